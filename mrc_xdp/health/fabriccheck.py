"""`mrc-xdp fabric check`: probe every path from this machine's hosts to each peer and
name the suspect links and switches, with a confidence.

Every EV of every connection is a path: the host's plane NIC (the EV's plane), its T0,
the T1 the EV goes through (``mrc_ev.t1``: source-routed in srv6 mode, found by EV
discovery in ecmp mode), the peer's T0 and the peer.  Each EV gets ``count`` probes
through the prober (the datapath's PROBE_REQ on that EV, answered by the peer's XDP).
The answer comes back on the same plane over a T1 this host cannot know (ECMP hashes
the answer, the peer sprays it), so every T1 of the plane is a possible way back.

Localisation is a likelihood comparison of single-fault hypotheses: "element e loses
a fraction q of what crosses it" for every link and switch on a probed path (q fitted
on a grid), against "no fault".  A probe's answer survives with probability
(1 - eps) x survival(forward path) x survival(way back), averaged over the possible
ways back.  The confidence of a suspect is its posterior probability (uniform prior).
Elements that every probed path crosses together (in a plane with two T0s, a T1 and
its two links) cannot be told apart: they share the confidence and are reported as
one group.  Probes from every host on the machine (on the lab: every lab host) are
used together, which separates most of them.

On a lab (instances named <prefix><host> of a running lab) elements are the lab's
link and switch names (``p0t0s0-p0t1s1``, ``p0t1s1``, ``h0-p0t0s0``); elsewhere they
are ``<instance> plane P NIC``, ``plane P T1 t`` and ``<peer> plane P NIC``.
"""
from __future__ import annotations

import ipaddress
import math
import time
from concurrent.futures import ThreadPoolExecutor

from mrc_xdp.datapath import maps

Q_GRID = (0.02, 0.05, 0.1, 0.2, 0.3, 0.5, 0.7, 0.9, 0.99, 1.0)
EPS = 0.002                 # probes lost without a fault (rate limits, queues)
MIN_CONF = 0.05


class FabricCheckError(RuntimeError):
    pass


# ---------------------------------------------------------------- path models

class LabModel:
    """Paths and element names from a running lab's topology."""

    def __init__(self, prefix: str, topo):
        self.prefix, self.topo = prefix, topo
        self.links = {frozenset((lk.a.node, lk.b.node)): lk.name for lk in topo.links}
        self.addr_host = {str(ipaddress.IPv6Address(h.addr)): h.name for h in topo.hosts}

    def host_of(self, instance: str) -> str | None:
        h = instance[len(self.prefix):] if instance.startswith(self.prefix) else None
        return h if h in {x.name for x in self.topo.hosts} else None

    def _elems(self, nodes: list[str]) -> list[str]:
        out = [self.links[frozenset((a, b))] for a, b in zip(nodes, nodes[1:])]
        return out + nodes[1:-1]

    def path(self, instance: str, peer_addr: str, plane: int, t1: int):
        src, dst = self.host_of(instance), self.addr_host.get(str(ipaddress.IPv6Address(peer_addr)))
        if src is None or dst is None:
            return None
        fwd = self._elems(self.topo.path_nodes(src, dst, plane, t1))
        if self.topo.host(src).t0 == self.topo.host(dst).t0:
            backs = [self._elems(self.topo.path_nodes(dst, src, plane, 0))]
        else:
            backs = [self._elems(self.topo.path_nodes(dst, src, plane, t)) for t in range(self.topo.t1_per_plane)]
        return fwd, backs, "%s>%s p%d t1 %d" % (src, dst, plane, t1)

    def kind(self, e: str) -> str:
        return "switch" if e in self.topo.nodes else "link"


