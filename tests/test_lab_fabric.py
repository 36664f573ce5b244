"""Tier 2: the netns lab, live, in both modes.

Each lab uses its own random prefix, so it never collides with a user's lab or another
test run, and is torn down by its fixture even when a test fails.  Where a frame went is
read from the link model's per-link counters (mrc_pkts at each receiving end), never
from the sender.
"""
from __future__ import annotations

import contextlib
import io
import json
import os
import signal
import subprocess
import sys
import time
import uuid

import pytest

from mrc_xdp.datapath import netns
from mrc_xdp.cli import lab as cli
from mrc_xdp.lab import fabric, probe, topology
from mrc_xdp.lab import linkmodel as lmod

pytestmark = pytest.mark.skipif(os.geteuid() != 0, reason="the lab needs root")

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def new_prefix(tag: str) -> str:
    return "t%s%s-" % (tag, uuid.uuid4().hex[:5])


@contextlib.contextmanager
def running_lab(mode: str, tag: str):
    prefix = new_prefix(tag)
    try:
        st = fabric.up(topology.load(mode=mode), prefix=prefix)
        topo = fabric.topology_of(st)
        lm = lmod.LinkModel.open(st["pin_dir"])
        try:
            yield prefix, topo, lm
        finally:
            lm.close()
    finally:
        fabric.down(prefix)


@pytest.fixture(scope="module")
def srv6_lab():
    with running_lab("srv6", "s") as lab:
        yield lab


@pytest.fixture(scope="module")
def ecmp_lab():
    with running_lab("ecmp", "e") as lab:
        yield lab


def snap(lm, topo, field="mrc_pkts"):
    return {name: lm.counters(rx.ifindex)[field] for name, rx, _, _ in topo.link_ends()}


def delta(before, after):
    return {k: after[k] - before[k] for k in after if after[k] != before[k]}


def wait_delta(lm, topo, before, total, field="mrc_pkts", end=None, timeout=2.0):
    """Counters after the frames have crossed the fabric (kernel forwarding is async)."""
    t = time.monotonic() + timeout
    while True:
        d = delta(before, snap(lm, topo, field))
        got = d.get(end, 0) if end else sum(d.values())
        if got >= total or time.monotonic() > t:
            time.sleep(0.05)
            return delta(before, snap(lm, topo, field))
        time.sleep(0.02)


def path_ends(nodes):
    return ["%s>%s" % (a, b) for a, b in zip(nodes, nodes[1:])]


# ------------------------------------------------------------------ srv6
def test_srv6_lab_is_built(srv6_lab):
    prefix, topo, lm = srv6_lab
    assert netns.list_names(prefix) == sorted(prefix + n for n in topo.nodes)
    st = fabric.load_state(prefix)
    assert st["complete"] and st["mode"] == "srv6"
    # the link model is attached to every receiving end, ECN off only towards hosts
    for name, rx, _, _ in topo.link_ends():
        assert lmod.xdp_prog_id(rx.ifindex, prefix + rx.node) != 0, name
        assert lm.get(rx.ifindex)["ecn"] == (topo.nodes[rx.node].kind != "host"), name


def test_up_twice_reports_the_running_lab(srv6_lab):
    prefix, topo, _ = srv6_lab
    with pytest.raises(fabric.LabAlreadyUp) as e:
        fabric.up(topo, prefix=prefix)
    assert e.value.state["prefix"] == prefix
    out = io.StringIO()
    with contextlib.redirect_stdout(out):
        assert cli.main(["lab", "up", "--prefix", prefix, "--no-hosts"]) == 0
    assert "already up" in out.getvalue()


@pytest.mark.parametrize("plane", [0, 1])
@pytest.mark.parametrize("t1", [0, 1])
def test_srv6_frame_crosses_exactly_the_t1_its_usid_names(srv6_lab, plane, t1):
    prefix, topo, lm = srv6_lab
    before, before_un = snap(lm, topo), snap(lm, topo, "usid_end")
    f = probe.path_frame(topo, "h0", "h2", plane, t1)
    probe.send(prefix, "h0", "p%d" % plane, [f] * 5)
    want = path_ends(topo.path_nodes("h0", "h2", plane, t1))
    assert want[2] == "p%dt1s%d>p%dt0s1" % (plane, t1, plane)
    d = wait_delta(lm, topo, before, 5, end=want[-1])
    assert d == {e: 5 for e in want}
    # uN done by the kernel (seg6local) or, on kernels without it, by the link model at
    # each switch the frame entered: T0, T1, T0 (the host's end takes block:host::)
    un = delta(before_un, snap(lm, topo, "usid_end"))
    assert un == ({e: 5 for e in want[:3]} if fabric.load_state(prefix)["un"] == "linkmodel" else {})


