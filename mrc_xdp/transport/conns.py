"""Connections at run time: add one to a loaded datapath's pinned maps, or remove it,
without a reload.

A connection is (peer address, local QPN, remote QPN) and its EV set.  ``add`` finds a
free connection id, writes ``mrc_conns``, the EV slots (``mrc_evs``, ``mrc_evidx``) and
zeroed per-connection state (rotation, PSN ring, per-EV counters), and only then the two
``mrc_connidx`` keys that make the datapath see it, so spray never meets half a
connection.  ``remove`` deletes the ``mrc_connidx`` keys first, then clears every entry
the connection had (its EV slots and index, counters, rotation, PSN ring, received-per-EV
rows) and frees the id.  The instance's state file (/run/mrc-xdp/<instance>.json) lists
connections by id; a freed id is ``null`` there (trailing ones are trimmed).

EV sets are drawn as at load (``config.Connection.ev_sets``).  When the instance already
has a connection to the same peer, the new one takes its shape: SRv6 row template, EVs
per plane, T1 count, and in ecmp mode its very EVs (an ecmp lab learnt them by probing
which T1 each EV hashes to, and that depends on the EV, not on the QPN).

Adds and removes on one instance are serialised by ``flock`` on its pin directory
(/sys/fs/bpf/mrc/<instance>), so concurrent processes cannot take the same id.

A connection added with an ``owner`` pid (transport.QP.connect records its process's)
also records that process's start time and pid namespace; ``reap`` removes the
connections whose owner is gone (a process killed with -9 never removes its own), and
transport.Endpoint calls it whenever an endpoint opens.  A pid reused by another process
has another start time, so its new owner's connections are not mistaken for the old.
"""
from __future__ import annotations

import contextlib
import fcntl
import functools
import ipaddress
import json
import os

from mrc_xdp.datapath import bpfsys
from mrc_xdp.datapath.config import Connection, EvSpec, backup_max
from mrc_xdp.datapath.maps import (ACTIVE_MAX, MAX_CONNS, SLOTS, NotLoaded, conn_key, index_probes,
                                   pin_dir, put_connection, state_path)
from mrc_xdp.datapath.shared import EvState, const, ffi, sizeof

PSN_RING = const("MRC_PSN_RING")
MAPS = ("mrc_conns", "mrc_connidx", "mrc_evs", "mrc_evidx", "mrc_evctr", "mrc_rot",
        "mrc_psn", "mrc_rxev", "mrc_cfg")


class ConnError(RuntimeError):
    """A connection cannot be added or removed; str() is one line saying why."""


@contextlib.contextmanager
def _locked(instance: str):
    """flock on the instance's pin directory: it lives exactly as long as the instance,
    so no lock file is left behind by unload."""
    try:
        fd = os.open(pin_dir(instance), os.O_RDONLY | os.O_DIRECTORY)
    except FileNotFoundError:
        raise NotLoaded("instance %r is not loaded: run `mrc-xdp load` first" % instance) from None
    try:
        fcntl.flock(fd, fcntl.LOCK_EX)
        yield
    finally:
        os.close(fd)      # releases the lock


def _read_state(instance: str) -> dict:
    try:
        with open(state_path(instance)) as f:
            return json.load(f)
    except FileNotFoundError:
        raise NotLoaded("instance %r is not loaded: run `mrc-xdp load` first" % instance) from None


def _write_state(state: dict) -> None:
    path = state_path(state["instance"])
    tmp = path + ".%d.tmp" % os.getpid()
    with open(tmp, "w") as f:
        # one line: json's C encoder (indent takes the pure-Python one: 50 ms a write at
        # 1024 connections, once per add)
        f.write(json.dumps(state, separators=(",", ":")))
    os.replace(tmp, path)


class _Maps:
    def __init__(self, instance: str):
        d = pin_dir(instance)
        if not os.path.exists(os.path.join(d, "mrc_cfg")):
            raise NotLoaded("instance %r is not loaded: run `mrc-xdp load` first" % instance)
        self.m = {}
        try:
            for n in MAPS:
                self.m[n] = bpfsys.Map.open_pinned(os.path.join(d, n))
        except BaseException:
            self.close()
            raise

    def __getitem__(self, n):
        return self.m[n]

    def close(self):
        for mp in self.m.values():
            mp.close()


@functools.lru_cache(maxsize=4096)
def _addr_of(peer: str) -> ipaddress.IPv6Address:
    """A state file's peer string, parsed once (add and find compare it with every
    connection's)."""
    return ipaddress.IPv6Address(peer)


