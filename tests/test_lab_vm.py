"""Tier 3: the lab on virtual machines (mrc_xdp.lab.vm), really run under QEMU (TCG).

- the rendered VM topology (the JSON vagrant/Vagrantfile reads) is the netns lab's:
  same nodes, NIC names and MACs, links pairing the same ends; `vagrant validate` takes it;
- a small VM lab (2 hosts, one switch per plane, 2 planes: 4 VMs, plain QEMU, the cached
  guest image) configured by the lab's own code over SSH: each VM's interfaces,
  addresses and routes (with the lab control path) equal a netns lab's built from the same
  topology; a host sprays over both planes (datapath counters, traffic.Sender/Receiver);
  a switch VM fails (frozen) and the sender's datapath retires that plane's EVs;
- two scenarios run on both targets, the netns lab and the QEMU lab (fixture `lab_on`,
  the same topology, node set-up code and executors):
  - the transport engine on the hosts: `mrc-xdp send` / `recv` of a 4 MiB file h0 -> h1
    (TCP bootstrap over the lab control path), verified by sha256, over both planes, then
    again intact with the plane-1 switch failed (netns: its links blackholed; VMs: the
    switch VM frozen; adds ~30-60 s under TCG);
  - `mrc-xdp lab link set` / `lab heal` (the link model in the node that receives on the
    end; on VMs changed over SSH): a blackholed end stops pings, the heal restores them;
    `mrc-xdp lab status` shows it (on VMs read in the VMs; ends without a link model named);
  - the path health daemon (`mrc-xdp daemon` on h0 and h1; in the guests on VMs), no data
    traffic: with the plane-1 switch failed its background probes retire every plane-1 EV
    of both hosts' connections (PROBE_FAIL) while plane 0's stay GOOD; after the heal its
    resurrection probes bring them back (PROBE_OK);
- `vagrant up` / `vagrant destroy` of 2 VMs (vagrant-libvirt, a UDP-tunnel link), the
  same node set-up minus bcc, a ping over the link; libvirtd/virtlogd started and stopped.

Everything created (VMs, daemons, bridges, iptables chains, directories, state) is removed
and checked.  The guest image is built on first use (~6-10 min cold, cached afterwards
under /var/cache/mrc-xdp/vm).
"""
import concurrent.futures as cf
import json
import os
import re
import shutil
import subprocess
import sys
import threading
import time

import pytest

from mrc_xdp.lab import ctlpath
from mrc_xdp.lab import fabric, vm
from mrc_xdp.lab import agent
from mrc_xdp.lab.executor import GUEST_PY, GUEST_ROOT, SshNode
from mrc_xdp.lab.hosts import instance_name, qpn
from mrc_xdp.lab.topology import from_dict, load

pytestmark = pytest.mark.skipif(os.geteuid() != 0, reason="needs root (VMs, netns)")

TAG = "%x" % (os.getpid() & 0xFFFF)
CI_TOPO = {"name": "vmci", "mode": "srv6", "planes": 2, "t0_per_plane": 1, "t1_per_plane": 0,
           "hosts": [{"name": "h0", "t0": 0}, {"name": "h1", "t0": 0}]}
SMOKE_TOPO = dict(CI_TOPO, name="vsmoke", planes=1, hosts=[{"name": "h0", "t0": 0}])   # 2 VMs
LM_NODE = "p0t0s0"          # the VM that gets the link model in the CI scenario
LAB_CLI = [os.path.join(os.path.dirname(os.sys.executable), "mrc-xdp"), "lab"]


def say(msg):
    print(msg, flush=True)


# ---------------------------------------------------------------- rendering
def test_render_is_the_netns_topology_and_vagrant_validates(tmp_path, monkeypatch):
    # an empty cache, as on a new machine: what the rendering names (the lab's ssh key)
    # the rendering makes; nothing may come from an image built earlier
    cache = tmp_path / "vmcache"
    monkeypatch.setattr(vm, "CACHE", str(cache))
    monkeypatch.setenv("MRC_VM_CACHE", str(cache))
    topo = load()
    r = vm.render(topo, "rv%s-" % TAG)
    assert r["ssh_key"] == str(cache / "id_lab") and os.path.getsize(r["ssh_key"]) > 0
    key = open(r["ssh_key"] + ".pub").read()
    assert [n["name"] for n in r["nodes"]] == list(topo.nodes)
    ends = {}
    for n in r["nodes"]:
        ports = topo.nodes[n["name"]].ports
        assert [(c["ifname"], c["mac"], c["mtu"], c["peer"]) for c in n["nics"]] == \
            [(p.ifname, p.mac, topo.mtu, p.peer.node) for p in ports]
        assert n["memory"] == (vm.MEM_HOST if n["kind"] == "host" else vm.MEM_SWITCH)
        for c in n["nics"]:
            ends.setdefault(c["link"], []).append((n["name"], c["local_port"], c["remote_port"]))
    # one UDP socket pair per topology link, the two ends pointing at each other
    assert sorted(ends) == sorted(lk.name for lk in topo.links)
    for name, pair in ends.items():
        (a, la, ra), (b, lb, rb) = pair
        assert {a, b} == set(name.split("-")) and (la, ra) == (rb, lb)
    ports = [c["local_port"] for n in r["nodes"] for c in n["nics"]] + [n["ssh_port"] for n in r["nodes"]]
    assert len(ports) == len(set(ports))
    assert r["driver"] in ("qemu", "kvm") and r["accel_reason"]

    # the CLI writes the same rendering; vagrant validates the Vagrantfile with it
    out = tmp_path / "topology.json"
    p = subprocess.run([os.path.join(os.path.dirname(os.sys.executable), "python"), "-m", "mrc_xdp.cli.lab",
                        "lab", "render", "--json", "-o", str(out), "--prefix", "rv%s-" % TAG],
                       capture_output=True, text=True, timeout=60)
    assert p.returncode == 0, p.stderr
    got = json.loads(out.read_text())
    assert [[(c["ifname"], c["mac"]) for c in n["nics"]] for n in got["nodes"]] == \
        [[(c["ifname"], c["mac"]) for c in n["nics"]] for n in r["nodes"]]
    assert got["ssh_key"] == r["ssh_key"] and open(r["ssh_key"] + ".pub").read() == key   # the same key
    if not shutil.which("vagrant"):
        pytest.fail("vagrant is not installed: run `make vm-setup`")
    env = dict(os.environ, VAGRANT_CWD=vm.VAGRANT_DIR, MRC_LAB_JSON=str(out),
               VAGRANT_DOTFILE_PATH=str(tmp_path / ".vagrant"), VAGRANT_CHECKPOINT_DISABLE="1")
    p = subprocess.run(["vagrant", "validate"], env=env, capture_output=True, text=True, timeout=120)
    assert p.returncode == 0 and "validated successfully" in p.stdout, p.stdout + p.stderr
    # and refuses to run without a rendering, in one line
    env["MRC_LAB_JSON"] = str(tmp_path / "missing.json")
    p = subprocess.run(["vagrant", "validate"], env=env, capture_output=True, text=True, timeout=120)
    assert p.returncode != 0 and "mrc-xdp lab render --json" in p.stderr


def test_ci_topology_file():
    """contrib/lab-vmci.toml (the by-hand command of docs/fleet.md) is CI_TOPO."""
    assert load(os.path.join(vm.ROOT, "contrib", "lab-vmci.toml")).to_dict() == from_dict(CI_TOPO).to_dict()


