"""Tier 2: the Kubernetes agent (deploy/kubernetes) under podman, on a netns lab host.

No cluster runs here.  What runs is everything of the DaemonSet but the controller: the
agent image built from this checkout by podman (scripts/k8s-setup.sh, `make k8s-image`:
podman, runc and debootstrap from Debian, a base image debootstrapped from the machine's
Debian mirror, then the Containerfile; cached in podman's store), and the DaemonSet's pod
template, written as one node's Pod by `mrc-xdp fleet pod` from daemonset.yaml itself,
run by `podman kube play`.  The node is a netns lab host brought up without datapaths
(`--no-hosts`): the pod stays on the machine's network, as a hostNetwork pod, and the
agent loads into the host's namespace (MRC_NETNS, /run/netns from the node), as the
Ansible role does for netns hosts.  Real podman, runc, bcc and XDP; nothing is mocked.

The image fixture runs scripts/k8s-setup.sh, which rebuilds only the layer of the sources
when they changed (tens of seconds; minutes from nothing, see docs/fleet.md).
"""
from __future__ import annotations

import contextlib
import json
import os
import shutil
import socket
import subprocess
import tempfile
import time
import urllib.request
import uuid

import pytest
import yaml

import health_lab as H

ROOT = H.ROOT
MANIFEST = os.path.join(ROOT, "deploy", "kubernetes", "daemonset.yaml")
CONTAINERS_CONF = os.path.join(ROOT, "deploy", "kubernetes", "containers.conf")
IMAGE = os.environ.get("MRC_K8S_IMAGE", "localhost/mrc-xdp:dev")
SETUP = os.path.join(ROOT, "scripts", "k8s-setup.sh")
SETUP_TIMEOUT = 900         # from nothing: about 2.5 min at load 3-4 (docs/fleet.md)
PODMAN_ENV = dict(os.environ, CONTAINERS_CONF=CONTAINERS_CONF)

root_only = pytest.mark.skipif(os.geteuid() != 0, reason="podman, bpffs and the lab need root")


def podman(*args, check=True, timeout=120):
    p = subprocess.run(["podman", *args], capture_output=True, text=True, timeout=timeout, env=PODMAN_ENV)
    if check:
        assert p.returncode == 0, (args, p.returncode, p.stdout[-2000:], p.stderr[-2000:])
    return p


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _scrape(listen: str) -> str | None:
    try:
        with urllib.request.urlopen("http://%s/metrics" % listen, timeout=3) as r:
            return r.read().decode()
    except OSError:
        return None


# ------------------------------------------------------------------ the Pod from the manifest