def _struct(ctype: str, raw: bytes):
    """A copy of raw as a new cdata (a cast of from_buffer would not own its bytes)."""
    v = ffi.new(ctype + " *")
    ffi.memmove(v, raw, sizeof(ctype))
    return v


def _conn_at(m: _Maps, cid: int):
    return _struct("struct mrc_conn", m["mrc_conns"].lookup(cid))


def _slots(n: int, b: int, nplanes: int) -> list[int]:
    return [p * n + k for p in range(nplanes) for k in range(n)] + \
           [ACTIVE_MAX + p * b + k for p in range(nplanes) for k in range(b)]


def _ev_specs(m: _Maps, cid: int, nplanes: int) -> tuple[list, list]:
    """The EVs connection cid holds now (whatever slots they moved to), as EvSpecs."""
    c = _conn_at(m, cid)
    n, b = c.ev_per_plane, c.backup_per_plane
    active, backup = [], []
    for slot in _slots(n, b, nplanes):
        e = _struct("struct mrc_ev", m["mrc_evs"].lookup(cid * SLOTS + slot))
        if e.state != EvState.UNUSED:
            (active if slot < ACTIVE_MAX else backup).append(EvSpec(e.ev, e.plane, e.t1))
    return active, backup


def _find(state: dict, peer: str, local_qpn: int) -> int | None:
    for cid, c in enumerate(state.get("connections", [])):
        if c and c["local_qpn"] == local_qpn and _addr_of(c["peer"]) == peer:
            return cid
    return None


def find(instance: str, peer: str, local_qpn: int) -> int | None:
    """Connection id of (peer, local QPN) on the instance, None when there is none."""
    return _find(_read_state(instance), ipaddress.IPv6Address(peer), local_qpn)


def list_(instance: str) -> list[dict]:
    """The instance's connections: [{id, name, peer, local_qpn, remote_qpn, runtime}]."""
    return [dict(c, id=i) for i, c in enumerate(_read_state(instance).get("connections", [])) if c]


def add(instance: str, peer: str, local_qpn: int, remote_qpn: int, name: str = "",
        ev_per_plane: int | None = None, backup_per_plane: int | None = None,
        t1s: int | None = None, template: int | None = None, evs: list | None = None,
        backup_evs: list | None = None, owner: int | None = None) -> dict:
    """Add connection (peer, local_qpn -> remote_qpn) to the running instance.

    Unset shape parameters come from an existing connection to the same peer (see the
    module docstring), else from the load defaults (8 active + 4 backup EVs per plane,
    one T1).  In srv6 mode the row template index is required when the instance has no
    connection to the peer.  owner: a pid recorded in the state file with its start time
    (``reap``, ``remove_owned``).
    Returns {id, name, peer, local_qpn, remote_qpn, evs}.  ConnError when the
    connection exists (by either key), no id is free, or the shape is invalid.
    """
    try:
        peer = str(ipaddress.IPv6Address(peer))
    except ValueError:
        raise ConnError("peer: %r is not an IPv6 address" % (peer,)) from None
    for q, what in ((local_qpn, "local_qpn"), (remote_qpn, "remote_qpn")):
        if not 3 <= int(q) <= 0xFFFFFF:
            raise ConnError("%s: %#x is out of range (3..0xffffff)" % (what, q))
    with _locked(instance):
        state = _read_state(instance)
        m = _Maps(instance)
        try:
            return _add(m, state, peer, local_qpn, remote_qpn, name, ev_per_plane,
                        backup_per_plane, t1s, template, evs, backup_evs, owner)
        finally:
            m.close()


def proc_start(pid: int) -> int | None:
    """A live, non-zombie process's start time (clock ticks since boot); None if gone."""
    try:
        with open("/proc/%d/stat" % pid) as f:
            rest = f.read().rpartition(")")[2].split()
    except (FileNotFoundError, ProcessLookupError):
        return None
    return None if rest[0] in ("Z", "X") else int(rest[19])


def _pidns() -> int:
    return os.stat("/proc/self/ns/pid").st_ino


def owner_alive(meta: dict) -> bool:
    """Whether the process that owns a connection (its state-file entry) still runs.
    No owner, or one recorded in another pid namespace (its pid means nothing here):
    True.  An entry without a start time (written before they were recorded) is judged
    by its pid alone."""
    pid = meta.get("owner")
    if pid is None or meta.get("owner_pidns", _pidns()) != _pidns():
        return True
    start = proc_start(int(pid))
    return start is not None and meta.get("owner_start", start) == start


