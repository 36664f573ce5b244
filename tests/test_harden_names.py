"""Instance names cannot escape the pin root (issue 6, defect 1).

Everything runs in a child under ``unshare -m -n``: a private mount namespace with a
fresh bpf file system on /sys/fs/bpf and a fresh tmpfs on /run (so neither the host's
pins nor its state files are visible or reachable), and a private network namespace
with the devices a host config names.  There the child plants decoys (another tool's
pin under /sys/fs/bpf, another mrc instance's pins and state, a file next to the state
directory, a symlink from the pin root to the other tool's directory) and checks that

- `mrc-xdp unload --instance X` for '..', '.', '../x', 'a/b', '', and other bad names is a
  one-line error, exit 1, and removes nothing;
- a config with instance '..' (and --instance '..') is refused before anything is
  compiled or pinned; so is the library's loader.load/unload, maps.Instance and
  metrics.render with such a name;
- a good instance loads into a bpffs where /sys/fs/bpf/mrc does not exist yet, pins
  only under /sys/fs/bpf/mrc/<instance>, and unloads;
- every decoy survives all of it.
"""
from __future__ import annotations

import json
import os
import subprocess
import sys

import pytest

pytestmark = pytest.mark.skipif(os.geteuid() != 0, reason="needs root (mounts, XDP)")

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))

BAD = ["..", ".", "../x", "a/b", "", "../..", "./x", "x/..", "-x", ".hidden", "a" * 33, "a\nb",
       "a b", "évian", "evil"]

CHILD = r'''
import json, os, subprocess, sys
BAD = json.loads(sys.argv[1])
ROOT = sys.argv[2]
PY = sys.executable
problems, notes = [], []


def sh(*a):
    subprocess.run(list(a), check=True)


sh("mount", "--make-rprivate", "/")
sh("mount", "-t", "bpf", "bpf", "/sys/fs/bpf")
sh("mount", "-t", "tmpfs", "tmpfs", "/run")
os.makedirs("/run/mrc-xdp")
sh("ip", "link", "set", "lo", "up")
sh("ip", "link", "add", "mrc0", "type", "veth", "peer", "name", "mrc0p")
for p, q in (("p0", "q0"), ("p1", "q1")):
    sh("ip", "link", "add", p, "type", "veth", "peer", "name", q)
for d in ("mrc0", "mrc0p", "p0", "q0", "p1", "q1"):
    sh("ip", "link", "set", d, "up")

sys.path.insert(0, ROOT)
from mrc_xdp import bpfsys


def tree():
    out = []
    for top in ("/sys/fs/bpf", "/run"):
        for d, dirs, files in os.walk(top):
            out += [os.path.join(d, x) for x in sorted(dirs + files)]
    return sorted(out)


def toml(inst):
    return ('instance = "%s"\nmode = "ecmp"\nlocal_addr = "fd00:79::a"\n'
            '[[planes]]\ndev = "p0"\ngateway_mac = "02:00:00:00:00:01"\n'
            '[[planes]]\ndev = "p1"\ngateway_mac = "02:00:00:00:00:02"\n'
            '[[connections]]\npeer = "fd00:79::b"\nlocal_qpn = 0x1a0\nremote_qpn = 0x1b0\n' % inst)


def cli(*args):
    return subprocess.run([PY, "-m", "mrc_xdp.cli"] + list(args), capture_output=True, text=True,
                          cwd=ROOT, timeout=300)


def one_line_error(r, what):
    if r.returncode != 1 or "Traceback" in r.stderr or len(r.stderr.strip().splitlines()) != 1:
        problems.append("%s: exit %d, stderr %r" % (what, r.returncode, r.stderr[-600:]))
    else:
        notes.append("%s: %s" % (what, r.stderr.strip()))


# 1. a good instance in a bpffs without /sys/fs/bpf/mrc: the pin root is made, pins go there
with open("/tmp/good.toml", "w") as f:
    f.write(toml("mrc-h0"))
r = cli("load", "--config", "/tmp/good.toml")
if r.returncode != 0:
    problems.append("load mrc-h0: %r" % r.stderr[-800:])
else:
    pins = sorted(os.listdir("/sys/fs/bpf/mrc/mrc-h0"))
    top = sorted(set(os.listdir("/sys/fs/bpf")) - {"maps.debug", "progs.debug"})   # a fresh bpffs has these
    if "mrc_cfg" not in pins or "prog_spray" not in pins or top != ["mrc"]:
        problems.append("pins of mrc-h0: %s; /sys/fs/bpf: %s" % (pins, os.listdir("/sys/fs/bpf")))
    r = cli("unload", "--instance", "mrc-h0")
    if r.returncode != 0 or os.path.exists("/sys/fs/bpf/mrc/mrc-h0"):
        problems.append("unload mrc-h0: %r" % r.stderr[-800:])

# 2. decoys
os.makedirs("/sys/fs/bpf/othertool")
fd = bpfsys.map_create(2, 4, 4, 1, "decoy")
bpfsys.obj_pin(fd, "/sys/fs/bpf/othertool/decoy")
os.makedirs("/sys/fs/bpf/mrc/victim")
bpfsys.obj_pin(fd, "/sys/fs/bpf/mrc/victim/mrc_cfg")
os.close(fd)
with open("/run/mrc-xdp/victim.json", "w") as f:
    json.dump({"instance": "victim"}, f)
with open("/run/x.json", "w") as f:
    f.write("{}")
with open("/run/mrc-xdp/..json", "w") as f:
    f.write("{}")
os.symlink("/sys/fs/bpf/othertool", "/sys/fs/bpf/mrc/evil")
before = tree()

# 3. unload with bad names: one line, nothing removed
for name in BAD:
    one_line_error(cli("unload", "--instance=" + name), "unload --instance %r" % name)

# 4. load with instance '..': from the config and from --instance
with open("/tmp/dotdot.toml", "w") as f:
    f.write(toml(".."))
one_line_error(cli("load", "--config", "/tmp/dotdot.toml"), "load instance '..' (config)")
one_line_error(cli("load", "--config", "/tmp/good.toml", "--instance", ".."), "load --instance ..")

# 5. the library
from mrc_xdp import loader, maps, metrics, names
from mrc_xdp.datapath.config import HostConfig
cfg = HostConfig.from_toml("/tmp/good.toml")
for name in ("..", ".", "a/b", "", "evil/.."):
    cfg.instance = name
    for what, fn in (("loader.load", lambda: loader.load(cfg)),
                     ("loader.unload", lambda: loader.unload(name)),
                     ("maps.Instance", lambda: maps.Instance(name)),
                     ("metrics.render", lambda: metrics.render([name]))):
        try:
            fn()
            problems.append("%s(%r) was accepted" % (what, name))
        except (ValueError, loader.LoadError, maps.NotLoaded) as e:
            if "\n" in str(e):
                problems.append("%s(%r): not one line: %r" % (what, name, str(e)))
        except Exception as e:
            problems.append("%s(%r): %s: %s" % (what, name, type(e).__name__, e))
if not names.is_valid("mrc-h0") or not names.is_valid("t_1") or names.is_valid("a" * 33):
    problems.append("the name rule does not accept mrc-h0/t_1 or accepts 33 characters")

after = tree()
if after != before:
    problems.append("files changed: removed %s, added %s"
                    % (sorted(set(before) - set(after)), sorted(set(after) - set(before))))
print(json.dumps({"problems": problems, "notes": notes}))
'''


