"""The DaemonSet's pod template as a Pod that `podman kube play` runs (docs/fleet.md,
"Kubernetes").

`podman kube play` does not take ``kind: DaemonSet``.  ``pod_documents()`` reads
deploy/kubernetes/daemonset.yaml and gives what the DaemonSet controller would create on
one node, as documents kube play takes: the ConfigMaps the pod template mounts, then a
Pod whose metadata (namespace, labels, annotations) and spec are the template's,
unchanged.  Read from the manifest at every run, the Pod cannot drift from it.  Options
only replace what differs per node or per build:

- ``image``: the agent container's image (default: the manifest's);
- ``host_config``: the TOML text of the host config ConfigMap's ``host.toml`` (each
  host has its own config: ``local_addr``, gateway MACs); ``lab_host(prefix, host)``
  gives a netns lab host's, the lab's own config (mrc_xdp.lab.hosts), the one ``mrc-xdp
  lab inventory`` hands to Ansible, with the agent's environment for that host
  (MRC_NETNS: the pod stays on the machine's network and loads into the host's
  namespace, as the Ansible role does for netns hosts);
- ``env``: {NAME: value} set in the agent container's environment (replacing the
  manifest's value of NAME): e.g. the daemon's socket where several agents share one
  machine's /run/mrc-xdp (the netns lab);
- ``node``: the node's name: the Pod is ``<daemonset>-<node>`` (or ``name``) and each
  ConfigMap ``<configmap>-<node>``, one per node as docs/fleet.md says a fleet needs
  (podman keeps a ConfigMap as a volume of that name, shared by every pod that names it).

One change is podman's: with ``hostNetwork: true`` the containers' ``ports`` are dropped
(``podman=True``, the default).  podman 4.3's kube play refuses every port of a pod on
the host's network ("PortMappings can only be used with Bridge or slirp4netns
networking"), with or without ``hostPort``; in Kubernetes, on the host's network, they
only document the port the agent listens on (hostPort = containerPort).

Library code: plain arguments in, documents out, FleetError (one line) on failure.
"""
from __future__ import annotations

import copy
import json
import os

from mrc_xdp.fleet import FleetError, write_text

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
DAEMONSET = os.path.join(ROOT, "deploy", "kubernetes", "daemonset.yaml")
CONTAINERS_CONF = os.path.join(ROOT, "deploy", "kubernetes", "containers.conf")
CONFIG_KEY = "host.toml"


def _yaml():
    try:
        import yaml
    except ImportError:
        raise FleetError("PyYAML is missing: install Debian's python3-yaml") from None
    return yaml


def read_manifest(path: str = DAEMONSET) -> list[dict]:
    """The documents of a manifest file (FleetError, one line, if unreadable)."""
    yaml = _yaml()
    try:
        with open(path) as f:
            return [d for d in yaml.safe_load_all(f) if d]
    except OSError as e:
        raise FleetError("%s: %s" % (path, e.strerror or e)) from None
    except yaml.YAMLError as e:
        raise FleetError("%s: not YAML: %s" % (path, str(e).replace("\n", " "))) from None


def _one(docs: list[dict], kind: str, name: str | None, path: str) -> dict:
    found = [d for d in docs if d.get("kind") == kind and (name is None or d.get("metadata", {}).get("name") == name)]
    if len(found) != 1:
        raise FleetError("%s: expected one %s%s, found %d" % (path, kind, " named %r" % name if name else "",
                                                               len(found)))
    return found[0]


def pod_documents(path: str = DAEMONSET, image: str | None = None, host_config: str | None = None,
                  name: str | None = None, node: str | None = None, env: dict | None = None,
                  podman: bool = True) -> list[dict]:
    """[ConfigMap..., Pod]: the DaemonSet's pod template in `path` as one node's Pod."""
    docs = read_manifest(path)
    ds = _one(docs, "DaemonSet", None, path)
    tmpl = ds.get("spec", {}).get("template")
    if not isinstance(tmpl, dict) or not isinstance(tmpl.get("spec"), dict):
        raise FleetError("%s: DaemonSet %s has no spec.template.spec" % (path, ds.get("metadata", {}).get("name")))
    ns = ds.get("metadata", {}).get("namespace")
    meta = copy.deepcopy(tmpl.get("metadata") or {})
    dsname = ds.get("metadata", {}).get("name", "pod")
    meta["name"] = name or ("%s-%s" % (dsname, node) if node else dsname)
    if ns:
        meta.setdefault("namespace", ns)
    spec = copy.deepcopy(tmpl["spec"])
    containers = spec.get("containers") or []
    if not containers:
        raise FleetError("%s: the pod template has no containers" % path)
    if image:
        containers[0]["image"] = image
    for k, v in (env or {}).items():
        lst = containers[0].setdefault("env", [])
        for e in lst:
            if e.get("name") == k:
                e.clear()
                e.update({"name": k, "value": str(v)})
                break
        else:
            lst.append({"name": k, "value": str(v)})
    if podman and spec.get("hostNetwork"):
        for c in containers:
            c.pop("ports", None)
    # the ConfigMaps the template mounts, from the same manifest
    maps = []
    for v in spec.get("volumes") or []:
        if "configMap" in v:
            cm = copy.deepcopy(_one(docs, "ConfigMap", v["configMap"].get("name"), path))
            if node:    # one ConfigMap per node (docs/fleet.md); podman keeps each as a volume of that name
                cm.setdefault("metadata", {})["name"] = v["configMap"]["name"] = "%s-%s" % (
                    v["configMap"]["name"], node)
            maps.append(cm)
    if host_config is not None:
        cms = [cm for cm in maps if CONFIG_KEY in (cm.get("data") or {})]
        if len(cms) != 1:
            raise FleetError("%s: expected one ConfigMap with %s mounted by the pod template, found %d"
                             % (path, CONFIG_KEY, len(cms)))
        cms[0]["data"][CONFIG_KEY] = host_config
    pod = {"apiVersion": "v1", "kind": "Pod", "metadata": meta, "spec": spec}
    return maps + [pod]


