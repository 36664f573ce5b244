"""The C/Python contract: bpf/mrc_shared.h read through cffi.

Every struct layout, enum and map name used by Python comes from here, so a layout is
written exactly once (in the header).  ``ffi.new("struct mrc_ev *")`` gives a value with
the same bytes the BPF program sees; ``Ctr`` mirrors ``enum mrc_ctr`` as an IntEnum.
"""
from __future__ import annotations

import enum
import os
import re

import cffi

BPF_DIR = os.path.join(os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__)))), "bpf")
HEADER = os.path.join(BPF_DIR, "mrc_shared.h")

_INT_DEFINE = re.compile(r"^#define\s+(\w+)\s+(0x[0-9a-fA-F]+|\d+)\s*$")
_NAME_DEFINE = re.compile(r"^#define\s+(MRC_(?:MAP|LMAP|PROG)_\w+)\s+(\w+)\s*$")
_ALIAS_DEFINE = re.compile(r"^#define\s+(\w+)\s+(MRC_\w+)\s*$")


def _read_header(path: str = HEADER):
    with open(path) as f:
        text = f.read()
    text = re.sub(r"/\*.*?\*/", "", text, flags=re.S)
    text = re.sub(r"//[^\n]*", "", text)
    ints: dict[str, int] = {}
    names: dict[str, str] = {}
    body = []
    for line in text.splitlines():
        s = line.strip()
        if s.startswith("#"):
            m = _INT_DEFINE.match(s)
            if m:
                ints[m.group(1)] = int(m.group(2), 0)
                continue
            m = _NAME_DEFINE.match(s)
            if m:
                names[m.group(1)] = m.group(2)
                continue
            m = _ALIAS_DEFINE.match(s)
            if m and m.group(2) in ints:
                ints[m.group(1)] = ints[m.group(2)]
            continue  # include guards and the like
        body.append(line)
    src = "\n".join(body)
    # Array sizes in struct bodies use the integer constants: substitute them.
    for k in sorted(ints, key=len, reverse=True):
        src = re.sub(r"\b%s\b" % k, str(ints[k]), src)
    return ints, names, src


CONSTS, MAP_NAMES, _CDEF = _read_header()

ffi = cffi.FFI()
ffi.cdef("""
typedef unsigned char __u8; typedef unsigned short __u16;
typedef unsigned int __u32; typedef unsigned long long __u64;
""")
ffi.cdef(_CDEF)


def const(name: str) -> int:
    return CONSTS[name]


def map_name(macro: str) -> str:
    """'MRC_MAP_EVS' -> 'mrc_evs'."""
    return MAP_NAMES[macro]


def _enum(ctype: str, cls_name: str, prefix: str) -> type[enum.IntEnum]:
    members = ffi.typeof(ctype).relements
    pairs = sorted(((k[len(prefix):], v) for k, v in members.items() if k.startswith(prefix)),
                   key=lambda kv: kv[1])
    return enum.IntEnum(cls_name, pairs)


Ctr = _enum("enum mrc_ctr", "Ctr", "MRC_C_")            # Ctr.SPRAY_TX, ... Ctr.MAX
EvState = _enum("enum mrc_ev_state", "EvState", "MRC_EV_")
EvReason = _enum("enum mrc_ev_reason", "EvReason", "MRC_R_")
Opcode = _enum("enum mrc_opcode", "Opcode", "MRC_OP_")
SackM = _enum("enum mrc_sack_m", "SackM", "MRC_M_")
NackReason = _enum("enum mrc_nack_reason", "NackReason", "MRC_NACK_")
Mode = _enum("enum mrc_mode", "Mode", "MRC_MODE_")

# Link-model per-link counter fields, in header order.
LINK_CTR_FIELDS = [name for name, _ in ffi.typeof("struct mrc_link_ctr").fields]
EV_CTR_FIELDS = [name for name, _ in ffi.typeof("struct mrc_ev_ctr").fields]


def sizeof(ctype: str) -> int:
    return ffi.sizeof(ctype)


def to_bytes(cdata) -> bytes:
    return bytes(ffi.buffer(cdata))


def from_bytes(ctype: str, data: bytes):
    """A fresh cdata 'ctype *' holding a copy of data."""
    p = ffi.new(ctype + " *")
    n = ffi.sizeof(ctype)
    if len(data) < n:       # memmove would read past the end of data
        raise ValueError("%s is %d bytes, got %d" % (ctype, n, len(data)))
    ffi.memmove(p, data[:n], n)
    return p


def as_dict(cdata) -> dict:
    """Plain-Python view of a struct cdata (arrays become lists / bytes)."""
    out = {}
    t = ffi.typeof(cdata)
    if t.kind == "pointer":
        t = t.item
        cdata = cdata[0]
    for name, field in t.fields:
        v = getattr(cdata, name)
        ft = field.type
        if ft.kind == "array":
            if ft.item.cname == "unsigned char":
                v = bytes(ffi.buffer(ffi.addressof(cdata, name)))
            else:
                v = list(v)
        out[name] = v
    return out
