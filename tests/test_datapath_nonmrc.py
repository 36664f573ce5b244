"""Tier 1: traffic that is not MRC leaves every program byte-for-byte unchanged.

Not MRC = not Ethernet | IPv6 | UDP with destination port 4791 at the expected place
(IPv4, ARP, VLAN-tagged, IPv6 TCP, IPv6 UDP to another port, IPv6 extension headers,
runt frames, ...).  Verdict XDP_PASS, output equal to the input, and only the non-MRC
counters move (with the VLAN / IPv4 / extension-header subset counter where it applies).
"""
from __future__ import annotations

import pytest

from helpers import LOCAL_SID, NON_MRC_FRAMES, data, srv6_push, xdp_name


@pytest.mark.parametrize("mode", ["ecmp", "srv6"])
@pytest.mark.parametrize("prog", ["spray", "ingress"])
@pytest.mark.parametrize("name,frame,reason", NON_MRC_FRAMES, ids=[c[0] for c in NON_MRC_FRAMES])
def test_non_mrc_passes_unchanged(datapath, mode, prog, name, frame, reason):
    env = datapath.use(mode)
    ret, out, d = env.run_counted(prog, frame)
    assert (xdp_name(ret), out.hex()) == ("PASS", frame.hex())
    pre = "spray" if prog == "spray" else "ing"
    want = {pre + "_rx": 1, pre + "_non_mrc": 1}
    if reason:
        want[reason] = 1
    assert d == want
    if prog == "spray":
        assert env.psn_entry(0, 5).flags == 0


@pytest.mark.parametrize("prog,mode", [("spray", "ecmp"), ("spray", "srv6"), ("ingress", "ecmp")])
def test_ipv6_in_ipv6_is_not_mrc_outside_srv6_ingress(datapath, prog, mode):
    env = datapath.use(mode)
    f = srv6_push(data(5), "fcbb:bb00:200::1", LOCAL_SID[0], 60)
    ret, out, d = env.run_counted(prog, f)
    assert (xdp_name(ret), out) == ("PASS", f)
    pre = "spray" if prog == "spray" else "ing"
    assert d == {pre + "_rx": 1, pre + "_non_mrc": 1}
