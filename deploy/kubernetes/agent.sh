#!/usr/bin/env bash
# mrc-xdp agent (container entry point; deploy/kubernetes/Containerfile):
#   1. mrc-xdp load --config $MRC_HOST_CONFIG (--force: a restarted pod replaces its own),
#      into the named network namespace $MRC_NETNS when it is set (a netns lab host, whose
#      devices live in /run/netns/NAME of the node; unset on a real node: the pod is on
#      the node's network)
#   2. the health daemon and the metrics endpoint ($MRC_METRICS_LISTEN), in the background
#   3. on SIGTERM: both stopped, the datapath unloaded (MRC_UNLOAD_ON_EXIT=0 keeps it)
# Bash is the container's PID 1: a signal it has no trap for is ignored (the kernel's rule
# for PID 1), so the trap is set before anything is loaded.
set -euo pipefail
CLI=/opt/mrc-xdp/.venv/bin/mrc-xdp
CONFIG=${MRC_HOST_CONFIG:-/etc/mrc-xdp/host.toml}
LISTEN=${MRC_METRICS_LISTEN:-0.0.0.0:9417}
NETNS=${MRC_NETNS:-}
export MRC_XDP_DAEMON_SOCKET=${MRC_XDP_DAEMON_SOCKET:-/run/mrc-xdp/events.sock}
say() { echo "mrc-xdp-agent: $*" >&2; }
inst="" dpid="" mpid="" made=()
stop() {    # [exit code]
    trap '' TERM INT
    [ -z "$mpid$dpid" ] || kill -TERM $mpid $dpid 2>/dev/null || true
    [ -z "$mpid$dpid" ] || wait $mpid $dpid 2>/dev/null || true
    if [ -n "$inst" ] && [ "${MRC_UNLOAD_ON_EXIT:-1}" = 1 ]; then
        "$CLI" unload --instance "$inst" && say "datapath $inst unloaded" || say "unload of $inst failed"
    fi
    for ((i = ${#made[@]} - 1; i >= 0; i--)); do rmdir --ignore-fail-on-non-empty "${made[i]}" 2>/dev/null || true; done
    exit "${1:-0}"
}
trap stop TERM INT
[ -r "$CONFIG" ] || { say "no host config at $CONFIG (mount the ConfigMap there)"; exit 1; }
mountpoint -q /sys/fs/bpf || { say "/sys/fs/bpf is not a bpffs mount: mount the host's /sys/fs/bpf"; exit 1; }
if [ -n "$NETNS" ] && [ ! -e "/run/netns/$NETNS" ]; then
    say "MRC_NETNS=$NETNS: no /run/netns/$NETNS (mount the node's /run/netns)"; exit 1
fi
# the instance's name first, from the config: a SIGTERM that comes during the load (bash
# runs the trap when the load returns) unloads it
inst=$(python3 -c 'import sys, tomllib; print(tomllib.load(open(sys.argv[1], "rb"))["instance"])' "$CONFIG") \
    || { say "$CONFIG: no instance name"; exit 1; }
# the socket's directory, and the ones made for it, removed again at the end when empty
d=$(dirname "$MRC_XDP_DAEMON_SOCKET")
while [ ! -d "$d" ]; do made=("$d" ${made[@]+"${made[@]}"}); d=$(dirname "$d"); done
mkdir -p "$(dirname "$MRC_XDP_DAEMON_SOCKET")"
t0=$(date +%s%N)
"$CLI" load --config "$CONFIG" --force ${NETNS:+--netns "$NETNS"} >&2 \
    || { say "load of $CONFIG failed (the loader undid what it had done)"; inst=""; stop 1; }
say "datapath $inst loaded from $CONFIG${NETNS:+ in netns $NETNS} in $(( ($(date +%s%N) - t0) / 1000000 )) ms"
"$CLI" daemon -i "$inst" --socket "$MRC_XDP_DAEMON_SOCKET" &
dpid=$!
"$CLI" metrics --listen "$LISTEN" --instance "$inst" &
mpid=$!
say "health daemon (pid $dpid, socket $MRC_XDP_DAEMON_SOCKET) and metrics endpoint (pid $mpid, $LISTEN) started"
wait -n $dpid $mpid || true
say "the daemon or the metrics endpoint exited; stopping"
stop 1
