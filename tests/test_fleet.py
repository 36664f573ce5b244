"""Tier 2: the fleet tools (deploy/ansible, deploy/prometheus, mrc_xdp.fleet) on the netns
lab's 4 hosts, with real ansible-playbook and Prometheus processes.

One lab per module, fabric only (`lab up --no-hosts`): the deploy playbook loads the
datapaths.  ``deployed`` runs deploy.yml unless every host is already deployed (so no
test depends on another having run); ``prom`` runs Prometheus (extracted from Debian's
package by scripts/fleet-setup.sh) on 127.0.0.1 with the config mrc_xdp.fleet.prometheus
generates.  The unload test runs last; the module's teardown stops every process the
role started (by pid file), unloads, and takes the lab down whatever happened.
"""
from __future__ import annotations

import json
import os
import re
import shutil
import signal
import socket
import subprocess
import sys
import tempfile
import threading
import time
import urllib.parse
import urllib.request
import uuid

import pytest

import health_lab as H

pytestmark = pytest.mark.skipif(os.geteuid() != 0, reason="the lab needs root")

ROOT = H.ROOT
ANSIBLE = os.path.join(ROOT, "deploy", "ansible")
PLAYBOOK = os.path.join(ROOT, ".venv", "bin", "ansible-playbook")
PROM_DIR = "/var/cache/mrc-xdp/prometheus/usr/bin"
RULES = os.path.join(ROOT, "deploy", "prometheus", "mrc-xdp.rules.yml")
HOSTS = ("h0", "h1", "h2", "h3")
RECAP = re.compile(r"^(\S+)\s*:\s*ok=(\d+)\s+changed=(\d+)\s+unreachable=(\d+)\s+failed=(\d+)", re.M)


def _free_base(n: int) -> int:
    """A port p with p..p+n-1 free on 127.0.0.1."""
    import random
    for _ in range(200):
        base = random.randrange(20000, 40000)
        socks = []
        try:
            for i in range(n):
                s = socket.socket()
                s.bind(("127.0.0.1", base + i))
                socks.append(s)
            return base
        except OSError:
            continue
        finally:
            for s in socks:
                s.close()
    raise RuntimeError("no free ports")


@pytest.fixture(scope="module")
def lab():
    from mrc_xdp.datapath import loader
    from mrc_xdp.fleet import inventory
    from mrc_xdp.lab import fabric, topology
    from mrc_xdp.lab import linkmodel as lmod
    if not os.access(PLAYBOOK, os.X_OK):
        pytest.fail("%s is missing: run scripts/setup.sh (it installs ansible-core)" % PLAYBOOK, pytrace=False)
    prefix = "fl%s-" % uuid.uuid4().hex[:4]
    tmp = tempfile.mkdtemp(prefix="mrc-fleet-")
    lm = None
    try:
        st = fabric.up(topology.load(mode="srv6"), prefix=prefix)
        lm = lmod.LinkModel.open(st["pin_dir"])
        inv = inventory.lab_inventory(prefix, state_dir=os.path.join(tmp, "hosts"), metrics_port=_free_base(4))
        path = os.path.join(tmp, "inventory.json")
        inventory.write(inv, path)
        yield {"prefix": prefix, "tmp": tmp, "inv": inv, "inv_path": path, "topo": fabric.topology_of(st),
               "lm": lm, "hosts": inventory.hosts_of(inv)}
    finally:
        bg = os.path.join(ANSIBLE, "roles", "mrc_xdp", "files", "mrc-xdp-bg")
        for h in HOSTS:
            for svc in ("metrics", "daemon"):
                pid = os.path.join(tmp, "hosts", h, svc + ".pid")
                if os.path.exists(pid):
                    subprocess.run([bg, "stop", pid], capture_output=True, timeout=30)
            loader.unload(prefix + h, quiet_missing=True)
        if lm is not None:
            lm.close()
        fabric.down(prefix)
        shutil.rmtree(tmp, ignore_errors=True)


