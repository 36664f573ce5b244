"""Fuzz the two TOML loaders: the host config (mrc_xdp.datapath.config) and the lab topology
(mrc_xdp.lab.topology).

Every input must give either a valid result or exactly the loader's error class
(ConfigError / TopologyError) whose message is one printable line of bounded length;
any other exception is a bug (a traceback for the user).  Valid results are checked
too: the types a TOML file cannot get wrong any more (addresses are strings, flags are
bools, gateway MACs are unicast) and, for topologies, the to_dict/from_dict round trip
the lab's state file relies on.

Inputs, from a fixed seed (MRC_FUZZ_SEED replays another), per loader:
- structural mutations of every shipped example, parsed: values replaced by other TOML
  types and edge values, keys removed, renamed to other schema keys or to odd names,
  values swapped and duplicated between keys, lists grown and shrunk;
- text mutations of the examples' TOML (bytes flipped or inserted, invalid UTF-8, lines
  deleted, duplicated or swapped, values replaced by other TOML literals, truncation)
  and random bytes, read through the file loader.
The examples: the host config of docs/config.md, the host configs of tests/helpers.py,
tests/test_config.py and tests/test_live_pair.py, mrc_xdp/lab/default.toml and the
topologies of tests/test_lab_topology.py.
"""
from __future__ import annotations

import copy
import datetime
import ipaddress
import os
import random
import re

import pytest

import helpers
import test_config
import test_lab_topology
import test_live_pair
from mrc_xdp.datapath.config import ConfigError, HostConfig
from mrc_xdp.lab import topology as T
from mrc_xdp.datapath.validate import tomllib

SEED = int(os.environ.get("MRC_FUZZ_SEED", "20260606"))
N_STRUCT = 2000     # structural mutations per loader
N_TEXT = 700        # text mutations and random bytes per loader
MAX_MSG = 400
CONFIG_DOC = os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))), "docs", "config.md")


# ---------------------------------------------------------------- the examples
def _readme_host_toml() -> str:
    text = open(CONFIG_DOC, encoding="utf-8").read()
    m = re.search(r"## Host config.*?```toml\n(.*?)```", text, re.S)
    assert m, "docs/config.md: no ```toml block under '## Host config'"
    return m.group(1)


def config_texts() -> list[str]:
    macs = ["02:11:22:33:44:01", "02:11:22:33:44:02"]
    return [_readme_host_toml(),
            test_live_pair.host_toml("fz", "fd00:77::a", "fd00:77::b", 0x1A0, 0x1B0, macs),
            test_live_pair.srv6_toml("fz", "fd00:77::a", "fd00:77::b", 0x1A0, 0x1B0, macs)]


def config_dicts() -> list[dict]:
    evs = [[0x10001, 0, 0], [0x20002, 0, 1], [0x30003, 1, 0], [0x40004, 1, 1]]
    out = [tomllib.loads(t) for t in config_texts()]
    out += [helpers._conf("ecmp"), helpers._conf("srv6"), test_config.conf(),
            test_config.conf(evs=evs, backup_evs=[[0x50005, 0, 1], [0x60006, 1, 0]])]
    return out


def topology_texts() -> list[str]:
    return [open(T.DEFAULT_TOPOLOGY, encoding="utf-8").read()]


def topology_dicts() -> list[dict]:
    return [tomllib.loads(t) for t in topology_texts()] + [
        test_lab_topology.base(), test_lab_topology.base(mode="ecmp", planes=1),
        {"planes": 1, "t0_per_plane": 1, "t1_per_plane": 1,
         "hosts": [{"name": "a", "t0": 0}, {"name": "b", "t0": 0}]},
        T.load().to_dict()]


def _keys(d, acc: set) -> set:
    if isinstance(d, dict):
        for k, v in d.items():
            acc.add(k)
            _keys(v, acc)
    elif isinstance(d, list):
        for v in d:
            _keys(v, acc)
    return acc


