"""The package's top-level names resolve (they are imported lazily)."""

import ultraep


def test_every_exported_name_resolves():
    for name in ultraep.__all__:
        assert getattr(ultraep, name) is not None, name
