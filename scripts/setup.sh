#!/usr/bin/env bash
# Set up mrc-xdp on a Debian 12 host, as root: Debian packages (bcc, libbpf, scapy,
# pyroute2, ...), a kernel headers tree for bcc, and .venv with mrc-xdp installed
# in editable mode.  Idempotent: when everything is present it only checks, which
# takes a second or two.  `make setup` runs it; `make demo` and `make test` too.
set -euo pipefail
t0=$(date +%s%N)

cd "$(dirname "${BASH_SOURCE[0]}")/.."
ROOT=$PWD
PY=/usr/bin/python3          # Debian's python: the only one that can import bcc
VENV=$ROOT/.venv
LOG_DIR=$VENV/setup-logs
export PIP_DISABLE_PIP_VERSION_CHECK=1 PIP_NO_INPUT=1

say() { printf 'setup: %s\n' "$*"; }
die() { printf 'setup: error: %s\n' "$*" >&2; exit 1; }
. scripts/lib.sh

[ "$(id -u)" -eq 0 ] || die "must run as root (e.g. sudo make setup): it installs Debian packages and a kernel headers tree"
command -v dpkg-query >/dev/null && command -v apt-get >/dev/null \
    || die "dpkg/apt-get not found: mrc-xdp's setup supports Debian 12"

# ---------------------------------------------------------------- Debian packages
# bcc's Python module comes only from Debian (python3-bpfcc).  The PyPI package named
# "bcc" is unrelated and must never be installed.
APT_PKGS=(
    python3-bpfcc bpfcc-tools libbpf1 libbpf-dev     # BPF: bcc loads, libbpf runs/pins
    libxdp-dev zlib1g-dev                            # transport engine: AF_XDP, CRC-32
    python3-venv python3-dev python3-cffi gcc make   # venv, cffi (shared header, engine)
    python3-scapy python3-pyroute2 python3-pytest    # packets, netlink, tests
    iproute2 iperf3 ethtool tcpdump mptcpize         # lab and benchmarks (mptcpize: gloo over MPTCP, evaluate (g), (h))
    python3-rich python3-matplotlib tmux             # mrc-xdp top, bench_failover plot, top test
    python3-prometheus-client                        # mrc-xdp metrics
    python3-numpy                                    # the collective library
)
# MRC_SETUP_EXTRAS=0 leaves out what only the evaluation's plots, the benchmarks and the
# `mrc-xdp top` test use (the VM lab's guest image sets it: matplotlib is most of a cold
# image build's downloads).
APT_EXTRAS=(python3-matplotlib tmux iperf3 tcpdump mptcpize)
if [ "${MRC_SETUP_EXTRAS:-1}" = 0 ]; then
    keep=()
    for p in "${APT_PKGS[@]}"; do [[ " ${APT_EXTRAS[*]} " == *" $p "* ]] || keep+=("$p"); done
    APT_PKGS=("${keep[@]}")
fi
# Kernel headers for bcc: a host with a headers tree for its running kernel is left
# alone; otherwise Debian's linux-headers-<arch> is merged by mrc_xdp.datapath.kheaders.
KBUILD=/lib/modules/$(uname -r)/build
if [ ! -e "$KBUILD/include/linux/kconfig.h" ]; then
    APT_PKGS+=("linux-headers-$(dpkg --print-architecture)")
fi

apt_ensure /var/log/mrc-xdp-setup-apt.log "${APT_PKGS[@]}"
# MRC_SETUP_APT_ONLY=1 stops here, with the Debian packages only: the agent image's first
# layer (deploy/kubernetes/Containerfile), which stays cached while only the sources change.
if [ "${MRC_SETUP_APT_ONLY:-0}" = 1 ]; then
    say "Debian packages ready; stopping (MRC_SETUP_APT_ONLY=1)"
    exit 0
fi

