"""Control of the lab's XDP link model (bpf/linkmodel.c).

One program per lab, loaded once with bcc and attached natively at the receiving end of
every fabric link; its maps are keyed by the receiving ifindex (unique across the lab)
and pinned under /sys/fs/bpf/mrc/lab-<prefix>/ so any process can read counters and
change rates and faults while the lab runs::

    lm = LinkModel.open("/sys/fs/bpf/mrc/lab-mrc-")
    lm.update(ifindex, rate_bps=1_000_000_000, loss_ppm=20000, blackhole=False)
    lm.counters(ifindex)   # {'pkts': .., 'bytes': .., 'marked': .., ...} summed over CPUs

Tests use ``LinkModel.load()`` without pins and drive the program with BPF_PROG_TEST_RUN.
"""
from __future__ import annotations

import ctypes
import errno
import os

from mrc_xdp.datapath import bpfsys, shared
from mrc_xdp.datapath.loader import XDP_FLAGS_DRV_MODE, XDP_FLAGS_SKB_MODE
from mrc_xdp.datapath.shared import ffi

LINKMODEL_SRC_NAME = "linkmodel.c"     # in bpf/
PROG_NAME = shared.MAP_NAMES["MRC_PROG_LINK"]
MAP_CFG = shared.map_name("MRC_LMAP_CFG")
MAP_STATE = shared.map_name("MRC_LMAP_STATE")
MAP_STATS = shared.map_name("MRC_LMAP_STATS")
MAP_NEXT = shared.map_name("MRC_LMAP_NEXT")
LF_ECN = shared.const("MRC_LF_ECN")
LF_TRIM = shared.const("MRC_LF_TRIM")
LF_BLACKHOLE = shared.const("MRC_LF_BLACKHOLE")
LF_USID_END = shared.const("MRC_LF_USID_END")
LNEXT_MAX = shared.const("MRC_LNEXT_MAX")
CTR_FIELDS = shared.LINK_CTR_FIELDS
DROP_FIELDS = [f for f in CTR_FIELDS if f.startswith("drop_")]

BPF_FS = "/sys/fs/bpf"
BPF_FS_MAGIC = 0xCAFE4A11

_FLAG_KEYS = {"ecn": LF_ECN, "trim": LF_TRIM, "blackhole": LF_BLACKHOLE, "usid_end": LF_USID_END}
CFG_KEYS = ("rate_bps", "ecn_bytes", "trim_bytes", "drop_bytes", "loss_ppm",
            "flap_period_ms", "dscp_trimmed", "dscp_ctrl", "udp_port", "next_prog",
            "usid_block", "usid_self") + \
    tuple(_FLAG_KEYS)


class LinkModelError(RuntimeError):
    pass


class _Statfs(ctypes.Structure):
    _fields_ = [("f_type", ctypes.c_long), ("rest", ctypes.c_long * 15)]


def bpffs_mounted(path: str = BPF_FS) -> bool:
    libc = ctypes.CDLL(None, use_errno=True)
    st = _Statfs()
    if libc.statfs(path.encode(), ctypes.byref(st)) != 0:
        return False
    return (st.f_type & 0xFFFFFFFF) == BPF_FS_MAGIC


def ensure_bpffs() -> None:
    """Mount the BPF filesystem on /sys/fs/bpf when it is not there (pins need it)."""
    if bpffs_mounted():
        return
    libc = ctypes.CDLL(None, use_errno=True)
    if libc.mount(b"bpf", BPF_FS.encode(), b"bpf", 0, None) != 0:
        e = ctypes.get_errno()
        raise LinkModelError("cannot mount bpffs on %s: %s" % (BPF_FS, os.strerror(e)))


def compile_program(frags: str | None = None):
    """(progload.Built, program fd): bpf/linkmodel.c compiled and loaded (about 1.5 s), through
    mrc_xdp.datapath.bpfsrc like the datapath (local headers inlined, so map calls in them work),
    frags-aware or single-buffer by the same rule as the datapath (progload; frags: 'auto',
    'on', 'off', default MRC_XDP_FRAGS): the host ingress programs it tail-calls through
    mrc_lnext must take the same path, or the kernel refuses them in the prog array."""
    from mrc_xdp.datapath import progload
    from mrc_xdp.datapath.bpfsrc import compile_bpf
    built = progload.build(lambda extra: compile_bpf(LINKMODEL_SRC_NAME, extra), [PROG_NAME], frags)
    return built, built.progs[PROG_NAME].fd


def cfg_from_dict(d: dict):
    c = ffi.new("struct mrc_link_cfg *")
    flags = 0
    for k, v in d.items():
        if k in _FLAG_KEYS:
            if v:
                flags |= _FLAG_KEYS[k]
        elif k == "flags":
            flags |= int(v)
        elif k in CFG_KEYS:
            setattr(c, k, int(v))
        else:
            raise KeyError("unknown link model setting %r" % k)
    c.flags = flags
    return c


