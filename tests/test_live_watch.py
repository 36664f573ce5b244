"""Watchers of a vanished instance (issue 6, defect 8), on a real loaded datapath.

`stats --watch` and `events --follow` hold the instance's maps open; an open map outlives
its pin, so after `unload` they used to print frozen counters (or wait for events) for
ever.  Now they compare the map they hold with the pinned one: unloaded or replaced ->
one line, exit 1; with --wait-reload they wait for the next load and read its maps.

Synchronisation without sleeps: which map a watcher process holds is read from its
/proc/PID/fdinfo (map_id of each BPF map fd).
"""
import json
import os
import select
import signal
import subprocess
import sys
import time

import pytest

from mrc_xdp.datapath import bpfsys, netns

pytestmark = pytest.mark.skipif(os.geteuid() != 0, reason="needs root (XDP, netns)")

CLI = [sys.executable, "-m", "mrc_xdp.cli"]
LOCAL, PEER = "fd00:79::a", "fd00:79::b"
PIN_ROOT = "/sys/fs/bpf/mrc"


def cli(*args, check=True):
    r = subprocess.run(CLI + list(args), capture_output=True, text=True, timeout=180)
    if check and r.returncode != 0:
        raise AssertionError("mrc-xdp %s failed (%d): %s%s" % (" ".join(args), r.returncode, r.stdout, r.stderr))
    return r


def pinned_id(inst, name):
    fd = bpfsys.obj_get(os.path.join(PIN_ROOT, inst, name))
    try:
        return bpfsys.map_info(fd).id
    finally:
        os.close(fd)


def held_map_ids(pid) -> set:
    ids = set()
    d = "/proc/%d/fdinfo" % pid
    for fd in os.listdir(d):
        try:
            with open(os.path.join(d, fd)) as f:
                for line in f:
                    if line.startswith("map_id:"):
                        ids.add(int(line.split()[1]))
        except OSError:   # closed meanwhile
            pass
    return ids


def wait_for(what, cond, timeout=60):
    end = time.monotonic() + timeout
    while time.monotonic() < end:
        if cond():
            return
        time.sleep(0.05)
    raise AssertionError("timed out waiting for " + what)


class Watcher:
    """A CLI watcher process with stdout and stderr in files (never blocked on a pipe)."""

    def __init__(self, tmp_path, name, args):
        self.out, self.err = tmp_path / (name + ".out"), tmp_path / (name + ".err")
        self.name = name
        self.p = subprocess.Popen(CLI + args, stdout=open(self.out, "w"), stderr=open(self.err, "w"))

    def holds(self, map_id):
        if self.p.poll() is not None:
            raise AssertionError("%s exited (%d): %s" % (self.name, self.p.returncode, self.stderr()))
        return map_id in held_map_ids(self.p.pid)

    def stderr(self):
        return self.err.read_text()

    def json_lines(self):
        return [json.loads(l) for l in self.out.read_text().splitlines() if l.endswith("}")]

    def finish(self, timeout=30):
        try:
            self.p.wait(timeout=timeout)
        except subprocess.TimeoutExpired:
            raise AssertionError("%s still running %d s after the change; stdout %d bytes, stderr %r" % (
                self.name, timeout, self.out.stat().st_size, self.stderr())) from None
        return self.p.returncode

    def kill(self):
        if self.p.poll() is None:
            self.p.kill()
            self.p.wait()


@pytest.fixture
def loaded(tmp_path):
    tag = "%x" % os.getpid()
    ns, inst = "mrcw-" + tag, "tw-" + tag
    netns.create(ns)
    try:
        subprocess.run(["nsenter", "--net=/run/netns/" + ns, "sh", "-ec",
                        "ip link set lo up; ip link add mrc0 type veth peer name mrc0p; "
                        "ip link add p0 type veth peer name q0; "
                        "for d in mrc0 mrc0p p0 q0; do ip link set $d up; done"], check=True)
        cfg = tmp_path / "w.toml"
        cfg.write_text('instance = "%s"\nlocal_addr = "%s"\n[[planes]]\ndev = "p0"\n'
                       'gateway_mac = "02:00:00:00:79:01"\n[[connections]]\npeer = "%s"\n'
                       'local_qpn = 0x1a0\nremote_qpn = 0x1b0\nev_per_plane = 4\nbackup_per_plane = 2\n'
                       % (inst, LOCAL, PEER))
        load = lambda: cli("load", "--config", str(cfg), "--netns", ns)  # noqa: E731
        load()
        yield inst, load
    finally:
        cli("unload", "--instance", inst, check=False)
        netns.delete(ns)


