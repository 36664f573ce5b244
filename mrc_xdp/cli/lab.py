"""`mrc-xdp lab ...`: a thin layer over mrc_xdp.lab (fabric, linkmodel, topology).

The main CLI calls ``add_parser(subparsers)``; each subcommand sets ``func`` to a
handler taking the parsed args and returning an exit code.  Errors are one line on
stderr (no traceback), e.g. ``mrc-xdp lab: no node or link 'h9' (nodes: h0, h1, ...)``.

Link names: ``<lower>-<upper>`` names both directions of a link (``h0-p0t0s0``,
``p0t0s0-p0t1s1``); ``<from>><to>`` one direction, modelled at the receiving end
(``h0>p0t0s0`` is at p0t0s0's port h0).  ``lab status`` lists them all.
"""
from __future__ import annotations

import argparse
import json
import os
import sys

from mrc_xdp.lab import fabric
from mrc_xdp.lab import linkmodel as lmod
from mrc_xdp.lab import topology as topomod
from mrc_xdp.lab.executor import ExecError
from mrc_xdp.lab import ops
from mrc_xdp.lab.ops import UsageError, default_prefix, fail, heal, parse_settings, set_link, status
from mrc_xdp.lab.topology import format_rate

# ---------------------------------------------------------------- output
def _faults(l: dict) -> str:
    f = []
    if l["blackhole"]:
        f.append("BLACKHOLE")
    if l["loss_ppm"]:
        f.append("loss %g%%" % (l["loss_ppm"] / 10_000))
    if l["flap_period_ms"]:
        f.append("flap %gs" % (l["flap_period_ms"] / 1000))
    return ",".join(f) or "-"


def _where(n: dict) -> tuple[str, str]:
    """Where a node runs and, if it is not running, why: netns NAME or vm NAME [STATE]."""
    if "vm" in n:
        bad = "" if n["exists"] else "  [%s]" % (n.get("state") or "missing").upper()
        return "vm %-14s" % n["vm"], bad
    return "netns %-14s" % n["netns"], "" if n["exists"] else "  [MISSING]"


def format_status(s: dict) -> str:
    on = "  on VMs (%s, %s)" % (s["target"], s.get("accel")) if s.get("target") else ""
    out = ["lab %r: %s%s%s" % (s["prefix"], s["topology"],
                               "  (up in %.1fs)" % s["up_s"] if s.get("up_s") else "", on)]
    hosts = [n for n in s["nodes"] if n["kind"] == "host"]
    sw = [n for n in s["nodes"] if n["kind"] != "host"]
    out.append("hosts:")
    for n in hosts:
        loc = ("  locators " + " ".join(n["locators"])) if n["locators"] else ""
        dp = (s.get("hosts") or {}).get(n["name"])
        dps = ("  datapath %s" % dp["instance"]) if dp else "  (no datapath)"
        where, bad = _where(n)
        out.append("  %-8s %s MRC %s  T0 %d%s%s%s" % (n["name"], where, n["addr"], n["t0"], dps, loc, bad))
    out.append("switches: " + " ".join(n["name"] + _where(n)[1].replace("  ", "") for n in sw))
    out.append("links (FROM>TO, modelled at TO's port; `lab link set h0-p0t0s0 ...` sets both "
               "directions, `h0>p0t0s0` one):")
    hdr = "  %-18s %-9s %-4s %-14s %10s %10s %8s %8s %8s %8s" % (
        "link", "rate", "ecn", "faults", "pkts", "mrc", "marked", "trimmed", "dropped", "backlog")
    out.append(hdr)
    for l in s["links"]:
        c = l["counters"]
        if not l.get("modelled", True) or c is None:
            out.append("  %-18s (%s)" % (l["name"], l.get("why") or "not modelled"))
            continue
        drops = sum(v for k, v in c.items() if k.startswith("drop_"))
        out.append("  %-18s %-9s %-4s %-14s %10d %10d %8d %8d %8d %8d" % (
            l["name"], format_rate(l["rate_bps"]), "on" if l["ecn"] else "off", _faults(l),
            c["pkts"], c["mrc_pkts"], c["marked"], c["trimmed"], drops, l["backlog"]))
    return "\n".join(out)


# ---------------------------------------------------------------- handlers
def _progress(msg: str) -> None:
    print(msg, flush=True)


def _warn(msg: str) -> None:
    print("mrc-xdp lab: %s" % msg, file=sys.stderr, flush=True)


