"""Lab operations the CLI, the tests and the VM lab share: link ends by name, `lab status`
as a dict, link-model changes (set, fail, heal) and the parsing of their values.

Link names: ``<lower>-<upper>`` names both directions of a link (``h0-p0t0s0``,
``p0t0s0-p0t1s1``); ``<from>><to>`` one direction, modelled at the receiving end
(``h0>p0t0s0`` is at p0t0s0's port h0).  ``mrc-xdp lab status`` lists them all.
"""
from __future__ import annotations

import os
import re

from mrc_xdp.lab import fabric
from mrc_xdp.lab import linkmodel as lmod
from mrc_xdp.lab import topology as topomod
from mrc_xdp.lab.links import UsageError, _drained, link_row, node_row, resolve_ends  # noqa: F401 - ops' API
from mrc_xdp.lab.topology import parse_rate

ENV_PREFIX = "MRC_LAB_PREFIX"


def default_prefix() -> str:
    return os.environ.get(ENV_PREFIX) or fabric.DEFAULT_PREFIX


def _open(prefix: str):
    st = fabric.load_state(prefix)
    if not st.get("complete"):
        raise fabric.LabNotUp("lab %r is not completely up (an `up` failed or is running): "
                              "run `mrc-xdp lab down --prefix %s` and `up` again" % (prefix, prefix))
    topo = fabric.topology_of(st)
    return st, topo, lmod.LinkModel.open(st["pin_dir"])


def status(prefix: str) -> dict:
    """Nodes, link ends with their settings and counters (summed over CPUs).  A VM lab
    (`lab up --vm`): the same, read in the VMs over SSH (vm.status)."""
    from mrc_xdp.lab import vm
    if vm.is_vm_lab(prefix):
        return vm.status(prefix)
    if not os.path.exists(fabric.state_path(prefix)):
        raise fabric.LabNotUp("lab %r is not up (neither namespaces nor VMs): `mrc-xdp lab up` builds one "
                              "(`lab up --vm` on VMs; --prefix names another lab)" % prefix)
    st, topo, lm = _open(prefix)
    with lm:
        links = []
        for name, rx, lk in resolve_ends(topo, None):
            cfg = lm.get(rx.ifindex) or {}
            links.append(link_row(name, rx, lk, rx.ifindex, cfg, _drained(lm.state(rx.ifindex) or {},
                                                                        cfg.get("rate_bps", 0)),
                                  lm.counters(rx.ifindex)))
    from mrc_xdp.datapath import netns
    nodes = []
    for name, n in topo.nodes.items():
        ns = st["nodes"][name]
        nodes.append(node_row(topo, name, netns=ns, exists=netns.exists(ns)))
    return {"prefix": prefix, "mode": topo.mode, "topology": topo.summary(),
            "up_s": st.get("up_s"), "pin_dir": st["pin_dir"], "hosts": st.get("hosts"),
            "nodes": nodes, "links": links}


def set_link(prefix: str, target: str, node_ok: bool = False, warn=None, **changes) -> list[str]:
    """Apply link-model changes (rate_bps, loss_ppm, blackhole, flap_period_ms, ...).  warn(msg):
    told of the ends a VM lab does not model (vm.set_link)."""
    from mrc_xdp.lab import vm
    if vm.is_vm_lab(prefix):            # the same changes, made in the VMs (over SSH)
        return vm.set_link(prefix, target, node_ok=node_ok, warn=warn, **changes)
    st, topo, lm = _open(prefix)
    with lm:
        sel = resolve_ends(topo, target, node_ok=node_ok)
        for name, rx, lk in sel:
            lm.update(rx.ifindex, **changes)
    return [e[0] for e in sel]


def fail(prefix: str, target: str, warn=None) -> list[str]:
    """A node fails: every link end into and out of it is blackholed; a link: both ways."""
    return set_link(prefix, target, node_ok=True, warn=warn, blackhole=True)


def heal(prefix: str, target: str | None = None, warn=None) -> list[str]:
    """Clear the faults (blackhole, loss, flap) of a node, a link, or (None) everything."""
    return set_link(prefix, target, node_ok=True, warn=warn, blackhole=False, loss_ppm=0, flap_period_ms=0) \
        if target is not None else _heal_all(prefix)


