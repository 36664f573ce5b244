"""Load and unload the host datapath.

``load(cfg)`` compiles bpf/mrc_datapath.c with bcc, fills the maps from the config,
attaches spray to the fabric side of the mrc0 pair, ingress to every plane NIC and
to_engine to mrc0, and pins every map and program under /sys/fs/bpf/mrc/<instance>/
so the datapath outlives the loading process and any process can read it.
``unload(instance)`` detaches exactly our programs, deletes every entry of a pinned
prog array (e.g. the lab link model's mrc_lnext) that tail-calls one of them, and
removes the pins and state.

Instance names follow one rule (names.py) and every path under the pin root and the
state directory is checked to resolve inside it: nothing outside
/sys/fs/bpf/mrc/<instance>/ and /run/mrc-xdp/<instance>.* is ever written or removed.
Load and unload of one instance hold its lock (flock on /run/mrc-xdp/<instance>.lock)
from the "already loaded" check to the last state write, so a second load of the same
instance fails at once with one line (or waits, ``wait=`` seconds).  A load that fails
removes only what it made itself: pins whose object id is the one it pinned, its own
state file, the directory it created.  The loading process keeps nothing: the bcc
object and every fd are released before load() returns, so the unloaded programs leave
the kernel as soon as unload() has removed pins and attachments.
"""
from __future__ import annotations

import contextlib
import ctypes
import fcntl
import json
import os
import shutil
import time

from mrc_xdp.datapath import bpfsys, netns
from mrc_xdp.datapath.config import HostConfig
from mrc_xdp.datapath.maps import (DATAPATH_MAPS, PIN_ROOT, STATE_DIR, DevInfo, lock_path, pin_dir,
                                   state_path, write_all)
from mrc_xdp.datapath.names import BadName, is_valid
from mrc_xdp.datapath.shared import CONSTS, MAP_NAMES

PROGS = {"spray": MAP_NAMES["MRC_PROG_SPRAY"], "ingress": MAP_NAMES["MRC_PROG_INGRESS"],
         "engine": MAP_NAMES["MRC_PROG_ENGINE"],
         "evop": MAP_NAMES["MRC_PROG_EVOP"]}     # never attached: user space runs it (maps.set_ev_state)

XDP_FLAGS_UPDATE_IF_NOEXIST = 1 << 0
XDP_FLAGS_SKB_MODE = 1 << 1
XDP_FLAGS_DRV_MODE = 1 << 2
BPF_MAP_TYPE_PROG_ARRAY = 3

_icrc_rows_cache: list | None = None


class LoadError(RuntimeError):
    """One line saying what failed and what to do."""


class AlreadyLoaded(LoadError):
    pass


class Busy(LoadError):
    """Another process holds the instance's lock (it is loading or unloading it)."""


def _paths(instance: str) -> tuple[str, str]:
    """(pin dir, state file) of instance; LoadError when the name breaks the rule or a
    path would resolve outside the pin root or the state directory."""
    try:
        return pin_dir(instance), state_path(instance)
    except BadName as e:
        raise LoadError(str(e)) from None


def _lock_holder(fd: int) -> str:
    with contextlib.suppress(OSError, ValueError):
        pid, doing = os.pread(fd, 64, 0).decode().split()[:2]
        return "%s by pid %d" % (doing, int(pid))
    return "loaded or unloaded by another process"


@contextlib.contextmanager
def instance_lock(instance: str, doing: str = "loaded", wait: float = 0.0):
    """Hold instance's lock: flock(LOCK_EX) on /run/mrc-xdp/<instance>.lock, which holds
    "<pid> <doing>" for whoever finds it taken.  wait: seconds to wait for it (0: fail at
    once); then Busy, one line naming the holder.  The file is removed on release (a
    waiter that then locks the removed file notices it and takes the new one)."""
    try:
        path = lock_path(instance)
    except BadName as e:
        raise LoadError(str(e)) from None
    try:
        os.makedirs(STATE_DIR, exist_ok=True)
    except OSError as e:
        raise LoadError("cannot create %s: %s" % (STATE_DIR, e.strerror)) from None
    deadline = time.monotonic() + wait
    while True:
        try:
            fd = os.open(path, os.O_RDWR | os.O_CREAT | os.O_CLOEXEC | os.O_NOFOLLOW, 0o644)
        except OSError as e:
            raise LoadError("cannot open the lock file %s: %s" % (path, e.strerror)) from None
        try:
            fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError:
            holder = _lock_holder(fd)
            os.close(fd)
            if time.monotonic() >= deadline:
                raise Busy("instance %r is being %s — wait for it to finish, then retry"
                           % (instance, holder)) from None
            time.sleep(0.1)
            continue
        except BaseException:
            os.close(fd)
            raise
        try:
            cur = os.stat(path, follow_symlinks=False)
            mine = os.fstat(fd)
            if (cur.st_dev, cur.st_ino) == (mine.st_dev, mine.st_ino):
                break
        except FileNotFoundError:
            pass
        os.close(fd)         # the holder removed this file as we waited: take the new one
    try:
        os.ftruncate(fd, 0)
        os.pwrite(fd, ("%d %s\n" % (os.getpid(), doing)).encode(), 0)
        yield
    finally:
        with contextlib.suppress(FileNotFoundError):
            os.unlink(path)
        os.close(fd)