def _target(args) -> str:
    return "qemu" if args.vm and args.target == "netns" else args.target


def cmd_up(args) -> int:
    fabric.require_root()
    topo = topomod.load(args.topology, mode=args.mode)
    target = _target(args)
    if target != "netns":
        from mrc_xdp.lab import vm
        kw = {"linkmodel": not args.no_linkmodel}
        up = vm.qemu_up if target == "qemu" else vm.vagrant_up
        try:
            up(topo, prefix=args.prefix, progress=_progress, hosts=not args.no_hosts, **kw)
        except fabric.LabAlreadyUp:
            print("VM lab %r is already up: `mrc-xdp lab vm status --prefix %s` shows it"
                  % (args.prefix, args.prefix))
        return 0
    try:
        hook = None if args.no_hosts else _hosts_hook()
        st = fabric.up(topo, prefix=args.prefix, progress=_progress, hosts_hook=hook)
    except fabric.LabAlreadyUp as e:
        st = e.state
        print("lab %r is already up (%s mode, %d nodes, since %s): `mrc-xdp lab status` shows it"
              % (st["prefix"], st["mode"], len(st["nodes"]), _when(st.get("started"))))
        return 0
    _control_path(args.prefix, topo)
    return 0


def _control_path(prefix: str, topo) -> None:
    """Give the hosts their control addresses (the TCP bootstrap of write-bw, send, ...,
    and of MPTCP) as a VM lab's set-up does, and say what they are: a user's first
    `write-bw PEER` needs one."""
    from mrc_xdp.lab import ctlpath
    addrs = ctlpath.lab_control_path(prefix, topo)
    print("control addresses (PEER of write-bw, write-lat, send): %s"
          % ", ".join("%s %s" % (h, a[0]) for h, a in sorted(addrs.items())))


def _when(ts) -> str:
    import time
    return time.strftime("%H:%M:%S", time.localtime(ts)) if ts else "?"


def _hosts_hook():
    try:
        from mrc_xdp.lab import hosts
    except ImportError:
        return None
    return getattr(hosts, "fabric_hook", None)


def _unload_hook():
    try:
        from mrc_xdp.lab import hosts
    except ImportError:
        return None
    return getattr(hosts, "unload_all", None)


def cmd_down(args) -> int:
    from mrc_xdp.lab import vm
    if vm.is_vm_lab(args.prefix):
        vm.down(args.prefix, progress=_progress)
        if not os.path.exists(fabric.state_path(args.prefix)):
            return 0
    res = fabric.down(args.prefix, progress=_progress, unload_hosts=_unload_hook())
    if not (res["netns"] or res["pins"] or res["state_file"]):
        print("lab %r was not up: nothing to remove" % args.prefix)
    return 0


def cmd_status(args) -> int:
    s = status(args.prefix)
    if args.json:
        print(json.dumps(s, indent=1))
    else:
        print(format_status(s))
    return 0


def exec_command(args) -> list[str]:
    """The command of `exec NODE [--prefix P] -- CMD ...`.  argparse hands everything after
    NODE over verbatim (so the command keeps its own options and `--`); exec's options
    between NODE and the first `--` are parsed here (they update args)."""
    rest = list(args.cmd)
    if not rest or not rest[0].startswith("-"):
        return rest                               # exec NODE CMD ...
    if rest[0] == "--":
        return rest[1:]
    if "--" not in rest:
        raise UsageError("exec: end exec's options with `--` before the command: "
                         "exec NODE [--prefix P] -- CMD")
    i = rest.index("--")
    ap = argparse.ArgumentParser(prog="mrc-xdp lab exec", add_help=False, exit_on_error=False)
    _prefix_option(ap, default=args.prefix)
    try:
        opts, unknown = ap.parse_known_args(rest[:i])
    except argparse.ArgumentError as e:
        raise UsageError("exec: %s" % e) from None
    if unknown:
        raise UsageError("exec: unknown option %s (exec takes --prefix P before `--`)" % unknown[0])
    args.prefix = opts.prefix
    return rest[i + 1:]


