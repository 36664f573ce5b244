"""Verifier headroom: the programs must stay well inside the kernel's 1M-instruction
verification limit, or a small change (or another kernel's verifier) tips them over.

Spray once needed 799k verified instructions (one loop exit per EV try, one state per
opcode); this keeps such growth from creeping back unnoticed.
"""
from mrc_xdp.datapath import bpfsys

LIMIT = 1_000_000
HEADROOM = 0.5          # each program may use at most half of the limit


def test_verifier_headroom(dp_env):
    used = {}
    for prog in ("spray", "ingress", "engine", "evop"):
        info = bpfsys.prog_info(dp_env.dp.fd(prog))
        assert info.verified_insns > 0, "kernel reported no verified_insns for %s" % prog
        used[prog] = info.verified_insns
    print("verified instructions:", used)
    for prog, n in used.items():
        assert n < HEADROOM * LIMIT, "%s needs %d verified instructions (limit %d)" % (prog, n, LIMIT)
