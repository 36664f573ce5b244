"""`mrc-xdp top`: a live terminal view of one datapath instance, in the style of htop.

Per-connection EV table (state, packet rate, probe RTT, last reason), EVs retired by why
(time-based loss, the PSN-distance fallback, ALWAYS_SKIP, probes, the operator) with each
connection's loss reorder window, plane balance
(share of the packets sprayed per plane over the last refresh; a plane the health
daemon took out of rotation because its NIC is down says DOWN) and the recent EV
events.  Probe RTTs and events come from the health daemon when it runs (events over
its socket); without it top reads the instance's event ring itself.

Keys: ``s`` next sort column, ``c`` next connection filter (all, then each), up/down
or ``j``/``k`` move the cursor, ``d`` deny / ``a`` allow the EV under the cursor
(as `mrc-xdp ev deny|allow`), ``q`` quit.
"""
from __future__ import annotations

import collections
import json
import os
import select
import sys
import termios
import time
import tty

from mrc_xdp.datapath import bpfsys, maps
from mrc_xdp.health import daemon as health
from mrc_xdp.datapath.shared import EvState

SORTS = ["conn", "ev", "plane", "state", "rate", "rtt"]
STATE_STYLE = {"GOOD": "green", "SKIP": "yellow", "ASSUMED_BAD": "bold red", "DENIED": "magenta"}


