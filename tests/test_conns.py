"""Tier 2: connections added to and removed from a running datapath (mrc_xdp.transport.conns).

Two namespaces back to back, both loaded (as test_live_pair's pair), each with one
connection from its config.  A connection added at run time is sprayed like a loaded one;
removing it leaves no map entry; 1,000 add/remove cycles and concurrent add/remove from
several processes leave nothing behind.
"""
import json
import multiprocessing
import os
import socket
import time
import uuid

import pytest

from mrc_xdp.transport import conns
from mrc_xdp.datapath import loader, netns, wire
from mrc_xdp.datapath.config import HostConfig
from mrc_xdp.datapath.maps import Instance

pytestmark = pytest.mark.skipif(os.geteuid() != 0, reason="needs root (XDP, netns)")

A_ADDR, B_ADDR = "fd00:78::a", "fd00:78::b"
QA, QB = 0x1A0, 0x1B0


def _ip(ns, *a):
    return netns.run_cmd(ns, ["ip"] + list(a))


def _mac(ns, dev):
    return json.loads(_ip(ns, "-j", "link", "show", dev).stdout)[0]["address"]


def _cfg(inst, local, peer, lq, rq, gws):
    return HostConfig.from_dict({
        "instance": inst, "mode": "ecmp", "local_addr": local,
        "planes": [{"dev": "p%d" % i, "gateway_mac": m} for i, m in enumerate(gws)],
        "connections": [{"peer": peer, "local_qpn": lq, "remote_qpn": rq, "ev_per_plane": 4,
                         "backup_per_plane": 2}]})


@pytest.fixture(scope="module")
def pair():
    tag = "%x%s" % (os.getpid() & 0xffff, uuid.uuid4().hex[:4])
    a, b = "cnA-" + tag, "cnB-" + tag
    ia, ib = "tcA-" + tag, "tcB-" + tag
    made = []
    try:
        for n in (a, b):
            netns.create(n)
            made.append(n)
            _ip(n, "link", "set", "lo", "up")
            _ip(n, "link", "add", "mrc0", "type", "veth", "peer", "name", "mrc0p")
            _ip(n, "link", "set", "mrc0", "up")
            _ip(n, "link", "set", "mrc0p", "up")
        for p in ("p0", "p1"):
            _ip(a, "link", "add", p, "type", "veth", "peer", "name", p, "netns", b)
            _ip(a, "link", "set", p, "up")
            _ip(b, "link", "set", p, "up")
        loader.load(_cfg(ia, A_ADDR, B_ADDR, QA, QB, [_mac(b, "p0"), _mac(b, "p1")]), netns_name=a)
        loader.load(_cfg(ib, B_ADDR, A_ADDR, QB, QA, [_mac(a, "p0"), _mac(a, "p1")]), netns_name=b)
        yield {"a": a, "b": b, "ia": ia, "ib": ib}
    finally:
        for i in (ia, ib):
            loader.unload(i, quiet_missing=True)
        for n in made:
            netns.delete(n)


def _send(ns, dev, frame):
    def go():
        with socket.socket(socket.AF_PACKET, socket.SOCK_RAW) as s:
            s.bind((dev, 0))
            s.send(frame)
    netns.run(ns, go)


def _ctr(inst):
    with Instance(inst) as i:
        return i.counters()


def _conn_tx(inst, cid):
    with Instance(inst) as i:
        return sum(r["tx_pkts"] for r in i.ev_table(cid))


def _wait(pred, timeout=2.0):
    end = time.monotonic() + timeout
    while time.monotonic() < end:
        if pred():
            return True
        time.sleep(0.02)
    return pred()


