"""Hardening of the lab's control plane (issue 6, defects 3 and 4).

- A lab removes only what it recorded as created: `lab down --prefix P` leaves running
  labs whose prefix starts with P, and unrelated namespaces that match P, untouched and
  names them; `lab up` refuses a prefix that overlaps a lab's and a namespace it would
  have to adopt.
- The record is written before each creation: a lab killed (SIGKILL) right after creating
  a namespace is still removed completely by `down`, and nothing else is.
- The worker processes that load the host datapaths die with a killed `lab up`, and
  `lab down` leaves nothing.

Every case uses its own random prefix; foreign namespaces are created by the test itself.
"""
from __future__ import annotations

import os
import signal
import subprocess
import sys
import time
import uuid

import pytest

from mrc_xdp.datapath import netns
from mrc_xdp.lab import fabric, hosts, topology

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
CLI = [sys.executable, "-m", "mrc_xdp.cli", "lab"]
ENV = dict(os.environ, PYTHONPATH=ROOT)
NOTHING = {"netns": [], "pins": [], "state_file": []}

root = pytest.mark.skipif(os.geteuid() != 0, reason="the lab needs root")


def base() -> str:
    return "r%s" % uuid.uuid4().hex[:6]


def cli(*args, timeout=120) -> subprocess.CompletedProcess:
    return subprocess.run(CLI + list(args), cwd=ROOT, env=ENV, capture_output=True, text=True,
                          timeout=timeout)


def alive(pid: int) -> bool:
    """pid exists and is not a zombie."""
    try:
        with open("/proc/%d/stat" % pid) as f:
            return f.read().rpartition(")")[2].split()[0] != "Z"
    except FileNotFoundError:
        return False


def children(pid: int) -> list[int]:
    """Python processes whose parent is pid (the forked loader workers; not `ip`)."""
    out = []
    for d in os.listdir("/proc"):
        if not d.isdigit():
            continue
        try:
            with open("/proc/%s/stat" % d) as f:
                s = f.read()
        except OSError:
            continue
        comm = s[s.index("(") + 1:s.rindex(")")]
        if int(s.rpartition(")")[2].split()[1]) == pid and comm.startswith("python"):
            out.append(int(d))
    return out


# ------------------------------------------------------------------ prefix rule (no root)
@pytest.mark.parametrize("bad", ["", ".", "..", "a.b", "-x", "_x", "a/b", "a b", "x" * 17, "é", "a\n"])
def test_bad_prefixes_are_refused(bad):
    with pytest.raises(fabric.LabError) as e:
        fabric.check_prefix(bad)
    assert "\n" not in str(e.value)


@pytest.mark.parametrize("good", ["mrc-", "lab_1-", "A", "x" * 16])
def test_good_prefixes(good):
    assert fabric.check_prefix(good) == good


# ------------------------------------------------------------------ defect 3
@root
def test_down_of_a_shorter_prefix_leaves_other_labs_and_foreign_namespaces():
    """The issue's repro: labs <b>x and <b>y run, <b>victim is someone else's namespace;
    `lab down --prefix <b>` must remove none of them and say so; `lab up` of an
    overlapping prefix is refused with one line."""
    b = base()
    labs = [b + "x", b + "y"]
    victim = b + "victim"
    netns.create(victim)
    try:
        for p in labs:
            fabric.up(topology.load(), prefix=p)
        owned = {p: sorted(fabric.load_state(p)["nodes"].values()) for p in labs}

        r = cli("down", "--prefix", b)
        assert r.returncode == 0, r.stderr
        assert netns.exists(victim), "down --prefix %s deleted the foreign %s" % (b, victim)
        for p in labs:
            assert all(netns.exists(n) for n in owned[p]), "down --prefix %s removed lab %s" % (b, p)
            assert fabric.running(p) is not None
        assert victim in r.stdout and "not touch" in r.stdout, r.stdout

        for p in (b, b + "x1"):     # shorter and longer than a running lab's prefix
            r = cli("up", "--prefix", p, "--no-hosts")
            assert r.returncode == 1 and "overlaps" in r.stderr, (p, r.stdout, r.stderr)
            assert len(r.stderr.strip().splitlines()) == 1, r.stderr
            assert not os.path.exists(fabric.state_path(p))
        assert netns.exists(victim)
        assert all(netns.exists(n) for p in labs for n in owned[p])
        assert not [n for n in netns.list_names(b) if n not in owned[labs[0]] + owned[labs[1]] + [victim]]

        # each lab's own down removes exactly its own namespaces
        res = fabric.down(labs[0])
        assert sorted(res["netns"]) == owned[labs[0]]
        assert fabric.running(labs[1]) is not None and netns.exists(victim)
    finally:
        for p in labs:
            fabric.down(p)
        netns.delete(victim)
    for p in labs:
        assert fabric.leftovers(p) == NOTHING


@root
def test_up_refuses_to_adopt_an_existing_namespace():
    """A namespace with a name the lab would create is not the lab's: up stops (one
    line) before building anything, and neither up nor down removes it."""
    p = base() + "-"
    foreign = p + "h3"
    netns.create(foreign)
    try:
        r = cli("up", "--prefix", p, "--no-hosts")
        assert r.returncode == 1 and foreign in r.stderr, (r.stdout, r.stderr)
        assert len(r.stderr.strip().splitlines()) == 1, r.stderr
        assert netns.list_names(p) == [foreign]
        r = cli("down", "--prefix", p)
        assert r.returncode == 0 and netns.exists(foreign), (r.stdout, r.stderr)
    finally:
        fabric.down(p)
        netns.delete(foreign)


