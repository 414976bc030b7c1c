# Two commands do all the set-up on a fresh machine with Python:
#   make demo   # the default job on the built-in GPT
#   make test   # the whole test suite
# TORCH overrides the torch requirement (default: the CPU build of 2.13.0), e.g.
#   make test TORCH='torch==2.5.1'
# On a machine with a GPU (and a CUDA build of torch through TORCH where the default is not one):
#   make device-check OUT=device-check   # DEVICE=cuda (default), SIZE=full (default) or small
#   make device-check-system OUT=DIR     # the same with $(PYTHON) as it is (torch with CUDA installed,
#                                        # nothing fetched: a machine that reaches no package index)
PYTHON ?= python3
TORCH ?= torch==2.13.0
DEVICE ?= cuda
SIZE ?= full
OUT ?= device-check
VENV := .venv
BIN := $(VENV)/bin
STAMP := $(VENV)/.installed

.PHONY: demo test setup clean bench device-check device-check-system

$(STAMP): pyproject.toml Makefile
	$(PYTHON) -m venv $(VENV)
	$(BIN)/python -m pip install -q --upgrade pip
	$(BIN)/python -m pip install -q "$(TORCH)"
	$(BIN)/python -m pip install -q -e ".[hf,dev]" "$(TORCH)"
	touch $(STAMP)

setup: $(STAMP)

demo: $(STAMP)
	$(BIN)/remat demo

test: $(STAMP)
	OMP_NUM_THREADS=1 $(BIN)/python -m pytest -n 2 -q

bench: $(STAMP)
	$(BIN)/python -m benchmarks.peers --model gpt

device-check: $(STAMP)
	$(BIN)/python -m benchmarks.device_check --device $(DEVICE) --size $(SIZE) --out $(OUT)

device-check-system:
	PYTHONPATH=src $(PYTHON) -m benchmarks.device_check --device $(DEVICE) --size $(SIZE) --out $(OUT)

clean:
	rm -rf $(VENV) build *.egg-info src/*.egg-info
