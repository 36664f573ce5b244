"""`mrc-xdp load / unload / status / ev / plane / stats / events / version`: the datapath
of one host (mrc_xdp.datapath), its pinned maps read and written live."""
from __future__ import annotations

import json
import os
import sys
import time

from mrc_xdp.cli.common import CliError, _hex, _out, _seconds, _version, add_instance, add_json, table


# ---------------------------------------------------------------- load / unload / status

def cmd_load(args):
    from mrc_xdp.datapath.config import HostConfig
    from mrc_xdp.datapath.maps import pin_dir
    from mrc_xdp.datapath import loader

    if not args.config:
        raise CliError("load needs --config FILE (see `mrc-xdp load --help` for the format)")
    if args.netns is not None:
        from mrc_xdp.datapath import netns
        try:
            netns.check_name(args.netns)
        except netns.NetnsError as e:
            raise CliError("--netns: %s" % e.strerror) from None
    cfg = HostConfig.from_toml(args.config, {"instance": args.instance, "mode": args.mode})
    say = (lambda s: print("load: " + s, file=sys.stderr)) if not args.json else None
    st = loader.load(cfg, netns_name=args.netns, force=args.force, xdp_mode=args.xdp_mode,
                     config_path=os.path.abspath(args.config), progress=say)
    _out(args, st, lambda s: print(
        "loaded %s (%s mode) in %.1f s: spray on %s, ingress on %s, %d connections; pinned at %s" % (
            s["instance"], s["mode"], s["load_seconds"], s["fabric_dev"],
            ",".join(p["dev"] for p in s["planes"]), len(s["connections"]),
            pin_dir(s["instance"]))))


def cmd_unload(args):
    from mrc_xdp.datapath import loader, maps
    names = maps.instances() if args.all else [args.instance]
    if args.all and not names:
        raise CliError("nothing loaded")
    res = [loader.unload(n) for n in names]
    _out(args, res, lambda rs: [print("unloaded %s: detached %s%s, pins removed" % (
        r["instance"], ",".join(r["detached"]) or "nothing",
        "; no longer tail-called from %s" % ",".join(r["unchained"]) if r["unchained"] else ""))
        for r in rs])


def _open(args):
    from mrc_xdp.datapath.maps import Instance
    return Instance(args.instance)


class _Watch:
    """The instance a watcher (stats --watch, events --follow) reads, through the map it
    holds open.  An open map outlives its pin: after an unload the watcher would read
    frozen counters, after a reload the old instance's.  check() compares the held map's
    id with the pinned one; when they differ the watcher stops with one line, or, with
    --wait-reload, waits until the instance is loaded (completely) again and reopens it."""

    POLL = 0.5      # seconds between pin checks while sleeping or waiting

    def __init__(self, args, map_name: str):
        self.args, self.map_name = args, map_name
        self.inst = None
        self._open()

    def _open(self):
        from mrc_xdp.datapath import bpfsys
        self.inst = _open(self.args)
        self.map = self.inst.map(self.map_name)
        self.held = bpfsys.map_info(self.map.fd).id

    def close(self):
        if self.inst is not None:
            self.inst.close()
            self.inst = None

    def check(self) -> bool:
        """True: the held maps are the pinned ones.  False: they were replaced and the new
        instance is open now (only with --wait-reload; without it, CliError)."""
        from mrc_xdp.datapath.maps import NotLoaded, load_complete, pinned_map_id
        name = self.args.instance
        now = pinned_map_id(name, self.map_name)
        if now == self.held:
            return True
        what = "unloaded (its pins are gone)" if now is None else "reloaded (its maps were replaced)"
        if not self.args.wait_reload:
            raise CliError("instance %r was %s: stopped watching (--wait-reload follows reloads)" % (name, what))
        self.close()
        if now is None or not load_complete(name):
            print("mrc-xdp: instance %r was %s: waiting for it to be loaded again" % (name, what),
                  file=sys.stderr, flush=True)
        while True:
            if pinned_map_id(name, self.map_name) is not None and load_complete(name):
                try:
                    self._open()
                    break
                except (NotLoaded, OSError):   # unloaded again in between
                    self.close()
            time.sleep(self.POLL)
        print("mrc-xdp: instance %r is loaded again: watching its new maps" % name, file=sys.stderr, flush=True)
        return False

    def sleep(self, seconds: float) -> bool:
        """Sleep, checking the pins every POLL s; False when the instance was replaced."""
        end = time.monotonic() + seconds
        while True:
            left = end - time.monotonic()
            if left <= 0:
                return self.check()
            time.sleep(min(left, self.POLL))
            if not self.check():
                return False