def cfg_to_dict(c) -> dict:
    d = shared.as_dict(c)
    for k, bit in _FLAG_KEYS.items():
        d[k] = bool(d["flags"] & bit)
    return d


class LinkModel:
    """The link model's maps (and program fd when loaded here)."""

    def __init__(self, cfg: bpfsys.Map, state: bpfsys.Map, stats: bpfsys.Map,
                 nxt: bpfsys.Map | None = None, prog_fd: int = -1, pin_dir: str = "",
                 bpf=None):
        self.cfg_map, self.state_map, self.stats_map, self.next_map = cfg, state, stats, nxt
        self.prog_fd = prog_fd
        self.pin_dir = pin_dir
        self._bpf = bpf          # keeps a bcc object / progload.Built (and its fds) alive
        self.frags = getattr(bpf, "frags", None)   # the program's path (None: opened from pins)

    # ------------------------------------------------------------ construction
    @classmethod
    def load(cls, bpf_and_fd=None) -> "LinkModel":
        """Compile (or take a compiled (bcc.BPF, fd)) without pinning: for tests."""
        b, fd = bpf_and_fd or compile_program()
        bpf = getattr(b, "bpf", b)      # a progload.Built or a bare bcc object

        def m(name):
            return bpfsys.Map(bpf[name.encode()].map_fd, name, owns_fd=False)
        return cls(m(MAP_CFG), m(MAP_STATE), m(MAP_STATS), m(MAP_NEXT), fd, bpf=b)

    def pin(self, pin_dir: str) -> None:
        ensure_bpffs()
        os.makedirs(pin_dir, exist_ok=True)
        for mp in (self.cfg_map, self.state_map, self.stats_map, self.next_map):
            path = os.path.join(pin_dir, mp.name)
            if os.path.exists(path):
                os.unlink(path)
            bpfsys.obj_pin(mp.fd, path)
        path = os.path.join(pin_dir, PROG_NAME)
        if os.path.exists(path):
            os.unlink(path)
        bpfsys.obj_pin(self.prog_fd, path)
        self.pin_dir = pin_dir

    @classmethod
    def open(cls, pin_dir: str) -> "LinkModel":
        """Open a running lab's pinned link model."""
        def m(name):
            path = os.path.join(pin_dir, name)
            try:
                return bpfsys.Map.open_pinned(path)
            except OSError as e:
                if e.errno == errno.ENOENT:
                    raise LinkModelError("%s: no link model pinned there (is the lab up?)" % path) from None
                raise
        prog = os.path.join(pin_dir, PROG_NAME)
        fd = bpfsys.obj_get(prog) if os.path.exists(prog) else -1
        nxt = m(MAP_NEXT) if os.path.exists(os.path.join(pin_dir, MAP_NEXT)) else None
        return cls(m(MAP_CFG), m(MAP_STATE), m(MAP_STATS), nxt, fd, pin_dir)

    def close(self) -> None:
        for mp in (self.cfg_map, self.state_map, self.stats_map, self.next_map):
            if mp is not None:
                mp.close()
        if self._bpf is None and self.prog_fd >= 0:
            os.close(self.prog_fd)
        self.prog_fd = -1

    def __enter__(self):
        return self

    def __exit__(self, *a):
        self.close()

    # ------------------------------------------------------------ config
    def set(self, ifindex: int, cfg: dict, reset: bool = True) -> None:
        """Write a link end's whole config (missing keys are 0/off); reset its queue and counters."""
        self.cfg_map.update(ifindex, shared.to_bytes(cfg_from_dict(cfg)))
        if reset:
            self.state_map.update(ifindex, bytes(shared.sizeof("struct mrc_link_state")))
            self.stats_map.update(ifindex, bytes(shared.sizeof("struct mrc_link_ctr")))

    def get(self, ifindex: int) -> dict | None:
        raw = self.cfg_map.lookup(ifindex)
        if raw is None:
            return None
        return cfg_to_dict(shared.from_bytes("struct mrc_link_cfg", raw))

    def update(self, ifindex: int, **changes) -> dict:
        """Change some settings of a configured link end (e.g. loss_ppm=1000, blackhole=True)."""
        cur = self.get(ifindex)
        if cur is None:
            raise LinkModelError("ifindex %d has no link model config" % ifindex)
        flags = cur.pop("flags")
        for k in _FLAG_KEYS:
            cur.pop(k)
        for k, bit in _FLAG_KEYS.items():
            if k in changes:
                flags = (flags | bit) if changes.pop(k) else (flags & ~bit)
        unknown = set(changes) - set(CFG_KEYS)
        if unknown:
            raise KeyError("unknown link model setting %r" % sorted(unknown)[0])
        cur.update(changes)
        cur["flags"] = flags
        self.cfg_map.update(ifindex, shared.to_bytes(cfg_from_dict(cur)))
        return self.get(ifindex)

    def delete(self, ifindex: int) -> None:
        for mp in (self.cfg_map, self.state_map, self.stats_map):
            mp.delete(ifindex)

    def set_state(self, ifindex: int, backlog: int, last_ns: int = 0) -> None:
        """Preset the phantom queue (tests: last_ns in the future freezes it)."""
        st = ffi.new("struct mrc_link_state *")
        st.backlog, st.last_ns = backlog, last_ns
        self.state_map.update(ifindex, shared.to_bytes(st))

    def state(self, ifindex: int) -> dict | None:
        raw = self.state_map.lookup(ifindex)
        return None if raw is None else shared.as_dict(shared.from_bytes("struct mrc_link_state", raw))

    def counters(self, ifindex: int) -> dict:
        vals = self.stats_map.lookup(ifindex)
        if vals is None:
            return dict.fromkeys(CTR_FIELDS, 0)
        return dict(zip(CTR_FIELDS, bpfsys.sum_u64_percpu(vals, len(CTR_FIELDS))))

    def reset_counters(self, ifindex: int) -> None:
        self.stats_map.update(ifindex, bytes(shared.sizeof("struct mrc_link_ctr")))

    def set_next(self, ifindex: int, slot: int, prog_fd: int | None) -> None:
        """Chain: after a pass at `ifindex`, tail-call prog_fd (None: stop chaining)."""
        if self.next_map is None:
            raise LinkModelError("this link model has no %s map" % MAP_NEXT)
        if not 0 <= slot < LNEXT_MAX:
            raise LinkModelError("next-program slot %d out of range [0, %d)" % (slot, LNEXT_MAX))
        if prog_fd is None:
            self.update(ifindex, next_prog=0)
            self.next_map.delete(slot)
            return
        try:
            self.next_map.update(slot, prog_fd.to_bytes(4, "little"))
        except bpfsys.BpfError as e:
            if e.errno != errno.EINVAL:
                raise
            raise LinkModelError("%s[%d]: the kernel refused the program (EINVAL): the link model and "
                                 "the program it tail-calls must both be frags-aware or both "
                                 "single-buffer (MRC_XDP_FRAGS, docs/datapath.md)" % (MAP_NEXT, slot)) from None
        self.update(ifindex, next_prog=slot + 1)


