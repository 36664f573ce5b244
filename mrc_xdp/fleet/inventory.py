"""An Ansible inventory of a running lab, for deploy/ansible/ (the mrc_xdp role).

``lab_inventory(prefix)`` reads the lab's state (/run/mrc-xdp/lab-<prefix>.json for the
netns lab, vmlab-<prefix>.json for the VM lab) and gives one inventory host per lab host,
named after its datapath instance (``<prefix><host>``), in the group ``mrc_xdp``:

- netns lab: ``ansible_connection: local`` (every host is a namespace on this machine);
  the role passes ``mrc_xdp_netns`` to ``mrc-xdp load --netns``.  The daemon and the
  metrics endpoint run in the root namespace (the pinned maps are global; the daemon
  follows the plane links in the instance's namespace itself), the endpoint on
  127.0.0.1:<metrics_port + host number>, so a Prometheus on this machine reaches each.
  Per-host files (config, pid files, logs, daemon socket) live under
  ``<state_dir>/<host>/``: the hosts share one file system.
- VM lab: over SSH as root (QEMU runner: to 127.0.0.1 on the VM's forwarded port with
  the lab's key; Vagrant runner: through the ssh config `vagrant ssh-config` wrote); the
  checkout is the guest's /opt/mrc-xdp; files under /etc/mrc-xdp and /run/mrc-xdp as on
  a real host.  The metrics endpoint listens on the guest's port 9417, which the QEMU
  runner forwards to 127.0.0.1:<the plan's metrics_port>: that is the host's
  ``mrc_xdp_metrics_target``.  Vagrant labs (and QEMU labs started before the forward
  existed) have none (prometheus.py leaves them out and says so).

Each host's datapath config is the lab's own (``mrc_xdp.lab.hosts.host_config_dict``:
planes, QPNs, SRv6 templates), split into the role's variables (``mrc_xdp_planes``,
``mrc_xdp_connections``, ...), with a fixed seed per connection so the config file the
role writes is the same at every run (the role's idempotence rests on it).  In ecmp mode
the EVs are then drawn from the seed, not discovered as `lab up` does: the T0s' hash
decides which T1 each takes, so shares over the T1s may be unequal (srv6 routes every EV
as drawn).

The lab must be up with its fabric; its host datapaths need not be loaded (`lab up
--no-hosts` and then the deploy playbook is the fleet's path from nothing).

The inventory is JSON, which Ansible's YAML inventory plugin reads as it is.
"""
from __future__ import annotations

import json
import os
import zlib

from mrc_xdp.fleet import INVENTORY_CMD, FleetError, write_json

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
GROUP = "mrc_xdp"
DEFAULT_METRICS_PORT = 9470     # host n's endpoint: 127.0.0.1:<port + n> (netns lab)
DEFAULT_STATE_DIR = "/run/mrc-xdp/fleet"
VM_CHECKOUT = "/opt/mrc-xdp"

# host config keys the role takes as variables of their own (the rest: mrc_xdp_host_extra)
_SPLIT = {"instance": "mrc_xdp_instance", "mode": "mrc_xdp_mode", "local_addr": "mrc_xdp_local_addr",
          "planes": "mrc_xdp_planes", "connections": "mrc_xdp_connections",
          "srv6_templates": "mrc_xdp_srv6_templates"}


def _seed(prefix: str, host: str, peer: str) -> int:
    return zlib.crc32(("%s%s>%s" % (prefix, host, peer)).encode())


def host_vars(config: dict) -> dict:
    """A host config dict (docs/config.md) as the role's variables."""
    out = {"mrc_xdp_host_extra": {}}
    for k, v in config.items():
        if k in _SPLIT:
            out[_SPLIT[k]] = v
        else:
            out["mrc_xdp_host_extra"][k] = v
    out.setdefault("mrc_xdp_srv6_templates", {})
    return out