def cmd_exec(args) -> int:
    cmd = exec_command(args)
    st = fabric.load_state(args.prefix)
    if args.node not in st["nodes"]:
        raise UsageError("no node %r (nodes: %s)" % (args.node, ", ".join(st["nodes"])))
    if not cmd:
        cmd = [os.environ.get("SHELL", "/bin/sh")]
    from mrc_xdp.datapath import netns
    ns = st["nodes"][args.node]
    if not netns.exists(ns):
        raise fabric.LabNotUp("netns %s is gone: run `mrc-xdp lab down` and `up` again" % ns)
    fd = netns.open_fd(ns)
    try:
        # setns the whole (single-threaded) process, then exec: /sys stays as it is,
        # so pinned BPF maps remain visible to the command
        import ctypes
        libc = ctypes.CDLL(None, use_errno=True)
        if libc.setns(fd, netns.CLONE_NEWNET) != 0:
            raise fabric.LabError("setns %s: %s" % (ns, os.strerror(ctypes.get_errno())))
    finally:
        os.close(fd)
    sys.stdout.flush()
    sys.stderr.flush()
    try:
        os.execvp(cmd[0], cmd)
    except OSError as e:
        raise fabric.LabError("%s: %s" % (cmd[0], e.strerror)) from None


def cmd_launch(args) -> int:
    from mrc_xdp.lab import launch
    cmd = exec_command(args)
    hosts = [h for h in args.hosts.split(",") if h] if args.hosts else None
    return launch.launch(args.prefix, cmd, hosts=hosts, timeout=args.timeout, port=args.port)


def cmd_link_set(args) -> int:
    changes = parse_settings(args.settings)
    names = set_link(args.prefix, args.link, warn=_warn, **changes)
    print("%s: %s" % (", ".join(names), " ".join("%s=%s" % kv for kv in changes.items())))
    return 0


def cmd_fail(args) -> int:
    names = fail(args.prefix, args.target, warn=_warn)
    print("failed %s: blackholed %s" % (args.target, ", ".join(names)))
    return 0


def cmd_heal(args) -> int:
    names = heal(args.prefix, args.target, warn=_warn)
    print("healed %s (%d link ends)" % (args.target or "everything", len(names)))
    return 0


def cmd_render(args) -> int:
    from mrc_xdp.lab import vm
    topo = topomod.load(args.topology, mode=args.mode)
    r = vm.render(topo, args.prefix)
    text = json.dumps(r, indent=1) + "\n"
    if args.output:
        d = os.path.dirname(os.path.abspath(args.output))
        os.makedirs(d, exist_ok=True)
        with open(args.output, "w") as f:
            f.write(text)
        print("%s: %d VMs, %d links (%s); `vagrant up` in %s reads it%s"
              % (args.output, len(r["nodes"]), len(r["links"]), topo.summary().split(":")[0],
                 d, "" if os.path.basename(args.output) == "topology.json" and
                 os.path.samefile(d, vm.VAGRANT_DIR) else " with MRC_LAB_JSON=" + args.output))
    else:
        sys.stdout.write(text)
    return 0


def cmd_vm_build_box(args) -> int:
    from mrc_xdp.lab import vm
    import shutil
    if args.no_vagrant or not shutil.which("vagrant"):
        vm.build_image(_progress, force=args.force)
        if not args.no_vagrant:
            print("vagrant is not installed: image built, no box added (`make vm-setup` installs vagrant)")
    else:
        vm.build_box(_progress, force=args.force)
    return 0


def cmd_vm_status(args) -> int:
    from mrc_xdp.lab import vm
    st = vm.load_state(args.prefix)
    nodes = st.get("plan", {}).get("nodes", {})
    out = {"prefix": st["prefix"], "target": st["target"], "complete": st.get("complete"),
           "accel": st.get("accel"), "accel_reason": st.get("accel_reason"),
           "up_s": st.get("up_s"), "boot_s": st.get("boot_s"),
           "nodes": {n: {"kind": d["kind"], "ssh": " ".join(st["ssh"][n]) if n in st.get("ssh", {}) else None,
                         "nics": {c["ifname"]: c["link"] for c in d["nics"]}} for n, d in nodes.items()}}
    if args.json:
        print(json.dumps(out, indent=1))
        return 0
    print("VM lab %r (%s, %s: %s)%s" % (out["prefix"], out["target"], out["accel"], out["accel_reason"],
                                       "  up in %.0fs" % out["up_s"] if out["up_s"] else "  [incomplete]"))
    for n, d in out["nodes"].items():
        print("  %-8s %-6s %s" % (n, d["kind"], " ".join("%s:%s" % kv for kv in d["nics"].items())))
    return 0