# ---------------------------------------------------------------- random values
ODD_CHARS = "\n\r\t\x00\x1b\u2028\u0085é%/.:\"'\\ ]=[#{}"
STRINGS = ["", " ", ".", "..", "a/b", "fd00::1", "fd00::1%eth0", "::", "ff02::1", "::1",
           "fd00:100::/48", "fd00::/64", "fcbb::", "1.2.3.4", "02:00:00:00:00:01",
           "ff:ff:ff:ff:ff:ff", "01:00:5e:00:00:01", "00:00:00:00:00:00", "03:00:00:00:00:01",
           "02:00:00:00:00:0g", "10gbit", "0", "1.5Tbit", "9" * 400 + "gbit", "no", "false",
           "true", "ecmp", "srv6", "p0", "p1", "mrc0", "mrc0p", "h0", "to_a", "x" * 16,
           "y" * 5000, "0x100", "-1"]


def rand_str(rng: random.Random) -> str:
    n = rng.choice([1, 2, 5, 20, 70])
    alphabet = "abcdef0123456789:" + ODD_CHARS
    return "".join(rng.choice(alphabet) for _ in range(n))


def rand_scalar(rng: random.Random):
    k = rng.randrange(10)
    if k == 0:
        return rng.choice([0, 1, -1, 2, 3, 7, 8, 63, 64, 255, 256, 65535, 65536, 0xFFFFFF,
                           0x1000000, 2**31, 2**32, 2**63, 2**64, -2**63])
    if k == 1:
        return rng.randrange(-2**70, 2**70)
    if k == 2:
        return 1 << rng.choice([100, 1000, 20000])      # a 0x... literal TOML parses
    if k == 3:
        return rng.choice([True, False])
    if k == 4:
        return rng.choice([0.0, -0.0, 0.5, 1.5, 1e300, -1e300, float("inf"), float("-inf"), float("nan")])
    if k == 5:
        return rng.choice([datetime.date(1979, 5, 27), datetime.time(7, 32),
                           datetime.datetime(1979, 5, 27, 7, 32, tzinfo=datetime.timezone.utc)])
    if k in (6, 7):
        return rng.choice(STRINGS)
    return rand_str(rng)


def rand_value(rng: random.Random, depth: int = 0):
    k = rng.randrange(10)
    if k < 7 or depth > 2:
        return rand_scalar(rng)
    if k < 9:
        return [rand_value(rng, depth + 1) for _ in range(rng.randrange(4))]
    return {rng.choice(["x", "dev", "name", rand_str(rng)]): rand_value(rng, depth + 1)
            for _ in range(rng.randrange(3))}


# ---------------------------------------------------------------- structural mutations
def _slots(d, acc: list) -> list:
    """Every (container, key-or-index) in the tree."""
    if isinstance(d, dict):
        for k in list(d):
            acc.append((d, k))
            _slots(d[k], acc)
    elif isinstance(d, list):
        for i in range(len(d)):
            acc.append((d, i))
            _slots(d[i], acc)
    return acc


def _containers(d, acc: list) -> list:
    if isinstance(d, (dict, list)):
        acc.append(d)
        for v in (d.values() if isinstance(d, dict) else d):
            _containers(v, acc)
    return acc


def mutate(rng: random.Random, doc: dict, schema_keys: list) -> dict:
    doc = copy.deepcopy(doc)
    for _ in range(rng.choice([1, 1, 2, 3])):
        slots = _slots(doc, [])
        op = rng.randrange(9)
        if not slots:
            doc[rng.choice(schema_keys)] = rand_value(rng)
            continue
        c, k = rng.choice(slots)
        v = c[k]
        if op == 0:                                   # another type / an edge value
            c[k] = rand_value(rng)
        elif op == 1:                                 # remove
            del c[k]
        elif op == 2 and isinstance(c, dict):         # rename to another schema key or an odd one
            nk = rng.choice(schema_keys) if rng.random() < 0.7 else rand_str(rng)
            c[nk] = c.pop(k)
        elif op == 3:                                 # swap two values
            c2, k2 = rng.choice(slots)
            try:
                c[k], c2[k2] = c2[k2], v
            except (KeyError, IndexError):            # one slot was inside the other
                pass
        elif op == 4:                                 # duplicate a value into another slot / key
            c2 = rng.choice(_containers(doc, []))
            val = copy.deepcopy(v)
            if isinstance(c2, list):
                c2.insert(rng.randrange(len(c2) + 1), val)
            else:
                c2[k if isinstance(k, str) and rng.random() < 0.5 else rng.choice(schema_keys)] = val
        elif op == 5:                                 # wrap / unwrap
            c[k] = v[0] if isinstance(v, list) and v else [v]
        elif op == 6 and isinstance(v, int) and not isinstance(v, bool):
            c[k] = rng.choice([v + 1, v - 1, -v, v * 2, v << 32, 0])
        elif op == 7 and isinstance(v, str):
            i = rng.randrange(len(v) + 1)
            c[k] = rng.choice([v[:i], v[:i] + rng.choice(ODD_CHARS) + v[i:], v.upper(), v * 3])
        else:                                         # a value that is another key's
            c2, k2 = rng.choice(slots)
            c[k] = copy.deepcopy(c2[k2]) if (c2, k2) != (c, k) else rand_value(rng)
    return doc


