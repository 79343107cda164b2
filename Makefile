# Two entry points that work on a fresh machine: `make demo` and `make test`.
PYTHON ?= python3
VENV := .venv
PY := $(VENV)/bin/python
STAMP := $(VENV)/.installed

.PHONY: demo lint test venv gpu-check clean

$(STAMP): setup.cfg pyproject.toml
	$(PYTHON) -m venv $(VENV)
	$(PY) -m pip install -q --upgrade pip
	$(PY) -m pip install -q -e .[test]
	touch $(STAMP)

venv: $(STAMP)

# The planning policies on a trace, then one balanced MoE layer on 4 CPU ranks (out/demo_layer.png).
demo: $(STAMP)
	$(PY) -m ultraep.bench plan --demo
	$(VENV)/bin/mpiexec -n 4 $(PY) -m mpi4py examples/balanced_layer.py --out out/demo_layer.png

lint: $(STAMP)
	$(VENV)/bin/ruff check .

# pytest's exit code 5 (no test collected) must fail, never pass.
test: lint
	$(PY) -m pytest -q; rc=$$?; \
	if [ $$rc -eq 5 ]; then echo "make test: pytest collected no tests" >&2; exit 1; fi; \
	exit $$rc

# On the lent GPU machine: uses the machine's own Python packages (nothing can be
# installed there), runs every GPU test and benchmark, writes results to $$OUT.
gpu-check:
	bash scripts/gpu_check.sh

clean:
	rm -rf $(VENV) build dist *.egg-info .pytest_cache .ruff_cache