def cmd_status(args):
    from mrc_xdp.datapath import maps
    names = maps.instances()
    if args.instance is not None:
        if args.instance not in names:
            raise CliError("instance %r is not loaded (%s)" % (
                args.instance, "loaded: " + ", ".join(names) if names else "nothing is loaded"))
        names = [args.instance]
    out = []
    for n in names:
        with maps.Instance(n) as inst:
            rows = inst.ev_table()
            by_state = {}
            for r in rows:
                if r["role"] == "active":
                    by_state[r["state"]] = by_state.get(r["state"], 0) + 1
            st = dict(inst.state)
            st["active_evs_by_state"] = by_state
            st["plane_rotation"] = inst.plane_rows()
            st["planes_down"] = [not r["in_rotation"] for r in st["plane_rotation"]]
            st["counters"] = {k: v for k, v in inst.counters().items() if v}
            st["qps"] = _engine_qps(n)
            out.append(st)

    def text(sts):
        if not sts:
            print("nothing loaded (run `mrc-xdp load --config FILE`)")
            return
        for s in sts:
            print("instance %s: %s mode%s, local %s" % (
                s.get("instance"), s.get("mode"), " in netns %s" % s["netns"] if s.get("netns") else "",
                s.get("local_addr")))
            print("  spray    %s (%s)" % (s.get("fabric_dev"), s.get("xdp_modes", {}).get(s.get("fabric_dev"))))
            print("  engine   %s (%s)" % (s.get("app_dev"), s.get("xdp_modes", {}).get(s.get("app_dev"))))
            if s.get("frags"):
                print("  programs %s: %s" % ("frags-aware" if s["frags"].get("frags") else "single-buffer",
                                             s["frags"].get("why")))
            rot = s.get("plane_rotation", [])
            for i, p in enumerate(s.get("planes", [])):
                print("  plane %d  %s ingress (%s), next hop %s%s" % (
                    i, p["dev"], s.get("xdp_modes", {}).get(p["dev"]), p["gateway_mac"],
                    _out_of_rotation(rot[i]) if i < len(rot) else ""))
            print("  %d connections; active EVs: %s" % (len(s.get("connections", [])), ", ".join(
                "%d %s" % (v, k) for k, v in sorted(s["active_evs_by_state"].items())) or "none"))
            c = s["counters"]
            print("  sprayed %d pkts, ingress %d pkts, to engine %d, dropped malformed %d" % (
                c.get("spray_tx", 0), c.get("ing_rx", 0), c.get("ing_to_engine", 0),
                sum(v for k, v in c.items() if k.startswith("bad_"))))
            for q in s.get("qps", []):
                print("  qp %#x  pid %d %s: %s, sent %d pkts (%d resent), received %d, srtt %.0f us, cwnd %d B%s" % (
                    q["qpn"], q["pid"], q.get("cmd", ""), q.get("state_name", "?"), q["tx_pkts"], q["rtx_pkts"],
                    q["rx_pkts"], q["srtt_ns"] / 1000.0, q["cwnd"],
                    "; engine " + q["engine_path"] if q.get("engine_path") else ""))
    _out(args, out, text)


# ---------------------------------------------------------------- ev

EV_COLS = ["conn", "slot", "role", "ev", "plane", "t1", "state", "reason", "tx_pkts", "sack",
           "ecn", "trim", "nack", "loss", "skipped"]


