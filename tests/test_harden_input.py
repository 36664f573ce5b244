"""Hostile and careless input: strict types in both TOML loaders, files that are not
config files, namespace names, watch intervals; every failure is one line, never a
traceback (issue 6, defects 6 and 7).  No root needed."""
from __future__ import annotations

import os
import signal
import subprocess
import sys

import pytest

from mrc_xdp.datapath import netns
from mrc_xdp.datapath.config import ConfigError, HostConfig
from mrc_xdp.lab import topology as T
from mrc_xdp.datapath import validate

CLI = [sys.executable, "-m", "mrc_xdp.cli"]

HOST = '''local_addr = "fd00::1"
[[planes]]
dev = "p0"
gateway_mac = "02:00:00:00:00:01"
[[connections]]
peer = "fd00::2"
local_qpn = 0x100
remote_qpn = 0x200
'''


def host(tmp_path, text=HOST, **subst) -> HostConfig:
    for k, v in subst.items():
        text = "\n".join(("%s = %s" % (k.split(".")[-1], v)) if ln.startswith(k.split(".")[-1] + " =") else ln
                         for ln in text.splitlines()) + "\n"
    p = tmp_path / "h.toml"
    p.write_text(text)
    return HostConfig.from_toml(str(p))


def one_line(msg: str) -> None:
    assert msg and msg.isprintable() and "\n" not in msg, repr(msg)


# ---------------------------------------------------------------- defect 7: types as TOML gives them
@pytest.mark.parametrize("key,value,msg", [
    ("local_addr", "12345", "local_addr: 12345 is not an IPv6 address"),
    ("local_addr", "true", "local_addr: True is not an IPv6 address"),
    ("local_addr", '"fd00::1%eth0"', "local_addr: 'fd00::1%eth0' is not an IPv6 address"),
    ("local_addr", '"ff02::1"', "local_addr: 'ff02::1' is not a unicast address"),
    ("peer", "2", "connections[0].peer: 2 is not an IPv6 address"),
    ("gateway_mac", '"ff:ff:ff:ff:ff:ff"', "planes[0].gateway_mac: ff:ff:ff:ff:ff:ff is a broadcast address"),
    ("gateway_mac", '"01:00:5e:00:00:01"', "planes[0].gateway_mac: 01:00:5e:00:00:01 is a multicast address"),
    ("gateway_mac", '"33:33:00:00:00:01"', "planes[0].gateway_mac: 33:33:00:00:00:01 is a multicast address"),
    ("gateway_mac", '"00:00:00:00:00:00"', "planes[0].gateway_mac: 00:00:00:00:00:00 is not a unicast"),
    ("dev", "0", "planes[0].dev: 0 is not an interface name"),
    ("dev", '"a/b"', "planes[0].dev: 'a/b' is not an interface name"),
    ("dev", '"p0123456789abcdef"', "is not an interface name"),
    ("local_qpn", "true", "connections[0].local_qpn: True is not an integer"),
    ("local_qpn", "256.0", "connections[0].local_qpn: 256.0 is not an integer"),
])
def test_config_types(tmp_path, key, value, msg):
    with pytest.raises(ConfigError) as e:
        host(tmp_path, **{key: value})
    assert msg in str(e.value)
    one_line(str(e.value))


@pytest.mark.parametrize("extra,msg", [
    ('dscp = { rewrite = "no" }\n', "dscp.rewrite: 'no' is not a boolean"),
    ("dscp = { rewrite = 0 }\n", "dscp.rewrite: 0 is not a boolean"),
    ("mode = true\n", "mode: True must be 'ecmp' or 'srv6'"),
    ("app_dev = 7\n", "app_dev: 7 is not an interface name"),
])
def test_config_top_level_types(tmp_path, extra, msg):
    with pytest.raises(ConfigError) as e:
        host(tmp_path, extra + HOST)
    assert msg in str(e.value)


