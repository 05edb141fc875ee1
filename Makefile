# The two set-up commands of the README. Each creates or reuses .venv and installs what it needs.
VENV ?= .venv
PY := $(VENV)/bin/python
RAYLM := $(VENV)/bin/raylm
DEMO_DATA := runs/data/stdlib-byte-256

.PHONY: demo test

# On a machine without an NVIDIA driver, install the CPU build of torch first so that pip
# never pulls the multi-GB CUDA wheels; with a driver, pip resolves torch>=2.6 as usual.
$(VENV)/.installed: pyproject.toml
	test -x $(PY) || python3 -m venv $(VENV)
	$(PY) -m pip install -q --upgrade pip
	command -v nvidia-smi >/dev/null 2>&1 || $(PY) -m pip install -q torch==2.13.0
	$(PY) -m pip install -q -e ".[test]"
	touch $@

# Prepare the built-in corpus (this Python's standard library sources), train a small GPT on
# a local Ray cluster, then sample from it.
demo: $(VENV)/.installed
	test -f $(DEMO_DATA)/manifest.json || $(RAYLM) prepare --output $(DEMO_DATA) --seq-len 256
	$(RAYLM) train configs/demo-cpu.yaml data.path=$(DEMO_DATA)
	$(RAYLM) generate --checkpoint runs/demo --prompt "def " --max-new-tokens 300 --seed 0

test: $(VENV)/.installed
	OMP_NUM_THREADS=1 $(VENV)/bin/pytest -q -ra --durations=40