def dump(docs: list[dict]) -> str:
    """Documents as one multi-document YAML text (block style, the host config literal)."""
    yaml = _yaml()

    class Dumper(yaml.SafeDumper):
        pass

    def text(d, s):
        return d.represent_scalar("tag:yaml.org,2002:str", s, style="|" if "\n" in s else None)
    Dumper.add_representer(str, text)
    return yaml.dump_all(docs, Dumper=Dumper, sort_keys=False, default_flow_style=False)


def write(docs: list[dict], path: str) -> None:
    write_text(dump(docs), path)


# ------------------------------------------------------------------ host config as TOML

def _key(k: str) -> str:
    k = str(k)
    return k if k and all(c.isalnum() or c in "_-" for c in k) else json.dumps(k)


def _val(v) -> str:
    if isinstance(v, bool):
        return "true" if v else "false"
    if isinstance(v, (int, float)):
        return repr(v)
    if isinstance(v, str):
        return json.dumps(v)    # a JSON string is a TOML basic string (\\uXXXX escapes alike)
    if isinstance(v, (list, tuple)):
        return "[" + ", ".join(_val(x) for x in v) + "]"
    if isinstance(v, dict):
        return "{" + ", ".join("%s = %s" % (_key(k), _val(x)) for k, x in v.items()) + "}"
    raise FleetError("host config: cannot write %r as TOML" % (v,))


def toml_text(config: dict, comment: str = "") -> str:
    """A host config dict (docs/config.md) as TOML: scalars first, then [[planes]],
    [[connections]] and one [srv6_templates.NAME] table each."""
    lines = ["# %s" % c for c in comment.splitlines()] if comment else []
    tables = []
    for k, v in config.items():
        if isinstance(v, list) and v and all(isinstance(x, dict) for x in v):
            for x in v:
                tables.append(["", "[[%s]]" % _key(k)] + ["%s = %s" % (_key(a), _val(b)) for a, b in x.items()])
        elif isinstance(v, dict) and v and all(isinstance(x, dict) for x in v.values()):
            for n, x in v.items():
                tables.append(["", "[%s.%s]" % (_key(k), _key(n))] + ["%s = %s" % (_key(a), _val(b))
                                                                    for a, b in x.items()])
        else:
            lines.append("%s = %s" % (_key(k), _val(v)))
    for t in tables:
        lines.extend(t)
    return "\n".join(lines) + "\n"


def lab_host(prefix: str, host: str) -> dict:
    """What the agent needs to act as the netns lab host `host` of lab `prefix`, from the
    lab's inventory (`mrc-xdp lab inventory`, the one Ansible deploys with):
    {"config": TOML text (the lab's own config, with the inventory's fixed EV seeds),
     "env": {MRC_NETNS: the host's namespace, MRC_XDP_DAEMON_SOCKET and MRC_METRICS_LISTEN:
     the inventory's socket and endpoint of that host}, "instance": its instance name}."""
    from mrc_xdp.fleet import inventory
    inv = inventory.lab_inventory(prefix)
    hosts = inv["all"]["children"][inventory.GROUP]["hosts"]
    for name, v in hosts.items():
        if v.get("mrc_host") != host:
            continue
        if not v.get("mrc_xdp_netns"):
            raise FleetError("lab %s host %s is not a network namespace of this machine (a VM lab?)"
                             % (prefix, host))
        text = toml_text(inventory.config_of(v), "lab %s host %s (mrc_xdp.fleet.kubernetes.lab_host)" % (prefix, host))
        _check(text)
        return {"config": text, "instance": v.get("mrc_xdp_instance", name),
                "env": {"MRC_NETNS": v["mrc_xdp_netns"], "MRC_XDP_DAEMON_SOCKET": v["mrc_xdp_daemon_socket"],
                        "MRC_METRICS_LISTEN": v["mrc_xdp_metrics_listen"]}}
    raise FleetError("lab %s has no host %r (hosts: %s)" % (prefix, host, ", ".join(
        sorted(v.get("mrc_host", "?") for v in hosts.values()))))


def _check(text: str) -> None:
    """The TOML text parses and validates as a host config (FleetError otherwise)."""
    import tempfile
    from mrc_xdp.datapath.config import HostConfig
    with tempfile.NamedTemporaryFile("w", suffix=".toml") as f:
        f.write(text)
        f.flush()
        try:
            HostConfig.from_toml(f.name)
        except Exception as e:
            raise FleetError("host config written for the pod does not validate: %s" % e) from None
