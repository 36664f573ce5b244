#!/usr/bin/env bash
# Set up the kernel matrix (tests/test_kernel_matrix.py, tools/kmatrix.py), as root:
# QEMU, kmod and a static busybox from Debian, virtme-ng from PyPI in its own venv
# (/var/cache/mrc-xdp/vng), and the Debian kernels of the matrix, downloaded and
# unpacked once into /var/cache/mrc-xdp/kernels (no network needed after that).
# Idempotent: when everything is there it only checks (well under a second).
# `make kmatrix-setup` runs it; `make test` too.
set -euo pipefail
t0=$(date +%s%N)
cd "$(dirname "${BASH_SOURCE[0]}")/.."
ROOT=$PWD
VNG_VENV=/var/cache/mrc-xdp/vng
VNG_VERSION=1.42
LOG=/var/log/mrc-xdp-kmatrix-setup.log

say() { printf 'kmatrix-setup: %s\n' "$*"; }
die() { printf 'kmatrix-setup: error: %s\n' "$*" >&2; exit 1; }
. scripts/lib.sh
[ "$(id -u)" -eq 0 ] || die "must run as root (e.g. sudo make kmatrix-setup)"

# QEMU boots the kernels (TCG); virtme-ng's guest needs modprobe (kmod) and a static
# busybox; file tells virtme-ng a kernel image's version.
APT_PKGS=(qemu-system-x86 kmod busybox-static file)
apt_ensure -q "$LOG" "${APT_PKGS[@]}"

if [ "$("$VNG_VENV/bin/vng" --version 2>/dev/null)" != "virtme-ng $VNG_VERSION" ]; then
    say "installing virtme-ng $VNG_VERSION into $VNG_VENV (PyPI)"
    rm -rf "$VNG_VENV"
    { /usr/bin/python3 -m venv "$VNG_VENV" \
      && PIP_DISABLE_PIP_VERSION_CHECK=1 "$VNG_VENV/bin/pip" install -q "virtme-ng==$VNG_VERSION"; } \
        >>"$LOG" 2>&1 \
        || { tail -n 15 "$LOG" >&2; die "pip install virtme-ng==$VNG_VERSION failed (log: $LOG)"; }
fi

# The kernels: fetched once (apt-get download + dpkg -x), then only checked.
/usr/bin/python3 "$ROOT/tools/kmatrix.py" fetch >/dev/null \
    || die "cannot fetch the matrix kernels (see above)"
ms=$(( ($(date +%s%N) - t0) / 1000000 ))
say "ready in $((ms / 1000)).$((ms % 1000 / 100))s: $(/usr/bin/python3 "$ROOT/tools/kmatrix.py" list | awk '{printf "%s=%s ", $1, $NF}')"