def require_root() -> None:
    if os.geteuid() != 0:
        raise LoadError("needs root (CAP_BPF and CAP_NET_ADMIN): run it with sudo")
    if not os.path.ismount("/sys/fs/bpf"):
        raise LoadError("/sys/fs/bpf is not mounted: mount -t bpf bpf /sys/fs/bpf")


def icrc_rows():
    global _icrc_rows_cache
    if _icrc_rows_cache is None:
        from mrc_xdp.datapath.wire import icrc_update_rows
        _icrc_rows_cache = icrc_update_rows(CONSTS["MRC_ICRC_TBL_LEN"])
    return _icrc_rows_cache


@contextlib.contextmanager
def _in(ns: str | None):
    if ns is None:
        yield
        return
    if not netns.exists(ns):
        raise LoadError("network namespace %r does not exist" % ns)
    with netns.enter(ns):
        yield


def _link(ipr, name: str, hint: str):
    idx = ipr.link_lookup(ifname=name)
    if not idx:
        raise LoadError("%s: no such device — %s" % (name, hint))
    return ipr.get_links(idx[0])[0]


def _xdp_prog_id(link) -> int:
    xdp = link.get_attr("IFLA_XDP")
    if not xdp:
        return 0
    return xdp.get_attr("IFLA_XDP_PROG_ID") or 0


def _resolve_gateway(ipr, ifindex: int, gw: str, dev: str) -> str:
    for n in ipr.get_neighbours(ifindex=ifindex, family=10):
        if n.get_attr("NDA_DST") == gw and n.get_attr("NDA_LLADDR"):
            return n.get_attr("NDA_LLADDR")
    raise LoadError("%s: gateway %s has no neighbour entry — ping it once or set gateway_mac" % (dev, gw))


def _check_srv6_mtu(cfg: HostConfig, app, planes) -> None:
    """Spray pushes an outer IPv6 header: a full-size frame from app_dev must still fit
    every plane NIC, or the plane drops it silently."""
    outer = CONSTS["MRC_IPV6_LEN"]
    app_mtu = app.get_attr("IFLA_MTU")
    lk = min(planes, key=lambda x: x.get_attr("IFLA_MTU"))    # the smallest plane MTU decides
    mtu = lk.get_attr("IFLA_MTU")
    if app_mtu + outer > mtu:
        raise LoadError("%s: MTU %d + %d (SRv6 outer header) exceeds %s MTU %d — lower %s's MTU to %d "
                        "or raise the plane MTU to %d" % (
                            cfg.app_dev, app_mtu, outer, lk.get_attr("IFLA_IFNAME"), mtu,
                            cfg.app_dev, mtu - outer, app_mtu + outer))


def _devinfo(cfg: HostConfig, force: bool) -> tuple[DevInfo, dict]:
    from pyroute2 import IPRoute

    hint = "run `mrc-xdp lab up` or fix the device name in the config"
    names = {}
    with IPRoute() as ipr:
        app = _link(ipr, cfg.app_dev, "create the veth pair or set app_dev in the config")
        fab = _link(ipr, cfg.fabric_dev, "create the veth pair or set fabric_dev in the config")
        planes = []
        for pl in cfg.planes:
            lk = _link(ipr, pl.dev, hint)
            gw = pl.gateway_mac or _resolve_gateway(ipr, lk["index"], pl.gateway, pl.dev)
            planes.append((lk["index"], lk.get_attr("IFLA_ADDRESS"), gw))
            names[pl.dev] = lk
        names[cfg.app_dev] = app
        names[cfg.fabric_dev] = fab
        if cfg.mode == "srv6":
            _check_srv6_mtu(cfg, app, [names[p.dev] for p in cfg.planes])
        for name, lk in names.items():
            pid = _xdp_prog_id(lk)
            if pid and not force:
                raise AlreadyLoaded("%s: an XDP program (id %d) is already attached — "
                                    "`mrc-xdp unload` it, or pass --force to replace it" % (name, pid))
            if lk.get_attr("IFLA_OPERSTATE") == "DOWN" and lk["flags"] & 1 == 0:
                ipr.link("set", index=lk["index"], state="up")
    dev = DevInfo(app["index"], app.get_attr("IFLA_ADDRESS"), fab["index"], fab.get_attr("IFLA_ADDRESS"), planes)
    return dev, {n: lk["index"] for n, lk in names.items()}


