"""Lab hosts: each host's datapath config generated from the topology, and loading it.

``host_configs(topo, prefix)`` gives one validated ``HostConfig`` per host:

- instance ``<prefix><host>`` (pins under /sys/fs/bpf/mrc/<prefix><host>/);
- one plane per topology plane: dev ``p<n>``, gateway_mac = the MAC of the T0 port the
  NIC is cabled to; in srv6 mode srv6_src = local_sid = the host's locator on that plane
  (``<block>:<host uSID with plane bits>::``);
- one connection per other host, QPNs derived from the pair: the QP that host a keeps
  for peer b is ``qpn(a, b) = (a+1) << 8 | (b+1)`` (host numbers), so a's local_qpn is
  b's remote_qpn and back; t1s = t1_per_plane (EVs cycle over every T1 of every plane);
- srv6 mode: one row template per destination, named after it: uSIDs
  [T0src, T1, T0dst, host] (plane bits and T1 index zero; t1_pos 1), or [T0, host] for
  a destination on the same T0 (t1_pos -1).

``fabric_hook`` is what ``lab up`` runs after the fabric: it loads every host's datapath
with ``mrc_xdp.datapath.loader`` inside the host's netns, then puts the link model back in front
of the datapath's ingress on each plane NIC: the link model stays attached and
tail-calls the ingress program (mrc_lnext), so the last hop to a host is modelled too.
"""
from __future__ import annotations

import os

from mrc_xdp.datapath.config import HostConfig
from mrc_xdp.lab import linkmodel as lmod
from mrc_xdp.lab.topology import Topology

EV_PER_PLANE = 8          # active EVs per plane per connection (a multiple of t1_per_plane is best)
BACKUP_PER_PLANE = 4


def qpn(a: int, b: int) -> int:
    """The QPN host number a uses for its connection to host number b."""
    return ((a + 1) << 8) | (b + 1)


def instance_name(prefix: str, host: str) -> str:
    return prefix + host


def host_config_dict(topo: Topology, prefix: str, host: str, ev_per_plane: int = EV_PER_PLANE,
                     backup_per_plane: int = BACKUP_PER_PLANE, evs: dict | None = None) -> dict:
    """evs: {(host, peer): (active, backup)} lists of [ev, plane, t1], e.g. from
    discover_ecmp_evs(); connections without an entry get random EVs."""
    me = topo.host(host)
    d: dict = {
        "instance": instance_name(prefix, host),
        "mode": topo.mode,
        "local_addr": me.addr,
        "app_dev": "mrc0",
        "fabric_dev": "mrc0p",
        "udp_port": topo.linkmodel.udp_port,
        "dscp": {"ctrl": topo.linkmodel.dscp_ctrl},
        "planes": [],
        "connections": [],
    }
    for p in range(topo.planes):
        pl = {"dev": "p%d" % p, "gateway_mac": topo.gateway(host, p).mac}
        if topo.mode == "srv6":
            loc = topo.host_locator(host, p)
            pl.update(srv6_src=loc, local_sid=loc)
        d["planes"].append(pl)
    tmpls = {}
    for other in topo.hosts:
        if other.name == host:
            continue
        c = {"name": other.name, "peer": other.addr,
             "local_qpn": qpn(me.index, other.index), "remote_qpn": qpn(other.index, me.index),
             "ev_per_plane": ev_per_plane, "backup_per_plane": backup_per_plane,
             "t1s": topo.t1_per_plane if other.t0 != me.t0 else 1}
        if evs and (host, other.name) in evs:
            c["evs"], c["backup_evs"] = evs[(host, other.name)]
        if topo.mode == "srv6":
            c["template"] = other.name
            tmpls[other.name] = {"block": str(topo.block.network_address),
                                 "usids": topo.srv6_usids(host, other.name),
                                 "t1_pos": topo.t1_pos(host, other.name),
                                 "plane_shift": 12, "t1_shift": 0}
        d["connections"].append(c)
    if tmpls:
        d["srv6_templates"] = tmpls
    return d


# ------------------------------------------------------------------ ECMP: EV discovery

PROBE_TIMEOUT_S = 0.25
MAX_CANDIDATES = 400        # per (host, peer, plane): far more than a fair hash needs