def test_srv6_un_in_the_link_model_when_forced(monkeypatch):
    monkeypatch.setenv("MRC_LAB_UN", "linkmodel")
    with running_lab("srv6", "u") as (prefix, topo, lm):
        assert fabric.load_state(prefix)["un"] == "linkmodel"
        routes = netns.run_cmd(prefix + "p1t1s0", ["ip", "-6", "route", "show"]).stdout
        own = topo.usid_addr([topo.nodes["p1t1s0"].usid()]) + "/48"     # the T1's uN SID
        assert own == "fcbb:0:1200::/48" and own not in routes and "seg6local" not in routes
        assert "fcbb:0:1100::/48 via" in routes                         # next uSID: T0 0
        before, before_un = snap(lm, topo), snap(lm, topo, "usid_end")
        probe.send(prefix, "h1", "p1", [probe.path_frame(topo, "h1", "h3", 1, 0)] * 4)
        want = path_ends(topo.path_nodes("h1", "h3", 1, 0))
        assert wait_delta(lm, topo, before, 4, end=want[-1]) == {e: 4 for e in want}
        assert delta(before_un, snap(lm, topo, "usid_end")) == {e: 4 for e in want[:3]}
    monkeypatch.setenv("MRC_LAB_UN", "bogus")
    with pytest.raises(fabric.LabError, match="MRC_LAB_UN"):
        fabric.usid_end_where(topology.load(mode="srv6"))


def test_srv6_same_t0_path(srv6_lab):
    prefix, topo, lm = srv6_lab
    before = snap(lm, topo)
    probe.send(prefix, "h3", "p1", [probe.path_frame(topo, "h3", "h2", 1)] * 3)
    d = wait_delta(lm, topo, before, 3, end="p1t0s1>h2")
    assert d == {"h3>p1t0s1": 3, "p1t0s1>h2": 3}


def test_srv6_failed_t1_takes_nothing_and_heals(srv6_lab):
    prefix, topo, lm = srv6_lab
    try:
        assert set(cli.fail(prefix, "p0t1s1")) == {
            "p0t0s0>p0t1s1", "p0t1s1>p0t0s0", "p0t0s1>p0t1s1", "p0t1s1>p0t0s1"}
        drops0 = snap(lm, topo, "drop_blackhole")
        before = snap(lm, topo)
        probe.send(prefix, "h0", "p0", [probe.path_frame(topo, "h0", "h2", 0, 1)] * 4)
        probe.send(prefix, "h0", "p0", [probe.path_frame(topo, "h0", "h2", 0, 0)] * 4)
        d = wait_delta(lm, topo, before, 4, end="p0t0s1>h2")
        assert d["p0t0s1>h2"] == 4 and d["p0t1s0>p0t0s1"] == 4
        assert "p0t1s1>p0t0s1" not in d
        drops = delta(drops0, snap(lm, topo, "drop_blackhole"))
        # (non-MRC chatter, e.g. an MLD report, may also hit the dead links)
        assert 4 <= drops["p0t0s0>p0t1s1"] <= 6
        assert set(drops) <= {"p0t0s0>p0t1s1", "p0t1s1>p0t0s0", "p0t0s1>p0t1s1", "p0t1s1>p0t0s1"}
    finally:
        cli.heal(prefix)
    before = snap(lm, topo)
    probe.send(prefix, "h0", "p0", [probe.path_frame(topo, "h0", "h2", 0, 1)] * 2)
    assert wait_delta(lm, topo, before, 2, end="p0t0s1>h2")["p0t1s1>p0t0s1"] == 2


