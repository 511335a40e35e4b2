# The two commands of the README: `make demo` and `make test`. Both set everything up first.
.PHONY: setup demo test lint bench

setup:
	./scripts/setup.sh

demo: setup
	.venv/bin/prefixcache serve --demo

test: setup
	.venv/bin/python -m pytest -q

bench: setup
	.venv/bin/python benchmarks/kv_cache.py
	.venv/bin/python benchmarks/model_runner.py
