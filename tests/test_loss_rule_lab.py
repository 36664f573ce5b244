"""Tier 2: the datapath's loss rule retires exactly the EVs whose path is broken.

A SACK-bitmap hole is a loss only if the missing packet was sent more than a reorder
window before the packet whose SACK reports the hole (time-based, from the engine's
TSETH timestamps in the PSN ring: bpf/mrc_datapath.c sack_losses).  Reordering of many
PSNs is normal with four paths and busy CPUs; a PSN-distance rule took it for loss.

One lab per mode (srv6, ecmp); h0 -> h2 transfers over the lab's connection (4 paths:
2 planes x 2 T1s) by engines that stamp TSETH (timestamps=1), no health daemon (nothing
brings a retired EV back, so the EV table after the transfer shows every retirement of
the run):

- a T1 blackholed midway with both CPUs busy (a bounded busy loop per core for the
  fault's duration): the EVs retired are those that cross the T1, at most one more;
- one T0-T1 link 4x slower than the others, no fault: no EV retired;
- 5% random loss on one T0-T1 link: only EVs over that link retired.
"""
import multiprocessing
import os
import time
import uuid

import pytest

from test_transfer_lab import _reset_evs, transfer

pytestmark = pytest.mark.skipif(os.geteuid() != 0, reason="the lab needs root")

T1 = "p0t1s1"        # the T1 the faults strike (plane 0, T1 1)
MIN_DROPS = 64       # a fault that struck the transfer, not only its tail


@pytest.fixture(scope="module", params=["srv6", "ecmp"])
def lab(request):
    from mrc_xdp import transport
    from mrc_xdp.lab import fabric, hosts, topology
    from mrc_xdp.lab import linkmodel as lmod
    prefix = "lr%s%s-" % (request.param[0], uuid.uuid4().hex[:4])
    eps = {}
    try:
        st = fabric.up(topology.load(mode=request.param), prefix=prefix, hosts_hook=hosts.fabric_hook)
        topo = fabric.topology_of(st)
        lm = lmod.LinkModel.open(st["pin_dir"])
        for h in ("h0", "h2"):      # TSETH on data: the time-based rule judges the losses
            eps[h] = transport.Endpoint(prefix + h, timestamps=1)
        yield {"prefix": prefix, "topo": topo, "lm": lm, "eps": eps, "mode": request.param}
        lm.close()
    finally:
        for ep in eps.values():
            ep.close()
        fabric.down(prefix, unload_hosts=hosts.unload_all)


@pytest.fixture
def fabric_links(lab):
    """The T0-T1 link ends, restored to their settings (and every EV to GOOD) afterwards."""
    lm, topo = lab["lm"], lab["topo"]
    ends = [(lk, rx) for lk in topo.links if lk.tier == "fabric" for _, rx, _ in lk.ends()]
    saved = {rx.ifindex: lm.get(rx.ifindex) for _, rx in ends}
    _reset_evs(lab)
    _fresh_reorder(lab)
    yield ends
    for ifindex, cfg in saved.items():
        flags = {k: bool(cfg[k]) for k in ("ecn", "trim", "blackhole")}
        lm.update(ifindex, **{k: v for k, v in cfg.items() if k not in ("flags",) + tuple(flags)}, **flags)
    _reset_evs(lab)


def _fresh_reorder(lab):
    """Every connection's reorder window back to its RTT-based width (reo_steps 0), as a
    new connection's: late packets of the case before (on the same connections) widened
    it, and with no traffic between cases nothing narrows it back."""
    from mrc_xdp.datapath import shared
    from mrc_xdp.datapath.maps import Instance
    for h in lab["topo"].hosts:
        with Instance(lab["prefix"] + h.name) as inst:
            m = inst.map("mrc_conns")
            for c in inst.connections():
                raw = shared.ffi.new("struct mrc_conn *")
                shared.ffi.memmove(raw, m.lookup(c["id"]), shared.sizeof("struct mrc_conn"))
                raw.reo_steps, raw.reo_ns = 0, 0
                m.update(c["id"], shared.to_bytes(raw))


def _reorder_state(lab):
    """h0's connection to h2: the datapath's RTT and reorder-window state."""
    from mrc_xdp.datapath.maps import Instance
    with Instance(lab["prefix"] + "h0") as inst:
        c = [c for c in inst.connections() if c["name"] == "h2"][0]
    return {k: c[k] for k in ("min_rtt", "rtt_spread", "reo_wnd", "reo_steps")}


def _rows(lab):
    from mrc_xdp.datapath.maps import Instance
    with Instance(lab["prefix"] + "h0") as inst:
        return [e for e in inst.ev_table() if e["conn_name"] == "h2"]


def _counters(lab):
    from mrc_xdp.datapath.maps import Instance
    with Instance(lab["prefix"] + "h0") as inst:
        return inst.counters()


def _show(rows):
    return [(e["role"], "%#x" % e["ev"], e["plane"], e["t1"], e["state"], e["reason"], e["loss"])
            for e in rows]


def _spin(seconds):
    end = time.monotonic() + seconds
    while time.monotonic() < end:
        pass


