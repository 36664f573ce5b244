"""The lab on virtual machines: one VM per host and per switch, one virtual link per
topology link, configured by the same lab code as the netns lab (over SSH).

- Image: ``build_image()`` runs vagrant/build-image.sh: Debian 12 minbase (debootstrap),
  the guest kernel from tools/kmatrix.py's cache (default Debian's 7.x: its verifier
  accepts the datapath), this checkout at /opt/mrc-xdp set up by scripts/setup.sh,
  an unpartitioned ext4 (mkfs.ext4 -d) as qcow2, direct kernel boot.  Cached under
  $MRC_VM_CACHE (default /var/cache/mrc-xdp/vm); rebuilt only when the sources, the
  recipe, the kernel or the lab's SSH key (``lab_key()``, made by whoever needs it
  first: the build or a rendering) change.
  ``build_box()`` packages it as the Vagrant box ``mrc-xdp/lab`` (libvirt provider).
- Plan: ``plan(topo, prefix)`` gives every VM its NICs: a management NIC (eth0) and one
  virtio-net NIC per port, with the topology's MAC; each link is a pair of UDP sockets
  on 127.0.0.1 (QEMU ``-netdev socket,udp=``; vagrant-libvirt ``tunnel_type: "udp"``).
  ``render()`` is that plan as the JSON vagrant/Vagrantfile reads.
- Runners: ``QemuLab`` (plain QEMU, no daemons: what CI uses) and ``VagrantLab``
  (vagrant-libvirt; starts libvirtd/virtlogd itself when they are not running).
- Node set-up: ``setup_nodes()``: wiring in each guest (NICs renamed by MAC, mrc0/mrc0p),
  then fabric.configure_links / configure_routes, the link model and the host datapaths
  (hosts.load_host), all through executor.SshNode: the functions the netns lab runs.

Accelerator: TCG unless KVM is usable (``accel()``): a paravirtual /dev/kvm ("PVM") runs
stock guest kernels ~100x slower than TCG, so it is not used.

State: /run/mrc-xdp/vmlab-<prefix>.json, written before each VM, directory or daemon is
created; ``down`` removes exactly what it records.
"""
from __future__ import annotations

import concurrent.futures as cf
import contextlib
import fcntl
import hashlib
import importlib.util
import json
import os
import shutil
import signal
import socket
import subprocess
import tarfile
import time
import zlib

from mrc_xdp.datapath import bpfcache
from mrc_xdp.datapath.maps import STATE_DIR
from mrc_xdp.lab import agent, fabric
from mrc_xdp.lab.executor import SshNode
from mrc_xdp.lab.topology import Topology, from_dict

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
VAGRANT_DIR = os.path.join(ROOT, "vagrant")
CACHE = os.environ.get("MRC_VM_CACHE", "/var/cache/mrc-xdp/vm")
KERNEL = os.environ.get("MRC_VM_KERNEL", "7")       # a tools/kmatrix.py kernel name
BOX_NAME = "mrc-xdp/lab"
MEM_HOST = 1024          # MiB: bcc compiles the datapath in the guest (~60 s under TCG)
MEM_SWITCH = 640         # MiB: the link model only
MGMT = "10.0.2.15/24,10.0.2.2"      # QEMU user networking (slirp), restrict=on
CMDLINE = "console=ttyS0 root=/dev/vda rw net.ifnames=0 panic=-1 quiet init=/sbin/lab-init"
SSH_OPTS = ["-q", "-o", "StrictHostKeyChecking=no", "-o", "UserKnownHostsFile=/dev/null",
            "-o", "LogLevel=ERROR", "-o", "BatchMode=yes", "-o", "ConnectTimeout=5",
            "-o", "ServerAliveInterval=15", "-o", "ServerAliveCountMax=8"]


class VmError(fabric.LabError):
    """A VM lab operation failed; str() is one line."""


def guest_bpf_cache() -> str:
    """Where the guests' bcc builds (bpfcache entries) are kept between VM labs."""
    return os.path.join(CACHE, "bpf")


def _noop(msg: str) -> None:
    pass


def _which(*tools) -> None:
    missing = [t for t in tools if not shutil.which(t) and not os.path.exists("/usr/sbin/" + t)
               and not os.path.exists("/sbin/" + t)]
    if missing:
        raise VmError("%s not found: install the VM lab packages (`make vm-setup`)" % ", ".join(missing))


# ---------------------------------------------------------------- image and box
def _kmatrix():
    spec = importlib.util.spec_from_file_location("mrc_kmatrix", os.path.join(ROOT, "tools", "kmatrix.py"))
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    return mod


def image() -> dict:
    return {"base": os.path.join(CACHE, "base.qcow2"), "kernel": os.path.join(CACHE, "vmlinuz"),
            "initrd": os.path.join(CACHE, "initrd.img"), "key": os.path.join(CACHE, "id_lab"),
            "info": os.path.join(CACHE, "build.json")}


def lab_key() -> str:
    """The lab's SSH key pair (CACHE/id_lab, ed25519), made on first use.  The guest
    image authorises it, the runners log in with it, and a rendering names it (`vagrant
    validate` wants the file to exist): whoever needs it first makes it, under a lock
    (two first users at once make one key), the private key renamed into place last.
    Returns the sha256 of the public key (build.json records the one the image took)."""
    key = image()["key"]
    try:
        os.makedirs(CACHE, exist_ok=True)
        with open(os.path.join(CACHE, ".id_lab.lock"), "w") as lk:
            fcntl.flock(lk, fcntl.LOCK_EX)
            if not (os.path.exists(key) and os.path.exists(key + ".pub")):
                _which("ssh-keygen")
                tmp = "%s.tmp%d" % (key, os.getpid())
                for f in (tmp, tmp + ".pub"):
                    with contextlib.suppress(FileNotFoundError):
                        os.unlink(f)
                r = subprocess.run(["ssh-keygen", "-q", "-t", "ed25519", "-N", "", "-C", "mrc-xdp-lab",
                                    "-f", tmp], capture_output=True, text=True, stdin=subprocess.DEVNULL)
                if r.returncode:
                    raise VmError("ssh-keygen: %s" % _last(r))
                os.replace(tmp + ".pub", key + ".pub")
                os.replace(tmp, key)
            with open(key + ".pub", "rb") as f:
                return hashlib.sha256(f.read()).hexdigest()
    except OSError as e:
        raise VmError("the lab's ssh key %s: %s (run as root, or set MRC_VM_CACHE to a directory "
                      "you can write)" % (key, e.strerror or e)) from None


