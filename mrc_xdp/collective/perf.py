"""`mrc-xdp allreduce-perf` (and allgather-perf, reducescatter-perf, bcast-perf): the
tables of NVIDIA's nccl-tests, over torch.distributed with the "mrc" backend or gloo, so
both transports are measured by the same code.

One harness owns the sizes, warm-ups, timing, checking and the table; one small function
per collective says how to run it and its bus-bandwidth factor.  time = the mean of -n
timed iterations after -w warm-ups, averaged over the ranks; algbw = bytes / time
(GB/s, 1e9); busbw = algbw x factor: all-reduce 2(n-1)/n, all-gather and reduce-scatter
(n-1)/n with bytes = the whole array, broadcast 1.  Only the in-place form is measured
(torch's collectives write in place); #wrong counts the elements that differ from the
expected result with --check (-c 1).  Rank, world size and rendezvous come from the
variables torchrun and `mrc-xdp lab launch` set (RANK, WORLD_SIZE, MASTER_ADDR,
MASTER_PORT) or the flags.
"""
from __future__ import annotations

import datetime
import json
import os
import re
import sys
import time

DTYPES = ("float32", "float64", "float16", "bfloat16", "int32", "int64", "uint8")
OPS = ("sum", "avg", "min", "max")
_SHORT = {"float32": "float", "float64": "double", "float16": "half", "bfloat16": "bfloat16",
          "int32": "int32", "int64": "int64", "uint8": "uint8"}


class PerfError(RuntimeError):
    pass


def parse_size(v: str) -> int:
    m = re.fullmatch(r"\s*(\d+)\s*([KMG]?)B?\s*", str(v), re.I)
    if not m:
        raise ValueError("size %r: use bytes, or a number with K, M or G" % v)
    return int(m.group(1)) << {"": 0, "K": 10, "M": 20, "G": 30}[m.group(2).upper()]


# ---------------------------------------------------------------- one function per collective
class AllReduce:
    name, root = "all_reduce", -1

    @staticmethod
    def factor(n):
        return 2 * (n - 1) / n

    def __init__(self, torch, dist, count, dtype, op, rank, world):
        self.t = torch.empty(count, dtype=dtype)
        self.dist, self.op, self.rank, self.world, self.torch = dist, op, rank, world, torch

    def fill(self):
        self.t.copy_(_values(self.torch, self.t.numel(), self.rank, self.t.dtype))

    def run(self):
        self.dist.all_reduce(self.t, op=self.op)

    def wrong(self, opname):
        return _count_wrong(self.torch, self.t, self._reduced(self.t.numel(), slice(None), opname))

    def _reduced(self, n, part, opname):
        """What op over every rank's _values(n) must give, on elements `part`."""
        st = self.torch.stack([_values(self.torch, n, r, self.torch.float64) for r in range(self.world)])[:, part]
        want = {"sum": st.sum(0), "avg": st.sum(0) / self.world, "min": st.min(0).values,
                "max": st.max(0).values}[opname]
        if not self.t.dtype.is_floating_point and opname == "avg":
            want = self.torch.floor(want)
        return want

    def nbytes(self):
        return self.t.numel() * self.t.element_size()


