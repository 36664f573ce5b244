"""`mrc-xdp top` driven in tmux against h0 of an ecmp lab: the EV table, a transfer's
packet rates and plane balance, the datapath's events (from the ring without the
daemon, over the socket with it), and the keys: filter by connection, sort, deny and
allow the EV under the cursor (checked in the pinned maps), quit.
"""
from __future__ import annotations

import os
import re
import shutil
import subprocess
import threading
import time
import uuid

import pytest

import health_lab as H

pytestmark = [pytest.mark.skipif(os.geteuid() != 0, reason="the lab needs root"),
              pytest.mark.skipif(not shutil.which("tmux"), reason="tmux is not installed (make setup)")]


@pytest.fixture(scope="module")
def lab():
    with H.lab_up("ecmp", "tp") as lab:
        yield lab


class Tmux:
    def __init__(self, cmd, env):
        self.name = "mrctop%s" % uuid.uuid4().hex[:6]
        envs = ["%s=%s" % kv for kv in env.items()]
        subprocess.run(["tmux", "new-session", "-d", "-s", self.name, "-x", "180", "-y", "60",
                        "env", *envs, *cmd], check=True)

    def screen(self) -> str:
        p = subprocess.run(["tmux", "capture-pane", "-p", "-t", self.name], capture_output=True, text=True)
        return p.stdout

    def keys(self, *k):
        subprocess.run(["tmux", "send-keys", "-t", self.name, *k], check=True)

    def wait(self, pred, timeout=15):
        end = time.monotonic() + timeout
        s = ""
        while time.monotonic() < end:
            s = self.screen()
            if pred(s):
                return s
            time.sleep(0.2)
        raise AssertionError("screen never matched:\n" + s)

    def alive(self) -> bool:
        return subprocess.run(["tmux", "has-session", "-t", self.name], capture_output=True).returncode == 0

    def kill(self):
        subprocess.run(["tmux", "kill-session", "-t", self.name], capture_output=True)


def _rows(screen):
    """(conn name, EV, state, pkt/s) of every table row on the screen."""
    out = []
    for line in screen.splitlines():
        m = re.match(r"\s*(\S+)\s+(0x[0-9a-f]{8})\s+(\d)\s+(\d)\s+(active|backup)\s+(\S+)\s+(\d+)\s", line)
        if m:
            out.append((m.group(1), int(m.group(2), 16), m.group(6), int(m.group(7))))
    return out