def test_lab_key_is_made_once_by_its_first_users(tmp_path):
    """Four processes needing the lab's key at once on an empty cache (renderings, a
    build) end with one key pair, the private and public halves matching."""
    cache = tmp_path / "vmcache"
    code = "from mrc_xdp.lab import vm; print(vm.lab_key())"
    env = dict(os.environ, MRC_VM_CACHE=str(cache))
    ps = [subprocess.Popen([os.sys.executable, "-c", code], env=env, stdout=subprocess.PIPE, text=True)
          for _ in range(4)]
    got = {p.communicate(timeout=60)[0].strip() for p in ps}
    assert all(p.returncode == 0 for p in ps) and len(got) == 1
    pub = subprocess.run(["ssh-keygen", "-y", "-f", str(cache / "id_lab")], capture_output=True, text=True,
                         check=True).stdout.split()[:2]
    assert (cache / "id_lab.pub").read_text().split()[:2] == pub
    assert sorted(os.listdir(cache)) == [".id_lab.lock", "id_lab", "id_lab.pub"]     # no temporaries


# ---------------------------------------------------------------- the QEMU lab
@pytest.fixture(scope="module")
def vmlab():
    prefix = "mv%s-" % TAG
    topo = from_dict(CI_TOPO)
    t0 = time.monotonic()
    info = vm.build_image(say)
    t_img = time.monotonic() - t0
    t0 = time.monotonic()
    try:
        # the link model on one switch only: every bcc build is 1-4 min of a TCG guest's CPU
        st = vm.qemu_up(topo, prefix, progress=say, linkmodel=[LM_NODE])
        say("timing: image %.0fs (%s), lab up %.0fs (boot %.0fs)"
            % (t_img, "cached" if info.get("cached") else "built", time.monotonic() - t0, st["boot_s"]))
        yield prefix, topo, st
    finally:
        t0 = time.monotonic()
        vm.down(prefix, progress=say)
        say("timing: lab down %.1fs" % (time.monotonic() - t0))
        assert vm.leftovers(prefix) == {"qemu": [], "dirs": [], "state_file": []}


def _links(ex_or_ns, vm_node=True):
    """{ifname: (mac, mtu, [global addresses])} and the IPv6 routes of a node."""
    if vm_node:
        links = json.loads(ex_or_ns.run(["ip", "-j", "addr", "show"]).stdout)
        routes = json.loads(ex_or_ns.run(["ip", "-6", "-j", "route", "show"]).stdout)
    else:
        links = json.loads(subprocess.run(["ip", "-n", ex_or_ns, "-j", "addr", "show"], capture_output=True,
                                          text=True, check=True).stdout)
        routes = json.loads(subprocess.run(["ip", "-n", ex_or_ns, "-6", "-j", "route", "show"],
                                           capture_output=True, text=True, check=True).stdout)
    out = {}
    for ln in links:
        if ln["ifname"] in ("lo", "eth0"):
            continue
        addrs = sorted("%s/%d" % (a["local"], a["prefixlen"]) for a in ln.get("addr_info", [])
                       if a.get("scope") == "global")
        out[ln["ifname"]] = (ln["address"], ln["mtu"], addrs, "UP" in ln["flags"])
    rts = sorted(json.dumps({k: r.get(k) for k in ("dst", "gateway", "dev", "encap", "nexthops")},
                            sort_keys=True) for r in routes if r.get("dev") != "eth0" and "fe80" not in r["dst"])
    return out, rts


def test_vm_nodes_equal_the_netns_lab(vmlab):
    prefix, topo, st = vmlab
    execs = vm.execs_of(st)
    nprefix = "mn%s-" % TAG
    nst = fabric.up(topo, prefix=nprefix)       # the same topology as namespaces (no datapaths)
    try:
        assert ctlpath.lab_control_path(nprefix, topo) == st["control"]
        for node in topo.nodes:
            got_vm = _links(execs[node])
            got_ns = _links(nprefix + node, vm_node=False)
            assert got_vm[0] == got_ns[0], (node, got_vm[0], got_ns[0])
            vm_routes = got_vm[1]
            if nst["un"] == "linkmodel":      # this kernel has no seg6local: uN is the link model's
                un = [r for r in vm_routes if "seg6local" in r]
                assert len(un) == (topo.nodes[node].kind != "host"), (node, un)
                vm_routes = [r for r in vm_routes if r not in un]
            assert vm_routes == got_ns[1], (node, vm_routes, got_ns[1])
            assert got_vm[0], node
    finally:
        fabric.down(nprefix)
    assert fabric.leftovers(nprefix) == {"netns": [], "pins": [], "state_file": []}
    # XDP: the link model on every VM port (native mode on virtio-net), the datapath on hosts
    # XDP in native (driver) mode on virtio-net: the datapath on the hosts' NICs, the link
    # model on the ports of LM_NODE; nothing on the other switch
    for node in topo.nodes:
        n = topo.nodes[node]
        devs = [p.ifname for p in n.ports] + (["mrc0", "mrc0p"] if n.kind == "host" else [])
        for dev in devs:
            j = json.loads(execs[node].run(["ip", "-j", "-d", "link", "show", "dev", dev]).stdout)[0]
            want = n.kind == "host" or node == LM_NODE
            assert (j.get("xdp", {}).get("mode") == 1) == want, (node, dev, j.get("xdp"))
    for h in topo.hosts:
        assert st["hosts"][h.name]["host"]["instance"] == instance_name(prefix, h.name)


def test_guests_share_one_bpf_build(vmlab):
    """bcc compiles each program once for all the VMs (vm.setup_nodes, bpfcache): h1
    loaded h0's datapath build (from its cache, no compile); both guests and the host's
    store of guest builds hold that entry; the link-model node's build is kept too."""
    from mrc_xdp.datapath import bpfcache
    prefix, topo, st = vmlab
    execs = vm.execs_of(st)
    builds = {h: st["hosts"][h]["host"]["build"] for h in ("h0", "h1")}
    assert builds["h1"] == "cache" and builds["h0"] in ("bcc", "cache"), builds
    got = {n: agent.call(execs[n], "bpf_cache_get") for n in ("h0", "h1", LM_NODE)}

    def of(es, base):
        return {k for k in es if k.startswith(base + "-")}
    assert len(of(got["h0"], "mrc_datapath")) >= 1 and of(got["h0"], "mrc_datapath") <= set(got["h1"])
    assert of(got[LM_NODE], "linkmodel")
    store = bpfcache.entries(vm.guest_bpf_cache())
    assert of(got["h0"], "mrc_datapath") | of(got[LM_NODE], "linkmodel") <= set(store)
    say("guest builds: %s; entries h0 %d, h1 %d, %s %d, host store %d"
        % (builds, len(got["h0"]), len(got["h1"]), LM_NODE, len(got[LM_NODE]), len(store)))


def _counters(ex, prefix, host):
    return agent.call(ex, "counters", instance=instance_name(prefix, host))


