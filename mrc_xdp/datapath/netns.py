"""Named network namespaces, entered per thread with setns(2).

Compatible with ``ip netns``: a namespace NAME is a bind mount of a net namespace on
/run/netns/NAME, so ``ip -n NAME ...`` and ``nsenter --net=/run/netns/NAME`` see it too.

Unlike ``ip netns exec`` nothing here remounts /sys, so pinned BPF objects under
/sys/fs/bpf stay visible inside.  Only the calling *thread* changes namespace::

    from mrc_xdp import netns
    netns.create("mrc-h0")
    with netns.enter("mrc-h0"):
        sock = socket.socket(...)        # created inside mrc-h0, usable from anywhere
        subprocess.run(["ip", "addr"])   # a child forked here starts inside mrc-h0
    netns.run("mrc-h0", os.listdir, "/sys/class/net")   # any function, inside
    netns.run_cmd("mrc-h0", ["ping", "-6", "-c1", "fd00:100::2"])
    netns.delete("mrc-h0")
"""
from __future__ import annotations

import contextlib
import ctypes
import errno
import os
import subprocess

NETNS_RUN_DIR = "/run/netns"

CLONE_NEWNET = 0x40000000
MS_BIND = 0x1000
MS_REC = 0x4000
MS_SHARED = 1 << 20
MNT_DETACH = 2

_libc = ctypes.CDLL(None, use_errno=True)
_libc.setns.argtypes = [ctypes.c_int, ctypes.c_int]
_libc.unshare.argtypes = [ctypes.c_int]
_libc.mount.argtypes = [ctypes.c_char_p, ctypes.c_char_p, ctypes.c_char_p, ctypes.c_ulong, ctypes.c_void_p]
_libc.umount2.argtypes = [ctypes.c_char_p, ctypes.c_int]


NAME_MAX = 255      # a name is a file in /run/netns


class NetnsError(OSError):
    pass


class BadName(NetnsError, ValueError):
    """A name that is not a plain file name in /run/netns (still a ValueError, as before)."""


def _err(what: str) -> NetnsError:
    e = ctypes.get_errno()
    return NetnsError(e, "%s: %s" % (what, os.strerror(e)))


def check_name(name: str) -> str:
    """name, when it is a namespace name: one file name in /run/netns, as ip-netns makes
    them (1-255 bytes, no '/' or NUL, not '.' or '..'); BadName, one line, otherwise."""
    if not isinstance(name, str):
        raise BadName(errno.EINVAL, "netns name %r: expected a string" % (name,))
    why = None
    if not name:
        why = "is empty"
    elif name in (".", ".."):
        why = "is a directory, not a namespace"
    elif "/" in name or "\0" in name:
        why = "must not contain '/' or NUL"
    elif len(os.fsencode(name)) > NAME_MAX:
        why = "is longer than %d bytes" % NAME_MAX
    if why:
        shown = name if len(name) <= 40 else name[:37] + "..."
        raise BadName(errno.EINVAL, "netns name %r %s (a name in %s)" % (shown, why, NETNS_RUN_DIR))
    return name


def path(name: str) -> str:
    return os.path.join(NETNS_RUN_DIR, check_name(name))


def exists(name: str) -> bool:
    return os.path.exists(path(name))


def list_names(prefix: str = "") -> list[str]:
    try:
        names = os.listdir(NETNS_RUN_DIR)
    except FileNotFoundError:
        return []
    return sorted(n for n in names if n.startswith(prefix))


def _ensure_run_dir() -> None:
    """Make /run/netns a shared mount point, as iproute2 does (idempotent)."""
    os.makedirs(NETNS_RUN_DIR, exist_ok=True)
    d = NETNS_RUN_DIR.encode()
    if _libc.mount(b"none", d, b"none", MS_SHARED | MS_REC, None) == 0:
        return
    if ctypes.get_errno() != errno.EINVAL:
        raise _err("make %s shared" % NETNS_RUN_DIR)
    if _libc.mount(d, d, b"none", MS_BIND | MS_REC, None) != 0:
        raise _err("bind %s" % NETNS_RUN_DIR)
    if _libc.mount(b"none", d, b"none", MS_SHARED | MS_REC, None) != 0:
        raise _err("make %s shared" % NETNS_RUN_DIR)