def _parse_ev(s: str) -> int:
    try:
        v = int(s, 0)
    except ValueError:
        raise CliError("EV %r: expected a number (e.g. 0x3d3ec531)" % s) from None
    if not 0 <= v <= 0xFFFFFFFF:
        raise CliError("EV %r: must fit in 32 bits" % s)
    return v


def _out_of_rotation(row: dict) -> str:
    why = [w for w, on in (("link down", row["link_down"]), ("operator", row["operator_out"])) if on]
    return "  OUT OF ROTATION (%s)" % ", ".join(why) if why else ""


def _rotation(row: dict) -> str:
    return "in rotation" if row["in_rotation"] else _out_of_rotation(row).strip()


def cmd_plane(args):
    with _open(args) as inst:
        if args.plane_cmd != "list":
            try:
                changed = inst.set_plane_out(args.plane, args.plane_cmd == "out")
            except KeyError as e:
                raise CliError(str(e.args[0])) from None
        rows = inst.plane_rows()
    if args.plane_cmd == "list":
        _out(args, rows, lambda rs: [print("plane %d  %-10s %s" % (r["plane"], r["dev"], _rotation(r)))
                                     for r in rs])
        return
    row = dict(rows[args.plane], changed=changed)
    _out(args, row, lambda r: print("plane %d (%s): %s%s" % (
        r["plane"], r["dev"], _rotation(r), "" if r["changed"] else " (unchanged)") + (
        " -- still out: its link is down" if args.plane_cmd == "in" and r["link_down"] else "")))


def cmd_ev(args):
    from mrc_xdp.datapath.shared import EvState
    with _open(args) as inst:
        if args.conn is not None:
            conns = inst.connections()
            if args.conn not in [c["id"] for c in conns]:
                raise CliError("--conn %d: no such connection in %s (connections: %s)" % (
                    args.conn, inst.name, ", ".join("%d %s" % (c["id"], c["name"]) for c in conns) or "none"))
        if args.ev_cmd == "list":
            rows = inst.ev_table(args.conn)
            if args.state:
                want = args.state.upper()
                if want not in EvState.__members__:
                    raise CliError("--state %s: one of %s" % (args.state, ", ".join(EvState.__members__)))
                rows = [r for r in rows if r["state"] == want]
            _out(args, rows, lambda rs: print(table(rs, EV_COLS, fmt={"ev": _hex})))
            return
        ev = _parse_ev(args.ev)
        try:
            res = inst.set_ev_state(ev, EvState.DENIED if args.ev_cmd == "deny" else EvState.GOOD, args.conn)
        except KeyError as e:
            raise CliError(str(e.args[0])) from None
        _out(args, res, lambda r: print("EV %#010x (conn %d, slot %d): %s -> %s" % (
            r["ev"], r["conn"], r["slot"], r["old"], r["new"])))


# ---------------------------------------------------------------- stats

def _snapshot(inst):
    return {"t": time.monotonic(), "counters": inst.counters(), "evs": inst.ev_table()}


def _stats_obj(inst, prev, cur):
    dt = (cur["t"] - prev["t"]) if prev else 0
    ctr = cur["counters"]
    rates = {}
    if prev and dt > 0:
        rates = {k: (v - prev["counters"].get(k, 0)) / dt for k, v in ctr.items()}
    evs = cur["evs"]
    if prev and dt > 0:
        pev = {(r["conn"], r["ev"]): r for r in prev["evs"]}
        for r in evs:
            p = pev.get((r["conn"], r["ev"]))
            r["pps"] = round((r["tx_pkts"] - p["tx_pkts"]) / dt, 1) if p else 0.0
    tot = sum(r["tx_pkts"] for r in evs) or 1
    for r in evs:
        r["share"] = round(100.0 * r["tx_pkts"] / tot, 2)
    planes = {}
    for r in evs:
        planes[r["plane"]] = planes.get(r["plane"], 0) + r["tx_pkts"]
    down = inst.planes_down()
    cfg = inst.config()
    loss = {"window_floor_us": cfg["loss_window_us"], "window_min_rtt_div": cfg["loss_window_div"],
            "conns": [{"conn": c["id"], "name": c["name"], "window_us": c["reo_wnd"], "min_rtt_us": c["min_rtt"],
                       "rtt_spread_us": c["rtt_spread"]} for c in inst.connections()]}
    return {"instance": inst.name, "interval_s": round(dt, 3), "counters": ctr, "loss_rule": loss,
            "rates": {k: round(v, 1) for k, v in rates.items() if v},
            "planes": {str(p): {"tx_pkts": n, "share": round(100.0 * n / tot, 2),
                                "out_of_rotation": p < len(down) and down[p]} for p, n in sorted(planes.items())},
            "evs": evs, "rx_evs": inst.rx_evs(), "qps": _engine_qps(inst.name)}


