"""The out-of-band bootstrap (mrc_xdp.transport.bootstrap): JSON lines over TCP, its errors, and
the lab's control path (TCP between hosts over the fabric, through every host's XDP)."""
import os
import socket
import threading
import uuid

import pytest

from mrc_xdp.transport import bootstrap as bs
from mrc_xdp.lab import ctlpath

ATTRS = {"addr": "fd00:100::1", "qpn": 0x123, "start_psn": 77, "mtu": 1408,
         "mr": {"addr": 0x7f0000001000, "length": 1 << 20, "rkey": 5}}


def _free_port():
    with socket.socket(socket.AF_INET6) as s:
        s.bind(("::1", 0))
        return s.getsockname()[1]


def _serve(lst, out):
    try:
        with lst.accept(timeout=10) as ch:
            peer = bs.check_qp_attrs(ch.expect("qp")["attrs"])
            ch.send({"type": "qp", "attrs": dict(ATTRS, qpn=0x456)})
            ch.barrier("done")
            out["peer"] = peer
            out["hello"] = ch.hello
    except Exception as e:
        out["error"] = e


def _exchange(host, port, ns=None, server_ns=None, bind="::"):
    out = {}
    with bs.Listener(port, bind=bind, ns=server_ns) as lst:
        t = threading.Thread(target=_serve, args=(lst, out))
        t.start()
        with bs.connect(host, port, timeout=10, ns=ns, hello={"cmd": "write-bw"}) as ch:
            ch.send({"type": "qp", "attrs": ATTRS})
            got = bs.check_qp_attrs(ch.expect("qp")["attrs"])
            ch.barrier("done")
        t.join(10)
    assert "error" not in out, out.get("error")
    return got, out


def test_exchange_loopback():
    got, out = _exchange("::1", _free_port())
    assert got["qpn"] == 0x456 and got["mr"]["rkey"] == 5
    assert out["peer"] == ATTRS and out["hello"]["cmd"] == "write-bw"


def test_errors_are_one_line():
    port = _free_port()
    with pytest.raises(bs.BootstrapError, match="cannot connect.*start the server side first"):
        bs.connect("::1", port, timeout=0.5)
    for bad, field in (({**ATTRS, "addr": "10.0.0.1x"}, "addr"), ({**ATTRS, "qpn": 0}, "qpn"),
                       ({**ATTRS, "start_psn": 1 << 24}, "start_psn"),
                       ({**ATTRS, "mr": {"addr": 1, "length": 2}}, "mr.rkey")):
        with pytest.raises(bs.BootstrapError, match=field):
            bs.check_qp_attrs(bad)
    # a peer that is not mrc-xdp: garbage instead of JSON, or a closed connection
    with bs.Listener(port, bind="::1") as lst:
        def garbage():
            s, _ = lst.sock.accept()
            s.recv(100)
            s.sendall(b"SSH-2.0-OpenSSH\n")
            s.close()
        t = threading.Thread(target=garbage)
        t.start()
        ch = bs.connect("::1", port, timeout=5)
        with pytest.raises(bs.BootstrapError, match="not JSON"):
            ch.recv(5)
        ch.close()
        t.join()
    # a listener that gets no answer in time says so
    with bs.Listener(port, bind="::1") as lst:
        with pytest.raises(bs.BootstrapError, match="no client connected"):
            lst.accept(timeout=0.2)
        with bs.connect("::1", port, timeout=5) as ch:
            peer = lst.accept(timeout=5)
            with pytest.raises(bs.BootstrapError, match="no answer"):
                ch.recv(0.2)
            peer.send({"error": "size too large"})
            with pytest.raises(bs.BootstrapError, match="peer .*size too large"):
                ch.recv(5)
            peer.close()
    with bs.Listener(port, bind="::1"):
        with pytest.raises(bs.BootstrapError, match="cannot listen"):
            bs.Listener(port, bind="::1")


@pytest.fixture(scope="module")
def ecmp_lab():
    if os.geteuid() != 0:
        pytest.skip("the lab needs root")
    from mrc_xdp.lab import fabric, hosts, topology
    prefix = "tb%s-" % uuid.uuid4().hex[:5]
    try:
        st = fabric.up(topology.load(mode="ecmp"), prefix=prefix, hosts_hook=hosts.fabric_hook)
        yield prefix, fabric.topology_of(st), st
    finally:
        fabric.down(prefix, unload_hosts=hosts.unload_all)


def test_lab_control_path(ecmp_lab):
    """TCP from h0 to h2 over each plane: the bootstrap works between lab hosts, through
    their loaded datapaths and the fabric (the uplinks' link models count the frames)."""
    from mrc_xdp.lab import linkmodel as lmod
    prefix, topo, st = ecmp_lab
    addrs = ctlpath.lab_control_path(prefix, topo)
    assert ctlpath.lab_control_path(prefix, topo) == addrs         # idempotent
    ends = {name: rx.ifindex for name, rx, _, _ in topo.link_ends()}
    with lmod.LinkModel.open(st["pin_dir"]) as lm:
        for p in range(topo.planes):
            ups = [ends["%s>%s" % (topo.t0_name(p, 0), topo.t1_name(p, j))] for j in range(topo.t1_per_plane)]
            before = sum(lm.counters(i)["pkts"] for i in ups)
            got, out = _exchange(addrs["h2"][p], 18515, ns=prefix + "h0", server_ns=prefix + "h2",
                                 bind=addrs["h2"][p])
            assert got["qpn"] == 0x456 and out["peer"]["qpn"] == ATTRS["qpn"]
            assert sum(lm.counters(i)["pkts"] for i in ups) - before >= 4, "plane %d" % p
    # a host's own datapath saw the TCP frames and passed them unchanged
    from mrc_xdp.datapath.maps import Instance
    with Instance(prefix + "h0") as inst:
        c = inst.counters()
        assert c["ing_non_mrc"] > 0
