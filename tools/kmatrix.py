#!/usr/bin/env python3
"""Kernel matrix: run the datapath's tests under the Debian kernels users run.

    sudo .venv/bin/python tools/kmatrix.py fetch [KERNEL ...]      # download + unpack (cached)
    sudo .venv/bin/python tools/kmatrix.py run KERNEL [-- PYTEST ARGS]
    sudo .venv/bin/python tools/kmatrix.py list

KERNEL is a name of KERNELS below (6.1, 6.12, 7): each is the linux-image-amd64 of one
Debian suite.  `fetch` resolves that metapackage to its versioned linux-image package
(and, on newer suites, the linux-binary / linux-modules packages it depends on) against a
private apt sources list and lists directory, fetches them with `apt-get download` and
unpacks them with `dpkg -x` into /var/cache/mrc-xdp/kernels/<KERNEL>/root (then depmod).
Nothing is installed on the host.  A kernel already unpacked is not fetched again, so a
second run needs no network.

`run` boots that kernel under QEMU with TCG (never KVM: /dev/kvm may be a paravirtual
one that runs ordinary guests ~100x slower than TCG) through virtme-ng, whose guest uses
the host's own root file system read-only: the guest runs this checkout with the host's
venv, bcc and kernel headers tree (mrc_xdp.datapath.kheaders; the guest has no
/lib/modules/<ver>/build).  Inside, pytest runs the given tests (default: the verifier
test; tests/test_kernel_matrix.py passes it a sample of tier-1 cases, one bcc build for
all) and writes its output and exit code to a scratch directory the guest may write.  Exit code: pytest's
(0 = all passed); 3 = the guest did not report (boot failure or timeout: the console log
is printed).  The summary line is `kmatrix: KERNEL UNAME: RESULT (boot+run Ns)`.

virtme-ng comes from PyPI into its own venv (/var/cache/mrc-xdp/vng); it needs QEMU,
kmod and a static busybox (`make kmatrix-setup` installs all of it).
"""
from __future__ import annotations

import argparse
import glob
import os
import re
import shlex
import shutil
import subprocess
import sys
import tempfile
import time

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
CACHE = os.environ.get("MRC_KMATRIX_CACHE", "/var/cache/mrc-xdp/kernels")
VNG_VENV = os.environ.get("MRC_KMATRIX_VNG", "/var/cache/mrc-xdp/vng")
MIRROR = "http://deb.debian.org/debian"

# name: (Debian suite, uname -r prefix the booted kernel must show, what it is)
KERNELS = {
    "6.1": ("bookworm", "6.1.", "Debian 12 bookworm"),
    "6.12": ("bookworm-backports", "6.12.", "Debian 12 bookworm-backports (Debian 13's too)"),
    "7": ("trixie-backports", "7.", "Debian 13 trixie-backports (current 7.x)"),
}

# The default test selection run in each guest: every program loads (verifier test).
# tests/test_kernel_matrix.py passes its own sample of tier-1 cases.
DEFAULT_TESTS = ["tests/test_datapath_verifier.py"]

# Modules no guest of this matrix needs (hardware drivers), dropped after unpacking.
SLIM = ["sound", "drivers/gpu", "drivers/media", "drivers/infiniband", "drivers/staging",
        "drivers/usb", "drivers/net/wireless", "drivers/net/ethernet", "drivers/scsi",
        "drivers/iio", "drivers/hid", "drivers/input", "drivers/bluetooth", "drivers/isdn",
        "drivers/mmc", "drivers/nfc", "drivers/thunderbolt", "drivers/video",
        "net/bluetooth", "net/mac80211", "net/wireless"]


class KmError(RuntimeError):
    pass


def say(msg: str) -> None:
    print("kmatrix: %s" % msg, flush=True)


def kdir(name: str) -> str:
    return os.path.join(CACHE, name)


