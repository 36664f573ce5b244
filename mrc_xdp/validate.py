"""Checks for values read from TOML files (host config, lab topology).

Each raises the caller's error class with one line naming the key, e.g.
``hosts[0].t0: 2 is out of range [0, 1]`` or ``planes[1].nic: unknown key 'nic' (allowed: ...)``.
"""
from __future__ import annotations

try:
    import tomllib
except ImportError:  # Python 3.10 and older
    import tomli as tomllib


def read_toml(path: str, what: str, err: type[Exception]) -> dict:
    """The TOML file at path as a dict; a missing or invalid file is one line."""
    try:
        with open(path, "rb") as f:
            return tomllib.load(f)
    except FileNotFoundError:
        raise err("%s: no such %s file" % (path, what)) from None
    except tomllib.TOMLDecodeError as e:
        raise err("%s: not valid TOML: %s" % (path, e)) from None


def int_in(v, key: str, lo: int, hi: int, err: type[Exception]) -> int:
    if isinstance(v, bool) or not isinstance(v, int):
        raise err("%s: %r is not an integer" % (key, v))
    if not lo <= v <= hi:
        raise err("%s: %d is out of range [%d, %d]" % (key, v, lo, hi))
    return v


def no_unknown_keys(d: dict, allowed: set, where: str, err: type[Exception]) -> None:
    extra = sorted(set(d) - allowed)
    if extra:
        raise err("%s: unknown key %r (allowed: %s)" % (
            where + "." + extra[0] if where else extra[0], extra[0], ", ".join(sorted(allowed))))