def play(lab, playbook: str, *extra: str, check: bool = True, timeout: float = 180) -> dict:
    """Run a playbook on the lab's inventory; {"out", "rc", "recap": {host: (ok, changed, unreachable, failed)}}."""
    env = dict(os.environ, ANSIBLE_CONFIG=os.path.join(ANSIBLE, "ansible.cfg"), ANSIBLE_NOCOLOR="1",
               ANSIBLE_LOCAL_TEMP=os.path.join(lab["tmp"], "ansible-local"),
               ANSIBLE_HOME=os.path.join(lab["tmp"], "ansible-home"))
    t = time.monotonic()
    p = subprocess.run([PLAYBOOK, "-i", lab["inv_path"], os.path.join(ANSIBLE, playbook), *extra],
                       capture_output=True, text=True, timeout=timeout, env=env)
    recap = {m[0]: tuple(int(x) for x in m[1:]) for m in RECAP.findall(p.stdout)}
    if check:
        fatal = [l for l in p.stdout.splitlines() if l.startswith(("fatal:", "failed:", "ERROR", "[ERROR]"))]
        assert p.returncode == 0, (playbook, p.returncode, fatal[:4] or p.stdout[-3000:], p.stderr[-2000:])
    return {"out": p.stdout, "err": p.stderr, "rc": p.returncode, "recap": recap, "s": time.monotonic() - t}


def status(lab, host: str):
    p = H.cli("status", "-i", lab["prefix"] + host, "--json", check=False)
    return json.loads(p.stdout) if p.returncode == 0 else None


def _deployed(lab) -> bool:
    from mrc_xdp.datapath import maps
    loaded = maps.instances()
    for h in HOSTS:
        if lab["prefix"] + h not in loaded:
            return False
        for svc in ("daemon", "metrics"):
            try:
                with open(os.path.join(lab["tmp"], "hosts", h, svc + ".pid")) as f:
                    pid, start = f.read().split("\n")[:2]
            except OSError:
                return False
            if not _same_start(int(pid), start):
                return False
    return True


def _same_start(pid: int, start: str) -> bool:
    try:
        with open("/proc/%d/stat" % pid) as f:
            return f.read().rsplit(")", 1)[1].split()[19] == start
    except OSError:
        return False


@pytest.fixture
def deployed(lab):
    """The fleet deployed (deploy.yml run now unless every host is deployed already)."""
    if not _deployed(lab):
        lab["first_deploy"] = play(lab, "deploy.yml")
    return lab


@pytest.fixture(scope="module")
def prom(lab):
    """Prometheus on 127.0.0.1 scraping every host of the inventory every second, with the
    rules and the console templates of deploy/prometheus."""
    from mrc_xdp.fleet import prometheus
    binary = os.path.join(PROM_DIR, "prometheus")
    if not os.access(binary, os.X_OK):
        pytest.fail("%s is missing: run scripts/fleet-setup.sh" % binary, pytrace=False)
    d = os.path.join(lab["tmp"], "prometheus")
    os.makedirs(d)
    res = prometheus.scrape_config(lab["inv"], [RULES], interval="1s")
    prometheus.write_json(res["config"], os.path.join(d, "prometheus.yml"))
    port = _free_base(1)
    log = open(os.path.join(d, "log"), "w")
    p = subprocess.Popen([binary, "--config.file=" + os.path.join(d, "prometheus.yml"),
                          "--web.listen-address=127.0.0.1:%d" % port, "--storage.tsdb.path=" + os.path.join(d, "data"),
                          "--web.console.templates=" + os.path.join(ROOT, "deploy", "prometheus", "consoles"),
                          "--web.console.libraries=" + os.path.join(ROOT, "deploy", "prometheus", "console_libraries")],
                         stdout=log, stderr=subprocess.STDOUT)
    url = "http://127.0.0.1:%d" % port
    try:
        assert H.wait_for(lambda: _get(url + "/-/ready", ok_only=True), 20, 0.2), open(log.name).read()[-2000:]
        yield {"url": url, "targets": res["targets"]}
    finally:
        p.send_signal(signal.SIGTERM)
        try:
            p.wait(10)
        except subprocess.TimeoutExpired:
            p.kill()
            p.wait()
        log.close()


def _get(url: str, ok_only: bool = False):
    try:
        with urllib.request.urlopen(url, timeout=5) as r:
            body = r.read().decode()
            return True if ok_only else body
    except OSError:
        return None if ok_only else ""


def query(prom, expr: str) -> list:
    body = _get(prom["url"] + "/api/v1/query?" + urllib.parse.urlencode({"query": expr}))
    return json.loads(body)["data"]["result"] if body else []


# ------------------------------------------------------------------ the library

