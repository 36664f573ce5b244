"""Compile with bcc, load frags-aware where the kernel allows it (issue 20 item 1).

bcc stays the compiler: the programs are written in its dialect.  bcc 0.26's Python
``load_func`` always passes program flags 0, so it cannot load a program that handles
multi-buffer frames.  The frags path therefore takes the instructions bcc produced
(``BPF.dump_func``: bcc has already put the map fds into their ``ld_imm64``) and loads
them with libbpf's ``bpf_prog_load`` (bpfsys.prog_load_xdp), ``prog_flags =
BPF_F_XDP_HAS_FRAGS`` and ``expected_attach_type = BPF_XDP``.  The programs have no
subprograms (everything is ``__always_inline``) and use no BTF-dependent feature, so
nothing else is needed; bcc's BTF (one func_info record) is left out.  Each load is
checked: the kernel's program tag (digest of the instructions with map fds masked) must
equal the tag of bcc's instructions, so the kernel runs exactly what bcc built.

The rule (docs/datapath.md, "Multi-buffer frames"):

- ``MRC_XDP_FRAGS`` unset or ``auto``: compile with ``-DMRC_FRAGS=1`` and load every
  program with the flag.  If the kernel refuses any of them (kernels before 5.18 do
  not know the flag: EINVAL; or the verifier refuses the frags code), compile again with
  ``-DMRC_FRAGS=0`` and load today's single-buffer programs through bcc's own
  ``load_func``.  The result says which path was taken and why.
- ``MRC_XDP_FRAGS=1``: the frags path or an error (no fallback).
- ``MRC_XDP_FRAGS=0``: the single-buffer path, never trying the flag.

All programs of one build take the same path, and must: the kernel records the first
program that uses a devmap or prog array (mrc_ports, mrc_lnext) as its owner and refuses
a program whose frags support differs (EINVAL at load, or on a prog-array update).
"""
from __future__ import annotations

import atexit
import contextlib
import errno
import hashlib
import os
import warnings

from mrc_xdp.datapath import bpfcache, bpfsys

ENV = "MRC_XDP_FRAGS"
PATH_FRAGS = "frags"          # BPF_F_XDP_HAS_FRAGS, -DMRC_FRAGS=1
PATH_SINGLE = "single"        # flags 0, -DMRC_FRAGS=0 (the programs of before issue 20)

_LD_IMM64 = 0x18              # BPF_LD | BPF_IMM | BPF_DW
_PSEUDO_MAP_FD, _PSEUDO_MAP_VALUE = 1, 2


class FragsRefused(RuntimeError):
    """MRC_XDP_FRAGS=1 and the kernel refused the frags programs."""


def wanted() -> str:
    """'auto', 'on' or 'off' from MRC_XDP_FRAGS (ValueError on anything else)."""
    v = os.environ.get(ENV, "auto").strip().lower()
    table = {"": "auto", "auto": "auto", "1": "on", "on": "on", "yes": "on", "true": "on",
             "0": "off", "off": "off", "no": "off", "false": "off"}
    if v not in table:
        raise ValueError("%s=%r: use 1 (frags programs or fail), 0 (single-buffer programs) or "
                         "auto (frags where the kernel takes them)" % (ENV, os.environ.get(ENV)))
    return table[v]


def insn_tags(insns: bytes) -> set[bytes]:
    """The kernel's program tag of these instructions (bpf_prog_calc_tag): a digest of them
    with the imm of map-fd ld_imm64 pairs zeroed, its first 8 bytes.  The digest is SHA-1
    up to Linux 6.17 and SHA-256 since 6.18: both are returned."""
    b = bytearray(insns)
    ld_map = False
    for i in range(0, len(b), 8):
        code, regs = b[i], b[i + 1]
        off = int.from_bytes(b[i + 2:i + 4], "little")
        if not ld_map and code == _LD_IMM64 and (regs >> 4) in (_PSEUDO_MAP_FD, _PSEUDO_MAP_VALUE):
            ld_map = True
            b[i + 4:i + 8] = bytes(4)
        elif ld_map and code == 0 and regs == 0 and off == 0:
            ld_map = False
            b[i + 4:i + 8] = bytes(4)
        else:
            ld_map = False
    return {hashlib.sha1(bytes(b)).digest()[:8], hashlib.sha256(bytes(b)).digest()[:8]}


