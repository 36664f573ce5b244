"""The demo's phase 3 (mrc_xdp.lab.demo.failover) on a lab of its own: h0 RDMA-Writes the
demo's 104 MiB to h2 and a T1 of plane 0 fails once 30% is acknowledged.

- the goodput time line is the transfer as it ran: every interval before the failure's
  has bytes in it, the intervals add up to the bytes moved, and the fault came when about
  30% was acknowledged (a fresh machine's demo once showed 0.0 Mbit/s in every interval
  until 90% had arrived: nothing was sampled while the Writes were being posted);
- the reaction is measured: the EVs retired after the injection are the ASSUMED_BAD ones
  of h0's EV table, and the first and last retirement are dated from the injection by the
  datapath's own event timestamps (no bound on how fast: that is the loss rule's job).

No speed is asserted.  ~20 s (lab up ~10 s).
"""
import os
import uuid

import pytest

pytestmark = pytest.mark.skipif(os.geteuid() != 0, reason="the lab needs root")


@pytest.fixture(scope="module")
def lab():
    from mrc_xdp import transport
    from mrc_xdp.lab import fabric, hosts, topology
    from mrc_xdp.lab import linkmodel as lmod
    from mrc_xdp.datapath.maps import Instance
    prefix = "fd%s-" % uuid.uuid4().hex[:4]
    try:
        st = fabric.up(topology.load(mode="srv6"), prefix=prefix, hosts_hook=hosts.fabric_hook)
        topo = fabric.topology_of(st)
        with lmod.LinkModel.open(st["pin_dir"]) as lm, Instance(prefix + "h0") as inst, \
                transport.Endpoint(prefix + "h0") as ep_s, transport.Endpoint(prefix + "h2") as ep_d:
            yield topo, lm, inst, ep_s, ep_d
    finally:
        fabric.down(prefix, unload_hosts=hosts.unload_all)


def _show(rows):
    return ["%.0f-%.0f ms: %d B" % (lo * 1e3, hi * 1e3, b) for lo, hi, b in rows]


def test_failover_time_line_and_reaction(lab):
    from mrc_xdp.lab import demo
    topo, lm, inst, ep_s, ep_d = lab
    size = 4 * ((20000 * ep_s.payload) >> 20 << 20)        # the demo's phase 3, default --packets
    before = {rx.ifindex: lm.get(rx.ifindex) for rx in demo._fault_ends(topo, demo.FAIL)}
    r = demo.failover(topo, lm, inst, ep_s, ep_d, size)
    x = r["transfer"]
    assert x.sha_s == x.sha_d
    # the fault came at ~30% acknowledged, and is gone again
    assert r["inject_ns"] is not None and 0.3 * size <= r["fired_at"] < 0.5 * size, r["fired_at"] / size
    assert {i: lm.get(i) for i in before} == before
    rows = r["timeline"]
    assert sum(b for _, _, b in rows) == size
    k = next(i for i, (lo, hi, _) in enumerate(rows) if lo <= r["t_fail"] < hi)
    assert all(b > 0 for _, _, b in rows[:k]), _show(rows[:k + 1])
    # and at a finer grain up to the failure (after it the transfer may stall for a while,
    # squeezing the time before it into the first interval or two of the printed line)
    t0 = x.samples[0][0]
    before = demo.timeline([smp for smp in x.samples if smp[0] <= t0 + r["t_fail"]], buckets=4)
    assert all(b > 0 for _, _, b in before), _show(before)
    # the reaction, from the datapath's events
    bad = {row["ev"] for row in inst.ev_table() if row["conn_name"] == demo.DST and row["state"] == "ASSUMED_BAD"}
    assert r["retired"] and {e["ev"] for e in r["retired"]} <= bad
    assert bad == {e["ev"] for e in r["events"] if e["new"] == "ASSUMED_BAD"}
    assert all(e["ts_ns"] >= r["inject_ns"] for e in r["retired"])
    assert 0 < r["first_us"] <= r["last_us"] < x.seconds * 1e6
    assert r["first_us"] == (min(e["ts_ns"] for e in r["retired"]) - r["inject_ns"]) / 1000
    print("reaction: first EV retired %.0f us, last %.0f us after the injection (%.0f us to blackhole "
          "%d ends), %d retired; %d MiB in %.2f s" % (r["first_us"], r["last_us"], r["inject_us"],
                                                      len(before), len(r["retired"]), size >> 20, x.seconds))