def test_vm_spray_over_both_planes_then_a_switch_fails(vmlab):
    """(h0's loss threshold is 4 here, not 1: a TCG switch VM stalled for a few hundred ms
    under load makes the frames behind it look lost, and one such stall retired most of
    plane 1's EVs in the healthy phase once ({0: 518, 1: 82}); a dead plane's EVs still
    lose far more than 4 frames each.)"""
    prefix, topo, st = vmlab
    execs = vm.execs_of(st)
    h0, h1 = topo.host("h0"), topo.host("h1")
    saved = agent.call(execs["h0"], "datapath_config", instance=instance_name(prefix, "h0"), changes={"loss_thresh": 4})
    rx_args = dict(local=h1.addr, peer=h0.addr, local_qpn=qpn(1, 0), peer_qpn=qpn(0, 1),
                   expect=10**9, seconds=600, ready="/run/mrc-rx.ready", stop="/run/mrc-rx.stop")
    res = {}

    def receive():
        try:
            res["rx"] = agent.call(execs["h1"], "traffic_receive", **rx_args)
        except Exception as e:
            res["err"] = e
    th = threading.Thread(target=receive, daemon=True)
    th.start()
    try:
        deadline = time.monotonic() + 120
        while execs["h1"].run(["test", "-e", rx_args["ready"]], check=False).returncode:
            assert time.monotonic() < deadline and th.is_alive(), res.get("err", "receiver did not start")
            time.sleep(1)
        n = 600
        t0 = time.monotonic()
        out = agent.call(execs["h0"], "traffic_send", local=h0.addr, peer=h1.addr, dqpn=qpn(1, 0), count=n, pps=200)
        assert out["sent"] == n
        # every frame crossed a switch VM and reached h1's datapath; SACKs came back
        deadline = time.monotonic() + 60
        while True:
            a, b = _counters(execs["h0"], prefix, "h0"), _counters(execs["h1"], prefix, "h1")
            if a["counters"]["ing_sack"] >= n or time.monotonic() > deadline:
                break
            time.sleep(2)
        say("healthy phase: %d frames in %.0fs" % (n, time.monotonic() - t0))
        ca, cb = a["counters"], b["counters"]
        assert ca["spray_tx"] == n and ca["spray_data"] == n
        planes = {}
        for r in a["evs"]:
            planes[r["plane"]] = planes.get(r["plane"], 0) + r["tx_pkts"]
        assert sorted(planes) == [0, 1] and abs(planes[0] - planes[1]) <= 0.1 * n, planes
        assert cb["ing_data"] == n, cb
        assert ca["ing_sack"] == n and ca["ing_fb_no_conn"] == 0, ca
        # (a few EVs may be retired already: TCG timing reorders frames across the planes
        # beyond the datapath's loss_reorder, and those holes count as losses)
        healthy_bad = [r for r in a["evs"] if r["state"] != "GOOD"]
        say("healthy phase: plane split %s, EVs retired by reordering: %d" % (planes, len(healthy_bad)))
        # the link model in the switch VM counted exactly h0's plane-0 frames at port h0
        lc = agent.call(execs[LM_NODE], "link_counters", pin_dir=fabric.pin_dir(prefix), ifnames=["h0", "h1"])
        assert lc["h0"]["mrc_pkts"] == planes[0], (lc, planes)
        assert lc["h1"]["mrc_pkts"] > 0, lc
        # the switch of plane 1 fails (its VM frozen): h0's datapath retires plane 1's EVs
        vm.fail(prefix, "p1t0s0")
        try:
            out = agent.call(execs["h0"], "traffic_send", local=h0.addr, peer=h1.addr, dqpn=qpn(1, 0),
                                   count=n, pps=200, psn=n)
            time.sleep(3)
            a2 = _counters(execs["h0"], prefix, "h0")
            b2 = _counters(execs["h1"], prefix, "h1")
        finally:
            vm.heal(prefix, "p1t0s0")
        ev1 = [r for r in a2["evs"] if r["plane"] == 1]
        ev0 = [r for r in a2["evs"] if r["plane"] == 0]
        retired = [r for r in ev1 if r["state"] != "GOOD"]
        say("after the failure: plane-1 EVs %s; loss counted %d; h1 got %d of %d"
            % ({r["state"] for r in ev1}, a2["counters"]["ing_loss"],
               b2["counters"]["ing_data"] - cb["ing_data"], n))
        assert a2["counters"]["ing_loss"] > ca["ing_loss"]
        # plane 1's EVs are retired for losses: no active slot of plane 1 holds a GOOD EV
        assert len(retired) >= 8, ev1
        assert not [r for r in ev1 if r["role"] == "active" and r["state"] == "GOOD"], ev1
        assert all(r["state"] == "ASSUMED_BAD" for r in retired), ev1
        # the raw frames carry no TSETH stamp: the PSN-distance rule judges them (LOSS_PSN)
        assert any(r["reason"] in ("LOSS", "LOSS_PSN") for r in retired), ev1
        # plane 0 carries on: its EVs that are active sent the failure phase's traffic
        good0 = [r for r in ev0 if r["state"] == "GOOD" and r["role"] == "active"]
        assert good0, ev0
        # after retirement, what still goes out goes over plane 0: h1 got more than half
        got = b2["counters"]["ing_data"] - cb["ing_data"]
        assert got > n // 2, got
    finally:
        execs["h1"].run(["touch", rx_args["stop"]], check=False)
        agent.call(execs["h0"], "datapath_config", instance=instance_name(prefix, "h0"), changes=saved)
        th.join(timeout=60)
    assert "err" not in res, res.get("err")


# ---------------------------------------------------------------- the transport engine in the VMs
GUEST_CLI = GUEST_ROOT + "/.venv/bin/mrc-xdp"
XFER_MIB = 4


def _nic_tx(ex):
    """TX packets of h0's plane NICs p0, p1 (the engine's connection and its per-EV
    counters go with its QP, so the plane split is read here)."""
    j = json.loads(ex.run(["ip", "-j", "-s", "link", "show"]).stdout)
    return {int(ln["ifname"][1:]): ln["stats64"]["tx"]["packets"] for ln in j if ln["ifname"] in ("p0", "p1")}


def _engine_transfer(lab, tag, timeout=60):
    """XFER_MIB random MiB h0 -> h1 with the transport engine running on the lab's hosts
    (namespaces or guests): `mrc-xdp recv` on h1, `mrc-xdp send` on h0 (TCP bootstrap to
    h1's control address over plane 0, the lab control path; data by RDMA Write over
    AF_XDP on mrc0, sprayed by the datapath).  Verified by the engine's sha256 on both
    sides and by sha256sum of the file on each node.  Returns (send result, packets h0
    sent per plane NIC)."""
    execs, prefix, GUEST_CLI = lab["execs"], lab["prefix"], lab["cli"]
    st = {"control": lab["control"]}
    src, rxdir = "/tmp/xfer-%s-%s.bin" % (TAG, tag), "/tmp/xfer-rx-%s-%s" % (TAG, tag)
    execs["h0"].run(["sh", "-c", "head -c %d /dev/urandom > %s" % (XFER_MIB << 20, src)])
    execs["h1"].run(["mkdir", "-p", rxdir])
    before = _nic_tx(execs["h0"])
    res = {}

    def recv():
        res["rx"] = execs["h1"].run([GUEST_CLI, "recv", rxdir, "-i", instance_name(prefix, "h1"), "--json",
                                     "--timeout", str(timeout)], timeout=4 * timeout, check=False)
    th = threading.Thread(target=recv, daemon=True)
    th.start()
    t0 = time.monotonic()
    try:
        tx = execs["h0"].run([GUEST_CLI, "send", src, st["control"]["h1"][0], "-i", instance_name(prefix, "h0"),
                              "--json", "--timeout", str(timeout)], timeout=4 * timeout, check=False)
    finally:
        el = time.monotonic() - t0
        th.join(timeout=10)
        if th.is_alive():       # the receiver waits for a sender that failed: end it
            execs["h1"].run(["pkill", "-f", rxdir], check=False)
            th.join(timeout=30)
    rx = res.get("rx")
    assert tx.returncode == 0, "send: %s" % (tx.stderr.strip() or tx.stdout.strip())
    assert rx is not None and rx.returncode == 0, "recv: %s" % (rx and (rx.stderr.strip() or rx.stdout.strip()))
    sent = json.loads(tx.stdout.strip().splitlines()[-1])
    got = json.loads(rx.stdout.strip().splitlines()[-1])
    assert sent["bytes"] == got["bytes"] == XFER_MIB << 20
    assert sent["intact"] and got["intact"] and sent["sha256"] == got["sha256"] == got["sender_sha256"]
    # the bytes on the two disks, hashed outside the engine
    h_src = execs["h0"].run(["sha256sum", src]).stdout.split()[0]
    h_dst = execs["h1"].run(["sha256sum", got["file"]]).stdout.split()[0]
    assert h_src == h_dst == sent["sha256"], (h_src, h_dst, sent["sha256"])
    execs["h0"].run(["rm", "-f", src])
    execs["h1"].run(["rm", "-rf", rxdir])
    after = _nic_tx(execs["h0"])
    planes = {p: after[p] - before[p] for p in sorted(after)}
    say("engine transfer %s (%s): %d MiB in %.1fs (send+recv commands %.1fs), %d packets (%d retransmitted, "
        "%d RTO), per plane NIC %s, sha256 %s..."
        % (tag, lab["target"], XFER_MIB, sent["seconds"], el, sent["qp_stats"]["tx_pkts"], sent["qp_stats"]["rtx_pkts"],
           sent["qp_stats"]["rtx_timeout"], planes, sent["sha256"][:16]))
    return sent, planes