def unpacked(name: str):
    """(vmlinuz path, kernel release) of an unpacked kernel, or None."""
    root = os.path.join(kdir(name), "root")
    for vmlinuz in sorted(glob.glob(os.path.join(root, "boot", "vmlinuz-*"))):
        kver = os.path.basename(vmlinuz)[len("vmlinuz-"):]
        if os.path.isfile(os.path.join(root, "lib", "modules", kver, "modules.dep")):
            return vmlinuz, kver
    return None


def _run(cmd, **kw) -> str:
    p = subprocess.run(cmd, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, **kw)
    if p.returncode != 0:
        last = (p.stderr.strip().splitlines() or ["exit %d" % p.returncode])[-1]
        raise KmError("%s failed: %s" % (" ".join(cmd[:2]), last))
    return p.stdout


def fetch(name: str) -> tuple:
    """Download and unpack one kernel (no-op when already there); returns (vmlinuz, kver)."""
    if name not in KERNELS:
        raise KmError("unknown kernel %r: choose one of %s" % (name, ", ".join(KERNELS)))
    have = unpacked(name)
    if have:
        return have
    suite = KERNELS[name][0]
    base = kdir(name)
    apt = os.path.join(base, "apt")
    for d in ("lists/partial", "cache/archives/partial", "debs"):
        os.makedirs(os.path.join(apt, d), exist_ok=True)
    srclist = os.path.join(apt, "sources.list")
    with open(srclist, "w") as f:
        f.write("deb %s %s main\n" % (MIRROR, suite))
    # A private sources list, lists and cache directory: the host's apt state is untouched.
    opts = ["-o", "Dir::Etc::sourcelist=" + srclist, "-o", "Dir::Etc::sourceparts=-",
            "-o", "Dir::State::Lists=" + os.path.join(apt, "lists"),
            "-o", "Dir::Cache=" + os.path.join(apt, "cache"),
            "-o", "APT::Get::List-Cleanup=0", "-o", "Debug::NoLocking=1"]
    t0 = time.monotonic()
    say("%s: apt-get update (%s %s)" % (name, MIRROR, suite))
    try:
        _run(["apt-get", "-q"] + opts + ["update"])
    except KmError as e:
        raise KmError("cannot reach Debian's %s package lists (%s): kernel %s needs the "
                      "network once, then it is cached under %s" % (suite, e, name, base))
    out = _run(["apt-cache"] + opts + ["depends", "linux-image-amd64"])
    m = re.search(r"Depends: (linux-image-\d\S*)", out)
    if not m:
        raise KmError("%s: linux-image-amd64 depends on no versioned linux-image package" % suite)
    img = m.group(1)
    pkgs = [img] + re.findall(r"Depends: (linux-(?:binary|modules)-\d\S*)",
                              _run(["apt-cache"] + opts + ["depends", img]))
    say("%s: apt-get download %s" % (name, " ".join(pkgs)))
    debs = os.path.join(apt, "debs")
    for old in glob.glob(os.path.join(debs, "*.deb")):
        os.unlink(old)
    _run(["apt-get", "-q"] + opts + ["download"] + pkgs, cwd=debs)
    tmp = os.path.join(base, "root.tmp")
    shutil.rmtree(tmp, ignore_errors=True)
    for deb in sorted(glob.glob(os.path.join(debs, "*.deb"))):
        _run(["dpkg-deb", "-x", deb, tmp])
    kver = img[len("linux-image-"):]
    mods = os.path.join(tmp, "lib", "modules", kver)
    if not os.path.isdir(mods) and os.path.isdir(os.path.join(tmp, "usr", "lib", "modules", kver)):
        os.makedirs(os.path.join(tmp, "lib"), exist_ok=True)
        os.rename(os.path.join(tmp, "usr", "lib", "modules"), os.path.join(tmp, "lib", "modules"))
    os.makedirs(os.path.join(tmp, "boot"), exist_ok=True)
    vmlinuz = os.path.join(tmp, "boot", "vmlinuz-" + kver)
    if not os.path.isfile(vmlinuz) and os.path.isfile(os.path.join(mods, "vmlinuz")):
        shutil.copy(os.path.join(mods, "vmlinuz"), vmlinuz)   # newer packaging
    if not os.path.isfile(vmlinuz):
        raise KmError("%s: no vmlinuz in %s" % (name, " ".join(pkgs)))
    for sub in SLIM:
        shutil.rmtree(os.path.join(mods, "kernel", sub), ignore_errors=True)
    _run(["depmod", "-b", tmp, kver])
    for old in glob.glob(os.path.join(debs, "*.deb")):
        os.unlink(old)                                         # ~100 MB each, unpacked now
    dest = os.path.join(base, "root")
    shutil.rmtree(dest, ignore_errors=True)
    os.rename(tmp, dest)
    say("%s: %s unpacked in %.0f s" % (name, kver, time.monotonic() - t0))
    return unpacked(name)


