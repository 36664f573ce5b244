"""The fleet: an Ansible inventory of running lab hosts, a Prometheus scrape config
generated from the same inventory, and the Kubernetes DaemonSet's pod for podman
(deploy/ansible/, deploy/prometheus/, deploy/kubernetes/, docs/fleet.md).

Its command line (mrc_xdp.cli.fleet):

    mrc-xdp lab inventory [--prefix P] [-o FILE] [--json] [--state-dir DIR]
                          [--metrics-port N] [--checkout DIR]
        write an Ansible inventory of the running lab P (netns hosts driven locally in
        their namespace, VM hosts over SSH with the lab's key and forwarded ports);
        -o FILE: write it there (JSON, which Ansible's YAML inventory plugin reads),
        else print it.  --json: print a one-line summary as JSON instead of text.
        -> fleet.inventory.lab_inventory(prefix, state_dir, metrics_port, checkout)
           fleet.inventory.write(inv, path)

    mrc-xdp fleet prometheus-config --inventory FILE [-o FILE] [--targets FILE]
                          [--rules FILE]... [--interval S] [--job NAME]
        a Prometheus configuration scraping every host's metrics endpoint named in the
        inventory (its rule files given by --rules, e.g. deploy/prometheus/mrc-xdp.rules.yml);
        --targets FILE: also write the targets as a file_sd JSON file and point the
        config at it (a running Prometheus then follows fleet changes without a reload).
        -> fleet.prometheus.scrape_config(inv, rule_files, interval, job, targets_file)
           fleet.prometheus.targets(inv)

    mrc-xdp fleet pod [--lab-host HOST --prefix P | --host-config FILE] [--image IMG]
                      [--env NAME=VALUE]... [--name N] [--daemonset FILE] [-o FILE]
        the Kubernetes DaemonSet's pod template (deploy/kubernetes/daemonset.yaml) as one
        node's Pod with the ConfigMap it mounts, for `podman kube play`.
        -> fleet.kubernetes.pod_documents(path, image, host_config, name, node, env)
           fleet.kubernetes.lab_host(prefix, host)

Library code: plain arguments in, dicts out, FleetError (one line) on failure; it never
imports mrc_xdp.cli.  Messages name the command to run as INVENTORY_CMD.
"""
from __future__ import annotations

import json
import os


INVENTORY_CMD = "mrc-xdp lab inventory"


class FleetError(RuntimeError):
    """A fleet operation failed; str() is one line saying what and what to do."""


def write_json(obj, path: str, what: str = "") -> None:
    """obj as JSON into path, atomically (a temporary file renamed into place); JSON is
    YAML to Ansible and Prometheus.  FleetError (one line) when it cannot be written."""
    write_text(json.dumps(obj, indent=1, sort_keys=True) + "\n", path, what)


def write_text(text: str, path: str, what: str = "") -> None:
    """text into path, atomically (a temporary file renamed into place).  FleetError (one
    line, `what` before the path) when it cannot be written."""
    tmp = "%s.tmp.%d" % (path, os.getpid())
    try:
        with open(tmp, "w") as f:
            f.write(text)
        os.replace(tmp, path)
    except OSError as e:
        try:
            os.unlink(tmp)
        except OSError:
            pass
        raise FleetError("%s%s: %s" % (what, path, e.strerror or e)) from None