# What of the checkout goes into the guest (and so, when changed, rebuilds the image):
# the package, the BPF sources, the set-up, the image recipe.  Tests, tools and docs do not.
GUEST_PATHS = ("mrc_xdp", "bpf", "scripts/setup.sh", "scripts/lib.sh", "setup.py", "pyproject.toml",
               "vagrant/build-image.sh", "vagrant/lab-init", "vagrant/lab-poweroff")


def guest_files() -> list[str]:
    """The checkout's files (tracked or not, minus ignored ones) that go into the guest."""
    files = subprocess.run(["git", "ls-files", "-c", "-o", "--exclude-standard", "--"] + list(GUEST_PATHS),
                           cwd=ROOT, capture_output=True, text=True, check=True).stdout.split("\n")
    return sorted(f for f in set(files) if f and os.path.isfile(os.path.join(ROOT, f)))


def source_digest(kver: str) -> str:
    """What the image depends on: the guest files, the kernel."""
    h = hashlib.sha256(kver.encode())
    for f in guest_files():
        p = os.path.join(ROOT, f)
        if os.path.isfile(p):
            h.update(f.encode() + b"\0")
            with open(p, "rb") as fh:
                h.update(hashlib.sha256(fh.read()).digest())
    return h.hexdigest()


def image_info() -> dict | None:
    try:
        with open(image()["info"]) as f:
            return json.load(f)
    except (OSError, ValueError):
        return None


