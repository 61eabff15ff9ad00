# epx: the everyday commands.
#
#   make run     set up, build the epx binary (Release, build/) and train the tiny MoE model (`epx train`)
#   make demo    build, then `epx demo` (one dispatch + combine, shown and checked)
#   make test    set up, then: Release build + ctest; ASan/UBSan build + ctest;
#                install into a scratch prefix and build examples/consumer against it;
#                every fuzz target for 60 s
#   make build   set up and build (Release, build/), the Python module included
#   make venv    set up, then `pip install .` into .venv (made from Debian's python3
#                with --system-site-packages): `.venv/bin/python -c "import epx.torch"`
#   make bench   build, then `epx bench exchange`
#   make test-tsan  ThreadSanitizer build + the in-process tests (not in `make test`)
#   make fuzz    clang build of the libFuzzer targets (build-fuzz/), each run FUZZ_SECONDS (60)
#   make clean   remove every build folder
#
# JOBS, BUILD_DIR, ASAN_DIR, INSTALL_CHECK_DIR, CTEST_TIMEOUT, FUZZ_DIR,
# FUZZ_SECONDS and FUZZ_JOBS can be set on the command line, e.g. `make test JOBS=8`.

SHELL := /bin/bash
.SHELLFLAGS := -euo pipefail -c
.NOTPARALLEL:
.DEFAULT_GOAL := run

JOBS ?= 2
BUILD_DIR ?= build
ASAN_DIR ?= build-asan
INSTALL_CHECK_DIR ?= build-install
CTEST_TIMEOUT ?= 600
# The sanitizer build keeps line tables only (-g1): enough for the stack
# traces of a report, and much quicker to compile and link than -g.
ASAN_OPT_FLAGS ?= -O2 -g1 -DNDEBUG
CMAKE ?= cmake
CTEST ?= ctest

# The epx binary: $(BUILD_DIR)/apps/epx/epx, or $(BUILD_DIR)/bin/epx where
# apps/epx sets its RUNTIME_OUTPUT_DIRECTORY there. Used as `$(call epx,ARGS)`.
epx = @bin=$(BUILD_DIR)/apps/epx/epx; [[ -x $$bin ]] || bin=$(BUILD_DIR)/bin/epx; echo "$$bin $(1)"; "$$bin" $(1)
CTEST_FLAGS := --output-on-failure -j$(JOBS) --timeout $(CTEST_TIMEOUT) --no-tests=error
INSTALL_PREFIX := $(abspath $(INSTALL_CHECK_DIR))/prefix
CONSUMER_BUILD := $(INSTALL_CHECK_DIR)/consumer

section = @printf '\n==== %s ====\n' $(1)

# ccache, where installed (scripts/setup.sh installs it): sources compiled
# before, in this or any other clone of the repository (paths are taken
# relative to it), are cache hits. EPX_CCACHE=0 turns it off.
EPX_CCACHE ?= 1
ifeq ($(EPX_CCACHE)$(if $(shell command -v ccache 2>/dev/null),yes,no),1yes)
LAUNCHER := -DCMAKE_C_COMPILER_LAUNCHER=ccache -DCMAKE_CXX_COMPILER_LAUNCHER=ccache -DCMAKE_CUDA_COMPILER_LAUNCHER=ccache
export CCACHE_BASEDIR := $(CURDIR)
export CCACHE_NOHASHDIR := 1
else
LAUNCHER := -UCMAKE_C_COMPILER_LAUNCHER -UCMAKE_CXX_COMPILER_LAUNCHER -UCMAKE_CUDA_COMPILER_LAUNCHER
endif

.PHONY: venv run demo test build build-app bench clean setup configure test-readme test-release test-asan test-install test-tsan fuzz test-fuzz

setup:
	@bash scripts/setup.sh

configure: setup
	$(call section,"configure Release ($(BUILD_DIR))")
	$(CMAKE) -S . -B $(BUILD_DIR) -DCMAKE_BUILD_TYPE=Release $(LAUNCHER)

build: configure
	$(call section,"build Release ($(BUILD_DIR))")
	$(CMAKE) --build $(BUILD_DIR) -j$(JOBS)

