"""Checks for values read from TOML files (host config, lab topology).

One set of validators for both loaders.  Types are checked as TOML gives them: an
integer is an int but not a bool, a boolean only a bool, an address or a name only a
string.  Each raises the caller's error class with one printable line naming the key,
e.g. ``hosts[0].t0: 2 is out of range [0, 1]`` or
``planes[1].nic: unknown key 'nic' (allowed: ...)``; values from the file appear in it
as short reprs (control characters escaped, long strings and huge integers abridged).
"""
from __future__ import annotations

import ipaddress
import os
import re
import reprlib
import stat

try:
    import tomllib
except ImportError:  # Python 3.10 and older
    import tomli as tomllib

MAX_FILE_BYTES = 1 << 20        # a host config or topology is a few KB
MAX_SHOW = 80                   # characters of a value quoted in a message

_PLAIN_KEY = re.compile(r"^[A-Za-z0-9_-]{1,40}$")
_MAC = re.compile(r"^([0-9a-fA-F]{2}:){5}[0-9a-fA-F]{2}$")


class _Repr(reprlib.Repr):
    def __init__(self):
        super().__init__()
        self.maxstring = 50
        self.maxother = 50
        self.maxlist = self.maxdict = 4
        self.maxlevel = 2

    def repr_int(self, x, level):
        if x.bit_length() > 64:     # repr() refuses past 4300 digits; nobody reads 20
            return "<%d-bit integer>" % x.bit_length()
        return repr(x)


_repr = _Repr()


def show(v) -> str:
    """v as it may appear in a one-line message: a short repr, control characters escaped."""
    s = _repr.repr(v)
    return s if len(s) <= MAX_SHOW else s[:MAX_SHOW - 3] + "..."


def keyname(k) -> str:
    """A key as written in a message: bare when plain, else quoted like a value."""
    return k if isinstance(k, str) and _PLAIN_KEY.fullmatch(k) else show(k)


def _path(p) -> str:
    s = os.fsdecode(p) if isinstance(p, (bytes, os.PathLike)) else str(p)
    return s if s.isprintable() and len(s) <= 200 else show(s)


def read_toml(path: str, what: str, err: type[Exception]) -> dict:
    """The TOML file at path as a dict.  A missing, unreadable, special (directory, FIFO,
    device), oversized (MAX_FILE_BYTES), non-UTF-8 or invalid file is one line."""
    p = _path(path)
    try:
        fd = os.open(path, os.O_RDONLY | os.O_NONBLOCK | os.O_NOCTTY | os.O_CLOEXEC)
    except FileNotFoundError:
        raise err("%s: no such %s file" % (p, what)) from None
    except (OSError, ValueError, TypeError) as e:   # ValueError: a NUL in the path
        raise err("%s: cannot open the %s file: %s" % (p, what, getattr(e, "strerror", None) or e)) from None
    try:
        st = os.fstat(fd)
        if not stat.S_ISREG(st.st_mode):
            os.close(fd)
            m = st.st_mode
            kind = "a directory" if stat.S_ISDIR(m) else "a FIFO" if stat.S_ISFIFO(m) else \
                "a device" if stat.S_ISCHR(m) or stat.S_ISBLK(m) else "a socket" if stat.S_ISSOCK(m) else \
                "not a regular file"
            raise err("%s: %s, not a %s file" % (p, kind, what))
        if st.st_size > MAX_FILE_BYTES:
            os.close(fd)
            raise err("%s: %d bytes, larger than a %s file may be (%d)" % (p, st.st_size, what, MAX_FILE_BYTES))
        with os.fdopen(fd, "rb") as f:
            raw = f.read(MAX_FILE_BYTES + 1)    # /proc files say size 0
    except OSError as e:
        raise err("%s: cannot read the %s file: %s" % (p, what, e.strerror or e)) from None
    if len(raw) > MAX_FILE_BYTES:
        raise err("%s: larger than a %s file may be (%d bytes)" % (p, what, MAX_FILE_BYTES))
    try:
        text = raw.decode("utf-8")
    except UnicodeDecodeError as e:
        raise err("%s: not UTF-8 text (byte %d is %#04x): a %s file is TOML, in UTF-8"
                  % (p, e.start, raw[e.start], what)) from None
    try:
        return tomllib.loads(text)
    except tomllib.TOMLDecodeError as e:
        raise err("%s: not valid TOML: %s" % (p, e)) from None
    except ValueError as e:         # an integer of more than 4300 decimal digits
        raise err("%s: not valid TOML: %s" % (p, str(e).split(";")[0])) from None
    except RecursionError:
        raise err("%s: not valid TOML: arrays or tables nested too deeply" % p) from None


