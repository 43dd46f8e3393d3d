# Developer shortcuts; CI runs .ci/run. `make help` lists the targets.
PY ?= python3
ARGS ?=

.PHONY: help build test test-all lint fix bench-kernel bench-e2e

help:
	@echo "build        build the C++ extension and install hetmoe editable (no network: no build isolation)"
	@echo "test         the per-commit test tier (what CI runs)"
	@echo "test-all     every tier: slow tests too (HETMOE_TEST_ALL=1); GPU tests run where torch sees CUDA"
	@echo "lint         ruff + clang-format checks (tools/lint.sh)"
	@echo "fix          apply ruff's fixes and clang-format in place"
	@echo "bench-kernel hetmoe bench kernel on this CPU (extra options: ARGS=\"--quick --json out.json\")"
	@echo "bench-e2e    hetmoe bench e2e on this machine (e.g. ARGS=--quick)"
	@echo "Cap the engine to a smaller CPU with HETMOE_MAX_ISA=avx2 (or avx512, scalar), e.g. HETMOE_MAX_ISA=avx2 make test"

build:
	$(PY) -m pip install --no-build-isolation --no-deps -e .

test:
	$(PY) -m pytest -q --durations=15 tests

test-all:
	HETMOE_TEST_ALL=1 $(PY) -m pytest -q --durations=15 tests

lint:
	bash tools/lint.sh

fix:
	ruff check --fix .
	clang-format -i $$(git ls-files 'csrc/*.cpp' 'csrc/*.h' 'bench/device/*.cpp')

bench-kernel:
	$(PY) -m hetmoe bench kernel $(ARGS)

bench-e2e:
	$(PY) -m hetmoe bench e2e $(ARGS)