def _trim_heap() -> None:
    """Give freed compiler memory back to the system (glibc keeps it otherwise)."""
    with contextlib.suppress(Exception):
        ctypes.CDLL(None).malloc_trim(0)


class Datapath:
    """A compiled datapath: the bcc object, program fds and maps (by name), and the path
    its programs took (progload: .frags, .path_info)."""

    def __init__(self, built):
        self.built = built
        self.bpf = built.bpf
        self.fns = {k: built.progs[v] for k, v in PROGS.items()}
        self.maps = {n: bpfsys.Map(self.bpf[n.encode()].map_fd, n, owns_fd=False) for n in DATAPATH_MAPS}
        self.frags = built.frags
        self.path_info = built.info()

    def fd(self, prog: str) -> int:
        return self.fns[prog].fd

    def close(self) -> None:
        """Release the bcc object and our program fds: the compiled module, maps.  Pinned
        and attached objects live on; the rest leaves the kernel.  bcc registers cleanup()
        with atexit, which would keep every BPF object of the process alive until exit."""
        built, self.built, self.bpf = self.built, None, None
        self.fns, self.maps = {}, {}
        if built is None:
            return
        built.close()
        _trim_heap()

    def configure(self, cfg: HostConfig, dev: DevInfo) -> None:
        write_all(self.maps, cfg, dev, icrc_rows())


def build(frags: str | None = None) -> Datapath:
    """Compile and load (not attach) the datapath programs; ~2 s (twice that when the
    kernel refuses the frags programs and the single-buffer ones are built instead).
    frags: 'auto', 'on' or 'off' (default: MRC_XDP_FRAGS, see progload)."""
    from mrc_xdp.datapath import progload
    from mrc_xdp.datapath.bpfsrc import compile_bpf
    try:
        built = progload.build(lambda extra: compile_bpf("mrc_datapath.c", extra),
                               list(PROGS.values()), frags)
        return Datapath(built)
    except ValueError as e:          # MRC_XDP_FRAGS spelled wrong
        raise LoadError(str(e)) from None
    except progload.FragsRefused as e:
        raise LoadError("%s — unset %s (or set it to 0) to load the single-buffer programs"
                        % (e, progload.ENV)) from None
    except Exception as e:  # bcc raises bare Exception with the verifier log printed above
        raise LoadError("BPF compile/load failed: %s (the compiler or verifier output above says "
                        "why; missing kernel headers: run `make setup`)" % e) from e


def _attach(fd: int, dev: str, mode: str) -> str:
    """Attach prog fd to dev (current netns); 'auto' tries native, then generic."""
    from pyroute2 import IPRoute
    from pyroute2.netlink.exceptions import NetlinkError
    modes = {"native": [XDP_FLAGS_DRV_MODE], "generic": [XDP_FLAGS_SKB_MODE],
             "auto": [XDP_FLAGS_DRV_MODE, XDP_FLAGS_SKB_MODE]}[mode]
    last = None
    with IPRoute() as ipr:
        idx = ipr.link_lookup(ifname=dev)
        if not idx:
            raise LoadError("%s: no such device" % dev)
        for fl in modes:
            try:
                ipr.link("set", index=idx[0], xdp_fd=fd, xdp_flags=fl)
                return "native" if fl == XDP_FLAGS_DRV_MODE else "generic"
            except NetlinkError as e:
                last = os.strerror(e.code)
    raise LoadError("%s: cannot attach XDP in %s mode: %s" % (dev, mode, last))


