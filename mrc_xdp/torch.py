"""torch.distributed backend "mrc": PyTorch's collectives over the MRC transport.

    import mrc_xdp.torch                      # registers the backend
    torch.distributed.init_process_group("mrc")         # under torchrun, or env://

A thin adapter over ``mrc_xdp.collective.Communicator``: the process group's store is
the rendezvous, the process group's timeout the collectives' timeout.  Each rank's
datapath instance is ``$MRC_INSTANCE`` (``mrc-xdp lab launch`` sets it; default
``default``, the CLI's default instance); ``$MRC_NETNS`` names its namespace when the
instance's own is not wanted.

Work is asynchronous: every call is queued to one worker thread per process group, which
runs the collectives in call order (all ranks call them in the same order) and completes
a ``torch.futures.Future``; the Work returned is made from that future, so DDP's bucket
all-reduces overlap the backward pass.  A failed collective (a peer gone, a QP in error,
nothing for the timeout) completes its future, and every one queued after it, with the
CollectiveError naming the rank and path state: nothing hangs past the timeout.

Supported: allreduce (SUM, AVG, MIN, MAX), allgather and all_gather_into_tensor,
reduce_scatter and reduce_scatter_tensor, broadcast, barrier, send/recv, on CPU tensors
of float32, float64, float16, bfloat16, int32, int64, uint8.  A non-contiguous tensor is
copied to a contiguous one and the result copied back.  Anything else (a GPU tensor,
another op or dtype) raises one clear error at the call: never a silent fallback.
"""
from __future__ import annotations

import collections
import os
import queue
import threading
from datetime import timedelta

import numpy as np
import torch
import torch.distributed as dist
from torch.futures import Future

from mrc_xdp.collective import CollectiveError, Communicator, TorchStore

BACKEND = "mrc"
# Works the group keeps referenced (see ProcessGroupMRC._works)
WORKS_KEPT = 1024

_OPS = {dist.ReduceOp.SUM: "sum", dist.ReduceOp.AVG: "avg", dist.ReduceOp.MIN: "min",
        dist.ReduceOp.MAX: "max"}
_DTYPES = {torch.float32: None, torch.float64: None, torch.float16: None, torch.int32: None,
           torch.int64: None, torch.uint8: None, torch.bfloat16: "bfloat16"}


class MrcBackendError(RuntimeError):
    """A call the mrc backend cannot run (wrong device, dtype or op)."""


def _env_int(name: str, default: int, lo: int, hi: int, multiple: int = 1) -> int:
    """A tuning knob from the environment (see docs/collective.md), checked."""
    v = os.environ.get(name)
    if v is None or v == "":
        return default
    try:
        n = int(v, 0)
    except ValueError:
        n = None
    if n is None or not lo <= n <= hi or n % multiple:
        raise MrcBackendError("mrc backend: %s=%r: expected an integer in %d..%d%s" % (
            name, v, lo, hi, " (a multiple of %d)" % multiple if multiple > 1 else ""))
    return n


def _op(opts) -> str:
    for k, v in _OPS.items():
        if opts.reduceOp == k:
            return v
    raise MrcBackendError("mrc backend: reduce op %s is not supported (SUM, AVG, MIN, MAX)" % opts.reduceOp)


def _check(t: torch.Tensor) -> None:
    if not isinstance(t, torch.Tensor):
        raise MrcBackendError("mrc backend: expected a tensor, got %s" % type(t).__name__)
    if t.device.type != "cpu":
        raise MrcBackendError("mrc backend: tensor on %s: only CPU tensors are supported "
                              "(copy it with .cpu(), or use NCCL for GPU tensors)" % t.device)
    if t.dtype not in _DTYPES:
        raise MrcBackendError("mrc backend: dtype %s is not supported (float32, float64, float16, "
                              "bfloat16, int32, int64, uint8)" % t.dtype)
    if t.is_sparse:
        raise MrcBackendError("mrc backend: sparse tensors are not supported")


class _View:
    """A contiguous numpy view of a tensor (a copy when it is not contiguous, written
    back by done())."""

    def __init__(self, t: torch.Tensor):
        _check(t)
        self.t = t
        self.work = t if t.is_contiguous() else t.contiguous()
        w = self.work.detach()
        if t.dtype == torch.bfloat16:
            self.arr = w.view(torch.int16).numpy().view(np.uint16)
        else:
            self.arr = w.numpy()
        self.dtype = _DTYPES[t.dtype]

    def done(self) -> None:
        if self.work is not self.t:
            with torch.no_grad():
                self.t.copy_(self.work)


