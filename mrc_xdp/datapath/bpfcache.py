"""A cache of bcc's builds: compile a BPF source once, load it many times.

bcc compiles the datapath from source at every load, ~2-5 s of one CPU here and
minutes in a TCG guest, although the instructions it produces depend only on the
source, the flags, bcc and the kernel headers.  After a compile this module keeps, per
(source text, cflags, bcc version, kernel release and build, headers tree), what the
kernel needs to load the same thing again without clang:

- every map bcc created: type, key and value size, max entries, flags, name (read back
  from the kernel, ``BPF_OBJ_GET_INFO_BY_FD``);
- every function's instructions (``BPF.dump_func``) with each map-fd ``ld_imm64`` named
  by the map it refers to (bcc puts its maps' fds there; they are replaced by the fds of
  the maps made here).

A hit returns a :class:`CachedBuild`, which offers what the loaders use of ``bcc.BPF``:
``obj[name].map_fd``, ``dump_func``, ``load_func`` (through libbpf, flags 0), ``cleanup``.
progload checks each load's kernel program tag against the instructions, so the kernel
runs what bcc built, from the cache or not.  The maps are made without BTF (the loaders
never use it; bcc's BTF only pretty-prints) and the programs carry no subprograms.

Entries live in ``/var/cache/mrc-xdp/bpf`` (root only), one file per build, written
atomically, checked by a digest when read; a damaged or unreadable entry is rebuilt, and
one in a directory or file that another user owns or may write is never used.
``MRC_BPF_CACHE`` names another directory, or ``off`` to compile every time.
"""
from __future__ import annotations

import base64
import contextlib
import ctypes
import hashlib
import json
import os
import re
import tempfile

from mrc_xdp.datapath import bpfsys

ENV = "MRC_BPF_CACHE"
DEFAULT_DIR = "/var/cache/mrc-xdp/bpf"
FORMAT = 1
KEEP = 16                   # entries kept per source file (the newest)

_LD_IMM64 = 0x18            # BPF_LD | BPF_IMM | BPF_DW
_PSEUDO_MAP_FD = 1
_F_RDONLY_PROG = 1 << 7
_KERNEL_RDONLY_PROG = (14, 25)   # BPF_MAP_TYPE_DEVMAP, _DEVMAP_HASH: dev_map_alloc adds the flag


class Uncacheable(Exception):
    """This build cannot be replayed from its instructions (a reference we do not know)."""


def directory() -> str | None:
    """The cache directory, or None when MRC_BPF_CACHE is off."""
    v = os.environ.get(ENV, "").strip()
    if v.lower() in ("off", "0", "no", "false"):
        return None
    return v or DEFAULT_DIR


def _trusted(path: str) -> bool:
    """Only our own files and directories, writable by nobody else: what is in them runs
    in the kernel."""
    try:
        st = os.stat(path)
    except OSError:
        return False
    return st.st_uid == os.geteuid() and not st.st_mode & 0o022


def key(filename: str, src: str, cflags: list[str]) -> str:
    """The entry's name: the source's base name and a digest of everything the build
    depends on."""
    try:
        import bcc
        bcc_version = getattr(bcc, "__version__", "?")
    except ImportError:
        bcc_version = "none"
    u = os.uname()
    headers = os.environ.get("BCC_KERNEL_SOURCE") or "/lib/modules/%s/build" % u.release
    h = hashlib.sha256()
    for part in (str(FORMAT), bcc_version, u.release, u.version, u.machine,
                 os.path.realpath(headers), "\0".join(cflags), src):
        h.update(part.encode())
        h.update(b"\0\1")
    base = os.path.splitext(os.path.basename(filename))[0]
    return "%s-%s" % (base, h.hexdigest()[:32])


# ---------------------------------------------------------------- reading bcc's build
def _libbcc():
    from bcc import libbcc
    lib = libbcc.lib
    lib.bpf_num_tables.restype = ctypes.c_ulonglong
    lib.bpf_num_tables.argtypes = [ctypes.c_void_p]
    lib.bpf_table_name.restype = ctypes.c_char_p
    lib.bpf_table_name.argtypes = [ctypes.c_void_p, ctypes.c_ulonglong]
    lib.bpf_table_fd_id.restype = ctypes.c_int
    lib.bpf_table_fd_id.argtypes = [ctypes.c_void_p, ctypes.c_ulonglong]
    return lib


