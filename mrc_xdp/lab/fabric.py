"""Build and tear down a lab fabric of network namespaces.

One netns per node, named ``<prefix><node>`` (default prefix ``mrc-``: mrc-h0,
mrc-p0t0s0, mrc-p0t1s1, ...).  Every link is a veth pair created directly in its two
namespaces with a deterministic MAC and an ifindex from a lab-owned range, unique across
the lab, so one link-model program and one map keyed by ifindex serve every link end.

Switches forward with the kernel and static tables only: in srv6 mode uN (seg6local End,
next-csid, 32-bit block, 16-bit uSIDs) plus /48 routes to the next uSIDs (on a kernel
without seg6local, CONFIG_IPV6_SEG6_LWTUNNEL, the link model does uN on every switch
port and the kernel keeps the /48 routes: usid_end_where()); in ecmp mode
/128 routes to every host's MRC address, multipath towards the T1s, L4 hash.  Neighbour
entries are static, so no packet waits on NDP.

State: /run/mrc-xdp/lab-<prefix>.json (for status/down from another process); link
model pins under /sys/fs/bpf/mrc/lab-<prefix>/.  The state records everything the lab
creates (namespaces, pin dirs, host datapath instances, loader worker pids), each entry
written (atomically, fsync'd) *before* the creation, so ``down`` also cleans a lab whose
``up`` was killed midway, and removes nothing it did not record: a namespace that merely
matches the prefix (someone else's, or another lab's) is left alone and named.  ``up``
refuses a prefix that overlaps another lab's (one is a prefix of the other) and names
that already exist.

    state = fabric.up(topology.load(), prefix="mrc-", progress=print)
    fabric.down("mrc-")
"""
from __future__ import annotations

import contextlib
import fcntl
import functools
import json
import os
import re
import shutil
import signal
import subprocess
import threading
import time

from mrc_xdp.transport import conns
from mrc_xdp.datapath import names, netns
from mrc_xdp.datapath.maps import PIN_ROOT, STATE_DIR
from mrc_xdp.lab import linkmodel as lmod
from mrc_xdp.lab.executor import NetnsNode
from mrc_xdp.lab.topology import Topology, from_dict

DEFAULT_PREFIX = "mrc-"
PREFIX_MAX = 16   # + a host name (<= 8) = an instance name well inside the 32 allowed
_PREFIX = re.compile(r"[A-Za-z0-9][A-Za-z0-9_-]{0,%d}" % (PREFIX_MAX - 1))


class LabError(RuntimeError):
    """A lab operation failed; str() is one line saying what and what to do."""


class LabNotUp(LabError):
    pass


class LabAlreadyUp(LabError):
    def __init__(self, state: dict):
        super().__init__("lab %r is already up (%d nodes); `mrc-xdp lab down --prefix %s` first"
                         % (state["prefix"], len(state["nodes"]), state["prefix"]))
        self.state = state


_INSTANCE = re.compile(r"[A-Za-z0-9][A-Za-z0-9_-]{0,31}")   # <prefix><host>


def check_prefix(prefix: str) -> str:
    if (not isinstance(prefix, str) or not _PREFIX.fullmatch(prefix)
            or prefix.startswith(names.RESERVED_PREFIX)):
        raise LabError("prefix %r: use 1-%d characters of [A-Za-z0-9_-], starting with a letter "
                       "or digit, not with %r" % (prefix, PREFIX_MAX, names.RESERVED_PREFIX))
    return prefix


def state_path(prefix: str) -> str:
    return os.path.join(STATE_DIR, "lab-%s.json" % prefix)


def pin_dir(prefix: str) -> str:
    return os.path.join(PIN_ROOT, "lab-%s" % prefix)


def ns_name(prefix: str, node: str) -> str:
    return prefix + node


def require_root() -> None:
    if os.geteuid() != 0:
        raise LabError("the lab needs root (network namespaces, XDP, BPF pins): run with sudo")


# ---------------------------------------------------------------- state
def load_state(prefix: str) -> dict:
    try:
        with open(state_path(prefix)) as f:
            st = json.load(f)
    except FileNotFoundError:
        raise LabNotUp("lab %r is not up (no %s): run `mrc-xdp lab up`"
                       % (prefix, state_path(prefix))) from None
    except ValueError:
        raise LabNotUp("lab %r: state file %s is damaged: run `mrc-xdp lab down --prefix %s`"
                       % (prefix, state_path(prefix), prefix)) from None
    return st