class AllGather(AllReduce):
    name = "all_gather"

    @staticmethod
    def factor(n):
        return (n - 1) / n

    def __init__(self, torch, dist, count, dtype, op, rank, world):
        super().__init__(torch, dist, count, dtype, op, rank, world)
        self.per = max(1, count // world)
        self.inp = torch.empty(self.per, dtype=dtype)
        self.t = torch.empty(self.per * world, dtype=dtype)

    def fill(self):
        self.inp.copy_(_values(self.torch, self.inp.numel(), self.rank, self.inp.dtype))

    def run(self):
        self.dist.all_gather_into_tensor(self.t, self.inp)

    def wrong(self, opname):
        want = self.torch.cat([_values(self.torch, self.inp.numel(), r, self.torch.float64)
                               for r in range(self.world)])
        return _count_wrong(self.torch, self.t, want)


class ReduceScatter(AllGather):
    name = "reduce_scatter"

    def __init__(self, torch, dist, count, dtype, op, rank, world):
        super().__init__(torch, dist, count, dtype, op, rank, world)
        self.inp, self.out = self.t, self.inp        # in: world x per (filled), out: per

    def run(self):
        self.dist.reduce_scatter_tensor(self.out, self.inp, op=self.op)

    def wrong(self, opname):
        mine = slice(self.rank * self.per, (self.rank + 1) * self.per)
        return _count_wrong(self.torch, self.out, self._reduced(self.inp.numel(), mine, opname))


class Broadcast(AllReduce):
    name, root = "broadcast", 0

    @staticmethod
    def factor(n):
        return 1.0

    def run(self):
        self.dist.broadcast(self.t, src=0)

    def wrong(self, opname):
        return _count_wrong(self.torch, self.t, _values(self.torch, self.t.numel(), 0, self.torch.float64))


COLLECTIVES = {"allreduce-perf": AllReduce, "allgather-perf": AllGather,
               "reducescatter-perf": ReduceScatter, "bcast-perf": Broadcast}


def _values(torch, n, rank, dtype):
    """Small integers (exact in every type, also summed over 8 ranks of uint8)."""
    return ((torch.arange(n, dtype=torch.int64) + 3 * rank) % 7 + rank % 3).to(dtype)


def _count_wrong(torch, got, want):
    g = got.to(torch.float64)
    tol = 1e-2 if got.dtype in (torch.float16, torch.bfloat16) else 1e-6
    return int((~torch.isclose(g, want.to(torch.float64), rtol=tol, atol=0)).sum())


# ---------------------------------------------------------------- the harness
def run(args, out=sys.stdout) -> int:
    try:
        import torch
        import torch.distributed as dist
    except ImportError:
        raise PerfError("needs PyTorch: run `make setup` (it installs torch==2.13.0)") from None
    if args.backend == "mrc":
        import mrc_xdp.torch  # noqa: F401  (registers the backend)
    env = os.environ
    rank = args.rank if args.rank is not None else int(env.get("RANK", "-1"))
    world = args.world_size if args.world_size is not None else int(env.get("WORLD_SIZE", "0"))
    if rank < 0 or world < 1:
        raise PerfError("no rank: run it under `mrc-xdp lab launch` or torchrun, or pass --rank and "
                        "--world-size with --master-addr/--master-port")
    if args.master_addr:
        os.environ["MASTER_ADDR"] = args.master_addr
    if args.master_port:
        os.environ["MASTER_PORT"] = str(args.master_port)
    if args.instance:
        os.environ["MRC_INSTANCE"] = args.instance
    for k in ("MASTER_ADDR", "MASTER_PORT"):
        if not os.environ.get(k):
            raise PerfError("%s is not set (torchrun and `mrc-xdp lab launch` set it)" % k)
    dtype = getattr(torch, args.dtype)
    op = {"sum": dist.ReduceOp.SUM, "avg": dist.ReduceOp.AVG, "min": dist.ReduceOp.MIN,
          "max": dist.ReduceOp.MAX}[args.op]
    if args.backend == "gloo" and args.op == "avg":
        raise PerfError("gloo has no AVG reduction: use -o sum")
    dist.init_process_group(args.backend, rank=rank, world_size=world,
                            timeout=datetime.timedelta(seconds=args.timeout))
    cls = COLLECTIVES[args.tool]
    rows = []
    try:
        size = args.minbytes
        isz = torch.empty(0, dtype=dtype).element_size()
        lead = rank == 0
        if lead:
            _header(out, args, world, cls)
        while size <= args.maxbytes:
            count = max(1, size // isz)
            c = cls(torch, dist, count, dtype, op, rank, world)
            for _ in range(args.warmup_iters):
                c.fill()
                c.run()
            dist.barrier()
            t0 = time.perf_counter()
            for _ in range(args.iters):
                c.run()
            dt = (time.perf_counter() - t0) / max(1, args.iters)
            tt = torch.tensor([dt], dtype=torch.float64)
            dist.all_reduce(tt)
            t_us = tt.item() / world * 1e6
            wrong = 0
            if args.check:
                c.fill()
                c.run()
                w = torch.tensor([c.wrong(args.op)], dtype=torch.int64)
                dist.all_reduce(w)
                wrong = int(w.item())
            nbytes = c.nbytes()
            algbw = nbytes / (t_us * 1e-6) / 1e9
            row = {"size": nbytes, "count": c.t.numel(), "type": args.dtype, "redop": args.op
                   if cls in (AllReduce, ReduceScatter) else "none", "root": cls.root, "time_us": t_us,
                   "algbw": algbw, "busbw": algbw * cls.factor(world), "wrong": wrong if args.check else None}
            rows.append(row)
            if lead and not args.json:
                out.write("%12d  %12d  %8s  %6s  %6d  %9.1f  %7.3f  %7.3f  %6s\n" % (
                    row["size"], row["count"], _SHORT[args.dtype], row["redop"], row["root"], t_us,
                    algbw, row["busbw"], "N/A" if row["wrong"] is None else row["wrong"]))
                out.flush()
            size *= args.stepfactor
            if args.stepfactor <= 1:
                break
        bad = sum(r["wrong"] or 0 for r in rows)
        avg = sum(r["busbw"] for r in rows) / max(1, len(rows))
        if lead:
            if args.json:
                out.write(json.dumps({"tool": args.tool, "backend": args.backend, "world_size": world,
                                      "rows": rows, "avg_busbw": avg, "wrong": bad}) + "\n")
            else:
                out.write("# Out of bounds values : %d %s\n" % (bad, "OK" if not bad else "FAILED"))
                out.write("# Avg bus bandwidth    : %g\n#\n" % avg)
        return 1 if bad else 0
    finally:
        try:
            dist.barrier()
        except Exception:
            pass
        dist.destroy_process_group()


def _header(out, args, world, cls):
    if args.json:
        return
    out.write("# %s: backend %s, %d ranks, -b %d -e %d -f %d -n %d -w %d -d %s -o %s -c %d\n" % (
        args.tool, args.backend, world, args.minbytes, args.maxbytes, args.stepfactor, args.iters,
        args.warmup_iters, args.dtype, args.op, 1 if args.check else 0))
    out.write("#%70s\n" % "in-place")
    out.write("# %10s  %12s  %8s  %6s  %6s  %9s  %7s  %7s  %6s\n" % (
        "size", "count", "type", "redop", "root", "time", "algbw", "busbw", "#wrong"))
    out.write("# %10s  %12s  %8s  %6s  %6s  %9s  %7s  %7s  %6s\n" % (
        "(B)", "(elements)", "", "", "", "(us)", "(GB/s)", "(GB/s)", ""))
