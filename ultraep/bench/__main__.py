"""Entry point of ``python -m ultraep.bench``."""

import sys

from ultraep.bench import main

sys.exit(main())