def topology_of(state: dict) -> Topology:
    return from_dict(state["topology"], source=state.get("topology_source", ""))


def _write_state(state: dict) -> None:
    """Atomically (temp file, fsync, rename, fsync of the directory)."""
    os.makedirs(STATE_DIR, exist_ok=True)
    tmp = state_path(state["prefix"]) + ".tmp"
    with open(tmp, "w") as f:
        json.dump(state, f, indent=1)
        f.flush()
        os.fsync(f.fileno())
    os.replace(tmp, state_path(state["prefix"]))
    dfd = os.open(STATE_DIR, os.O_RDONLY | os.O_DIRECTORY)
    try:
        os.fsync(dfd)
    finally:
        os.close(dfd)


RECORD_KINDS = ("netns", "pins", "instances", "workers")


def record(state: dict, kind: str, items) -> None:
    """Add items to what the lab created and write the state, before creating them."""
    lst = state.setdefault("created", {}).setdefault(kind, [])
    for it in items:
        if it not in lst:
            lst.append(it)
    _write_state(state)


def unrecord(state: dict, kind: str, item) -> None:
    """Take back an entry whose creation failed (the thing was not created by us)."""
    with contextlib.suppress(ValueError):
        state.get("created", {}).get(kind, []).remove(item)
    _write_state(state)


def created(state: dict, kind: str) -> list:
    """What the lab recorded as created.  (A state written before records existed names
    its nodes only: those namespaces are the lab's.)"""
    if "created" not in state:
        return sorted(state.get("nodes", {}).values()) if kind == "netns" else []
    return list(state["created"].get(kind, []))


@contextlib.contextmanager
def _labs_lock():
    """Serializes the overlap check and the first state write of concurrent `up`s."""
    os.makedirs(STATE_DIR, exist_ok=True)
    fd = os.open(os.path.join(STATE_DIR, "lab.lock"), os.O_RDWR | os.O_CREAT | os.O_CLOEXEC, 0o600)
    try:
        fcntl.flock(fd, fcntl.LOCK_EX)
        yield
    finally:
        os.close(fd)


def lab_states() -> dict[str, dict]:
    """Every lab with a state file here (running, half-built or crashed): {prefix: state}."""
    out = {}
    try:
        names = os.listdir(STATE_DIR)
    except FileNotFoundError:
        return out
    for f in names:
        if not (f.startswith("lab-") and f.endswith(".json")):
            continue
        prefix = f[4:-5]
        if not _PREFIX.fullmatch(prefix):
            continue
        try:
            with open(os.path.join(STATE_DIR, f)) as fh:
                st = json.load(fh)
        except (OSError, ValueError):
            continue
        if isinstance(st, dict) and st.get("prefix") == prefix:
            out[prefix] = st
    return out


def overlapping(prefix: str) -> list[str]:
    """Other labs whose prefix is a prefix of this one, or the other way round."""
    return sorted(p for p in lab_states() if p != prefix and (p.startswith(prefix) or prefix.startswith(p)))


_proc_start = conns.proc_start     # a live process's start time: (pid, start) names it


def worker_record(pid: int) -> dict:
    """What the state keeps of a worker process: its pid and start time (a pid alone may
    be reused by an unrelated process by the time `down` runs)."""
    return {"pid": pid, "start": _proc_start(pid)}


def _end_workers(workers, timeout: float = 2.0) -> list[int]:
    """SIGKILL the recorded workers that still run (same pid *and* start time), wait for
    them to go.  Returns the pids ended."""
    ended = []
    for w in workers:
        try:
            pid, start = int(w["pid"]), w.get("start")
        except (TypeError, KeyError, ValueError):
            continue
        if pid > 1 and start is not None and _proc_start(pid) == start:
            with contextlib.suppress(ProcessLookupError):
                os.kill(pid, signal.SIGKILL)
                ended.append(pid)
    deadline = time.monotonic() + timeout
    while any(_proc_start(p) is not None for p in ended) and time.monotonic() < deadline:
        time.sleep(0.02)
    return ended


