"""Concurrent loads of one instance leave one datapath that status and unload see
(issue 6, defect 2).

Two `mrc-xdp load` of the same instance start together on a private pair, TRIALS times
(the second 0 s and then about half a compile later).  Exactly one wins; the other fails
with one line (the instance is being loaded by pid N, or is already loaded).  `status`
shows the winner with the programs that really are attached; `unload` then leaves no XDP
program on any device of the pair, no pins and no state file.
"""
from __future__ import annotations

import json
import os
import subprocess
import sys
import time

import pytest

pytestmark = pytest.mark.skipif(os.geteuid() != 0, reason="needs root (XDP, netns)")

CLI = [sys.executable, "-m", "mrc_xdp.cli"]
ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
TRIALS = 3
STAGGER = (0.0, 1.0, 0.3)     # seconds between the two starts, per trial


def cli(*args, env=None):
    return subprocess.run(CLI + list(args), capture_output=True, text=True, timeout=300, cwd=ROOT,
                          env=dict(os.environ, **(env or {})))


@pytest.fixture(autouse=True)
def _compile_every_load(monkeypatch):
    """Every load compiles (MRC_BPF_CACHE=off, inherited by the CLI processes): the
    staggers are set against a compile's length, and a load replayed from the build cache
    is over before a second start 1 s later could meet it."""
    monkeypatch.setenv("MRC_BPF_CACHE", "off")


@pytest.fixture
def pair(tmp_path):
    import harden_pair
    p = harden_pair.Pair(str(tmp_path), "lo")
    try:
        yield p.setup()
    finally:
        cli("unload", "--instance", p.instance)
        p.close()


def test_concurrent_loads_of_one_instance(pair):
    from mrc_xdp.datapath.maps import pin_dir, state_path
    for trial in range(TRIALS):
        argv = CLI + ["load", "--config", pair.toml, "--netns", pair.a, "--json"]
        p1 = subprocess.Popen(argv, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, cwd=ROOT)
        time.sleep(STAGGER[trial % len(STAGGER)])
        p2 = subprocess.Popen(argv, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, cwd=ROOT)
        res = [(p.wait(timeout=300), *p.communicate()) for p in (p1, p2)]
        ok = [r for r in res if r[0] == 0]
        bad = [r for r in res if r[0] != 0]
        assert len(ok) == 1 and len(bad) == 1, "trial %d: exits %s: %s" % (
            trial, [r[0] for r in res], [r[2][-800:] for r in res])
        err = bad[0][2].strip()
        assert bad[0][0] == 1 and len(err.splitlines()) == 1 and "Traceback" not in err, err
        # "is being loaded by pid N", or "... being loaded or unloaded by another process"
        # when the holder has the lock but has not written its pid yet
        assert ("is being loaded" in err or "already loaded" in err), err
        won = json.loads(ok[0][1])

        # status sees the winner, and its programs are the ones attached
        r = cli("status", "--instance", pair.instance, "--json")
        assert r.returncode == 0, "trial %d: status: %s (loser said: %s)" % (trial, r.stderr, err)
        st = json.loads(r.stdout)[0]
        assert st["prog_ids"] == won["prog_ids"] and st["complete"]
        attached = pair.xdp_ids()
        assert attached == {"mrc0": won["prog_ids"]["engine"], "mrc0p": won["prog_ids"]["spray"],
                            "p0": won["prog_ids"]["ingress"], "p1": won["prog_ids"]["ingress"]}, \
            "trial %d: attached %s, loaded %s (loser said: %s)" % (trial, attached, won["prog_ids"], err)

        # unload removes all of it
        r = cli("unload", "--instance", pair.instance)
        assert r.returncode == 0, r.stderr
        assert pair.xdp_ids() == {}, "trial %d: still attached after unload" % trial
        assert not os.path.lexists(pin_dir(pair.instance)) and not os.path.lexists(state_path(pair.instance))
        print("trial %d (second start %.1f s later): loser: %s" % (trial, STAGGER[trial % len(STAGGER)], err))


def test_unload_waits_for_a_load_in_progress(pair):
    """unload takes the lock too: started while a load compiles, it waits for the load to
    finish and then removes that datapath (nothing is left attached)."""
    from mrc_xdp.datapath.maps import pin_dir
    p1 = subprocess.Popen(CLI + ["load", "--config", pair.toml, "--netns", pair.a],
                          stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, cwd=ROOT)
    first = p1.stderr.readline()       # "load: compiling datapath (bcc)": the load is under way
    assert "compiling" in first, first
    r = cli("unload", "--instance", pair.instance)
    out, errs = p1.communicate(timeout=300)
    assert p1.returncode == 0, errs
    assert r.returncode == 0, "unload during the load: %s" % r.stderr
    assert pair.xdp_ids() == {} and not os.path.lexists(pin_dir(pair.instance))


def test_failed_load_removes_what_it_made(pair):
    """A load that fails half-way (native XDP cannot attach to p1 while its veth peer has
    a 9000-byte MTU, after three devices already took theirs) detaches its programs and
    removes its pins, pin directory and state: the instance loads cleanly right after.
    The single-buffer programs (MRC_XDP_FRAGS=0): veth takes frags programs at any MTU."""
    from mrc_xdp.datapath import netns
    from mrc_xdp.datapath.maps import pin_dir, state_path
    netns.run_cmd(pair.b, ["ip", "link", "set", "p1", "mtu", "9000"])
    r = cli("load", "--config", pair.toml, "--netns", pair.a, "--xdp-mode", "native", env={"MRC_XDP_FRAGS": "0"})
    assert r.returncode == 1 and "p1: cannot attach XDP in native mode" in r.stderr, r.stderr
    assert [l for l in r.stderr.splitlines() if not l.startswith("load: ")] == [r.stderr.splitlines()[-1]]
    assert pair.xdp_ids() == {}
    assert not os.path.lexists(pin_dir(pair.instance)) and not os.path.lexists(state_path(pair.instance))
    netns.run_cmd(pair.b, ["ip", "link", "set", "p1", "mtu", "1500"])
    r = cli("load", "--config", pair.toml, "--netns", pair.a)
    assert r.returncode == 0, r.stderr
