"""Instance names, and the paths built from them under the pin root and the state directory.

One rule for every name that enters (a config's ``instance``, ``--instance``,
``maps.Instance``, ``loader.load``/``unload``, metrics, the lab's <prefix><host>):
1-32 characters of ``[A-Za-z0-9_-]``, the first a letter or a digit.  So no ``.``/``..``,
no ``/``, no empty name, nothing that starts like an option, and /sys/fs/bpf/mrc/<name>/
plus any map name (<= 15 characters) stays a short path.

``confined(root, *parts)`` builds a path under root and checks that it resolves (realpath)
to exactly that path inside root: no ``..``, no symlink anywhere below root, root itself
not a symlink.  Every path the loader pins to, writes or removes goes through it.
"""
from __future__ import annotations

import os
import re

NAME_MAX = 32
RESERVED_PREFIX = "lab-"   # /sys/fs/bpf/mrc/lab-<prefix>/ holds a lab's link-model pins
RULE = ("1-%d letters, digits, '-' or '_', starting with a letter or digit, not starting "
        "with '%s'" % (NAME_MAX, RESERVED_PREFIX))
_NAME = re.compile(r"[A-Za-z0-9][A-Za-z0-9_-]{0,%d}" % (NAME_MAX - 1))


class BadName(ValueError):
    """A name or path that breaks the rule; the message is one line."""


def _show(v) -> str:
    r = repr(v)     # escapes newlines and control characters: the message stays one line
    return r if len(r) <= 40 else r[:37] + "..."


def is_valid(name) -> bool:
    """name is a safe single component of the pin root (an instance's or a lab's directory)."""
    return isinstance(name, str) and _NAME.fullmatch(name) is not None


def is_instance(name) -> bool:
    """name follows the instance rule: is_valid, and not in the lab's reserved namespace
    (an instance 'lab-x' would share the directory of lab x's link models)."""
    return is_valid(name) and not name.startswith(RESERVED_PREFIX)


def check_instance(name, what: str = "instance") -> str:
    """name if it follows the rule, else BadName (one line: what is wrong, what to use)."""
    if not is_instance(name):
        raise BadName("%s name %s is not allowed: use %s" % (what, _show(name), RULE))
    return name


def confined(root: str, *parts: str) -> str:
    """os.path.join(root, *parts), checked to resolve to itself inside root.

    parts are single path components (no '/', not '.' or '..', not empty)."""
    for p in parts:
        if not p or "/" in p or "\0" in p or p in (".", ".."):
            raise BadName("path component %s under %s is not allowed" % (_show(p), root))
    if os.path.islink(root):
        raise BadName("%s is a symbolic link: refusing to use it (remove it)" % root)
    path = os.path.join(root, *parts)
    want = os.path.join(os.path.realpath(root), *parts)
    if os.path.realpath(path) != want:
        raise BadName("%s resolves to %s, outside %s: refusing to use it (remove the link)"
                      % (path, os.path.realpath(path), root))
    return path