def _map_refs(insns: bytes) -> list[tuple[int, int]]:
    """(instruction index, fd) of every map-fd ld_imm64; Uncacheable on any other pseudo
    load (a map value, a BTF id: nothing bcc emits for our sources)."""
    out = []
    i, n = 0, len(insns) // 8
    while i < n:
        code, regs = insns[8 * i], insns[8 * i + 1]
        if code == _LD_IMM64:
            src = regs >> 4
            if src == _PSEUDO_MAP_FD:
                out.append((i, int.from_bytes(insns[8 * i + 4:8 * i + 8], "little", signed=True)))
            elif src != 0:
                raise Uncacheable("ld_imm64 with src_reg %d at instruction %d" % (src, i))
            i += 2
            continue
        i += 1
    return out


def describe(bpf) -> dict:
    """What a bcc build holds, in the cache's terms (maps, functions with map references)."""
    lib = _libbcc()
    mod = bpf.module
    maps, by_fd = [], {}
    for i in range(lib.bpf_num_tables(mod)):
        name = lib.bpf_table_name(mod, i).decode()
        fd = lib.bpf_table_fd_id(mod, i)
        if fd < 0:
            raise Uncacheable("table %s has no map" % name)
        mi = bpfsys.map_info(fd)
        flags = mi.map_flags
        if mi.type in _KERNEL_RDONLY_PROG:      # set by the kernel itself, refused at create
            flags &= ~_F_RDONLY_PROG
        maps.append({"name": name, "type": mi.type, "key_size": mi.key_size, "value_size": mi.value_size,
                     "max_entries": mi.max_entries, "flags": flags})
        by_fd[fd] = name
    funcs = {}
    for i in range(lib.bpf_num_functions(mod)):
        fname = lib.bpf_function_name(mod, i).decode()
        insns = bytes(bpf.dump_func(fname.encode()))
        refs = []
        for idx, fd in _map_refs(insns):
            if fd not in by_fd:
                raise Uncacheable("%s: instruction %d refers to fd %d, not a map of this build" % (fname, idx, fd))
            refs.append([idx, by_fd[fd]])
        funcs[fname] = {"insns": base64.b64encode(insns).decode(), "maps": refs}
    return {"maps": maps, "funcs": funcs}


def _digest(body: dict) -> str:
    return hashlib.sha256(json.dumps(body, sort_keys=True).encode()).hexdigest()


def _checks_out(doc, name: str) -> bool:
    """An entry document of this format, written for file name, its body unchanged."""
    return isinstance(doc, dict) and doc.get("format") == FORMAT and "%s.json" % doc.get("entry") == name \
        and isinstance(doc.get("body"), dict) and doc.get("sha256") == _digest(doc["body"])


def store(entry: str, bpf) -> str | None:
    """Keep bcc's build under entry; the file written, or None (cache off, uncacheable,
    or not writable: the next load compiles again, nothing else changes)."""
    d = directory()
    if d is None:
        return None
    try:
        body = describe(bpf)
    except Uncacheable:
        return None
    doc = {"format": FORMAT, "entry": entry, "body": body, "sha256": _digest(body)}
    tmp = None
    try:
        os.makedirs(d, mode=0o700, exist_ok=True)
        if not _trusted(d):
            return None
        fd, tmp = tempfile.mkstemp(prefix=".%s." % entry, dir=d)
        with os.fdopen(fd, "w") as f:
            json.dump(doc, f)
        path = os.path.join(d, entry + ".json")
        os.replace(tmp, path)
    except OSError:
        if tmp:
            with contextlib.suppress(OSError):
                os.unlink(tmp)
        return None
    _prune(d, entry.rsplit("-", 1)[0])
    return path


def _prune(d: str, base: str) -> None:
    """The KEEP newest entries of one source file stay."""
    with contextlib.suppress(OSError):
        mine = [os.path.join(d, f) for f in os.listdir(d)
                if f.endswith(".json") and f.rsplit("-", 1)[0] == base]
        mine.sort(key=lambda p: os.stat(p).st_mtime, reverse=True)
        for p in mine[KEEP:]:
            with contextlib.suppress(OSError):
                os.unlink(p)


# ---------------------------------------------------------------- replaying a build
class _Table:
    """What the loaders use of a bcc table: its map fd."""

    def __init__(self, name: str, fd: int):
        self.name, self.map_fd = name, fd


class _Func:
    def __init__(self, name: str, fd: int):
        self.name, self.fd = name, fd


