PY ?= python

.PHONY: test test-gpu demo lint typecheck bench bench-quick docs

# The README's test command. Under no GPU the Triton kernels run in the interpreter (tests/conftest.py sets
# TRITON_INTERPRET=1 when CUDA is absent); on a GPU they compile and the gpu-marked tests run too.
test:
	$(PY) -m pytest -q

test-gpu:
	$(PY) -m pytest -q -m gpu

demo:
	$(PY) -m tripwire demo

lint:
	$(PY) -m ruff check src tests benchmarks scripts examples
	$(PY) -m ruff format --check src tests benchmarks scripts examples
	$(PY) -m mypy

typecheck:
	$(PY) -m mypy

bench:
	$(PY) -m tripwire bench

bench-quick:
	$(PY) -m tripwire bench --quick

# The documentation site (the docs extra): every warning, broken link or missing anchor is an error.
docs:
	NO_MKDOCS_2_WARNING=1 $(PY) -m mkdocs build --strict