def _detach(dev: str, expect_ids: set[int]) -> bool:
    """Detach the XDP program from dev if it is one of ours. True if detached."""
    from pyroute2 import IPRoute
    with IPRoute() as ipr:
        idx = ipr.link_lookup(ifname=dev)
        if not idx:
            return False
        lk = ipr.get_links(idx[0])[0]
        pid = _xdp_prog_id(lk)
        if not pid or (expect_ids and pid not in expect_ids):
            return False
        xdp = lk.get_attr("IFLA_XDP")
        mode = xdp.get_attr("IFLA_XDP_ATTACHED") if xdp else None
        flags = XDP_FLAGS_SKB_MODE if mode == "xdpgeneric" else XDP_FLAGS_DRV_MODE
        ipr.link("set", index=idx[0], xdp_fd=-1, xdp_flags=flags)
        return True


_XDP_MODE_IDS = (("IFLA_XDP_DRV_PROG_ID", XDP_FLAGS_DRV_MODE), ("IFLA_XDP_SKB_PROG_ID", XDP_FLAGS_SKB_MODE))


def _detach_ids(ids: set[int]) -> list[str]:
    """Detach, from every device of the current netns, each XDP program whose id is in
    ids (native and generic attachments alike). Returns the devices detached."""
    from pyroute2 import IPRoute
    out = []
    if not ids:
        return out
    with IPRoute() as ipr:
        for lk in ipr.get_links():
            xdp = lk.get_attr("IFLA_XDP")
            if not xdp:
                continue
            hits = [fl for attr, fl in _XDP_MODE_IDS if xdp.get_attr(attr) in ids]
            if not hits and xdp.get_attr("IFLA_XDP_PROG_ID") in ids:   # kernels without per-mode ids
                hits = [XDP_FLAGS_SKB_MODE if xdp.get_attr("IFLA_XDP_ATTACHED") == "xdpgeneric"
                        else XDP_FLAGS_DRV_MODE]
            for fl in hits:
                with contextlib.suppress(Exception):
                    ipr.link("set", index=lk["index"], xdp_fd=-1, xdp_flags=fl)
                    out.append(lk.get_attr("IFLA_IFNAME"))
    return out


def _write_state(state: dict) -> None:
    """Write /run/mrc-xdp/<instance>.json atomically (a crash leaves the old or the new)."""
    os.makedirs(STATE_DIR, exist_ok=True)
    path = _paths(state["instance"])[1]
    tmp = path + ".tmp"
    with open(tmp, "w") as f:
        json.dump(state, f, indent=1)
    os.replace(tmp, path)


def _map_type(fd: int) -> int | None:
    """The map type of a BPF fd, None when it is not a map (a pinned program)."""
    with open("/proc/self/fdinfo/%d" % fd) as f:
        for line in f:
            if line.startswith("map_type:"):
                return int(line.split()[1])
    return None


def _pinned_prog_arrays() -> list[str]:
    """Every PROG_ARRAY map pinned in a directory under /sys/fs/bpf/mrc/."""
    out = []
    try:
        dirs = sorted(os.listdir(PIN_ROOT))
    except FileNotFoundError:
        return out
    for d in dirs:
        full = os.path.join(PIN_ROOT, d)
        if not is_valid(d) or os.path.islink(full) or not os.path.isdir(full):
            continue          # only real directories of the pin root, never a link out of it
        for name in sorted(os.listdir(full)):
            path = os.path.join(full, name)
            if os.path.islink(path):
                continue
            try:
                fd = bpfsys.obj_get(path)
            except OSError:
                continue
            try:
                if _map_type(fd) == BPF_MAP_TYPE_PROG_ARRAY:
                    out.append(path)
            finally:
                os.close(fd)
    return out


def unchain(prog_ids: set[int]) -> list[str]:
    """Delete every entry of a pinned prog array that holds one of prog_ids (a lookup on
    a prog array returns the program id), so nothing tail-calls those programs any more.
    Returns the entries removed, as "<dir>/<map>[<index>]"."""
    removed = []
    if not prog_ids:
        return removed
    for path in _pinned_prog_arrays():
        with contextlib.suppress(OSError), bpfsys.Map.open_pinned(path) as m:
            for k in list(m.keys()):
                v = m.lookup(k)
                if v is not None and int.from_bytes(v[:4], "little") in prog_ids and m.delete(k):
                    removed.append("%s[%d]" % (os.path.relpath(path, PIN_ROOT), int.from_bytes(k, "little")))
    return removed


def _ensure_pin_root() -> None:
    """/sys/fs/bpf/mrc exists (a real directory) before anything is pinned under it."""
    os.makedirs(PIN_ROOT, mode=0o755, exist_ok=True)
    if os.path.islink(PIN_ROOT) or not os.path.isdir(PIN_ROOT):
        raise LoadError("%s is not a directory: remove it (mrc-xdp pins only under it)" % PIN_ROOT)