# ---------------------------------------------------------------- text mutations
LITERALS = ["true", "false", "12345", "-1", "0", "0x" + "f" * 2000, "9" * 5000, "1e400", "nan",
            "-inf", "1979-05-27", "07:32:00", '""', '"x"', '"\\u0000"', '"\\n"', "[]", "[1, 2]",
            '["a", 1]', "{}", "{ a = 1 }", '"fd00::1"', '"ff:ff:ff:ff:ff:ff"', '"no"', "'..'",
            '"' + "z" * 3000 + '"', "[[[[[[[[[[1]]]]]]]]]]"]


def mutate_text(rng: random.Random, text: str) -> bytes:
    b = text.encode()
    lines = b.split(b"\n")
    op = rng.randrange(8)
    if op == 0 and b:                                 # flip bytes
        ba = bytearray(b)
        for _ in range(rng.randint(1, 4)):
            ba[rng.randrange(len(ba))] = rng.randrange(256)
        return bytes(ba)
    if op == 1:                                       # insert invalid UTF-8 or control bytes
        i = rng.randrange(len(b) + 1)
        return b[:i] + rng.choice([b"\xff", b"\xc3", b"\xed\xa0\x80", b"\x00", b"\x1b[2J", b"\r"]) + b[i:]
    if op == 2 and len(lines) > 1:                    # delete a line
        del lines[rng.randrange(len(lines))]
    elif op == 3:                                     # duplicate a line (duplicate keys / tables)
        i = rng.randrange(len(lines))
        lines.insert(i, lines[i])
    elif op == 4 and len(lines) > 1:                  # swap two lines
        i, j = rng.randrange(len(lines)), rng.randrange(len(lines))
        lines[i], lines[j] = lines[j], lines[i]
    elif op == 5:                                     # truncate
        return b[:rng.randrange(len(b) + 1)]
    else:                                             # replace a value with another literal
        idx = [i for i, ln in enumerate(lines) if b"=" in ln]
        for _ in range(rng.randint(1, 3)):
            if not idx:
                break
            i = rng.choice(idx)
            key = lines[i].split(b"=", 1)[0]
            lines[i] = key + b"= " + rng.choice(LITERALS).encode()
    return b"\n".join(lines)


def text_inputs(rng: random.Random, texts: list[str], n: int):
    for i in range(n):
        if i % 5 == 0:
            yield bytes(rng.randrange(256) for _ in range(rng.randrange(200)))
        else:
            yield mutate_text(rng, rng.choice(texts))


# ---------------------------------------------------------------- checks
def _short(x) -> str:
    s = repr(x)
    return s if len(s) < 600 else s[:600] + "..."


def check_error(e: Exception, what, inp) -> None:
    msg = str(e)
    if not (msg and msg.isprintable() and len(msg) <= MAX_MSG):
        pytest.fail("%s: error message not one printable line of at most %d chars: %r\ninput: %s" % (
            what, MAX_MSG, msg[:800], _short(inp)), pytrace=False)


def _addr(a) -> None:
    assert isinstance(a, str) and "%" not in a
    ipaddress.IPv6Address(a)


def _unicast(m) -> None:
    assert isinstance(m, str) and re.fullmatch(r"([0-9a-f]{2}:){5}[0-9a-f]{2}", m)
    assert not int(m[:2], 16) & 1 and m != "00:00:00:00:00:00", m


