# Two commands on a fresh machine:
#   make demo   set up .venv, run the comparison sweep (sync x world_size), print the table
#   make test   set up .venv, run the test suite (what CI runs)
PYTHON ?= python3
# torch==2.13.0 is a CPU build on the project's machines; CUDA users set TORCH_SPEC to their build.
TORCH_SPEC ?= torch==2.13.0
VENV := .venv
BIN := $(VENV)/bin
STAMP := $(VENV)/.installed

.PHONY: setup demo test bench overhead clean

setup: $(STAMP)

$(STAMP): pyproject.toml
	$(PYTHON) -m venv $(VENV)
	$(BIN)/pip install --quiet "$(TORCH_SPEC)"
	$(BIN)/pip install --quiet -e '.[dev]'
	touch $(STAMP)

demo: $(STAMP)
	$(BIN)/python -m testbed +experiment=compare launcher.echo_rank0=false

test: $(STAMP)
	OMP_NUM_THREADS=1 WANDB_MODE=disabled $(BIN)/python -m pytest -q

bench: $(STAMP)
	$(BIN)/python -m testbed.bench --world-sizes 2,4 --sizes 1M,16M,64M --out bench-results/collectives.json

overhead: $(STAMP)
	$(BIN)/python -m testbed.bench.overhead --steps 1000 --repeats 6

clean:
	rm -rf $(VENV) outputs multirun bench-results