def test_config_connection_name_and_template_types(tmp_path):
    with pytest.raises(ConfigError, match=r"connections\[0\]\.name: expected a non-empty string, got 5"):
        host(tmp_path, HOST + "name = 5\n")
    srv6 = HOST.replace('gateway_mac = "02:00:00:00:00:01"\n', 'gateway_mac = "02:00:00:00:00:01"\n'
                        'srv6_src = "fcbb::1"\nlocal_sid = "fcbb:0:1::"\n')
    srv6 = 'mode = "srv6"\nsrv6_templates = { t = { block = "fcbb::", usids = [1] } }\n' + srv6
    with pytest.raises(ConfigError, match=r"connections\[0\]\.template: no srv6_templates entry named \['t'\]"):
        host(tmp_path, srv6 + 'template = ["t"]\n')
    assert host(tmp_path, srv6 + 'template = "t"\n').connections[0].template == "t"
    block = srv6.replace('block = "fcbb::"', "block = 1").replace("usids", 'x = 1, usids') + 'template = "t"\n'
    with pytest.raises(ConfigError, match=r"srv6_templates\.t\.x: unknown key 'x'"):
        host(tmp_path, block)
    with pytest.raises(ConfigError, match=r"srv6_templates.t.block: 1 is not an IPv6 address"):
        host(tmp_path, block.replace("x = 1, ", ""))
    with pytest.raises(ConfigError) as e:       # a key with a newline is quoted, one line
        host(tmp_path, block.replace("{ t =", '{ "a\\nb" ='))
    assert str(e.value).startswith("srv6_templates.'a\\nb'.x: unknown key 'x'"), str(e.value)
    # what stays valid: bools from bools, MACs lowered, a unicast locally administered MAC
    cfg = host(tmp_path, "dscp = { rewrite = false }\n" + HOST.replace("02:00:00:00:00:01", "02:AA:00:00:00:01"))
    assert cfg.dscp_rewrite is False and cfg.planes[0].gateway_mac == "02:aa:00:00:00:01"
    assert host(tmp_path).dscp_rewrite is True


@pytest.mark.parametrize("over,msg", [
    ({"addressing": {"base": 12345}}, "addressing.base: 12345 is not an IPv6 prefix"),
    ({"addressing": {"srv6_block": True}}, "addressing.srv6_block: True is not an IPv6 prefix"),
    ({"addressing": {"base": "fd00::%eth0/48"}}, "is not an IPv6 prefix"),
    ({"name": 5}, "name: expected a non-empty string, got 5"),
    ({"name": "a\nb"}, "name: 'a\\nb' must be at most 64 printable characters"),
    ({"mode": True}, "mode: True must be 'srv6' or 'ecmp'"),
    ({"capacity": {"host_t0": 1.5}}, "capacity.host_t0: 1.5 is not a rate"),
    ({"capacity": {"host_t0": "9" * 400 + "gbit"}}, "capacity.host_t0:"),
    ({"capacity": {"t0_t1": 2**70}}, "capacity.t0_t1: <71-bit integer> is above 1000tbit"),
    ({"hosts": [{"name": "h0\n", "t0": 0}]}, "hosts[0].name: 'h0\\n' must be 1-8 characters"),
    ({"planes": 2, "t0_per_plane": 64, "t1_per_plane": 64}, "link ends exceed"),
])
def test_topology_types(over, msg):
    d = {"hosts": [{"name": "h0", "t0": 0}]}
    d.update(over)
    with pytest.raises(T.TopologyError) as e:
        T.from_dict(d)
    assert msg in str(e.value)
    one_line(str(e.value))


# ---------------------------------------------------------------- defect 6: files that are not config files
def _fifo(tmp_path):
    p = tmp_path / "fifo"
    os.mkfifo(p)
    return str(p)


def _huge(tmp_path):
    p = tmp_path / "huge.toml"
    with open(p, "wb") as f:
        f.write(b"# " + b"x" * (validate.MAX_FILE_BYTES + 10) + b"\n")
    return str(p)


def _write(tmp_path, data: bytes, name="in.toml"):
    p = tmp_path / name
    p.write_bytes(data)
    return str(p)