_run_dir_ok = False


def _self_fd() -> int:
    return os.open("/proc/thread-self/ns/net", os.O_RDONLY | os.O_CLOEXEC)


def _setns(fd: int, what: str) -> None:
    if _libc.setns(fd, CLONE_NEWNET) != 0:
        raise _err("setns %s" % what)


def create(name: str, exist_ok: bool = False) -> str:
    """Create the named netns (like ``ip netns add``); returns its path."""
    global _run_dir_ok
    p = path(name)
    if not _run_dir_ok:
        _ensure_run_dir()
        _run_dir_ok = True
    try:
        fd = os.open(p, os.O_RDONLY | os.O_CREAT | os.O_EXCL, 0)
        os.close(fd)
    except FileExistsError:
        if exist_ok:
            return p
        raise NetnsError(errno.EEXIST, "netns %s already exists" % name) from None
    orig = _self_fd()
    try:
        if _libc.unshare(CLONE_NEWNET) != 0:
            raise _err("unshare netns %s" % name)
        try:
            if _libc.mount(b"/proc/thread-self/ns/net", p.encode(), b"none", MS_BIND, None) != 0:
                raise _err("bind netns %s" % name)
        finally:
            _setns(orig, "back to the original netns")
    except BaseException:
        with contextlib.suppress(OSError):
            os.unlink(p)
        raise
    finally:
        os.close(orig)
    return p


def delete(name: str) -> bool:
    """Delete the named netns (like ``ip netns del``). False when it did not exist.

    The kernel destroys the namespace (and the veths in it) once no process or
    socket holds it any more.
    """
    p = path(name)
    if not os.path.exists(p):
        return False
    _libc.umount2(p.encode(), MNT_DETACH)  # EINVAL: not mounted (half-created); unlink anyway
    try:
        os.unlink(p)
    except FileNotFoundError:
        return False
    return True


def open_fd(name: str) -> int:
    """An fd of the named netns (close it yourself); for pyroute2's net_ns_fd and setns."""
    try:
        return os.open(path(name), os.O_RDONLY | os.O_CLOEXEC)
    except FileNotFoundError:
        raise NetnsError(errno.ENOENT, "netns %s does not exist" % name) from None


@contextlib.contextmanager
def enter(name: str | None):
    """Run the body with the current thread inside netns `name` (None: stay put)."""
    if name is None:
        yield
        return
    target = open_fd(name)
    orig = _self_fd()
    try:
        _setns(target, name)
        try:
            yield
        finally:
            _setns(orig, "back to the original netns")
    finally:
        os.close(target)
        os.close(orig)


def run(name: str | None, fn, *args, **kwargs):
    """fn(*args, **kwargs) with the current thread inside netns `name`."""
    with enter(name):
        return fn(*args, **kwargs)


def run_cmd(name: str | None, argv, check: bool = True, capture: bool = True,
            timeout: float | None = 60, **kwargs) -> subprocess.CompletedProcess:
    """Run a command inside netns `name` (the child is forked from a thread inside it)."""
    if capture:
        kwargs.setdefault("stdout", subprocess.PIPE)
        kwargs.setdefault("stderr", subprocess.PIPE)
        kwargs.setdefault("text", True)
    with enter(name):
        return subprocess.run(list(argv), check=check, timeout=timeout, **kwargs)


def sysctl(name: str | None, key: str, value) -> None:
    """Write a net.* sysctl inside netns `name` (key in dotted form)."""
    with enter(name):
        with open("/proc/sys/" + key.replace(".", "/"), "w") as f:
            f.write(str(value))


def read_sysctl(name: str | None, key: str) -> str:
    with enter(name):
        with open("/proc/sys/" + key.replace(".", "/")) as f:
            return f.read().strip()