def test_inventory_of_lab(lab):
    """4 hosts, local connection, one namespace and one metrics port each; a lab that is
    not up is one line (FleetError)."""
    from mrc_xdp.fleet import FleetError, inventory
    hs = lab["hosts"]
    assert sorted(hs) == [lab["prefix"] + h for h in HOSTS]
    assert {v["ansible_connection"] for v in hs.values()} == {"local"}
    assert sorted(v["mrc_xdp_netns"] for v in hs.values()) == sorted(hs)
    assert len({v["mrc_xdp_metrics_target"] for v in hs.values()}) == 4
    assert all(len(v["mrc_xdp_connections"]) == 3 for v in hs.values())
    # deterministic: the same lab gives the same inventory (the role's idempotence rests on it)
    again = inventory.lab_inventory(lab["prefix"], state_dir=os.path.join(lab["tmp"], "hosts"),
                                    metrics_port=int(hs[lab["prefix"] + "h0"]["mrc_xdp_metrics_target"].split(":")[1]))
    assert again == lab["inv"]
    with pytest.raises(FleetError, match=r"is not up .*lab up") as e:
        inventory.lab_inventory("nolab%s-" % uuid.uuid4().hex[:4])
    assert "\n" not in str(e.value)
    p = subprocess.run([sys.executable, "-m", "mrc_xdp.cli", "lab", "inventory", "--prefix", "bad prefix"],
                       capture_output=True, text=True)
    assert p.returncode == 1 and p.stderr.count("\n") == 1 and "prefix" in p.stderr, p.stderr


def test_inventory_of_vm_lab_state(tmp_path):
    """A QEMU VM lab's inventory, from its state file (no VM needed: the state of a lab
    that is up is written here): every host over SSH to 127.0.0.1 on its VM's forwarded
    sshd port as root with the lab's key, the guest's checkout, background services,
    its metrics endpoint forwarded to 127.0.0.1 (the metrics_port of the plan, which
    qemu_argv forwards to the guest's 9417; switches get none); Ansible reads it
    (ansible-inventory), the playbooks parse against it (--syntax-check), and the
    Prometheus config scrapes both guests."""
    from mrc_xdp.fleet import inventory, prometheus
    from mrc_xdp.lab import topology, vm
    topo = topology.from_dict({"name": "vmci", "mode": "srv6", "planes": 2, "t0_per_plane": 1, "t1_per_plane": 0,
                               "hosts": [{"name": "h0", "t0": 0}, {"name": "h1", "t0": 0}]})
    prefix = "fv%s-" % uuid.uuid4().hex[:4]
    pl = vm.plan(topo, prefix, base_port=31000)
    st = {"prefix": prefix, "target": "qemu", "complete": True, "topology": topo.to_dict(),
          "topology_source": "", "plan": pl, "ssh_key": "/var/cache/mrc-xdp/vm/id_lab", "created": {}}
    vm._write(st)
    try:
        inv = inventory.lab_inventory(prefix)
    finally:
        os.unlink(vm.state_path(prefix))
    hs = inventory.hosts_of(inv)
    assert sorted(hs) == [prefix + "h0", prefix + "h1"]
    ports = {n: pl["nodes"][n]["ssh_port"] for n in ("h0", "h1")}
    for h in ("h0", "h1"):
        v = hs[prefix + h]
        assert (v["ansible_connection"], v["ansible_host"], v["ansible_port"], v["ansible_user"]) == \
            ("ssh", "127.0.0.1", ports[h], "root"), v
        assert v["ansible_ssh_private_key_file"] == "/var/cache/mrc-xdp/vm/id_lab"
        assert v["mrc_xdp_checkout"] == "/opt/mrc-xdp" and v["mrc_xdp_service_manager"] == "background"
        assert v["mrc_xdp_netns"] == "" and v["mrc_xdp_metrics_listen"] == "0.0.0.0:9417"
        assert v["mrc_xdp_metrics_target"] == "127.0.0.1:%d" % pl["nodes"][h]["metrics_port"]
        assert v["mrc_xdp_instance"] == prefix + h and len(v["mrc_xdp_connections"]) == 1
        argv = vm.qemu_argv({"accel": "tcg"}, pl["nodes"][h], "/tmp", vm.image())
        assert "hostfwd=tcp:127.0.0.1:%d-:9417" % pl["nodes"][h]["metrics_port"] in " ".join(argv)
    assert "metrics_port" not in pl["nodes"]["p0t0s0"]
    mports = [pl["nodes"][h]["metrics_port"] for h in ("h0", "h1")]
    others = [c["local_port"] for n in pl["nodes"].values() for c in n["nics"]] + \
        [n["ssh_port"] for n in pl["nodes"].values()]
    assert len(set(mports)) == 2 and not set(mports) & set(others)
    path = str(tmp_path / "inv.json")
    inventory.write(inv, path)
    env = dict(os.environ, ANSIBLE_CONFIG=os.path.join(ANSIBLE, "ansible.cfg"), ANSIBLE_NOCOLOR="1",
               ANSIBLE_HOME=str(tmp_path / "ansible-home"))
    p = subprocess.run([os.path.join(ROOT, ".venv", "bin", "ansible-inventory"), "-i", path, "--list"],
                       capture_output=True, text=True, timeout=120, env=env)
    assert p.returncode == 0, p.stderr
    got = json.loads(p.stdout)
    assert sorted(got["mrc_xdp"]["hosts"]) == sorted(hs)
    assert got["_meta"]["hostvars"][prefix + "h1"]["ansible_port"] == ports["h1"]
    for pb in ("deploy.yml", "plane-drain.yml", "plane-return.yml", "unload.yml"):
        p = subprocess.run([PLAYBOOK, "-i", path, "--syntax-check", os.path.join(ANSIBLE, pb)],
                           capture_output=True, text=True, timeout=120, env=env)
        assert p.returncode == 0, (pb, p.stdout[-1000:], p.stderr[-1000:])
    res = prometheus.scrape_config(inv)
    assert sorted(t["targets"][0] for t in res["config"]["scrape_configs"][0]["static_configs"]) == \
        sorted("127.0.0.1:%d" % m for m in mports) and not res["skipped"]