class Prog:
    """One loaded program: .fd (what bcc's load_func returns has .fd too)."""

    def __init__(self, name: str, fd: int, owned: bool):
        self.name, self.fd, self.owned = name, fd, owned

    def close(self) -> None:
        if self.owned and self.fd >= 0:
            os.close(self.fd)
        self.fd = -1


class Built:
    """A compiled and loaded set of programs: the bcc object (it owns the maps), the
    programs by their C name, and which path they took (.path, .why)."""

    def __init__(self, bpf, progs: dict, path: str, why: str):
        self.bpf, self.progs, self.path, self.why = bpf, progs, path, why

    @property
    def frags(self) -> bool:
        return self.path == PATH_FRAGS

    @property
    def build(self) -> str:
        """'cache' when bcc's build was replayed from the build cache (bpfcache), else 'bcc'."""
        return "cache" if isinstance(self.bpf, bpfcache.CachedBuild) else "bcc"

    def info(self) -> dict:
        return {"path": self.path, "frags": self.frags, "why": self.why, "build": self.build}

    def close(self) -> None:
        """Close our program fds and the bcc object (maps; bcc's own program fds)."""
        for p in self.progs.values():
            p.close()
        self.progs = {}
        bpf, self.bpf = self.bpf, None
        if bpf is not None:
            atexit.unregister(bpf.cleanup)
            with contextlib.suppress(Exception):
                bpf.cleanup()
            bpf.tables.clear()


def _compile(compile_fn, frags: bool):
    with warnings.catch_warnings():    # bcc: "not a bytes object" on its own text
        warnings.simplefilter("ignore", DeprecationWarning)
        return compile_fn(["-DMRC_FRAGS=%d" % (1 if frags else 0)])


def _load_frags(bpf, names) -> dict:
    progs = {}
    try:
        for n in names:
            insns = bpf.dump_func(n.encode())
            fd = bpfsys.prog_load_xdp(n, insns, bpfsys.BPF_F_XDP_HAS_FRAGS)
            progs[n] = Prog(n, fd, True)
            tag = bytes(bpfsys.prog_info(fd).tag)
            if tag not in insn_tags(insns):
                raise bpfsys.BpfError(errno.EPROTO, "%s: the kernel's program tag %s is not that of "
                                      "bcc's instructions (%s)" % (
                                          n, tag.hex(), " or ".join(t.hex() for t in insn_tags(insns))))
        return progs
    except BaseException:
        for p in progs.values():
            p.close()
        raise


def _load_single(bpf, names) -> dict:
    from bcc import BPF
    return {n: Prog(n, bpf.load_func(n.encode(), BPF.XDP).fd, False) for n in names}


def _why_refused(e: Exception) -> str:
    log = getattr(e, "log", "") or ""
    last = [ln for ln in log.strip().splitlines() if ln.strip()][-1:] if log else []
    return "%s%s" % (e, (" (verifier: %s)" % last[0][:200]) if last else "")


def build(compile_fn, names, mode: str | None = None) -> Built:
    """Compile (compile_fn(extra_cflags) -> bcc.BPF) and load the XDP programs names on
    the path the rule above picks; mode overrides MRC_XDP_FRAGS ('auto', 'on', 'off')."""
    mode = mode or wanted()
    if mode != "off":
        bpf = _compile(compile_fn, True)
        try:
            return Built(bpf, _load_frags(bpf, names), PATH_FRAGS,
                         "%s=%s: loaded with BPF_F_XDP_HAS_FRAGS" % (ENV, "1" if mode == "on" else "auto"))
        except (bpfsys.BpfError, OSError) as e:
            Built(bpf, {}, PATH_FRAGS, "").close()
            if mode == "on":
                raise FragsRefused("%s=1 but the kernel refused the frags programs: %s"
                                   % (ENV, _why_refused(e))) from None
            why = "the kernel refused BPF_F_XDP_HAS_FRAGS programs (%s): single-buffer programs" % (
                _why_refused(e))
    else:
        why = "%s=0: single-buffer programs" % ENV
    bpf = _compile(compile_fn, False)
    try:
        return Built(bpf, _load_single(bpf, names), PATH_SINGLE, why)
    except BaseException:
        Built(bpf, {}, PATH_SINGLE, "").close()
        raise