def test_pod_is_the_daemonsets_template():
    """`mrc-xdp fleet pod` writes the DaemonSet's pod template as a Pod: spec and metadata
    as in the manifest (ports dropped for podman under hostNetwork), the ConfigMap it
    mounts, per node when a node is named, the host config and environment replaced."""
    from mrc_xdp.fleet import kubernetes as K
    docs = [d for d in yaml.safe_load_all(open(MANIFEST)) if d]
    ds = next(d for d in docs if d["kind"] == "DaemonSet")
    tmpl = ds["spec"]["template"]
    # what the agent needs from the node, as the issue names it (Cilium's way)
    spec = tmpl["spec"]
    c = spec["containers"][0]
    assert spec["hostNetwork"] is True and c["securityContext"]["privileged"] is True
    mounts = {m["mountPath"]: m for m in c["volumeMounts"]}
    vols = {v["name"]: v for v in spec["volumes"]}
    assert mounts["/sys/fs/bpf"]["mountPropagation"] == "Bidirectional"
    assert vols[mounts["/sys/fs/bpf"]["name"]]["hostPath"]["path"] == "/sys/fs/bpf"
    assert vols[mounts["/run/mrc-xdp"]["name"]]["hostPath"]["path"] == "/run/mrc-xdp"
    assert "configMap" in vols[mounts["/etc/mrc-xdp"]["name"]]

    plain = K.pod_documents(MANIFEST)
    assert [d["kind"] for d in plain] == ["ConfigMap", "Pod"]
    pod = plain[-1]
    assert pod["metadata"]["name"] == ds["metadata"]["name"]
    assert pod["metadata"]["labels"] == tmpl["metadata"]["labels"]
    assert pod["metadata"]["annotations"] == tmpl["metadata"]["annotations"]
    want = json.loads(json.dumps(spec))
    for cc in want["containers"]:
        cc.pop("ports", None)
    assert pod["spec"] == want
    assert K.pod_documents(MANIFEST, podman=False)[-1]["spec"] == spec
    assert plain[0] == next(d for d in docs if d["kind"] == "ConfigMap")

    cfg = 'instance = "x"\n'
    node = K.pod_documents(MANIFEST, image="localhost/other:1", host_config=cfg, node="n1",
                           env={"MRC_NETNS": "n1", "MRC_METRICS_LISTEN": "127.0.0.1:1"})
    cm, pod = node
    assert cm["metadata"]["name"] == "mrc-xdp-host-config-n1" and cm["data"]["host.toml"] == cfg
    assert pod["metadata"]["name"] == "mrc-xdp-n1"
    assert [v["configMap"]["name"] for v in pod["spec"]["volumes"] if "configMap" in v] == [cm["metadata"]["name"]]
    env = {e["name"]: e["value"] for e in pod["spec"]["containers"][0]["env"]}
    assert env["MRC_NETNS"] == "n1" and env["MRC_METRICS_LISTEN"] == "127.0.0.1:1"
    assert env["MRC_HOST_CONFIG"] == "/etc/mrc-xdp/host.toml"
    assert pod["spec"]["containers"][0]["image"] == "localhost/other:1"
    # the text round-trips (the host config as a literal block)
    assert list(yaml.safe_load_all(K.dump(node))) == node
    assert "host.toml: |" in K.dump(node).replace("|-", "|")


def test_pod_cli_errors(tmp_path):
    bad = tmp_path / "bad.yaml"
    bad.write_text("kind: ConfigMap\n")
    for args, want in ((["--daemonset", str(tmp_path / "none.yaml")], "No such file"),
                       (["--daemonset", str(bad)], "expected one DaemonSet, found 0"),
                       (["--env", "NOEQUALS"], "expected NAME=VALUE"),
                       (["--lab-host", "h0", "--prefix", "nolab%s-" % uuid.uuid4().hex[:4]], "")):
        p = H.cli("fleet", "pod", *args, check=False)
        assert p.returncode == 1, (args, p.stdout, p.stderr)
        lines = p.stderr.strip().splitlines()
        assert len(lines) == 1 and lines[0].startswith("mrc-xdp fleet: ") and want in lines[0], (args, p.stderr)


# ------------------------------------------------------------------ the pod under podman

@pytest.fixture(scope="module")
def image():
    """The agent image of this checkout (scripts/k8s-setup.sh: installs podman, runc and
    debootstrap if missing, builds the base once, rebuilds the sources' layer)."""
    if os.geteuid() != 0:
        pytest.skip("podman, bpffs and the lab need root")
    t = time.monotonic()
    try:
        p = subprocess.run(["bash", SETUP], capture_output=True, text=True, timeout=SETUP_TIMEOUT,
                           env=dict(os.environ, MRC_K8S_IMAGE=IMAGE))
    except subprocess.TimeoutExpired:
        pytest.fail("scripts/k8s-setup.sh took over %d s (log: /var/log/mrc-xdp-k8s-setup.log)" % SETUP_TIMEOUT,
                    pytrace=False)
    assert p.returncode == 0, (p.stdout[-2000:], p.stderr[-3000:])
    print("k8s-setup: %.0f s\n%s" % (time.monotonic() - t, p.stdout.strip()))
    assert podman("image", "exists", IMAGE, check=False).returncode == 0
    return IMAGE


@pytest.fixture(scope="module")
def lab():
    from mrc_xdp.datapath import loader
    from mrc_xdp.lab import fabric, topology
    prefix = "k8%s-" % uuid.uuid4().hex[:4]
    tmp = tempfile.mkdtemp(prefix="mrc-k8s-")
    try:
        fabric.up(topology.load(mode="srv6"), prefix=prefix)
        yield {"prefix": prefix, "tmp": tmp}
    finally:
        for h in ("h0", "h1", "h2", "h3"):
            loader.unload(prefix + h, quiet_missing=True)
        fabric.down(prefix)
        shutil.rmtree(tmp, ignore_errors=True)