@root
def test_kill_9_right_after_a_namespace_is_created_is_still_cleaned():
    """SIGKILL right after the 3rd namespace exists (the record must already name it):
    down removes those 3 and leaves a foreign namespace that matches the prefix."""
    p = base() + "-"
    victim = p + "victim"
    code = ("import os, signal\n"
            "from mrc_xdp import netns\n"
            "from mrc_xdp.lab import fabric, topology\n"
            "orig, n = netns.create, []\n"
            "def create(name, *a, **k):\n"
            "    r = orig(name, *a, **k)\n"
            "    n.append(name)\n"
            "    if len(n) == 3:\n"
            "        os.kill(os.getpid(), signal.SIGKILL)\n"
            "    return r\n"
            "netns.create = create\n"
            "fabric.up(topology.load(), prefix=%r)\n" % p)
    netns.create(victim)
    try:
        r = subprocess.run([sys.executable, "-c", code], cwd=ROOT, env=ENV, capture_output=True,
                           text=True, timeout=60)
        assert r.returncode == -signal.SIGKILL, r.stderr
        made = [n for n in netns.list_names(p) if n != victim]
        assert len(made) == 3, made
        assert fabric.running(p) is None
        res = fabric.down(p)
        assert sorted(res["netns"]) == sorted(made)
        assert netns.list_names(p) == [victim]
        assert victim in res.get("not_touched", [])
    finally:
        fabric.down(p)
        netns.delete(victim)
    assert fabric.leftovers(p) == NOTHING


# ------------------------------------------------------------------ defect 4
@root
def test_kill_9_during_host_loads_leaves_no_worker_and_down_leaves_nothing():
    p = base() + "-"
    victim = p + "victim"
    netns.create(victim)
    proc = subprocess.Popen(CLI + ["up", "--prefix", p], cwd=ROOT, env=ENV, stdout=subprocess.PIPE,
                            stderr=subprocess.PIPE, text=True)
    workers: list[int] = []
    try:
        try:
            for line in proc.stdout:
                if "link model on" in line:     # the fabric is up; the host loads start now
                    break
            t = time.monotonic() + 10
            while not workers and time.monotonic() < t:
                time.sleep(0.05)
                workers = children(proc.pid)
            assert workers, "no loader worker was started"
            time.sleep(0.5)                     # midway through a bcc compile (2-4 s each)
            assert all(alive(w) for w in workers)
        finally:
            proc.send_signal(signal.SIGKILL)
            proc.wait(timeout=10)
        t = time.monotonic() + 2
        while any(alive(w) for w in workers) and time.monotonic() < t:
            time.sleep(0.05)
        assert not [w for w in workers if alive(w)], "workers outlived the killed lab up"
        r = cli("down", "--prefix", p)
        assert r.returncode == 0, r.stderr
    finally:
        fabric.down(p, unload_hosts=hosts.unload_all)
        for w in workers:
            if alive(w):
                os.kill(w, signal.SIGKILL)
        exists = netns.exists(victim)
        netns.delete(victim)
    assert exists, "down removed the foreign namespace %s" % victim
    assert fabric.leftovers(p) == NOTHING
    assert not [d for d in os.listdir(fabric.PIN_ROOT) if d.startswith(p)] \
        if os.path.isdir(fabric.PIN_ROOT) else True


@root
def test_down_ends_the_recorded_workers_and_only_them():
    """A worker recorded in the lab state that still runs (here: one that escaped the
    parent-death signal) is ended by `down`; a recorded pid whose start time differs (the
    pid was reused by another process) is left alone."""
    p = base() + "-"
    kw = dict(stdin=subprocess.DEVNULL, stdout=subprocess.DEVNULL, start_new_session=True)
    ours = subprocess.Popen(["sleep", "60"], **kw)
    other = subprocess.Popen(["sleep", "60"], **kw)
    try:
        rec = fabric.worker_record(other.pid)
        rec["start"] -= 1
        fabric._write_state({"prefix": p, "complete": False, "nodes": {},
                             "created": {"workers": [fabric.worker_record(ours.pid), rec]}})
        res = fabric.down(p)
        assert res["workers_ended"] == [ours.pid]
        assert ours.wait(timeout=2) == -signal.SIGKILL
        assert other.poll() is None
    finally:
        for x in (ours, other):
            x.kill()
            x.wait()
        fabric.down(p)
    assert fabric.leftovers(p) == NOTHING


@root
def test_down_refuses_a_lab_another_live_up_is_building():
    """While a `lab up` is still building (alive, record incomplete), `down` from another
    process says so in one line instead of racing it; once it is gone, down cleans."""
    p = base() + "-"
    code = ("import time\n"
            "from mrc_xdp.lab import fabric, topology\n"
            "def hold(m):\n"
            "    print(m, flush=True)\n"
            "    if 'veth' in m: time.sleep(60)\n"
            "fabric.up(topology.load(), prefix=%r, progress=hold)\n" % p)
    proc = subprocess.Popen([sys.executable, "-c", code], cwd=ROOT, env=ENV, stdout=subprocess.PIPE,
                            text=True)
    try:
        try:
            for line in proc.stdout:
                if "veth" in line:
                    break
            r = cli("down", "--prefix", p)
            assert r.returncode == 1 and "still being built" in r.stderr, (r.stdout, r.stderr)
            assert len(r.stderr.strip().splitlines()) == 1
            assert len(netns.list_names(p)) == 12
        finally:
            proc.kill()
            proc.wait(timeout=10)
        assert len(fabric.down(p)["netns"]) == 12
    finally:
        fabric.down(p)
    assert fabric.leftovers(p) == NOTHING
