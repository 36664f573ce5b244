"""cffi (API mode) builder of the transport engine: mrc_xdp.transport._engine.

setup.py lists it in CFFI_MODULES ("mrc_xdp/transport/engine/build.py:ffibuilder"), so
`pip install -e .` (scripts/setup.sh) compiles engine.c against libxdp, libbpf and
zlib into mrc_xdp/transport/_engine*.so.  Rebuild by hand: .venv/bin/python mrc_xdp/transport/engine/build.py
(setup.py build_ext --inplace)
"""
import os
import re

from cffi import FFI

HERE = os.path.dirname(os.path.abspath(__file__))
ROOT = os.path.dirname(os.path.dirname(os.path.dirname(HERE)))
BPF = os.path.join(ROOT, "bpf")


def _cdef() -> str:
    """engine.h as cffi reads it: no preprocessor lines but integer #defines."""
    with open(os.path.join(HERE, "engine.h")) as f:
        text = f.read()
    text = re.sub(r"/\*.*?\*/", "", text, flags=re.S)
    out = []
    for line in text.splitlines():
        s = line.strip()
        if s.startswith("#"):
            if re.match(r"#define\s+MRC_\w+\s+(0x[0-9a-fA-F]+|\d+)\s*$", s):
                out.append(s)
            continue
        out.append(line)
    return "\n".join(out)


ffibuilder = FFI()
ffibuilder.cdef(_cdef())
ffibuilder.set_source(
    "mrc_xdp.transport._engine",
    '#include "engine.h"\n',
    # relative to the root (setup.py runs there): objects go under build/, not next to it
    sources=[os.path.relpath(os.path.join(HERE, "engine.c"), ROOT)],
    include_dirs=[HERE, BPF],
    libraries=["xdp", "bpf", "z", "pthread"],
    extra_compile_args=["-O2", "-g", "-Wall", "-Wno-unused-function", "-std=gnu11"],
)

if __name__ == "__main__":      # rebuild in place, as `pip install -e .` does
    import subprocess
    import sys
    subprocess.run([sys.executable, "setup.py", "-q", "build_ext", "--inplace"], cwd=ROOT, check=True)