class _Made:
    """What one load created, so that a failed load removes exactly that (by object id)."""

    def __init__(self, instance: str):
        self.instance = instance
        self.pins: list[tuple[str, str, int]] = []    # (path, "map"|"prog", object id)
        self.pdir = None
        self.root = False
        self.state_ids: dict | None = None

    def undo(self, netns_name: str | None) -> None:
        prog_ids = set((self.state_ids or {}).values())
        with contextlib.suppress(Exception), _in(netns_name):
            _detach_ids(prog_ids)
        for path, kind, oid in reversed(self.pins):
            with contextlib.suppress(OSError):
                fd = bpfsys.obj_get(path)
                try:
                    cur = (bpfsys.prog_info if kind == "prog" else bpfsys.map_info)(fd).id
                finally:
                    os.close(fd)
                if cur == oid:
                    os.unlink(path)
        for d in (self.pdir, PIN_ROOT if self.root else None):
            if d:
                with contextlib.suppress(OSError):
                    os.rmdir(d)          # only when empty: never someone else's pins
        if self.state_ids is not None:
            spath = state_path(self.instance)
            with contextlib.suppress(OSError, ValueError, AttributeError):
                with open(spath) as f:
                    if json.load(f).get("prog_ids") == self.state_ids:
                        os.unlink(spath)
            with contextlib.suppress(FileNotFoundError):
                os.unlink(spath + ".tmp")


def load(cfg: HostConfig, netns_name: str | None = None, force: bool = False,
         xdp_mode: str = "auto", config_path: str | None = None, progress=None,
         wait: float = 0.0) -> dict:
    """Load the datapath for cfg; returns the state written to /run/mrc-xdp/<instance>.json.

    The instance's lock is held throughout: when another process is loading or unloading
    the same instance, Busy (wait: seconds to wait for it first)."""
    require_root()
    _paths(cfg.instance)
    with instance_lock(cfg.instance, "loaded", wait):
        return _load_locked(cfg, netns_name, force, xdp_mode, config_path, progress or (lambda s: None))


def _load_locked(cfg, netns_name, force, xdp_mode, config_path, say) -> dict:
    pdir, spath = _paths(cfg.instance)
    if os.path.lexists(pdir) or os.path.lexists(spath):
        if not force:
            raise AlreadyLoaded("instance %r is already loaded (or a load of it was interrupted) — "
                                "`mrc-xdp unload --instance %s` first, or pass --force to replace it"
                                % (cfg.instance, cfg.instance))
        _unload_locked(cfg.instance)
    t0 = time.monotonic()
    with _in(netns_name):
        dev, ifindexes = _devinfo(cfg, force)
    say("compiling datapath (bcc; a build made before comes from the build cache)")
    dp = build()
    say("programs: %s (%s; %s)" % ("frags-aware (multi-buffer frames)" if dp.frags else "single-buffer",
                                   dp.path_info["why"], "bcc's build replayed from the build cache"
                                   if dp.path_info["build"] == "cache" else "compiled by bcc"))
    try:
        return _install(dp, cfg, dev, ifindexes, netns_name, force, xdp_mode, config_path, say, t0)
    finally:
        dp.close()       # pins and attachments hold what must live on