def running(prefix: str) -> dict | None:
    """The state of a complete running lab, or None."""
    try:
        st = load_state(prefix)
    except LabNotUp:
        return None
    if not st.get("complete"):
        return None
    if any(not netns.exists(ns) for ns in st["nodes"].values()):
        return None
    return st


# ---------------------------------------------------------------- netlink helpers
def _create_veth(ipr, name: str, ifindex: int, mac: str, mtu: int,
                 peer_name: str, peer_ifindex: int, peer_mac: str, peer_ns_fd: int | None) -> None:
    """A veth pair with both ifindexes chosen; the peer created in another netns."""
    from pyroute2.netlink import NLM_F_ACK, NLM_F_CREATE, NLM_F_EXCL, NLM_F_REQUEST
    from pyroute2.netlink.rtnl import RTM_NEWLINK
    from pyroute2.netlink.rtnl.ifinfmsg import ifinfmsg

    peer_attrs = [("IFLA_IFNAME", peer_name), ("IFLA_ADDRESS", peer_mac), ("IFLA_MTU", mtu)]
    if peer_ns_fd is not None:
        peer_attrs.append(("IFLA_NET_NS_FD", peer_ns_fd))
    msg = ifinfmsg()
    msg["index"] = ifindex
    msg["attrs"] = [
        ("IFLA_IFNAME", name), ("IFLA_ADDRESS", mac), ("IFLA_MTU", mtu),
        ("IFLA_LINKINFO", {"attrs": [
            ("IFLA_INFO_KIND", "veth"),
            ("IFLA_INFO_DATA", {"attrs": [
                ("VETH_INFO_PEER", {"index": peer_ifindex, "attrs": peer_attrs})]})]})]
    ipr.nlm_request(msg, msg_type=RTM_NEWLINK,
                    msg_flags=NLM_F_REQUEST | NLM_F_ACK | NLM_F_CREATE | NLM_F_EXCL)


_NS_SYSCTLS_COMMON = [
    ("net.ipv6.conf.all.accept_dad", 0), ("net.ipv6.conf.default.accept_dad", 0),
    ("net.ipv6.conf.all.accept_ra", 0), ("net.ipv6.conf.default.accept_ra", 0),
    ("net.ipv6.conf.all.router_solicitations", 0), ("net.ipv6.conf.default.router_solicitations", 0),
    # no link-local addresses: no NDP, RS or MLD chatter on the fabric (neighbours are static)
    ("net.ipv6.conf.default.addr_gen_mode", 1),
]
_NS_SYSCTLS_SWITCH = [
    ("net.ipv6.conf.all.forwarding", 1), ("net.ipv6.conf.default.forwarding", 1),
    ("net.ipv6.conf.all.seg6_enabled", 1), ("net.ipv6.conf.default.seg6_enabled", 1),
    ("net.ipv6.fib_multipath_hash_policy", 1),
    ("net.ipv6.conf.all.ignore_routes_with_linkdown", 1),
]


def _write_sysctls(pairs) -> None:
    for k, v in pairs:
        with open("/proc/sys/" + k.replace(".", "/"), "w") as f:
            f.write(str(v))


# ---------------------------------------------------------------- tables
@functools.lru_cache(maxsize=None)
def kernel_has_seg6local() -> bool:
    """Whether this kernel takes a uN route (seg6local End, next-csid): tried once in a
    throwaway network namespace.  Kernels built without CONFIG_IPV6_SEG6_LWTUNNEL say
    "lwt encapsulation type not supported"."""
    return subprocess.run(["unshare", "-n", "sh", "-c",
                           "ip link set lo up && ip -6 route add fc00:0:1::/48 encap seg6local "
                           "action End flavors next-csid lblen 32 nflen 16 dev lo"],
                          capture_output=True).returncode == 0


def usid_end_where(topo: Topology) -> str | None:
    """Where a netns lab's switches do uN: "kernel" (seg6local routes) or "linkmodel"
    (this kernel has no seg6local); None in ecmp mode.  MRC_LAB_UN=kernel|linkmodel forces it."""
    if topo.mode != "srv6":
        return None
    forced = os.environ.get("MRC_LAB_UN", "")
    if forced in ("kernel", "linkmodel"):
        return forced
    if forced:
        raise LabError("MRC_LAB_UN=%r: use kernel or linkmodel (or unset it)" % forced)
    return "kernel" if kernel_has_seg6local() else "linkmodel"


