# mrc-xdp: run as root on Debian 12.  `make demo` and `make test` set everything up first.
SHELL := /bin/bash
VENV  := .venv
PY    := $(VENV)/bin/python

.PHONY: setup demo test bench clean

setup:
	bash scripts/setup.sh

demo: setup
	$(VENV)/bin/mrc-xdp demo

test: setup
	$(PY) -m pytest -ra tests

bench: setup
	$(PY) tools/bench_xdp.py

clean:
	rm -rf $(VENV) .pytest_cache build dist *.egg-info
	find . -path ./.git -prune -o -type d -name __pycache__ -prune -exec rm -rf {} +
