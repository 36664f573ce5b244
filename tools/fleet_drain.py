#!/usr/bin/env python3
"""A fabric-wide plane drain with traffic running, seen by Prometheus (docs/fleet.md).

On a lab deployed with deploy/ansible/deploy.yml (and a Prometheus scraping it, e.g. the
one deploy.yml starts with -e mrc_xdp_prometheus_bin=...): h0 RDMA-Writes buffers to h2
back to back (demo's transfer: random bytes, sha256 compared at both ends) while
plane-drain.yml takes the plane out on every host one at a time; then a few seconds
drained, plane-return.yml, a few seconds returned.  Prints one JSON object: transfers
done and failed, the playbooks' times, when Prometheus showed the plane out on every host
and when its alert fired (seconds from the drain playbook's start), the clear, and the
bytes each plane carried (fabric counters) before, during and after the drain.

    .venv/bin/python tools/fleet_drain.py --prefix fl- --inventory inv.json \\
        --prometheus http://127.0.0.1:9090
"""
from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import threading
import time
import urllib.parse
import urllib.request

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, ROOT)
ANSIBLE = os.path.join(ROOT, "deploy", "ansible")


def query(url: str, expr: str) -> list:
    try:
        with urllib.request.urlopen(url + "/api/v1/query?" + urllib.parse.urlencode({"query": expr}), timeout=5) as r:
            return json.load(r)["data"]["result"]
    except OSError:
        return []


def playbook(inv: str, name: str, plane: int) -> float:
    t = time.monotonic()
    p = subprocess.run([os.path.join(ROOT, ".venv", "bin", "ansible-playbook"), "-i", inv,
                        os.path.join(ANSIBLE, name), "-e", "mrc_xdp_plane=%d" % plane],
                       capture_output=True, text=True, env=dict(os.environ, ANSIBLE_CONFIG=os.path.join(ANSIBLE, "ansible.cfg")))
    if p.returncode != 0:
        sys.exit("fleet_drain: %s failed: %s" % (name, (p.stdout.strip().splitlines() or ["?"])[-1]))
    return round(time.monotonic() - t, 2)


def plane_bytes(topo, lm, hosts) -> dict:
    out: dict = {}
    for _, rx, tx, _ in topo.link_ends():
        if tx.node in hosts:
            p = int(tx.ifname[1:])
            out[p] = out.get(p, 0) + lm.counters(rx.ifindex)["bytes"]
    return out


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--prefix", required=True, help="the lab's prefix")
    ap.add_argument("--inventory", required=True, help="its inventory (mrc-xdp lab inventory)")
    ap.add_argument("--prometheus", required=True, help="URL of a Prometheus scraping the lab's hosts")
    ap.add_argument("--plane", type=int, default=1)
    ap.add_argument("--size", type=int, default=8, help="MiB per transfer (default 8)")
    ap.add_argument("--hold", type=float, default=4.0, help="seconds drained and seconds returned (default 4)")
    args = ap.parse_args()

    from mrc_xdp.lab import demo
    from mrc_xdp import transport
    from mrc_xdp.lab import fabric
    from mrc_xdp.lab import linkmodel as lmod
    st = fabric.load_state(args.prefix)
    topo = fabric.topology_of(st)
    hosts = [h.name for h in topo.hosts]
    lm = lmod.LinkModel.open(st["pin_dir"])
    eps = {h: transport.Endpoint(args.prefix + h) for h in (demo.SRC, demo.DST)}
    res = {"done": 0, "failed": 0, "errors": [], "bytes": 0}
    stop = threading.Event()

    def traffic():
        while not stop.is_set():
            tr = demo._Transfer(topo, eps[demo.SRC], eps[demo.DST], args.size << 20)
            try:
                tr.run()
                if tr.sha_s == tr.sha_d and tr.imm is not None:
                    res["done"] += 1
                    res["bytes"] += args.size << 20
                else:
                    res["failed"] += 1
            except Exception as e:      # noqa: BLE001 - counted and reported
                res["failed"] += 1
                res["errors"].append(str(e))
            finally:
                tr.close()

    seen: dict = {}
    t0 = [0.0]
    want = len(hosts)
    pl = str(args.plane)

    def watch():
        while not stop.is_set():
            now = round(time.monotonic() - t0[0], 2)
            out = len(query(args.prometheus, 'mrc_plane_in_rotation{plane="%s"} == 0' % pl))
            firing = len([x for x in query(args.prometheus, 'ALERTS{alertname="MrcPlaneOutOfRotation",'
                                           'alertstate="firing"}') if x["metric"].get("plane") == pl])
            if out == want and "prometheus_all_out_s" not in seen:
                seen["prometheus_all_out_s"] = now
            if firing == want and "alert_firing_all_s" not in seen:
                seen["alert_firing_all_s"] = now
            if "return_start" in seen and out == 0 and firing == 0 and "cleared_s" not in seen:
                seen["cleared_s"] = round(now - seen["return_start"], 2)
            time.sleep(0.2)

    th = threading.Thread(target=traffic, daemon=True)
    th.start()
    time.sleep(1.0)
    b0 = plane_bytes(topo, lm, hosts)
    t0[0] = time.monotonic()
    w = threading.Thread(target=watch, daemon=True)
    w.start()
    drain_s = playbook(args.inventory, "plane-drain.yml", args.plane)
    b1 = plane_bytes(topo, lm, hosts)
    time.sleep(args.hold)
    b2 = plane_bytes(topo, lm, hosts)
    seen["return_start"] = round(time.monotonic() - t0[0], 2)
    return_s = playbook(args.inventory, "plane-return.yml", args.plane)
    b3 = plane_bytes(topo, lm, hosts)
    time.sleep(args.hold)
    b4 = plane_bytes(topo, lm, hosts)
    end = time.monotonic() + 20
    while "cleared_s" not in seen and time.monotonic() < end:
        time.sleep(0.2)
    stop.set()
    th.join(120)
    w.join(5)
    for ep in eps.values():
        ep.close()
    lm.close()

    def share(a, b):
        d = {p: b[p] - a[p] for p in b}
        tot = sum(d.values()) or 1
        return {"plane%d" % p: "%.1f%%" % (100.0 * v / tot) for p, v in sorted(d.items())}
    print(json.dumps({"transfers_done": res["done"], "transfers_failed": res["failed"], "errors": res["errors"][:3],
                      "mib_moved": res["bytes"] >> 20, "drain_playbook_s": drain_s, "return_playbook_s": return_s,
                      "prometheus": {k: v for k, v in seen.items() if k != "return_start"},
                      "fabric_bytes_share": {"during_drain_playbook": share(b0, b1), "drained": share(b1, b2),
                                             "during_return_playbook": share(b2, b3), "returned": share(b3, b4)}},
                     indent=1))
    return 0 if res["failed"] == 0 else 1


if __name__ == "__main__":
    raise SystemExit(main())