def _batch(topo: Topology, node: str, un: str | None = "kernel") -> list[str]:
    """`ip -batch` lines (routes, neighbours) for one node; un="linkmodel": no seg6local
    route (the link model does uN on the switch's ports)."""
    n = topo.nodes[node]
    out: list[str] = []
    for p in n.ports:                     # static neighbours for every link peer
        out.append("neigh replace %s lladdr %s dev %s nud permanent"
                   % (p.peer.addr, p.peer.mac, p.ifname))
    if n.kind == "host":
        h = topo.host(node)
        fab_mac = _mrc0p_mac(h)
        for other in topo.hosts:          # kernel UDP fallback: peers via mrc0 -> mrc0p
            if other.name != node:
                out.append("neigh replace %s lladdr %s dev mrc0 nud permanent" % (other.addr, fab_mac))
        return out
    port = {p.peer.node: p for p in n.ports}
    if topo.mode == "srv6":
        blk = topo.usid_addr
        # (not `dev lo`: the kernel turns routes via loopback into reject routes)
        if un != "linkmodel":
            out.append("route replace %s/48 encap seg6local action End flavors next-csid "
                       "lblen 32 nflen 16 dev %s" % (blk([n.usid()]), n.ports[0].ifname))
        for p in n.ports:
            peer = topo.nodes[p.peer.node]
            u = peer.usid(n.plane) if peer.kind == "host" else peer.usid()
            out.append("route replace %s/48 via %s dev %s" % (blk([u]), p.peer.addr, p.ifname))
        return out
    for h in topo.hosts:                  # ecmp
        if n.kind == "t0":
            if h.t0 == n.index:
                p = port[h.name]
                out.append("route replace %s/128 via %s dev %s" % (h.addr, p.peer.addr, p.ifname))
            else:
                hops = " ".join("nexthop via %s dev %s" % (port[topo.t1_name(n.plane, j)].peer.addr,
                                                           port[topo.t1_name(n.plane, j)].ifname)
                                for j in range(topo.t1_per_plane))
                out.append("route replace %s/128 %s" % (h.addr, hops))
        else:
            p = port[topo.t0_name(n.plane, h.t0)]
            out.append("route replace %s/128 via %s dev %s" % (h.addr, p.peer.addr, p.ifname))
    return out


def _mrc0_mac(h) -> str:
    from mrc_xdp.lab.topology import mac_of
    return mac_of(h.app_ifindex)


def _mrc0p_mac(h) -> str:
    from mrc_xdp.lab.topology import mac_of
    return mac_of(h.fab_ifindex)


def link_model_cfg(topo: Topology, rx_node: str, link, un: str | None = "kernel") -> dict:
    """The default link-model config of the link end received at rx_node (un="linkmodel":
    with uN for a switch, see usid_end_where)."""
    lm = topo.linkmodel
    n = topo.nodes[rx_node]
    last_hop = n.kind == "host"
    cfg = dict(rate_bps=link.rate_bps, ecn_bytes=lm.ecn_bytes, trim_bytes=lm.trim_bytes,
               drop_bytes=lm.drop_bytes, dscp_trimmed=lm.dscp_trimmed, dscp_ctrl=lm.dscp_ctrl,
               udp_port=lm.udp_port, ecn=not last_hop, trim=True)
    if un == "linkmodel" and topo.mode == "srv6" and not last_hop:
        cfg.update(usid_end=True, usid_block=int(topo.block.network_address) >> 96,
                   usid_self=n.usid())      # the SID usid_addr([n.usid()]) names
    return cfg


# ---------------------------------------------------------------- node set-up (any target)
# The same functions configure a node whether it is a namespace here (NetnsNode) or a VM
# reached over SSH (SshNode, mrc_xdp.lab.vm): only the wiring differs (veth pairs with
# chosen ifindexes here; NICs found by their MAC in a VM).
def node_sysctls(topo: Topology, node: str) -> list:
    """The sysctls of a node, set before its interfaces exist (no link-local addresses)."""
    return _NS_SYSCTLS_COMMON + (_NS_SYSCTLS_SWITCH if topo.nodes[node].kind != "host" else [])