# ---------------------------------------------------------------- kernel headers
# Prints the tree bcc should use; builds the merged tree under /var/cache/mrc-xdp
# when the running kernel has none.  The library calls mrc_xdp.datapath.kheaders.ensure()
# itself at run time, so nothing needs to be exported for later commands.
BCC_KERNEL_SOURCE=$("$PY" -m mrc_xdp.datapath.kheaders) \
    || die "no kernel headers tree for bcc (see above); install linux-headers-$(dpkg --print-architecture) or set BCC_KERNEL_SOURCE"
export BCC_KERNEL_SOURCE
say "kernel headers for bcc: $BCC_KERNEL_SOURCE"

# ---------------------------------------------------------------- .venv
venv_ok() {
    [ -x "$VENV/bin/python" ] && [ -f "$VENV/pyvenv.cfg" ] \
        && grep -qx 'home = /usr/bin' "$VENV/pyvenv.cfg" \
        && grep -qx 'include-system-site-packages = true' "$VENV/pyvenv.cfg" \
        && "$VENV/bin/python" -c '' 2>/dev/null
}
if ! venv_ok; then
    if [ -e "$VENV" ]; then
        say "removing .venv: not a working /usr/bin/python3 --system-site-packages venv"
        rm -rf "$VENV"
    fi
    say "creating .venv (/usr/bin/python3 -m venv --system-site-packages)"
    "$PY" -m venv --system-site-packages "$VENV"
fi
mkdir -p "$LOG_DIR"

# Python packages Debian lacks, installed into .venv with pip.  Everything else comes
# from Debian through the system site packages.  Never add "bcc".
# PyTorch (the "mrc" torch.distributed backend, the *-perf tools, the training example):
# pinned exactly, which takes the CPU build; an unpinned or open-range torch resolves to
# a CUDA build of several GB.  Left out with MRC_SETUP_EXTRAS=0 (the VM lab's guests).
# ansible-core (deploy/ansible: the fleet role and playbooks, tests/test_fleet.py): pinned;
# 2.19 is the last line that runs on Debian 12's Python 3.11.  Only the controller needs it,
# so the VM lab's guests (MRC_SETUP_EXTRAS=0) leave it out too.
PIP_PKGS=()
if [ "${MRC_SETUP_EXTRAS:-1}" != 0 ]; then
    PIP_PKGS+=(torch==2.13.0 ansible-core==2.19.14)
fi

# Editable install: reinstalled only when its inputs change (setup.py, pyproject.toml,
# PIP_PKGS, the sources of the cffi-built transport engine), or when the engine's
# compiled module is missing.
STAMP_INPUTS=(setup.py pyproject.toml mrc_xdp/transport/engine/engine.c mrc_xdp/transport/engine/engine.h
              mrc_xdp/transport/engine/build.py)
stamp=$VENV/.mrc-xdp-installed
want=$( { for f in "${STAMP_INPUTS[@]}"; do [ -f "$f" ] && cat "$f"; done; echo "${PIP_PKGS[*]-}"; } \
        | sha256sum | cut -d' ' -f1)