def _unwrap(fut: Future):
    return fut.value()          # raises the collective's error


class MrcWork(dist._Work):
    """A collective in flight: wait() blocks until it ran and raises its error (a Work
    made by _create_work_from_future returns True from wait() even when its future
    failed, which would let a training loop run on after a dead peer).

    Two futures: ``_fut``, which the worker completes (with the result, or with the
    CollectiveError through ``set_exception``), and the one ``get_future()`` hands out,
    ``_fut.then(_unwrap)``.  torch's ``Future.set_exception`` completes a future with the
    exception as its *value* (Python unwraps it when read); C++ sees a success, and DDP's
    reducer read that value as the bucket's tensors and crashed (SIGSEGV in
    ``parseCppCommHookResult``, whenever a collective under DDP failed).  A ``then``
    callback that raises fails its future in C++, so DDP raises the error from
    ``backward()`` instead."""

    def __init__(self, fut: Future, timeout: float):
        super().__init__()
        self._fut = fut
        self._out = fut.then(_unwrap)
        self._timeout = timeout

    def wait(self, timeout=None) -> bool:
        self._fut.wait()                # raises the collective's error
        # and the handed-out future too: its callback runs in the worker's thread after
        # _fut completes, so value() right after wait() could find it not yet done
        # (torch's "completed() INTERNAL ASSERT FAILED", seen once in a CI run)
        self._out.wait()
        return True

    def get_future(self) -> Future:
        return self._out

    def is_completed(self) -> bool:
        return self._out.done()

    def is_success(self) -> bool:
        if not self._fut.done():
            return False
        try:
            self._fut.value()
        except Exception:
            return False
        return True

    def exception(self):
        try:
            self._fut.value()
        except Exception as e:
            return e
        return None