def test_t1_blackhole_cpus_loaded(lab, fabric_links):
    """(The fault strikes at the first completion poll that sees 20% done.  With both CPUs
    busy that poll can come only after every packet was sent (completions lag), so the
    fault struck nothing, or only the last few packets, which the engine's RTO resends
    with no later SACK to show their holes, and no EV was retired: a run whose fault
    dropped fewer than MIN_DROPS packets is redone, up to 3 times, on a healed fabric
    with every EV GOOD again.)"""
    lm = lab["lm"]
    fault_s = 1.5

    t1_ends = [rx.ifindex for lk, rx in fabric_links if T1 in (lk.a.node, lk.b.node)]

    def set_t1(dead):
        for ifindex in t1_ends:
            lm.update(ifindex, blackhole=dead)

    def fail(frac):
        if frac >= 0.2 and "t" not in state:
            # a competing busy loop on every core for the fault's duration (bounded)
            ctx = multiprocessing.get_context("fork")
            state["spin"] = [ctx.Process(target=_spin, args=(fault_s,)) for _ in range(os.cpu_count() or 2)]
            for p in state["spin"]:
                p.start()
            set_t1(True)
            state["t"] = time.monotonic()
        elif "t" in state and "healed" not in state and time.monotonic() - state["t"] > fault_s:
            set_t1(False)
            state["healed"] = 1

    def dropped():
        return sum(lm.counters(ifindex)["drop_blackhole"] for ifindex in t1_ends)

    state: dict = {}
    for attempt in range(3):
        state.clear()
        before = dropped()
        try:
            transfer(lab, [("h0", "h2")], 48 << 20, during=fail)
        finally:
            for p in state.get("spin", []):
                p.join(10)
        state["dropped"] = dropped() - before
        if state["dropped"] >= MIN_DROPS:
            break
        set_t1(False)           # the fault came after the last packets were sent: again
        _reset_evs(lab)
    assert state["dropped"] >= MIN_DROPS, \
        "in 3 runs the fault struck only the tail (%d dropped)" % state["dropped"]
    assert "t" in state
    rows = _rows(lab)
    # every row (a list's repr gets cut short)
    show = "dropped by the fault: %d\n" % state["dropped"] + "\n".join(map(str, _show(rows)))
    through = [e for e in rows if (e["plane"], e["t1"]) == (0, 1)]
    # every EV through the dead T1 that carried packets was retired (the active ones all)
    assert through and all(e["state"] == "ASSUMED_BAD" for e in through if e["role"] == "active"), show
    others = [e for e in rows if (e["plane"], e["t1"]) != (0, 1) and e["state"] == "ASSUMED_BAD"]
    assert len(others) <= 1, show
    # the engine stamps TSETH: the time-based rule retired them, not the PSN-distance fallback
    assert all(e["reason"] == "LOSS" for e in rows if e["state"] == "ASSUMED_BAD"), show
    ctr = _counters(lab)
    retired = sum(e["state"] == "ASSUMED_BAD" for e in rows)
    assert ctr["retire_loss"] >= retired and ctr["retire_loss_psn"] == 0, ctr


def test_unequal_rates_no_retire(lab, fabric_links):
    """All T0-T1 links at 1 Gbit/s but one at 250 Mbit/s: its queue builds (ECN, trims),
    which is congestion, not failure: no EV retired over a long transfer."""
    lm = lab["lm"]
    slow = None
    for lk, rx in fabric_links:
        lm.update(rx.ifindex, rate_bps=1_000_000_000)
        if slow is None and T1 in (lk.a.node, lk.b.node) and rx.node == T1:
            slow = rx
    assert slow is not None
    lm.update(slow.ifindex, rate_bps=250_000_000)
    transfer(lab, [("h0", "h2")], 64 << 20)
    rows = _rows(lab)
    assert not [e for e in rows if e["state"] == "ASSUMED_BAD"], _show(rows)


def test_lossy_link_only_its_evs(lab, fabric_links):
    """5% random loss on the T0 -> T1 link into p0t1s1 from h0's T0: EVs over that
    link lose packets and are retired; no EV of another path is.
    (Not 2%: an EV is retired at its second loss since it last delivered (loss_thresh 2,
    every SACK that echoes it restarts the count), so random loss retires it only when
    two of its losses are judged before it delivers again.  Measured here 2026-12-07 over
    32 MiB: at 2%, 2-5 of the link's 6 EVs retired with all 4 active ones crossing it,
    and none in 2 of ~22 runs after the blackhole case (which leaves 2 active ones on
    it), as in two CI runs; at 5%, all 6 in 16 of 16 runs, both modes.)"""
    lm = lab["lm"]
    h0_t0 = "p0t0s%d" % lab["topo"].host("h0").t0
    lossy = [rx for lk, rx in fabric_links if {lk.a.node, lk.b.node} == {h0_t0, T1} and rx.node == T1]
    assert len(lossy) == 1, fabric_links
    lm.update(lossy[0].ifindex, loss_ppm=50_000)
    keys = ("ing_loss", "ing_late", "ing_reo", "retire_loss", "ing_rtt")
    before = _counters(lab)
    drops0 = lm.counters(lossy[0].ifindex)["drop_loss"]
    res = transfer(lab, [("h0", "h2")], 32 << 20)
    rows = _rows(lab)
    ctr = _counters(lab)
    # everything a failure needs to be understood: each EV's losses since the reset, the
    # case's counter deltas, the link's drops, the sender's resends, the reorder state
    show = "\n".join(map(str, [r + (e["losses"],) for r, e in zip(_show(rows), rows)])) + "\n" + str({
        "datapath": {k: ctr[k] - before[k] for k in ctr if k.startswith(keys)},
        "link_drops": lm.counters(lossy[0].ifindex)["drop_loss"] - drops0,
        "sender": {k: v for k, v in res[0]["tx"].items() if "rtx" in k or "rtt" in k or "reo" in k},
        "conn": _reorder_state(lab)})
    bad = [e for e in rows if e["state"] == "ASSUMED_BAD"]
    assert bad, show                       # the lossy link's EVs are found out
    assert all((e["plane"], e["t1"]) == (0, 1) for e in bad), show