def link_lines(topo: Topology, node: str) -> list[str]:
    """`ip -batch` lines: loopback, link addresses, MRC address, interfaces up."""
    n = topo.nodes[node]
    out = ["link set dev lo up"]
    for p in n.ports:
        out += ["address add %s/64 dev %s" % (p.addr, p.ifname), "link set dev %s up" % p.ifname]
    if n.kind == "host":
        out += ["address add %s/64 dev mrc0" % topo.host(node).addr,
                "link set dev mrc0p up", "link set dev mrc0 up"]
    return out


def configure_links(ex, topo: Topology, node: str) -> None:
    ex.ip_batch(link_lines(topo, node))


def configure_routes(ex, topo: Topology, node: str, un: str | None = "kernel") -> None:
    """Static neighbours and routes (srv6: uN + /48s; ecmp: /128s, multipath)."""
    ex.ip_batch(_batch(topo, node, un))


def linkmodel_ends(topo: Topology, node: str, un: str | None = "kernel") -> list:
    """The link ends received at `node`: [[name, ifname, topology ifindex, config]]."""
    return [[name, rx.ifname, rx.ifindex, link_model_cfg(topo, rx.node, lk, un)]
            for name, rx, tx, lk in topo.link_ends() if rx.node == node]


def attach_linkmodel(lm, ends, netns_name: str | None = None, ifindex_of=None) -> list[str]:
    """Configure and attach the link model at each end.  ifindex_of(ifname): where the
    topology's ifindex is not the device's (a VM); netns_name: the node's namespace."""
    for name, ifname, ifindex, cfg in ends:
        i = ifindex_of(ifname) if ifindex_of else ifindex
        lm.set(i, cfg)
        lmod.xdp_attach(i, lm.prog_fd, netns_name=netns_name)
    return [e[0] for e in ends]


# ---------------------------------------------------------------- up
def _noop(msg: str) -> None:
    pass


# Native XDP on a veth takes a peer MTU above this only from a program loaded with
# BPF_F_XDP_HAS_FRAGS, and only once it is attached (docs/datapath.md "Multi-buffer frames").
XDP_SINGLE_MAX_MTU = 3506


def creation_mtus(topo: Topology) -> tuple[int, int]:
    """The MTUs the lab's veths are made with (fabric links, mrc0/mrc0p): the topology's,
    or at most XDP_SINGLE_MAX_MTU (the app side as far below as in the topology) when
    larger: raise_mtus sets the topology's once the programs are attached."""
    mtu0 = min(topo.mtu, XDP_SINGLE_MAX_MTU)
    return mtu0, min(topo.app_mtu, mtu0 - (topo.mtu - topo.app_mtu))


def raise_mtus(topo: Topology, iprs: dict) -> None:
    """Every fabric link end to topo.mtu and every host's mrc0/mrc0p to topo.app_mtu; a
    veth refuses (ERANGE/EINVAL) while its peer's XDP program is single-buffer."""
    ends = [(e.node, e.ifname) for lk in topo.links for e in (lk.a, lk.b)]
    ends += [(h.name, d) for h in topo.hosts for d in ("mrc0p", "mrc0")]
    for node, dev in ends:
        ipr = iprs[node]
        mtu = topo.app_mtu if dev in ("mrc0", "mrc0p") else topo.mtu
        try:
            ipr.link("set", index=ipr.link_lookup(ifname=dev)[0], mtu=mtu)
        except Exception as e:      # pyroute2's NetlinkError (ERANGE / EINVAL)
            raise LabError("%s %s: MTU %d refused (%s): above %d a veth needs the frags-aware XDP "
                           "programs (MRC_XDP_FRAGS auto or 1, Linux 5.18+); this lab loaded the "
                           "single-buffer ones, so keep mtu at most %d"
                           % (node, dev, mtu, e, XDP_SINGLE_MAX_MTU, XDP_SINGLE_MAX_MTU)) from None


