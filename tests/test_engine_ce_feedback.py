"""Tier 2: coalesced CE feedback on the lab (issue 19 item 3).

The receiver coalesces SACKs for CE-marked packets like the rest; each SACK echoes, with
M=SKIP_ONCE, the oldest marked EV it has not echoed yet (engine.c, ce_note).  An ecmp
lab, a 48 MiB transfer h0 -> h2 first on a clean fabric, then with the link model of
p0t0s0 -> p0t1s0 marking every MRC packet (one of the four paths): the receiver sends at
most one SACK per four data packets (the policy: one per ack_every = 8, plus those for
holes and duplicates), and the marked path's share of the sender's packets falls while
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


@pytest.fixture(scope="module")
def lab():
    with H.lab_up("ecmp", "ce") as lab:
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
    # a phantom queue draining at 1 Mbit/s that never trims or drops: every MRC packet
    # over the link is marked, none delayed
    old = lab["lm"].get(end.ifindex)
    lab["lm"].update(end.ifindex, rate_bps=1_000_000, ecn_bytes=0, trim=False, drop_bytes=0, ecn=True)
    try:
        marked, st = _run(lab)
    finally:
        lab["lm"].update(end.ifindex, **{k: old[k] for k in ("rate_bps", "ecn_bytes", "drop_bytes")},
                         trim=bool(old["flags"] & LF_TRIM), ecn=bool(old["flags"] & LF_ECN))
    rx = st["peer"]
    print("clean shares", clean, "marked shares", marked, "receiver: %d data, %d CE, %d SACKs; "
          "sender: %d SACKs, %d ECN" % (rx["rx_pkts"], rx["rx_ce"], rx["sacks_tx"], st["sacks_rx"],
                                       st["sacks_rx_ecn"]))
    assert rx["rx_ce"] > 0.1 * rx["rx_pkts"], rx          # the path did mark
    assert rx["sacks_tx"] <= rx["rx_pkts"] / 4, (rx["sacks_tx"], rx["rx_pkts"])
    assert st["sacks_rx_ecn"] <= st["tx_pkts"] / 4, st
    assert st["sacks_rx_ecn"] > 0, st
    # the marked path's share falls, the other path of its plane takes it (planes stay
    # equally loaded: spray gives them turns, so the other plane's paths keep theirs)
    path = (0, 0)
    assert marked[path] < 0.9 * clean[path], (clean, marked)
    assert marked[(0, 1)] > clean[(0, 1)] + (clean[path] - marked[path]) / 2, (clean, marked)
    for k in ((1, 0), (1, 1)):
        assert abs(marked[k] - clean[k]) < 0.02, (k, clean, marked)

