# Two commands on a fresh machine:  make install && make train   ...and   make test
PY ?= .venv/bin/python
PIP ?= .venv/bin/pip

.PHONY: install train train-ddp test test-fast lint format bench rename clean help

help:  ## show the targets
	@grep -E '^[a-z-]+:.*##' $(MAKEFILE_LIST) | sed 's/:.*##/\t/'

.venv:
	python3 -m venv .venv
	$(PIP) install -q --upgrade pip

install: .venv  ## create .venv, install torch 2.14.1 / torchvision 0.29.1 and the package (editable, with test tools)
	$(PIP) install torch==2.14.1 torchvision==0.29.1
	$(PIP) install -e ".[dev]"

train:  ## train the default model on the embedded digits data (CPU, no network)
	$(PY) train.py

train-ddp:  ## the same with DDP: 2 processes on the CPU over gloo
	$(PY) train.py trainer=ddp_cpu

# The slow tests run on 2 workers, a test module to a worker (--dist loadscope: a module's shared runs are made once,
# and the SLURM tests share the 2-node cluster one at a time). Alone they kept 2 cores about 40% busy: much of a
# multi-process test is waiting (for a stall timeout, a signal, the SLURM scheduler, a rank's rendezvous).
test:  ## the whole suite: the fast tests as test-fast does, then the slow ones on 2 workers (about 19 minutes on 2 cores)
	$(PY) -m pytest -q -m "not slow" -n auto --durations=10; fast=$$?; \
	$(PY) -m pytest -q -m slow -n 2 --dist loadscope --durations=25; slow=$$?; \
	exit $$(( fast || slow ))

test-fast:  ## skip the slow tests; one pytest-xdist worker per core (about 3 minutes on 2 cores)
	$(PY) -m pytest -q -m "not slow" -n auto

lint:  ## ruff (lint + format check) and shellcheck on the scripts; .ci/run runs it
	.venv/bin/ruff check .
	.venv/bin/ruff format --check .
	.venv/bin/shellcheck scripts/*.sh scripts/*.sbatch .ci/run

format:  ## fix what ruff can fix, then format
	.venv/bin/ruff check --fix .
	.venv/bin/ruff format .

bench:  ## the template versus a hand-written loop (1 process, then 2 over gloo), each callback's own overhead, the garbage collector's schedule, GPT tokens/s
	$(PY) scripts/benchmark.py --batch-size 256 --per-callback
	$(PY) scripts/benchmark.py --batch-size 1024 --per-callback --lightning-costs --tty
	$(PY) scripts/benchmark.py --batch-size 4096
	$(PY) scripts/benchmark.py --batch-size 1024 --ddp
	$(PY) scripts/bench_callbacks.py --batch-size 256 --cycles 16
	$(PY) scripts/bench_callbacks.py --batch-size 1024 --cycles 16
	$(PY) scripts/bench_callbacks.py --batch-size 4096 --cycles 6
	$(PY) scripts/bench_callbacks.py --batch-size 1024 --cycles 8 --ddp
	$(PY) scripts/bench_callbacks.py --batch-size 1024 --totals --cycles 192
	$(PY) scripts/bench_callbacks.py --batch-size 256 --totals
	$(PY) scripts/bench_gc.py
	$(PY) scripts/bench_gc.py --ddp
	$(PY) scripts/bench_sync_check.py
	OMP_NUM_THREADS=1 $(PY) scripts/bench_profiling.py
	$(PY) scripts/bench_hang_doctor.py
	$(PY) scripts/bench_cold_hooks.py
	$(PY) scripts/bench_gpt.py --rounds 3 --steps 300

rename:  ## make the template your own project: make rename NAME=my_project
	@test -n "$(NAME)" || { echo "error: NAME is required: make rename NAME=my_project"; exit 2; }
	$(PY) scripts/rename.py $(NAME)

clean:  ## remove run outputs
	rm -rf logs/ outputs/ multirun/ .pytest_cache
