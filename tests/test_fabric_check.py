"""`mrc-xdp fabric check` localises single faults on the lab, srv6 and ecmp.

Topology: 2 planes x (3 T0 + 2 T1), h0 and h1 on T0 0, h2 on T0 1, h3 on T0 2.  With
three T0s a T1 and each of its links are crossed by different sets of host pairs, and
with two hosts on T0 0 a host link and its T0 are too, so every single fault has one
explanation (in the default topology, two T0s per plane, a T1 and its two links cannot
be told apart by any probe: see fabriccheck's docstring).

Faults, each through the CLI (`lab fail`, `lab link set ... loss`), then `lab heal`:
every T1 blackholed (4), one T0-T1 link with 30% loss both ways, one host link
blackholed, one host link with 30% loss.  `fabric check --json` from every lab host
must name the broken element first with confidence >= 0.5; with no fault it must find
none.  The pure localisation is also checked on the default topology's ambiguity.
"""
from __future__ import annotations

import json
import os

import pytest

import health_lab as H

TOPO3 = {"name": "fc3", "planes": 2, "t0_per_plane": 3, "t1_per_plane": 2,
         "hosts": [{"name": "h0", "t0": 0}, {"name": "h1", "t0": 0}, {"name": "h2", "t0": 1},
                   {"name": "h3", "t0": 2}]}

FAULTS = [("fail", "p0t1s0", "p0t1s0"), ("fail", "p0t1s1", "p0t1s1"), ("fail", "p1t1s0", "p1t1s0"),
          ("fail", "p1t1s1", "p1t1s1"), ("loss", "p0t0s0-p0t1s1", "p0t0s0-p0t1s1"),
          ("fail", "h0-p1t0s0", "h0-p1t0s0"), ("loss", "h2-p0t0s1", "h2-p0t0s1")]


@pytest.fixture(scope="module", params=["srv6", "ecmp"])
def lab(request):
    if os.geteuid() != 0:
        pytest.skip("the lab needs root")
    from mrc_xdp.health import daemon as health
    if health.load_prober() is None:
        pytest.skip("needs probes answered in the datapath (mrc_xdp.health.probe)")
    with H.lab_up(request.param, "fc", TOPO3, endpoints=()) as lab:
        yield lab


def check(lab):
    args = ["fabric", "check", "--json", "--count", "8"]
    for h in lab["topo"].hosts:
        args += ["-i", lab["prefix"] + h.name]
    p = H.cli(*args, timeout=120)
    return json.loads(p.stdout)


def test_no_fault(lab):
    r = check(lab)
    assert r["lab"] == lab["prefix"] and r["evs"] == 4 * 3 * 2 * (8 + 4)
    assert r["lost"] <= r["probes"] * 0.01, r["paths"]
    assert r["no_fault_confidence"] >= 0.5, r["suspects"]


@pytest.mark.parametrize("how,target,expect", FAULTS, ids=[f[1] for f in FAULTS])
def test_single_fault(lab, how, target, expect):
    pre = ["--prefix", lab["prefix"]]
    if how == "fail":
        H.cli("lab", "fail", target, *pre)
    else:
        H.cli("lab", "link", "set", target, "loss", "30%", *pre)
    try:
        r = check(lab)
    finally:
        H.cli("lab", "heal", *pre)
    top = r["suspects"][0] if r["suspects"] else None
    assert top and top["element"] == expect and top["confidence"] >= 0.5, (expect, r["suspects"][:4])
    assert r["no_fault_confidence"] < 0.1
    if how == "loss":
        assert 0.1 <= top["loss_estimate"] <= 0.5, top


def test_default_topology_ambiguity():
    """Two T0s per plane: a dead T1 and its two links explain the same lost probes; the
    check says so (three suspects sharing the confidence, one group) instead of guessing."""
    from mrc_xdp.health import fabriccheck as fc
    from mrc_xdp.lab import topology
    topo = topology.load(mode="ecmp")
    m = fc.LabModel("x-", topo)
    obs = []
    for h in topo.hosts:
        for d in topo.hosts:
            if d is h:
                continue
            for p in range(topo.planes):
                for t in (range(2) if h.t0 != d.t0 else [0]):
                    fwd, backs, _ = m.path("x-" + h.name, d.addr, p, t)
                    for k, b in enumerate(backs):       # every way back once
                        dead = "p0t1s1" in fwd or "p0t1s1" in b
                        obs.append({"instance": "x-" + h.name, "peer": d.addr, "plane": p, "t1": t,
                                    "sent": 8, "answered": 0 if dead else 8})
    r = fc.localise(obs, m)
    assert set(r["groups"][0]) == {"p0t1s1", "p0t0s0-p0t1s1", "p0t0s1-p0t1s1"}, r["suspects"]
    assert all(abs(s["confidence"] - 1 / 3) < 0.02 for s in r["suspects"][:3])
    assert "cannot be told apart" in fc.format_text(dict(r, instances=["x-h0"], lab="x-", evs=len(obs)))