# The targets of the scenarios below: CI runs netns and qemu; MRC_LAB_TARGETS=vagrant (or
# netns,qemu,vagrant) runs them on a `vagrant up` of the same topology too (by hand: about
# 10 min more under TCG, see vagrant/README.md).
TARGETS = [t for t in os.environ.get("MRC_LAB_TARGETS", "netns,qemu").split(",") if t]


@pytest.fixture(scope="module", params=TARGETS)
def lab_on(request):
    """The CI topology on a target, for the scenarios that run on all: `netns` (network
    namespaces of this machine, `lab up`'s default), `qemu` (the VM lab above) or
    `vagrant` (the same VMs from the same image, booted by `vagrant up`).  All are built
    by the same node set-up code; a scenario sees executors per node, the lab control
    path, the mrc-xdp CLI on the nodes and how to fail / heal a switch (netns: every end
    of its links blackholed in the link model; VMs: the switch VM frozen)."""
    if request.param not in ("netns", "qemu", "vagrant"):
        pytest.fail("MRC_LAB_TARGETS: %r is not a target (netns, qemu, vagrant)" % request.param)
    if request.param == "qemu":
        prefix, topo, st = request.getfixturevalue("vmlab")
        yield {"target": "qemu", "prefix": prefix, "topo": topo, "execs": vm.execs_of(st),
               "control": st["control"], "cli": GUEST_CLI, "fail": vm.fail, "heal": vm.heal}
        return
    if request.param == "vagrant":
        if not shutil.which("vagrant"):
            pytest.fail("vagrant is not installed: run `make vm-setup`")
        prefix, topo = "mg%s-" % TAG, from_dict(CI_TOPO)
        t0 = time.monotonic()
        try:
            st = vm.vagrant_up(topo, prefix, progress=say, linkmodel=[LM_NODE])
            say("timing: vagrant lab up %.0fs (vagrant up %.0fs)" % (time.monotonic() - t0, st["boot_s"]))
            yield {"target": "vagrant", "prefix": prefix, "topo": topo, "execs": vm.execs_of(st),
                   "control": st["control"], "cli": GUEST_CLI, "fail": vm.fail, "heal": vm.heal}
        finally:
            t0 = time.monotonic()
            vm.down(prefix, progress=say)
            say("timing: vagrant lab down %.1fs" % (time.monotonic() - t0))
        assert vm.leftovers(prefix) == {"qemu": [], "dirs": [], "state_file": []}
        return
    from mrc_xdp.cli import lab as lab_cli
    from mrc_xdp.lab import hosts
    from mrc_xdp.lab.executor import NetnsNode
    prefix = "mt%s-" % TAG
    try:
        st = fabric.up(from_dict(CI_TOPO), prefix=prefix, hosts_hook=hosts.fabric_hook)
        topo = fabric.topology_of(st)
        yield {"target": "netns", "prefix": prefix, "topo": topo,
               "execs": {n: NetnsNode(n, prefix + n) for n in topo.nodes},
               "control": ctlpath.lab_control_path(prefix, topo),
               "cli": os.path.join(os.path.dirname(os.sys.executable), "mrc-xdp"),
               "fail": lab_cli.fail, "heal": lab_cli.heal}
    finally:
        fabric.down(prefix, unload_hosts=hosts.unload_all)
    assert fabric.leftovers(prefix) == {"netns": [], "pins": [], "state_file": []}


def test_engine_transfer_over_both_planes_then_with_a_switch_failed(lab_on):
    """On both targets: the transport engine on the hosts, a file h0 -> h1 verified by
    hash, sprayed over both planes; then again with the plane-1 switch failed: it
    completes intact over plane 0 (the datapath retires the EVs that lose packets, the
    engine resends).

    Under TCG a busy guest's virtio queue overflows now and then (~1-2% of the frames of
    a transfer here, on every path alike: no path's fault), and with loss_thresh 1 each
    loss retires an EV: with no health daemon to resurrect them, every EV was retired
    and the QP hit its retry limit in 7 of 8 tries.  As the netns lab's random-loss cases
    do, the loss threshold is raised for these transfers (16 losses per EV: a dead
    plane's EVs lose every packet and are still retired within a few hundred)."""
    lab = lab_on
    prefix, execs = lab["prefix"], lab["execs"]
    saved = {h: agent.call(execs[h], "datapath_config", instance=instance_name(prefix, h), changes={"loss_thresh": 16})
             for h in ("h0", "h1")}
    try:
        sent, planes = _engine_transfer(lab, "healthy")
        pkts = sent["qp_stats"]["tx_pkts"]
        assert sorted(planes) == [0, 1] and min(planes.values()) >= 0.25 * pkts, (planes, pkts)

        loss0 = _counters(execs["h0"], prefix, "h0")["counters"]["ing_loss"]
        lab["fail"](prefix, "p1t0s0")
        try:
            sent, planes = _engine_transfer(lab, "p1-failed")
            loss1 = _counters(execs["h0"], prefix, "h0")["counters"]["ing_loss"]
        finally:
            lab["heal"](prefix, "p1t0s0")
    finally:
        for h, old in saved.items():
            agent.call(execs[h], "datapath_config", instance=instance_name(prefix, h), changes=old)
    # plane 0 carried the whole file; the frames sprayed into the dead plane were lost
    # (counted by h0's datapath from h1's SACKs) and resent
    assert planes[0] >= (XFER_MIB << 20) // 1500, planes
    assert loss1 > loss0 and sent["qp_stats"]["rtx_pkts"] > 0, (loss0, loss1, sent["qp_stats"])


# ---------------------------------------------------------------- `lab link set` / `lab heal` on VMs
PING6 = """
import socket, sys, time
s = socket.socket(socket.AF_INET6, socket.SOCK_RAW, socket.IPPROTO_ICMPV6)
s.settimeout(0.5)
for seq in range(2):
    s.sendto(bytes([128, 0, 0, 0, 0x4d, 0x52, 0, seq]) + b"mrc-xdp", (sys.argv[1], 0))
    end = time.monotonic() + 3
    while time.monotonic() < end:
        try:
            d, a = s.recvfrom(1500)
        except socket.timeout:
            continue
        if d[0] == 129 and d[4:6] == bytes([0x4d, 0x52]):
            sys.exit(0)
sys.exit(1)
"""