def check_config(cfg: HostConfig) -> None:
    _addr(cfg.local_addr)
    assert isinstance(cfg.dscp_rewrite, bool)
    assert cfg.mode in ("ecmp", "srv6") and isinstance(cfg.instance, str)
    for p in cfg.planes:
        assert isinstance(p.dev, str) and 0 < len(p.dev) < 16
        if p.gateway_mac is not None:
            _unicast(p.gateway_mac)
        else:
            _addr(p.gateway)
        for a in (p.srv6_src, p.local_sid):
            if a is not None:
                _addr(a)
    for t in cfg.srv6_templates.values():
        _addr(t.block)
    for c in cfg.connections:
        _addr(c.peer)
        assert isinstance(c.name, str) and c.name.isprintable()
        for v in (c.local_qpn, c.remote_qpn, c.ev_per_plane, c.backup_per_plane, c.t1s):
            assert type(v) is int
        active, backup = c.ev_sets(len(cfg.planes))
        assert sum(map(len, active)) == c.ev_per_plane * len(cfg.planes)


def check_topology(t: T.Topology) -> None:
    assert isinstance(t.name, str) and t.name.isprintable() and t.mode in ("srv6", "ecmp")
    assert type(t.rate_host) is int and type(t.rate_fabric) is int
    d = t.to_dict()
    assert T.from_dict(d).to_dict() == d
    t.summary()


def run_config(inp) -> str:
    try:
        cfg = HostConfig.from_dict(inp)
    except ConfigError as e:
        check_error(e, "config", inp)
        return "error"
    check_config(cfg)
    return "ok"


def run_topology(inp) -> str:
    try:
        topo = T.from_dict(inp)
    except T.TopologyError as e:
        check_error(e, "topology", inp)
        return "error"
    check_topology(topo)
    return "ok"


def _crash(what, inp, e):
    pytest.fail("%s loader raised %s: %s\ninput: %s" % (what, type(e).__name__, str(e)[:300], _short(inp)),
                pytrace=False)


# ---------------------------------------------------------------- tests
def test_examples_are_valid():
    for d in config_dicts():
        assert run_config(d) == "ok", d
    for d in topology_dicts():
        assert run_topology(d) == "ok", d


@pytest.mark.parametrize("what", ["config", "topology"])
def test_structural_mutations(what):
    rng = random.Random("%d-%s-struct" % (SEED, what))
    docs = config_dicts() if what == "config" else topology_dicts()
    run = run_config if what == "config" else run_topology
    schema = sorted(k for k in set().union(*[_keys(d, set()) for d in docs]) if isinstance(k, str))
    seen = {"ok": 0, "error": 0}
    for _ in range(N_STRUCT):
        inp = mutate(rng, rng.choice(docs), schema)
        try:
            seen[run(inp)] += 1
        except AssertionError:
            raise
        except Exception as e:  # noqa: BLE001 - exactly what this test looks for
            _crash(what, inp, e)
    # the mutations reach both outcomes (not all rejected at the first key)
    assert seen["ok"] > N_STRUCT // 20 and seen["error"] > N_STRUCT // 4, seen


@pytest.mark.parametrize("what", ["config", "topology"])
def test_text_mutations_and_random_bytes(what, tmp_path):
    rng = random.Random("%d-%s-text" % (SEED, what))
    texts = config_texts() if what == "config" else topology_texts()
    path = tmp_path / "in.toml"
    seen = {"ok": 0, "error": 0}
    err = ConfigError if what == "config" else T.TopologyError
    for raw in text_inputs(rng, texts, N_TEXT):
        path.write_bytes(raw)
        try:
            if what == "config":
                check_config(HostConfig.from_toml(str(path)))
            else:
                check_topology(T.load(str(path)))
            seen["ok"] += 1
        except err as e:
            check_error(e, what, raw)
            seen["error"] += 1
        except AssertionError:
            raise
        except Exception as e:  # noqa: BLE001
            _crash(what, raw, e)
    assert seen["ok"] > 0 and seen["error"] > N_TEXT // 4, seen
