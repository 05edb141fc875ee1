# The two set-up commands of the README. Each creates or reuses .venv and installs what it needs.
VENV ?= .venv
PY := $(VENV)/bin/python
RAYLM := $(VENV)/bin/raylm
DEMO_TOKENIZER := runs/data/stdlib-bpe-2048.json
DEMO_DATA := runs/data/stdlib-bpe-2048-128
DEMO_RUN := runs/demo

.PHONY: demo test

# On a machine without an NVIDIA driver, install the CPU build of torch first so that pip
# never pulls the multi-GB CUDA wheels; with a driver, pip resolves torch>=2.6 as usual.
$(VENV)/.installed: pyproject.toml
	test -x $(PY) || python3 -m venv $(VENV)
	$(PY) -m pip install -q --upgrade pip
	command -v nvidia-smi >/dev/null 2>&1 || $(PY) -m pip install -q torch==2.13.0
	$(PY) -m pip install -q -e ".[test]"
	touch $@

# Train a BPE tokenizer on the built-in corpus (this Python's standard library sources), prepare
# the corpus with it, train a small GPT on a local Ray cluster, draw its report, sample from it and
# say where everything is. BPE, not bytes: its tokens are pieces of words, so 600 steps of the demo
# model end in text that reads as Python (val loss 3.52 a token, 1.12 nats a byte: 2.13 a byte
# after 300 byte-level steps gave no words yet). Measured on 2 idle cores without runs/: the whole
# target 165 s (9.8 minutes on 2 cores shared with other work, load 15-30, before rows one by one).
demo: $(VENV)/.installed
	test -f $(DEMO_TOKENIZER) || $(RAYLM) tokenizer train --vocab-size 2048 --output $(DEMO_TOKENIZER)
	test -f $(DEMO_DATA)/manifest.json || $(RAYLM) prepare --tokenizer $(DEMO_TOKENIZER) --output $(DEMO_DATA) --seq-len 128
	$(RAYLM) train configs/demo-cpu.yaml data.path=$(DEMO_DATA) train.steps=600
	$(RAYLM) report $(DEMO_RUN)
	@echo; echo "Sampled from the last checkpoint:"; echo
	@$(RAYLM) generate --checkpoint $(DEMO_RUN) --prompt "def __init__(self" --max-new-tokens 120 \
		--temperature 0.4 --top-k 20 --seed 0
	@echo; echo "The run:         $(DEMO_RUN) (raylm status $(DEMO_RUN); its console: $(DEMO_RUN)/console.log)"
	@echo "Its report:      $(DEMO_RUN)/report/report.html"
	@echo "Its checkpoints: $$(ls -d $(DEMO_RUN)/checkpoint_* | tr '\n' ' ')"

# The checkout's bytecode first: with PYTHONDONTWRITEBYTECODE set (this machine's environment has it)
# Python never caches what it compiles, and each of the suite's hundreds of processes (Ray workers,
# drivers, gloo ranks) compiled raylm again: 0.4 s of CPU each for a Ray Train worker's imports.
test: $(VENV)/.installed
	$(PY) -m compileall -q raylm cluster jobs tests benchmarks >/dev/null
	OMP_NUM_THREADS=1 $(VENV)/bin/pytest -q -ra --durations=40 -n 2 --dist loadscope