def build_image(progress=_noop, force: bool = False) -> dict:
    """The guest image (cached).  Returns build.json: kver, digest, seconds, cached."""
    fabric.require_root()
    _which("debootstrap", "qemu-img", "mkfs.ext4", "ssh-keygen", "git", "chroot")
    km = _kmatrix()
    try:
        vmlinuz, kver = km.fetch(KERNEL)
    except km.KmError as e:
        raise VmError("guest kernel: %s" % e) from None
    kroot = os.path.dirname(os.path.dirname(vmlinuz))
    digest = source_digest(kver)
    key = lab_key()          # build-image.sh authorises it in the guest
    info = image_info()
    img = image()
    if not force and info and info.get("digest") == digest and info.get("key") == key and all(
            os.path.exists(img[k]) for k in ("base", "kernel", "initrd")):
        progress("guest image: cached (%s, kernel %s)" % (img["base"], kver))
        return dict(info, cached=True)
    t0 = time.monotonic()
    progress("guest image: building in %s (kernel %s; first build ~6-10 min, then ~1 min)" % (CACHE, kver))
    os.makedirs(CACHE, exist_ok=True)
    flist = os.path.join(CACHE, "guest-files.txt")
    with open(flist, "w") as f:
        # README.md: setup.py reads it (not hashed: a docs change needs no new image)
        f.write("\n".join(guest_files() + ["README.md"]) + "\n")
    env = dict(os.environ, OUT=CACHE, KROOT=kroot, KVER=kver, SRC=ROOT, FILES=flist)
    p = subprocess.Popen(["bash", os.path.join(VAGRANT_DIR, "build-image.sh")], env=env,
                         stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
    last = []
    for line in p.stdout:
        line = line.rstrip()
        last = (last + [line])[-8:]
        if "build-image:" in line:
            progress("  " + line)
    if p.wait():
        raise VmError("guest image build failed: %s" % (last[-1] if last else "exit %d" % p.returncode))
    info = {"digest": digest, "key": key, "kver": kver, "kernel": KERNEL, "built": time.time(),
            "seconds": round(time.monotonic() - t0, 1),
            "size_mb": round(os.path.getsize(img["base"]) / 2**20)}
    with open(img["info"], "w") as f:
        json.dump(info, f)
    progress("guest image: built in %.0f s (%d MB)" % (info["seconds"], info["size_mb"]))
    return dict(info, cached=False)


def _vagrant_env(extra: dict | None = None, lab: bool = True) -> dict:
    """lab=False: for `vagrant box ...`, which must not load the lab's Vagrantfile."""
    env = dict(os.environ, VAGRANT_CHECKPOINT_DISABLE="1", VAGRANT_DEFAULT_PROVIDER="libvirt")
    if lab:
        env["VAGRANT_CWD"] = VAGRANT_DIR
    else:
        env.pop("VAGRANT_CWD", None)
    env.update(extra or {})
    return env


def box_added() -> bool:
    if not shutil.which("vagrant"):
        return False
    r = subprocess.run(["vagrant", "box", "list", "--machine-readable"], capture_output=True,
                       text=True, env=_vagrant_env(lab=False), cwd=CACHE if os.path.isdir(CACHE) else "/",
                       timeout=120)
    return any(line.split(",")[3:4] == [BOX_NAME] for line in r.stdout.splitlines()
               if ",box-name," in line)


def build_box(progress=_noop, force: bool = False) -> dict:
    """Image (cached) -> mrc-xdp-lab.box (metadata.json, Vagrantfile, box.img) ->
    `vagrant box add mrc-xdp/lab`.  The box is re-added only when the image changed."""
    info = build_image(progress, force=force)
    _which("vagrant")
    box = os.path.join(CACHE, "mrc-xdp-lab.box")
    stamp = os.path.join(CACHE, "box.digest")
    if not force and info.get("cached") and box_added() and os.path.exists(stamp) \
            and open(stamp).read() == info["digest"]:
        progress("box %s: up to date" % BOX_NAME)
        return dict(info, box=box, box_cached=True)
    t0 = time.monotonic()
    img = image()
    vsize = json.loads(subprocess.run(["qemu-img", "info", "--output=json", img["base"]],
                                      capture_output=True, text=True, check=True).stdout)["virtual-size"]
    meta = json.dumps({"provider": "libvirt", "format": "qcow2", "virtual_size": -(-vsize // 2**30)})
    vf = 'Vagrant.configure("2") do |c|\n  c.vm.provider :libvirt do |lv|\n    lv.driver = "qemu"\n  end\nend\n'
    tmp = box + ".tmp"
    with tarfile.open(tmp, "w") as tar:
        for name, data in (("metadata.json", meta), ("Vagrantfile", vf)):
            ti = tarfile.TarInfo(name)
            ti.size = len(data.encode())
            import io
            tar.addfile(ti, io.BytesIO(data.encode()))
        tar.add(img["base"], arcname="box.img")
    os.replace(tmp, box)
    r = subprocess.run(["vagrant", "box", "add", "--force", "--name", BOX_NAME, box],
                       capture_output=True, text=True, env=_vagrant_env(lab=False), cwd=CACHE, timeout=600)
    if r.returncode:
        raise VmError("vagrant box add: %s" % _last(r))
    with open(stamp, "w") as f:
        f.write(info["digest"])
    progress("box %s added in %.1f s (%s)" % (BOX_NAME, time.monotonic() - t0, box))
    return dict(info, box=box, box_cached=False)


def _last(r) -> str:
    lines = [ln for ln in ((r.stderr or "") + (r.stdout or "")).strip().splitlines() if ln.strip()]
    return lines[-1].strip() if lines else "exit %d" % r.returncode


# ---------------------------------------------------------------- accelerator
def accel() -> tuple[str, str]:
    """("kvm"|"tcg", why).  MRC_LAB_ACCEL=kvm|tcg overrides."""
    forced = os.environ.get("MRC_LAB_ACCEL")
    if forced in ("kvm", "tcg"):
        return forced, "MRC_LAB_ACCEL=%s" % forced
    if not os.path.exists("/dev/kvm"):
        return "tcg", "no /dev/kvm"
    if os.path.isdir("/sys/module/kvm_pvm"):
        return "tcg", "/dev/kvm is PVM (paravirtual KVM: stock guest kernels run ~100x slower than TCG)"
    try:
        flags = open("/proc/cpuinfo").read()
    except OSError:
        flags = ""
    if " vmx" not in flags and " svm" not in flags:
        return "tcg", "the CPU shows no vmx/svm"
    if not os.access("/dev/kvm", os.R_OK | os.W_OK):
        return "tcg", "/dev/kvm is not accessible"
    return "kvm", "hardware KVM"


# ---------------------------------------------------------------- plan / render
def _port_free(port: int) -> bool:
    for kind in (socket.SOCK_STREAM, socket.SOCK_DGRAM):
        with socket.socket(socket.AF_INET, kind) as s:
            try:
                s.bind(("127.0.0.1", port))
            except OSError:
                return False
    return True


def _ports(prefix: str, count: int) -> int:
    """A base port with `count` free ports after it (TCP and UDP on 127.0.0.1)."""
    start = 20000 + (zlib.crc32(prefix.encode()) % 400) * 100
    for k in range(200):
        base = 20000 + (start - 20000 + k * 100) % 40000
        if all(_port_free(base + i) for i in range(count)):
            return base
    raise VmError("no %d free local ports for the VM lab's links" % count)


GUEST_METRICS_PORT = 9417      # `mrc-xdp metrics` in a host VM (the fleet role's default port)


def plan(topo: Topology, prefix: str, base_port: int | None = None) -> dict:
    """Every VM and its NICs.  Link k is UDP ports base+2k (lower end) and base+2k+1
    (upper end) on 127.0.0.1; VM i's sshd is forwarded from base+2L+i; host j's metrics
    endpoint (guest port GUEST_METRICS_PORT, when something serves it there: the fleet
    role) from base+2L+N+j (QEMU runner only), so a Prometheus on this machine scrapes
    the guests."""
    if topo.mtu > fabric.XDP_SINGLE_MAX_MTU:
        raise VmError("the VM lab keeps its MTUs at most %d (mtu %d): raising them after the load "
                      "is done for the netns lab only" % (fabric.XDP_SINGLE_MAX_MTU, topo.mtu))
    nlinks = len(topo.links)
    base = base_port if base_port is not None else _ports(prefix, 2 * nlinks + len(topo.nodes) + len(topo.hosts))
    link_idx = {lk.name: k for k, lk in enumerate(topo.links)}
    nodes = {}
    for i, (name, n) in enumerate(topo.nodes.items()):
        nics = []
        for p in n.ports:
            k = link_idx[p.link.name]
            lo = p.link.a is p
            mine, theirs = (base + 2 * k, base + 2 * k + 1) if lo else (base + 2 * k + 1, base + 2 * k)
            nics.append({"ifname": p.ifname, "mac": p.mac, "mtu": topo.mtu, "link": p.link.name,
                         "peer": p.peer.node, "local_port": mine, "remote_port": theirs})
        d = {"name": name, "vm": prefix + name, "kind": n.kind, "index": i,
             "memory": MEM_HOST if n.kind == "host" else MEM_SWITCH,
             "ssh_port": base + 2 * nlinks + i, "mgmt_mac": "52:54:00:%02x:%02x:01" % (i >> 8, i & 0xFF),
             "nics": nics, "veth": None}
        if n.kind == "host":
            h = topo.host(name)
            d["veth"] = {"app": "mrc0", "fab": "mrc0p", "mtu": topo.app_mtu,
                         "app_mac": fabric._mrc0_mac(h), "fab_mac": fabric._mrc0p_mac(h)}
            d["metrics_port"] = base + 2 * nlinks + len(topo.nodes) + h.index
        nodes[name] = d
    return {"prefix": prefix, "base_port": base, "nodes": nodes}


def render(topo: Topology, prefix: str, base_port: int | None = None) -> dict:
    """The JSON vagrant/Vagrantfile reads: the plan, the image, the accelerator."""
    a, why = accel()
    img = image()
    lab_key()                # named below: the Vagrantfile does not validate without it
    pl = plan(topo, prefix, base_port)
    return {"prefix": prefix, "topology": topo.summary(), "mode": topo.mode,
            "box": BOX_NAME, "kernel": img["kernel"], "initrd": img["initrd"],
            "ssh_key": img["key"], "cmdline": CMDLINE,
            "driver": "kvm" if a == "kvm" else "qemu", "accel_reason": why,
            "nodes": list(pl["nodes"].values()), "links": [lk.name for lk in topo.links],
            "base_port": pl["base_port"]}


# ---------------------------------------------------------------- node set-up (both runners)
def _parallel(fn, names, workers: int | None = None) -> dict:
    out, errors = {}, []
    with cf.ThreadPoolExecutor(max_workers=workers or len(names) or 1) as pool:
        futs = {pool.submit(fn, n): n for n in names}
        for f in cf.as_completed(futs):
            try:
                out[futs[f]] = f.result()
            except Exception as e:
                errors.append("%s" % e)
    if errors:
        raise VmError(sorted(errors)[0])
    return out


def setup_nodes(topo: Topology, prefix: str, execs: dict, pl: dict, progress=_noop,
                hosts: bool = True, datapaths: bool = True, linkmodel=True) -> dict:
    """Configure every VM with the lab's own functions, run over SSH.  datapaths=False:
    names, addresses and routes only (no bcc in the guests: the Vagrant smoke test).
    linkmodel: True (every node, as the netns lab), False, or the nodes that get it
    (each bcc build costs 1-4 min of a TCG guest's CPU)."""
    names = list(topo.nodes)
    t = time.monotonic()
    _parallel(lambda n: agent.call(
        execs[n], "wire_vm", ports=[{"ifname": c["ifname"], "mac": c["mac"], "mtu": c["mtu"]}
                          for c in pl["nodes"][n]["nics"]],
        veth=pl["nodes"][n]["veth"], sysctls=fabric.node_sysctls(topo, n)), names)
    progress("  NICs named by MAC, mrc0/mrc0p on hosts  %.1fs" % (time.monotonic() - t))
    t = time.monotonic()
    _parallel(lambda n: fabric.configure_links(execs[n], topo, n), names)
    _parallel(lambda n: fabric.configure_routes(execs[n], topo, n), names)
    progress("  addresses, static routes and neighbours (%s mode)  %.1fs" % (topo.mode, time.monotonic() - t))
    if not datapaths:
        return {}
    t = time.monotonic()
    lm_nodes = set(names) if linkmodel is True else set(linkmodel or ())
    busy = [n for n in names if n in lm_nodes or (hosts and topo.nodes[n].kind == "host")]

    def load(n):
        return agent.call(execs[n], "vm_datapaths", topo=topo.to_dict(), prefix=prefix, node=n,
                          pin_dir=fabric.pin_dir(prefix), hosts=hosts, linkmodel=n in lm_nodes)
    # One build of each program for all the VMs (bpfcache): the guests' builds kept here
    # go into every VM first; then one host and one link-model node load (and compile what
    # no VM built before), their builds go to the others, and the others load from them.
    # Each bcc build is 1-4 min of a TCG guest's CPU; replayed, a few seconds.
    store = guest_bpf_cache()
    kept = bpfcache.entries(store)
    if kept:
        _parallel(lambda n: agent.call(execs[n], "bpf_cache_put", entries=kept), busy)
    first = [n for n in busy if hosts and topo.nodes[n].kind == "host"][:1]
    if not first or first[0] not in lm_nodes:
        first += [n for n in busy if n in lm_nodes and n not in first][:1]
    rest = [n for n in busy if n not in first]
    res = _parallel(load, first) if first else {}
    t1 = time.monotonic() - t
    built = {}
    for n in first:
        built.update(agent.call(execs[n], "bpf_cache_get"))
    new = bpfcache.import_entries(built, store)
    if rest:
        _parallel(lambda n: agent.call(execs[n], "bpf_cache_put", entries=built), rest)
        res.update(_parallel(load, rest))
    progress("  link model on %d VMs%s (bcc in the guests: %s, %.0fs; the other %d VMs from their builds)  %.1fs"
             % (len(lm_nodes), ", host datapaths" if hosts else "", ", ".join(first), t1, len(rest),
                time.monotonic() - t))
    if new:
        progress("  %d guest BPF build(s) kept in %s for the next VM lab" % (len(new), store))
    return res


def control_path(topo: Topology, prefix: str, execs: dict, progress=_noop) -> dict:
    """The lab control path (ctlpath.lab_control_path, the netns lab's function, over
    SSH): every host gets one control address per plane, routed by that plane's switches,
    for the TCP bootstrap of `mrc-xdp send/recv/write-bw` (a host's plane-0 address is its
    control address).  Returns {host: [address per plane]}."""
    from mrc_xdp.transport import bootstrap
    from mrc_xdp.lab import ctlpath
    t = time.monotonic()
    try:
        addrs = ctlpath.lab_control_path(prefix, topo, execs=execs)
    except bootstrap.BootstrapError as e:
        raise VmError(str(e)) from None
    progress("  control path (TCP bootstrap addresses per plane)  %.1fs" % (time.monotonic() - t))
    return addrs


# ---------------------------------------------------------------- state
def state_path(prefix: str) -> str:
    return os.path.join(STATE_DIR, "vmlab-%s.json" % prefix)


def _write(st: dict) -> None:
    os.makedirs(STATE_DIR, exist_ok=True)
    tmp = state_path(st["prefix"]) + ".tmp"
    with open(tmp, "w") as f:
        json.dump(st, f, indent=1)
        f.flush()
        os.fsync(f.fileno())
    os.replace(tmp, state_path(st["prefix"]))


def load_state(prefix: str) -> dict:
    try:
        with open(state_path(prefix)) as f:
            return json.load(f)
    except FileNotFoundError:
        raise fabric.LabNotUp("VM lab %r is not up (no %s): run `mrc-xdp lab up --vm`"
                              % (prefix, state_path(prefix))) from None
    except ValueError:
        raise fabric.LabNotUp("VM lab %r: state file %s is damaged: run `mrc-xdp lab down --prefix %s`"
                              % (prefix, state_path(prefix), prefix)) from None


def is_vm_lab(prefix: str) -> bool:
    return os.path.exists(state_path(prefix))


def _rec(st: dict, kind: str, item) -> None:
    """Record before creating (as fabric.record does for the netns lab)."""
    st.setdefault("created", {}).setdefault(kind, []).append(item)
    _write(st)


def _qemu_pid(vm: dict) -> int | None:
    """The pid of a recorded QEMU, if that process still runs this VM."""
    try:
        pid = int(open(vm["pidfile"]).read().strip())
        cmd = open("/proc/%d/cmdline" % pid, "rb").read().split(b"\0")
    except (OSError, ValueError):
        return None
    return pid if b"-name" in cmd and vm["vm"].encode() in cmd else None


def execs_of(st: dict) -> dict:
    return {n: SshNode(n, argv) for n, argv in st["ssh"].items()}


def _new_state(topo: Topology, prefix: str, target: str) -> dict:
    fabric.require_root()
    fabric.check_prefix(prefix)
    if is_vm_lab(prefix):
        st = load_state(prefix)
        if st.get("complete"):
            raise fabric.LabAlreadyUp(dict(st, nodes=st.get("plan", {}).get("nodes", {})))
        down(prefix)
    if fabric.running(prefix):
        raise VmError("prefix %r is a running netns lab: pick another prefix" % prefix)
    a, why = accel()
    st = {"prefix": prefix, "target": target, "complete": False, "topology": topo.to_dict(),
          "topology_source": topo.source, "accel": a, "accel_reason": why, "started": time.time(),
          "owner": fabric.worker_record(os.getpid()), "created": {}}
    _write(st)
    return st


def _wait_ssh(execs: dict, timeout: float, progress, t0: float) -> None:
    pending = set(execs)
    deadline = time.monotonic() + timeout
    while pending and time.monotonic() < deadline:
        for n in sorted(pending):
            p = execs[n].run(["true"], timeout=20, check=False)
            if p.returncode == 0:
                pending.discard(n)
                progress("  %s: ssh up after %.0fs" % (n, time.monotonic() - t0))
        if pending:
            time.sleep(1)
    if pending:
        raise VmError("VMs not reachable over ssh after %d s: %s" % (timeout, ", ".join(sorted(pending))))


# ---------------------------------------------------------------- plain QEMU
def qemu_argv(st: dict, node: dict, run_dir: str, img: dict) -> list[str]:
    a = st["accel"]
    cmd = ["qemu-system-x86_64", "-name", node["vm"], "-accel", a,
           "-cpu", "max" if a == "tcg" else "host", "-smp", "1", "-m", str(node["memory"]),
           "-nodefaults", "-display", "none", "-no-reboot",
           "-serial", "file:" + os.path.join(run_dir, node["name"] + ".console"),
           "-kernel", img["kernel"], "-initrd", img["initrd"],
           "-append", "%s lab.host=%s lab.mgmt=%s" % (CMDLINE, node["name"], MGMT),
           "-drive", "file=%s,if=virtio,format=qcow2,cache=unsafe" % os.path.join(run_dir, node["name"] + ".qcow2"),
           "-netdev", "user,id=mgmt,restrict=on,hostfwd=tcp:127.0.0.1:%d-:22" % node["ssh_port"]
           + (",hostfwd=tcp:127.0.0.1:%d-:%d" % (node["metrics_port"], GUEST_METRICS_PORT)
              if node.get("metrics_port") else ""),
           "-device", "virtio-net-pci,netdev=mgmt,mac=%s" % node["mgmt_mac"]]
    for k, nic in enumerate(node["nics"]):
        cmd += ["-netdev", "socket,id=l%d,udp=127.0.0.1:%d,localaddr=127.0.0.1:%d"
                % (k, nic["remote_port"], nic["local_port"]),
                "-device", "virtio-net-pci,netdev=l%d,mac=%s" % (k, nic["mac"])]
    return cmd + ["-pidfile", os.path.join(run_dir, node["name"] + ".pid"), "-daemonize"]


def qemu_up(topo: Topology, prefix: str = fabric.DEFAULT_PREFIX, progress=_noop, hosts: bool = True,
            boot_timeout: float = 600, datapaths: bool = True, linkmodel=True) -> dict:
    """Boot one VM per node with plain QEMU, then set every node up.  Returns the state."""
    _which("qemu-system-x86_64", "qemu-img", "ssh")
    img_info = build_image(progress)
    img = image()
    st = _new_state(topo, prefix, "qemu")
    t_start = time.monotonic()
    try:
        pl = plan(topo, prefix)
        st["plan"] = pl
        run_dir = "/var/tmp/mrc-xdp-vmlab-%s" % prefix
        _rec(st, "dirs", run_dir)
        os.makedirs(run_dir, exist_ok=True)
        progress("%s on %d VMs (%s: %s)" % (topo.summary(), len(pl["nodes"]), st["accel"], st["accel_reason"]))
        st["ssh"] = {}
        for name, node in pl["nodes"].items():
            ov = os.path.join(run_dir, name + ".qcow2")
            subprocess.run(["qemu-img", "create", "-q", "-f", "qcow2", "-b", img["base"], "-F", "qcow2", ov],
                           check=True, capture_output=True)
            _rec(st, "vms", {"name": name, "vm": node["vm"], "pidfile": os.path.join(run_dir, name + ".pid")})
            r = subprocess.run(qemu_argv(st, node, run_dir, img), capture_output=True, text=True)
            if r.returncode:
                raise VmError("qemu %s: %s" % (name, _last(r)))
            st["ssh"][name] = ["ssh"] + SSH_OPTS + [
                "-o", "ControlMaster=auto", "-o", "ControlPath=%s/%s.ssh" % (run_dir, name),
                "-o", "ControlPersist=600", "-i", img["key"], "-p", str(node["ssh_port"]), "root@127.0.0.1"]
        _write(st)
        execs = execs_of(st)
        _wait_ssh(execs, boot_timeout, progress, t_start)
        st["boot_s"] = round(time.monotonic() - t_start, 1)
        progress("  %d VMs booted in %.0fs" % (len(execs), st["boot_s"]))
        return _set_up(st, topo, prefix, execs, pl, progress, hosts, datapaths, linkmodel, img_info,
                       t_start, "")
    except BaseException:
        progress("VM lab up failed: removing what was built")
        with contextlib.suppress(Exception):
            down(prefix)
        raise


def _set_up(st, topo, prefix, execs, pl, progress, hosts, datapaths, linkmodel, img_info, t_start,
            runner: str) -> dict:
    """The booted VMs of either runner become the lab: the node set-up (the netns lab's
    code over SSH), the lab control path, and the state marked complete."""
    st["hosts"] = setup_nodes(topo, prefix, execs, pl, progress, hosts=hosts, datapaths=datapaths,
                              linkmodel=linkmodel)
    st["control"] = control_path(topo, prefix, execs, progress)
    st["linkmodel"] = sorted(topo.nodes) if (linkmodel is True and datapaths) \
        else sorted(linkmodel or ()) if datapaths else []
    st["image"] = {"kver": img_info["kver"], "cached": img_info.get("cached")}
    st["complete"] = True
    st["up_s"] = round(time.monotonic() - t_start, 1)
    _write(st)
    progress("VM lab %r%s up in %.0fs" % (prefix, runner, st["up_s"]))
    return st


def _end_qemus(st: dict) -> list[str]:
    ended = []
    run_dirs = st.get("created", {}).get("dirs", [])
    for vm in st.get("created", {}).get("vms", []):
        for d in run_dirs:          # close the ssh control masters first
            ctl = os.path.join(d, vm["name"] + ".ssh")
            if os.path.exists(ctl):
                subprocess.run(["ssh", "-o", "ControlPath=" + ctl, "-O", "exit", "x"],
                               capture_output=True, timeout=10)
        pid = _qemu_pid(vm)
        if pid is None:
            continue
        with contextlib.suppress(ProcessLookupError):
            os.kill(pid, signal.SIGKILL)
        ended.append(vm["name"])
        for _ in range(100):
            if fabric._proc_start(pid) is None:
                break
            time.sleep(0.05)
    return ended


def fail(prefix: str, node: str) -> None:
    """A switch (or host) VM fails: its QEMU is frozen (SIGSTOP; on a Vagrant lab its
    libvirt domain is paused), so it forwards nothing and answers nothing; frames sent
    to it are lost.  heal() resumes it."""
    _signal_node(prefix, node, signal.SIGSTOP)


def heal(prefix: str, node: str) -> None:
    _signal_node(prefix, node, signal.SIGCONT)


def _signal_node(prefix: str, node: str, sig) -> None:
    st = load_state(prefix)
    if st.get("target") == "vagrant":
        # the libvirt domain (vagrant-libvirt names it <prefix><node>) is paused and
        # resumed: the same as freezing the QEMU process, through its owner
        now = _vagrant_run_state(prefix, node)
        if now == "gone":
            raise VmError("no running VM %r in lab %r" % (node, prefix))
        op = "suspend" if sig == signal.SIGSTOP else "resume"
        if now == ("frozen" if op == "suspend" else "running"):
            return
        p = subprocess.run(VIRSH + [op, prefix + node], capture_output=True, text=True, timeout=60)
        if p.returncode:
            raise VmError("virsh %s %s: %s" % (op, prefix + node, _last(p)))
        return
    if st.get("target") != "qemu":
        raise VmError("fail/heal of a VM: lab %r is neither a QEMU nor a Vagrant lab" % prefix)
    vm = next((v for v in st.get("created", {}).get("vms", []) if v["name"] == node), None)
    pid = _qemu_pid(vm) if vm else None
    if pid is None:
        raise VmError("no running VM %r in lab %r" % (node, prefix))
    os.kill(pid, sig)


def linkmodel_nodes(st: dict) -> list[str]:
    """The VMs that run the link model (`lab up --vm` loads it on all unless told not to)."""
    lm = st.get("linkmodel")
    return sorted(st.get("plan", {}).get("nodes", {})) if lm is None else list(lm)


def set_link(prefix: str, target: str | None, node_ok: bool = False, warn=None, **changes) -> list[str]:
    """`lab link set` / `lab fail` / `lab heal` on a VM lab: the link ends named as in the
    netns lab (cli.resolve_ends), each changed by LinkModel.update in the VM that receives
    on it (executor agent ``link_update``).  Ends into a VM without the link model are
    not modelled: they are left out and named through warn(msg); none at all is an error.
    target None: every end.  Returns the ends changed."""
    from mrc_xdp.lab.links import resolve_ends
    st = load_state(prefix)
    if not st.get("complete"):
        raise fabric.LabNotUp("VM lab %r is not completely up (an `up` failed or is running): "
                              "run `mrc-xdp lab down --prefix %s` and `up` again" % (prefix, prefix))
    topo = topology_of(st)
    have = set(linkmodel_nodes(st))
    by_node, done, skipped = {}, [], []
    for name, rx, lk in resolve_ends(topo, target, node_ok=node_ok):
        if rx.node in have:
            by_node.setdefault(rx.node, []).append(rx.ifname)
            done.append(name)
        else:
            skipped.append((name, rx.node))
    if not done:
        raise VmError("%s: no link model at %s (VM lab %r runs it on %s only; `lab up --vm` without "
                      "--no-linkmodel loads it on every VM)"
                      % (target or "every link", ", ".join(e[0] for e in skipped), prefix, ", ".join(sorted(have)) or "none"))
    execs = execs_of(st)
    _parallel(lambda n: agent.call(execs[n], "link_update", pin_dir=fabric.pin_dir(prefix), ifnames=by_node[n],
                                      changes=changes, timeout=120), list(by_node))
    if skipped and target is not None and warn:
        warn("not modelled (no link model in VM %s): %s"
             % (", ".join(sorted({e[1] for e in skipped})), ", ".join(e[0] for e in skipped)))
    return done


def _qemu_run_state(vm: dict | None) -> str:
    """running, frozen (SIGSTOP: `lab vm fail`) or gone, from the recorded QEMU's pid."""
    pid = _qemu_pid(vm) if vm else None
    if pid is None:
        return "gone"
    try:
        stat = open("/proc/%d/stat" % pid).read()
    except OSError:
        return "gone"
    return "frozen" if stat[stat.rindex(")") + 2:][:1] in ("T", "t") else "running"


def _vagrant_run_state(prefix: str, node: str) -> str:
    """running, frozen (a paused domain: `lab vm fail`) or gone, from libvirt."""
    p = subprocess.run(VIRSH + ["domstate", prefix + node], capture_output=True, text=True, timeout=60)
    s = p.stdout.strip() if p.returncode == 0 else ""
    return {"running": "running", "paused": "frozen"}.get(s, "gone")


def status(prefix: str, timeout: float = 120) -> dict:
    """`lab status` of a VM lab, the netns lab's shape (cli.status): nodes (where each
    runs: its VM, running / frozen / gone / unreachable) and every link end with the link
    model's settings and counters, read in the VM that receives on it (executor agent
    ``link_status``, one call per VM, in parallel).  An end into a VM without the link
    model, or into one that is frozen or does not answer, is named with the reason."""
    from mrc_xdp.lab.links import link_row, node_row, resolve_ends
    st = load_state(prefix)
    if not st.get("complete"):
        raise fabric.LabNotUp("VM lab %r is not completely up (an `up` failed or is running): "
                              "run `mrc-xdp lab down --prefix %s` and `up` again" % (prefix, prefix))
    topo = topology_of(st)
    execs = execs_of(st)
    have = set(linkmodel_nodes(st))
    vms = {v["name"]: v for v in st.get("created", {}).get("vms", [])}
    ends = resolve_ends(topo, None)
    state = {}
    if st.get("target") == "qemu":
        state = {n: _qemu_run_state(vms.get(n)) for n in topo.nodes}
    elif st.get("target") == "vagrant":
        state = {n: _vagrant_run_state(prefix, n) for n in topo.nodes}
    want = {}
    for name, rx, lk in ends:
        if rx.node in have:
            want.setdefault(rx.node, []).append(rx.ifname)
    ask = [n for n in topo.nodes if state.get(n, "running") == "running"]

    def probe(n):
        try:
            if n in want:
                return agent.call(execs[n], "link_status", pin_dir=fabric.pin_dir(prefix), ifnames=want[n],
                                     timeout=timeout)
            execs[n].run(["true"], timeout=min(timeout, 30))
            return {}
        except Exception as e:          # named in the output, not fatal
            return e
    got = _parallel(probe, ask) if ask else {}
    for n in ask:
        state[n] = "unreachable" if isinstance(got.get(n), Exception) else "running"
    links = []
    for name, rx, lk in ends:
        r = got.get(rx.node)
        end = r.get(rx.ifname) if isinstance(r, dict) else None
        if end:
            row = link_row(name, rx, lk, end["ifindex"], end["cfg"], end["backlog"], end["counters"])
        else:
            row = link_row(name, rx, lk, None, None, None, None)
            row["why"] = ("VM %s is %s" % (rx.node, state[rx.node]) if state[rx.node] != "running"
                          else "not modelled: no link model in VM %s" % rx.node)
        links.append(row)
    nodes = [node_row(topo, n, vm=prefix + n, exists=state[n] == "running", state=state[n])
             for n in topo.nodes]
    hosts = {n: (d or {}).get("host") for n, d in (st.get("hosts") or {}).items() if (d or {}).get("host")}
    return {"prefix": prefix, "target": st.get("target"), "accel": st.get("accel"), "mode": topo.mode,
            "topology": topo.summary(), "up_s": st.get("up_s"), "pin_dir": fabric.pin_dir(prefix),
            "hosts": hosts, "linkmodel": sorted(have), "nodes": nodes, "links": links}


# ---------------------------------------------------------------- Vagrant (vagrant-libvirt)
LIBVIRT_PIDS = ("/run/mrc-xdp/libvirtd.pid", "/run/mrc-xdp/virtlogd.pid")
VIRSH = ["virsh", "-c", "qemu:///system"]


def _iptables_chains() -> list[str]:
    out = []
    for ipt in ("iptables", "ip6tables"):
        if not shutil.which(ipt):
            continue
        for t in ("filter", "nat", "mangle"):
            r = subprocess.run([ipt, "-t", t, "-S"], capture_output=True, text=True)
            out += ["%s %s %s" % (ipt, t, ln.split()[1]) for ln in r.stdout.splitlines()
                    if ln.startswith("-N LIBVIRT_")]
    return out


def _libvirt_running() -> bool:
    return subprocess.run(VIRSH + ["version"], capture_output=True, timeout=30).returncode == 0 \
        if os.path.exists("/run/libvirt/libvirt-sock") else False


def libvirt_start(st: dict, progress=_noop) -> None:
    """Start virtlogd and libvirtd by hand (no systemd) unless they run; record what we
    started and the state we changed (the /dev/kvm mode, libvirt's iptables chains)."""
    if _libvirt_running():
        return
    _which("libvirtd", "virtlogd", "virsh")
    if os.path.exists("/dev/kvm"):
        s = os.stat("/dev/kvm")
        _rec(st, "kvm_mode", {"mode": s.st_mode & 0o7777, "gid": s.st_gid})
        # no udev here: libvirt probes QEMU as libvirt-qemu and loops forever without this
        subprocess.run(["chgrp", "kvm", "/dev/kvm"], check=False)
        os.chmod("/dev/kvm", 0o660)
    _rec(st, "iptables_before", _iptables_chains())
    os.makedirs("/run/mrc-xdp", exist_ok=True)
    os.makedirs("/run/libvirt", exist_ok=True)
    for exe, pidf in (("virtlogd", LIBVIRT_PIDS[1]), ("libvirtd", LIBVIRT_PIDS[0])):
        _rec(st, "daemons", {"exe": exe, "pidfile": pidf})
        subprocess.run([exe, "--daemon", "--pid-file", pidf], check=True, capture_output=True)
    for _ in range(100):
        if _libvirt_running():
            break
        time.sleep(0.2)
    else:
        raise VmError("libvirtd did not answer on /run/libvirt/libvirt-sock")
    if subprocess.run(VIRSH + ["pool-info", "default"], capture_output=True).returncode:
        _rec(st, "pools", "default")
        subprocess.run(VIRSH + ["pool-define-as", "default", "dir", "--target", "/var/lib/libvirt/images"],
                       check=True, capture_output=True)
    subprocess.run(VIRSH + ["pool-start", "default"], capture_output=True)
    progress("  libvirtd and virtlogd started (pid files %s)" % ", ".join(LIBVIRT_PIDS))


def _pool_volumes() -> list[str]:
    r = subprocess.run(VIRSH + ["vol-list", "default"], capture_output=True, text=True)
    return [ln.split()[0] for ln in r.stdout.splitlines()[2:] if ln.strip()]


def libvirt_stop(st: dict) -> None:
    """Undo libvirt_start: only what the state records."""
    cr = st.get("created", {})
    daemons = cr.get("daemons", [])
    if daemons and _libvirt_running():
        for pool in cr.get("pools", []):
            subprocess.run(VIRSH + ["pool-destroy", pool], capture_output=True)
            subprocess.run(VIRSH + ["pool-undefine", pool], capture_output=True)
    for d in reversed(daemons):
        try:
            pid = int(open(d["pidfile"]).read().strip())
            if os.path.basename(os.readlink("/proc/%d/exe" % pid)) != d["exe"]:
                continue
        except (OSError, ValueError):
            continue
        with contextlib.suppress(ProcessLookupError):
            os.kill(pid, signal.SIGTERM)
        for _ in range(100):
            if fabric._proc_start(pid) is None:
                break
            time.sleep(0.1)
        with contextlib.suppress(FileNotFoundError):
            os.unlink(d["pidfile"])
    if daemons:
        before = set(cr.get("iptables_before", [[]])[0] if cr.get("iptables_before") else [])
        for ch in _iptables_chains():
            if ch in before:
                continue
            ipt, table, name = ch.split()
            rules = subprocess.run([ipt, "-t", table, "-S"], capture_output=True, text=True).stdout
            for ln in rules.splitlines():
                if ln.startswith("-A ") and ln.endswith("-j " + name):
                    subprocess.run([ipt, "-t", table, "-D"] + ln.split()[1:], capture_output=True)
            subprocess.run([ipt, "-t", table, "-F", name], capture_output=True)
            subprocess.run([ipt, "-t", table, "-X", name], capture_output=True)
    for km in cr.get("kvm_mode", [])[:1]:
        with contextlib.suppress(OSError):
            os.chown("/dev/kvm", -1, km["gid"])
            os.chmod("/dev/kvm", km["mode"])


def vagrant_up(topo: Topology, prefix: str = fabric.DEFAULT_PREFIX, progress=_noop, hosts: bool = True,
               timeout: float = 1800, datapaths: bool = True, linkmodel=True) -> dict:
    """`vagrant up` of the rendered topology (vagrant-libvirt, UDP-tunnel links), then the
    same node set-up as the QEMU runner."""
    _which("vagrant", "ssh")
    img_info = build_box(progress)
    st = _new_state(topo, prefix, "vagrant")
    t_start = time.monotonic()
    try:
        work = "/var/tmp/mrc-xdp-vagrant-%s" % prefix
        _rec(st, "dirs", work)
        os.makedirs(work, exist_ok=True)
        r = render(topo, prefix)
        st["plan"] = {"prefix": prefix, "base_port": r["base_port"], "nodes": {n["name"]: n for n in r["nodes"]}}
        with open(os.path.join(work, "topology.json"), "w") as f:
            json.dump(r, f, indent=1)
        libvirt_start(st, progress)
        vols = _pool_volumes()
        st["vagrant"] = {"work": work, "volumes_before": vols}
        env = _vagrant_env({"VAGRANT_DOTFILE_PATH": os.path.join(work, ".vagrant"),
                            "MRC_LAB_JSON": os.path.join(work, "topology.json")})
        _rec(st, "vagrant", work)
        progress("%s on %d VMs: vagrant up (libvirt driver %s: %s)"
                 % (topo.summary(), len(r["nodes"]), r["driver"], r["accel_reason"]))
        p = subprocess.run(["vagrant", "up", "--provider", "libvirt"], env=env, capture_output=True,
                           text=True, timeout=timeout)
        if p.returncode:
            raise VmError("vagrant up: %s" % _last(p))
        st["boot_s"] = round(time.monotonic() - t_start, 1)
        progress("  vagrant up: %d VMs in %.0fs" % (len(r["nodes"]), st["boot_s"]))
        cfg = os.path.join(work, "ssh_config")
        p = subprocess.run(["vagrant", "ssh-config"], env=env, capture_output=True, text=True, timeout=300)
        if p.returncode:
            raise VmError("vagrant ssh-config: %s" % _last(p))
        with open(cfg, "w") as f:
            f.write(p.stdout)
        st["ssh"] = {n: ["ssh", "-F", cfg] + SSH_OPTS + [n] for n in st["plan"]["nodes"]}
        _write(st)
        execs = execs_of(st)
        _wait_ssh(execs, 300, progress, t_start)
        return _set_up(st, topo, prefix, execs, st["plan"], progress, hosts, datapaths, linkmodel,
                       img_info, t_start, " (vagrant)")
    except BaseException:
        progress("VM lab up failed: removing what was built")
        with contextlib.suppress(Exception):
            down(prefix)
        raise


MGMT_NET = "mrc-xdp-mgmt"      # vagrant/Vagrantfile's management_network_name


def _domains() -> list[str]:
    if not _libvirt_running():
        return []
    r = subprocess.run(VIRSH + ["list", "--all", "--name"], capture_output=True, text=True)
    return [d for d in r.stdout.split() if d]


def _vagrant_destroy(st: dict) -> None:
    for work in st.get("created", {}).get("vagrant", []):
        if not os.path.isdir(os.path.join(work, ".vagrant")):
            continue
        env = _vagrant_env({"VAGRANT_DOTFILE_PATH": os.path.join(work, ".vagrant"),
                            "MRC_LAB_JSON": os.path.join(work, "topology.json")})
        subprocess.run(["vagrant", "destroy", "-f"], env=env, capture_output=True, timeout=600)
    if st.get("created", {}).get("vagrant") and _libvirt_running():
        # the management network vagrant-libvirt made for the lab (destroy normally removes it)
        for net in (MGMT_NET,):
            others = [d for d in _domains() if not d.startswith(st["prefix"])]   # might use it
            if not others and subprocess.run(VIRSH + ["net-info", net], capture_output=True).returncode == 0:
                subprocess.run(VIRSH + ["net-destroy", net], capture_output=True)
                subprocess.run(VIRSH + ["net-undefine", net], capture_output=True)
    before = set((st.get("vagrant") or {}).get("volumes_before", []))
    if st.get("created", {}).get("vagrant") and _libvirt_running():
        for v in _pool_volumes():           # the box image vagrant uploaded for this lab
            if v not in before and v.startswith("mrc-xdp-VAGRANTSLASH-lab"):
                subprocess.run(VIRSH + ["vol-delete", "--pool", "default", v], capture_output=True)


# ---------------------------------------------------------------- down
def down(prefix: str, progress=_noop) -> dict:
    """Remove what VM lab `prefix` recorded: VMs, daemons it started, libvirt chains
    that appeared, its work directories, its state file."""
    fabric.require_root()
    fabric.check_prefix(prefix)
    t = time.monotonic()
    try:
        st = load_state(prefix)
    except fabric.LabNotUp:
        return {"prefix": prefix, "vms": [], "state_file": False, "down_s": 0.0}
    fabric._not_being_built(prefix, st)
    _vagrant_destroy(st)
    ended = _end_qemus(st)
    libvirt_stop(st)
    dirs = []
    for d in st.get("created", {}).get("dirs", []):
        if d.startswith("/var/tmp/mrc-xdp-") and os.path.isdir(d):
            shutil.rmtree(d, ignore_errors=True)
            dirs.append(d)
    for p in (state_path(prefix), state_path(prefix) + ".tmp"):
        with contextlib.suppress(FileNotFoundError):
            os.unlink(p)
    res = {"prefix": prefix, "target": st.get("target"), "vms": ended, "dirs": dirs,
           "state_file": True, "down_s": round(time.monotonic() - t, 1)}
    progress("VM lab %r down (%s): %d VMs ended, %d directories removed in %.1fs"
             % (prefix, st.get("target"), len(ended) or len(st.get("ssh", {})), len(dirs), res["down_s"]))
    return res


def leftovers(prefix: str) -> dict:
    """What a VM lab could have left (tests assert it is empty after down)."""
    qemus = []
    for pid in os.listdir("/proc"):
        if pid.isdigit():
            with contextlib.suppress(OSError):
                cmd = open("/proc/%s/cmdline" % pid, "rb").read().split(b"\0")
                if cmd and cmd[0].endswith(b"qemu-system-x86_64") and b"-name" in cmd:
                    name = cmd[cmd.index(b"-name") + 1].decode()
                    if name.startswith(prefix):
                        qemus.append(name)
    doms = [d for d in _domains() if d.startswith(prefix)]
    if doms:
        qemus += doms
    return {"qemu": qemus,
            "dirs": [d for d in ("/var/tmp/mrc-xdp-vmlab-%s" % prefix, "/var/tmp/mrc-xdp-vagrant-%s" % prefix)
                     if os.path.exists(d)],
            "state_file": [state_path(prefix)] if os.path.exists(state_path(prefix)) else []}


def topology_of(st: dict) -> Topology:
    return from_dict(st["topology"], source=st.get("topology_source", ""))