def test_lab_link_set_and_heal(lab_on):
    """`mrc-xdp lab link set` and `lab heal`, on both targets: the CLI changes the link
    model in the node that receives on the end (here p0t0s0's port h0; on VMs over SSH);
    a blackhole there stops h0's pings to its plane-0 switch, the heal restores them.
    On VMs only p0t0s0 has a link model: the other ends are named, not skipped silently."""
    prefix, topo, execs = lab_on["prefix"], lab_on["topo"], lab_on["execs"]
    cli = [os.path.join(os.path.dirname(os.sys.executable), "mrc-xdp"), "lab"]
    gw = topo.gateway("h0", 0).addr
    end = "h0>%s" % LM_NODE

    def ping():
        if lab_on["target"] != "netns":
            return execs["h0"].run(["ping", "-6", "-c", "2", "-i", "0.5", "-W", "3", gw], check=False).returncode
        # this machine has no ping(8): two ICMPv6 echo requests from a raw socket in h0
        return execs["h0"].run([os.sys.executable, "-c", PING6, gw], check=False).returncode

    def lm_port():
        return agent.call(execs[LM_NODE], "link_counters", pin_dir=fabric.pin_dir(prefix), ifnames=["h0"])["h0"]
    assert ping() == 0
    p = subprocess.run(cli + ["link", "set", end, "blackhole", "on", "loss", "1%", "--prefix", prefix],
                       capture_output=True, text=True, timeout=120)
    assert p.returncode == 0 and p.stdout.startswith(end), p.stdout + p.stderr
    try:
        d0 = sum(v for k, v in lm_port().items() if k.startswith("drop_"))
        assert ping() != 0
        d1 = sum(v for k, v in lm_port().items() if k.startswith("drop_"))
        assert d1 >= d0 + 2, (d0, d1)
        # `lab status`, the same shape on both targets (on VMs read in the VMs over SSH)
        p = subprocess.run(cli + ["status", "--prefix", prefix, "--json"], capture_output=True, text=True,
                           timeout=300)
        assert p.returncode == 0, p.stderr
        s = json.loads(p.stdout)
        assert [n["name"] for n in s["nodes"]] == list(topo.nodes) and all(n["exists"] for n in s["nodes"]), s
        ends = {ln["name"]: ln for ln in s["links"]}
        assert sorted(ends) == sorted(e[0] for e in topo.link_ends())
        e = ends[end]
        assert e["modelled"] and e["blackhole"] and e["loss_ppm"] == 10_000, e
        assert sum(v for k, v in e["counters"].items() if k.startswith("drop_")) >= d1, e
        if lab_on["target"] != "netns":     # the ends into VMs without the link model are named
            assert {n: ln["why"] for n, ln in ends.items() if not ln["modelled"]} == {
                n: "not modelled: no link model in VM %s" % ln["to"] for n, ln in ends.items() if ln["to"] != LM_NODE}
        else:
            assert all(ln["modelled"] for ln in ends.values())
        if lab_on["target"] != "netns":
            # a link's other direction ends at h0, which has no link model: named, not silently skipped
            p = subprocess.run(cli + ["link", "set", "h0-%s" % LM_NODE, "rate", "100M", "--prefix", prefix],
                               capture_output=True, text=True, timeout=120)
            assert p.returncode == 0 and "not modelled" in p.stderr and "%s>h0" % LM_NODE in p.stderr, p.stderr
            p = subprocess.run(cli + ["link", "set", "%s>h0" % LM_NODE, "rate", "100M", "--prefix", prefix],
                               capture_output=True, text=True, timeout=120)
            assert p.returncode == 1 and p.stderr.count("\n") == 1 and "no link model" in p.stderr, p.stderr
    finally:
        h = subprocess.run(cli + ["heal", LM_NODE, "--prefix", prefix], capture_output=True, text=True,
                           timeout=120)
    assert h.returncode == 0 and "healed %s" % LM_NODE in h.stdout, h.stdout + h.stderr
    assert ping() == 0
    p = subprocess.run(cli + ["status", "--prefix", prefix], capture_output=True, text=True, timeout=300)
    assert p.returncode == 0 and end in p.stdout and "BLACKHOLE" not in p.stdout, p.stdout + p.stderr
    if lab_on["target"] != "netns":
        say(p.stdout)
        assert "on VMs (%s" % lab_on["target"] in p.stdout and re.search(r"\n  %s>h0 +\(not modelled: no link model in VM h0\)"
                                                       % LM_NODE, p.stdout), p.stdout
    # and with no lab of that name up, one line
    p = subprocess.run(cli + ["status", "--prefix", "zz%s-" % TAG], capture_output=True, text=True, timeout=60)
    assert p.returncode == 1 and p.stderr.count("\n") == 1 and "is not up" in p.stderr, p.stderr
    if lab_on["target"] == "netns":
        return
    cfg = agent.call(execs[LM_NODE], "link_update", pin_dir=fabric.pin_dir(prefix), ifnames=["h0"], changes={})["h0"]
    assert not cfg["blackhole"] and cfg["loss_ppm"] == 0 and cfg["rate_bps"] == 100_000_000, cfg


# ---------------------------------------------------------------- the path health daemon on the hosts
# Faster background probes than the defaults (20/s, 50 ms), so the scenario fits in
# seconds; the 500 ms answer timeout leaves room for a TCG switch VM that stalls for a few
# hundred ms (an unanswered probe is only a failure after 3 in a row).
DAEMON_PROBE = {"background_per_s": 50, "background_fail": 3, "timeout_ms": 500, "interval_ms": 100,
                "backoff_max_ms": 500, "ok_needed": 3, "workers": 8}


def _daemon_start(lab, host):
    """`mrc-xdp daemon` on a lab host (netns: a process in the host's namespace; VM: in
    the guest), over the executor, following only that host's datapath instance, on a
    socket of its own.  Returns what _daemon_ready/_daemon_stop need."""
    ex, inst = lab["execs"][host], instance_name(lab["prefix"], host)
    d = "/tmp/mrcd-%s-%s-%s" % (TAG, lab["target"], host)
    cfg = ['socket = "%s/events.sock"' % d, 'instances = ["%s"]' % inst, "[probe]"] + \
        ["%s = %s" % kv for kv in DAEMON_PROBE.items()]
    ex.run(["mkdir", "-p", d])
    ex.run(["sh", "-c", "cat > %s/daemon.toml" % d], input="\n".join(cfg) + "\n")
    t0 = time.monotonic()
    out = ex.run(["sh", "-c", "nohup %s daemon --config %s/daemon.toml >%s/daemon.log 2>&1 </dev/null & echo $!"
                  % (lab["cli"], d, d)]).stdout
    return {"host": host, "ex": ex, "dir": d, "inst": inst, "pid": int(out.split()[-1]), "t0": t0}


def _daemon_alive(dm) -> bool:
    """Its process exists and is not a zombie (one not reaped yet has ended)."""
    p = dm["ex"].run(["cat", "/proc/%d/stat" % dm["pid"]], check=False)
    return p.returncode == 0 and ")" in p.stdout and p.stdout[p.stdout.rindex(")") + 2:][:1] not in ("Z", "X")


def _daemon_log(dm) -> str:
    return dm["ex"].run(["cat", dm["dir"] + "/daemon.log"], check=False).stdout


def _daemon_ready(dm, timeout=240):
    """Until the daemon follows its instance (its log says so); returns the start time."""
    deadline = time.monotonic() + timeout
    while True:
        log = _daemon_log(dm)
        if "%s: following" % dm["inst"] in log:
            assert "probing is off" not in log, log
            return time.monotonic() - dm["t0"]
        assert _daemon_alive(dm), "daemon on %s exited: %s" % (dm["host"], log.strip()[-300:])
        assert time.monotonic() < deadline, "daemon on %s did not follow %s in %d s: %s" % (
            dm["host"], dm["inst"], timeout, log.strip()[-300:])
        time.sleep(0.5)


def _daemon_stop(dm, timeout=60) -> list:
    """SIGTERM, then until the process is gone; its socket is removed by the daemon.
    Returns what is wrong (empty: stopped cleanly, directory removed)."""
    ex, bad = dm["ex"], []
    stat = ex.run(["cat", "/proc/%d/stat" % dm["pid"]], check=False).stdout
    if ")" in stat:         # CPU time used (utime + stime, in USER_HZ = 100 ticks/s), run time
        f = stat[stat.rindex(")") + 2:].split()
        dm["cpu"] = "%.1f s CPU in %.0f s" % ((int(f[11]) + int(f[12])) / 100, time.monotonic() - dm["t0"])
    ex.run(["kill", "-TERM", str(dm["pid"])], check=False)
    deadline = time.monotonic() + timeout
    while _daemon_alive(dm):
        if time.monotonic() > deadline:
            ex.run(["kill", "-KILL", str(dm["pid"])], check=False)
            bad.append("daemon on %s (pid %d) ignored SIGTERM for %d s" % (dm["host"], dm["pid"], timeout))
            break
        time.sleep(0.3)
    if ex.run(["test", "-e", dm["dir"] + "/events.sock"], check=False).returncode == 0:
        bad.append("daemon on %s left its socket" % dm["host"])
    ex.run(["rm", "-rf", dm["dir"]], check=False)
    return bad