class Top:
    def __init__(self, instance: str, interval: float = 1.0, events: int = 12):
        self.name = instance
        self.inst = maps.Instance(instance)
        self.interval = interval
        self.sort = 0
        self.conn_filter: int | None = None
        self.cursor = 0
        self.events: collections.deque = collections.deque(maxlen=events)
        self.prev: dict | None = None
        self.prev_t = 0.0
        self.rows: list[dict] = []
        self.planes: list[tuple[int, int]] = []
        self.down: list[bool] = []
        self.retired: str = ""
        self.windows: list[tuple] = []
        self.msg = ""
        self.daemon: dict | None = None
        self.evsock = None
        self.evbuf = b""
        self.rb = None
        self._open_events()

    # -- events
    def _open_events(self) -> None:
        st = health.status()
        if st is not None and self.name in st.get("instances", {}):
            s = health.connect()
            if s is not None:
                s.sendall((json.dumps({"op": "events", "instance": self.name, "history": self.events.maxlen,
                                       "follow": True}) + "\n").encode())
                s.setblocking(False)
                self.evsock = s
                return
        self.rb = bpfsys.RingReader(self.inst.map("mrc_events").fd,
                                    lambda raw: self.events.append(health.event_dict(self.name, raw)))

    def _read_events(self) -> None:
        if self.rb is not None:
            self.rb.poll(0)
            return
        while True:
            try:
                chunk = self.evsock.recv(65536)
            except (BlockingIOError, InterruptedError):
                return
            except OSError:
                chunk = b""
            if not chunk:
                self.evsock.close()
                self.evsock = None
                self.rb = bpfsys.RingReader(self.inst.map("mrc_events").fd,
                                            lambda raw: self.events.append(health.event_dict(self.name, raw)))
                return
            self.evbuf += chunk
            *lines, self.evbuf = self.evbuf.split(b"\n")
            for line in lines:
                try:
                    self.events.append(json.loads(line))
                except ValueError:
                    pass

    # -- data
    def refresh(self) -> None:
        self._read_events()
        now = time.monotonic()
        rows = self.inst.ev_table()
        self.daemon = health.status() if self.evsock is not None or os.path.exists(health.socket_path()) else None
        rtts = ((self.daemon or {}).get("instances", {}).get(self.name) or {}).get("rtt", {})
        cur = {(r["conn"], r["ev"]): r["tx_pkts"] for r in rows}
        dt = now - self.prev_t if self.prev is not None else 0
        plane_pk: dict[int, int] = collections.Counter()
        for r in rows:
            k = (r["conn"], r["ev"])
            d = cur[k] - self.prev.get(k, cur[k]) if self.prev is not None else 0
            r["rate"] = d / dt if dt > 0 else 0.0
            plane_pk[r["plane"]] += max(d, 0)
            p = rtts.get("%d:%d" % k)
            r["rtt"] = p.get("srtt") if p else None
        self.prev, self.prev_t = cur, now
        self.down = self.inst.planes_down()
        self.retired = retire_summary(self.inst.counters())
        self.windows = [(c["name"] or str(c["id"]), c["reo_wnd"], c["min_rtt"]) for c in self.inst.connections()
                        if self.conn_filter in (None, c["id"])]
        for p in range(len(self.down)):
            plane_pk.setdefault(p, 0)
        self.planes = sorted(plane_pk.items())
        if self.conn_filter is not None:
            rows = [r for r in rows if r["conn"] == self.conn_filter]
        key = SORTS[self.sort]
        if key == "rtt":
            rows.sort(key=lambda r: (r["rtt"] is None, r["rtt"] or 0))
        elif key == "rate":
            rows.sort(key=lambda r: -r["rate"])
        else:
            rows.sort(key=lambda r: (r[key], r["conn"], r["slot"]))
        self.rows = rows
        self.cursor = max(0, min(self.cursor, len(rows) - 1))

    # -- keys
    def key(self, k: str) -> bool:
        """Apply one key; False to quit."""
        if k in ("q", "Q", "\x03"):
            return False
        if k == "s":
            self.sort = (self.sort + 1) % len(SORTS)
            self.msg = "sorted by %s" % SORTS[self.sort]
        elif k == "c":
            ids = sorted({c["id"] for c in self.inst.connections()})
            seq = [None] + ids
            i = seq.index(self.conn_filter) if self.conn_filter in seq else 0
            self.conn_filter = seq[(i + 1) % len(seq)]
            self.msg = "connection: %s" % ("all" if self.conn_filter is None else self.conn_filter)
            self.cursor = 0
        elif k in ("j", "\x1b[B"):
            self.cursor += 1
        elif k in ("k", "\x1b[A"):
            self.cursor = max(0, self.cursor - 1)
        elif k in ("d", "a") and self.rows:
            r = self.rows[min(self.cursor, len(self.rows) - 1)]
            st = EvState.DENIED if k == "d" else EvState.GOOD
            try:
                res = self.inst.set_ev_state(r["ev"], st, conn=r["conn"])
                self.msg = "conn %d EV %#010x: %s -> %s" % (r["conn"], r["ev"], res["old"], res["new"])
            except (KeyError, OSError) as e:
                self.msg = "%s: %s" % ("deny" if k == "d" else "allow", e)
        self.refresh()
        return True

    # -- view
    def render(self, height: int = 50):
        from rich.console import Group
        from rich.table import Table
        from rich.text import Text

        d = self.daemon
        head = Text()
        head.append("mrc-xdp top  ", style="bold")
        head.append("instance %s  " % self.name)
        head.append("daemon: %s  " % ("pid %d%s" % (d["pid"], "" if d.get("prober") else " (probing off)")
                                       if d else "not running (events from the ring)"))
        head.append("sort: %s  conn: %s" % (SORTS[self.sort], "all" if self.conn_filter is None else self.conn_filter))
        tot = sum(n for _, n in self.planes) or 0
        bal = Text("planes: ")
        for p, n in self.planes:
            bal.append("p%d %5.1f%%  " % (p, 100.0 * n / tot if tot else 0.0))
            if p < len(self.down) and self.down[p]:
                bal.append("DOWN (out of rotation)  ", style="bold red")
        counts = collections.Counter(r["state"] for r in self.rows)
        bal.append("   EVs: " + "  ".join("%s %d" % (s, counts[s]) for s in ("GOOD", "SKIP", "ASSUMED_BAD", "DENIED")
                                         if counts[s]))
        why = Text("retired by: %s" % (self.retired or "none"))
        if self.windows:
            why.append("   loss window: " + "  ".join("%s %d us (min RTT %s)" % (
                n, w, "%d us" % m if m else "-") for n, w, m in self.windows))
        t = Table(box=None, pad_edge=False, header_style="bold reverse", expand=False)
        for c in ("CONN", "EV", "PLANE", "T1", "ROLE", "STATE", "PKT/S", "RTT(us)", "LOSS", "REASON"):
            t.add_column(c, justify="right" if c in ("PKT/S", "RTT(us)", "LOSS", "PLANE", "T1") else "left")
        nev = len(self.events)
        room = max(3, height - 7 - min(nev, 12))
        first = max(0, self.cursor - room + 1)
        for i, r in enumerate(self.rows[first:first + room], first):
            t.add_row(r["conn_name"] or str(r["conn"]), "%#010x" % r["ev"], str(r["plane"]), str(r["t1"]), r["role"],
                      Text(r["state"], style=STATE_STYLE.get(r["state"], "")), "%.0f" % r["rate"],
                      "-" if r["rtt"] is None else "%.0f" % (r["rtt"] * 1e6), str(r["loss"]), r["reason"],
                      style="reverse" if i == self.cursor else None)
        lines = [Text("recent events:", style="bold")]
        for e in list(self.events)[-12:]:
            lines.append(Text(health.format_event(e), no_wrap=True, overflow="ellipsis"))
        keys = Text(self.msg + "   " if self.msg else "", style="bold", no_wrap=True, overflow="ellipsis")
        keys.append("keys: s sort  c connection  j/k move  d deny  a allow  q quit", style="dim")
        return Group(head, keys, bal, why, t, *lines)

    def close(self) -> None:
        if self.rb is not None:
            self.rb.close()
        if self.evsock is not None:
            self.evsock.close()
        self.inst.close()