def up(topo: Topology, prefix: str = DEFAULT_PREFIX, progress=_noop, hosts_hook=None) -> dict:
    """Build the lab; returns its state.  Raises LabAlreadyUp if it is running.

    hosts_hook(topo, prefix, state, progress), when given, runs after the fabric is up
    (phase 2: load each host's datapath); its return value is stored as state["hosts"].
    """
    require_root()
    check_prefix(prefix)
    t_start = time.monotonic()
    nodes = {n: ns_name(prefix, n) for n in topo.nodes}
    state = {
        "prefix": prefix, "complete": False, "mode": topo.mode,
        "topology": topo.to_dict(), "topology_source": topo.source,
        "nodes": nodes, "pin_dir": pin_dir(prefix), "state_file": state_path(prefix),
        "started": time.time(), "created": {k: [] for k in RECORD_KINDS},
        "owner": worker_record(os.getpid()),      # the `lab up` building it
    }
    with _labs_lock():
        st = running(prefix)
        if st:
            raise LabAlreadyUp(st)
        other = overlapping(prefix)
        if other:
            raise LabError("prefix %r overlaps lab %r (one is a prefix of the other, so their names "
                           "could collide): pick another prefix, or `mrc-xdp lab down --prefix %s` first"
                           % (prefix, other[0], other[0]))
        if os.path.exists(state_path(prefix)):
            _not_being_built(prefix)
            progress("cleaning up the leftovers of an earlier lab %r" % prefix)
            down(prefix)
        _check_free(topo, prefix, nodes)
        _write_state(state)        # first, so `down` knows about a half-built lab

    # the link model compiles (bcc, ~1.5 s) while the namespaces are built
    compiled: dict = {}

    def _compile():
        try:
            compiled["v"] = lmod.compile_program()
        except BaseException as e:  # reported below
            compiled["e"] = e
    th = threading.Thread(target=_compile, name="linkmodel-compile", daemon=True)
    th.start()
    lmod.ensure_bpffs()
    progress("%s" % topo.summary())

    iprs: dict[str, object] = {}
    fds: dict[str, int] = {}
    try:
        from pyroute2 import IPRoute
        t = time.monotonic()
        for node, ns in nodes.items():
            record(state, "netns", [ns])        # before: a crash right after is cleaned too
            try:
                netns.create(ns)
            except netns.NetnsError as e:
                unrecord(state, "netns", ns)    # not ours (someone made it meanwhile)
                raise LabError("netns %s: %s: it is not this lab's; remove it or pick another "
                               "prefix" % (ns, e.strerror or e)) from None
            fds[node] = netns.open_fd(ns)
            NetnsNode(node, ns).sysctls(node_sysctls(topo, node))
            with netns.enter(ns):
                iprs[node] = IPRoute()
        progress("  %d namespaces (%s*)  %.2fs" % (len(nodes), prefix, time.monotonic() - t))

        t = time.monotonic()
        mtu0, app0 = creation_mtus(topo)
        for lk in topo.links:
            a, b = lk.a, lk.b
            _create_veth(iprs[a.node], a.ifname, a.ifindex, a.mac, mtu0,
                         b.ifname, b.ifindex, b.mac, fds[b.node])
        for h in topo.hosts:
            _create_veth(iprs[h.name], "mrc0", h.app_ifindex, _mrc0_mac(h), app0,
                         "mrc0p", h.fab_ifindex, _mrc0p_mac(h), None)
        execs = {node: NetnsNode(node, ns) for node, ns in nodes.items()}
        for node in topo.nodes:
            configure_links(execs[node], topo, node)
        progress("  %d links (veth, ifindex %d..%d), addresses  %.2fs"
                 % (len(topo.links), topo.links[0].a.ifindex, topo.hosts[-1].fab_ifindex,
                    time.monotonic() - t))

        t = time.monotonic()
        un = state["un"] = usid_end_where(topo)
        for node in topo.nodes:
            configure_routes(execs[node], topo, node, un)
        progress("  static routes and neighbours (%s mode%s)  %.2fs"
                 % (topo.mode, ", uN in the link model: this kernel has no seg6local"
                    if un == "linkmodel" else "", time.monotonic() - t))

        t = time.monotonic()
        th.join()
        if "e" in compiled:
            raise LabError("link model: %s" % compiled["e"])
        lm = lmod.LinkModel.load(compiled["v"])
        record(state, "pins", [pin_dir(prefix)])
        lm.pin(pin_dir(prefix))
        ends = []
        for node in topo.nodes:
            ends += attach_linkmodel(lm, linkmodel_ends(topo, node, un), netns_name=nodes[node])
        progress("  link model on %d link ends (compile overlapped)  %.2fs"
                 % (len(ends), time.monotonic() - t))
        lm.close()

        state["fabric_s"] = round(time.monotonic() - t_start, 3)
        if hosts_hook is not None:
            t = time.monotonic()
            state["hosts"] = hosts_hook(topo, prefix, state, progress)
            progress("  host datapaths  %.2fs" % (time.monotonic() - t))
        if (mtu0, app0) != (topo.mtu, topo.app_mtu):
            t = time.monotonic()
            raise_mtus(topo, iprs)
            progress("  MTUs raised to %d (mrc0 %d), the frags-aware programs attached  %.2fs"
                     % (topo.mtu, topo.app_mtu, time.monotonic() - t))
        state["complete"] = True     # (only now: a crash before leaves an incomplete record)
        state["up_s"] = round(time.monotonic() - t_start, 3)
        _write_state(state)
        progress("lab %r up in %.1fs" % (prefix, state["up_s"]))
        return state
    except BaseException:
        progress("lab up failed: removing what was built")
        th.join()       # (a compile left running would race the next one: bpfsrc)
        for ipr in iprs.values():
            with contextlib.suppress(Exception):
                ipr.close()
        iprs.clear()
        with contextlib.suppress(Exception):
            down(prefix)
        raise
    finally:
        for ipr in iprs.values():
            with contextlib.suppress(Exception):
                ipr.close()
        for fd in fds.values():
            with contextlib.suppress(OSError):
                os.close(fd)


