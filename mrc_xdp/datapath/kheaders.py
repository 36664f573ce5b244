"""Find or provide a kernel headers tree for bcc.

bcc compiles against /lib/modules/$(uname -r)/build.  When the running kernel has no
headers package (this project's CI kernel), a Debian linux-headers tree of another
version works for XDP programs: the split -common and -<arch> directories are merged
into one symlink farm under /var/cache/mrc-xdp/ and BCC_KERNEL_SOURCE points bcc at it.
A host that has matching headers is left alone.
"""
from __future__ import annotations

import glob
import os
import re
import shutil
import subprocess

CACHE = "/var/cache/mrc-xdp"


class HeadersError(RuntimeError):
    pass


def _usable(tree: str) -> bool:
    return os.path.isfile(os.path.join(tree, "include", "linux", "kconfig.h")) and \
        os.path.isdir(os.path.join(tree, "arch"))


def running_tree() -> str | None:
    build = "/lib/modules/%s/build" % os.uname().release
    return build if _usable(build) else None


def _debian_pairs():
    """(version, common_dir, arch_dir) for installed Debian header packages, newest first."""
    out = []
    for arch_dir in glob.glob("/usr/src/linux-headers-*"):
        m = re.match(r".*/linux-headers-(.+)-(amd64|arm64|cloud-amd64|cloud-arm64)$", arch_dir)
        if not m:
            continue
        common = "/usr/src/linux-headers-%s-common" % m.group(1)
        if os.path.isdir(common):
            out.append((m.group(1), common, arch_dir))
    def key(t):
        return [int(x) if x.isdigit() else 0 for x in re.split(r"[.-]", t[0])]
    return sorted(out, key=key, reverse=True)


def merged_tree(version: str, common: str, arch_dir: str) -> str:
    dest = os.path.join(CACHE, "kheaders-%s-%s" % (version, os.path.basename(arch_dir).rsplit("-", 1)[-1]))
    if _usable(dest):
        return dest
    tmp = dest + ".tmp"
    shutil.rmtree(tmp, ignore_errors=True)
    os.makedirs(tmp)
    for src in (common, arch_dir):
        subprocess.run(["cp", "-asf", src + "/.", tmp + "/"], check=True)
    os.replace(tmp, dest) if not os.path.exists(dest) else shutil.rmtree(tmp)
    if not _usable(dest):
        raise HeadersError("merged headers tree %s is incomplete" % dest)
    return dest


def ensure(env=os.environ) -> str:
    """Make bcc find a headers tree; returns its path. Idempotent, cheap when done."""
    cur = env.get("BCC_KERNEL_SOURCE")
    if cur and _usable(cur):
        return cur
    tree = running_tree()
    if tree:
        return tree
    pairs = _debian_pairs()
    if not pairs:
        raise HeadersError(
            "no kernel headers for bcc: install linux-headers-amd64 (run `make setup`), "
            "or set BCC_KERNEL_SOURCE to a kernel headers tree")
    tree = merged_tree(*pairs[0])
    env["BCC_KERNEL_SOURCE"] = tree
    return tree


if __name__ == "__main__":
    print(ensure())