def _headers_tree() -> str:
    sys.path.insert(0, ROOT)
    from mrc_xdp.datapath import kheaders
    env = dict(os.environ)
    # The guest mounts a tmpfs on /lib/modules: pass the tree by its real path.
    return os.path.realpath(kheaders.ensure(env))


def _vng() -> str:
    vng = os.path.join(VNG_VENV, "bin", "vng")
    if not os.access(vng, os.X_OK):
        raise KmError("virtme-ng is not installed (%s): run `make kmatrix-setup`" % vng)
    for tool in ("qemu-system-x86_64", "busybox", "depmod"):
        if not shutil.which(tool) and not os.path.exists("/usr/sbin/" + tool) \
                and not os.path.exists("/sbin/" + tool):
            raise KmError("%s not found: run `make kmatrix-setup`" % tool)
    return vng


GUEST_SCRIPT = r"""#!/bin/sh
# runs inside the guest (host root fs read-only; $OUT is writable, shared with the host)
OUT=%(out)s
uname -r > $OUT/uname
mountpoint -q /sys/fs/bpf || mount -t bpf bpf /sys/fs/bpf
# virtme-ng-init hides the host's /var/cache under a tmpfs: the kernel's modules and the
# merged headers tree live there (/var/cache/mrc-xdp)
[ "$(stat -f -c %%T /var/cache)" = tmpfs ] && umount /var/cache
cd %(root)s
export BCC_KERNEL_SOURCE=%(headers)s PYTHONDONTWRITEBYTECODE=1
start=$(cat /proc/uptime | cut -d' ' -f1)
%(py)s -m pytest -p no:cacheprovider -q -rfE %(args)s > $OUT/pytest.log 2>&1
echo $? > $OUT/rc.tmp
echo "boot_s=$start" > $OUT/times
mv $OUT/rc.tmp $OUT/rc
"""