def test_prometheus_config_of_inventory(lab):
    """One target per host with a metrics target, labelled with its host; hosts without one
    (VM guests) are listed as skipped; file_sd and bad arguments; the CLI writes both files."""
    from mrc_xdp.fleet import FleetError, prometheus
    res = prometheus.scrape_config(lab["inv"], [RULES], interval="2s")
    sc = res["config"]["scrape_configs"][0]
    assert sorted(t["labels"]["mrc_host"] for t in sc["static_configs"]) == list(HOSTS) and not res["skipped"]
    assert res["config"]["rule_files"] == [RULES] and sc["scrape_interval"] == "2s"
    inv = json.loads(json.dumps(lab["inv"]))
    inv["all"]["children"]["mrc_xdp"]["hosts"][lab["prefix"] + "h3"]["mrc_xdp_metrics_target"] = None
    res = prometheus.scrape_config(inv, targets_file="/tmp/t.json")
    assert res["skipped"] == [lab["prefix"] + "h3"] and len(res["targets"]) == 3
    assert res["config"]["scrape_configs"][0]["file_sd_configs"][0]["files"] == ["/tmp/t.json"]
    for kw, msg in (({"interval": "5 s"}, "interval '5 s'"), ({"rule_files": ["/nonexistent.yml"]}, "no such file"),
                    ({"job": "a b"}, "job 'a b'")):
        with pytest.raises(FleetError, match=msg):
            prometheus.scrape_config(lab["inv"], **kw)
    out, tg = os.path.join(lab["tmp"], "p.yml"), os.path.join(lab["tmp"], "t.json")
    p = subprocess.run([sys.executable, "-m", "mrc_xdp.cli", "fleet", "prometheus-config", "-i", lab["inv_path"],
                        "--rules", RULES, "--targets", tg, "-o", out], capture_output=True, text=True)
    assert p.returncode == 0, p.stderr
    p = subprocess.run([os.path.join(PROM_DIR, "promtool"), "check", "config", out], capture_output=True, text=True)
    assert p.returncode == 0, (p.stdout, p.stderr)
    with open(tg) as f:
        assert len(json.load(f)) == 4


# ------------------------------------------------------------------ deploy