QP_COLS = ["pid", "cmd", "qpn", "state_name", "tx_pkts", "tx_bytes", "rtx_pkts", "rtx_sack", "rtx_timeout",
           "rtx_nack_trim", "sacks_rx", "sacks_rx_ecn", "nacks_rx_trim", "rx_pkts", "srtt_ns", "cwnd"]


def _engine_qps(instance):
    """Per-QP engine counters of every open transport.Endpoint on the instance."""
    from mrc_xdp.transport import published_qps
    return published_qps(instance)


def _stats_text(s, all_counters=False):
    ctr = s["counters"]
    rates = s["rates"]
    rows = [{"counter": k, "value": v, "rate": ("%.0f/s" % rates[k]) if k in rates else ""}
            for k, v in ctr.items() if v or all_counters]
    print("instance %s%s" % (s["instance"], "   (rates over %.1f s)" % s["interval_s"] if s["interval_s"] else ""))
    print(table(rows, ["counter", "value", "rate"]) if rows else "(all counters zero)")
    lr = s.get("loss_rule")
    if lr and lr["conns"]:
        print("\nloss rule: a SACK hole is lost when sent more than max(%d us, min(min RTT / %d + 4 x RTT spread, mean RTT)) "
              "before the packet SACKed (PSN distance for unstamped packets)" % (
                  lr["window_floor_us"], lr["window_min_rtt_div"]))
        print(table(lr["conns"], ["conn", "name", "window_us", "min_rtt_us", "rtt_spread_us"]))
    if s["planes"]:
        print("\nplanes: " + "   ".join("plane %s %d pkts (%.1f%%)%s" % (
            p, v["tx_pkts"], v["share"], " OUT OF ROTATION (link down)" if v.get("out_of_rotation") else "")
            for p, v in s["planes"].items()))
    if s["evs"]:
        cols = ["conn", "ev", "plane", "t1", "role", "state", "tx_pkts", "share", "sack", "ecn", "trim",
                "loss", "skipped"]
        if s["interval_s"]:
            cols.insert(7, "pps")
        print()
        print(table(s["evs"], cols, fmt={"ev": _hex, "share": lambda v: "%.1f%%" % v}))
    if s["rx_evs"]:
        print("\nreceived (per sender EV):")
        print(table(s["rx_evs"], ["conn", "ev", "pkts", "bytes", "ce"], fmt={"ev": _hex}))
    if s.get("qps"):
        print("\nengine QPs (transport endpoints):")
        print(table(s["qps"], QP_COLS, fmt={"qpn": _hex}))


def cmd_stats(args):
    _seconds("--watch", args.watch, "the refresh interval")
    if args.count is not None and args.count < 1:
        raise CliError("--count %d: must be at least 1" % args.count)
    if not args.watch:
        with _open(args) as inst:
            s = _stats_obj(inst, None, _snapshot(inst))
            _out(args, s, lambda o: _stats_text(o, args.all))
        return
    w = _Watch(args, "mrc_stats")
    try:
        prev = _snapshot(w.inst)
        n = 0
        try:
            while args.count is None or n < args.count:
                if not w.sleep(args.watch):
                    prev = _snapshot(w.inst)
                    continue
                cur = _snapshot(w.inst)
                if not w.check():       # unloaded or replaced while reading: not printed
                    prev = _snapshot(w.inst)
                    continue
                s = _stats_obj(w.inst, prev, cur)
                if args.json:
                    print(json.dumps(s, default=str), flush=True)
                else:
                    if sys.stdout.isatty():
                        print("\033[2J\033[H", end="")
                    _stats_text(s, args.all)
                    print(flush=True)
                prev = cur
                n += 1
        except KeyboardInterrupt:
            pass
    finally:
        w.close()