def run(name: str, pytest_args, memory: str = "2G", cpus: int = 2, timeout: float = 600,
        keep: bool = False) -> int:
    vmlinuz, kver = fetch(name)
    vng = _vng()
    headers = _headers_tree()
    py = os.path.join(ROOT, ".venv", "bin", "python")
    if not os.access(py, os.X_OK):
        raise KmError("%s not found: run `make setup`" % py)
    out = tempfile.mkdtemp(prefix="mrc-kmatrix-%s-" % name, dir="/tmp")
    script = os.path.join(out, "run.sh")
    with open(script, "w") as f:
        f.write(GUEST_SCRIPT % dict(out=shlex.quote(out), root=shlex.quote(ROOT),
                                    headers=shlex.quote(headers), py=shlex.quote(py),
                                    args=" ".join(shlex.quote(a) for a in pytest_args)))
    os.chmod(script, 0o755)
    cmd = [vng, "--run", vmlinuz, "--disable-kvm", "--memory", memory, "--cpus", str(cpus),
           "--rwdir", out, "--verbose", "--exec", "sh " + script]
    console = os.path.join(out, "console.log")
    t0 = time.monotonic()
    say("%s: booting %s under QEMU TCG (%s, %d vCPU)" % (name, kver, memory, cpus))
    with open(console, "w") as log:
        # own session: on timeout the whole tree (vng, qemu) is ended by its group id
        p = subprocess.Popen(cmd, stdout=log, stderr=subprocess.STDOUT,
                             stdin=subprocess.DEVNULL, start_new_session=True,
                             env=dict(os.environ, PATH=os.path.join(VNG_VENV, "bin") + ":" +
                                      os.environ.get("PATH", "/usr/sbin:/usr/bin:/sbin:/bin")))
        try:
            p.wait(timeout=timeout)
        except subprocess.TimeoutExpired:
            os.killpg(p.pid, 9)
            p.wait()
    took = time.monotonic() - t0
    rc_file = os.path.join(out, "rc")
    log_text = open(os.path.join(out, "pytest.log")).read() \
        if os.path.exists(os.path.join(out, "pytest.log")) else ""
    uname = open(os.path.join(out, "uname")).read().strip() \
        if os.path.exists(os.path.join(out, "uname")) else "?"
    if not os.path.exists(rc_file):
        sys.stdout.write(open(console, errors="replace").read()[-4000:])
        sys.stdout.write(log_text[-4000:])
        say("%s %s: the guest did not report (%s after %.0f s); console log above"
            % (name, uname, "timeout" if took >= timeout else "boot or run failure", took))
        rc = 3
    else:
        rc = int(open(rc_file).read().strip() or 1)
        sys.stdout.write(log_text)
        last = (log_text.strip().splitlines() or ["no output"])[-1]
        say("%s %s: %s (boot+run %.0f s)" % (name, uname, last.strip("= "), took))
        if not uname.startswith(KERNELS[name][1]):
            say("%s: booted %s, expected a %s* kernel" % (name, uname, KERNELS[name][1]))
            rc = rc or 4
    if keep or rc not in (0,):
        say("%s: guest output kept in %s" % (name, out))
    else:
        shutil.rmtree(out, ignore_errors=True)
    return rc


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description="Boot Debian kernels under QEMU (TCG) and run "
                                 "the datapath tests inside them.")
    sub = ap.add_subparsers(dest="cmd", required=True)
    f = sub.add_parser("fetch", help="download and unpack kernels (cached)")
    f.add_argument("kernels", nargs="*", default=list(KERNELS))
    sub.add_parser("list", help="the kernels of the matrix and what is cached")
    r = sub.add_parser("run", help="boot KERNEL and run pytest in it")
    r.add_argument("kernel")
    r.add_argument("--memory", default="2G")
    r.add_argument("--cpus", type=int, default=2)
    r.add_argument("--timeout", type=float, default=600, help="seconds for boot + tests")
    r.add_argument("--keep", action="store_true", help="keep the guest's output directory")
    argv = sys.argv[1:] if argv is None else list(argv)
    pytest_args = argv[argv.index("--") + 1:] if "--" in argv else []
    argv = argv[:argv.index("--")] if "--" in argv else argv
    ap.epilog = "run KERNEL [options] -- PYTEST ARGS (default: the verifier test)"
    a = ap.parse_args(argv)
    if os.geteuid() != 0:
        print("kmatrix: error: run as root (it unpacks kernels under %s and boots them)" % CACHE,
              file=sys.stderr)
        return 2
    try:
        if a.cmd == "fetch":
            for k in a.kernels:
                vmlinuz, kver = fetch(k)
                say("%s: %s (%s)" % (k, kver, vmlinuz))
        elif a.cmd == "list":
            for k, (suite, _, what) in KERNELS.items():
                have = unpacked(k)
                print("%-5s %-20s %-48s %s" % (k, suite, what, have[1] if have else "not fetched"))
        else:
            return run(a.kernel, pytest_args or DEFAULT_TESTS, a.memory, a.cpus, a.timeout, a.keep)
    except KmError as e:
        print("kmatrix: error: %s" % e, file=sys.stderr)
        return 2
    return 0


if __name__ == "__main__":
    sys.exit(main())
