#!/usr/bin/env bash
# Set up the VM lab (mrc_xdp/lab/vm.py, vagrant/, tests/test_lab_vm.py), as root: QEMU,
# debootstrap and the image tools, and Vagrant with vagrant-libvirt and libvirt, all
# from Debian's packages (~1 min once), plus the guest kernel (tools/kmatrix.py's cache).
# Nothing is started here: `mrc-xdp lab up --target vagrant` starts libvirtd/virtlogd
# itself when they do not run (no systemd needed) and `lab down` stops what it started.
# Idempotent: when everything is there it only checks.  `make vm-setup` runs it.
set -euo pipefail
cd "$(dirname "${BASH_SOURCE[0]}")/.."
LOG=/var/log/mrc-xdp-vm-setup.log
say() { printf 'vm-setup: %s\n' "$*"; }
die() { printf 'vm-setup: error: %s\n' "$*" >&2; exit 1; }
[ "$(id -u)" -eq 0 ] || die "must run as root (e.g. sudo make vm-setup)"

APT_PKGS=(qemu-system-x86 qemu-utils debootstrap e2fsprogs openssh-client git   # image, QEMU runner
          vagrant vagrant-libvirt libvirt-daemon-system libvirt-clients          # Vagrant runner
          dnsmasq-base ebtables iptables)
. scripts/lib.sh
apt_ensure "$LOG" "${APT_PKGS[@]}"
# the guest kernel (Debian's 7.x: its verifier accepts the datapath), cached and shared
# with the kernel matrix
.venv/bin/python tools/kmatrix.py fetch "${MRC_VM_KERNEL:-7}" >/dev/null \
    || die "could not fetch the guest kernel (tools/kmatrix.py fetch ${MRC_VM_KERNEL:-7})"
say "ready: \`make vm-box\` builds the guest image and box (cached), \`make vm-test\` runs the VM tests"