def test_srv6_trim_delivers_header_only_frame_with_trimmed_dscp(srv6_lab):
    prefix, topo, lm = srv6_lab
    end = "p0t1s0>p0t0s1"
    rx = next(r for n, r, _, _ in topo.link_ends() if n == end)
    saved = lm.get(rx.ifindex)
    f = probe.path_frame(topo, "h0", "h2", 0, 0, payload=bytes(1000))
    try:
        # 8 kbit/s: the first frame fills the phantom queue, the next ones are trimmed
        lm.update(rx.ifindex, rate_bps=8000, trim_bytes=1, ecn_bytes=1, drop_bytes=0)
        lm.set_state(rx.ifindex, 0, 0)
        with probe.Capture(prefix, "h2", "p0") as cap:
            probe.send(prefix, "h0", "p0", [f] * 3)
            got = [g for g in cap.read(timeout=1.0, want=3) if g[12:14] == b"\x86\xdd"]
    finally:
        lm.set(rx.ifindex, saved)
    assert [len(g) for g in got] == [len(f), 138, 138]
    hdr_only = got[1]
    tc_outer = ((hdr_only[14] & 0x0F) << 4) | (hdr_only[15] >> 4)
    tc_inner = ((hdr_only[54] & 0x0F) << 4) | (hdr_only[55] >> 4)
    assert tc_outer >> 2 == tc_inner >> 2 == topo.linkmodel.dscp_trimmed
    assert tc_outer & 3 == 3                      # and CE-marked (ECN on in the fabric)
    assert int.from_bytes(hdr_only[18:20], "big") == 138 - 54
    assert int.from_bytes(hdr_only[58:60], "big") == 138 - 94
    assert hdr_only[94 + 8] == 0xCA               # the BTH survived
    assert hdr_only[62:94] == f[62:94]            # inner addresses unchanged
    assert hdr_only[94:98] == f[94:98] and hdr_only[102:134] == f[102:134]  # ports, BTH..RETH


# ------------------------------------------------------------------ ecmp
@pytest.mark.parametrize("plane", [0, 1])
def test_ecmp_spreads_over_both_t1s_of_the_plane(ecmp_lab, plane):
    prefix, topo, lm = ecmp_lab
    before = snap(lm, topo)
    frames = [probe.path_frame(topo, "h1", "h3", plane, ev=(((0x1000 + 977 * i) & 0xFFFF) | 1) << 16 | i)
              for i in range(64)]
    probe.send(prefix, "h1", "p%d" % plane, frames)
    d = wait_delta(lm, topo, before, 64, end="p%dt0s1>h3" % plane)
    assert d["h1>p%dt0s0" % plane] == 64 and d["p%dt0s1>h3" % plane] == 64
    up0, up1 = d.get("p%dt0s0>p%dt1s0" % (plane, plane), 0), d.get("p%dt0s0>p%dt1s1" % (plane, plane), 0)
    assert up0 + up1 == 64 and up0 >= 10 and up1 >= 10
    assert all(k.startswith("h1>p%d" % plane) or "p%d" % plane in k for k in d)
    assert not any(k.startswith("p%d" % (1 - plane)) or k.endswith("p%dt0s0" % (1 - plane)) for k in d)


def test_ecmp_same_t0(ecmp_lab):
    prefix, topo, lm = ecmp_lab
    before = snap(lm, topo)
    probe.send(prefix, "h0", "p0", [probe.path_frame(topo, "h0", "h1", 0)] * 3)
    assert wait_delta(lm, topo, before, 3, end="p0t0s0>h1") == {"h0>p0t0s0": 3, "p0t0s0>h1": 3}


def test_cli_status_and_errors(ecmp_lab, capsys):
    prefix, topo, lm = ecmp_lab
    assert cli.main(["lab", "status", "--prefix", prefix, "--json"]) == 0
    s = json.loads(capsys.readouterr().out)
    assert s["mode"] == "ecmp" and len(s["links"]) == 32 and len(s["nodes"]) == 12
    assert set(s["links"][0]["counters"]) == set(lmod.CTR_FIELDS)
    assert cli.main(["lab", "status", "--prefix", prefix]) == 0
    text = capsys.readouterr().out
    assert "h0>p0t0s0" in text and "p0t1s1>p0t0s1" in text
    for argv, msg in [
        (["lab", "fail", "--prefix", prefix, "h9"], "no node or link 'h9'"),
        (["lab", "link", "set", "--prefix", prefix, "h0-p0t0s0", "rate", "fast"], "not a rate"),
        (["lab", "link", "set", "--prefix", prefix, "h0-p0t0s0", "loss"], "KEY VALUE pairs"),
        (["lab", "status", "--prefix", "tnope-"], "is not up"),
        (["lab", "exec", "--prefix", prefix, "h7", "--", "true"], "no node 'h7'"),
        (["lab", "exec", "h0", "--prefix", prefix, "true"], "end exec's options with `--`"),
        (["lab", "exec", "h0", "--bogus", "--", "true"], "unknown option --bogus"),
    ]:
        assert cli.main(argv) == 1
        err = capsys.readouterr().err
        assert msg in err and err.count("\n") == 1, err
    assert cli.main(["lab", "link", "set", "--prefix", prefix, "h0-p0t0s0", "rate", "1gbit",
                     "loss", "1%", "flap", "2s", "blackhole", "on"]) == 0
    g = lm.get(topo.port("p0t0s0", "h0").ifindex)
    assert (g["rate_bps"], g["loss_ppm"], g["flap_period_ms"], g["blackhole"]) == (10**9, 10000, 2000, True)
    assert cli.main(["lab", "heal", "--prefix", prefix, "h0-p0t0s0"]) == 0
    g = lm.get(topo.port("h0", "p0").ifindex)
    assert (g["rate_bps"], g["loss_ppm"], g["flap_period_ms"], g["blackhole"]) == (10**9, 0, 0, False)
    assert cli.main(["lab", "link", "set", "--prefix", prefix, "h0-p0t0s0", "rate", "10gbit"]) == 0


