# Two commands on a fresh machine:
#   make demo   set up .venv, race the synchronizers to a held-out target (sync x world_size x seed,
#               real, n <= 4), project the race to 64 workers on a virtual cluster, and draw both
#               under results/demo/<time>/analysis
#   make test   set up .venv, lint, build the manual (mkdocs --strict), run the test suite (what CI runs)
# make test-fast: the in-process unit tier and one end-to-end run (a few minutes).
# Figures: make figure PRESET=stragglers [ARGS="seed=0"]; make figures runs every preset;
# measured beside simulated: make figure PRESET=paper_models ANALYSIS_ARGS="--calibration docs/sim/calibration.json";
# simulated ones: make sim-figure PRESET=horovod (or scaling_sim).
PYTHON ?= python3
# torch==2.13.0 is a CPU build on the project's machines; CUDA users set TORCH_SPEC to their build.
TORCH_SPEC ?= torch==2.13.0
VENV := .venv
BIN := $(VENV)/bin
STAMP := $(VENV)/.installed

PRESETS := compare time_to_target scaling overlap buckets accumulation stragglers diminishing paper_models topology backup_workers balance critical_batch elastic backup_workers_at_scale staleness_at_scale delay_at_scale large_batch_at_scale time_to_target_projected time_to_target_at_scale
SIM_PRESETS := scaling_sim horovod topology_sim
RUN_DIR = results/$(PRESET)/$(shell date +%Y-%m-%d_%H-%M-%S)
# A sweep of real ranks keeps rank 0's output off the console; a virtual run has no ranks to echo.
QUIET = $(if $(shell grep -l "override /launcher: virtual" experiments/experiment/$(PRESET).yaml 2>/dev/null),,launcher.echo_rank0=false)

.PHONY: setup demo figure figures sim-figure lint docs test test-fast bench overhead clean

setup: $(STAMP)

$(STAMP): pyproject.toml
	$(PYTHON) -m venv $(VENV)
	$(BIN)/pip install --quiet "$(TORCH_SPEC)"
	$(BIN)/pip install --quiet -e '.[dev]'
	touch $(STAMP)

# The demo: a real sweep to a held-out target at n <= 4 and its projection to 64 workers on a
# virtual cluster of this machine's workers, analysed together.
demo: $(STAMP)
	$(eval DIR := results/demo/$(shell date +%Y-%m-%d_%H-%M-%S))
	$(BIN)/python -m testbed +experiment=time_to_target launcher.echo_rank0=false hydra.sweep.dir=$(DIR)/real $(ARGS)
	$(BIN)/python -m testbed +experiment=time_to_target_projected hydra.sweep.dir=$(DIR)/virtual $(ARGS)
	$(BIN)/python -m analysis $(DIR)/real $(DIR)/virtual --out $(DIR)/analysis

figure: $(STAMP)
	@test -n "$(PRESET)" || { echo "usage: make figure PRESET=<one of: $(PRESETS)> [ARGS=...]"; exit 2; }
	$(eval DIR := $(RUN_DIR))
	$(BIN)/python -m testbed +experiment=$(PRESET) $(QUIET) hydra.sweep.dir=$(DIR) $(ARGS)
	$(BIN)/python -m analysis $(DIR) --out $(DIR)/analysis $(ANALYSIS_ARGS)

sim-figure: $(STAMP)
	@test -n "$(PRESET)" || { echo "usage: make sim-figure PRESET=<one of: $(SIM_PRESETS)> [ARGS=...]"; exit 2; }
	$(eval DIR := $(RUN_DIR))
	$(BIN)/python -m testbed.sim +experiment=$(PRESET) hydra.sweep.dir=$(DIR) $(ARGS)
	$(BIN)/python -m analysis $(DIR) --out $(DIR)/analysis

figures: $(STAMP)
	for p in $(PRESETS); do $(MAKE) --no-print-directory figure PRESET=$$p ARGS="$(ARGS)" || exit 1; done

TEST_ENV := OMP_NUM_THREADS=1 WANDB_MODE=disabled
# The end-to-end run of test-fast: one Hydra sweep through the real CLI (ranks, collectives, the
# results contract of every job, the comparison table).
SMOKE := tests/test_results_contract.py

lint: $(STAMP)
	$(BIN)/ruff check

# The manual (docs/, mkdocs.yml) into a throwaway directory: --strict fails on a broken link, anchor or
# nav entry. mkdocs serve previews it.
docs: $(STAMP)
	out=$$(mktemp -d) && NO_MKDOCS_2_WARNING=1 $(BIN)/mkdocs build --strict -d $$out; rc=$$?; rm -rf $$out; exit $$rc

# Tests spend much of their time starting processes and waiting on sockets, so two run at once
# even on two cores (a test module stays on one worker: its shared runs are made once); tests
# that assert on measured time run after them, alone.
TEST_WORKERS ?= 2

test: lint docs
	$(TEST_ENV) $(BIN)/python -m pytest -q -n $(TEST_WORKERS) --dist loadfile -m "not serial" --durations=25
	$(TEST_ENV) $(BIN)/python -m pytest -q -m serial --durations=10

test-fast: lint
	$(TEST_ENV) $(BIN)/python -m pytest -q -m unit
	$(TEST_ENV) $(BIN)/python -m pytest -q $(SMOKE)

bench: $(STAMP)
	$(BIN)/python -m testbed.bench --world-sizes 2,4 --sizes 1M,16M,64M --out bench-results/collectives.json

overhead: $(STAMP)
	$(BIN)/python -m testbed.bench.overhead --steps 1000 --repeats 6

clean:
	rm -rf $(VENV) outputs multirun bench-results site
