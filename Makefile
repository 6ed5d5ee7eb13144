# make demo / make test create (or refresh) a virtual environment, install the package with
# its dev extras and run the demo or the test suite.
#
# The environment has the Python and the JAX that the GPU machines run: Python 3.12 (else
# the newest >= 3.12; scripts/find_python.sh) and JAX from constraints/jax-gpu.txt.  With no
# Python >= 3.12 here it falls back to python3 and the oldest supported JAX
# (constraints/jax-oldest.txt), saying so.  Override any of these:
#   make test PYTHON=python3.13 VENV=.venv-313 CONSTRAINTS=        (newest JAX pip resolves)
#   make test PYTEST_ARGS="-x tests/test_attention.py"
ifeq ($(origin PYTHON),undefined)
PYTHON      := $(shell sh scripts/find_python.sh)
endif
VENV        ?= .venv
PY          := $(VENV)/bin/python
STAMP       := $(VENV)/.installed
OLD_PYTHON  := $(shell $(PYTHON) -c 'import sys; print(int(sys.version_info < (3, 12)))')
CONSTRAINTS ?= $(if $(filter 1,$(OLD_PYTHON)),constraints/jax-oldest.txt,constraints/jax-gpu.txt)
PYTEST_ARGS ?=

.PHONY: demo test info clean

$(PY):
	$(PYTHON) -m venv $(VENV)

$(STAMP): pyproject.toml $(CONSTRAINTS) | $(PY)
	@if [ "$(OLD_PYTHON)" = 1 ] && [ "$(CONSTRAINTS)" = constraints/jax-oldest.txt ]; then \
	  echo "make: $(PYTHON) is older than 3.12: installing the oldest supported JAX" \
	       "($(CONSTRAINTS)), not the GPU machines' 0.11.2"; fi
	$(PY) -m pip install --quiet --upgrade pip
	$(PY) -m pip install --quiet $(if $(CONSTRAINTS),-c $(CONSTRAINTS)) -e ".[dev]"
	$(PY) -c 'import sys, jax; print(f"make: {sys.executable}: Python {sys.version.split()[0]}, JAX {jax.__version__}")'
	touch $(STAMP)

demo: $(STAMP)
	$(PY) -m jax_seqpar demo

# --dist worksteal: a worker that runs out of tests takes some queued for the other one, so
# neither sits idle at the end (with the default 'load', one waited ~10 s; 2026-11-25)
test: $(STAMP)
	$(PY) -m pytest -n 2 --dist worksteal -q $(PYTEST_ARGS)

info: $(STAMP)
	$(PY) -m jax_seqpar info

clean:
	rm -rf $(VENV) .pytest_cache