# ---------------------------------------------------------------- down
def down(prefix: str = DEFAULT_PREFIX, progress=_noop, unload_hosts=None) -> dict:
    """Remove what lab `prefix` recorded as created: end its loader workers, unload its
    host datapaths, delete its namespaces, pin dirs and state files.  Namespaces that only
    match the prefix (another lab's, or no lab's) are not touched: they are listed under
    "not_touched".  Works on a half-built or crashed lab (the record precedes every
    creation).  Returns what was removed."""
    require_root()
    check_prefix(prefix)
    t = time.monotonic()
    try:
        st = load_state(prefix)
    except LabNotUp:
        st = None
    if st is not None and (not isinstance(st, dict) or st.get("prefix") != prefix):
        st = None
    if st is not None:
        _not_being_built(prefix, st)
    names = [n for n in (created(st, "netns") if st else [])
             if isinstance(n, str) and n.startswith(prefix) and n != prefix]
    insts = [i for i in (created(st, "instances") if st else [])
             if isinstance(i, str) and i.startswith(prefix) and _INSTANCE.fullmatch(i)]
    ended = _end_workers(created(st, "workers")) if st else []
    if unload_hosts is not None and st is not None:
        with contextlib.suppress(Exception):
            unload_hosts(st)
    removed_ns = []
    for n in sorted(set(names)):
        with contextlib.suppress(ValueError):       # a damaged record: not a netns name
            if netns.delete(n):
                removed_ns.append(n)
    pins = []
    recorded_pins = (created(st, "pins") if st else []) + [os.path.join(PIN_ROOT, i) for i in insts]
    for d in recorded_pins:
        if _inside(d, PIN_ROOT) and os.path.isdir(d):
            shutil.rmtree(d, ignore_errors=True)
            pins.append(d)
    for i in insts:                  # host datapath instances' state (loader)
        f = os.path.join(STATE_DIR, i + ".json")
        if _inside(f, STATE_DIR):
            with contextlib.suppress(FileNotFoundError):
                os.unlink(f)
    had_state = False
    for p in (state_path(prefix), state_path(prefix) + ".tmp"):
        with contextlib.suppress(FileNotFoundError):
            os.unlink(p)
            had_state = True
    others = lab_states()
    skipped = [n for n in netns.list_names(prefix) if n not in removed_ns]
    res = {"prefix": prefix, "netns": removed_ns, "pins": pins, "state_file": had_state,
           "workers_ended": ended, "not_touched": skipped,
           "down_s": round(time.monotonic() - t, 3)}
    progress("lab %r down: %d namespaces, %d pin dirs removed in %.2fs"
             % (prefix, len(removed_ns), len(pins), res["down_s"]))
    if ended:
        progress("  ended %d loader worker(s) of a killed `lab up`: pid %s"
                 % (len(ended), ", ".join(map(str, ended))))
    if skipped:
        progress("  not touching %d namespace(s) matching %r that lab %r did not create: %s"
                 % (len(skipped), prefix, prefix, _owners(skipped, others)))
    return res