def test_add_sprays_remove_clears(pair):
    ia, ib = pair["ia"], pair["ib"]
    lq, rq = 0x300, 0x301
    ca = conns.add(ia, B_ADDR, lq, rq, name="rt")
    cb = conns.add(ib, A_ADDR, rq, lq, name="rt")
    assert ca["id"] == 1 and cb["id"] == 1
    # shape and EVs taken from the loaded connection to the same peer (ecmp)
    with Instance(ia) as inst:
        c = {x["id"]: x for x in inst.connections()}
        assert c[1]["ev_per_plane"] == 4 and c[1]["backup_per_plane"] == 2
        assert c[1]["local_qpn"] == lq and c[1]["remote_qpn"] == rq and c[1]["name"] == "rt"
        evs0 = {r["ev"] for r in inst.ev_table(0)}
        evs1 = {r["ev"] for r in inst.ev_table(1)}
    assert evs1 == evs0 and len(evs1) == 12
    with pytest.raises(conns.ConnError, match="exists"):
        conns.add(ia, B_ADDR, lq, 0x999)

    # one data frame of the new connection: sprayed (counted on its EVs), arrives at B
    before_a, before_b = _ctr(ia), _ctr(ib)
    f = wire.data_frame(A_ADDR, B_ADDR, rq, 0, b"\x11" * 256, dmac=_mac(pair["a"], "mrc0p"),
                        smac=_mac(pair["a"], "mrc0"))
    for _ in range(4):
        _send(pair["a"], "mrc0", f)
    assert _wait(lambda: _ctr(ib)["ing_data"] - before_b["ing_data"] == 4)
    after_a = _ctr(ia)
    assert after_a["spray_tx"] - before_a["spray_tx"] == 4
    assert after_a["spray_no_conn"] == before_a["spray_no_conn"]
    assert _conn_tx(ia, 1) == 4 and _conn_tx(ia, 0) == 0
    with Instance(ib) as inst:
        assert sum(r["pkts"] for r in inst.rx_evs() if r["conn"] == 1) == 4

    # remove: nothing of it is left in any map, and its frames are no longer sprayed
    conns.remove(ia, B_ADDR, lq)
    conns.remove(ib, A_ADDR, rq)
    assert conns.leftovers(ia, 1) == [] and conns.leftovers(ib, 1) == []
    assert [c["id"] for c in conns.list_(ia)] == [0]
    before = _ctr(ia)
    _send(pair["a"], "mrc0", f)
    assert _wait(lambda: _ctr(ia)["spray_no_conn"] - before["spray_no_conn"] == 1)
    assert _ctr(ia)["spray_tx"] == before["spray_tx"]
    with pytest.raises(conns.ConnError, match="no connection"):
        conns.remove(ia, B_ADDR, lq)
    # the loaded connection is untouched
    assert conns.leftovers(ia, 0) != [] and len(conns.list_(ia)) == 1


def test_thousand_cycles_leave_nothing(pair):
    ia = pair["ia"]
    for i in range(1000):
        q = 0x1000 + (i % 7)
        c = conns.add(ia, B_ADDR, q, q + 0x100)
        assert c["id"] == 1
        conns.remove(ia, B_ADDR, q)
    assert conns.leftovers(ia, 1) == []
    assert [c["id"] for c in conns.list_(ia)] == [0]
    with open("/run/mrc-xdp/%s.json" % ia) as fh:
        assert len(json.load(fh)["connections"]) == 1


def _worker(inst, base, n, q):
    try:
        ids = []
        for i in range(n):
            c = conns.add(inst, B_ADDR, base + i, base + i + 0x8000)
            ids.append(c["id"])
            conns.remove(inst, B_ADDR, base + i)
        q.put(("ok", ids))
    except Exception as e:       # reported by the test
        q.put(("error", "%s: %s" % (type(e).__name__, e)))


def test_concurrent_add_remove(pair):
    """Three processes add and remove their own connections at once: the lock keeps ids
    unique, and every entry is gone at the end."""
    ia = pair["ia"]
    held = [conns.add(ia, B_ADDR, 0x2000 + k, 0x2100 + k)["id"] for k in range(3)]
    ctx = multiprocessing.get_context("fork")
    q = ctx.Queue()
    procs = [ctx.Process(target=_worker, args=(ia, 0x10000 * (k + 1), 60, q)) for k in range(3)]
    for p in procs:
        p.start()
    res = [q.get(timeout=120) for _ in procs]
    for p in procs:
        p.join()
    assert all(r[0] == "ok" for r in res), res
    assert all(i not in held and 1 <= i < 64 for _, ids in res for i in ids)
    for k in range(3):
        conns.remove(ia, B_ADDR, 0x2000 + k)
    assert [c["id"] for c in conns.list_(ia)] == [0]
    for cid in range(1, 8):
        assert conns.leftovers(ia, cid) == [], cid


def _probe_idx(inst, peer):
    """Connection id the QPN 0x2 (connectionless probe) index keys of peer name, per direction."""
    from mrc_xdp.datapath.maps import QPN_PROBE, conn_key
    m = conns._Maps(inst)
    try:
        out = []
        for d in (0, 1):
            v = m["mrc_connidx"].lookup(conn_key(peer, QPN_PROBE, d))
            out.append(None if v is None else int.from_bytes(v, "little"))
        return out
    finally:
        m.close()


