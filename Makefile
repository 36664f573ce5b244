# mrc-xdp: run as root on Debian 12.  `make demo` and `make test` set everything up first.
SHELL := /bin/bash
VENV  := .venv
PY    := $(VENV)/bin/python

.PHONY: setup fleet-setup k8s-image kmatrix-setup kmatrix vm-setup vm-box vm-test vm-up vm-down demo train-demo test bench evaluate clean

setup:
	bash scripts/setup.sh

demo: setup
	$(VENV)/bin/mrc-xdp demo

# a PyTorch DDP job over the "mrc" backend on the lab's 4 hosts while a T1 switch fails
train-demo: setup
	$(VENV)/bin/mrc-xdp demo --train

# the fleet tools' tests (tests/test_fleet.py): Prometheus and promtool extracted from Debian's package
fleet-setup: setup
	bash scripts/fleet-setup.sh

# the Kubernetes agent's image (tests/test_kubernetes.py, docs/fleet.md): podman, runc, catatonit and
# debootstrap from Debian, the base localhost/debian:bookworm (debootstrap, podman import)
# and localhost/mrc-xdp:dev from this checkout, cached in podman's store
# (/var/lib/containers/storage); from nothing ~3 min, after a change of the sources ~30 s
k8s-image: setup
	bash scripts/k8s-setup.sh

# the kernel matrix (tests/test_kernel_matrix.py) needs QEMU, virtme-ng and the kernels
kmatrix-setup: setup
	bash scripts/kmatrix-setup.sh

test: setup fleet-setup k8s-image kmatrix-setup vm-setup
	$(PY) -m pytest -ra tests

# the VM lab (vagrant/README.md): QEMU, debootstrap, Vagrant + vagrant-libvirt, guest kernel
vm-setup: setup
	bash scripts/vm-setup.sh

# guest image and Vagrant box mrc-xdp/lab (cached under /var/cache/mrc-xdp/vm)
vm-box: vm-setup
	$(VENV)/bin/mrc-xdp lab vm build-box

# the VM lab's tests: rendering + vagrant validate, a 4-VM QEMU scenario, a vagrant smoke test
vm-test: vm-setup
	$(PY) -m pytest -ra -s tests/test_lab_vm.py

# the full default topology on VMs (12 VMs; plain QEMU); vm-down removes it
vm-up: vm-setup
	$(VENV)/bin/mrc-xdp lab up --vm

vm-down:
	$(VENV)/bin/mrc-xdp lab down

# boot each kernel of the matrix under QEMU (TCG) and run the datapath sample in it
kmatrix: kmatrix-setup
	$(PY) -m pytest -ra tests/test_kernel_matrix.py

bench: setup
	$(PY) tools/bench_xdp.py

# the evaluation (tools/evaluate.py): experiment suite on the netns lab -> results/REPORT.md + plots
evaluate: setup
	$(PY) tools/evaluate.py --out results

clean:
	rm -rf $(VENV) .pytest_cache build dist *.egg-info
	find . -path ./.git -prune -o -type d -name __pycache__ -prune -exec rm -rf {} +
