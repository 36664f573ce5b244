"""`mrc-xdp lab launch` and the nccl-tests-style tools (`allreduce-perf`, ...), as a
user runs them: the CLI, real rank processes in the lab hosts' namespaces, PyTorch with
the "mrc" backend and with gloo over the lab's control path."""
from __future__ import annotations

import json
import os
import re
import subprocess
import sys
import time
import uuid

import pytest

pytest.importorskip("torch", reason="torch is installed by scripts/setup.sh")

from mrc_xdp.lab import fabric, hosts, topology  # noqa: E402

pytestmark = pytest.mark.skipif(os.geteuid() != 0, reason="the lab needs root")

MRC = [sys.executable, "-m", "mrc_xdp.cli"]


@pytest.fixture(scope="module")
def prefix():
    p = "tl%s-" % uuid.uuid4().hex[:4]
    try:
        from mrc_xdp.lab import ctlpath
        st = fabric.up(topology.load(mode="ecmp"), prefix=p, hosts_hook=hosts.fabric_hook)
        ctlpath.lab_control_path(p, fabric.topology_of(st))
        yield p
    finally:
        fabric.down(p, unload_hosts=hosts.unload_all)


def launch(prefix, *cmd, timeout=300, extra=()):
    return subprocess.run(MRC + ["lab", "launch", "--prefix", prefix, *extra, "--"] + list(cmd),
                          capture_output=True, text=True, timeout=timeout)


def test_launch_sets_torchruns_environment_per_host(prefix):
    r = launch(prefix, "sh", "-c", 'echo "$RANK $WORLD_SIZE $LOCAL_RANK $MASTER_ADDR $MASTER_PORT '
               '$MRC_INSTANCE $(hostname)"', extra=("--hosts", "h2,h0,h1"))
    assert r.returncode == 0, r.stdout + r.stderr
    lines = sorted(l for l in r.stdout.splitlines() if l.startswith("[rank"))
    assert len(lines) == 3, r.stdout
    for line in lines:
        m = re.match(r"\[rank (\d)\] (\d) 3 0 (\S+) 29500 (\S+) (\S+)$", line)
        assert m and m.group(1) == m.group(2), line
        host = ["h2", "h0", "h1"][int(m.group(1))]
        assert m.group(3) == "fd00:100:ff00::3", line           # the master is the first host, h2
        assert m.group(4) == prefix + host, line
    assert "exit status by rank: 0:0 1:0 2:0" in r.stdout


def test_launch_stops_every_rank_when_one_fails_and_on_timeout(prefix):
    t0 = time.monotonic()
    r = launch(prefix, "sh", "-c", '[ "$RANK" = 1 ] && exit 3; sleep 60')
    assert r.returncode == 3, r.stdout + r.stderr
    assert time.monotonic() - t0 < 30
    assert "rank 1 exited with status 3: stopping the others" in r.stdout
    t0 = time.monotonic()
    r = launch(prefix, "sleep", "60", extra=("--timeout", "2"))
    assert r.returncode == 124 and time.monotonic() - t0 < 30, r.stdout
    r = launch(prefix, "true", extra=("--hosts", "h9"))
    assert r.returncode == 1 and "no host h9" in r.stderr and "Traceback" not in r.stderr, r.stderr


@pytest.mark.parametrize("backend", ["mrc", "gloo"])
def test_allreduce_perf_table(prefix, backend):
    r = launch(prefix, sys.executable, "-m", "mrc_xdp.cli", "allreduce-perf", "-b", "1K", "-e", "1M", "-f", "32",
               "-n", "3", "-w", "1", "--backend", backend)
    assert r.returncode == 0, r.stdout[-3000:] + r.stderr[-2000:]
    rows = [l.split()[2:] for l in r.stdout.splitlines() if re.match(r"\[rank 0\]\s+\d+\s+\d+\s+float", l)]
    assert [int(x[0]) for x in rows] == [1024, 32768, 1048576], r.stdout
    for size, count, typ, redop, root, t, algbw, busbw, wrong in rows:
        assert int(count) * 4 == int(size) and redop == "sum" and root == "-1" and wrong == "0"
        assert float(t) > 0 and abs(float(busbw) - 1.5 * float(algbw)) <= 0.002 + 0.01 * float(algbw)
    assert "[rank 0] # Out of bounds values : 0 OK" in r.stdout
    assert "# Avg bus bandwidth" in r.stdout


def test_perf_tools_json_and_other_collectives(prefix):
    for tool in ("allgather-perf", "reducescatter-perf", "bcast-perf"):
        r = launch(prefix, sys.executable, "-m", "mrc_xdp.cli", tool, "-b", "64K", "-e", "64K", "-n", "2",
                   "-w", "1", "-d", "int32", "--json", extra=("--hosts", "h0,h1,h2"))
        assert r.returncode == 0, (tool, r.stdout[-2000:], r.stderr[-2000:])
        doc = json.loads([l for l in r.stdout.splitlines() if l.startswith("[rank 0] {")][0][len("[rank 0] "):])
        assert doc["world_size"] == 3 and doc["wrong"] == 0 and len(doc["rows"]) == 1, doc


def test_perf_tool_outside_a_job_is_one_line():
    r = subprocess.run(MRC + ["allreduce-perf"], capture_output=True, text=True, timeout=120,
                       env={k: v for k, v in os.environ.items() if k not in ("RANK", "WORLD_SIZE")})
    assert r.returncode == 1 and r.stderr.startswith("allreduce-perf: no rank: ") and "Traceback" not in r.stderr, r.stderr
    assert len(r.stderr.strip().splitlines()) == 1, r.stderr


def test_train_demo_runs_and_trains_through_a_t1_failure():
    """`make train-demo` = `mrc-xdp demo --train`: lab up, DDP over "mrc" on 4 hosts, a T1
    failed mid-training, training completes, lab down."""
    r = subprocess.run(MRC + ["demo", "--train", "--steps", "45"], capture_output=True, text=True, timeout=600)
    assert r.returncode == 0, r.stdout[-3000:] + r.stderr[-2000:]
    assert "T1 switch p0t1s1 (plane 0) fails now" in r.stdout
    assert "training went on through the failure" in r.stdout
    assert re.search(r"train_ddp: 45 steps in [\d.]+ s", r.stdout), r.stdout[-2000:]
    assert "lab torn down" in r.stdout
    assert not fabric.running("mrctrain-")