def test_deploy_loads_every_host_and_is_idempotent(deployed):
    """status --json on every host: the datapath loaded in its namespace with its 3
    connections; the config the role wrote is the inventory's; a second run changed=0."""
    from mrc_xdp.datapath.config import HostConfig
    from mrc_xdp.fleet import inventory
    lab = deployed
    first = lab.get("first_deploy")
    if first is not None:
        assert all(first["recap"][lab["prefix"] + h][1] > 0 for h in HOSTS), first["recap"]
    for h in HOSTS:
        s = status(lab, h)
        assert s and s[0]["instance"] == lab["prefix"] + h, s
        assert s[0]["netns"] == lab["prefix"] + h and len(s[0]["connections"]) == 3
        assert s[0]["active_evs_by_state"] == {"GOOD": 48}, s[0]["active_evs_by_state"]
        path = os.path.join(lab["tmp"], "hosts", h, "host.toml")
        want = HostConfig.from_dict(inventory.config_of(lab["hosts"][lab["prefix"] + h]))
        assert HostConfig.from_toml(path) == want
    again = play(lab, "deploy.yml")
    assert set(again["recap"]) >= {lab["prefix"] + h for h in HOSTS}
    assert all(r[1] == 0 and r[3] == 0 for r in again["recap"].values()), again["recap"]


# ------------------------------------------------------------------ Prometheus

def test_prometheus_scrapes_every_host(deployed, prom):
    """All targets up, per-host series present (EV states, planes, the daemon following
    its instance, probe RTTs); the rules load and pass promtool; the console page renders."""
    lab = deployed
    want = {h for h in HOSTS}

    def up():
        r = query(prom, 'up{job="mrc-xdp"} == 1')
        return {x["metric"]["mrc_host"] for x in r} == want
    assert H.wait_for(up, 20, 0.25), query(prom, "up")
    for expr in ('count by (mrc_host) (mrc_ev_state{role="active"})', 'mrc_daemon_up == 1',
                 'count by (mrc_host) (mrc_plane_in_rotation == 1)', 'count by (mrc_host) (mrc_ev_probe_rtt_seconds)'):
        assert H.wait_for(lambda: {x["metric"]["mrc_host"] for x in query(prom, expr)} == want, 20, 0.25), \
            (expr, query(prom, expr))
    r = {x["metric"]["mrc_host"]: float(x["value"][1]) for x in query(prom, 'sum by (mrc_host) (mrc_ev_state{role="active"})')}
    assert r == dict.fromkeys(want, 48.0)
    rules = json.loads(_get(prom["url"] + "/api/v1/rules"))["data"]["groups"][0]["rules"]
    assert {"MrcPlaneOutOfRotation", "MrcEvRetiredRatioHigh", "MrcQpErrors", "MrcDaemonDown",
            "MrcProbeRttOutlier"} <= {x["name"] for x in rules}
    assert all(x["health"] == "ok" for x in rules), [(x["name"], x.get("lastError")) for x in rules]
    for args in (["check", "rules", RULES], ["test", "rules", RULES.replace(".yml", ".test.yml")]):
        p = subprocess.run([os.path.join(PROM_DIR, "promtool"), *args], capture_output=True, text=True,
                           cwd=os.path.dirname(RULES))
        assert p.returncode == 0, (args, p.stdout, p.stderr)
    page = _get(prom["url"] + "/consoles/mrc-xdp.html")
    assert "<h1>mrc-xdp fleet</h1>" in page, page[:2000]
    for h in HOSTS:
        assert "<h2>host %s</h2>" % h in page and ">%s%s<" % (lab["prefix"], h) in page
    assert page.count("in rotation</td>") == 8 and "OUT OF ROTATION" not in page
    assert "error executing template" not in page


# ------------------------------------------------------------------ fleet-wide operations

def _plane_tx(lab) -> dict:
    """{plane: [MRC packets, bytes]} the hosts sent into the fabric (the T0 ends of host links)."""
    out = {}
    for name, rx, tx, _ in lab["topo"].link_ends():
        if tx.node in HOSTS:
            c = lab["lm"].counters(rx.ifindex)
            o = out.setdefault(int(tx.ifname[1:]), [0, 0])
            o[0] += c["mrc_pkts"]
            o[1] += c["bytes"]
    return out


def _delta(before, after):
    return {p: [a - b for a, b in zip(after[p], before[p])] for p in after}


def _endpoints(lab):
    from mrc_xdp import transport
    return {h: transport.Endpoint(lab["prefix"] + h) for h in ("h0", "h2")}