def test_connectionless_probe_index_follows_runtime_connections(pair):
    """Probes on QPN 0x2 to a peer are answered through one connection's EV set: a run-time
    connection to a new peer provides it, a second one inherits it when the first goes, and
    the last one takes it away; the loaded connection's keys are never disturbed."""
    ia = pair["ia"]
    c_addr = "fd00:78::c"
    assert _probe_idx(ia, B_ADDR) == [0, 0] and _probe_idx(ia, c_addr) == [None, None]
    x = conns.add(ia, c_addr, 0x500, 0x501)
    y = conns.add(ia, c_addr, 0x502, 0x503)
    assert _probe_idx(ia, c_addr) == [x["id"], x["id"]]
    conns.remove(ia, c_addr, 0x500)
    assert _probe_idx(ia, c_addr) == [y["id"], y["id"]]
    conns.remove(ia, c_addr, 0x502)
    assert _probe_idx(ia, c_addr) == [None, None]
    z = conns.add(ia, B_ADDR, 0x504, 0x505)        # a second connection to a loaded peer
    assert _probe_idx(ia, B_ADDR) == [0, 0]
    conns.remove(ia, B_ADDR, 0x504)
    assert _probe_idx(ia, B_ADDR) == [0, 0] and conns.leftovers(ia, z["id"]) == []


# An endpoint process that connects two QPs (so adds their connections, owned by its pid),
# says which, and waits to be killed (bounded).
_ENDPOINT_PROC = r"""
import json, sys, time
from mrc_xdp import transport
ep = transport.Endpoint(sys.argv[1])
qps = [ep.create_qp(qpn=q) for q in (0x600, 0x601)]
for q in qps:
    q.connect({"addr": sys.argv[2], "qpn": q.qpn + 0x100})
print(json.dumps([q.qpn for q in qps]), flush=True)
time.sleep(120)
"""


def test_connections_of_a_killed_endpoint_are_reaped(pair):
    """An endpoint process killed with -9 leaves its QPs' connections in the datapath;
    the next endpoint that opens removes them (conns.reap), and nothing else: not the
    loaded connection, not one whose owner runs.  A connection whose owner pid now names
    another process (another start time: the pid was reused) goes too."""
    import signal
    import subprocess
    import sys
    from mrc_xdp import transport
    ia = pair["ia"]
    live = conns.add(ia, B_ADDR, 0x610, 0x710, owner=os.getpid())
    reused = conns.add(ia, B_ADDR, 0x611, 0x711, owner=os.getpid())
    with open("/run/mrc-xdp/%s.json" % ia) as fh:
        st = json.load(fh)
    assert st["connections"][reused["id"]]["owner_start"] == conns.proc_start(os.getpid())
    st["connections"][reused["id"]]["owner_start"] -= 1
    with open("/run/mrc-xdp/%s.json" % ia, "w") as fh:
        json.dump(st, fh)
    p = subprocess.Popen([sys.executable, "-c", _ENDPOINT_PROC, ia, B_ADDR], stdout=subprocess.PIPE,
                         text=True)
    try:
        assert json.loads(p.stdout.readline()) == [0x600, 0x601]
        dead = [c["id"] for c in conns.list_(ia) if c.get("owner") == p.pid]
        assert len(dead) == 2
    finally:
        p.send_signal(signal.SIGKILL)
        p.wait()
    assert all(conns.leftovers(ia, cid) != [] for cid in dead)      # left behind by the kill
    with transport.Endpoint(ia):
        pass
    left = {c["id"] for c in conns.list_(ia)}
    assert left == {0, live["id"]}
    for cid in dead + [reused["id"]]:
        assert conns.leftovers(ia, cid) == [], cid
    assert conns.leftovers(ia, live["id"]) != [] and conns.leftovers(ia, 0) != []
    conns.remove(ia, B_ADDR, 0x610)
    assert conns.reap(ia) == [] and [c["id"] for c in conns.list_(ia)] == [0]


def test_health_daemon_reaps_connections_of_processes_gone(pair):
    """The health daemon's rescan reaps too (no endpoint need open again), and logs it."""
    import subprocess
    from mrc_xdp.health import daemon as health
    ia = pair["ia"]
    gone = subprocess.Popen(["true"])
    gone.wait()
    c = conns.add(ia, B_ADDR, 0x620, 0x720, owner=gone.pid)
    logged = []
    d = health.Daemon(health.HealthConfig(instances=[ia], follow_links=False), prober=None, log=logged.append)
    try:
        d.rescan()
    finally:
        d.close()
    assert [x["id"] for x in conns.list_(ia)] == [0] and conns.leftovers(ia, c["id"]) == []
    assert any("removed connection %d" % c["id"] in m and str(gone.pid) in m for m in logged), logged
