"""The collective library (mrc_xdp.collective) on the netns lab: real ranks in their own
processes, one per lab host, each with its Endpoint on that host's datapath.

Every operation and element type is checked against numpy (integers exactly, floats to a
stated tolerance), at sizes from one element to 16 MiB, for world sizes 2, 3 and 4, in
ecmp and srv6 mode; then the same under faults from the lab's link model (1% loss on
every T0-T1 link, a T1 blackholed mid-collective, a flapping link); a rank killed
mid-collective; and the errors a caller can make (mismatched sizes or types across
ranks, a non-contiguous array).
"""
from __future__ import annotations

import multiprocessing as mp
import os
import signal
import time
import traceback
import uuid

import numpy as np
import pytest

from mrc_xdp.collective import CollectiveError, Communicator, StoreClient, StoreServer
from mrc_xdp.collective.reduce import bf16_to_f32, f32_to_bf16
from mrc_xdp.lab import fabric, hosts, topology
from mrc_xdp.lab import linkmodel as lmod

pytestmark = pytest.mark.skipif(os.geteuid() != 0, reason="the lab needs root")

CTX = mp.get_context("fork")
KiB, MiB = 1024, 1 << 20


@pytest.fixture(scope="module")
def lab():
    yield from _lab("ecmp")


@pytest.fixture(scope="module")
def srv6_lab():
    yield from _lab("srv6")


def _lab(mode):
    prefix = "tc%s%s-" % (mode[0], uuid.uuid4().hex[:4])
    try:
        st = fabric.up(topology.load(mode=mode), prefix=prefix, hosts_hook=hosts.fabric_hook)
        lm = lmod.LinkModel.open(st["pin_dir"])
        try:
            yield {"prefix": prefix, "mode": mode, "topo": fabric.topology_of(st), "lm": lm}
        finally:
            lm.close()
    finally:
        fabric.down(prefix, unload_hosts=hosts.unload_all)


def _rank(fn, rank, world, prefix, port, key, q, kw):
    try:
        store = StoreClient("127.0.0.1", port, timeout=60)
        with Communicator(rank, world, store, "%sh%d" % (prefix, rank), key=key, **kw) as comm:
            q.put((rank, "ok", fn(comm, rank, world)))
    except CollectiveError as e:
        q.put((rank, "CollectiveError", str(e)))
    except Exception:
        q.put((rank, "exception", traceback.format_exc()))


def run_world(lab, world, fn, limit=180, during=None, kill=None, **kw):
    """fn(comm, rank, world) in `world` rank processes on hosts h0..h<world-1>; returns
    {rank: (status, value)}.  during(procs): called in the parent once the ranks run."""
    srv = StoreServer("127.0.0.1", 0)
    q = CTX.Queue()
    key = uuid.uuid4().hex[:8]
    procs = [CTX.Process(target=_rank, args=(fn, r, world, lab["prefix"], srv.port, key, q, kw))
             for r in range(world)]
    for p in procs:
        p.start()
    try:
        if during:
            during(procs)
        out = {}
        deadline = time.monotonic() + limit
        while len(out) < world - (1 if kill is not None else 0):
            left = deadline - time.monotonic()
            assert left > 0, "ranks still running after %d s: %s" % (limit, sorted(out))
            try:
                r, status, val = q.get(timeout=min(left, 5))
            except Exception:
                continue
            out[r] = (status, val)
        return out
    finally:
        for p in procs:
            p.join(10)
            if p.is_alive():
                p.kill()
                p.join()
        srv.close()


def assert_all_ok(res):
    bad = {r: v for r, v in res.items() if v[0] != "ok"}
    assert not bad, bad