def _probe_figures(lab, dm, rows) -> dict:
    """From the daemon's status (its socket, asked on the node): background and
    resurrection probes per plane, sent / answered, and the smoothed RTTs (ms)."""
    py = GUEST_PY if lab["target"] != "netns" else os.sys.executable
    p = dm["ex"].run([py, "-c", "import json, sys; from mrc_xdp.health import daemon as health; "
                      "print(json.dumps(health.status(sys.argv[1])))", dm["dir"] + "/events.sock"])
    st = json.loads(p.stdout)["instances"][dm["inst"]]
    plane = {"%d:%d" % (r["conn"], r["ev"]): r["plane"] for r in rows[dm["host"]]}
    out = {}
    for k, v in st["rtt"].items():
        d = out.setdefault(plane.get(k), {"sent": 0, "answered": 0, "srtt_ms": []})
        d["sent"] += v["sent"]
        d["answered"] += v["answered"]
        if v["srtt"] is not None:
            d["srtt_ms"].append(round(v["srtt"] * 1000, 1))
    for d in out.values():
        d["srtt_ms"] = [min(d["srtt_ms"]), max(d["srtt_ms"])] if d["srtt_ms"] else []
    return out


def _ev_rows(lab, hosts=("h0", "h1")) -> dict:
    """{host: rows of `mrc-xdp ev list --json`} (the EV states in the pinned maps), read on
    the hosts in parallel."""
    def one(h):
        p = lab["execs"][h].run([lab["cli"], "ev", "list", "-i", instance_name(lab["prefix"], h), "--json"])
        return h, json.loads(p.stdout)
    with cf.ThreadPoolExecutor(len(hosts)) as pool:
        return dict(pool.map(one, hosts))


def _wait_evs(lab, done, timeout, what):
    """Poll the EV states of h0 and h1 until done(rows) (which may assert on every sample);
    returns (rows, seconds)."""
    t0 = time.monotonic()
    while True:
        rows = _ev_rows(lab)
        if done(rows):
            return rows, time.monotonic() - t0
        assert time.monotonic() - t0 < timeout, "%s: not within %d s: %s" % (what, timeout, {
            h: sorted({(r["plane"], r["state"], r["reason"]) for r in rs}) for h, rs in rows.items()})
        time.sleep(0.5)


def _plane(rows, plane):
    return [r for rs in rows.values() for r in rs if r["plane"] == plane]


def test_health_daemon_retires_a_dead_plane_by_background_probes_and_heals(lab_on):
    """On both targets: `mrc-xdp daemon` on h0 and h1 (netns: in the host's namespace; VMs:
    in the guest), no data traffic at all.  The plane-1 switch fails: the daemons'
    background probes of GOOD EVs go unanswered on plane 1, and after 3 in a row each
    plane-1 EV of both connections (h0 -> h1, h1 -> h0; active and backup) is retired
    (ASSUMED_BAD, reason PROBE_FAIL); plane 0's stay GOOD at every sample.  After the heal
    the resurrection probes are answered again and every plane-1 EV is GOOD (PROBE_OK).
    States are read from the pinned maps with `mrc-xdp ev list --json` on the hosts; the
    datapaths' spray counters show that no data was sent meanwhile."""
    lab = lab_on
    prefix, execs = lab["prefix"], lab["execs"]
    t_start = time.monotonic()
    sprayed = {h: _counters(execs[h], prefix, h)["counters"] for h in ("h0", "h1")}
    dms, problems = [], []
    try:
        for h in ("h0", "h1"):
            dms.append(_daemon_start(lab, h))
        t_up = {dm["host"]: _daemon_ready(dm) for dm in dms}
        # EVs that earlier scenarios' losses retired (no daemon ran then) come back first
        rows, t_good0 = _wait_evs(lab, lambda rs: all(r["state"] == "GOOD" for x in rs.values() for r in x),
                                  120, "every EV GOOD with the daemons running")
        assert {h: len(rs) for h, rs in rows.items()} == {"h0": 24, "h1": 24}, rows     # 2 planes x (8 + 4)

        def plane1_retired(rs):
            bad0 = [(r["ev"], r["state"], r["reason"]) for r in _plane(rs, 0) if r["state"] != "GOOD"]
            assert not bad0, "plane-0 EVs left GOOD with plane 1 failed: %s" % bad0
            return all(r["state"] == "ASSUMED_BAD" for r in _plane(rs, 1))
        t0 = time.monotonic()
        _ev_rows(lab)
        t_poll = time.monotonic() - t0
        lab["fail"](prefix, "p1t0s0")
        try:
            rows, t_retire = _wait_evs(lab, plane1_retired, 120, "plane-1 EVs retired by background probes")
            assert {r["reason"] for r in _plane(rows, 1)} == {"PROBE_FAIL"}, _plane(rows, 1)
            assert {h for h, rs in rows.items() for r in rs if r["plane"] == 1} == {"h0", "h1"}
            st = None
            if lab["target"] != "netns":     # `lab status` names the frozen VM, does not wait for it
                p = subprocess.run(LAB_CLI + ["status", "--prefix", prefix, "--json"], capture_output=True,
                                   text=True, timeout=300)
                assert p.returncode == 0, p.stderr
                st = json.loads(p.stdout)
        finally:
            lab["heal"](prefix, "p1t0s0")
        if st is not None:
            nodes = {n["name"]: n for n in st["nodes"]}
            assert nodes["p1t0s0"]["state"] == "frozen" and not nodes["p1t0s0"]["exists"], nodes
            assert all(nodes[n]["exists"] for n in ("h0", "h1", "p0t0s0")), nodes
            into = [ln for ln in st["links"] if ln["to"] == "p1t0s0"]
            assert into and all(ln["why"] == "VM p1t0s0 is frozen" and ln["counters"] is None for ln in into)

        def all_good(rs):
            assert all(r["state"] == "GOOD" for r in _plane(rs, 0)), _plane(rs, 0)
            return all(r["state"] == "GOOD" for r in _plane(rs, 1))
        rows, t_heal = _wait_evs(lab, all_good, 120, "plane-1 EVs resurrected after the heal")
        assert {r["reason"] for r in _plane(rows, 1)} == {"PROBE_OK"}, _plane(rows, 1)
        for dm in dms:
            assert _daemon_alive(dm), _daemon_log(dm)
        with cf.ThreadPoolExecutor(2) as pool:
            figs = dict(zip(("h0", "h1"), pool.map(lambda dm: _probe_figures(lab, dm, rows), dms)))
        for h, f in figs.items():        # both planes were probed and answered (plane 1 after the heal)
            assert f[0]["answered"] > 0 and f[1]["answered"] > 0 and f[1]["sent"] > f[1]["answered"], (h, f)
    finally:
        for dm in dms:
            problems += _daemon_stop(dm)
    assert not problems, problems
    # probes only: every frame the datapaths sent was a control frame, no data
    after = {h: _counters(execs[h], prefix, h)["counters"] for h in ("h0", "h1")}
    for h in ("h0", "h1"):
        assert after[h]["spray_data"] == sprayed[h]["spray_data"], (h, sprayed[h], after[h])
        assert after[h]["spray_ctrl"] > sprayed[h]["spray_ctrl"] + 100, (h, sprayed[h], after[h])
    say("health daemon (%s): started in %s s, EVs GOOD %.1fs, plane 1 retired %.1fs after the failure, "
        "GOOD %.1fs after the heal; scenario %.0fs; probes per host and plane (sent, answered, srtt ms "
        "min-max): %s; one `ev list` of both hosts %.1fs; daemons used %s"
        % (lab["target"], {h: round(t, 1) for h, t in t_up.items()}, t_good0, t_retire, t_heal,
           time.monotonic() - t_start, figs, t_poll, {dm["host"]: dm.get("cpu") for dm in dms}))


# ---------------------------------------------------------------- the fleet role on the VMs, over SSH
ANSIBLE = os.path.join(vm.ROOT, "deploy", "ansible")
PLAYBOOK = os.path.join(os.path.dirname(os.sys.executable), "ansible-playbook")
RECAP = re.compile(r"^(\S+)\s*:\s*ok=(\d+)\s+changed=(\d+)\s+unreachable=(\d+)\s+failed=(\d+)", re.M)
BG = "/run/mrc-xdp/mrc-xdp-bg"


