# mrc-xdp: run as root on Debian 12.  `make demo` and `make test` set everything up first.
SHELL := /bin/bash
VENV  := .venv
PY    := $(VENV)/bin/python

.PHONY: setup kmatrix-setup kmatrix demo test bench clean

setup:
	bash scripts/setup.sh

demo: setup
	$(VENV)/bin/mrc-xdp demo

# the kernel matrix (tests/test_kernel_matrix.py) needs QEMU, virtme-ng and the kernels
kmatrix-setup: setup
	bash scripts/kmatrix-setup.sh

test: setup kmatrix-setup
	$(PY) -m pytest -ra tests

# boot each kernel of the matrix under QEMU (TCG) and run the datapath sample in it
kmatrix: kmatrix-setup
	$(PY) -m pytest -ra tests/test_kernel_matrix.py

bench: setup
	$(PY) tools/bench_xdp.py

clean:
	rm -rf $(VENV) .pytest_cache build dist *.egg-info
	find . -path ./.git -prune -o -type d -name __pycache__ -prune -exec rm -rf {} +