def _heal_all(prefix):
    from mrc_xdp.lab import vm
    if vm.is_vm_lab(prefix):
        return vm.set_link(prefix, None, blackhole=False, loss_ppm=0, flap_period_ms=0)
    st, topo, lm = _open(prefix)
    with lm:
        sel = resolve_ends(topo, None)
        for name, rx, lk in sel:
            lm.update(rx.ifindex, blackhole=False, loss_ppm=0, flap_period_ms=0)
    return [e[0] for e in sel]


# ---------------------------------------------------------------- value parsing
def parse_loss(v: str) -> int:
    """'1%' / '0.01' / '500ppm' -> parts per million."""
    s = v.strip().lower()
    try:
        if s.endswith("ppm"):
            ppm = float(s[:-3])
        elif s.endswith("%"):
            ppm = float(s[:-1]) * 10_000
        else:
            ppm = float(s) * 1_000_000
    except ValueError:
        raise UsageError("loss %r: use a percentage (\"2%%\"), a fraction (\"0.02\") or \"200ppm\"" % v) from None
    if not 0 <= ppm <= 1_000_000:
        raise UsageError("loss %r: must be between 0 and 100%%" % v)
    return int(round(ppm))


def parse_period_ms(v: str) -> int:
    s = v.strip().lower()
    if s in ("off", "0", "none"):
        return 0
    m = re.match(r"^(\d+(?:\.\d+)?)\s*(ms|s)?$", s)
    if not m:
        raise UsageError("flap %r: use a period like \"2s\" or \"500ms\", or \"off\"" % v)
    ms = float(m.group(1)) * (1 if m.group(2) == "ms" else 1000)
    if not 2 <= ms <= 3_600_000:
        raise UsageError("flap %r: the period must be between 2ms and 1h" % v)
    return int(ms)


def _onoff(v: str, key: str) -> bool:
    if v.lower() in ("on", "1", "yes", "true"):
        return True
    if v.lower() in ("off", "0", "no", "false"):
        return False
    raise UsageError("%s %r: use on or off" % (key, v))


def _bytes(v: str, key: str) -> int:
    m = re.match(r"^(\d+)\s*([kmKM]?)[bB]?$", v.strip())
    if not m:
        raise UsageError("%s %r: use bytes, e.g. 30000 or 30k" % (key, v))
    return int(m.group(1)) * {"": 1, "k": 1000, "m": 1000_000}[m.group(2).lower()]


def parse_settings(words: list[str]) -> dict:
    if not words or len(words) % 2:
        raise UsageError("link set: give KEY VALUE pairs: rate R | loss P | blackhole on|off | "
                         "flap PERIOD | ecn on|off | trim on|off | ecn_bytes B | trim_bytes B | drop_bytes B")
    out = {}
    for k, v in zip(words[::2], words[1::2]):
        if k == "rate":
            try:
                out["rate_bps"] = 0 if v in ("unlimited", "0") else parse_rate(v, "rate")
            except topomod.TopologyError as e:
                raise UsageError(str(e)) from None
        elif k == "loss":
            out["loss_ppm"] = parse_loss(v)
        elif k in ("blackhole", "ecn", "trim"):
            out[k] = _onoff(v, k)
        elif k == "flap":
            out["flap_period_ms"] = parse_period_ms(v)
        elif k in ("ecn_bytes", "trim_bytes", "drop_bytes"):
            out[k] = _bytes(v, k)
        else:
            raise UsageError("link set: unknown setting %r (rate, loss, blackhole, flap, ecn, trim, "
                             "ecn_bytes, trim_bytes, drop_bytes)" % k)
    return out


def lab_model_for(instances: list[str]):
    """The fabric check's model (names of links and switches) of the running lab these
    instances belong to, or None."""
    from mrc_xdp.health.fabriccheck import LabModel
    for prefix, st in fabric.lab_states().items():
        if not st.get("complete"):
            continue
        if not any(i.startswith(prefix) for i in instances):
            continue
        try:
            m = LabModel(prefix, fabric.topology_of(st))
        except Exception:           # a lab record this version cannot read: no names
            continue
        if all(m.host_of(i) for i in instances):
            return m
    return None
