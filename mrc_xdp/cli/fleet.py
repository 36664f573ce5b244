"""`mrc-xdp fleet inventory`, `mrc-xdp fleet prometheus-config`, `mrc-xdp fleet pod` (and
`mrc-xdp lab inventory`, the same as `fleet inventory`): the fleet tools of mrc_xdp.fleet as
commands (docs/fleet.md)."""
from __future__ import annotations

import argparse
import json
import os
import sys

from mrc_xdp.fleet import FleetError, inventory, kubernetes, prometheus

EPILOG = """\
examples:
  mrc-xdp lab up --no-hosts --prefix fl-                a fabric, no datapath loaded
  mrc-xdp lab inventory --prefix fl- -o inv.json        its hosts as an Ansible inventory
  ANSIBLE_CONFIG=deploy/ansible/ansible.cfg \\
  .venv/bin/ansible-playbook -i inv.json deploy/ansible/deploy.yml   deploy: load, daemon, metrics
  mrc-xdp fleet prometheus-config --inventory inv.json \\
      --rules deploy/prometheus/mrc-xdp.rules.yml -o prometheus.yml
docs/fleet.md has the whole story.
"""


def add_inventory_parser(sub) -> None:
    p = sub.add_parser("inventory", epilog=EPILOG, formatter_class=argparse.RawDescriptionHelpFormatter, help="Ansible inventory of a running lab (netns hosts local, VM hosts over SSH)",
                       description="Write an Ansible inventory (JSON, read by Ansible's YAML plugin) of the "
                       "running lab PREFIX: one host per lab host, named after its datapath instance, in the "
                       "group mrc_xdp, with its host config as the mrc_xdp role's variables.")
    p.add_argument("--prefix", default=os.environ.get("MRC_LAB_PREFIX", "mrc-"),
                   help="the lab's prefix (default mrc- or $MRC_LAB_PREFIX)")
    p.add_argument("-o", "--output", metavar="FILE", help="write it to FILE (default: print it)")
    p.add_argument("--json", action="store_true", help="with -o: print a summary as JSON")
    p.add_argument("--state-dir", metavar="DIR",
                   help="netns hosts' files (config, pid files, logs) under DIR/<host>/ "
                   "(default /run/mrc-xdp/fleet/<prefix>)")
    p.add_argument("--metrics-port", type=int, default=inventory.DEFAULT_METRICS_PORT, metavar="N",
                   help="netns host n's metrics endpoint listens on 127.0.0.1:N+n (default %(default)s)")
    p.add_argument("--checkout", metavar="DIR", help="mrc-xdp checkout with its .venv (default: this one; "
                   "VM hosts: /opt/mrc-xdp)")
    p.set_defaults(fn=cmd_fleet, func=cmd_fleet, fleet_cmd="inventory")