def test_bad_instance_names_never_escape_the_pin_root():
    r = subprocess.run(["unshare", "-m", "-n", "--", sys.executable, "-c", CHILD, json.dumps(BAD), ROOT],
                       capture_output=True, text=True, timeout=900)
    assert r.returncode == 0 and r.stdout.strip(), "child failed (%d): %s" % (r.returncode, r.stderr[-3000:])
    res = json.loads(r.stdout.strip().splitlines()[-1])
    print("\n".join(res["notes"]))
    assert res["problems"] == [], "\n".join(res["problems"])


def test_lab_prefix_is_reserved_for_link_model_pins():
    """/sys/fs/bpf/mrc/lab-<prefix>/ holds a lab's link models: an instance named lab-x
    (whose unload would remove lab x's pins) and a lab prefix lab-... are refused."""
    from mrc_xdp.datapath import config, maps, names
    from mrc_xdp.lab import fabric
    for bad in ("lab-", "lab-x", "lab-mrc-"):
        with pytest.raises(names.BadName, match="not starting with 'lab-'"):
            names.check_instance(bad)
        with pytest.raises(names.BadName):
            maps.pin_dir(bad)
    with pytest.raises(config.ConfigError, match="lab-"):
        config.HostConfig.from_dict({"instance": "lab-x", "local_addr": "fd00::1",
                                     "planes": [{"dev": "p0", "gateway_mac": "02:00:00:00:00:01"}]})
    with pytest.raises(fabric.LabError, match="lab-"):
        fabric.check_prefix("lab-x")
    assert names.check_instance("labx") == "labx" and fabric.check_prefix("mrc-") == "mrc-"
    r = subprocess.run([os.path.join(ROOT, ".venv", "bin", "mrc-xdp"), "unload", "--instance", "lab-x"], capture_output=True, text=True)
    assert r.returncode != 0 and "Traceback" not in r.stderr and len(r.stderr.strip().splitlines()) == 1, r.stderr
