#!/usr/bin/env bash
# The Kubernetes agent's image, built with podman on this machine (docs/fleet.md,
# "Kubernetes"; tests/test_kubernetes.py):
#   1. podman, runc, catatonit (the pause image of `podman kube play`) and debootstrap from Debian;
#   2. the base image localhost/debian:bookworm when podman has none (no image registry is
#      reachable here): debootstrap --variant=minbase bookworm from this machine's Debian
#      mirror (the first bookworm URI of /etc/apt/sources.list*, or $MRC_DEBIAN_MIRROR),
#      then `podman import`; the root file system is removed;
#   3. the agent image ($MRC_K8S_IMAGE, default localhost/mrc-xdp:dev) from this checkout:
#      `podman build` with runc and explicit ulimits; its layers are cached, so only the
#      sources' layer is rebuilt when they changed (the Debian packages' layer depends on
#      scripts/setup.sh alone).  The image it replaces is removed.
# The images live in podman's store (/var/lib/containers/storage): that is the cache.
# Idempotent: with everything present and the sources unchanged it takes a few seconds.
# `make k8s-image`; `make test` runs it.
set -euo pipefail
cd "$(dirname "${BASH_SOURCE[0]}")/.."
say() { printf 'k8s-setup: %s\n' "$*"; }
die() { printf 'k8s-setup: error: %s\n' "$*" >&2; exit 1; }
. scripts/lib.sh
t0=$(date +%s)

[ "$(id -u)" -eq 0 ] || die "must run as root (podman builds and runs privileged containers as root)"
BASE=localhost/debian:bookworm
IMAGE=${MRC_K8S_IMAGE:-localhost/mrc-xdp:dev}
PODMAN=(podman --runtime runc)
ULIMITS=(--ulimit nofile=20000:20000 --ulimit nproc=32768:32768)
LOG=/var/log/mrc-xdp-k8s-setup.log
: >"$LOG"

apt_ensure "$LOG" podman runc catatonit debootstrap

if ! podman image exists "$BASE"; then
    mirror=${MRC_DEBIAN_MIRROR:-$(python3 - <<'EOF'
import glob, re
# deb822 .sources stanzas and one-line sources.list entries; the first with bookworm
files = sorted(glob.glob("/etc/apt/sources.list.d/*.sources")) + ["/etc/apt/sources.list"] + \
    sorted(glob.glob("/etc/apt/sources.list.d/*.list"))
for f in files:
    try:
        text = open(f).read()
    except OSError:
        continue
    if f.endswith(".sources"):
        for st in re.split(r"\n\s*\n", text):
            kv = dict(re.findall(r"^(\w[\w-]*):\s*(.*)$", st, re.M))
            if "bookworm" in kv.get("Suites", "").split() and kv.get("URIs") and \
                    kv.get("Enabled", "yes") != "no":
                print(kv["URIs"].split()[0]); raise SystemExit
    else:
        for l in text.splitlines():
            m = re.match(r"\s*deb\s+(?:\[[^]]*\]\s+)?(\S+)\s+bookworm\s", l)
            if m:
                print(m.group(1)); raise SystemExit
EOF
)}
    [ -n "$mirror" ] || die "no bookworm mirror in /etc/apt/sources.list*: set MRC_DEBIAN_MIRROR"
    rootfs=$(mktemp -d /var/tmp/mrc-xdp-rootfs.XXXXXX)
    trap 'rm -rf "$rootfs"' EXIT
    say "base image $BASE: debootstrap --variant=minbase bookworm from $mirror (log: $LOG)"
    t=$(date +%s)
    debootstrap --variant=minbase bookworm "$rootfs" "$mirror" >>"$LOG" 2>&1 \
        || { tail -n 15 "$LOG" >&2; die "debootstrap failed (log: $LOG)"; }
    say "debootstrap: $(( $(date +%s) - t )) s; podman import"
    # an imported image has no environment at all: PATH as Debian's images set it
    tar -C "$rootfs" -c . | podman import --change "ENV PATH=/usr/local/sbin:/usr/local/bin:/usr/sbin:/usr/bin:/sbin:/bin" \
        - "$BASE" >>"$LOG" 2>&1 || die "podman import failed (log: $LOG)"
    rm -rf "$rootfs"
    trap - EXIT
    say "base image $BASE imported ($(( $(date +%s) - t )) s)"
else
    say "base image $BASE: present"
fi

old=$(podman image inspect --format '{{.Id}}' "$IMAGE" 2>/dev/null || true)
say "agent image $IMAGE: podman build (cached layers; log: $LOG)"
t=$(date +%s)
"${PODMAN[@]}" build "${ULIMITS[@]}" --build-arg BASE="$BASE" -f deploy/kubernetes/Containerfile \
    -t "$IMAGE" . >>"$LOG" 2>&1 || { tail -n 25 "$LOG" >&2; die "podman build failed (log: $LOG)"; }
new=$(podman image inspect --format '{{.Id}}' "$IMAGE")
if [ -n "$old" ] && [ "$old" != "$new" ]; then
    podman rmi "$old" >/dev/null 2>&1 || true       # the image this one replaces (kept while in use)
fi
say "agent image $IMAGE ${new:0:12}: $([ "$old" = "$new" ] && echo unchanged || echo built) in $(( $(date +%s) - t )) s"
say "ready in $(( $(date +%s) - t0 )) s"