def _play(d, inv, playbook, *extra, timeout=1500):
    """ansible-playbook on the inventory; {"recap": {host: (ok, changed, unreachable, failed)}, "s"}."""
    env = dict(os.environ, ANSIBLE_CONFIG=os.path.join(ANSIBLE, "ansible.cfg"), ANSIBLE_NOCOLOR="1",
               ANSIBLE_HOME=os.path.join(d, "home"), ANSIBLE_LOCAL_TEMP=os.path.join(d, "tmp"))
    t = time.monotonic()
    # -v: every task's result (stdout, stderr, rc) is in ansible.log, kept when the test fails
    p = subprocess.run([PLAYBOOK, "-v", "-i", inv, os.path.join(ANSIBLE, playbook), *extra], capture_output=True,
                       text=True, timeout=timeout, env=env)
    with open(os.path.join(d, "ansible.log"), "a") as f:
        f.write("==== %s %s: rc %d\n%s\n%s\n" % (playbook, " ".join(extra), p.returncode, p.stdout, p.stderr))
    fatal = [ln for ln in p.stdout.splitlines() if ln.startswith(("fatal:", "failed:", "ERROR", "[ERROR]"))]
    assert p.returncode == 0, (playbook, p.returncode, fatal[:4] or p.stdout[-3000:], p.stderr[-2000:])
    return {"recap": {m[0]: tuple(int(x) for x in m[1:]) for m in RECAP.findall(p.stdout)},
            "s": time.monotonic() - t}


def _later_vm_tests(request) -> list:
    """The tests after this one in the session that use the VM lab (`vmlab`, or `lab_on`
    on the QEMU target)."""
    items = request.session.items
    later = items[items.index(request.node) + 1:]
    return [it.nodeid for it in later if "vmlab" in it.fixturenames
            or (getattr(it, "callspec", None) and it.callspec.params.get("lab_on") == "qemu")]


def _guest_leftovers(ex, inst) -> list:
    """What a deploy could leave in a guest: the instance's pins and state, the role's
    processes and files, XDP programs on the host's devices."""
    sh = ("test -e /sys/fs/bpf/mrc/{i} && echo pins; test -e /run/mrc-xdp/{i}.json && echo state; "
          "pgrep -af 'mrc-xdp (daemon|metrics)' | sed 's/^/process /'; "
          "for f in /etc/mrc-xdp/host.toml /etc/mrc-xdp/host.toml.loaded /etc/mrc-xdp/daemon.toml "
          "/run/mrc-xdp/daemon.pid /run/mrc-xdp/metrics.pid /run/mrc-xdp/daemon.log /run/mrc-xdp/metrics.log "
          "{bg} /etc/mrc-xdp; do test -e $f && echo file $f; done; "
          "for d in p0 p1 mrc0 mrc0p; do ip -d link show dev $d | grep -q 'prog/xdp' && echo xdp $d; done; true"
          ).format(i=inst, bg=BG)
    return ex.run(["sh", "-c", sh]).stdout.split("\n")[:-1]


def test_fleet_deploy_and_drain_on_the_vms(vmlab, request):
    """CI's part of the VM fleet run (issue 18: "the same deploy and drain against the CI VM
    lab over SSH"): deploy.yml on both guests over SSH, `status --json`, the services and
    the metrics endpoint checked as below, plane-drain.yml, a transfer that sends nothing
    on plane 1, then unload.yml leaving nothing.  The idempotence re-run and the return
    are left to the whole run (test_fleet_role_on_the_vms_over_ssh, by hand): in TCG
    guests they double the time."""
    if not os.access(PLAYBOOK, os.X_OK):
        pytest.fail("%s is missing: run scripts/setup.sh (it installs ansible-core)" % PLAYBOOK)
    fleet_scenario(*vmlab, later=_later_vm_tests(request), full=False)


@pytest.mark.skipif(os.environ.get("MRC_VM_FLEET") != "1",
                    reason="by hand (MRC_VM_FLEET=1): 8-15 min in TCG guests (deploy, redeploy, drain, "
                           "return, unload); CI runs its deploy and drain part "
                           "(test_fleet_deploy_and_drain_on_the_vms)")
def test_fleet_role_on_the_vms_over_ssh(vmlab, request):
    """The fleet's Ansible role and playbooks (deploy/ansible) against the VM lab's hosts
    over SSH, as against real machines (docs/fleet.md): `mrc-xdp lab inventory` of the
    running QEMU lab (ssh to 127.0.0.1 on each VM's forwarded port, root, the lab's key);
    deploy.yml on both guests (the guest's /opt/mrc-xdp checkout; the lab's own datapath
    replaced by the role's load; background services, the guests run no systemd):
    `status --json` in every guest shows the instance with its connection and 16 GOOD
    active EVs, the health daemon and the metrics endpoint run, and the endpoint answers
    through its forwarded port with the instance's series and mrc_daemon_up 1; a second
    deploy changes nothing; plane-drain.yml takes plane 1 out on both (checked with
    status --json), and a 4 MiB engine transfer h0 -> h1 (intact by sha256) then sends
    no packet on plane 1 in either direction (both hosts' plane-1 NIC counters); plane-
    return.yml puts it back and the next transfer uses both planes; unload.yml leaves no
    pins, state, processes, files or XDP program in the guests.  The lab's own datapaths
    are loaded again afterwards when a later test uses the VMs."""
    if not os.access(PLAYBOOK, os.X_OK):
        pytest.fail("%s is missing: run scripts/setup.sh (it installs ansible-core)" % PLAYBOOK)
    fleet_scenario(*vmlab, later=_later_vm_tests(request))


def _guest_evidence(execs, hosts, d) -> None:
    """A failed fleet test: each guest's service logs, pid files, processes and kernel
    messages into d/guest-HOST.txt (the unload removes the logs)."""
    sh = ("for f in /run/mrc-xdp/*.pid /run/mrc-xdp/*.log; do echo \"== $f\"; cat $f; done; "
          "echo '== ps'; ps -eo pid,ppid,pgid,sid,stat,lstart,args | grep -v ' \\[' ; "
          "echo '== dmesg'; dmesg | tail -n 60; echo '== ls'; ls -la /run/mrc-xdp /sys/fs/bpf/mrc; true")
    for h in hosts:
        try:
            out = execs[h].run(["sh", "-c", sh], check=False, timeout=120).stdout
        except Exception as e:
            out = "could not read: %s" % e
        with open(os.path.join(d, "guest-%s.txt" % h), "w") as f:
            f.write(out)
    say("fleet on VMs: failed; the guests' logs, processes and dmesg in %s/guest-*.txt" % d)