BAD_FILES = [
    ("not UTF-8", lambda t: _write(t, b'local_addr = "fd00::1\xff"\n', "u.toml"), "not UTF-8 text (byte 21 is 0xff)"),
    ("Latin-1", lambda t: _write(t, 'name = "caf\xe9"\n'.encode("latin-1"), "l.toml"), "not UTF-8 text"),
    ("a directory", lambda t: str(t), "a directory, not a"),
    ("/proc/self/mem", lambda t: "/proc/self/mem", "cannot read the"),
    ("a FIFO", _fifo, "a FIFO, not a"),
    ("/dev/zero", lambda t: "/dev/zero", "/dev/zero: a device, not a"),
    ("over 1 MiB", _huge, "larger than a"),
    ("deeply nested", lambda t: _write(t, b"a = " + b"[" * 100000, "n.toml"), "nested too deeply"),
    ("a 5000-digit integer", lambda t: _write(t, b"a = " + b"9" * 5000, "d.toml"), "not valid TOML: Exceeds the limit"),
    ("NUL in the path", lambda t: str(t) + "/a\0b", "cannot open the"),
]


@pytest.mark.parametrize("what,make,msg", BAD_FILES, ids=[b[0] for b in BAD_FILES])
@pytest.mark.parametrize("loader", ["config", "topology"])
def test_bad_files_are_one_line(tmp_path, loader, what, make, msg):
    path = make(tmp_path)
    err, fn = (ConfigError, HostConfig.from_toml) if loader == "config" else (T.TopologyError, T.load)

    def hung(*_):
        raise TimeoutError("the loader blocked on %s" % what)
    old = signal.signal(signal.SIGALRM, hung)     # a FIFO without a writer blocks open()
    signal.alarm(20)
    try:
        with pytest.raises(err) as e:
            fn(path)
    finally:
        signal.alarm(0)
        signal.signal(signal.SIGALRM, old)
    assert msg in str(e.value)
    one_line(str(e.value))


def test_huge_integer_values_are_one_line(tmp_path):
    with pytest.raises(ConfigError) as e:
        host(tmp_path, local_qpn="0x" + "f" * 5000)
    assert str(e.value) == "connections[0].local_qpn: <20000-bit integer> is out of range [3, 16777215]"


# ---------------------------------------------------------------- defect 6: namespace names
@pytest.mark.parametrize("name", ["..", ".", "", "a/b", "../../etc", "x\0y", "n" * 256])
def test_bad_netns_names(name):
    with pytest.raises(netns.NetnsError) as e:
        netns.check_name(name)
    one_line(e.value.strerror)
    assert "netns name" in e.value.strerror
    with pytest.raises(netns.NetnsError):
        netns.exists(name)
    with pytest.raises(ValueError):      # it is still a ValueError for older callers
        netns.path(name)


def test_good_netns_names():
    for name in ("mrc-h0", "a", "n" * 255, "with space", "caf\xe9"):
        assert netns.check_name(name) == name


# ---------------------------------------------------------------- defect 6: the CLI
def test_cli_bad_input_is_one_line(tmp_path):
    good = _write(tmp_path, HOST.encode(), "good.toml")
    cases = [["load", "--config", make(tmp_path)] for what, make, _ in BAD_FILES
             if what != "NUL in the path"]      # argv cannot hold one
    cases += [
        ["load", "--config", _write(tmp_path, os.urandom(0) + bytes(range(256)), "bytes.toml")],
        ["load", "--config", _write(tmp_path, b"local_addr = 12345\n", "int.toml")],
        ["load", "--config", good, "--netns", ".."],
        ["load", "--config", good, "--netns", "a/b"],
        ["load", "--config", good, "--netns", "n" * 300],
        ["stats", "--watch", "inf"],
        ["stats", "--watch", "nan"],
        ["stats", "--watch", "-2"],
        ["stats", "--watch", "1e999"],
        ["events", "--follow", "--seconds", "nan"],
        ["events", "--follow", "--seconds", "-1"],
        ["metrics", "--seconds", "inf"],
        ["metrics", "--listen", "127.0.0.1:99999", "--seconds", "1"],
    ]
    procs = [(args, subprocess.Popen(CLI + args, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True))
             for args in cases]
    for args, p in procs:
        out, err = p.communicate(timeout=60)
        shown = [a[:60] for a in args]
        assert p.returncode in (1, 2), (shown, p.returncode, err)
        assert "Traceback" not in err, (shown, err)
        assert len(err.strip().splitlines()) == 1 and err.startswith("mrc-xdp: "), (shown, err)