# `make run` builds the epx binary only (not the tests and benchmarks), so a
# first run compiles about a third of what `make build` does.
build-app: configure
	$(call section,"build the epx binary ($(BUILD_DIR))")
	$(CMAKE) --build $(BUILD_DIR) -j$(JOBS) --target epx_app

run: build-app
	$(call section,"epx train --config configs/train-tiny.toml")
	$(call epx,train --config configs/train-tiny.toml --metrics $(BUILD_DIR)/train-metrics.jsonl)

demo: build-app
	$(call section,"epx demo")
	$(call epx,demo)

# The pip route (pyproject.toml, python/build_backend/): the module is built for
# .venv's interpreter in build-pip/, with the packages Debian installed.
VENV ?= .venv
venv: setup
	$(call section,"pip install . into $(VENV)")
	[[ -x $(VENV)/bin/pip ]] || /usr/bin/python3 -m venv --system-site-packages $(VENV)
	EPX_JOBS=$(JOBS) $(VENV)/bin/pip install --no-build-isolation --no-deps --no-index .

bench: build-app
	$(call section,"epx bench exchange")
	$(call epx,bench exchange)

test-release: build
	$(call section,"ctest Release ($(BUILD_DIR))")
	$(CTEST) --test-dir $(BUILD_DIR) $(CTEST_FLAGS)

test-asan: setup
	$(call section,"configure ASan+UBSan ($(ASAN_DIR))")
	$(CMAKE) -S . -B $(ASAN_DIR) $(LAUNCHER) -DEPX_SANITIZE=ON -DCMAKE_BUILD_TYPE=RelWithDebInfo -DEPX_BUILD_BENCH=OFF \
	  -DCMAKE_CXX_FLAGS_RELWITHDEBINFO="$(ASAN_OPT_FLAGS)"
	$(call section,"build ASan+UBSan ($(ASAN_DIR))")
	$(CMAKE) --build $(ASAN_DIR) -j$(JOBS)
	$(call section,"ctest ASan+UBSan ($(ASAN_DIR))")
	UBSAN_OPTIONS=print_stacktrace=1:halt_on_error=1 $(CTEST) --test-dir $(ASAN_DIR) $(CTEST_FLAGS)

# ThreadSanitizer (not part of `make test`: another full build): the
# in-process tests, where ranks are threads. MPI, Slurm and two-host tests are
# left out (Open MPI's own threads are not instrumented), and so are races
# seen through libgomp, which is not instrumented either (tests/tsan.supp).
TSAN_DIR ?= build-tsan
test-tsan: setup
	$(call section,"configure ThreadSanitizer ($(TSAN_DIR))")
	$(CMAKE) -S . -B $(TSAN_DIR) $(LAUNCHER) -DCMAKE_BUILD_TYPE=RelWithDebInfo -DEPX_BUILD_BENCH=OFF -DEPX_WITH_CUDA=OFF \
	  -DEPX_WITH_MPI=OFF -DCMAKE_CXX_FLAGS="-fsanitize=thread" -DCMAKE_CXX_FLAGS_RELWITHDEBINFO="$(ASAN_OPT_FLAGS)"
	$(call section,"build ThreadSanitizer ($(TSAN_DIR))")
	$(CMAKE) --build $(TSAN_DIR) -j$(JOBS)
	$(call section,"ctest ThreadSanitizer ($(TSAN_DIR))")
	TSAN_OPTIONS=halt_on_error=1:second_deadlock_stack=1:suppressions=$(abspath tests/tsan.supp) \
	  $(CTEST) --test-dir $(TSAN_DIR) $(CTEST_FLAGS) \
	  --label-exclude 'mpi|two_hosts|slurm'