class ProcessGroupMRC(dist.ProcessGroup):
    """The process group torch.distributed gets for init_process_group("mrc")."""

    def __init__(self, store, rank: int, world_size: int, timeout: timedelta,
                 instance: str | None = None, netns: str | None = None):
        super().__init__(rank, world_size)
        self._timeout = timeout.total_seconds() if isinstance(timeout, timedelta) else float(timeout)
        inst = instance or os.environ.get("MRC_INSTANCE", "default")
        self.comm = Communicator(rank, world_size, TorchStore(store), inst,
                                 netns=netns or os.environ.get("MRC_NETNS") or None,
                                 timeout=self._timeout, key="mrc-pg",
                                 chunk_bytes=_env_int("MRC_CHUNK_BYTES", 1 << 20, 4096, 1 << 26, multiple=8),
                                 slots=_env_int("MRC_SLOTS", 4, 1, 64))
        self._q: queue.Queue = queue.Queue()
        # A Work handed to C++ (DDP's reducer calls get_future() and wait() on it) is held
        # there by its C++ half only: with no Python reference left, its Python half can be
        # freed while C++ still calls into it (PyTorch's Python process groups keep their
        # Works in a field for this: pytorch/pytorch#79176).  DDP then now and then read
        # another Work's future (a SIGSEGV in parseCppCommHookResult, on a busy machine).
        # The group keeps its most recent Works, which run and complete in call order.
        self._works: collections.deque = collections.deque(maxlen=WORKS_KEPT)
        self._failed: BaseException | None = None
        self._thread = threading.Thread(target=self._worker, name="mrc-pg", daemon=True)
        self._thread.start()

    # ---------------------------------------------------------------- the worker
    def _worker(self) -> None:
        while True:
            item = self._q.get()
            if item is None:
                return
            fn, fut, result = item
            if self._failed is not None:
                fut.set_exception(self._failed)
                continue
            try:
                fn()
            except BaseException as e:             # completes the future: never a hang
                self._failed = e if isinstance(e, CollectiveError) else CollectiveError(
                    "rank %d: %s: %s" % (self.rank(), type(e).__name__, e))
                fut.set_exception(self._failed)
                continue
            fut.set_result(result)

    def _submit(self, fn, result):
        fut = Future()
        work = MrcWork(fut, self._timeout)
        self._works.append(work)
        self._q.put((fn, fut, result))
        return work

    def getBackendName(self) -> str:
        return BACKEND

    @property
    def name(self) -> str:                     # noqa: D401
        return BACKEND

    # ---------------------------------------------------------------- collectives
    def allreduce(self, tensors, opts=None):
        op = _op(opts) if opts is not None else "sum"
        views = [_View(t) for t in tensors]

        def run():
            for v in views:
                self.comm.all_reduce(v.arr, op=op, dtype=v.dtype)
                v.done()
        return self._submit(run, tensors)

    def allgather(self, output_tensors, input_tensors, opts=None):
        if len(input_tensors) != 1:
            raise MrcBackendError("mrc backend: allgather takes one input tensor per rank")
        inp = _View(input_tensors[0])
        outs = [_View(t) for t in output_tensors[0]]
        if len(outs) != self.size():
            raise MrcBackendError("mrc backend: allgather needs world_size (%d) output tensors" % self.size())
        n = inp.arr.size

        def run():
            flat = np.empty(n * self.size(), dtype=inp.arr.dtype)
            self.comm.all_gather(flat, inp.arr, dtype=inp.dtype)
            for r, o in enumerate(outs):
                np.copyto(o.arr.reshape(-1), flat[r * n:(r + 1) * n])
                o.done()
        return self._submit(run, output_tensors)

    def _allgather_base(self, output, input, opts=None):
        out, inp = _View(output), _View(input)

        def run():
            self.comm.all_gather(out.arr, inp.arr, dtype=inp.dtype)
            out.done()
        return self._submit(run, [output])

    # torch 2.13's all_gather_into_tensor / all_gather_single call this name
    all_gather_single = _allgather_base

    def reduce_scatter(self, output_tensors, input_tensors, opts=None):
        op = _op(opts) if opts is not None else "sum"
        out = _View(output_tensors[0])
        ins = [_View(t) for t in input_tensors[0]]
        if len(ins) != self.size():
            raise MrcBackendError("mrc backend: reduce_scatter needs world_size (%d) input tensors" % self.size())

        def run():
            flat = np.concatenate([v.arr.reshape(-1) for v in ins])
            self.comm.reduce_scatter(out.arr, flat, op=op, dtype=out.dtype)
            out.done()
        return self._submit(run, output_tensors)

    def _reduce_scatter_base(self, output, input, opts=None):
        op = _op(opts) if opts is not None else "sum"
        out, inp = _View(output), _View(input)

        def run():
            self.comm.reduce_scatter(out.arr, inp.arr, op=op, dtype=out.dtype)
            out.done()
        return self._submit(run, [output])

    # torch 2.13's reduce_scatter_tensor / reduce_scatter_single call this name
    reduce_scatter_single = _reduce_scatter_base

    def broadcast(self, tensors, opts=None):
        root = opts.rootRank if opts is not None else 0
        views = [_View(t) for t in tensors]

        def run():
            for v in views:
                self.comm.broadcast(v.arr, root=root, dtype=v.dtype)
                v.done()
        return self._submit(run, tensors)

    def barrier(self, opts=None):
        return self._submit(self.comm.barrier, None)

    def send(self, tensors, dst, tag=0):
        views = [_View(t) for t in tensors]

        def run():
            for v in views:
                self.comm.send(v.arr, dst, dtype=v.dtype)
        return self._submit(run, tensors)

    def recv(self, tensors, src, tag=0):
        views = [_View(t) for t in tensors]

        def run():
            for v in views:
                self.comm.recv(v.arr, src, dtype=v.dtype)
                v.done()
        return self._submit(run, tensors)

    def shutdown(self) -> None:
        """Finish what is queued, then free the communicator."""
        if self._thread.is_alive():
            self._q.put(None)
            self._thread.join(self._timeout + 5)
        self.comm.close()


def _create(store, rank, world_size, timeout):
    return ProcessGroupMRC(store, rank, world_size, timeout)


def register() -> None:
    """Register "mrc" with torch.distributed (done at import; again is harmless)."""
    if BACKEND not in dist.Backend.backend_list:
        dist.Backend.register_backend(BACKEND, _create, devices=["cpu"])


register()
