# Both targets work from a fresh clone: they create .venv and install what they need.
PYTHON ?= python3
VENV   := .venv
PY     := $(VENV)/bin/python
# The CPU build of torch; a bare `torch` requirement would pull a multi-GB CUDA build.
TORCH  ?= torch==2.13.0

.PHONY: demo test clean

$(VENV)/.installed: pyproject.toml
	$(PYTHON) -m venv $(VENV)
	$(PY) -m pip install -q --upgrade pip
	$(PY) -m pip install -q "$(TORCH)"
	$(PY) -m pip install -q -e ".[test]"
	touch $@

demo: $(VENV)/.installed
	$(PY) -m fast_start.demo

test: $(VENV)/.installed
	$(PY) -m pytest -q

clean:
	rm -rf $(VENV) .pytest_cache