def _xdp_progs(ns: str) -> list[str]:
    """Names of the XDP programs attached in ns, one per attachment, sorted."""
    out = subprocess.run(["ip", "-n", ns, "-d", "link", "show"], capture_output=True, text=True, check=True).stdout
    return sorted(l.split()[4] for l in out.splitlines() if l.strip().startswith("prog/xdp"))


class Pod:
    """One lab host's agent pod: its YAML from `mrc-xdp fleet pod --lab-host`, a free
    metrics port, the names podman gives it."""

    def __init__(self, lab, host: str, image: str):
        from mrc_xdp.datapath.maps import PIN_ROOT, STATE_DIR
        self.inst = self.ns = lab["prefix"] + host
        self.listen = "127.0.0.1:%d" % _free_port()
        self.yaml = os.path.join(lab["tmp"], "pod-%s.yaml" % host)
        out = H.cli("fleet", "pod", "--lab-host", host, "--prefix", lab["prefix"], "--image", image,
                    "--env", "MRC_METRICS_LISTEN=" + self.listen, "-o", self.yaml).stdout
        assert "Pod mrc-xdp-%s" % self.inst in out, out
        docs = list(yaml.safe_load_all(open(self.yaml)))
        self.name = docs[-1]["metadata"]["name"]
        self.agent = self.name + "-agent"
        self.cm = docs[0]["metadata"]["name"]
        self.env = {e["name"]: e["value"] for e in docs[-1]["spec"]["containers"][0]["env"]}
        self.sock = self.env["MRC_XDP_DAEMON_SOCKET"]
        assert self.env["MRC_NETNS"] == self.ns and self.sock.startswith("/run/mrc-xdp/")
        self.pins = os.path.join(PIN_ROOT, self.inst)
        self.state = os.path.join(STATE_DIR, self.inst + ".json")

    def logs(self) -> str:
        return podman("logs", self.agent, check=False).stderr

    def play(self, timeout: float = 240) -> tuple[float, float]:
        """kube play, then wait for mrc_daemon_up 1 on the endpoint: (play s, up s)."""
        t0 = time.monotonic()
        podman("kube", "play", self.yaml)
        t_play = time.monotonic() - t0
        while time.monotonic() - t0 < timeout:
            text = _scrape(self.listen)
            if text and 'mrc_daemon_up{mrc_instance="%s"} 1.0' % self.inst in text:
                return t_play, time.monotonic() - t0
            st = podman("pod", "inspect", self.name, "--format", "{{.State}}", check=False).stdout.strip()
            assert st in ("Running", "Degraded", ""), (st, self.logs()[-3000:])
            time.sleep(0.5)
        raise AssertionError(("no mrc_daemon_up 1 in %d s" % timeout, self.logs()[-3000:]))

    def status(self) -> dict:
        return json.loads(H.cli("status", "-i", self.inst, "--json").stdout)[0]

    def stop(self) -> float:
        """SIGTERM (podman 4.3's `kube down` kills at once: docs/fleet.md), then delete."""
        t = time.monotonic()
        podman("pod", "stop", "-t", "30", self.name)
        dt = time.monotonic() - t
        assert "mrc-xdp-agent: datapath %s unloaded" % self.inst in self.logs(), self.logs()[-3000:]
        assert podman("inspect", self.agent, "--format", "{{.State.ExitCode}}").stdout.strip() == "0"
        podman("kube", "down", self.yaml)
        podman("volume", "rm", self.cm)
        return dt

    def cleanup(self):
        podman("pod", "stop", "-t", "30", self.name, check=False)
        podman("kube", "down", self.yaml, check=False)
        podman("volume", "rm", "-f", self.cm, check=False)

    def assert_gone(self):
        """No pod, container or volume; no datapath, state file, XDP program or socket."""
        assert podman("pod", "exists", self.name, check=False).returncode != 0
        assert podman("volume", "exists", self.cm, check=False).returncode != 0
        assert not podman("ps", "-a", "--filter", "name=" + self.name, "-q").stdout.strip()
        from mrc_xdp.datapath import maps
        assert self.inst not in maps.instances()
        p = H.cli("status", "-i", self.inst, "--json", check=False)    # (not every instance: other
        assert p.returncode == 1 and "is not loaded" in p.stderr, p      # users' come and go meanwhile)
        assert not os.path.exists(self.pins) and not os.path.exists(self.state)
        assert _xdp_progs(self.ns) == []
        assert not os.path.exists(self.sock)
        assert _scrape(self.listen) is None