def add_parsers(sub) -> None:
    fp = sub.add_parser("fleet", help="fleet tools: an Ansible inventory of a lab, Prometheus config of an "
                        "inventory, the Kubernetes pod for podman",
                        description="The fleet's tools (docs/fleet.md): `inventory` writes an Ansible inventory of "
                        "a running lab for deploy/ansible/; `prometheus-config` a Prometheus configuration "
                        "scraping every host of an inventory; `pod` the Kubernetes DaemonSet's pod template "
                        "as a Pod for `podman kube play`.", epilog=EPILOG,
                        formatter_class=argparse.RawDescriptionHelpFormatter)
    sub = fp.add_subparsers(dest="fleet_cmd", metavar="ACTION", required=True)
    add_inventory_parser(sub)
    p = sub.add_parser("prometheus-config", help="Prometheus config scraping every host of an inventory",
                       description="Write a Prometheus configuration (JSON, which Prometheus reads as YAML) "
                       "with one scrape target per inventory host that has a metrics target.")
    p.add_argument("--inventory", "-i", required=True, metavar="FILE", help="an inventory from `inventory -o`")
    p.add_argument("-o", "--output", metavar="FILE", help="write it to FILE (default: print it)")
    p.add_argument("--targets", metavar="FILE", help="also write the targets as a file_sd JSON file and "
                   "point the config at it (Prometheus follows changes to it without a reload)")
    p.add_argument("--rules", action="append", default=[], metavar="FILE",
                   help="a rule file to load (repeatable), e.g. deploy/prometheus/mrc-xdp.rules.yml")
    p.add_argument("--interval", default="5s", help="scrape and rule evaluation interval (default 5s)")
    p.add_argument("--job", default=prometheus.JOB, help="job name (default %(default)s)")
    p.set_defaults(fn=cmd_fleet, func=cmd_fleet, fleet_cmd="prometheus-config")
    p = sub.add_parser("pod", help="the DaemonSet's pod template as a Pod for `podman kube play`",
                       formatter_class=argparse.RawDescriptionHelpFormatter,
                       description="Write the DaemonSet's pod template (deploy/kubernetes/daemonset.yaml) as "
                       "one node's Pod, with the ConfigMaps it mounts, for `podman kube play` (which does not "
                       "take kind: DaemonSet).  The template is taken as it is; only the image, the host "
                       "config and the name can be replaced.",
                       epilog="example (docs/fleet.md, \"Kubernetes\"):\n"
                       "  mrc-xdp lab up --no-hosts --prefix k8-\n"
                       "  mrc-xdp fleet pod --lab-host h0 --prefix k8- -o pod.yaml\n"
                       "  CONTAINERS_CONF=deploy/kubernetes/containers.conf podman kube play pod.yaml\n"
                       "  CONTAINERS_CONF=deploy/kubernetes/containers.conf podman kube down pod.yaml")
    p.add_argument("--daemonset", default=kubernetes.DAEMONSET, metavar="FILE",
                   help="the manifest (default: this checkout's deploy/kubernetes/daemonset.yaml)")
    p.add_argument("--image", help="the agent's image (default: the manifest's)")
    g = p.add_mutually_exclusive_group()
    g.add_argument("--host-config", metavar="FILE", help="a host config (TOML) for the ConfigMap's host.toml")
    g.add_argument("--lab-host", metavar="HOST", help="act as this netns lab host (e.g. h0): its host config, "
                   "and in the agent's environment its namespace (MRC_NETNS), daemon socket and metrics "
                   "endpoint, as `mrc-xdp lab inventory` gives them")
    p.add_argument("--prefix", default=os.environ.get("MRC_LAB_PREFIX", "mrc-"),
                   help="with --lab-host: the lab's prefix (default mrc- or $MRC_LAB_PREFIX)")
    p.add_argument("--env", action="append", default=[], metavar="NAME=VALUE",
                   help="set NAME in the agent's environment (repeatable; replaces the manifest's value)")
    p.add_argument("--name", help="the Pod's name (default <daemonset>-<lab host>, or the DaemonSet's)")
    p.add_argument("-o", "--output", metavar="FILE", help="write it to FILE (default: print it)")
    p.set_defaults(fn=cmd_fleet, func=cmd_fleet, fleet_cmd="pod")


def cmd_fleet(args) -> int:
    try:
        if args.fleet_cmd == "pod":
            return _cmd_pod(args)
        if args.fleet_cmd == "inventory":
            inv = inventory.lab_inventory(args.prefix, args.state_dir, args.metrics_port, args.checkout)
            if not args.output:
                print(json.dumps(inv, indent=1, sort_keys=True))
                return 0
            inventory.write(inv, args.output)
            s = inventory.summary(inv)
            if args.json:
                print(json.dumps(dict(s, file=os.path.abspath(args.output))))
            else:
                print("wrote %s: %d hosts (%s), group %s" % (args.output, len(s["hosts"]), ", ".join(s["hosts"]),
                                                             inventory.GROUP))
            return 0
        inv = inventory.read(args.inventory)
        res = prometheus.scrape_config(inv, args.rules, args.interval, args.job, args.targets)
        if args.targets:
            prometheus.write_json(res["targets"], args.targets)
        if args.output:
            prometheus.write_json(res["config"], args.output)
            print("wrote %s: %d targets%s" % (args.output, len(res["targets"]),
                                              " (in %s)" % args.targets if args.targets else ""))
        else:
            print(json.dumps(res["config"], indent=1))
        if res["skipped"]:
            print("not scraped (no metrics target reachable from here): %s" % ", ".join(res["skipped"]),
                  file=sys.stderr)
        return 0
    except FleetError as e:
        print("mrc-xdp fleet: %s" % e, file=sys.stderr)
        raise SystemExit(1)


def _cmd_pod(args) -> int:
    cfg = None
    if args.host_config:
        try:
            with open(args.host_config) as f:
                cfg = f.read()
        except OSError as e:
            raise FleetError("%s: %s" % (args.host_config, e.strerror or e)) from None
    env = {}
    if args.lab_host:
        lh = kubernetes.lab_host(args.prefix, args.lab_host)
        cfg = lh["config"]
        env.update(lh["env"])
    for e in args.env:
        k, eq, v = e.partition("=")
        if not eq or not k:
            raise FleetError("--env %r: expected NAME=VALUE" % e)
        env[k] = v
    docs = kubernetes.pod_documents(args.daemonset, image=args.image, host_config=cfg, name=args.name,
                                    node=(args.prefix + args.lab_host) if args.lab_host else None, env=env)
    if not args.output:
        sys.stdout.write(kubernetes.dump(docs))
        return 0
    kubernetes.write(docs, args.output)
    pod = docs[-1]
    print("wrote %s: Pod %s (image %s), %d ConfigMap(s)" % (
        args.output, pod["metadata"]["name"], pod["spec"]["containers"][0].get("image"), len(docs) - 1))
    return 0