def test_plane_drain_with_traffic_then_return(deployed, prom):
    """plane-drain.yml takes plane 1 out on every host while a transfer runs (it
    completes intact); the "plane out" alert fires for every host; a transfer then sends
    nothing on plane 1 (fabric counters); plane-return.yml restores the split and the
    alert clears."""
    lab = deployed
    eps = _endpoints(lab)
    tl = {"prefix": lab["prefix"], "topo": lab["topo"], "eps": eps}
    try:
        res = {"done": 0}
        stop = threading.Event()

        def bg():       # 8 MiB transfers back to back, each checked by sha256, until the drain is over
            try:
                while not stop.is_set():
                    H.transfer(tl, "h0", "h2", 8 << 20)
                    res["done"] += 1
            except BaseException as e:      # reported below
                res["error"] = e
        th = threading.Thread(target=bg)
        th.start()
        time.sleep(0.3)
        try:
            drain = play(lab, "plane-drain.yml", "-e", "mrc_xdp_plane=1")
        finally:
            stop.set()
            th.join(120)
        assert not th.is_alive() and "error" not in res and res["done"] >= 2, res
        assert all(drain["recap"][lab["prefix"] + h][1] == 1 for h in HOSTS), drain["recap"]
        assert "serial" not in drain["err"]
        for h in HOSTS:
            rot = status(lab, h)[0]["plane_rotation"]
            assert rot[1]["operator_out"] and not rot[1]["in_rotation"] and rot[0]["in_rotation"], rot
        before = _plane_tx(lab)
        H.transfer(tl, "h0", "h2", 16 << 20)
        d = _delta(before, _plane_tx(lab))
        # Nothing on plane 1: a 16 MiB transfer is > 11,000 data packets of > 1,400 bytes
        # (and their SACKs), all on plane 0; the health daemons leave a plane the
        # operator drained alone (no background or resurrection probes of its EVs)
        assert d[0][0] > 11000 and d[0][1] > 16 << 20, d
        assert d[1] == [0, 0], d
        lab["drain_plane_delta"] = d

        def firing():
            r = query(prom, 'ALERTS{alertname="MrcPlaneOutOfRotation",alertstate="firing"}')
            return {x["metric"]["mrc_host"] for x in r if x["metric"]["plane"] == "1"} == set(HOSTS)
        assert H.wait_for(firing, 20, 0.25), query(prom, "ALERTS")
        page = _get(prom["url"] + "/consoles/mrc-xdp.html")
        assert page.count("OUT OF ROTATION") == 4

        ret = play(lab, "plane-return.yml", "-e", "mrc_xdp_plane=1")
        assert all(ret["recap"][lab["prefix"] + h][1] == 1 for h in HOSTS), ret["recap"]
        before = _plane_tx(lab)
        H.transfer(tl, "h0", "h2", 16 << 20)
        d = _delta(before, _plane_tx(lab))
        d0, d1 = d[0][1], d[1][1]          # bytes: the planes share the transfer again
        assert d1 > 0.35 * (d0 + d1) and d0 > 0.35 * (d0 + d1), d
        assert H.wait_for(lambda: not query(prom, 'ALERTS{alertname="MrcPlaneOutOfRotation"}'), 20, 0.25), \
            query(prom, "ALERTS")
    finally:
        from mrc_xdp.datapath.maps import Instance
        for ep in eps.values():
            ep.close()
        for h in HOSTS:                 # every plane back in rotation, whatever happened
            with Instance(lab["prefix"] + h) as inst:
                inst.set_plane_out(1, False)


def test_plane_drain_refuses_bad_input(deployed):
    """A plane that does not exist: the playbook fails before changing anything."""
    lab = deployed
    r = play(lab, "plane-drain.yml", "-e", "mrc_xdp_plane=7", check=False)
    assert r["rc"] != 0 and "plane 7: no such plane (2 planes)" in r["out"], r["out"][-2000:]
    r = play(lab, "plane-drain.yml", "-e", "mrc_xdp_plane=x", "--limit", lab["prefix"] + "h0", check=False)
    assert r["rc"] != 0 and "give the plane: -e mrc_xdp_plane=N" in r["out"], r["out"][-2000:]
    assert all(not p["operator_out"] for h in HOSTS for p in status(lab, h)[0]["plane_rotation"])