def test_cli_exec_runs_in_the_node_namespace(ecmp_lab):
    prefix, topo, lm = ecmp_lab
    r = subprocess.run([sys.executable, "-m", "mrc_xdp.cli.lab", "lab", "exec", "--prefix", prefix,
                        "p1t1s0", "--", "ip", "-o", "link", "show"], cwd=ROOT,
                       capture_output=True, text=True, timeout=30, env=dict(os.environ, PYTHONPATH=ROOT))
    assert r.returncode == 0, r.stderr
    assert "t0s0" in r.stdout and "t0s1" in r.stdout and "mrc0" not in r.stdout
    # exec's options may follow NODE, up to `--`; the command after it is passed verbatim
    r = subprocess.run([sys.executable, "-m", "mrc_xdp.cli", "lab", "exec", "h0", "--prefix", prefix,
                        "--", "sh", "-c", 'echo "$1 $2 $3"; ip -o link show mrc0', "sh", "--prefix", "--", "x"],
                       cwd=ROOT, capture_output=True, text=True, timeout=30, env=dict(os.environ, PYTHONPATH=ROOT))
    assert r.returncode == 0, r.stderr
    assert r.stdout.splitlines()[0] == "--prefix -- x" and "mrc0" in r.stdout, r.stdout


# ------------------------------------------------------------------ lifecycle
def test_down_leaves_nothing():
    prefix = new_prefix("d")
    try:
        fabric.up(topology.load(), prefix=prefix)
        assert fabric.leftovers(prefix)["netns"]
        assert os.path.isdir(fabric.pin_dir(prefix))
    finally:
        res = fabric.down(prefix)
    assert len(res["netns"]) == 12
    assert fabric.leftovers(prefix) == {"netns": [], "pins": [], "state_file": []}
    # and down of a lab that is not up is harmless
    assert fabric.down(prefix)["netns"] == []


def test_down_after_kill_9_midway_removes_everything():
    prefix = new_prefix("k")
    code = ("import sys, time\n"
            "from mrc_xdp.lab import fabric, topology\n"
            "def p(m):\n"
            "    print(m, flush=True)\n"
            "    if 'veth' in m: time.sleep(30)\n"
            "fabric.up(topology.load(), prefix=%r, progress=p)\n" % prefix)
    proc = subprocess.Popen([sys.executable, "-c", code], cwd=ROOT, stdout=subprocess.PIPE,
                            text=True, env=dict(os.environ, PYTHONPATH=ROOT))
    try:
        try:
            for line in proc.stdout:
                if "veth" in line:
                    break
            assert fabric.leftovers(prefix)["netns"]
        finally:
            proc.send_signal(signal.SIGKILL)
            proc.wait(timeout=10)
        # a half-built lab is not "running": status says so, up would clean it first
        assert fabric.running(prefix) is None
    finally:
        fabric.down(prefix)
    assert fabric.leftovers(prefix) == {"netns": [], "pins": [], "state_file": []}


def test_cli_up_gives_the_hosts_their_control_addresses():
    """`mrc-xdp lab up` sets up the TCP bootstrap's control path (as a VM lab's set-up
    does) and names the addresses, so a first `write-bw PEER` needs no hidden step."""
    from mrc_xdp.lab import ctlpath
    prefix = new_prefix("c")
    out = io.StringIO()
    try:
        with contextlib.redirect_stdout(out):
            assert cli.main(["lab", "up", "--prefix", prefix, "--mode", "ecmp", "--no-hosts"]) == 0
        topo = fabric.topology_of(fabric.load_state(prefix))
        want = ctlpath.ctl_addr(topo, 0, "h2")
        assert "h2 %s" % want in out.getvalue(), out.getvalue()
        addrs = netns.run_cmd(prefix + "h2", ["ip", "-6", "-br", "addr", "show", "dev", "p0"]).stdout
        assert want in addrs, addrs
        route = netns.run_cmd(prefix + "h0", ["ip", "-6", "route", "get", want]).stdout
        assert "dev p0" in route, route
    finally:
        fabric.down(prefix)
