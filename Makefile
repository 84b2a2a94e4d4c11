# Set-up and entry points. Every target creates the virtual environment on first use and installs
# the CPU build of torch 2.13.0 before anything else, so nothing pulls a CUDA build.
PYTHON ?= python3
VENV ?= .venv
PY := $(VENV)/bin/python

.PHONY: demo test lint clean browser smoke-torch

$(VENV)/.installed: pyproject.toml
	$(PYTHON) -m venv $(VENV)
	$(PY) -m pip install --quiet torch==2.13.0
	$(PY) -m pip install --quiet -e '.[test,mcore]'  # mcore: the Megatron-Core tests run in CI, not skip
	$(PY) -m pip install --quiet --no-deps torchtitan==0.3.0 torchdata==0.11.0 torch_checkpointing==0.1.1 tyro==1.0.17 einops==0.8.2 spmd_types==0.2.3  # tests/titan: genuine torchtitan, without its heavy dependencies (triton: stubbed there)
	$(PY) -m pip install --quiet docstring-parser==0.18.0 typeguard==4.6.1  # tyro's small dependencies
	$(PY) -m pip install --quiet --no-deps --target $(VENV)/torchao-ref 'torchao==0.18.0'  # off the path: tests/torchao_ref.py
	touch $@

# the main job: tiny-moe trains on 2 ranks and checkpoints, then resumes on 3 ranks with the
# settings the checkpoint recorded; last, a run continues from a given step on 4 ranks, without a
# --ckpt-dir (it trains on and saves nothing)
DEMO_DIR ?= out/demo
TRAIN := --model tiny-moe --steps 60 --ckpt-dir $(DEMO_DIR) --log-every 5
demo: $(VENV)/.installed
	rm -rf $(DEMO_DIR)
	$(VENV)/bin/mfsdp-train --nproc-per-node 2 $(TRAIN) --save-every 10 --stop-at 30
	$(VENV)/bin/mfsdp-train --nproc-per-node 3 --ckpt-dir $(DEMO_DIR) --resume
	$(VENV)/bin/mfsdp-train --nproc-per-node 4 --resume $(DEMO_DIR)/step_000020 --stop-at 30 --log-every 10

# the linter and the formatter's check (ruff, configured in pyproject.toml); `make format` applies it;
# then the dead-code check: vulture (.ci/dead_code.py, names in __all__ not counted as used) at
# confidence 60, the level at which vulture reports unused functions, methods, classes and
# attributes at all (80 and up it reports only imports and unreachable code); what users or tests
# use although the package does not is listed in .vulture_whitelist.py
lint: $(VENV)/.installed
	$(VENV)/bin/ruff check .
	$(VENV)/bin/ruff format --check .
	$(PY) .ci/dead_code.py mfsdp_ckpt mfsdp_core cli .vulture_whitelist.py --min-confidence 60

format: $(VENV)/.installed
	$(VENV)/bin/ruff check --fix .
	$(VENV)/bin/ruff format .

# two pytest workers (pytest-xdist), each taking whole files so that a module's fixtures are built
# once; a one-worker run leaves much of the CPU idle (README, Tests, has the times)
TEST_WORKERS ?= 2
# the report tests render pages in a headless Chromium: installed here where apt-get can (as root)
browser:
	@command -v chromium >/dev/null || command -v google-chrome >/dev/null || \
	  (DEBIAN_FRONTEND=noninteractive apt-get install -y --no-install-recommends chromium >/dev/null 2>&1 || \
	   (apt-get update >/dev/null 2>&1 && DEBIAN_FRONTEND=noninteractive apt-get install -y --no-install-recommends chromium >/dev/null 2>&1)) || \
	  echo "note: no chromium and apt-get could not install it: the browser tests will be skipped"

test: $(VENV)/.installed browser
	$(PY) -m pytest -n $(TEST_WORKERS) --dist loadfile $(PYTEST_ARGS)

# the wheel as users install it, beside another torch than the suite's: built, installed into its own venv
# after torch $(SMOKE_TORCH) (which pip keeps), and run from outside the checkout (tests/packaging/wheel_smoke.py;
# torch 2.14.1 is a CUDA build of about 5.5 GB in the venv, taken from this machine's disk; it runs on the CPU)
SMOKE_TORCH ?= 2.14.1
smoke-torch: $(VENV)/.installed
	$(PY) tests/packaging/wheel_smoke.py --torch $(SMOKE_TORCH) --venv $(VENV)-torch$(SMOKE_TORCH)

clean:
	rm -rf $(VENV) $(VENV)-torch* .pytest_cache .hypothesis