def _add(m, state, peer, local_qpn, remote_qpn, name, ev_per_plane, backup_per_plane, t1s,
         template, evs, backup_evs, owner) -> dict:
    conns = state.setdefault("connections", [])
    nplanes = len(state.get("planes", [])) or 1
    srv6 = state.get("mode") == "srv6"
    paddr = ipaddress.IPv6Address(peer)
    for cid, c in enumerate(conns):
        if c and _addr_of(c["peer"]) == paddr and (
                c["local_qpn"] == local_qpn or c["remote_qpn"] == remote_qpn):
            raise ConnError("connection to %s with local QPN %#x or remote QPN %#x exists (id %d, %s)"
                            % (peer, local_qpn, remote_qpn, cid, c.get("name") or "unnamed"))
    for d, q in ((0, remote_qpn), (1, local_qpn)):
        if m["mrc_connidx"].lookup(conn_key(peer, q, d)) is not None:
            raise ConnError("connection to %s QPN %#x is in the datapath's index but not in the "
                            "state file: unload and load the instance again" % (peer, q))
    cid = next((i for i, c in enumerate(conns) if c is None), len(conns))
    if cid >= MAX_CONNS:
        raise ConnError("no free connection id: the instance has %d connections (MRC_MAX_CONNS)" % MAX_CONNS)

    ref = next((i for i, c in enumerate(conns) if c and _addr_of(c["peer"]) == paddr), None)
    ref_evs = None
    if ref is not None:
        rc = _conn_at(m, ref)
        ev_per_plane = ev_per_plane or rc.ev_per_plane
        backup_per_plane = rc.backup_per_plane if backup_per_plane is None else backup_per_plane
        template = rc.tmpl if template is None else template
        if t1s is None:
            t1s = max(1, len({e.t1 for s in _ev_specs(m, ref, nplanes) for e in s}))
        if state.get("mode") != "srv6" and evs is None and \
                ev_per_plane == rc.ev_per_plane and backup_per_plane == rc.backup_per_plane:
            ref_evs = _ev_specs(m, ref, nplanes)
    elif srv6 and template is None:
        raise ConnError("srv6 mode: no connection to %s to take a row template from; pass "
                        "template=<index of its srv6_templates entry>" % peer)
    ev_per_plane = ev_per_plane or 8
    backup_per_plane = 4 if backup_per_plane is None else backup_per_plane
    if not 1 <= ev_per_plane <= ACTIVE_MAX // nplanes:
        raise ConnError("ev_per_plane: %d is out of range (1..%d)" % (ev_per_plane, ACTIVE_MAX // nplanes))
    if not 0 <= backup_per_plane <= backup_max(nplanes):
        raise ConnError("backup_per_plane: %d is out of range (0..%d)"
                        % (backup_per_plane, backup_max(nplanes)))

    conn = Connection(peer=peer, local_qpn=local_qpn, remote_qpn=remote_qpn,
                      ev_per_plane=ev_per_plane, backup_per_plane=backup_per_plane,
                      t1s=t1s or 1, name=name)
    if evs is not None:
        conn.evs = [e if isinstance(e, EvSpec) else EvSpec(*e) for e in evs]
        conn.backup_evs = [e if isinstance(e, EvSpec) else EvSpec(*e) for e in backup_evs or []]
    elif ref_evs is not None:
        conn.evs, conn.backup_evs = ref_evs
    active, backup = conn.ev_sets(nplanes)
    for p in range(nplanes):
        if len(active[p]) != ev_per_plane or len(backup[p]) != backup_per_plane:
            raise ConnError("EV set: plane %d has %d active / %d backup EVs, want %d / %d"
                            % (p, len(active[p]), len(backup[p]), ev_per_plane, backup_per_plane))

    if m["mrc_conns"].lookup(cid) != bytes(m["mrc_conns"].value_size):
        _clear_slots(m, cid)        # a process died in the middle of a remove: finish it
    # the connection's row and EV slots, its mrc_connidx keys last (as at load)
    put_connection(m, cid, conn, template or 0, (active, backup))
    meta = {"name": name or "%s/%d" % (peer, remote_qpn), "peer": peer, "local_qpn": local_qpn,
            "remote_qpn": remote_qpn, "runtime": True}
    if owner is not None:
        meta.update(owner=owner, owner_start=proc_start(owner), owner_pidns=_pidns())
    while len(conns) <= cid:
        conns.append(None)
    conns[cid] = meta
    _write_state(state)
    return dict(meta, id=cid, evs=[e.ev for s in active for e in s])


def _zero(mp: bpfsys.Map, key: int) -> None:
    mp.update(key, bytes(mp.value_size))


def _clear_slots(m: _Maps, cid: int, slots=None, sweep: bool = True) -> None:
    """Zero connection id cid's array entries (its EV slots and their counters: all
    MRC_EV_SLOTS of them, or only `slots`; the PSN ring; the rotation) and delete its hash
    entries, except the mrc_connidx keys (the caller removes those first): the mrc_evidx
    keys of the EVs in its slots, then (sweep) every mrc_evidx and mrc_rxev key naming cid
    (_sweep; remove_many sweeps once for all its ids).  Writes zeros without looking
    first: a lookup costs as much as the write."""
    evs, ctr, evidx = m["mrc_evs"], m["mrc_evctr"], m["mrc_evidx"]
    zero_ev, zero_ctr = bytes(evs.value_size), [bytes(ctr.value_size)] * bpfsys.NCPUS
    k = ffi.new("struct mrc_evidx_key *")
    k.conn = cid
    for slot in (range(SLOTS) if slots is None else slots):
        raw = evs.lookup(cid * SLOTS + slot)
        if raw is not None and raw != zero_ev:
            k.ev = _struct("struct mrc_ev", raw).ev
            evidx.delete(bytes(ffi.buffer(k)))
        evs.update(cid * SLOTS + slot, zero_ev)
        ctr.update(cid * SLOTS + slot, zero_ctr)
    m["mrc_psn"].zero_range(cid * PSN_RING, PSN_RING)
    _zero(m["mrc_rot"], cid)
    if sweep:
        _sweep(m, {cid}, ("mrc_evidx", "mrc_rxev"))


def _sweep(m: _Maps, cids: set, names=("mrc_evidx", "mrc_rxev", "mrc_connidx")) -> None:
    """Delete every key of the named hash maps that names one of cids (mrc_evidx,
    mrc_rxev: the key's connection; mrc_connidx: the value), e.g. written by hand, or the
    received-per-EV rows, whose sender EVs nobody knows.  One batch read per map."""
    for n in names:
        hmap = m[n]
        for kb in hmap.keys_batch():
            if n == "mrc_connidx":
                v = hmap.lookup(kb)
                hit = v is not None and int.from_bytes(v, "little") in cids
            else:
                hit = int.from_bytes(kb[:4], "little") in cids
            if hit:
                hmap.delete(kb)


def remove(instance: str, peer: str, local_qpn: int) -> dict:
    """Remove connection (peer, local_qpn) from the running instance: its index keys
    first (the datapath stops seeing it), then every entry it had.  Returns its
    metadata with its id; ConnError when there is no such connection."""
    paddr = ipaddress.IPv6Address(peer)
    with _locked(instance):
        state = _read_state(instance)
        cid = _find(state, paddr, local_qpn)
        if cid is None:
            raise ConnError("no connection to %s with local QPN %#x on instance %s"
                            % (peer, local_qpn, instance))
        m = _Maps(instance)
        try:
            return _remove(m, state, cid)
        finally:
            m.close()


def _remove(m: _Maps, state: dict, cid: int, batch: bool = False) -> dict:
    """Remove connection cid.  batch (remove_many): leave the sweeps, the probe keys'
    heir and the state file to the caller, who does them once for all."""
    conns = state["connections"]
    meta = conns[cid]
    c = _conn_at(m, cid)
    peer = str(ipaddress.IPv6Address(bytes(c.peer)))
    for d, q in ((0, c.remote_qpn), (1, c.local_qpn)):
        m["mrc_connidx"].delete(conn_key(peer, q, d))
    if not batch:       # any key still naming this id (e.g. written by hand) goes too
        _sweep(m, {cid}, ("mrc_connidx",))
    nplanes = len(state.get("planes", [])) or 1
    slots = _slots(c.ev_per_plane, c.backup_per_plane, nplanes)
    _zero(m["mrc_conns"], cid)       # the per-CPU connection cache no longer matches
    _clear_slots(m, cid, slots, sweep=not batch)
    conns[cid] = None
    if not batch:
        _heirs(m, conns, {peer})
        _write_state(state)
    return dict(meta, id=cid, peer=meta.get("peer", peer))


def _heirs(m: _Maps, conns: list, peers: set) -> None:
    """Connectionless probes of a peer stay answered while another connection to it
    lives: its probe keys go to the first one left.  Trims trailing free ids."""
    for peer in peers:
        paddr = ipaddress.IPv6Address(peer)
        heir = next((i for i, o in enumerate(conns) if o and _addr_of(o["peer"]) == paddr), None)
        if heir is not None:
            index_probes(m, peer, heir, replace=True)
    while conns and conns[-1] is None:
        conns.pop()


def _remove_batch(instance: str, state: dict, cids: list) -> list[dict]:
    """Remove connection ids cids in the order given (caller holds the lock and has read
    state): one sweep of the hash maps, one pass over the probe keys' heirs and one
    state-file write for all of them.  Returns the metadata of those removed."""
    if not cids:
        return []
    m = _Maps(instance)
    try:
        out = [_remove(m, state, cid, batch=True) for cid in cids]
        _sweep(m, set(cids))
        _heirs(m, state["connections"], {str(ipaddress.IPv6Address(o["peer"])) for o in out})
        _write_state(state)
        return out
    finally:
        m.close()


def remove_many(instance: str, items) -> list[dict]:
    """Remove the connections (peer, local_qpn) of items that exist, under one lock, with
    one state-file write and one sweep of the hash maps for all of them (an endpoint
    closing 1024 QPs: remove() each would read every hash map 1024 times).  Returns the
    metadata of those removed."""
    with _locked(instance):
        state = _read_state(instance)
        cids = []
        for peer, qpn in items:
            cid = _find(state, ipaddress.IPv6Address(peer), qpn)
            if cid is not None and cid not in cids:
                cids.append(cid)
        return _remove_batch(instance, state, cids)


def remove_owned(instance: str, owner: int) -> list[dict]:
    """Remove every run-time connection recorded with this owner pid (cleanup after a
    process that died without removing what it added)."""
    out = []
    for c in list_(instance):
        if c.get("owner") == owner:
            with contextlib.suppress(ConnError):
                out.append(remove(instance, c["peer"], c["local_qpn"]))
    return out


def reap(instance: str) -> list[dict]:
    """Remove every run-time connection whose owner process is gone (``owner_alive``):
    the ones of endpoints that died without closing.  Returns what was removed."""
    with _locked(instance):
        state = _read_state(instance)
        dead = [cid for cid, c in enumerate(state.get("connections", []))
                if c and c.get("runtime") and not owner_alive(c)]
        return _remove_batch(instance, state, dead)     # ascending: later ids stay put


def reap_each(instances, log) -> None:
    """reap() on each instance (the health daemon's rescan), each removal logged (one
    line); an instance that cannot be read now is left for the next round."""
    for n in list(instances):
        try:
            for c in reap(n):
                log("%s: removed connection %d (%s, QPN %#x): its process %s is gone"
                    % (n, c["id"], c["peer"], c["local_qpn"], c.get("owner")))
        except (NotLoaded, OSError, ValueError) as e:       # (BpfError is an OSError)
            log("%s: reaping connections: %s" % (n, e))


def leftovers(instance: str, cid: int) -> list[str]:
    """Every map entry connection id cid still has (empty after remove): for tests and
    `doctor`-style checks."""
    m = _Maps(instance)
    try:
        out = []
        for kb, v in m["mrc_connidx"].items():
            if int.from_bytes(v, "little") == cid:
                out.append("mrc_connidx")
        if m["mrc_conns"].lookup(cid) != bytes(m["mrc_conns"].value_size):
            out.append("mrc_conns[%d]" % cid)
        zero_ev, zero_ctr = bytes(m["mrc_evs"].value_size), bytes(m["mrc_evctr"].value_size)
        for slot in range(SLOTS):
            if m["mrc_evs"].lookup(cid * SLOTS + slot) != zero_ev:
                out.append("mrc_evs[%d]" % slot)
            if any(v != zero_ctr for v in m["mrc_evctr"].lookup(cid * SLOTS + slot)):
                out.append("mrc_evctr[%d]" % slot)
        zero_psn = bytes(m["mrc_psn"].value_size)
        out += ["mrc_psn[%d]" % i for i in range(PSN_RING)
                if m["mrc_psn"].lookup(cid * PSN_RING + i) != zero_psn]
        if any(v != bytes(m["mrc_rot"].value_size) for v in m["mrc_rot"].lookup(cid)):
            out.append("mrc_rot")
        for n in ("mrc_evidx", "mrc_rxev"):
            out += [n for kb in m[n].keys()
                    if int.from_bytes(kb[:4], "little") == cid]
        return out
    finally:
        m.close()