engine_so=$(compgen -G "mrc_xdp/transport/_engine*.so" || true)
# (the entry point's metadata is mrc_xdp.egg-info in the tree: gone after a `git clean -x`)
if [ "$(cat "$stamp" 2>/dev/null)" != "$want" ] || [ ! -e "$VENV/bin/mrc-xdp" ] || [ -z "$engine_so" ] \
        || ! "$VENV/bin/python" -c 'import importlib.metadata as m; m.distribution("mrc-xdp")' 2>/dev/null; then
    pip_log=$LOG_DIR/pip.log
    : >"$pip_log"
    if [ ${#PIP_PKGS[@]} -gt 0 ]; then
        say "installing into .venv from PyPI: ${PIP_PKGS[*]}"
        "$VENV/bin/pip" install -q "${PIP_PKGS[@]}" >>"$pip_log" 2>&1 \
            || { tail -n 15 "$pip_log" >&2; die "pip install ${PIP_PKGS[*]} failed (log: $pip_log)"; }
    fi
    say "installing mrc-xdp into .venv (pip install -e .)"
    # Dependencies are Debian's (checked below), so pip needs nothing from an index.
    "$VENV/bin/pip" install -q --no-deps --no-build-isolation --no-index -e . >>"$pip_log" 2>&1 \
        || { tail -n 15 "$pip_log" >&2; die "pip install -e . failed (log: $pip_log)"; }
    echo "$want" >"$stamp"
else
    say "mrc-xdp: installed in .venv (editable)"
fi

# ---------------------------------------------------------------- checks
# -I: import from the installed environment, not from the current directory.
"$VENV/bin/python" -I - <<'EOF' || exit 1
import sys
try:
    import bcc, cffi, prometheus_client, pyroute2, scapy  # noqa: F401
except ImportError as e:
    sys.exit("setup: error: %s: install the Debian package (python3-bpfcc, python3-cffi, "
             "python3-prometheus-client, python3-pyroute2, python3-scapy)" % e)
if not bcc.__file__.startswith("/usr/lib/python3/dist-packages/"):
    sys.exit("setup: error: bcc is imported from %s, which is not Debian's python3-bpfcc: "
             "run .venv/bin/pip uninstall -y bcc (PyPI's 'bcc' is an unrelated package)"
             % bcc.__file__)
try:
    import mrc_xdp  # noqa: F401
    import mrc_xdp.transport._engine  # noqa: F401
except Exception as e:
    sys.exit("setup: error: .venv cannot import mrc_xdp or its transport engine (%s: %s): "
             "run make clean && make setup" % (type(e).__name__, e))
EOF
if [ "${MRC_SETUP_EXTRAS:-1}" != 0 ]; then
    "$VENV/bin/python" -I -c 'import torch, torch.distributed as d; assert d.is_available(); print(torch.__version__)' \
        >"$LOG_DIR/torch-check.log" 2>&1 \
        || { tail -n 5 "$LOG_DIR/torch-check.log" >&2; die "torch does not import in .venv (log: $LOG_DIR/torch-check.log): run make clean && make setup"; }
fi
say "imports: bcc, scapy, pyroute2, cffi, prometheus_client, mrc_xdp (with its engine)${PIP_PKGS[*]:+, ${PIP_PKGS[*]}} ok"

# bcc compiles and loads a trivial XDP program (a fraction of a second).
# MRC_SETUP_BPF_LOAD=0 compiles it only: an image build (deploy/kubernetes/Containerfile)
# runs without the privileges to load a BPF program; the agent loads at run time.
bcc_log=$LOG_DIR/bcc-check.log
MRC_SETUP_BPF_LOAD=${MRC_SETUP_BPF_LOAD:-1} "$VENV/bin/python" -I - >"$bcc_log" 2>&1 <<'EOF' || {
import os, sys
from bcc import BPF
try:
    b = BPF(text="int xdp_ok(struct xdp_md *ctx) { return XDP_PASS; }")
except Exception as e:
    sys.exit("compile failed: %s" % e)
if os.environ["MRC_SETUP_BPF_LOAD"] != "0":
    try:
        b.load_func("xdp_ok", BPF.XDP)
    except Exception as e:
        sys.exit("load failed: %s" % e)
EOF
    tail -n 10 "$bcc_log" >&2
    die "bcc cannot compile and load a trivial XDP program with headers $BCC_KERNEL_SOURCE (log: $bcc_log): check that you are root, that the kernel has BPF (CONFIG_BPF_SYSCALL), and that the headers tree is complete (rm -rf /var/cache/mrc-xdp and rerun)"
}
if [ "${MRC_SETUP_BPF_LOAD:-1}" = 0 ]; then
    say "bcc: compiles XDP programs (not loaded: MRC_SETUP_BPF_LOAD=0)"
else
    say "bcc: compiles and loads XDP programs"
fi

ms=$(( ($(date +%s%N) - t0) / 1000000 ))
say "ready in $((ms / 1000)).$((ms % 1000 / 100))s: make demo | make test"
