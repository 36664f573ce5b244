"""Load and unload the host datapath.

``load(cfg)`` compiles bpf/mrc_datapath.c with bcc, fills the maps from the config,
attaches spray to the fabric side of the mrc0 pair, ingress to every plane NIC and
to_engine to mrc0, and pins every map and program under /sys/fs/bpf/mrc/<instance>/
so the datapath outlives the loading process and any process can read it.
``unload(instance)`` detaches exactly our programs, deletes every entry of a pinned
prog array (e.g. the lab link model's mrc_lnext) that tail-calls one of them, and
removes the pins and state.
"""
from __future__ import annotations

import contextlib
import json
import os
import shutil
import time

from . import bpfsys, netns
from .config import HostConfig
from .maps import DATAPATH_MAPS, PIN_ROOT, DevInfo, pin_dir, state_path, write_all
from .shared import CONSTS, MAP_NAMES

PROGS = {"spray": MAP_NAMES["MRC_PROG_SPRAY"], "ingress": MAP_NAMES["MRC_PROG_INGRESS"],
         "engine": MAP_NAMES["MRC_PROG_ENGINE"]}

XDP_FLAGS_UPDATE_IF_NOEXIST = 1 << 0
XDP_FLAGS_SKB_MODE = 1 << 1
XDP_FLAGS_DRV_MODE = 1 << 2
BPF_MAP_TYPE_PROG_ARRAY = 3

_icrc_rows_cache: list | None = None


class LoadError(RuntimeError):
    """One line saying what failed and what to do."""


class AlreadyLoaded(LoadError):
    pass


def require_root() -> None:
    if os.geteuid() != 0:
        raise LoadError("needs root (CAP_BPF and CAP_NET_ADMIN): run it with sudo")
    if not os.path.ismount("/sys/fs/bpf"):
        raise LoadError("/sys/fs/bpf is not mounted: mount -t bpf bpf /sys/fs/bpf")


def icrc_rows():
    global _icrc_rows_cache
    if _icrc_rows_cache is None:
        from .wire import icrc_update_rows
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


class Datapath:
    """A compiled datapath: the bcc object, program fds and maps (by name)."""

    def __init__(self, bpf):
        from bcc import BPF
        self.bpf = bpf
        self.fns = {k: bpf.load_func(v.encode(), BPF.XDP) for k, v in PROGS.items()}
        self.maps = {n: bpfsys.Map(bpf[n.encode()].map_fd, n, owns_fd=False) for n in DATAPATH_MAPS}

    def fd(self, prog: str) -> int:
        return self.fns[prog].fd

    def configure(self, cfg: HostConfig, dev: DevInfo) -> None:
        write_all(self.maps, cfg, dev, icrc_rows())


def build() -> Datapath:
    """Compile and load (not attach) the datapath programs; ~2 s."""
    from .bpfsrc import compile_bpf
    try:
        return Datapath(compile_bpf("mrc_datapath.c"))
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
    path = state_path(state["instance"])
    os.makedirs(os.path.dirname(path), exist_ok=True)
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
        if not os.path.isdir(full):
            continue
        for name in sorted(os.listdir(full)):
            path = os.path.join(full, name)
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


def load(cfg: HostConfig, netns_name: str | None = None, force: bool = False,
         xdp_mode: str = "auto", config_path: str | None = None, progress=None) -> dict:
    """Load the datapath for cfg; returns the state written to /run/mrc-xdp/<instance>.json."""
    say = progress or (lambda s: None)
    require_root()
    pdir = pin_dir(cfg.instance)
    if os.path.exists(pdir) or os.path.exists(state_path(cfg.instance)):
        if not force:
            raise AlreadyLoaded("instance %r is already loaded (or a load of it was interrupted) — "
                                "`mrc-xdp unload --instance %s` first, or pass --force to replace it"
                                % (cfg.instance, cfg.instance))
        unload(cfg.instance)
    t0 = time.monotonic()
    with _in(netns_name):
        dev, ifindexes = _devinfo(cfg, force)
    say("compiling datapath (bcc)")
    dp = build()
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
        "connections": [{"name": c.name, "peer": c.peer, "local_qpn": c.local_qpn,
                         "remote_qpn": c.remote_qpn} for c in cfg.connections],
        "config_path": config_path,
        "complete": False,
    }
    try:
        _write_state(state)
        os.makedirs(pdir, exist_ok=True)
        for name, mp in dp.maps.items():
            bpfsys.obj_pin(mp.fd, os.path.join(pdir, name))
        for key, fn in dp.fns.items():
            bpfsys.obj_pin(fn.fd, os.path.join(pdir, "prog_" + key))
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
        with contextlib.suppress(Exception):
            with _in(netns_name):
                _detach_ids(set(prog_ids.values()))
        shutil.rmtree(pdir, ignore_errors=True)
        with contextlib.suppress(FileNotFoundError):
            os.unlink(state_path(cfg.instance))
        raise
    return state


def unload(instance: str, quiet_missing: bool = False) -> dict:
    """Detach our programs, remove pins and state. Returns what was removed.

    Works from whatever a crash left: the program ids come from the state file and from
    the pinned programs, and any device holding one of them is detached."""
    require_root()
    pdir = pin_dir(instance)
    spath = state_path(instance)
    if not os.path.exists(pdir) and not os.path.exists(spath):
        if quiet_missing:
            return {"instance": instance, "detached": [], "unchained": [], "pins": False}
        raise LoadError("instance %r is not loaded (nothing to unload)" % instance)
    try:
        with open(spath) as f:
            state = json.load(f)
    except (FileNotFoundError, ValueError):
        state = {}
    ids = set((state.get("prog_ids") or {}).values())
    for key in PROGS:   # the pinned programs name our ids even without a state file
        with contextlib.suppress(OSError):
            fd = bpfsys.obj_get(os.path.join(pdir, "prog_" + key))
            ids.add(bpfsys.prog_info(fd).id)
            os.close(fd)
    unchained = unchain(ids)
    detached = []
    # every device of the recorded netns; without a state file naming it, the current
    # netns and every named one (program ids are global: only ours match)
    spaces = [state["netns"]] if "netns" in state else [None] + netns.list_names()
    for ns in spaces:
        if ns is not None and not netns.exists(ns):
            continue
        with contextlib.suppress(Exception), _in(ns):
            detached += [d if ns is None or "netns" in state else "%s:%s" % (ns, d) for d in _detach_ids(ids)]
    shutil.rmtree(pdir, ignore_errors=True)
    for f in (spath, spath + ".tmp"):
        with contextlib.suppress(FileNotFoundError):
            os.unlink(f)
    with contextlib.suppress(OSError):
        os.rmdir(os.path.dirname(pdir))   # /sys/fs/bpf/mrc when it is empty
    return {"instance": instance, "detached": detached, "unchained": unchained, "pins": True}
