"""Filters of the mrc_xdp role."""
from __future__ import annotations

try:
    from ansible.errors import AnsibleFilterError
except ImportError:             # outside Ansible (tests)
    AnsibleFilterError = ValueError


def mrc_xdp_denylist(text, source="deny-list"):
    """A deny-list file's text -> sorted list of EVs (ints).  One EV per line (0x... or
    decimal, 32 bits); '#' starts a comment; blank lines are ignored."""
    evs = set()
    for n, line in enumerate(str(text).splitlines(), 1):
        s = line.split("#", 1)[0].strip()
        if not s:
            continue
        try:
            v = int(s, 0)
        except ValueError:
            raise AnsibleFilterError("%s line %d: %r is not an EV (e.g. 0x3d3ec531)" % (source, n, s)) from None
        if not 0 <= v <= 0xFFFFFFFF:
            raise AnsibleFilterError("%s line %d: %s does not fit in 32 bits" % (source, n, s))
        evs.add(v)
    return sorted(evs)


def mrc_xdp_toml(value):
    """A TOML value: strings, numbers and booleans; lists (arrays) and dicts (inline tables)
    of them."""
    if isinstance(value, bool):
        return "true" if value else "false"
    if isinstance(value, (int, float)):
        return repr(value)
    if isinstance(value, str):
        import json
        return json.dumps(value)
    if isinstance(value, dict):
        return "{" + ", ".join("%s = %s" % (_key(k), mrc_xdp_toml(v)) for k, v in value.items()) + "}"
    if isinstance(value, (list, tuple)):
        return "[" + ", ".join(mrc_xdp_toml(v) for v in value) + "]"
    if value is None:
        raise AnsibleFilterError("TOML has no null: give the key a value or leave it out")
    raise AnsibleFilterError("cannot write %r (%s) as TOML" % (value, type(value).__name__))


def _key(k) -> str:
    import re
    k = str(k)
    return k if re.fullmatch(r"[A-Za-z0-9_-]+", k) else mrc_xdp_toml(k)


class FilterModule:
    def filters(self):
        return {"mrc_xdp_denylist": mrc_xdp_denylist, "mrc_xdp_toml": mrc_xdp_toml,
                "mrc_xdp_toml_key": _key}