# ---------------------------------------------------------------- events

def cmd_events(args):
    from mrc_xdp.datapath import bpfsys
    from mrc_xdp.datapath.shared import EvReason, EvState, ffi

    _seconds("--seconds", args.seconds, "the time to follow")
    from mrc_xdp.cli.health import events_from_daemon
    if events_from_daemon(args):     # the daemon owns the ring while it runs
        return
    if not args.follow:
        args.wait_reload = False
    w = _Watch(args, "mrc_events")
    try:
        def show(raw):
            e = ffi.cast("struct mrc_event *", ffi.from_buffer(raw))
            d = {"ts_ns": e.ts_ns, "conn": e.conn, "ev": e.ev, "slot": e.slot, "plane": e.plane,
                 "old": EvState(e.old_state).name, "new": EvState(e.new_state).name,
                 "reason": EvReason(e.reason).name, "other_ev": e.other_ev}
            if args.json:
                print(json.dumps(d), flush=True)
            else:
                extra = " (replaced %#010x)" % e.other_ev if e.reason == EvReason.REPLACED else ""
                print("%.6f conn %d plane %d EV %#010x %s -> %s: %s%s" % (
                    e.ts_ns / 1e9, e.conn, e.plane, e.ev, d["old"], d["new"], d["reason"], extra), flush=True)

        rb = bpfsys.RingReader(w.map.fd, show)
        deadline = time.monotonic() + args.seconds if args.seconds else None
        checked = time.monotonic()
        try:
            while True:
                rb.poll(100)
                if not args.follow and rb.poll(0) == 0:
                    break
                if deadline and time.monotonic() > deadline:
                    break
                if args.follow and time.monotonic() - checked >= w.POLL:
                    if not w.check():
                        rb.close()
                        rb = bpfsys.RingReader(w.map.fd, show)
                    checked = time.monotonic()
        except KeyboardInterrupt:
            pass
        finally:
            rb.close()
    finally:
        w.close()


def cmd_version(args):
    from mrc_xdp.datapath.shared import CONSTS
    v = {"mrc-xdp": _version(), "kernel": os.uname().release,
         "limits": {k: CONSTS[k] for k in ("MRC_MAX_CONNS", "MRC_MAX_PLANES", "MRC_EV_ACTIVE_MAX",
                                           "MRC_BACKUP_PER_PLANE_MAX")}}
    _out(args, v, lambda o: print("mrc-xdp %s (kernel %s)" % (o["mrc-xdp"], o["kernel"])))


