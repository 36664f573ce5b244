"""Tier 2: EV probes on two hosts back to back (test_live_pair's `pair`), loaded with the
real CLI, no engine: Prober().probe() gets RTTs for a GOOD, an ASSUMED_BAD and a backup EV
(answered by the peer's XDP, recorded by ours), nothing for a DENIED EV (spray never
sends it) nor for an EV whose plane is blackholed (a tiny XDP drop program in place of the
peer's ingress on that plane's veth).  Operator changes made through the pins appear in
the event ring.
"""
import os
import warnings

import pytest

from mrc_xdp.datapath import bpfsys, maps, netns
from mrc_xdp.health import daemon as health
from mrc_xdp.health.probe import Prober
from mrc_xdp.datapath.shared import EvReason, EvState, ffi
from test_live_pair import B_ADDR, cli, pair  # noqa: F401  (pair: the fixture)

pytestmark = pytest.mark.skipif(os.geteuid() != 0, reason="needs root (XDP, netns)")


def _drop_on(ns, dev):
    """Replace the XDP program of dev (in ns) with one that drops everything."""
    from bcc import BPF
    from mrc_xdp.datapath import kheaders
    kheaders.ensure()
    netns.run_cmd(ns, ["ip", "link", "set", "dev", dev, "xdp", "off"])
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", DeprecationWarning)
        b = BPF(text="int drop_all(struct xdp_md *ctx) { return XDP_DROP; }")
    fn = b.load_func(b"drop_all", BPF.XDP)
    with netns.enter(ns):
        b.attach_xdp(dev.encode(), fn, 1 << 2)       # XDP_FLAGS_DRV_MODE
    return b


def test_probe_rtts_on_a_pair(pair):
    cli("load", "--config", pair["ta"], "--netns", pair["a"])
    cli("load", "--config", pair["tb"], "--netns", pair["b"])
    ia, ib = pair["ia"], pair["ib"]
    with maps.Instance(ia) as inst:
        rows = inst.ev_table(0)
        act = {p: [r["ev"] for r in rows if r["plane"] == p and r["role"] == "active"] for p in (0, 1)}
        backup = next(r["ev"] for r in rows if r["plane"] == 0 and r["role"] == "backup")
        good, bad, denied, dead = act[0][0], act[0][1], act[0][2], act[1][0]
        ring_events = []
        ring = bpfsys.RingReader(inst.map("mrc_events").fd, ring_events.append)
        ring.poll(0)
        ring_events.clear()
        assert inst.set_ev_state(bad, EvState.ASSUMED_BAD, conn=0)["new"] == "ASSUMED_BAD"
        inst.set_ev_state(denied, EvState.DENIED, conn=0)
        ring.poll(100)
        got = [ffi.cast("struct mrc_event *", ffi.from_buffer(b)) for b in ring_events]
        assert [(e.ev, e.new_state, e.reason) for e in got] == [
            (bad, EvState.ASSUMED_BAD, EvReason.OPERATOR), (denied, EvState.DENIED, EvReason.OPERATOR)]
        ring.close()

        prober = health.load_prober()
        assert isinstance(prober, Prober), "the daemon finds this prober"
        dropper = None
        try:
            res = {name: prober.probe(ia, 0, ev, count=3, timeout=1.0)
                   for name, ev in (("good", good), ("assumed_bad", bad), ("backup", backup))}
            res["peer"] = prober.probe_peer(ia, B_ADDR, good, count=2, timeout=1.0)
            res["denied"] = prober.probe(ia, 0, denied, count=1, timeout=0.2)
            for name in ("good", "assumed_bad", "backup", "peer"):
                assert all(r is not None and 0 < r < 1.0 for r in res[name]), (name, res)
            assert res["denied"] == [None]
            # blackhole plane 1 at the peer: a probe on an EV of plane 1 gets no answer
            before = prober.probe(ia, 0, dead, count=1, timeout=1.0)
            assert before[0] is not None, "plane 1 answers before the blackhole"
            dropper = _drop_on(pair["b"], "p1")
            assert prober.probe(ia, 0, dead, count=2, timeout=0.3) == [None, None]
            assert prober.probe(ia, 0, good, count=1, timeout=1.0)[0] is not None, "plane 0 still answers"
            many = prober.probe_many([(ia, 0, good), (ia, 0, dead), (ia, 0, bad)], count=2, timeout=0.5)
            assert [[r is not None for r in x] for x in many] == [[True, True], [False, False], [True, True]]
        finally:
            prober.close()
            if dropper is not None:
                dropper.cleanup()
        assert EvState[inst.ev_table(0)[[r["ev"] for r in inst.ev_table(0)].index(bad)]["state"]] == \
            EvState.ASSUMED_BAD, "probing changes no EV state"
        ca, cb = inst.counters(), maps.Instance(ib).counters()
        answered = 3 * 3 + 2 + 1 + 1 + 2 * 2
        assert ca["spray_probe"] == answered + 2 + 2 and ca["spray_probe_denied"] == 1
        assert cb["ing_probe_answered"] == answered and cb["ing_probe_not_peer"] == 0
        assert ca["ing_probe_ans"] == answered and ca["ing_probe_ans_unknown"] == 0
        assert list(inst.map("mrc_probes").keys()) == [], "every probe entry was removed"
        # the peer's answer limit, set through its pins: no answers at rate 0
        with maps.Instance(ib) as peer:
            assert peer.probe_limit() == {"rate": maps.PROBE_RATE_DEFAULT, "burst": maps.PROBE_BURST_DEFAULT}
            peer.set_probe_limit(0, 1)
            with Prober() as p2:
                assert p2.probe(ia, 0, good, count=1, timeout=0.3) == [None]
            assert peer.counters()["ing_probe_rate"] == 1
