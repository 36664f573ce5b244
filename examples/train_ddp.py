#!/usr/bin/env python3
"""Train a small character-level transformer with DistributedDataParallel.

The data is real text that ships with the repository (README.md and docs/*.md, read as
bytes), so nothing is downloaded.  Each rank draws its own batches; DDP all-reduces the
gradients every step over the chosen backend:

    mrc-xdp lab launch -- .venv/bin/python examples/train_ddp.py --backend mrc
    mrc-xdp lab launch -- .venv/bin/python examples/train_ddp.py --backend gloo

Rank, world size and the rendezvous come from the environment torchrun (or
`mrc-xdp lab launch`) sets.  Rank 0 prints loss, step time and samples/s every
--log-every steps and, with --json, one JSON line at the end with every step's time.
"""
from __future__ import annotations

import argparse
import datetime
import glob
import json
import math
import os
import sys
import time

import torch
import torch.distributed as dist
import torch.nn as nn
import torch.nn.functional as F

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def corpus() -> torch.Tensor:
    files = [os.path.join(ROOT, "README.md")] + sorted(glob.glob(os.path.join(ROOT, "docs", "*.md")))
    data = b"\n".join(open(f, "rb").read() for f in files if os.path.exists(f))
    if len(data) < 10_000:
        sys.exit("train_ddp: the repository's text is missing (README.md, docs/*.md)")
    return torch.frombuffer(bytearray(data), dtype=torch.uint8).long()


class Block(nn.Module):
    def __init__(self, d: int, heads: int):
        super().__init__()
        self.ln1, self.ln2 = nn.LayerNorm(d), nn.LayerNorm(d)
        self.attn = nn.MultiheadAttention(d, heads, batch_first=True)
        self.mlp = nn.Sequential(nn.Linear(d, 4 * d), nn.GELU(), nn.Linear(4 * d, d))

    def forward(self, x, mask):
        h = self.ln1(x)
        x = x + self.attn(h, h, h, attn_mask=mask, need_weights=False)[0]
        return x + self.mlp(self.ln2(x))


class CharTransformer(nn.Module):
    """Bytes in, next-byte logits out."""

    def __init__(self, ctx: int, d: int = 128, layers: int = 2, heads: int = 4):
        super().__init__()
        self.emb = nn.Embedding(256, d)
        self.pos = nn.Parameter(torch.zeros(ctx, d))
        self.blocks = nn.ModuleList(Block(d, heads) for _ in range(layers))
        self.out = nn.Linear(d, 256)
        self.register_buffer("mask", torch.triu(torch.full((ctx, ctx), float("-inf")), 1), persistent=False)

    def forward(self, idx):
        x = self.emb(idx) + self.pos[: idx.shape[1]]
        for b in self.blocks:
            x = b(x, self.mask[: idx.shape[1], : idx.shape[1]])
        return self.out(x)


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--backend", choices=["mrc", "gloo"], default="mrc")
    ap.add_argument("--steps", type=int, default=100)
    ap.add_argument("--batch", type=int, default=16, help="sequences per rank and step")
    ap.add_argument("--ctx", type=int, default=64, help="context length (bytes)")
    ap.add_argument("--width", type=int, default=128)
    ap.add_argument("--lr", type=float, default=3e-3)
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--log-every", type=int, default=10)
    ap.add_argument("--timeout", type=float, default=300, help="collective timeout, seconds")
    ap.add_argument("--json", action="store_true", help="one JSON line with every step's time at the end")
    args = ap.parse_args()
    if args.backend == "mrc":
        import mrc_xdp.torch  # noqa: F401  (registers the "mrc" backend)
    torch.set_num_threads(1)
    dist.init_process_group(args.backend, timeout=datetime.timedelta(seconds=args.timeout))
    rank, world = dist.get_rank(), dist.get_world_size()
    text = corpus()
    torch.manual_seed(args.seed)
    model = CharTransformer(args.ctx, args.width)
    ddp = nn.parallel.DistributedDataParallel(model)
    opt = torch.optim.AdamW(ddp.parameters(), lr=args.lr)
    gen = torch.Generator().manual_seed(args.seed * 1000 + rank)
    nparams = sum(p.numel() for p in model.parameters())
    if rank == 0:
        print("train_ddp: %s backend, %d ranks, %d parameters, %d bytes of text, batch %d x %d per rank"
              % (args.backend, world, nparams, text.numel(), args.batch, args.ctx), flush=True)
    times, losses = [], []
    t_start = time.monotonic()
    for step in range(1, args.steps + 1):
        t0 = time.monotonic()
        starts = torch.randint(0, text.numel() - args.ctx - 1, (args.batch,), generator=gen)
        x = torch.stack([text[s: s + args.ctx] for s in starts])
        y = torch.stack([text[s + 1: s + args.ctx + 1] for s in starts])
        loss = F.cross_entropy(ddp(x).reshape(-1, 256), y.reshape(-1))
        opt.zero_grad(set_to_none=True)
        loss.backward()
        opt.step()
        dt = time.monotonic() - t0
        times.append(dt)
        losses.append(loss.item())
        if rank == 0 and (step % args.log_every == 0 or step == 1):
            recent = times[-args.log_every:]
            print("step %4d  loss %.3f  (%.2f bits/byte)  step %6.1f ms  %7.1f samples/s"
                  % (step, loss.item(), loss.item() / math.log(2), 1e3 * sum(recent) / len(recent),
                     world * args.batch * len(recent) / sum(recent)), flush=True)
    dist.barrier()
    total = time.monotonic() - t_start
    if rank == 0:
        sps = world * args.batch * args.steps / total
        print("train_ddp: %d steps in %.1f s, %.1f samples/s, final loss %.3f"
              % (args.steps, total, sps, losses[-1]), flush=True)
        if args.json:
            print(json.dumps({"backend": args.backend, "world_size": world, "steps": args.steps,
                              "seconds": total, "samples_per_s": sps, "loss": losses[-1],
                              "step_times": times, "losses": losses, "params": nparams}), flush=True)
    dist.destroy_process_group()
    return 0


if __name__ == "__main__":
    sys.exit(main())
