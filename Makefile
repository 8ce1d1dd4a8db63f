# The two commands of the README. Both set up .venv first when it is missing.
SHELL := /bin/bash
VENV := .venv/bin
export PATH := $(CURDIR)/$(VENV):$(PATH)

.PHONY: env demo test lint

env:
	@scripts/setup-env

## demo: the whole pipeline on the embedded demo config, on this machine
demo: env
	snakemake --profile profiles/local

## test: the test suite (CI runs exactly this)
test:
	@scripts/setup-env --tests
	python -m pytest -n 3 --dist loadfile --no-loadscope-reorder -ra --durations=20 tests

## lint: ruff, snakefmt and snakemake --lint (also run inside the test suite)
lint: env
	ruff check . && ruff format --check . && snakefmt --check Snakefile workflow && snakemake --lint -n
