# Set-up and test targets. `make test` is the README's test command and what CI runs: ruff, mypy, pytest.
PYTHON ?= python3
VENV ?= .venv
PY := $(VENV)/bin/python

$(PY):
	$(PYTHON) -m venv $(VENV)
	# The pinned CPU torch first: an unpinned torch requirement would pull a multi-GB CUDA build.
	$(PY) -m pip install -q torch==2.13.0
	$(PY) -m pip install -q -e '.[test]'
	# litgpt (Lightning's LLM library) for the traced-trunk tests, without its dependencies: its pins
	# (huggingface-hub<1.4) would downgrade transformers below the test extra's range. Importing its model
	# code needs torch, lightning, safetensors and psutil, which the lines above install (the last two come
	# with transformers and peft).
	$(PY) -m pip install -q --no-deps litgpt==0.5.13

.PHONY: install test
install: $(PY)

# static checks first (seconds), then every test, on every core with pytest-xdist (at most 4 workers, for memory),
# a test file to a worker so that its processes start once; the 15 slowest tests are printed
test: $(PY)
	$(VENV)/bin/ruff check .
	$(VENV)/bin/mypy
	$(PY) -m pytest -q -n auto --maxprocesses 4 --dist loadfile --no-loadscope-reorder --durations=15

.PHONY: train demo
train: $(PY)  # the main job: Hydra app, embedded default (a small GPT on the Python standard library)
	$(PY) examples/train.py

demo: $(PY)  # the engine alone, without Lightning
	$(PY) examples/engine_demo.py