class CachedBuild:
    """A build replayed from the cache: its maps made anew, its instructions bound to
    them.  Stands in for ``bcc.BPF`` where the loaders use one."""

    def __init__(self, path: str, body: dict):
        self.path = path
        self.tables: dict = {}
        self._fds: dict[str, int] = {}
        self._insns: dict[str, bytes] = {}
        self._progs: list[int] = []
        try:
            for m in body["maps"]:
                self._fds[m["name"]] = bpfsys.map_create(m["type"], m["key_size"], m["value_size"],
                                                         m["max_entries"], m["name"], flags=m["flags"])
            for fname, f in body["funcs"].items():
                b = bytearray(base64.b64decode(f["insns"]))
                for idx, mname in f["maps"]:
                    b[8 * idx + 4:8 * idx + 8] = self._fds[mname].to_bytes(4, "little", signed=True)
                self._insns[fname] = bytes(b)
        except BaseException:
            self.cleanup()
            raise

    @staticmethod
    def _name(name) -> str:
        return name.decode() if isinstance(name, bytes) else name

    def __getitem__(self, name):
        n = self._name(name)
        if n not in self._fds:
            raise KeyError(n)
        t = self.tables.get(n)
        if t is None:
            t = self.tables[n] = _Table(n, self._fds[n])
        return t

    def dump_func(self, name) -> bytes:
        n = self._name(name)
        if n not in self._insns:
            raise Exception("Unknown program %s" % n)
        return self._insns[n]

    def load_func(self, name, prog_type=None):
        """The program loaded as bcc's load_func would (XDP, program flags 0)."""
        n = self._name(name)
        fd = bpfsys.prog_load_xdp(n, self.dump_func(n), 0)
        self._progs.append(fd)
        return _Func(n, fd)

    def cleanup(self) -> None:
        """Close every map and program fd of this build (pinned and attached ones live on)."""
        for fd in self._progs + list(self._fds.values()):
            with contextlib.suppress(OSError):
                os.close(fd)
        self._progs, self._fds = [], {}
        self.tables.clear()


def load(entry: str) -> CachedBuild | None:
    """The build kept under entry, its maps made; None on a miss.  A damaged entry is
    removed (and so rebuilt by the caller)."""
    d = directory()
    if d is None:
        return None
    path = os.path.join(d, entry + ".json")
    if not os.path.exists(path):
        return None
    if not (_trusted(d) and _trusted(path)):
        return None                 # another user's or a shared directory: compile
    try:
        with open(path) as f:
            doc = json.load(f)
    except FileNotFoundError:
        return None
    except (OSError, ValueError):
        doc = None
    if not _checks_out(doc, entry + ".json"):
        with contextlib.suppress(OSError):
            os.unlink(path)
        return None
    return CachedBuild(path, doc["body"])


# ---------------------------------------------------------------- moving entries between machines
_ENTRY = re.compile(r"^[A-Za-z0-9_]+-[0-9a-f]{32}\.json$")


def entries(d: str | None = None) -> dict[str, str]:
    """Every entry of the cache directory d (default: this machine's) as {file name: text}:
    what another machine with the same kernel, headers, bcc and sources can import
    (the VM lab shares one guest's builds with the others)."""
    d = d or directory()
    out = {}
    if not d or not os.path.isdir(d):
        return out
    for f in sorted(os.listdir(d)):
        if _ENTRY.match(f):
            with contextlib.suppress(OSError):
                with open(os.path.join(d, f)) as fh:
                    out[f] = fh.read()
    return out


def _valid(name: str, text: str) -> bool:
    try:
        return _checks_out(json.loads(text), name)
    except ValueError:
        return False


def import_entries(new: dict[str, str], d: str | None = None) -> list[str]:
    """Write entries ({file name: text}, from entries()) into the cache directory d
    (default: this machine's); those it did not hold and that check out (name, digest).
    Returns the names written."""
    d = d or directory()
    if not d:
        return []
    written = []
    os.makedirs(d, mode=0o700, exist_ok=True)
    if not _trusted(d):
        return []
    for name, text in sorted(new.items()):
        path = os.path.join(d, name)
        if not _ENTRY.match(name) or os.path.exists(path) or not _valid(name, text):
            continue
        fd, tmp = tempfile.mkstemp(prefix=".import.", dir=d)
        with os.fdopen(fd, "w") as f:
            f.write(text)
        os.replace(tmp, path)
        written.append(name)
    for base in {n.rsplit("-", 1)[0] for n in written}:
        _prune(d, base)
    return written