def discover_ecmp_evs(topo: Topology, prefix: str, lm: "lmod.LinkModel", progress=lambda m: None,
                      ev_per_plane: int = EV_PER_PLANE, backup_per_plane: int = BACKUP_PER_PLANE,
                      seed: int = 4791) -> dict:
    """In ecmp mode the T0s hash each EV onto a T1, so which T1 an EV takes is only known
    by trying it (as MRC deployments map EVs to paths).  For every host, every peer on
    another T0 and every plane, send one probe frame per candidate EV out of the host's
    plane NIC (before any datapath is loaded) and see on the link models which T0->T1
    uplink counted it; keep equal numbers of EVs per T1.  Probes go one at a time, so
    the counters attribute each.  Returns {(host, peer): (active, backup)} as lists of
    [ev, plane, t1] for host_config_dict().
    """
    import random
    import socket
    import time
    from mrc_xdp.datapath import netns, wire
    from mrc_xdp.lab.fabric import LabError

    t1s = topo.t1_per_plane
    if ev_per_plane % t1s or backup_per_plane % t1s:
        raise LabError("ev discovery: EVs per plane must divide evenly over %d T1s" % t1s)
    ends = {name: rx.ifindex for name, rx, _, _ in topo.link_ends()}
    rng = random.Random(seed)
    used: set[int] = set()
    out = {}
    probes = 0
    t0 = time.monotonic()
    for h in topo.hosts:
        socks = {}
        for p in range(topo.planes):
            def mk(dev="p%d" % p):
                s = socket.socket(socket.AF_PACKET, socket.SOCK_RAW)
                s.bind((dev, 0))
                return s
            socks[p] = netns.run(prefix + h.name, mk)
        try:
            for d in topo.hosts:
                if d.t0 == h.t0:
                    continue
                active, backup = [], []
                for p in range(topo.planes):
                    uplinks = [ends["%s>%s" % (topo.t0_name(p, h.t0), topo.t1_name(p, j))] for j in range(t1s)]
                    want = {j: [ev_per_plane // t1s, backup_per_plane // t1s] for j in range(t1s)}
                    port = topo.port(h.name, "p%d" % p)
                    gw = topo.gateway(h.name, p).mac
                    for _ in range(MAX_CANDIDATES):
                        if not any(a or b for a, b in want.values()):
                            break
                        ev = rng.getrandbits(32)
                        if ev in used or not ev >> 16:
                            continue
                        before = [lm.counters(i)["mrc_pkts"] for i in uplinks]
                        frame = wire.data_frame(h.addr, d.addr, qpn(d.index, h.index), 0, b"probe",
                                                ev=ev, smac=port.mac, dmac=gw)
                        socks[p].send(frame)
                        probes += 1
                        deadline = time.monotonic() + PROBE_TIMEOUT_S
                        j = None
                        while j is None and time.monotonic() < deadline:
                            now = [lm.counters(i)["mrc_pkts"] for i in uplinks]
                            hit = [k for k in range(t1s) if now[k] != before[k]]
                            if len(hit) == 1:
                                j = hit[0]
                        if j is None:
                            continue                    # lost or ambiguous: not used
                        used.add(ev)
                        if want[j][0]:
                            want[j][0] -= 1
                            active.append([ev, p, j])
                        elif want[j][1]:
                            want[j][1] -= 1
                            backup.append([ev, p, j])
                    if any(a or b for a, b in want.values()):
                        raise LabError("ev discovery: %s->%s plane %d: no EV found for every T1 in %d "
                                       "probes (is the fabric forwarding?)" % (h.name, d.name, p, MAX_CANDIDATES))
                out[(h.name, d.name)] = (active, backup)
        finally:
            for s in socks.values():
                s.close()
    progress("  ecmp: %d EVs mapped to T1s by %d probes (%.2fs)" % (
        sum(len(a) + len(b) for a, b in out.values()), probes, time.monotonic() - t0))
    return out


def host_configs(topo: Topology, prefix: str, **kw) -> dict[str, HostConfig]:
    """One validated HostConfig per lab host, keyed by host name."""
    return {h.name: HostConfig.from_dict(host_config_dict(topo, prefix, h.name, **kw))
            for h in topo.hosts}


def next_slot(topo: Topology, host: str, plane: int) -> int:
    """mrc_lnext slot of a host plane NIC's datapath ingress."""
    return topo.host(host).index * topo.planes + plane


_HERE = object()     # netns_name default: the host's namespace in the netns lab


def chain_ingress(topo: Topology, prefix: str, host: str, lm: "lmod.LinkModel",
                  netns_name=_HERE, ifindex_of=None) -> None:
    """Link model first on the host's plane NICs, then (tail call) the datapath's ingress.
    netns_name: the host's namespace (default: the netns lab's <prefix><host>; None on a
    VM); ifindex_of(ifname): the device's ifindex where it is not the topology's (a VM)."""
    from mrc_xdp.datapath.maps import pin_dir as dp_pin_dir
    from mrc_xdp.datapath import bpfsys
    ns = prefix + host if netns_name is _HERE else netns_name
    fd = bpfsys.obj_get(os.path.join(dp_pin_dir(instance_name(prefix, host)), "prog_ingress"))
    try:
        for p in range(topo.planes):
            port = topo.port(host, "p%d" % p)
            ifindex = ifindex_of(port.ifname) if ifindex_of else port.ifindex
            lm.set_next(ifindex, next_slot(topo, host, p), fd)
            lmod.xdp_attach(ifindex, lm.prog_fd, netns_name=ns)
    finally:
        os.close(fd)


def load_host(topo: Topology, prefix: str, host: str, cfg: HostConfig, lm,
              netns_name=_HERE, ifindex_of=None) -> dict:
    """Load a host's datapath in its namespace (netns lab) or here (netns_name=None: on
    the host's VM), behind the link model (lm None: no link model in front)."""
    from mrc_xdp.datapath import loader
    ns = prefix + host if netns_name is _HERE else netns_name
    st = loader.load(cfg, netns_name=ns, force=True)
    if lm is not None:
        chain_ingress(topo, prefix, host, lm, netns_name=ns, ifindex_of=ifindex_of)
    return {"instance": cfg.instance, "load_s": st.get("load_seconds"),
            "connections": len(cfg.connections), "build": (st.get("frags") or {}).get("build")}


PR_SET_PDEATHSIG = 1


def die_with_parent(parent: int) -> None:
    """In a forked child: SIGKILL when the parent dies (PR_SET_PDEATHSIG), and exit now if
    it already has (the signal is only sent for a death after the prctl)."""
    import ctypes
    import signal
    libc = ctypes.CDLL(None, use_errno=True)
    if libc.prctl(PR_SET_PDEATHSIG, signal.SIGKILL, 0, 0, 0) != 0:
        os._exit(1)
    if os.getppid() != parent:
        os._exit(1)


def _load_some(topo, prefix, names, cfgs, pin_dir, conn, parent=None):
    """Worker process: load some hosts, report through a pipe."""
    if parent is not None:
        die_with_parent(parent)
    out = {}
    try:
        lm = lmod.LinkModel.open(pin_dir)
        for n in names:
            out[n] = load_host(topo, prefix, n, cfgs[n], lm)
        lm.close()
        conn.send(("ok", out))
    except BaseException as e:  # reported by the parent as one line
        conn.send(("error", "%s: %s" % (type(e).__name__, e)))
    finally:
        conn.close()


def fabric_hook(topo: Topology, prefix: str, state: dict, progress, workers: int | None = None) -> dict:
    """Load every host's datapath (in parallel worker processes: each bcc compile is
    ~1.5 s of one CPU).  Returns {host: {instance, load_s, connections}}."""
    import multiprocessing as mp
    from mrc_xdp.lab import fabric
    from mrc_xdp.lab.fabric import LabError
    evs = None
    if topo.mode == "ecmp" and topo.t1_per_plane > 1:
        with lmod.LinkModel.open(state["pin_dir"]) as lm:
            evs = discover_ecmp_evs(topo, prefix, lm, progress)
    cfgs = host_configs(topo, prefix, evs=evs)
    names = [h.name for h in topo.hosts]
    workers = max(1, min(workers or os.cpu_count() or 1, len(names)))
    groups = [names[i::workers] for i in range(workers)]
    # recorded before anything is loaded: `lab down` removes them after any crash
    fabric.record(state, "instances", [cfgs[n].instance for n in names])
    ctx = mp.get_context("fork")
    procs = []
    me = os.getpid()
    for g in groups:
        r, w = ctx.Pipe(duplex=False)
        # the workers die with this process (PR_SET_PDEATHSIG), and `lab down` ends any
        # recorded one still running (by pid and start time)
        p = ctx.Process(target=_load_some, args=(topo, prefix, g, cfgs, state["pin_dir"], w, me),
                        daemon=True)
        p.start()
        w.close()
        procs.append((g, p, r))
        fabric.record(state, "workers", [fabric.worker_record(p.pid)])
    result, errors = {}, []
    for g, p, r in procs:
        try:
            kind, val = r.recv()
        except EOFError:
            kind, val = "error", "worker for %s died" % ",".join(g)
        p.join()
        if kind == "ok":
            result.update(val)
            for n in g:
                progress("  %s: datapath %s loaded (%d connections, %.1fs)"
                         % (n, val[n]["instance"], val[n]["connections"], val[n]["load_s"] or 0))
        else:
            errors.append(val)
    if errors:
        raise LabError("host datapath: %s" % errors[0])
    return result


def unload_all(state: dict) -> None:
    """Detach and unpin every host datapath of a lab (down removes the namespaces anyway)."""
    from mrc_xdp.datapath import loader
    from mrc_xdp.lab.fabric import created
    names = [v["instance"] for v in (state.get("hosts") or {}).values()]
    names += [i for i in created(state, "instances") if i not in names]
    for inst in names:
        try:
            loader.unload(inst, quiet_missing=True)
        except Exception:
            pass