def test_ev_denylist_denies_everywhere_then_allows(deployed):
    """Two EVs of every host's first connection in one list: ev-denylist.yml denies each
    where it is (8 changes), allow returns them to GOOD."""
    from mrc_xdp.datapath.maps import Instance
    lab = deployed
    picked = {}
    for h in HOSTS:
        with Instance(lab["prefix"] + h) as inst:
            rows = [r for r in inst.ev_table() if r["role"] == "active" and r["conn"] == 0]
        picked[h] = {r["ev"] for r in rows[:2]}
    path = os.path.join(lab["tmp"], "deny.txt")
    with open(path, "w") as f:
        f.write("# EVs to keep out of service\n\n")
        for h in HOSTS:
            f.write("".join("%#010x   # %s\n" % (ev, h) for ev in sorted(picked[h])))
    r = play(lab, "ev-denylist.yml", "-e", "mrc_xdp_denylist=" + path)
    assert sum(r["recap"][lab["prefix"] + h][1] for h in HOSTS) == 1 * 4, r["recap"]   # one loop task per host
    for h in HOSTS:
        with Instance(lab["prefix"] + h) as inst:
            denied = {x["ev"] for x in inst.ev_table() if x["state"] == "DENIED"}
        assert denied == picked[h], (h, denied, picked[h])
    play(lab, "ev-denylist.yml", "-e", "mrc_xdp_denylist=" + path, "-e", "mrc_xdp_ev_action=allow")
    for h in HOSTS:
        with Instance(lab["prefix"] + h) as inst:
            assert {x["state"] for x in inst.ev_table() if x["ev"] in picked[h]} == {"GOOD"}


def test_denylist_format():
    """The role's deny-list parser: EVs in hex or decimal, comments; a bad line is one error naming it."""
    sys.path.insert(0, os.path.join(ANSIBLE, "roles", "mrc_xdp", "filter_plugins"))
    try:
        import mrc_xdp as _  # noqa: F401  (the package, not the plugin: the plugin is loaded by path)
        import importlib.util
        spec = importlib.util.spec_from_file_location(
            "mrc_xdp_filters", os.path.join(ANSIBLE, "roles", "mrc_xdp", "filter_plugins", "mrc_xdp.py"))
        mod = importlib.util.module_from_spec(spec)
        spec.loader.exec_module(mod)
    finally:
        sys.path.pop(0)
    assert mod.mrc_xdp_denylist("0x10 # a\n\n  17\n# c\n0x10\n") == [16, 17]
    with pytest.raises(Exception, match=r"deny-list line 2: 'zz' is not an EV"):
        mod.mrc_xdp_denylist("1\nzz\n")
    with pytest.raises(Exception, match=r"line 1: 0x1ffffffff does not fit in 32 bits"):
        mod.mrc_xdp_denylist("0x1ffffffff")
    assert mod.mrc_xdp_toml({"a": [1, "x"], "b": True}) == '{a = [1, "x"], b = true}'


def test_collect_status_report(deployed):
    """collect-status.yml: one JSON report with every host's status --json."""
    lab = deployed
    out = os.path.join(lab["tmp"], "status.json")
    play(lab, "collect-status.yml", "-e", "mrc_xdp_report=" + out)
    with open(out) as f:
        rep = json.load(f)
    assert sorted(rep["hosts"]) == sorted(lab["hosts"]) and rep["unreachable"] == [] and rep["errors"] == {}
    for name, sts in rep["hosts"].items():
        assert sts[0]["instance"] == name and len(sts[0]["connections"]) == 3
        assert rep["summary"][name]["connections"] == 3 and rep["summary"][name]["planes_out"] == []


# ------------------------------------------------------------------ unload (last)

def test_unload_leaves_nothing(deployed):
    """unload.yml: every datapath unloaded (no pins, no state), the daemon and the metrics
    endpoint stopped, the role's files gone."""
    from mrc_xdp.datapath import maps
    lab = deployed
    pids = []
    for h in HOSTS:
        for svc in ("daemon", "metrics"):
            with open(os.path.join(lab["tmp"], "hosts", h, svc + ".pid")) as f:
                pids.append(int(f.readline()))
    r = play(lab, "unload.yml")
    assert all(r["recap"][lab["prefix"] + h][1] > 0 for h in HOSTS), r["recap"]
    assert not [n for n in maps.instances() if n.startswith(lab["prefix"])]
    for h in HOSTS:
        inst = lab["prefix"] + h
        assert not os.path.exists(os.path.join(maps.PIN_ROOT, inst))
        assert not os.path.exists(os.path.join(maps.STATE_DIR, inst + ".json"))
        assert not os.path.exists(os.path.join(lab["tmp"], "hosts", h)), os.listdir(os.path.join(lab["tmp"], "hosts", h))
    assert H.wait_for(lambda: not [p for p in pids if os.path.exists("/proc/%d" % p)], 5), pids