class GenericModel:
    """No topology known: the host's plane NIC link, the T1, the peer's plane NIC link."""

    def __init__(self, t1s: dict):
        self.t1s = t1s          # plane -> set of T1 indexes seen

    def path(self, instance: str, peer_addr: str, plane: int, t1: int):
        me, peer = "%s plane %d NIC" % (instance, plane), "%s plane %d NIC" % (peer_addr, plane)
        fwd = [me, "plane %d T1 %d" % (plane, t1), peer]
        backs = [[peer, "plane %d T1 %d" % (plane, t), me] for t in sorted(self.t1s.get(plane, {t1}))]
        return fwd, backs, "%s>%s p%d t1 %d" % (instance, peer_addr, plane, t1)

    def kind(self, e: str) -> str:
        return "switch" if " T1 " in e else "link"


# ---------------------------------------------------------------- probing

def probe_all(instances: list[str], prober, count: int = 8, timeout: float = 0.05, workers: int = 8,
              progress=lambda m: None) -> list[dict]:
    """One observation per (instance, connection, EV): sent, answered, RTTs."""
    jobs = []
    for name in instances:
        with maps.Instance(name) as inst:
            for c in inst.connections():
                for r in inst.ev_table(c["id"]):
                    jobs.append({"instance": name, "conn": c["id"], "conn_name": c["name"], "peer": c["peer"],
                                 "ev": r["ev"], "plane": r["plane"], "t1": r["t1"], "state": r["state"]})
    t0 = time.monotonic()

    def account(j, res):
        j["sent"] = len(res)
        rtts = [x for x in res if x is not None]
        j["answered"] = len(rtts)
        j["rtt_us"] = round(1e6 * sorted(rtts)[len(rtts) // 2], 1) if rtts else None
        return j

    if hasattr(prober, "probe_many"):       # mrc_xdp.health.probe: waves the peers' buckets accept
        try:
            res = prober.probe_many([(j["instance"], j["conn"], j["ev"]) for j in jobs], count, timeout)
            out = [account(j, r) for j, r in zip(jobs, res)]
            progress("probed %d EVs x %d in %.2fs" % (len(out), count, time.monotonic() - t0))
            return out
        except Exception as e:              # fall back to one EV at a time, errors per EV
            progress("batch probing failed (%s): probing EV by EV" % e)

    def one(j):
        try:
            res = prober.probe(j["instance"], j["conn"], j["ev"], count, timeout)
        except Exception as e:       # one EV that cannot be probed is reported, not fatal
            j["error"] = str(e)
            res = [None] * count
        return account(j, res)

    with ThreadPoolExecutor(max_workers=workers) as pool:
        out = list(pool.map(one, jobs))
    progress("probed %d EVs x %d in %.2fs" % (len(out), count, time.monotonic() - t0))
    return out


# ---------------------------------------------------------------- localisation

def _loglik(obs: list[tuple], elem: str | None, q: float) -> float:
    total = 0.0
    for fwd, backs, n, a in obs:
        sf = (1 - q) if elem is not None and elem in fwd else 1.0
        acc = 0.0
        for b in backs:
            p = (1 - EPS) * sf * ((1 - q) if elem is not None and elem in b else 1.0)
            p = min(max(p, 1e-12), 1 - 1e-12)
            acc += math.exp(a * math.log(p) + (n - a) * math.log(1 - p))
        total += math.log(max(acc / len(backs), 1e-300))
    return total


def localise(observations: list[dict], model) -> dict:
    """Suspects with confidence from probe observations (probe_all's output)."""
    obs, paths = [], {}
    for o in observations:
        p = model.path(o["instance"], o["peer"], o["plane"], o["t1"])
        if p is None or not o.get("sent"):
            continue
        fwd, backs, label = p
        obs.append((set(fwd), [set(b) for b in backs], o["sent"], o["answered"]))
        ps = paths.setdefault(label, {"path": label, "elements": fwd, "sent": 0, "answered": 0, "evs": 0})
        ps["sent"] += o["sent"]
        ps["answered"] += o["answered"]
        ps["evs"] += 1
    elems = sorted({e for f, backs, _, _ in obs for e in f | set().union(*backs)})
    null = _loglik(obs, None, 0.0)
    hyp = {}
    for e in elems:
        best = max(((_loglik(obs, e, q), q) for q in Q_GRID), key=lambda x: x[0])
        hyp[e] = best
    top = max([null] + [v[0] for v in hyp.values()])
    w = {e: math.exp(v[0] - top) for e, v in hyp.items()}
    wn = math.exp(null - top)
    z = wn + sum(w.values())
    suspects = []
    for e, v in sorted(hyp.items(), key=lambda kv: -kv[1][0]):
        conf = w[e] / z
        if conf < MIN_CONF:
            continue
        through = [o for o in obs if e in o[0]]
        suspects.append({"element": e, "kind": model.kind(e), "confidence": round(conf, 3),
                         "loss_estimate": v[1], "probes_through": sum(o[2] for o in through),
                         "lost_through": sum(o[2] - o[3] for o in through)})
    # elements with the same likelihood (up to rounding) form one group
    groups = []
    for s in suspects:
        if groups and abs(groups[-1][0]["confidence"] - s["confidence"]) < 0.01:
            groups[-1].append(s)
        else:
            groups.append([s])
    sent = sum(o[2] for o in obs)
    lost = sum(o[2] - o[3] for o in obs)
    return {"probes": sent, "lost": lost, "no_fault_confidence": round(wn / z, 3),
            "suspects": suspects, "groups": [[s["element"] for s in g] for g in groups],
            "paths": sorted(paths.values(), key=lambda p: p["path"])}


def check(instances: list[str] | None = None, prober=None, count: int = 8, timeout: float = 0.05,
          progress=lambda m: None, model_for=None) -> dict:
    """Probe every EV of `instances` (default: every loaded one) and localise the faults.
    model_for(instances): the topology model that names links and switches (the lab's,
    mrc_xdp.lab.ops.lab_model_for), or None: a generic one (planes and T1s only)."""
    if instances is None:
        instances = maps.instances()
    if not instances:
        raise FabricCheckError("nothing loaded (run `mrc-xdp load --config FILE` or `mrc-xdp lab up`)")
    if prober is None:
        from mrc_xdp.health.daemon import load_prober
        prober = load_prober()
        if prober is None:
            raise FabricCheckError("no prober: fabric check needs probes answered in the datapath (mrc_xdp.health.probe)")
    model = model_for(instances) if model_for else None
    obs = probe_all(instances, prober, count, timeout, progress=progress)
    if model is None:
        t1s: dict = {}
        for o in obs:
            t1s.setdefault(o["plane"], set()).add(o["t1"])
        model = GenericModel(t1s)
    res = localise(obs, model)
    res["instances"] = instances
    res["lab"] = getattr(model, "prefix", None)
    res["evs"] = len(obs)
    res["unprobed"] = [o for o in obs if o.get("error")][:10]
    return res


def format_text(r: dict) -> str:
    lines = ["fabric check: %d instance(s)%s, %d EVs, %d probes, %d lost" % (
        len(r["instances"]), " (lab %s)" % r["lab"] if r.get("lab") else "", r["evs"], r["probes"], r["lost"])]
    bad = [p for p in r["paths"] if p["answered"] < p["sent"]]
    if not r["suspects"] or r["no_fault_confidence"] >= 0.5:
        lines.append("no fault found (confidence %.0f%%)" % (100 * r["no_fault_confidence"]))
    for g in r["groups"]:
        ss = [s for s in r["suspects"] if s["element"] in g]
        for s in ss:
            lines.append("  suspect %-6s %-18s confidence %3.0f%%  loss ~%.0f%%  (%d of %d probes through it lost)" % (
                s["kind"], s["element"], 100 * s["confidence"], 100 * s["loss_estimate"],
                s["lost_through"], s["probes_through"]))
        if len(ss) > 1:
            lines.append("    (these %d cannot be told apart: every probed path crossing one crosses the others)" % len(ss))
    if bad:
        lines.append("paths with lost probes:")
        for p in bad[:24]:
            lines.append("  %-28s %4d/%-4d answered  via %s" % (p["path"], p["answered"], p["sent"], " ".join(p["elements"])))
    for o in r.get("unprobed", []):
        lines.append("  could not probe %s conn %d EV %#010x: %s" % (o["instance"], o["conn"], o["ev"], o["error"]))
    return "\n".join(lines)