def _not_being_built(prefix: str, st: dict | None = None) -> None:
    """Refuse to touch a lab that another live `lab up` is still building."""
    if st is None:
        with contextlib.suppress(LabNotUp):
            st = load_state(prefix)
    own = (st or {}).get("owner") if isinstance(st, dict) else None
    if not isinstance(own, dict) or (st or {}).get("complete"):
        return
    try:
        pid = int(own["pid"])
    except (KeyError, TypeError, ValueError):
        return
    if pid != os.getpid() and own.get("start") is not None and _proc_start(pid) == own["start"]:
        raise LabError("lab %r is still being built by `lab up` (pid %d): wait for it, or stop it "
                       "(kill %d) and run `mrc-xdp lab down --prefix %s`" % (prefix, pid, pid, prefix))


def _inside(path: str, root: str) -> bool:
    r = os.path.realpath(root)
    p = os.path.realpath(path)
    return p != r and p.startswith(r + os.sep)


def _owners(names: list[str], labs: dict) -> str:
    """'12 of lab 'x' (its own `down` removes them), rel-victim'."""
    out, rest = [], list(names)
    for p, st in sorted(labs.items()):
        mine = [n for n in rest if n in created(st, "netns")]
        if mine:
            out.append("%d of lab %r (`mrc-xdp lab down --prefix %s`)" % (len(mine), p, p))
            rest = [n for n in rest if n not in mine]
    out += rest[:10] + (["... (%d more)" % (len(rest) - 10)] if len(rest) > 10 else [])
    return ", ".join(out)


def _check_free(topo: Topology, prefix: str, nodes: dict) -> None:
    """Every name the lab will create is free (a namespace, pin dir or datapath instance of
    that name is someone else's: never adopted, so never deleted by our `down`)."""
    for ns in nodes.values():
        if netns.exists(ns):
            raise LabError("netns %s already exists and is not lab %r's: remove it (`ip netns del %s`) "
                           "or pick another prefix" % (ns, prefix, ns))
    if os.path.exists(pin_dir(prefix)):
        raise LabError("%s exists and is not lab %r's: remove it or pick another prefix"
                       % (pin_dir(prefix), prefix))
    for h in topo.hosts:
        inst = prefix + h.name
        if os.path.exists(os.path.join(PIN_ROOT, inst)) or os.path.exists(os.path.join(STATE_DIR, inst + ".json")):
            raise LabError("datapath instance %s is loaded and is not lab %r's: `mrc-xdp unload -i %s` "
                           "or pick another prefix" % (inst, prefix, inst))


_NODE = re.compile(r"^(p\d+t[01]s\d+|[a-z0-9_]{1,8})$")


def _is_lab_node(node: str) -> bool:
    return bool(_NODE.match(node))


def leftovers(prefix: str) -> dict:
    """What a lab `prefix` could have made that exists right now: names <prefix><node>
    that no other lab recorded (tests assert this is empty after down)."""
    theirs = set()
    for p, st in lab_states().items():
        if p != prefix:
            theirs.update(created(st, "netns"))
            theirs.update(created(st, "instances"))
    ns = [n for n in netns.list_names(prefix) if _is_lab_node(n[len(prefix):]) and n not in theirs]
    pins = [pin_dir(prefix)] if os.path.exists(pin_dir(prefix)) else []
    if os.path.isdir(PIN_ROOT):
        pins += [os.path.join(PIN_ROOT, d) for d in os.listdir(PIN_ROOT)
                 if d.startswith(prefix) and _is_lab_node(d[len(prefix):]) and d not in theirs]
    files = [state_path(prefix)] if os.path.exists(state_path(prefix)) else []
    if os.path.isdir(STATE_DIR):
        files += [os.path.join(STATE_DIR, f) for f in os.listdir(STATE_DIR)
                  if f.startswith(prefix) and f.endswith(".json") and _is_lab_node(f[len(prefix):-5])
                  and f[:-5] not in theirs]
    return {"netns": ns, "pins": sorted(pins), "state_file": sorted(set(files))}