def config_of(hostvars: dict) -> dict:
    """The host config dict the role renders from a host's variables (host_vars' inverse)."""
    d = dict(hostvars.get("mrc_xdp_host_extra") or {})
    for k, var in _SPLIT.items():
        v = hostvars.get(var)
        if v not in (None, {}, []) or k in ("planes", "connections"):
            d[k] = v
    return d


def _topology(prefix: str):
    """(kind, state, topology) of the running lab `prefix`."""
    from mrc_xdp.lab import fabric, vm
    try:
        fabric.check_prefix(prefix)
    except fabric.LabError as e:
        raise FleetError(str(e)) from None
    if vm.is_vm_lab(prefix):
        try:
            st = vm.load_state(prefix)
        except fabric.LabError as e:
            raise FleetError(str(e)) from None
        if not st.get("complete"):
            raise FleetError("VM lab %r is not complete (still starting, or its `lab up` failed): "
                             "wait for it, or `mrc-xdp lab down --prefix %s`" % (prefix, prefix))
        return "vm", st, fabric.topology_of(st)
    try:
        st = fabric.load_state(prefix)
    except fabric.LabError as e:
        raise FleetError(str(e)) from None
    if fabric.running(prefix) is None:
        raise FleetError("lab %r is not running (incomplete, or its namespaces are gone): "
                         "`mrc-xdp lab down --prefix %s` and `lab up` again" % (prefix, prefix))
    return "netns", st, fabric.topology_of(st)


def lab_inventory(prefix: str, state_dir: str | None = None, metrics_port: int = DEFAULT_METRICS_PORT,
                  checkout: str | None = None) -> dict:
    """The inventory of the running lab `prefix` (see the module docstring).
    state_dir: where netns hosts keep their files (default /run/mrc-xdp/fleet/<prefix>);
    metrics_port: host n's endpoint is 127.0.0.1:<metrics_port + n> (netns lab);
    checkout: the mrc-xdp checkout with its .venv (default: this one; VM: /opt/mrc-xdp)."""
    from mrc_xdp.lab import hosts as lab_hosts
    kind, st, topo = _topology(prefix)
    if not isinstance(metrics_port, int) or not 1024 <= metrics_port <= 65535 - len(topo.hosts):
        raise FleetError("metrics port %r: must be 1024-%d (host n listens on port + n)"
                         % (metrics_port, 65535 - len(topo.hosts)))
    state_dir = os.path.abspath(state_dir or os.path.join(DEFAULT_STATE_DIR, prefix.rstrip("-_") or prefix))
    hosts: dict[str, dict] = {}
    for h in topo.hosts:
        cfg = lab_hosts.host_config_dict(topo, prefix, h.name)
        for c in cfg["connections"]:
            c["seed"] = _seed(prefix, h.name, c["name"])
        name = lab_hosts.instance_name(prefix, h.name)
        v = {"mrc_host": h.name, "mrc_xdp_lab_prefix": prefix}
        v.update(host_vars(cfg))
        if kind == "netns":
            d = os.path.join(state_dir, h.name)
            listen = "127.0.0.1:%d" % (metrics_port + h.index)
            v.update({
                "ansible_connection": "local",
                "ansible_python_interpreter": "/usr/bin/python3",
                "mrc_xdp_checkout": os.path.abspath(checkout or ROOT),
                "mrc_xdp_netns": st["nodes"][h.name],
                "mrc_xdp_conf_dir": d, "mrc_xdp_run_dir": d,
                "mrc_xdp_daemon_socket": os.path.join(d, "events.sock"),
                "mrc_xdp_metrics_listen": listen, "mrc_xdp_metrics_target": listen,
                "mrc_xdp_service_manager": "background",
                # the lab's link model is attached on the host's plane NICs (rx ends);
                # load replaces it there (the last hop to the host is then not modelled)
                "mrc_xdp_load_force": True,
            })
        else:
            v.update(_vm_host_vars(st, h.name, checkout))
        hosts[name] = v
    return {"all": {"vars": {"mrc_xdp_fleet": "lab %s (%s)" % (prefix, kind)},
                    "children": {GROUP: {"hosts": hosts}}}}


