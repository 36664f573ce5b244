#!/usr/bin/env bash
# mrc-xdp agent (container entry point; deploy/kubernetes/Containerfile):
#   1. mrc-xdp load --config $MRC_HOST_CONFIG (--force: a restarted pod replaces its own)
#   2. the health daemon and the metrics endpoint ($MRC_METRICS_LISTEN), in the background
#   3. on SIGTERM: both stopped, the datapath unloaded (MRC_UNLOAD_ON_EXIT=0 keeps it)
set -euo pipefail
CLI=/opt/mrc-xdp/.venv/bin/mrc-xdp
CONFIG=${MRC_HOST_CONFIG:-/etc/mrc-xdp/host.toml}
LISTEN=${MRC_METRICS_LISTEN:-0.0.0.0:9417}
[ -r "$CONFIG" ] || { echo "mrc-xdp-agent: no host config at $CONFIG (mount the ConfigMap there)" >&2; exit 1; }
mountpoint -q /sys/fs/bpf || { echo "mrc-xdp-agent: /sys/fs/bpf is not a bpffs mount: mount the host's /sys/fs/bpf" >&2; exit 1; }
inst=$("$CLI" load --config "$CONFIG" --force --json | python3 -c 'import json,sys; print(json.load(sys.stdin)["instance"])')
echo "mrc-xdp-agent: datapath $inst loaded from $CONFIG"
export MRC_XDP_DAEMON_SOCKET=${MRC_XDP_DAEMON_SOCKET:-/run/mrc-xdp/events.sock}
"$CLI" daemon -i "$inst" --socket "$MRC_XDP_DAEMON_SOCKET" &
dpid=$!
"$CLI" metrics --listen "$LISTEN" --instance "$inst" &
mpid=$!
stop() {
    kill -TERM "$mpid" "$dpid" 2>/dev/null || true
    wait "$mpid" "$dpid" 2>/dev/null || true
    if [ "${MRC_UNLOAD_ON_EXIT:-1}" = 1 ]; then "$CLI" unload --instance "$inst" || true; fi
    exit 0
}
trap stop TERM INT
wait -n "$dpid" "$mpid" || true
echo "mrc-xdp-agent: the daemon or the metrics endpoint exited; stopping" >&2
stop
