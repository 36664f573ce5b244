#!/usr/bin/env bash
# Set up what the fleet tools' tests need beyond scripts/setup.sh: Prometheus and promtool,
# taken out of Debian's `prometheus` package without installing it (its maintainer script
# would start a server on 0.0.0.0:9090).  The package is downloaded (apt-get download) and
# extracted (dpkg-deb -x) under /var/cache/mrc-xdp/prometheus/; tests run the binary as a
# plain process on 127.0.0.1.  ansible-core comes from scripts/setup.sh (pinned in .venv).
# Idempotent: with the binaries present it only checks.  `make fleet-setup`; `make test`.
set -euo pipefail
cd "$(dirname "${BASH_SOURCE[0]}")/.."
say() { printf 'fleet-setup: %s\n' "$*"; }
die() { printf 'fleet-setup: error: %s\n' "$*" >&2; exit 1; }

[ "$(id -u)" -eq 0 ] || die "must run as root (it writes /var/cache/mrc-xdp)"
DEST=/var/cache/mrc-xdp/prometheus
BIN=$DEST/usr/bin/prometheus
LOG=/var/log/mrc-xdp-fleet-setup.log

if [ -x "$BIN" ] && [ -x "$DEST/usr/bin/promtool" ] && "$BIN" --version >/dev/null 2>&1; then
    say "prometheus: $("$BIN" --version 2>&1 | head -n 1 | cut -d' ' -f1-3) in $DEST (extracted, not installed)"
else
    command -v apt-get >/dev/null && command -v dpkg-deb >/dev/null \
        || die "apt-get/dpkg-deb not found: the fleet setup supports Debian 12"
    tmp=$(mktemp -d)
    trap 'rm -rf "$tmp"' EXIT
    chmod 755 "$tmp"            # apt's _apt user downloads into it
    say "downloading Debian's prometheus package (apt-get download; not installed)"
    ( cd "$tmp" && apt-get -o DPkg::Lock::Timeout=300 download prometheus ) >"$LOG" 2>&1 || {
        say "apt-get download failed; updating package lists and retrying"
        apt-get -o DPkg::Lock::Timeout=300 update -q >>"$LOG" 2>&1 || true
        ( cd "$tmp" && apt-get -o DPkg::Lock::Timeout=300 download prometheus ) >>"$LOG" 2>&1 \
            || { tail -n 10 "$LOG" >&2; die "apt-get download prometheus failed (log: $LOG)"; }
    }
    rm -rf "$DEST.new"
    mkdir -p "$DEST.new"
    dpkg-deb -x "$tmp"/prometheus_*.deb "$DEST.new" || die "dpkg-deb -x failed"
    rm -rf "$DEST"
    mv "$DEST.new" "$DEST"
    "$BIN" --version >/dev/null 2>&1 || die "$BIN does not run"
    say "prometheus extracted into $DEST"
fi
[ -x .venv/bin/ansible-playbook ] \
    || die ".venv/bin/ansible-playbook is missing: run scripts/setup.sh (it installs ansible-core)"
v=$(.venv/bin/ansible-playbook --version 2>&1) || die "ansible-playbook does not run: $v"
say "ansible: ${v%%$'\n'*}"