# Retirement counters (enum mrc_ctr MRC_C_RETIRE_*) by the words top shows for them.
RETIRE_WHY = [("retire_loss", "loss (time)"), ("retire_loss_psn", "loss (PSN fallback)"),
              ("retire_always", "ALWAYS_SKIP"), ("retire_probe", "probes"), ("retire_operator", "operator")]


def retire_summary(counters: dict) -> str:
    """EVs retired so far by why, e.g. "loss (time) 6  probes 1"; "" when none."""
    return "  ".join("%s %d" % (w, counters[k]) for k, w in RETIRE_WHY if counters.get(k))


def _keys(fd: int, timeout: float) -> list[str]:
    r, _, _ = select.select([fd], [], [], timeout)
    if not r:
        return []
    data = os.read(fd, 64).decode(errors="replace")
    out, i = [], 0
    while i < len(data):
        if data[i] == "\x1b" and data[i + 1:i + 2] == "[" and i + 2 < len(data):
            out.append(data[i:i + 3])
            i += 3
        else:
            out.append(data[i])
            i += 1
    return out


def run(instance: str, interval: float = 1.0, once: bool = False) -> None:
    from rich.console import Console
    from rich.live import Live

    top = Top(instance, interval)
    console = Console()
    try:
        top.refresh()
        if once or not sys.stdin.isatty():
            time.sleep(min(interval, 1.0))
            top.refresh()
            console.print(top.render(console.height))
            return
        fd = sys.stdin.fileno()
        old = termios.tcgetattr(fd)
        tty.setcbreak(fd)
        try:
            with Live(top.render(console.height), console=console, screen=True, auto_refresh=False) as live:
                nxt = time.monotonic() + interval
                while True:
                    keys = _keys(fd, max(0.0, nxt - time.monotonic()))
                    go = True
                    for k in keys:
                        go = top.key(k) and go
                    if not go:
                        break
                    if time.monotonic() >= nxt:
                        top.refresh()
                        nxt = time.monotonic() + interval
                    live.update(top.render(console.height), refresh=True)
        finally:
            termios.tcsetattr(fd, termios.TCSADRAIN, old)
    except KeyboardInterrupt:
        pass
    finally:
        top.close()