def test_top_in_tmux(lab, tmp_path):
    from mrc_xdp.datapath.maps import Instance
    inst = lab["prefix"] + "h0"
    env = {"MRC_XDP_DAEMON_SOCKET": str(tmp_path / "none.sock")}      # no daemon: the ring
    t = Tmux([H.CLI, "top", "-i", inst, "--interval", "0.3"], env)
    try:
        s = t.wait(lambda s: "mrc-xdp top" in s and len(_rows(s)) > 10)
        assert "daemon: not running" in s and "planes:" in s
        with Instance(inst) as i:
            names = {c["id"]: c["name"] for c in i.connections()}
            evs = {(r["conn_name"], r["ev"]) for r in i.ev_table()}
        assert {(n, ev) for n, ev, _, _ in _rows(s)} <= evs

        # filter by connection: the first is conn 0, then 1 (h2), ...
        t.keys("c")
        s = t.wait(lambda s: "conn: 0" in s)
        assert {n for n, _, _, _ in _rows(s)} == {names[0]}
        t.keys("c")
        s = t.wait(lambda s: "conn: 1" in s)
        assert {n for n, _, _, _ in _rows(s)} == {names[1]} == {"h2"}

        # live rates and plane balance during a transfer h0 -> h2 with a T1 failing
        t1 = H.t1_links(lab["topo"], "p1t1s0")
        failed = []

        def fail(frac):
            if frac > 0.3 and not failed:
                H.set_ends(lab, t1, blackhole=True)
                failed.append(1)
        th = threading.Thread(target=H.transfer, args=(lab, "h0", "h2", 48 << 20), kwargs={"during": fail})
        th.start()
        try:
            s = t.wait(lambda s: any(rate > 0 for _, _, _, rate in _rows(s)), 30)
            assert re.search(r"p0\s+\d+\.\d%\s+p1\s+\d+\.\d%", s), s
            s = t.wait(lambda s: "ASSUMED_BAD" in s.split("recent events:")[-1], 60)
        finally:
            th.join(120)
            H.heal_all(lab)

        # sort by EV
        t.keys("s")
        s = t.wait(lambda s: "sort: ev" in s)
        shown = [ev for _, ev, _, _ in _rows(s)]
        assert shown == sorted(shown)
        # deny the EV on the second row, then allow it
        t.keys("j")
        t.keys("d")
        s = t.wait(lambda s: "-> DENIED" in s)
        m = re.search(r"EV (0x[0-9a-f]{8}): \S+ -> DENIED", s)
        assert m, s
        ev = int(m.group(1), 16)
        assert ev == shown[1]
        with Instance(inst) as i:
            row = [r for r in i.ev_table(1) if r["ev"] == ev][0]
        assert row["state"] == "DENIED" and row["reason"] == "OPERATOR"
        t.keys("a")
        t.wait(lambda s: "DENIED -> GOOD" in s)
        with Instance(inst) as i:
            assert [r for r in i.ev_table(1) if r["ev"] == ev][0]["state"] == "GOOD"
        t.keys("q")
        end = time.monotonic() + 5
        while t.alive() and time.monotonic() < end:
            time.sleep(0.1)
        assert not t.alive(), "top did not quit on q"
    finally:
        t.kill()
        from mrc_xdp.datapath.shared import EvState
        with Instance(inst) as i:
            for r in i.ev_table():
                if r["state"] != "GOOD":
                    i.set_ev_state(r["ev"], EvState.GOOD, conn=r["conn"])


def test_top_with_daemon(lab):
    """With the daemon running top takes its events from the daemon's socket (the ring
    has one consumer) and says whose they are; --once prints one frame.  h0's p1 NIC
    down: top says plane 1 is DOWN and shows the daemon's LINK_DOWN event, the metrics
    say plane 1 is out of rotation (0) and plane 0 in (1); up again: both in."""
    from mrc_xdp.datapath.maps import Instance
    inst = lab["prefix"] + "h0"
    d = H.Daemon(lab, background_per_s=0).start()

    def down():
        with Instance(inst) as i:
            return i.planes_down()

    def gauge(text, plane):
        m = re.search(r'mrc_plane_in_rotation\{dev="p%d",mrc_instance="%s",plane="%d"\} (\d)' % (plane, inst, plane), text)
        return m and int(m.group(1))
    try:
        p = H.cli("top", "-i", inst, "--once", env=d.env)
        assert "daemon: pid %d" % d.p.pid in p.stdout, p.stdout
        assert "recent events:" in p.stdout
        assert "DOWN" not in p.stdout.split("recent events:")[0], p.stdout
        H.link_set(lab, "h0", "p1", False)
        assert H.wait_for(lambda: down() == [False, True], 5)
        p = H.cli("top", "-i", inst, "--once", env=d.env)
        assert re.search(r"p1\s+\d+\.\d%\s+DOWN \(out of rotation\)", p.stdout), p.stdout
        assert "plane 1 (p1) link down: LINK_DOWN" in p.stdout, p.stdout
        m = H.cli("metrics", "--once", "-i", inst).stdout
        assert (gauge(m, 0), gauge(m, 1)) == (1, 0), m
        H.link_set(lab, "h0", "p1", True)
        assert H.wait_for(lambda: down() == [False, False], 5)
        m = H.cli("metrics", "--once", "-i", inst).stdout
        assert (gauge(m, 0), gauge(m, 1)) == (1, 1), m
    finally:
        d.kill()
        H.link_set(lab, "h0", "p1", True)
        with Instance(inst) as i:
            i.set_plane_down(1, False)
    p = H.cli("top", "-i", "no-such-instance", "--once", check=False)
    assert p.returncode == 1 and "not loaded" in p.stderr and "Traceback" not in p.stderr