def test_agent_pod_on_lab_host(image, lab):
    """The DaemonSet's pod template under `podman kube play` on lab host h0: the agent
    loads the datapath into h0's namespace and runs the daemon and the endpoint; the host
    sees the instance (`status --json`, the pins, XDP on h0's devices, mrc_daemon_up 1);
    the pod stopped and deleted unloads it and leaves nothing."""
    pod = Pod(lab, "h0", image)
    # before: the lab's link model on h0's plane NICs (the load replaces it), no datapath
    assert not os.path.exists(pod.pins) and set(_xdp_progs(pod.ns)) <= {"mrc_link"}
    try:
        t0 = time.monotonic()
        t_play, up = pod.play()
        print("kube play returned in %.1f s; datapath loaded, daemon and endpoint up at %.1f s" % (t_play, up))
        assert "mrc-xdp-agent: datapath %s loaded from /etc/mrc-xdp/host.toml in netns %s" % (pod.inst, pod.ns) \
            in pod.logs()
        # visible from the host
        s = pod.status()
        assert s["instance"] == pod.inst and s["netns"] == pod.ns and s["mode"] == "srv6"
        assert s["config_path"] == "/etc/mrc-xdp/host.toml"      # the ConfigMap, inside the pod
        assert [c["peer"] for c in s["connections"]] == ["fd00:100::2", "fd00:100::3", "fd00:100::4"]
        assert sum(s["active_evs_by_state"].values()) == 48, s["active_evs_by_state"]
        assert s["plane_rotation"] and all(r["in_rotation"] for r in s["plane_rotation"])
        assert {"prog_spray", "prog_ingress", "prog_engine", "mrc_evs"} <= set(os.listdir(pod.pins))
        assert _xdp_progs(pod.ns) == ["mrc_ingress", "mrc_ingress", "mrc_spray", "mrc_to_engine"]
        assert os.path.exists(pod.sock)
        assert 'mrc_daemon_up{mrc_instance="%s"} 1.0' % pod.inst in _scrape(pod.listen)
        # deleted
        t_stop = pod.stop()
        print("pod stop (unload) %.1f s, total %.1f s" % (t_stop, time.monotonic() - t0))
    finally:
        pod.cleanup()
    pod.assert_gone()
    assert not os.path.exists(os.path.dirname(pod.sock))     # the directory the agent made for it


def test_killed_agent_is_replaced_by_the_next_pod(image, lab):
    """A pod killed (SIGKILL: no unload) leaves its datapath loaded; the node's next pod
    loads over it (`load --force`), runs, and unloads it when deleted."""
    pod = Pod(lab, "h1", image)
    made, d = [], os.path.dirname(pod.sock)
    while not os.path.isdir(d):
        made.insert(0, d)
        d = os.path.dirname(d)
    try:
        pod.play()
        first = pod.status()
        podman("pod", "kill", "--signal", "KILL", pod.name)
        podman("kube", "down", pod.yaml)
        assert os.path.exists(pod.pins) and pod.status()["prog_ids"] == first["prog_ids"]
        assert _scrape(pod.listen) is None
        pod.play()
        second = pod.status()
        assert second["loaded_at"] > first["loaded_at"] and second["prog_ids"] != first["prog_ids"]
        assert _xdp_progs(pod.ns) == ["mrc_ingress", "mrc_ingress", "mrc_spray", "mrc_to_engine"]
        pod.stop()
    finally:
        pod.cleanup()
    pod.assert_gone()
    # the killed pod's agent could not remove the directories it made for the socket; the
    # second found them there
    for d in reversed(made):
        with contextlib.suppress(OSError):
            os.rmdir(d)
