"""One rank of a torch.distributed job, for tests/test_torch_backend.py: env:// rendezvous
(RANK, WORLD_SIZE, MASTER_ADDR, MASTER_PORT as torchrun sets them), the backend from argv.

    torch_rank.py BACKEND MODE [STEPS]     MODE: ddp | ops | errors | hang
Prints one JSON line: the final parameters' checksum and per-step times (ddp), the failed
checks (ops, errors), or the error that ended it."""
import datetime
import json
import os
import sys
import time

import torch
import torch.distributed as dist
import torch.nn as nn

import mrc_xdp.torch  # noqa: F401  (registers "mrc")

backend, mode = sys.argv[1], sys.argv[2]
steps = int(sys.argv[3]) if len(sys.argv) > 3 else 20
timeout = float(os.environ.get("PG_TIMEOUT", "60"))


def out(**kw):
    print(json.dumps(dict(rank=int(os.environ["RANK"]), **kw)), flush=True)


dist.init_process_group(backend, timeout=datetime.timedelta(seconds=timeout))
r, w = dist.get_rank(), dist.get_world_size()
try:
    if mode == "ddp":
        torch.manual_seed(0)
        model = nn.Sequential(nn.Linear(64, 256), nn.ReLU(), nn.Linear(256, 256), nn.ReLU(), nn.Linear(256, 10))
        ddp = nn.parallel.DistributedDataParallel(model, bucket_cap_mb=1)
        opt = torch.optim.SGD(ddp.parameters(), lr=0.05)
        g = torch.Generator().manual_seed(r)
        times = []
        for _ in range(steps):
            t0 = time.monotonic()
            x = torch.randn(64, 64, generator=g)
            y = torch.randint(0, 10, (64,), generator=g)
            loss = nn.functional.cross_entropy(ddp(x), y)
            opt.zero_grad()
            loss.backward()
            opt.step()
            times.append(time.monotonic() - t0)
        dist.barrier()
        params = torch.cat([p.detach().reshape(-1) for p in model.parameters()])
        out(params=params.tolist()[:64], checksum=float(params.double().sum()), loss=float(loss), times=times)
    elif mode == "ops":
        bad = []
        for dt in (torch.float32, torch.float64, torch.float16, torch.bfloat16, torch.int32, torch.int64, torch.uint8):
            t = (torch.arange(1000) % 7 * (r + 1)).to(dt)
            dist.all_reduce(t)
            if not torch.equal(t, (torch.arange(1000) % 7 * sum(range(1, w + 1))).to(dt)):
                bad.append("all_reduce %s" % dt)
        t = torch.full((5,), float(r))
        dist.all_reduce(t, op=dist.ReduceOp.MAX)
        bad += [] if t[0].item() == w - 1 else ["max"]
        outs = [torch.zeros(4, dtype=torch.int64) for _ in range(w)]
        dist.all_gather(outs, torch.full((4,), r, dtype=torch.int64))
        bad += [] if [int(o[0]) for o in outs] == list(range(w)) else ["all_gather"]
        big = torch.zeros(4 * w)
        dist.all_gather_into_tensor(big, torch.full((4,), float(r)))
        bad += [] if big.tolist() == sum([[float(i)] * 4 for i in range(w)], []) else ["all_gather_into_tensor"]
        o = torch.zeros(3)
        dist.reduce_scatter_tensor(o, torch.arange(3 * w, dtype=torch.float32))
        bad += [] if o.tolist() == [float(w * (3 * r + i)) for i in range(3)] else ["reduce_scatter_tensor"]
        b = torch.full((6,), float(r))
        dist.broadcast(b, src=w - 1)
        bad += [] if b[0].item() == w - 1 else ["broadcast"]
        nc = torch.arange(16, dtype=torch.float32).reshape(4, 4)[:, 1] * (r + 1)   # not contiguous
        dist.all_reduce(nc)
        bad += [] if nc.tolist() == [float((4 * i + 1) * sum(range(1, w + 1))) for i in range(4)] else ["non-contiguous"]
        if r == 0:
            dist.send(torch.arange(8), dst=1)
        elif r == 1:
            got = torch.zeros(8, dtype=torch.int64)
            dist.recv(got, src=0)
            bad += [] if got.tolist() == list(range(8)) else ["send/recv"]
        work = dist.all_reduce(torch.ones(3), async_op=True)
        work.wait()
        bad += [] if work.get_future().value()[0].tolist() == [float(w)] * 3 else ["async future"]
        # a Work nothing in Python references stays alive (C++, e.g. DDP's reducer, still
        # calls into it): the group keeps it
        import gc
        import weakref
        ref = weakref.ref(dist.all_reduce(torch.ones(3), async_op=True))
        gc.collect()
        bad += [] if ref() is not None else ["a Work referenced only from C++ was freed"]
        if ref() is not None:
            ref().wait()
        dist.barrier()
        out(bad=bad)
    elif mode == "errors":
        msgs = []
        for make in (lambda: torch.ones(3, device="meta"), lambda: torch.ones(3, dtype=torch.int16)):
            try:
                dist.all_reduce(make())
                msgs.append("accepted")
            except Exception as e:
                msgs.append(str(e).splitlines()[0])
        try:
            dist.all_reduce(torch.ones(3), op=dist.ReduceOp.PRODUCT)
            msgs.append("accepted")
        except Exception as e:
            msgs.append(str(e).splitlines()[0])
        dist.barrier()
        out(msgs=msgs)
    elif mode == "ddp_hang":          # DDP training steps until a rank is killed
        model = nn.Sequential(nn.Linear(64, 256), nn.ReLU(), nn.Linear(256, 10))
        ddp = nn.parallel.DistributedDataParallel(model, bucket_cap_mb=1)
        opt = torch.optim.SGD(ddp.parameters(), lr=0.05)
        t0, n = time.monotonic(), 0
        while time.monotonic() - t0 < 120:
            loss = nn.functional.cross_entropy(ddp(torch.randn(64, 64)), torch.randint(0, 10, (64,)))
            opt.zero_grad()
            loss.backward()
            opt.step()
            n += 1
            if n == 3:
                open(os.environ["READY_FILE"] + str(r), "w").close()
        out(error="never failed")
    elif mode == "hang":              # every rank all-reduces until one of them is killed
        t = torch.ones(1 << 20)
        dist.all_reduce(t)
        open(os.environ["READY_FILE"] + str(r), "w").close()
        t0 = time.monotonic()
        while time.monotonic() - t0 < 120:
            dist.all_reduce(t)
        out(error="never failed")
except Exception as e:
    out(error="%s: %s" % (type(e).__name__, str(e).splitlines()[0] if str(e) else ""))
    os._exit(3)
dist.destroy_process_group()
