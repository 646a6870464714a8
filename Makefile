# The two commands that matter on a fresh machine: `make demo` and `make test`.
SHELL := /bin/bash
PY := .venv/bin/python
TINY := models/tiny
export OMPI_ALLOW_RUN_AS_ROOT := 1
export OMPI_ALLOW_RUN_AS_ROOT_CONFIRM := 1

.PHONY: install demo test test-fast bench lint clean

install:
	@bash scripts/install.sh

$(TINY)/config.json: | install
	$(PY) -m scalarlm.cli make-tiny-model $(TINY)

demo: install $(TINY)/config.json
	$(PY) examples/demo.py --model $(TINY)
	$(PY) examples/rl_arithmetic.py --short --model $(TINY)

test: install
	$(PY) -m pytest -q --timeout=900 --durations=40 --junitxml=build/test-report.xml tests

test-fast: install
	$(PY) -m pytest -q -m "not slow and not slurm" tests

lint: install
	.venv/bin/lint-imports

bench: install $(TINY)/config.json
	@.venv/bin/python -c "import trl" 2>/dev/null || { .venv/bin/pip install -q -e ".[bench]" && \
	  .venv/bin/pip uninstall -y -q torchvision torchaudio torchcodec triton 2>/dev/null; true; }
	$(PY) -m bench.run

clean:
	rm -rf .scalarlm build models
