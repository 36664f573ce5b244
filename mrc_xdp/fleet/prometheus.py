"""A Prometheus configuration for the fleet, generated from the inventory
(``mrc_xdp.fleet.inventory``): one scrape target per host with a metrics target.

Every target carries the labels ``mrc_host`` (the lab's host name, or the inventory
name) and ``mrc_inventory_host`` (the inventory name); the series' own ``mrc_instance``
names the datapath instance (Prometheus sets ``instance`` to the target's address).
Hosts without ``mrc_xdp_metrics_target`` (VM lab guests: their port is not forwarded)
are listed in the result's ``skipped`` so a caller can say so.

The configuration is JSON, which Prometheus reads as YAML.
"""
from __future__ import annotations

import os
import re

from mrc_xdp.fleet import FleetError, write_json  # noqa: F401  (write_json: callers write the config with it)
from mrc_xdp.fleet.inventory import hosts_of

JOB = "mrc-xdp"
_DURATION = re.compile(r"^[0-9]+(ms|s|m|h)$")
_HOSTPORT = re.compile(r"^[A-Za-z0-9_.:\[\]-]+:[0-9]{1,5}$")


def targets(inv: dict) -> tuple[list[dict], list[str]]:
    """([{targets: [host:port], labels: {...}}], [inventory hosts without a target])."""
    out, skipped = [], []
    for name, v in sorted(hosts_of(inv).items()):
        t = v.get("mrc_xdp_metrics_target")
        if not t:
            skipped.append(name)
            continue
        if not isinstance(t, str) or not _HOSTPORT.match(t):
            raise FleetError("host %s: mrc_xdp_metrics_target %r is not HOST:PORT" % (name, t))
        out.append({"targets": [t], "labels": {"mrc_host": str(v.get("mrc_host", name)),
                                               "mrc_inventory_host": name}})
    return out, skipped


def scrape_config(inv: dict, rule_files=(), interval: str = "5s", job: str = JOB,
                  targets_file: str | None = None) -> dict:
    """The configuration: global intervals, rule_files, one job over the targets (static,
    or file_sd from targets_file, which the caller writes with write_targets())."""
    if not _DURATION.match(interval or ""):
        raise FleetError("interval %r: a Prometheus duration such as 5s or 1m" % (interval,))
    if not re.match(r"^[A-Za-z0-9_-]+$", job or ""):
        raise FleetError("job %r: use letters, digits, _ and -" % (job,))
    tg, skipped = targets(inv)
    if not tg:
        raise FleetError("no host in the inventory has a metrics target (mrc_xdp_metrics_target): "
                         "nothing to scrape")
    sc = {"job_name": job, "scrape_interval": interval, "scrape_timeout": interval,
          "metrics_path": "/metrics"}
    if targets_file:
        sc["file_sd_configs"] = [{"files": [os.path.abspath(targets_file)], "refresh_interval": "5s"}]
    else:
        sc["static_configs"] = tg
    cfg = {"global": {"scrape_interval": interval, "evaluation_interval": interval,
                      "external_labels": {"mrc_fleet": job}},
           "rule_files": [os.path.abspath(r) for r in rule_files],
           "scrape_configs": [sc]}
    for r in cfg["rule_files"]:
        if not os.path.isfile(r):
            raise FleetError("rule file %s: no such file" % r)
    return {"config": cfg, "targets": tg, "skipped": skipped}