def cmd_vm_ssh(args) -> int:
    from mrc_xdp.lab import vm
    st = vm.load_state(args.prefix)
    if args.node not in st.get("ssh", {}):
        raise UsageError("no VM %r (VMs: %s)" % (args.node, ", ".join(st.get("ssh", {}))))
    cmd = args.cmd[1:] if args.cmd[:1] == ["--"] else args.cmd
    argv = st["ssh"][args.node] + ([" ".join(cmd)] if cmd else [])
    if not cmd:
        argv = [a for a in argv if a != "BatchMode=yes"]
        argv.insert(1, "-t")
    sys.stdout.flush()
    os.execvp(argv[0], argv)


def cmd_vm_fail(args) -> int:
    from mrc_xdp.lab import vm
    (vm.heal if args.heal else vm.fail)(args.prefix, args.node)
    print("%s %s" % ("resumed" if args.heal else "froze (failed)", args.node))
    return 0


def _guard(fn):
    def run(args) -> int:
        try:
            fabric.require_root()
            return fn(args)
        except (fabric.LabError, topomod.TopologyError, lmod.LinkModelError, ExecError) as e:
            print("mrc-xdp lab: %s" % e, file=sys.stderr)
            return 1
        except KeyError as e:
            print("mrc-xdp lab: %s" % (e.args[0] if e.args else e), file=sys.stderr)
            return 1
        except PermissionError as e:
            print("mrc-xdp lab: %s: run as root" % e, file=sys.stderr)
            return 1
        except OSError as e:
            print("mrc-xdp lab: %s" % e, file=sys.stderr)
            return 1
        except KeyboardInterrupt:
            print("mrc-xdp lab: interrupted (`mrc-xdp lab down` removes a half-built lab)",
                  file=sys.stderr)
            return 130
    run.__name__ = fn.__name__
    return run


def _set_handler(p, fn) -> None:
    """func: returns the exit code (our main); fn: for the main CLI, which ignores return
    values, so a failure exits non-zero after its one-line message."""
    guarded = _guard(fn)

    def exiting(args):
        rc = guarded(args)
        if rc:
            raise SystemExit(rc)
        return rc
    p.set_defaults(func=guarded, fn=exiting)


def _prefix_option(p, default=None) -> None:
    p.add_argument("--prefix", default=default or default_prefix(),
                   help="lab name prefix for namespaces and pins (default %(default)s; env "
                        + ops.ENV_PREFIX + ")")


