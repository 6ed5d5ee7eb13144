# make demo / make test create (or refresh) .venv and install the package with its dev extras.
PYTHON ?= python3
VENV   := .venv
PY     := $(VENV)/bin/python
STAMP  := $(VENV)/.installed

.PHONY: demo test info clean

$(PY):
	$(PYTHON) -m venv $(VENV)

$(STAMP): pyproject.toml | $(PY)
	$(PY) -m pip install --quiet --upgrade pip
	$(PY) -m pip install --quiet -e ".[dev]"
	touch $(STAMP)

demo: $(STAMP)
	$(PY) -m jax_seqpar demo

test: $(STAMP)
	$(PY) -m pytest -n 2 -q

info: $(STAMP)
	$(PY) -m jax_seqpar info

clean:
	rm -rf $(VENV) .pytest_cache