# ---------------------------------------------------------------- values
def int_in(v, key: str, lo: int, hi: int, err: type[Exception]) -> int:
    if isinstance(v, bool) or not isinstance(v, int):
        raise err("%s: %s is not an integer" % (key, show(v)))
    if not lo <= v <= hi:
        raise err("%s: %s is out of range [%d, %d]" % (key, show(v), lo, hi))
    return v


def boolean(v, key: str, err: type[Exception]) -> bool:
    if not isinstance(v, bool):
        raise err("%s: %s is not a boolean (write true or false, unquoted)" % (key, show(v)))
    return v


def string(v, key: str, err: type[Exception], maxlen: int = 64) -> str:
    """A non-empty printable string of at most maxlen characters."""
    if not isinstance(v, str) or not v:
        raise err("%s: expected a non-empty string, got %s" % (key, show(v)))
    if len(v) > maxlen or not v.isprintable():
        raise err("%s: %s must be at most %d printable characters" % (key, show(v), maxlen))
    return v


def choice(v, key: str, choices, err: type[Exception]) -> str:
    if not isinstance(v, str) or v not in choices:
        raise err("%s: %s must be %s" % (key, show(v), " or ".join(repr(c) for c in choices)))
    return v


def table(v, key: str, err: type[Exception]) -> dict:
    if not isinstance(v, dict):
        raise err("%s: expected a table ([%s]), got %s" % (key, key, show(v)))
    return v


def ifname(v, key: str, err: type[Exception]) -> str:
    """A Linux interface name: 1-15 characters, no '/', ':' or whitespace, not . or .."""
    if not isinstance(v, str) or not v or len(v) > 15 or v in (".", "..") or \
            not v.isprintable() or any(c in v for c in "/: \t") or not v.isascii():
        raise err("%s: %s is not an interface name (1-15 characters, no '/', ':' or spaces)"
                  % (key, show(v)))
    return v


def ipv6_addr(v, key: str, err: type[Exception], unicast: bool = False) -> str:
    """An IPv6 address, from a string only (never an integer); canonical form.
    unicast: not multicast, not ::."""
    a = None
    if isinstance(v, str) and "%" not in v:     # no scope ids (fe80::1%eth0)
        try:
            a = ipaddress.IPv6Address(v)
        except ValueError:
            pass
    if a is None:
        raise err("%s: %s is not an IPv6 address" % (key, show(v)))
    if unicast and (a.is_multicast or a.is_unspecified):
        raise err("%s: %s is not a unicast address" % (key, show(v)))
    return str(a)


def ipv6_net(v, key: str, err: type[Exception]) -> ipaddress.IPv6Network:
    """An IPv6 prefix "addr/len" (host bits ignored), from a string only."""
    net = None
    if isinstance(v, str) and "%" not in v:
        try:
            net = ipaddress.IPv6Network(v, strict=False)
        except ValueError:
            pass
    if net is None:
        raise err("%s: %s is not an IPv6 prefix" % (key, show(v)))
    return net


def unicast_mac(v, key: str, err: type[Exception]) -> str:
    """aa:bb:cc:dd:ee:ff, lower case; not multicast/broadcast (I/G bit), not all-zero."""
    if not isinstance(v, str) or not _MAC.fullmatch(v):
        raise err("%s: %s is not a MAC address (aa:bb:cc:dd:ee:ff)" % (key, show(v)))
    m = v.lower()
    if int(m[:2], 16) & 1:
        raise err("%s: %s is a %s address, not a unicast next hop" % (
            key, m, "broadcast" if m == "ff:ff:ff:ff:ff:ff" else "multicast"))
    if m == "00:00:00:00:00:00":
        raise err("%s: 00:00:00:00:00:00 is not a unicast next hop" % key)
    return m


def no_unknown_keys(d: dict, allowed: set, where: str, err: type[Exception]) -> None:
    extra = sorted(set(d) - allowed, key=str)
    if extra:
        k = keyname(extra[0])
        raise err("%s: unknown key %s (allowed: %s)" % (
            where + "." + k if where else k, show(extra[0]), ", ".join(sorted(allowed))))