def _install(dp, cfg, dev, ifindexes, netns_name, force, xdp_mode, config_path, say, t0) -> dict:
    say("writing maps: %d connections, %d planes" % (len(cfg.connections), len(cfg.planes)))
    with _in(netns_name):   # devmap entries name ifindexes of the caller's netns
        dp.configure(cfg, dev)
    prog_ids = {k: bpfsys.prog_info(fn.fd).id for k, fn in dp.fns.items()}
    # the state goes down before anything is pinned or attached: whatever happens from
    # here on, `unload` finds the netns, the devices and the program ids
    state = {
        "instance": cfg.instance,
        "netns": netns_name,
        "mode": cfg.mode,
        "local_addr": cfg.local_addr,
        "app_dev": cfg.app_dev,
        "fabric_dev": cfg.fabric_dev,
        "planes": [{"dev": p.dev, "ifindex": dev.planes[i][0], "gateway_mac": dev.planes[i][2]}
                   for i, p in enumerate(cfg.planes)],
        "ifindexes": ifindexes,
        "xdp_modes": {},
        "prog_ids": prog_ids,
        "frags": dp.path_info,
        "connections": [{"name": c.name, "peer": c.peer, "local_qpn": c.local_qpn,
                         "remote_qpn": c.remote_qpn} for c in cfg.connections],
        "config_path": config_path,
        "complete": False,
    }
    made = _Made(cfg.instance)
    try:
        made.root = not os.path.lexists(PIN_ROOT)
        _ensure_pin_root()
        pdir, _ = _paths(cfg.instance)       # checked again now that the root exists
        made.state_ids = prog_ids
        _write_state(state)
        os.mkdir(pdir, 0o755)
        made.pdir = pdir
        for name, mp in dp.maps.items():
            path = os.path.join(pdir, name)
            bpfsys.obj_pin(mp.fd, path)
            made.pins.append((path, "map", bpfsys.map_info(mp.fd).id))
        for key, fn in dp.fns.items():
            path = os.path.join(pdir, "prog_" + key)
            bpfsys.obj_pin(fn.fd, path)
            made.pins.append((path, "prog", prog_ids[key]))
        attached = state["xdp_modes"]
        with _in(netns_name):
            if force:
                for d in [cfg.app_dev, cfg.fabric_dev] + [p.dev for p in cfg.planes]:
                    _detach(d, set())
            say("attaching: spray -> %s, ingress -> %s, to_engine -> %s" % (
                cfg.fabric_dev, ",".join(p.dev for p in cfg.planes), cfg.app_dev))
            attached[cfg.app_dev] = _attach(dp.fd("engine"), cfg.app_dev, xdp_mode)
            attached[cfg.fabric_dev] = _attach(dp.fd("spray"), cfg.fabric_dev, xdp_mode)
            for p in cfg.planes:
                attached[p.dev] = _attach(dp.fd("ingress"), p.dev, xdp_mode)
        state.update(complete=True, loaded_at=time.time(), load_seconds=round(time.monotonic() - t0, 3))
        _write_state(state)
    except BaseException:
        made.undo(netns_name)
        raise
    return state


def unload(instance: str, quiet_missing: bool = False, wait: float = 60.0) -> dict:
    """Detach our programs, remove pins and state. Returns what was removed.

    Works from whatever a crash left: the program ids come from the state file and from
    the pinned programs, and any device holding one of them is detached.  Holds the
    instance's lock (waits up to wait seconds for a load of it in progress)."""
    require_root()
    _paths(instance)
    with instance_lock(instance, "unloaded", wait):
        return _unload_locked(instance, quiet_missing)


def _unload_locked(instance: str, quiet_missing: bool = False) -> dict:
    pdir, spath = _paths(instance)
    if not os.path.lexists(pdir) and not os.path.lexists(spath):
        if quiet_missing:
            return {"instance": instance, "detached": [], "unchained": [], "pins": False}
        raise LoadError("instance %r is not loaded (nothing to unload)" % instance)
    try:
        with open(spath) as f:
            state = json.load(f)
        if not isinstance(state, dict):
            state = {}
    except (OSError, ValueError):
        state = {}
    ids = set(v for v in (state.get("prog_ids") or {}).values() if isinstance(v, int))
    for key in PROGS:   # the pinned programs name our ids even without a state file
        with contextlib.suppress(OSError):
            fd = bpfsys.obj_get(os.path.join(pdir, "prog_" + key))
            try:
                ids.add(bpfsys.prog_info(fd).id)
            finally:
                os.close(fd)
    unchained = unchain(ids)
    detached = []
    # every device of the recorded netns; without a state file naming it, the current
    # netns and every named one (program ids are global: only ours match)
    recorded = isinstance(state.get("netns"), str) or ("netns" in state and state["netns"] is None)
    spaces = [state["netns"]] if recorded else [None] + netns.list_names()
    for ns in spaces:
        with contextlib.suppress(Exception):
            if ns is not None and not netns.exists(ns):
                continue
            with _in(ns):
                detached += [d if ns is None or recorded else "%s:%s" % (ns, d) for d in _detach_ids(ids)]
    shutil.rmtree(pdir, ignore_errors=True)    # a checked real directory: rmtree follows no link
    for f in (spath, spath + ".tmp"):
        with contextlib.suppress(FileNotFoundError):
            os.unlink(f)
    with contextlib.suppress(OSError):
        os.rmdir(PIN_ROOT)   # /sys/fs/bpf/mrc when it is empty
    return {"instance": instance, "detached": detached, "unchained": unchained, "pins": True}