def test_watchers_notice_unload_and_reload(loaded, tmp_path):
    inst, load = loaded
    stats1, events1 = pinned_id(inst, "mrc_stats"), pinned_id(inst, "mrc_events")
    watch = ["stats", "--watch", "0.3", "--json", "--instance", inst]
    follow = ["events", "--follow", "--json", "--instance", inst]
    w = {"stats": Watcher(tmp_path, "stats", watch),
         "events": Watcher(tmp_path, "events", follow),
         "stats_wait": Watcher(tmp_path, "stats_wait", watch + ["--wait-reload"]),
         "events_wait": Watcher(tmp_path, "events_wait", follow + ["--wait-reload"]),
         "stats_stopped": Watcher(tmp_path, "stats_stopped", watch)}
    try:
        for name, x in w.items():
            wait_for(name + " to open the instance",
                     lambda: x.holds(events1 if name.startswith("events") else stats1))
        evs = json.loads(cli("stats", "--json", "--instance", inst).stdout)["evs"]
        ev_x, ev_y = [r["ev"] for r in evs if r["role"] == "active"][:2]
        cli("ev", "deny", hex(ev_x), "--instance", inst)        # in the first instance only
        wait_for("stats_wait to print the denied EV", lambda: any(
            r["ev"] == ev_x and r["state"] == "DENIED" for s in w["stats_wait"].json_lines() for r in s["evs"]))

        # one watcher is stopped across a whole unload + load: it finds other maps pinned
        os.kill(w["stats_stopped"].p.pid, signal.SIGSTOP)
        cli("unload", "--instance", inst)

        # without --wait-reload: one line, exit 1, no traceback
        for name in ("stats", "events"):
            rc, err = w[name].finish(), w[name].stderr()
            assert rc == 1 and err == "mrc-xdp: instance %r was unloaded (its pins are gone): stopped " \
                "watching (--wait-reload follows reloads)\n" % inst, (name, rc, err)
        # with it: they say they wait, and keep running
        for name in ("stats_wait", "events_wait"):
            wait_for(name + " to say it waits", lambda: "waiting for it to be loaded again" in w[name].stderr())
            assert w[name].p.poll() is None

        load()
        stats2, events2 = pinned_id(inst, "mrc_stats"), pinned_id(inst, "mrc_events")
        assert {stats2, events2}.isdisjoint({stats1, events1})
        os.kill(w["stats_stopped"].p.pid, signal.SIGCONT)
        rc, err = w["stats_stopped"].finish(), w["stats_stopped"].stderr()
        assert rc == 1 and err == "mrc-xdp: instance %r was reloaded (its maps were replaced): stopped " \
            "watching (--wait-reload follows reloads)\n" % inst, (rc, err)

        # the waiting watchers now read the new instance's maps, and no longer the old ones
        wait_for("stats_wait to open the new maps", lambda: w["stats_wait"].holds(stats2))
        wait_for("events_wait to open the new ring", lambda: w["events_wait"].holds(events2))
        assert stats1 not in held_map_ids(w["stats_wait"].p.pid)
        assert events1 not in held_map_ids(w["events_wait"].p.pid)
        for name in ("stats_wait", "events_wait"):
            lines = w[name].stderr().splitlines()
            assert lines[-1] == "mrc-xdp: instance %r is loaded again: watching its new maps" % inst, lines
            assert "Traceback" not in w[name].stderr()
        # what stats_wait prints comes from the new maps: EV y denied there, x fresh (GOOD)
        n_before = len(w["stats_wait"].json_lines())
        cli("ev", "deny", hex(ev_y), "--instance", inst)

        def new_state_seen():
            for s in w["stats_wait"].json_lines()[n_before:]:
                st = {r["ev"]: r["state"] for r in s["evs"]}
                if st.get(ev_y) == "DENIED":
                    assert st[ev_x] == "GOOD", st
                    return True
            return False
        wait_for("stats_wait to print the new instance's EV states", new_state_seen)
        assert w["events_wait"].p.poll() is None
    finally:
        for x in w.values():
            if x.p.poll() is None:
                os.kill(x.p.pid, signal.SIGCONT)
            x.kill()