def fleet_scenario(prefix, topo, st, later=(), deployed_before=False, full=True):
    """test_fleet_role_on_the_vms_over_ssh on VM lab `prefix` (also run by hand on a lab
    brought up with `lab up --vm --no-hosts` and deployed: deployed_before=True, then the
    first deploy here must change nothing).  later: tests that need the lab's own
    datapaths loaded again at the end."""
    from mrc_xdp.datapath.config import HostConfig
    from mrc_xdp.fleet import inventory
    import tempfile
    import tomllib
    import urllib.request
    execs = vm.execs_of(st)
    hosts = [h.name for h in topo.hosts]
    insts = {h: instance_name(prefix, h) for h in hosts}
    lab = {"target": "qemu", "prefix": prefix, "topo": topo, "execs": execs, "control": st["control"],
           "cli": GUEST_CLI}
    d = tempfile.mkdtemp(prefix="mrcvf-")          # short: ssh's control sockets live under it
    t_all = time.monotonic()
    inv_path = os.path.join(d, "inventory.json")
    p = subprocess.run(LAB_CLI + ["inventory", "--prefix", prefix, "-o", inv_path], capture_output=True,
                       text=True, timeout=60)
    assert p.returncode == 0, p.stderr
    hv = inventory.hosts_of(inventory.read(inv_path))
    assert sorted(hv) == sorted(insts.values())
    t, deployed, saved = {}, False, {}
    try:
        first = _play(d, inv_path, "deploy.yml")
        deployed = True
        t["deploy"] = first["s"]
        t0 = time.monotonic()
        assert all((first["recap"][insts[h]][1] == 0) == deployed_before and first["recap"][insts[h]][2:] == (0, 0)
                   for h in hosts), first["recap"]
        for h in hosts:
            ex, inst = execs[h], insts[h]
            s = json.loads(ex.run([GUEST_CLI, "status", "-i", inst, "--json"]).stdout)
            assert s[0]["instance"] == inst and len(s[0]["connections"]) == 1, s
            assert s[0]["active_evs_by_state"] == {"GOOD": 16}, s[0]["active_evs_by_state"]
            written = tomllib.loads(ex.run(["cat", "/etc/mrc-xdp/host.toml"]).stdout)
            assert HostConfig.from_dict(written) == HostConfig.from_dict(inventory.config_of(hv[inst]))
            for svc in ("daemon", "metrics"):
                assert ex.run([BG, "status", "/run/mrc-xdp/%s.pid" % svc], check=False).returncode == 0, (
                    h, svc, ex.run(["tail", "-n", "25", "/run/mrc-xdp/%s.log" % svc], check=False).stdout)
            # monitored: the endpoint answers on this machine through the VM's forwarded
            # port, and says that the daemon follows the instance (it may still be starting)
            up = re.compile(r'^mrc_daemon_up\{mrc_instance="%s"\} 1(\.0)?$' % re.escape(inst), re.M)
            deadline, body = time.monotonic() + 90, ""
            while not up.search(body):
                assert time.monotonic() < deadline, body[-1500:]
                time.sleep(1)
                with urllib.request.urlopen("http://%s/metrics" % hv[inst]["mrc_xdp_metrics_target"],
                                            timeout=30) as r:
                    body = r.read().decode()
        t["checks"] = time.monotonic() - t0
        if full:
            again = _play(d, inv_path, "deploy.yml")
            t["redeploy"] = again["s"]
            assert all(again["recap"][insts[h]][1:] == (0, 0, 0) for h in hosts), again["recap"]

        drain = _play(d, inv_path, "plane-drain.yml", "-e", "mrc_xdp_plane=1")
        t["drain"] = drain["s"]
        assert all(drain["recap"][insts[h]][1] == 1 for h in hosts), drain["recap"]
        for h in hosts:
            rot = json.loads(execs[h].run([GUEST_CLI, "status", "-i", insts[h], "--json"]).stdout)[0]["plane_rotation"]
            assert rot[1]["operator_out"] and not rot[1]["in_rotation"] and rot[0]["in_rotation"], rot
        # TCG drops ~1-2% of a busy guest's frames: see test_engine_transfer_...
        saved = {h: agent.call(execs[h], "datapath_config", instance=insts[h], changes={"loss_thresh": 16})
                 for h in hosts}
        t0 = time.monotonic()
        nic0 = {h: _nic_tx(execs[h]) for h in hosts}
        sent, planes = _engine_transfer(lab, "fleet-drained")
        nic1 = {h: _nic_tx(execs[h]) for h in hosts}
        t["transfer"] = time.monotonic() - t0
        drained = {h: {p: nic1[h][p] - nic0[h][p] for p in (0, 1)} for h in hosts}
        say("fleet on VMs: plane 1 drained, %d MiB h0 -> h1: packets per plane NIC %s" % (XFER_MIB, drained))
        assert drained["h0"][0] >= (XFER_MIB << 20) // 1500 and drained["h1"][0] > 0, drained
        assert drained["h0"][1] == 0 and drained["h1"][1] == 0, drained

        if full:
            ret = _play(d, inv_path, "plane-return.yml", "-e", "mrc_xdp_plane=1")
            t["return"] = ret["s"]
            assert all(ret["recap"][insts[h]][1] == 1 for h in hosts), ret["recap"]
            t0 = time.monotonic()
            sent, planes = _engine_transfer(lab, "fleet-returned")
            t["transfer2"] = time.monotonic() - t0
            assert min(planes.values()) >= 0.25 * sent["qp_stats"]["tx_pkts"], planes

        unload = _play(d, inv_path, "unload.yml")
        t["unload"] = unload["s"]
        deployed = False
        assert all(unload["recap"][insts[h]][1] > 0 for h in hosts), unload["recap"]
        for h in hosts:
            assert _guest_leftovers(execs[h], insts[h]) == [], h
    finally:
        if deployed and sys.exc_info()[0] is not None:     # failed: what the guests had, before the unload
            _guest_evidence(execs, hosts, d)
        if deployed:                # whatever failed: nothing of the role stays behind
            for h in hosts:
                with_saved = saved.get(h)
                if with_saved:
                    agent.call(execs[h], "datapath_config", instance=insts[h], changes=with_saved)
            try:
                _play(d, inv_path, "unload.yml")
            except Exception as e:       # reported; the fixture's teardown ends the VMs anyway
                say("fleet on VMs: unload after a failure failed: %s" % e)
        t_restore = time.monotonic()
        if later:                   # the lab's own datapaths, as `lab up` loaded them
            vm._parallel(lambda n: agent.call(execs[n], "vm_datapaths", topo=topo.to_dict(), prefix=prefix,
                                              node=n, pin_dir=fabric.pin_dir(prefix), hosts=True,
                                              linkmodel=False), hosts)
        t["restore"] = time.monotonic() - t_restore if later else 0.0
        say("fleet on VMs: %s; whole test %.0fs%s (ansible output: %s/ansible.log)"
            % (", ".join("%s %.0fs" % kv for kv in t.items()), time.monotonic() - t_all,
               "; the lab's datapaths reloaded for %d later tests" % len(later) if later else "", d))
    shutil.rmtree(d, ignore_errors=True)


# ---------------------------------------------------------------- vagrant
def test_vagrant_up_destroy_smoke():
    if not shutil.which("vagrant"):
        pytest.fail("vagrant is not installed: run `make vm-setup`")
    prefix = "vg%s-" % TAG
    topo = from_dict(SMOKE_TOPO)
    daemons_before = vm._libvirt_running()
    chains_before = vm._iptables_chains()
    bridges_before = set(os.listdir("/sys/class/net"))
    kvm_mode = os.stat("/dev/kvm").st_mode & 0o777
    t0 = time.monotonic()
    try:
        st = vm.vagrant_up(topo, prefix, progress=say, datapaths=False)
        say("timing: vagrant lab up %.0fs (vagrant up %.0fs)" % (time.monotonic() - t0, st["boot_s"]))
        execs = vm.execs_of(st)
        gw = topo.gateway("h0", 0)
        execs["h0"].run(["ping", "-6", "-c", "3", "-W", "5", gw.addr])      # over a UDP tunnel link
        got = json.loads(execs["p0t0s0"].run(["ip", "-j", "link", "show", "h0"]).stdout)[0]
        assert got["address"] == topo.port("p0t0s0", "h0").mac
    finally:
        t0 = time.monotonic()
        vm.down(prefix, progress=say)
        say("timing: vagrant destroy and clean-up %.0fs" % (time.monotonic() - t0))
    assert vm.leftovers(prefix) == {"qemu": [], "dirs": [], "state_file": []}
    assert vm._libvirt_running() == daemons_before
    assert vm._iptables_chains() == chains_before
    assert set(os.listdir("/sys/class/net")) - bridges_before == set()
    assert os.stat("/dev/kvm").st_mode & 0o777 == kvm_mode
    left = subprocess.run(["pgrep", "-af", "dnsmasq.*%s|libvirtd --daemon --pid-file /run/mrc-xdp" % vm.MGMT_NET],
                          capture_output=True, text=True).stdout
    assert daemons_before or not left.strip(), left