def add_parsers(sub) -> None:
    sp = sub.add_parser("load", help="compile, configure and attach the datapath",
                        description="Load the MRC datapath: spray on the fabric side of the mrc0 veth pair, "
                        "ingress on every plane NIC, to_engine on mrc0. The config file (TOML) names the "
                        "devices, the mode and the connections; see the docstring of mrc_xdp/config.py "
                        "or docs/config.md for the format. Maps stay pinned after load exits.")
    sp.add_argument("--config", "-c", help="host config TOML file")
    sp.add_argument("--mode", choices=["ecmp", "srv6"], help="override the config's mode")
    sp.add_argument("--netns", help="load into this named network namespace")
    sp.add_argument("--force", action="store_true", help="replace an instance or XDP program already there")
    sp.add_argument("--xdp-mode", choices=["auto", "native", "generic"], default="auto",
                    help="XDP attach mode (auto: native, else generic)")
    sp.add_argument("--instance", "-i", help="override the config's instance name")
    add_json(sp)
    sp.set_defaults(fn=cmd_load)

    sp = sub.add_parser("unload", help="detach programs and remove pins")
    add_instance(sp)
    sp.add_argument("--all", action="store_true", help="every loaded instance")
    add_json(sp)
    sp.set_defaults(fn=cmd_unload)

    sp = sub.add_parser("status", help="what is loaded where, EV states, key counters")
    sp.add_argument("--instance", "-i", help="only this instance (default: every loaded instance)")
    add_json(sp)
    sp.set_defaults(fn=cmd_status)

    sp = sub.add_parser("ev", help="list EVs; deny or allow one",
                        description="EV = Entropy Value: one path through the fabric. States: GOOD, SKIP "
                        "(sits out one rotation after ECN/trim feedback), ASSUMED_BAD (retired by the "
                        "datapath after loss or ALWAYS_SKIP; replaced by a backup of the same plane), "
                        "DENIED (by the operator; never auto-recovers).")
    esub = sp.add_subparsers(dest="ev_cmd", metavar="ACTION", required=True)
    e = esub.add_parser("list", help="every EV with state and counters")
    add_instance(e)
    add_json(e)
    e.add_argument("--conn", type=int, help="only this connection id")
    e.add_argument("--state", help="only EVs in this state (GOOD, SKIP, ASSUMED_BAD, DENIED)")
    for name, hlp in (("deny", "take an EV out of service (DENIED)"), ("allow", "return an EV to GOOD")):
        e = esub.add_parser(name, help=hlp)
        e.add_argument("ev", help="the EV, e.g. 0x3d3ec531")
        e.add_argument("--conn", type=int, help="connection id, if the EV is in several sets")
        add_instance(e)
        add_json(e)
    sp.set_defaults(fn=cmd_ev)

    sp = sub.add_parser("plane", help="list planes; take one out of rotation or put it back",
                        description="A plane out of rotation sends nothing: spray passes its turns to "
                        "the other planes, which share the traffic equally; its EVs keep their states. "
                        "`out`/`in` are the operator's (e.g. before maintenance on a plane's switches); "
                        "the health daemon takes a plane out on its own while its NIC is down, and "
                        "`in` does not override that.")
    psub = sp.add_subparsers(dest="plane_cmd", metavar="ACTION", required=True)
    e = psub.add_parser("list", help="every plane and whether spray uses it")
    add_instance(e)
    add_json(e)
    for name, hlp in (("out", "take a plane out of rotation (operator)"),
                      ("in", "put a plane the operator took out back into rotation")):
        e = psub.add_parser(name, help=hlp)
        e.add_argument("plane", type=int, help="plane number, e.g. 0")
        add_instance(e)
        add_json(e)
    sp.set_defaults(fn=cmd_plane)

    sp = sub.add_parser("stats", help="counters, plane shares and the per-EV table",
                        description="Counters by name, per-plane and per-EV packet shares. --watch N refreshes "
                        "every N seconds with rates; --json prints one JSON object (per refresh with --watch).")
    add_instance(sp)
    add_json(sp)
    sp.add_argument("--watch", "-w", type=float, nargs="?", const=1.0, metavar="SECONDS",
                    help="refresh every SECONDS (default 1) with live rates")
    sp.add_argument("--count", type=int, help="with --watch: stop after this many refreshes")
    sp.add_argument("--all", action="store_true", help="show zero counters too")
    sp.add_argument("--wait-reload", action="store_true",
                    help="with --watch: when the instance is unloaded or reloaded, wait for it and go on "
                    "(default: say so and exit 1)")
    sp.set_defaults(fn=cmd_stats)

    sp = sub.add_parser("events", help="EV state changes from the datapath's ring buffer")
    add_instance(sp)
    add_json(sp)
    sp.add_argument("--follow", "-f", action="store_true", help="keep waiting for new events")
    sp.add_argument("--seconds", type=float, help="with --follow: stop after this long")
    sp.add_argument("--wait-reload", action="store_true",
                    help="with --follow: when the instance is unloaded or reloaded, wait for it and go on "
                    "(default: say so and exit 1)")
    sp.set_defaults(fn=cmd_events)

    sp = sub.add_parser("version", help="version and datapath limits")
    add_json(sp)
    sp.set_defaults(fn=cmd_version)