# ---------------------------------------------------------------- XDP attach
_xffi = None
_xlib = None


def _libbpf():
    global _xffi, _xlib
    if _xlib is None:
        import cffi
        _xffi = cffi.FFI()
        _xffi.cdef("""
int bpf_xdp_attach(int ifindex, int prog_fd, uint32_t flags, const void *opts);
int bpf_xdp_detach(int ifindex, uint32_t flags, const void *opts);
int bpf_xdp_query_id(int ifindex, int flags, uint32_t *prog_id);
int bpf_prog_get_fd_by_id(uint32_t id);
""")
        _xlib = _xffi.dlopen("libbpf.so.1")
    return _xffi, _xlib


def _xcheck(rc: int, what: str) -> int:
    if rc < 0:
        e = -rc if rc != -1 else _xffi.errno
        raise LinkModelError("%s: %s" % (what, os.strerror(e)))
    return rc


def xdp_attach(ifindex: int, prog_fd: int, mode: str = "drv", netns_name: str | None = None) -> None:
    """Attach an XDP program (replacing any) to a device of netns `netns_name`."""
    from mrc_xdp.datapath import netns
    _, lib = _libbpf()
    flags = XDP_FLAGS_DRV_MODE if mode == "drv" else XDP_FLAGS_SKB_MODE
    with netns.enter(netns_name):
        _xcheck(lib.bpf_xdp_attach(ifindex, prog_fd, flags, _xffi.NULL),
                "attach XDP to ifindex %d%s" % (ifindex, " in " + netns_name if netns_name else ""))


def xdp_detach(ifindex: int, mode: str = "drv", netns_name: str | None = None) -> None:
    from mrc_xdp.datapath import netns
    _, lib = _libbpf()
    flags = XDP_FLAGS_DRV_MODE if mode == "drv" else XDP_FLAGS_SKB_MODE
    with netns.enter(netns_name):
        _xcheck(lib.bpf_xdp_detach(ifindex, flags, _xffi.NULL), "detach XDP from ifindex %d" % ifindex)


def xdp_prog_id(ifindex: int, netns_name: str | None = None) -> int:
    """The id of the native XDP program on a device (0: none)."""
    from mrc_xdp.datapath import netns
    ffi_, lib = _libbpf()
    out = ffi_.new("uint32_t *")
    with netns.enter(netns_name):
        _xcheck(lib.bpf_xdp_query_id(ifindex, XDP_FLAGS_DRV_MODE, out), "query XDP on ifindex %d" % ifindex)
    return out[0]


def prog_fd_by_id(prog_id: int) -> int:
    _, lib = _libbpf()
    return _xcheck(lib.bpf_prog_get_fd_by_id(prog_id), "program id %d" % prog_id)