_SSH_ARGS = "-o StrictHostKeyChecking=no -o UserKnownHostsFile=/dev/null -o LogLevel=ERROR"


def _vm_host_vars(st: dict, host: str, checkout: str | None) -> dict:
    """A VM lab host: SSH as root (QEMU runner: 127.0.0.1, the VM's forwarded port, the
    lab's key; Vagrant runner: the ssh_config `vagrant ssh-config` wrote, host named as
    the VM), the guest's checkout, background services (the guests boot a minimal init).
    The metrics endpoint listens on the guest's GUEST_METRICS_PORT, which the QEMU runner
    forwards to 127.0.0.1:<metrics_port> (labs started before it did, and Vagrant labs,
    get no target)."""
    from mrc_xdp.lab import vm
    node = st["plan"]["nodes"][host]
    v = {"ansible_connection": "ssh", "ansible_user": "root",
         "ansible_python_interpreter": "/usr/bin/python3",
         "mrc_xdp_checkout": checkout or VM_CHECKOUT,
         "mrc_xdp_netns": "",
         "mrc_xdp_metrics_listen": "0.0.0.0:%d" % vm.GUEST_METRICS_PORT,
         "mrc_xdp_metrics_target": None,
         "mrc_xdp_service_manager": "background",
         # the lab may have loaded its own datapath (or the link model) on the host's
         # NICs: the role's load replaces it
         "mrc_xdp_load_force": True}
    if st.get("target") == "vagrant":
        argv = (st.get("ssh") or {}).get(host) or []
        cfg = argv[argv.index("-F") + 1] if "-F" in argv else None
        if not cfg:
            raise FleetError("VM lab %r: no ssh config recorded for %s (`mrc-xdp lab down --prefix %s` "
                             "and up again)" % (st["prefix"], host, st["prefix"]))
        v.update({"ansible_host": host, "ansible_ssh_common_args": "-F %s %s" % (cfg, _SSH_ARGS)})
        return v
    v.update({"ansible_host": "127.0.0.1", "ansible_port": node["ssh_port"],
              "ansible_ssh_private_key_file": st.get("ssh_key") or _vm_key(),
              "ansible_ssh_common_args": _SSH_ARGS})
    if node.get("metrics_port"):
        v["mrc_xdp_metrics_target"] = "127.0.0.1:%d" % node["metrics_port"]
    return v


def _vm_key() -> str:
    from mrc_xdp.lab import vm
    return vm.image()["key"]


def hosts_of(inv: dict) -> dict[str, dict]:
    """{inventory host name: its variables} of an inventory this module wrote."""
    try:
        return dict(inv["all"]["children"][GROUP]["hosts"])
    except (KeyError, TypeError):
        raise FleetError("not an mrc-xdp inventory: no group %r under all.children "
                         "(write one with `%s`)" % (GROUP, INVENTORY_CMD)) from None


def read(path: str) -> dict:
    """An inventory written by write() (JSON)."""
    try:
        with open(path) as f:
            inv = json.load(f)
    except FileNotFoundError:
        raise FleetError("inventory %s: no such file (write one with `%s -o %s`)"
                         % (path, INVENTORY_CMD, path)) from None
    except (OSError, ValueError) as e:
        raise FleetError("inventory %s: %s (expected the JSON `%s` writes)"
                         % (path, getattr(e, "strerror", None) or e, INVENTORY_CMD)) from None
    hosts_of(inv)
    return inv


def write(inv: dict, path: str) -> None:
    """Write atomically (a temporary file renamed into place)."""
    write_json(inv, path, "inventory ")


def summary(inv: dict) -> dict:
    hs = hosts_of(inv)
    return {"hosts": sorted(hs), "connection": sorted({v.get("ansible_connection", "ssh") for v in hs.values()}),
            "metrics_targets": {n: v.get("mrc_xdp_metrics_target") for n, v in sorted(hs.items())}}