# ------------------------------------------------------------------ correctness
SIZES = [1, 7, 1000, 256 * KiB + 3, 16 * MiB // 8]      # elements (the last: 16 MiB of int64)
DTYPES = ["int64", "int32", "uint8", "float32", "float64", "float16", "bfloat16"]


def _data(rank, n, dtype, seed=0):
    """Rank-specific values whose reductions are exact (small integers) in every type."""
    rng = np.random.default_rng(seed * 1000 + rank)
    v = rng.integers(0, 8, n)
    if dtype == "bfloat16":
        out = np.empty(n, np.uint16)
        f32_to_bf16(v.astype(np.float32), out)
        return out
    return v.astype(dtype)


def _as_f64(a, dtype):
    return bf16_to_f32(a).astype(np.float64) if dtype == "bfloat16" else a.astype(np.float64)


def _expect(world, n, dtype, op, seed=0):
    vals = np.stack([_as_f64(_data(r, n, dtype, seed), dtype) for r in range(world)])
    if op == "sum":
        return vals.sum(0)
    if op == "avg":
        s = vals.sum(0)
        return np.floor(s / world) if dtype in ("int64", "int32", "uint8") else s / world
    return vals.min(0) if op == "min" else vals.max(0)


def _storage(dtype):
    return np.uint16 if dtype == "bfloat16" else dtype


def _tol(dtype):
    return {"float16": 1e-2, "bfloat16": 2e-2}.get(dtype, 1e-6)


def _every_op(comm, rank, world):
    """all_reduce (4 ops), reduce_scatter, all_gather, broadcast, send/recv, barrier over
    every type and size; returns the failed cases."""
    bad = []
    for n in SIZES:
        for dtype in DTYPES:
            if n > 300 * KiB and dtype not in ("int64", "float32", "bfloat16"):
                continue            # the largest size for three types keeps the run short
            st = _storage(dtype)
            dt = "bfloat16" if dtype == "bfloat16" else None
            for op in ("sum", "avg", "min", "max"):
                if op in ("min", "avg") and n > 300 * KiB:
                    continue
                a = _data(rank, n, dtype)
                comm.all_reduce(a, op=op, dtype=dt)
                want = _expect(world, n, dtype, op)
                if dtype == "uint8" and op == "sum":
                    want = want % 256
                if not np.allclose(_as_f64(a, dtype), want, rtol=_tol(dtype), atol=0):
                    bad.append(("all_reduce", n, dtype, op))
            inp = np.concatenate([_data(rank, n, dtype, seed=s) for s in range(world)]).astype(st)
            out = np.zeros(n, st)
            comm.reduce_scatter(out, inp, op="max", dtype=dt)
            if not np.allclose(_as_f64(out, dtype), _expect(world, n, dtype, "max", seed=rank)):
                bad.append(("reduce_scatter", n, dtype))
            out = np.zeros(n * world, st)
            comm.all_gather(out, _data(rank, n, dtype), dtype=dt)
            want = np.concatenate([_as_f64(_data(r, n, dtype), dtype) for r in range(world)])
            if not np.array_equal(_as_f64(out, dtype), want):
                bad.append(("all_gather", n, dtype))
            root = n % world
            b = _data(rank, n, dtype)
            comm.broadcast(b, root=root, dtype=dt)
            if not np.array_equal(b, _data(root, n, dtype)):
                bad.append(("broadcast", n, dtype))
    # send/recv around the ring, then a barrier
    a = np.arange(1000, dtype=np.int64) + rank
    got = np.zeros(1000, np.int64)
    if rank % 2 == 0:
        comm.send(a, (rank + 1) % world)
        comm.recv(got, (rank - 1) % world)
    else:
        comm.recv(got, (rank - 1) % world)
        comm.send(a, (rank + 1) % world)
    if not np.array_equal(got, np.arange(1000) + (rank - 1) % world):
        bad.append(("send/recv",))
    comm.barrier()
    return bad


@pytest.mark.parametrize("world", [2, 3, 4])
def test_every_operation_and_type_against_numpy(lab, world):
    res = run_world(lab, world, _every_op, limit=400)
    assert_all_ok(res)
    assert all(v[1] == [] for v in res.values()), res


def test_srv6_every_operation_and_type_against_numpy(srv6_lab):
    res = run_world(srv6_lab, 4, _every_op, limit=400)
    assert_all_ok(res)
    assert all(v[1] == [] for v in res.values()), res


# ------------------------------------------------------------------ faults
def _big_allreduces(comm, rank, world, n=4 * MiB, rounds=4):
    bad = []
    for i in range(rounds):
        a = _data(rank, n, "int64", seed=i)
        comm.all_reduce(a)
        if not np.array_equal(a.astype(np.float64), _expect(world, n, "int64", "sum", seed=i)):
            bad.append(i)
    return bad


def _set_all_t0_t1(lab, **kw):
    for name, rx, _, _ in lab["topo"].link_ends():
        a, b = name.split(">")
        if "t0" in a and "t1" in b or "t1" in a and "t0" in b:
            lab["lm"].update(rx.ifindex, **kw)


def test_under_one_percent_loss(lab):
    _set_all_t0_t1(lab, loss_ppm=10000)
    try:
        res = run_world(lab, 4, _big_allreduces, limit=300)
    finally:
        _set_all_t0_t1(lab, loss_ppm=0)
    assert_all_ok(res)
    assert all(v[1] == [] for v in res.values()), res


def _blackhole_t1(lab, on: bool, t1="p0t1s1"):
    for name, rx, _, _ in lab["topo"].link_ends():
        if t1 in name.split(">"):
            lab["lm"].update(rx.ifindex, blackhole=on)


@pytest.mark.parametrize("mode", ["ecmp", "srv6"])
def test_t1_blackholed_mid_collective(mode, request):
    lab = request.getfixturevalue("lab" if mode == "ecmp" else "srv6_lab")
    def fault(procs):
        time.sleep(3.0)                 # the ranks are set up and all-reducing
        _blackhole_t1(lab, True)
    try:
        res = run_world(lab, 4, lambda c, r, w: _big_allreduces(c, r, w, rounds=8), limit=300,
                        during=fault)
    finally:
        _blackhole_t1(lab, False)
    assert_all_ok(res)
    assert all(v[1] == [] for v in res.values()), res


def test_flapping_link(lab):
    rx = [rx for n, rx, _, _ in lab["topo"].link_ends() if n == "p1t0s0>p1t1s0"][0]
    lab["lm"].update(rx.ifindex, flap_period_ms=200)
    try:
        res = run_world(lab, 4, _big_allreduces, limit=300)
    finally:
        lab["lm"].update(rx.ifindex, flap_period_ms=0)
    assert_all_ok(res)
    assert all(v[1] == [] for v in res.values()), res


def test_rank_killed_mid_collective_fails_the_others_within_the_timeout(lab):
    def loop(comm, rank, world):
        a = np.ones(4 * MiB, np.int64)
        t0 = time.monotonic()
        for _ in range(10_000):
            comm.all_reduce(a)
            if time.monotonic() - t0 > 120:
                break
        return "never failed"

    def kill(procs):
        time.sleep(4.0)
        os.kill(procs[3].pid, signal.SIGKILL)
    t0 = time.monotonic()
    res = run_world(lab, 4, loop, limit=120, during=kill, kill=3, timeout=20)
    assert time.monotonic() - t0 < 90
    for r in (0, 1, 2):
        status, msg = res[r]
        assert status == "CollectiveError", res[r]
        assert "rank" in msg, msg


# ------------------------------------------------------------------ caller errors
def test_mismatched_sizes_and_types_are_errors(lab):
    def mismatched(comm, rank, world):
        a = np.ones(1000 + (rank == 1), np.int64)      # rank 1 passes one element more
        comm.all_reduce(a)
        return "no error"
    res = run_world(lab, 2, mismatched, limit=120)
    assert any(s == "CollectiveError" and "different collective" in m for s, m in res.values()), res

    def types(comm, rank, world):
        a = np.ones(1000, np.int64 if rank == 0 else np.float64)
        comm.all_reduce(a)
        return "no error"
    res = run_world(lab, 2, types, limit=120)
    assert any(s == "CollectiveError" and "different collective" in m for s, m in res.values()), res


def test_non_contiguous_and_unsupported_arrays_are_refused(lab):
    def refused(comm, rank, world):
        out = []
        for bad in (np.ones((4, 4), np.float32)[:, 1], np.ones(4, np.complex64), [1, 2, 3]):
            try:
                comm.all_reduce(bad)
                out.append("accepted %r" % (bad,))
            except (CollectiveError, ValueError) as e:
                out.append(str(e).split(":")[0])
        comm.barrier()              # still usable after a refused call
        return out
    res = run_world(lab, 2, refused, limit=120)
    assert_all_ok(res)
    for r, (_, msgs) in res.items():
        assert not any(m.startswith("accepted") for m in msgs), msgs


def test_qp_retry_budget_covers_the_timeout():
    """A QP's RTO expiries in a row (1 ms doubling to the engine's 500 ms ceiling) last at
    least the communicator's timeout, so a path dead for less than it never errors a QP
    (the engine's own default, 12, gives up after about 2.5 s)."""
    from mrc_xdp.collective.comm import ENGINE_RETRY_LIMIT, ENGINE_RTO_MAX_S, retry_limit_for

    def lasts(n, rto=0.001):
        t = 0.0
        for _ in range(n):
            t += rto
            rto = min(2 * rto, ENGINE_RTO_MAX_S)
        return t
    assert lasts(ENGINE_RETRY_LIMIT) < 3.0
    for timeout in (1, 5, 10, 60, 300, 1800):
        assert lasts(retry_limit_for(timeout)) >= timeout
    assert retry_limit_for(0) == ENGINE_RETRY_LIMIT
