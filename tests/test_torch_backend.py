"""The torch.distributed backend "mrc" (mrc_xdp/torch.py): real PyTorch (CPU build) in
real rank processes, rendezvous by env:// as torchrun sets it, each rank's collectives
over its lab host's datapath (MRC_INSTANCE).

- every collective DDP and a training script use, the seven dtypes, a non-contiguous
  tensor, async Work with a future;
- DDP, 20 steps over mrc and over gloo from the same seed: the same parameters (to a
  float32 reduction-order tolerance); over mrc again with a T1 blackholed mid-run;
- a rank killed mid-collective: every other rank gets an error within the timeout;
- a non-CPU tensor, an unsupported dtype or op: one clear error.
"""
from __future__ import annotations

import json
import os
import random
import signal
import subprocess
import sys
import time
import uuid

import pytest

torch = pytest.importorskip("torch", reason="torch is installed by scripts/setup.sh")

from mrc_xdp.lab import fabric, hosts, topology  # noqa: E402
from mrc_xdp.lab import linkmodel as lmod  # noqa: E402

pytestmark = pytest.mark.skipif(os.geteuid() != 0, reason="the lab needs root")

HERE = os.path.dirname(os.path.abspath(__file__))
RANK = os.path.join(HERE, "torch_rank.py")


@pytest.fixture(scope="module")
def lab():
    prefix = "tt%s-" % uuid.uuid4().hex[:4]
    try:
        st = fabric.up(topology.load(mode="ecmp"), prefix=prefix, hosts_hook=hosts.fabric_hook)
        lm = lmod.LinkModel.open(st["pin_dir"])
        try:
            yield {"prefix": prefix, "topo": fabric.topology_of(st), "lm": lm}
        finally:
            lm.close()
    finally:
        fabric.down(prefix, unload_hosts=hosts.unload_all)


def launch(lab, backend, mode, world=4, steps=20, pg_timeout=60, during=None, limit=240, ready=None):
    """world ranks of torch_rank.py; returns {rank: its JSON line (or None)}, and the
    processes' return codes."""
    port = random.randint(20000, 40000)
    procs = []
    for r in range(world):
        env = dict(os.environ, RANK=str(r), WORLD_SIZE=str(world), LOCAL_RANK="0",
                   MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port), PG_TIMEOUT=str(pg_timeout),
                   MRC_INSTANCE="%sh%d" % (lab["prefix"], r), READY_FILE=ready or "")
        procs.append(subprocess.Popen([sys.executable, RANK, backend, mode, str(steps)], env=env,
                                      stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True))
    try:
        if during:
            during(procs)
        outs = {}
        deadline = time.monotonic() + limit
        for r, p in enumerate(procs):
            try:
                so, se = p.communicate(timeout=max(1, deadline - time.monotonic()))
            except subprocess.TimeoutExpired:
                pytest.fail("rank %d still running after %d s" % (r, limit))
            lines = [json.loads(l) for l in so.splitlines() if l.startswith("{")]
            outs[r] = (lines[-1] if lines else None, p.returncode, se[-2000:])
        return outs
    finally:
        for p in procs:
            if p.poll() is None:
                p.kill()
                p.wait()


def test_collectives_dtypes_and_async_work(lab):
    res = launch(lab, "mrc", "ops")
    for r, (line, rc, err) in res.items():
        assert rc == 0 and line and line["bad"] == [], (r, line, rc, err)


def test_ddp_matches_gloo(lab):
    mrc = launch(lab, "mrc", "ddp")
    gloo = launch(lab, "gloo", "ddp")
    for r in range(4):
        assert mrc[r][1] == 0 and gloo[r][1] == 0, (mrc[r], gloo[r])
    # every rank of a backend ends with the same parameters, and mrc's equal gloo's
    assert len({round(v[0]["checksum"], 6) for v in mrc.values()}) == 1, mrc
    a, b = mrc[0][0], gloo[0][0]
    assert abs(a["checksum"] - b["checksum"]) <= 1e-4 * max(1.0, abs(b["checksum"])), (a["checksum"], b["checksum"])
    assert all(abs(x - y) <= 1e-5 for x, y in zip(a["params"], b["params"]))


def _t1(lab, on: bool, t1="p0t1s1"):
    for name, rx, _, _ in lab["topo"].link_ends():
        if t1 in name.split(">"):
            lab["lm"].update(rx.ifindex, blackhole=on)


def test_ddp_completes_with_a_t1_blackholed_mid_run(lab):
    def fault(procs):
        time.sleep(6)               # rendezvous done, training under way
        _t1(lab, True)
    try:
        res = launch(lab, "mrc", "ddp", steps=60, during=fault)
    finally:
        _t1(lab, False)
    for r, (line, rc, err) in res.items():
        assert rc == 0 and line and "checksum" in line, (r, line, rc, err)
    assert len({round(v[0]["checksum"], 6) for v in res.values()}) == 1


@pytest.mark.parametrize("mode", ["hang", "ddp_hang"])
def test_a_killed_rank_fails_the_others_within_the_timeout(lab, tmp_path, mode):
    """A rank killed mid-collective (all_reduce in a loop, or DDP training): every other
    rank gets the collective's error within the timeout.  Under DDP the error reaches
    loss.backward() through the allreduce's future: a future that failed must fail in
    C++ too (torch's Future.set_exception completes it with the exception as its value,
    which DDP's reducer read as the bucket and crashed on: SIGSEGV in
    parseCppCommHookResult)."""
    ready = str(tmp_path / "ready")
    killed = []

    def kill(procs):
        deadline = time.monotonic() + 180
        while not all(os.path.exists(ready + str(r)) for r in range(4)):
            assert time.monotonic() < deadline and all(p.poll() is None for p in procs), "ranks never ready"
            time.sleep(0.2)
        time.sleep(1)
        procs[2].send_signal(signal.SIGKILL)
        killed.append(time.monotonic())
    res = launch(lab, "mrc", mode, pg_timeout=20, during=kill, limit=300, ready=ready)
    took = time.monotonic() - killed[0]
    for r in (0, 1, 3):
        line, rc, err = res[r]
        assert rc == 3 and line and "rank" in line["error"], (r, line, rc, err)
    assert took < 2 * 20 + 10, took          # within the timeout (plus exit), never a hang


def test_unsupported_tensors_and_ops_are_clear_errors(lab):
    res = launch(lab, "mrc", "errors", world=2)
    for r, (line, rc, err) in res.items():
        assert rc == 0 and line, (r, rc, err)
        meta, i16, prod = line["msgs"]
        assert "only CPU tensors" in meta, meta
        assert "dtype torch.int16 is not supported" in i16, i16
        assert "reduce op" in prod and "not supported" in prod, prod