def add_parser(subparsers) -> argparse.ArgumentParser:
    """Add `lab` and its subcommands to the main CLI's subparsers."""
    lab = subparsers.add_parser("lab", help="multi-plane fabric of network namespaces",
                                description=__doc__.split("\n\n")[0])
    sub = lab.add_subparsers(dest="lab_cmd", metavar="COMMAND")
    sub.required = True

    def common(p):
        _prefix_option(p)
        return p

    p = common(sub.add_parser("up", help="build the lab (idempotent)"))
    p.add_argument("--topology", "-t", metavar="FILE", help="topology TOML (default: the packaged default.toml)")
    p.add_argument("--mode", choices=("srv6", "ecmp"), help="override the topology's mode")
    p.add_argument("--no-hosts", action="store_true", help="fabric only: do not load the host datapaths")
    p.add_argument("--target", choices=("netns", "qemu", "vagrant"), default="netns",
                   help="netns: namespaces of this machine (default); qemu: one VM per node, "
                        "plain QEMU; vagrant: one VM per node, vagrant-libvirt")
    p.add_argument("--vm", action="store_true", help="same as --target qemu")
    p.add_argument("--no-linkmodel", action="store_true",
                   help="VMs: no link model (each bcc build is 1-4 min of a TCG guest's CPU)")
    _set_handler(p, cmd_up)

    p = common(sub.add_parser("render", help="the topology as the JSON vagrant/Vagrantfile reads"))
    p.add_argument("--json", action="store_true", help="JSON (the only format)")
    p.add_argument("--output", "-o", metavar="FILE", help="write to FILE (e.g. vagrant/topology.json)")
    p.add_argument("--topology", "-t", metavar="FILE", help="topology TOML (default: the packaged default.toml)")
    p.add_argument("--mode", choices=("srv6", "ecmp"), help="override the topology's mode")
    _set_handler(p, cmd_render)

    vmp = sub.add_parser("vm", help="VM lab: build-box, status, ssh, fail/heal")
    vsub = vmp.add_subparsers(dest="vm_cmd", metavar="COMMAND")
    vsub.required = True
    p = vsub.add_parser("build-box", help="build the guest image (cached) and add the Vagrant box mrc-xdp/lab")
    p.add_argument("--force", action="store_true", help="rebuild the disk even when nothing changed")
    p.add_argument("--no-vagrant", action="store_true", help="the image only (plain QEMU), no box")
    _set_handler(p, cmd_vm_build_box)
    p = common(vsub.add_parser("status", help="the VMs of a VM lab"))
    p.add_argument("--json", action="store_true")
    _set_handler(p, cmd_vm_status)
    p = common(vsub.add_parser("ssh", help="a shell or a command on a VM: ssh NODE [-- CMD]"))
    p.add_argument("node")
    p.add_argument("cmd", nargs=argparse.REMAINDER, metavar="-- CMD")
    _set_handler(p, cmd_vm_ssh)
    p = common(vsub.add_parser("fail", help="freeze a VM (a failed switch); --heal resumes it"))
    p.add_argument("node")
    p.add_argument("--heal", action="store_true")
    _set_handler(p, cmd_vm_fail)

    p = common(sub.add_parser("down", help="remove what the lab recorded creating (also after a crash); "
                                           "names what matches the prefix but is not its own"))
    _set_handler(p, cmd_down)

    p = common(sub.add_parser("status", help="nodes, links, per-link counters"))
    p.add_argument("--json", action="store_true")
    _set_handler(p, cmd_status)

    p = common(sub.add_parser("exec", help="run a command in a node's namespace: exec NODE -- CMD",
                              usage="%(prog)s [--prefix P] NODE [--prefix P] [-- CMD [ARG ...]]",
                              description="Run CMD (default: $SHELL) in NODE's network namespace. "
                              "Options of exec go before `--`; everything after it is the command, "
                              "passed on verbatim."))
    p.add_argument("node")
    p.add_argument("cmd", nargs=argparse.REMAINDER, metavar="-- CMD")
    _set_handler(p, cmd_exec)

    p = common(sub.add_parser(
        "launch", help="run a distributed job: CMD once per host, with torchrun's environment",
        usage="%(prog)s [--prefix P] [--hosts h0,h1,...] [--timeout S] [--port P] -- CMD [ARG ...]",
        description="Run CMD once per lab host, inside the host's namespace, with the variables "
        "torchrun sets (RANK, WORLD_SIZE, LOCAL_RANK, MASTER_ADDR = the first host's control address, "
        "MASTER_PORT) and MRC_INSTANCE (the host's datapath instance, for the \"mrc\" torch backend). "
        "Lines are prefixed with their rank; a failing rank stops the others; the exit status is "
        "the first failure's (124 on timeout). Example: mrc-xdp lab launch -- .venv/bin/python "
        "examples/train_ddp.py --backend mrc"))
    p.add_argument("--hosts", help="comma-separated hosts, rank order (default: every host)")
    p.add_argument("--timeout", type=float, help="stop every rank after S seconds")
    p.add_argument("--port", type=int, default=29500, help="MASTER_PORT (default 29500)")
    p.add_argument("cmd", nargs=argparse.REMAINDER, metavar="-- CMD")
    _set_handler(p, cmd_launch)

    lk = sub.add_parser("link", help="link model settings")
    lsub = lk.add_subparsers(dest="link_cmd", metavar="COMMAND")
    lsub.required = True
    p = common(lsub.add_parser("set", help="link set LINK [rate R] [loss P] [blackhole on|off] [flap PERIOD] ..."))
    p.add_argument("link", help="a-b (both directions) or a>b (one)")
    p.add_argument("settings", nargs="+", metavar="KEY VALUE")
    _set_handler(p, cmd_link_set)

    p = common(sub.add_parser("fail", help="fail a node (all its links) or a link (blackhole)"))
    p.add_argument("target", metavar="NODE|LINK")
    _set_handler(p, cmd_fail)

    p = common(sub.add_parser("heal", help="clear faults of a node, a link, or everything"))
    p.add_argument("target", nargs="?", metavar="NODE|LINK")
    _set_handler(p, cmd_heal)

    from mrc_xdp.cli import fleet as fleet_cli     # lab inventory = fleet inventory
    fleet_cli.add_inventory_parser(sub)
    return lab


def main(argv=None) -> int:
    """Standalone entry (python -m mrc_xdp.cli.lab ...), for when the main CLI is absent."""
    ap = argparse.ArgumentParser(prog="mrc-xdp")
    sub = ap.add_subparsers(dest="cmd", metavar="COMMAND")
    sub.required = True
    add_parser(sub)
    args = ap.parse_args(argv)
    return args.func(args)


if __name__ == "__main__":
    sys.exit(main())
