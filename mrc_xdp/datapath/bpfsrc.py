"""Compile the project's BPF sources with bcc.

bcc rewrites map method calls (``mrc_stats.lookup(&k)``) only in the main file it is
given, not in included headers, so our header-only helpers (bpf/*.h) are inlined into
one translation unit here: every ``#include "x.h"`` is replaced by the file's text,
once per file.  System includes (``<linux/...>``) are left to the compiler.
"""
from __future__ import annotations

import os
import re
import threading

from mrc_xdp.datapath import kheaders
from mrc_xdp.datapath.shared import BPF_DIR

CFLAGS = [
    "-I" + BPF_DIR,
    "-Wno-unused-value",
    "-Wno-pointer-sign",
    "-Wno-compare-distinct-pointer-types",
    "-Wno-unknown-warning-option",
]

# libbcc chdir()s into the headers tree for the length of a compile and back afterwards
# (its DirStack): the working directory is the process's, so two compiles in two threads
# (the lab compiles its link model in one) pull it from under each other, and clang then
# misses headers it looks up relative to it ("'uapi/linux/string.h' file not found").
_COMPILE_LOCK = threading.Lock()

_INCLUDE = re.compile(r'^\s*#\s*include\s+"([^"]+)"\s*$', re.M)


def amalgamate(path: str, _seen: set | None = None) -> str:
    seen = _seen if _seen is not None else set()
    path = os.path.abspath(path)
    if path in seen:
        return ""
    seen.add(path)
    with open(path) as f:
        text = f.read()
    base = os.path.dirname(path)

    def sub(m):
        inc = os.path.join(base, m.group(1))
        if not os.path.exists(inc):
            inc = os.path.join(BPF_DIR, m.group(1))
        return "/* --- %s --- */\n%s" % (m.group(1), amalgamate(inc, seen))

    return _INCLUDE.sub(sub, text)


def compile_bpf(filename: str, cflags: list[str] | None = None):
    """bcc.BPF for bpf/<filename>, built from the amalgamated source; or the same build
    replayed from the build cache (bpfcache.CachedBuild: its maps made anew, no compile)
    when this source, these flags, bcc and the kernel headers were built before."""
    kheaders.ensure()
    from mrc_xdp.datapath import bpfcache

    src = amalgamate(os.path.join(BPF_DIR, filename))
    flags = CFLAGS + list(cflags or [])
    entry = bpfcache.key(filename, src, flags)
    hit = bpfcache.load(entry)
    if hit is not None:
        return hit
    from bcc import BPF  # imported late: only loaders need bcc
    with _COMPILE_LOCK:
        bpf = BPF(text=src.encode(), cflags=flags)
    bpfcache.store(entry, bpf)
    return bpf
