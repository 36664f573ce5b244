"""Tier 2: coalesced CE feedback on the lab (issue 19 item 3).

The receiver coalesces SACKs for CE-marked packets like the rest; each SACK echoes, with
M=SKIP_ONCE, the oldest marked EV it has not echoed yet (engine.c, ce_note).  An ecmp
lab, a 48 MiB transfer h0 -> h2 first on a clean fabric, then with the link model of
p0t0s0 -> p0t1s0 marking every MRC packet (one of the four paths): the receiver sends
at most one SACK per four data packets and far fewer SACKs than marked packets (before,
each marked packet had a SACK of its own), and the marked path's share of the sender's packets falls while
the other path of its plane takes it (planes stay equally loaded).
"""
from __future__ import annotations

import collections
import os

import pytest

from mrc_xdp.lab.linkmodel import LF_ECN, LF_TRIM

import health_lab as H

pytestmark = pytest.mark.skipif(os.geteuid() != 0, reason="the lab needs root")

SIZE = 48 << 20
LINK = ("p0t0s0", "p0t1s0")     # h0's plane-0 uplink to T1 0: the path (plane 0, T1 0)


# The sender's window may not shrink below 64 packets: the marks change what it sends
# on, not how fast, so the marked run's packets arrive as densely as the clean run's
# and any SACK the marks added would show (with its window free, NSCC would slow the
# QP to a few packets per RTT, and the 50 us delayed-SACK timer alone would then SACK
# almost every packet, whatever the CE policy).
OPTS = {"cc_min_cwnd": 64 * 1408}


@pytest.fixture(scope="module")
def lab():
    from mrc_xdp import transport
    with H.lab_up("ecmp", "ce", endpoints=()) as lab:
        lab["eps"].update({h: transport.Endpoint(lab["prefix"] + h, **OPTS) for h in ("h0", "h2")})
        yield lab


def _shares(lab):
    """Packets h0 sent to h2 so far per (plane, T1), from its per-EV counters."""
    tot = collections.Counter()
    for r in H.ev_rows(lab, "h0", "h2"):
        tot[(r["plane"], r["t1"])] += r["tx_pkts"]
    return tot


def _run(lab):
    a = _shares(lab)
    st = H.transfer(lab, "h0", "h2", SIZE)
    b = _shares(lab)
    d = {k: b[k] - a[k] for k in b}
    n = sum(d.values())
    return {k: d[k] / n for k in sorted(d)}, st


def test_ce_sacks_coalesced_and_marked_path_avoided(lab):
    link = next(lk for lk in lab["topo"].links if {lk.a.node, lk.b.node} == set(LINK))
    end = next(rx for _, rx, _ in link.ends() if rx.node == LINK[1])
    clean, st0 = _run(lab)
    assert st0["peer"]["rx_ce"] == 0, st0["peer"]
    # a phantom queue draining at 1 Mbit/s that never trims or drops: every MRC packet
    # over the link is marked, none delayed
    old = lab["lm"].get(end.ifindex)
    lab["lm"].update(end.ifindex, rate_bps=1_000_000, ecn_bytes=0, trim=False, drop_bytes=0, ecn=True)
    try:
        marked, st = _run(lab)
    finally:
        lab["lm"].update(end.ifindex, **{k: old[k] for k in ("rate_bps", "ecn_bytes", "drop_bytes")},
                         trim=bool(old["flags"] & LF_TRIM), ecn=bool(old["flags"] & LF_ECN))
    rx, rx0 = st["peer"], st0["peer"]
    per0, per = rx0["sacks_tx"] / rx0["rx_pkts"], rx["sacks_tx"] / rx["rx_pkts"]
    print("clean: shares %s, %.3f SACKs per data packet; marked: shares %s, receiver %d data, "
          "%d CE, %d SACKs (%.3f per data packet), sender %d ECN SACKs" % (
              clean, per0, marked, rx["rx_pkts"], rx["rx_ce"], rx["sacks_tx"], per, st["sacks_rx_ecn"]))
    assert rx["rx_ce"] > 0.1 * rx["rx_pkts"], rx          # the path did mark
    # coalesced: marks add a SACK only for a marked EV waiting to be echoed, and only while
    # the SACKs stay at most one per four data packets (before: one SACK per marked packet)
    assert per <= 0.25, (per0, per)
    assert rx["sacks_tx"] < 0.6 * rx["rx_ce"], (rx["sacks_tx"], rx["rx_ce"])
    assert 0 < st["sacks_rx_ecn"] <= rx["sacks_tx"], st
    # the marked path's share falls, the other path of its plane takes it (planes stay
    # equally loaded: spray gives them turns, so the other plane's paths keep theirs)
    path = (0, 0)
    assert marked[path] < 0.9 * clean[path], (clean, marked)
    assert marked[(0, 1)] > clean[(0, 1)] + (clean[path] - marked[path]) / 2, (clean, marked)
    for k in ((1, 0), (1, 1)):
        assert abs(marked[k] - clean[k]) < 0.02, (k, clean, marked)