# libFuzzer (clang only): the readers of the command's input files, each fuzzed
# for FUZZ_SECONDS from its seed corpus fuzz/corpus/NAME/ after replaying
# fuzz/regressions/NAME/; FUZZ_JOBS targets at a time. Fails on any crash,
# leak, hang or runaway allocation, naming the reproducer (scripts/fuzz.sh).
# Only the libraries the targets link are built; -O1 -g1 like the ASan build.
FUZZ_DIR ?= build-fuzz
FUZZ_SECONDS ?= 60
FUZZ_JOBS ?= 2
fuzz: setup
	$(call section,"configure libFuzzer ($(FUZZ_DIR))")
	CC=clang CXX=clang++ $(CMAKE) -S . -B $(FUZZ_DIR) $(LAUNCHER) -DEPX_BUILD_FUZZ=ON -DCMAKE_BUILD_TYPE=RelWithDebInfo \
	  -DCMAKE_CXX_FLAGS_RELWITHDEBINFO="-O1 -g1" -DEPX_WITH_CUDA=OFF -DEPX_WITH_MPI=OFF \
	  -DEPX_BUILD_TESTS=OFF -DEPX_BUILD_BENCH=OFF -DEPX_BUILD_APPS=OFF
	$(call section,"build libFuzzer targets ($(FUZZ_DIR))")
	$(CMAKE) --build $(FUZZ_DIR) -j$(JOBS) --target epx_fuzz
	$(call section,"fuzz: $(FUZZ_SECONDS) s per target")
	bash scripts/fuzz.sh $(FUZZ_DIR) $(FUZZ_SECONDS) $(FUZZ_JOBS)

# Installs the Release build into a fresh prefix and builds the standalone
# examples/consumer project against it, as a user of the package would.
test-install: build
	$(call section,"install check: cmake --install into $(INSTALL_PREFIX)")
	rm -rf $(INSTALL_CHECK_DIR)
	$(CMAKE) --install $(BUILD_DIR) --prefix $(INSTALL_PREFIX)
	$(call section,"install check: build examples/consumer against the installed epx")
	$(CMAKE) -S examples/consumer -B $(CONSUMER_BUILD) -DCMAKE_BUILD_TYPE=Release \
	  -DCMAKE_PREFIX_PATH=$(INSTALL_PREFIX) -DCMAKE_FIND_USE_PACKAGE_REGISTRY=OFF
	$(CMAKE) --build $(CONSUMER_BUILD) -j$(JOBS)
	$(call section,"install check: run the consumer")
	$(CONSUMER_BUILD)/epx_consumer
	@if [[ -x $(CONSUMER_BUILD)/epx_consumer_cuda ]]; then echo "$(CONSUMER_BUILD)/epx_consumer_cuda"; \
	  $(CONSUMER_BUILD)/epx_consumer_cuda; else echo "(epx was built without CUDA: no epx_consumer_cuda)"; fi
	@pkgs=$$(ls -d $(INSTALL_PREFIX)/lib/python3*/dist-packages 2>/dev/null | head -1); \
	  if [[ -n "$$pkgs" ]]; then echo "import epx from $$pkgs"; \
	  cd /tmp && PYTHONPATH=$$pkgs /usr/bin/python3 -c "import epx, sys; assert epx.__file__.startswith('$$pkgs'); print(epx.__file__)"; \
	  else echo "(epx was built without the Python module)"; fi

# The C++ example in README.md must be examples/consumer/main.cc verbatim (the Python
# ones are checked by the ctest python.test_readme, which also runs them).
test-readme:
	$(call section,"README example == examples/consumer/main.cc")
	awk '/<!-- examples\/consumer\/main.cc -->/{m=1;next} m==1&&/^```cpp/{m=2;next} m==2&&/^```$$/{exit} m==2' README.md \
	  | diff -u examples/consumer/main.cc - && echo "identical"

# In `make test` every fuzz target runs its 60 s at once (TEST_FUZZ_JOBS), each
# on a share of the cores: a smoke test of the readers, about a minute of wall
# time; long fuzzing is `make fuzz FUZZ_SECONDS=...`.
TEST_FUZZ_JOBS ?= 6
test-fuzz:
	$(MAKE) --no-print-directory fuzz FUZZ_JOBS=$(TEST_FUZZ_JOBS)

test: test-readme test-release test-asan test-install test-fuzz
	$(call section,"make test: all passed")

clean:
	rm -rf $(BUILD_DIR) $(ASAN_DIR) $(TSAN_DIR) $(INSTALL_CHECK_DIR) $(FUZZ_DIR) build-pip build-pip-test
