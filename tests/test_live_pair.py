"""Tier 2: two hosts back to back, loaded with the real CLI, live traffic and feedback.

    hA: mrc0==mrc0p  p0 ------------ p0  mrc0p==mrc0 :hB
                     p1 ------------ p1

Frames written into hA's mrc0 are sprayed by XDP over both planes, arrive at hB's
plane NICs (ingress XDP), reach hB's mrc0 where a minimal receiver answers with SACKs
that travel back the same way and are applied by hA's ingress.  Counters are read
back through `mrc-xdp stats --json`, exactly as a user would.
"""
import json
import os
import subprocess
import sys
import time

import pytest

from mrc_xdp.datapath import netns, wire
from mrc_xdp.datapath.shared import SackM
from mrc_xdp.lab.traffic import Receiver, Sender

pytestmark = pytest.mark.skipif(os.geteuid() != 0, reason="needs root (XDP, netns)")

A_ADDR, B_ADDR = "fd00:77::a", "fd00:77::b"
QA, QB = 0x1A0, 0x1B0
CLI = [sys.executable, "-m", "mrc_xdp.cli"]


def sh(ns, cmd):
    subprocess.run(["nsenter", "--net=/run/netns/" + ns, "sh", "-ec", cmd], check=True)


def mac_of(ns, dev):
    out = subprocess.run(["ip", "-n", ns, "-j", "link", "show", dev], capture_output=True, text=True, check=True)
    return json.loads(out.stdout)[0]["address"]


def _send_raw(dev, frame):
    import socket
    with socket.socket(socket.AF_PACKET, socket.SOCK_RAW) as s:
        s.bind((dev, 0))
        s.send(frame)


def cli(*args, check=True):
    r = subprocess.run(CLI + list(args), capture_output=True, text=True, timeout=120)
    if check and r.returncode != 0:
        raise AssertionError("mrc-xdp %s failed (%d): %s%s" % (" ".join(args), r.returncode, r.stdout, r.stderr))
    return r


def host_toml(inst, local, peer, lq, rq, gw_macs):
    planes = "".join('[[planes]]\ndev = "p%d"\ngateway_mac = "%s"\n\n' % (i, m) for i, m in enumerate(gw_macs))
    return ('instance = "%s"\nmode = "ecmp"\nlocal_addr = "%s"\n\n%s'
            '[[connections]]\npeer = "%s"\nlocal_qpn = %d\nremote_qpn = %d\nev_per_plane = 4\n'
            'backup_per_plane = 2\n' % (inst, local, planes, peer, lq, rq))


@pytest.fixture
def pair(tmp_path):
    tag = "%x" % os.getpid()
    a, b = "mrcpA-" + tag, "mrcpB-" + tag
    ia, ib = "tpA-" + tag, "tpB-" + tag
    for n in (a, b):
        netns.create(n)
    try:
        for n in (a, b):
            sh(n, "ip link set lo up; ip link add mrc0 type veth peer name mrc0p; "
                  "ip link set mrc0 up; ip link set mrc0p up")
        for p in ("p0", "p1"):
            subprocess.run(["ip", "link", "add", p, "netns", a, "type", "veth", "peer", "name", p,
                            "netns", b], check=True)
            sh(a, "ip link set %s up" % p)
            sh(b, "ip link set %s up" % p)
        ta, tb = tmp_path / "a.toml", tmp_path / "b.toml"
        ta.write_text(host_toml(ia, A_ADDR, B_ADDR, QA, QB, [mac_of(b, "p0"), mac_of(b, "p1")]))
        tb.write_text(host_toml(ib, B_ADDR, A_ADDR, QB, QA, [mac_of(a, "p0"), mac_of(a, "p1")]))
        yield {"a": a, "b": b, "ia": ia, "ib": ib, "ta": str(ta), "tb": str(tb)}
    finally:
        for i in (ia, ib):
            cli("unload", "--instance", i, check=False)
        for n in (a, b):
            if netns.exists(n):
                netns.delete(n)


def check_exposition(body: str) -> None:
    """Prometheus text format: each metric's samples grouped right under its own HELP and
    TYPE lines, one TYPE line per metric."""
    typed, current = [], None
    for line in body.splitlines():
        if line.startswith("# TYPE "):
            current = line.split()[2]
            assert current not in typed, "second TYPE line for %s" % current
            typed.append(current)
        elif line.startswith("# HELP "):
            assert line.split()[2] not in typed, line
        elif line:
            name = line.split("{")[0].split(" ")[0]
            assert name == current, "sample of %s under the TYPE of %s: %s" % (name, current, line)


def stats(inst):
    return json.loads(cli("stats", "--json", "--instance", inst).stdout)


def test_load_spray_feedback_unload(pair):
    r = cli("load", "--config", pair["ta"], "--netns", pair["a"], "--json")
    assert r.stderr == "", r.stderr
    st = json.loads(r.stdout)
    assert st["xdp_modes"] == {"mrc0": "native", "mrc0p": "native", "p0": "native", "p1": "native"}
    cli("load", "--config", pair["tb"], "--netns", pair["b"])

    # a second load of the same instance is refused with one line, not a traceback
    r = cli("load", "--config", pair["ta"], "--netns", pair["a"], check=False)
    assert r.returncode == 1 and "already loaded" in r.stderr and "Traceback" not in r.stderr
    assert len(r.stderr.strip().splitlines()) == 1

    rx = Receiver("mrc0", B_ADDR, {(A_ADDR, QB): QA}, ns=pair["b"], max_seconds=60).start()
    tx = Sender("mrc0", A_ADDR, B_ADDR, QB, ns=pair["a"], payload=256)
    try:
        n = 2000
        # in bursts well inside the datapath's 1024-PSN sent window: the receiver here is
        # Python, and on a loaded machine it can lag more than 1024 frames behind, when
        # its SACKs would (rightly) count as feedback outside the sent window
        for burst in range(4):
            assert tx.send(n // 4, pps=20000) == (burst + 1) * n // 4
            deadline = time.monotonic() + 10
            while time.monotonic() < deadline and rx.sacks < (burst + 1) * n // 4:
                time.sleep(0.02)
        time.sleep(0.3)   # SACKs in flight back to A
    finally:
        rx.stop()
        tx.close()

    sa, sb = stats(pair["ia"]), stats(pair["ib"])
    ca, cb = sa["counters"], sb["counters"]
    assert ca["spray_tx"] == n and ca["spray_data"] == n and ca["spray_icrc_fix"] <= n
    # both planes carry half of the data (exact: per-CPU rotation, one sender thread)
    shares = {p: v["tx_pkts"] for p, v in sa["planes"].items()}
    assert abs(shares["0"] - shares["1"]) <= 0.02 * n, shares
    # every data frame arrived at B's ingress, for B, and went to B's engine side
    assert cb["ing_data"] == n and cb["ing_to_engine"] >= n
    assert sum(r["pkts"] for r in sb["rx_evs"]) == n
    assert {r["ev"] for r in sb["rx_evs"]} == {r["ev"] for r in sa["evs"] if r["role"] == "active"}
    # B's receiver answered every frame; its SACKs were sprayed and applied at A
    assert rx.sacks == n
    assert cb["spray_ctrl"] == n
    assert ca["ing_sack"] == n and ca["ing_fb_no_conn"] == 0 and ca["ing_fb_no_ev"] == 0
    assert sum(r["sack"] for r in sa["evs"]) == n
    assert all(r["state"] == "GOOD" for r in sa["evs"])

    # the operator denies one EV: no further packet uses it
    victim = next(r for r in sa["evs"] if r["role"] == "active")
    out = json.loads(cli("ev", "deny", hex(victim["ev"]), "--instance", pair["ia"], "--json").stdout)
    assert out["new"] == "DENIED"
    tx = Sender("mrc0", A_ADDR, B_ADDR, QB, ns=pair["a"], payload=256)
    try:
        tx.send(400, pps=20000)
    finally:
        tx.close()
    time.sleep(0.2)
    after = {r["ev"]: r for r in stats(pair["ia"])["evs"]}
    assert after[victim["ev"]]["tx_pkts"] == victim["tx_pkts"]
    assert after[victim["ev"]]["state"] == "DENIED"
    listed = json.loads(cli("ev", "list", "--state", "DENIED", "--json", "--instance", pair["ia"]).stdout)
    assert [r["ev"] for r in listed] == [victim["ev"]]
    out = json.loads(cli("ev", "allow", hex(victim["ev"]), "--instance", pair["ia"], "--json").stdout)
    assert (out["old"], out["new"], out["conn"]) == ("DENIED", "GOOD", 0)
    r = cli("ev", "deny", "0xdead", "--instance", pair["ia"], check=False)
    assert r.returncode == 1 and r.stderr.strip() == \
        "mrc-xdp: EV 0x0000dead is not in the EV set of any connection", r.stderr
    r = cli("ev", "list", "--conn", "7", "--instance", pair["ia"], check=False)
    assert r.returncode == 1 and r.stderr.strip() == "mrc-xdp: --conn 7: no such connection in %s " \
        "(connections: 0 %s/%d)" % (pair["ia"], B_ADDR, QB), r.stderr

    # B's side answers with ALWAYS_SKIP for one EV: A's ingress retires it at once and a
    # backup of the same plane takes its slot; `mrc-xdp events` shows both changes.
    target = next(r for r in stats(pair["ia"])["evs"] if r["role"] == "active" and r["state"] == "GOOD")
    sack = wire.sack_frame(B_ADDR, A_ADDR, QA, 0, 0, target["ev"], m=SackM.ALWAYS_SKIP)
    netns.run(pair["b"], _send_raw, "mrc0", sack)
    time.sleep(0.2)
    evs = [json.loads(l) for l in cli("events", "--json", "--instance", pair["ia"]).stdout.splitlines()]
    bad = [e for e in evs if e["ev"] == target["ev"] and e["new"] == "ASSUMED_BAD"]
    assert bad and bad[0]["reason"] == "SACK_ALWAYS", evs
    repl = [e for e in evs if e["reason"] == "REPLACED" and e["other_ev"] == target["ev"]]
    assert repl and repl[0]["plane"] == target["plane"], evs
    now = {r["ev"]: r for r in stats(pair["ia"])["evs"]}
    assert now[target["ev"]]["state"] == "ASSUMED_BAD" and now[target["ev"]]["role"] == "backup"
    assert now[repl[0]["ev"]]["role"] == "active" and now[repl[0]["ev"]]["plane"] == target["plane"]

    # stats --watch --json: one object per refresh, with live rates
    tx = Sender("mrc0", A_ADDR, B_ADDR, QB, ns=pair["a"], payload=256)
    proc = subprocess.Popen(CLI + ["stats", "--watch", "0.3", "--count", "2", "--json", "--instance", pair["ia"]],
                            stdout=subprocess.PIPE, text=True)
    try:
        # send once the watcher holds the counters (its start-up may outlast the 0.6 s of sending)
        from test_live_watch import held_map_ids, pinned_id, wait_for
        sid = pinned_id(pair["ia"], "mrc_stats")
        wait_for("stats --watch to open the counters", lambda: sid in held_map_ids(proc.pid))
        tx.send(3000, pps=5000)
    finally:
        tx.close()
    out, _ = proc.communicate(timeout=30)
    lines = [json.loads(l) for l in out.splitlines()]
    assert len(lines) == 2 and all(l["interval_s"] > 0 for l in lines)
    assert any(l["rates"].get("spray_tx", 0) > 0 for l in lines), lines

    # data of a connection B does not know (QP 0x999) is counted under conn "unknown"
    stray = wire.data_frame(A_ADDR, B_ADDR, 0x999, 0, b"\0" * 64, ev=0x12345678, dmac=mac_of(pair["b"], "p0"))
    netns.run(pair["a"], _send_raw, "p0", stray)
    time.sleep(0.1)

    # the metrics endpoint serves the same numbers over HTTP (loopback)
    import urllib.request
    import socket
    with socket.socket() as s:          # a port free now (a fixed one can clash with another run)
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    srv = subprocess.Popen(CLI + ["metrics", "--listen", "127.0.0.1:%d" % port, "--seconds", "60"],
                           stderr=subprocess.PIPE, text=True)
    try:
        body = None
        deadline = time.monotonic() + 30    # CLI start-up (bcc import) is slow on a loaded host
        while time.monotonic() < deadline and srv.poll() is None:
            try:
                body = urllib.request.urlopen("http://127.0.0.1:%d/metrics" % port, timeout=2).read().decode()
                break
            except OSError:
                time.sleep(0.1)
        assert body is not None, "metrics endpoint never answered (exit %s: %s)" % (
            srv.poll(), srv.stderr.read() if srv.poll() is not None else "")
    finally:
        srv.terminate()
        srv.wait(timeout=10)
    final = stats(pair["ia"])
    from prometheus_client.parser import text_string_to_metric_families
    samples = [x for f in text_string_to_metric_families(body) for x in f.samples]

    def values(name, **labels):
        return [x.value for x in samples if x.name == name and labels.items() <= x.labels.items()]
    assert values("mrc_counter_total", mrc_instance=pair["ia"], counter="spray_tx") == [final["counters"]["spray_tx"]]
    assert values("mrc_ev_state", mrc_instance=pair["ia"], state="ASSUMED_BAD") == [1], body[:2000]
    assert not [x for x in samples if "instance" in x.labels], "Prometheus sets `instance` itself"
    check_exposition(body)
    # conn is the connection's name in every metric ("unknown": no known connection, all
    # its sender EVs in one row)
    a_conn, b_conn = "%s/%d" % (B_ADDR, QB), "%s/%d" % (A_ADDR, QA)
    assert values("mrc_ev_packets_total", mrc_instance=pair["ia"], conn=a_conn)
    assert values("mrc_rx_ev_packets_total", mrc_instance=pair["ib"], conn=b_conn)
    assert values("mrc_rx_ev_ce_total", mrc_instance=pair["ib"], conn=b_conn)
    assert values("mrc_rx_ev_packets_total", mrc_instance=pair["ib"], conn="unknown") == [1]
    assert values("mrc_rx_ev_packets_total", mrc_instance=pair["ib"], conn="unknown", ev="other") == [1]

    for i in (pair["ia"], pair["ib"]):
        cli("unload", "--instance", i)
        assert not os.path.exists("/sys/fs/bpf/mrc/" + i)
        assert not os.path.exists("/run/mrc-xdp/%s.json" % i)
    for ns in (pair["a"], pair["b"]):
        for dev in ("mrc0", "mrc0p", "p0", "p1"):
            out = subprocess.run(["ip", "-n", ns, "-d", "link", "show", dev], capture_output=True, text=True).stdout
            assert "prog/xdp" not in out, (ns, dev, out)


def test_plane_out_and_in_by_the_operator(pair):
    """`mrc-xdp plane out N` takes plane N out of spray's rotation (MRC_PF_ADMIN; the
    daemon's link flag is another bit), status/stats/list say so, the other plane carries
    every packet, `plane in N` puts it back; a plane not configured is one line."""
    cli("load", "--config", pair["ta"], "--netns", pair["a"])
    try:
        rows = json.loads(cli("plane", "list", "-i", pair["ia"], "--json").stdout)
        assert [(r["plane"], r["in_rotation"]) for r in rows] == [(0, True), (1, True)]
        r = json.loads(cli("plane", "out", "1", "-i", pair["ia"], "--json").stdout)
        assert (r["plane"], r["in_rotation"], r["operator_out"], r["link_down"], r["changed"]) == (1, False, True, False, True)
        assert "(unchanged)" in cli("plane", "out", "1", "-i", pair["ia"]).stdout
        assert "OUT OF ROTATION (operator)" in cli("status", "-i", pair["ia"]).stdout
        assert stats(pair["ia"])["planes"].get("1", {"out_of_rotation": True})["out_of_rotation"]
        before = stats(pair["ia"])["evs"]
        tx = Sender("mrc0", A_ADDR, B_ADDR, QB, ns=pair["a"], payload=64)
        try:
            assert tx.send(200, pps=20000) == 200
        finally:
            tx.close()
        after = stats(pair["ia"])["evs"]
        sent = {p: sum(a["tx_pkts"] - b["tx_pkts"] for a, b in zip(after, before) if a["plane"] == p) for p in (0, 1)}
        assert sent == {0: 200, 1: 0}, sent
        assert "in rotation" in cli("plane", "in", "1", "-i", pair["ia"]).stdout
        rows = json.loads(cli("plane", "list", "-i", pair["ia"], "--json").stdout)
        assert all(r["in_rotation"] for r in rows)
        r = cli("plane", "out", "7", "-i", pair["ia"], check=False)
        assert r.returncode == 1 and len(r.stderr.strip().splitlines()) == 1 and "plane 7" in r.stderr
    finally:
        cli("unload", "--instance", pair["ia"], check=False)


def test_cli_errors_are_one_line(tmp_path):
    bad = tmp_path / "bad.toml"
    bad.write_text('local_addr = "fd00::1"\n[[planes]]\ndev = "p0"\ngateway_mac = "zz"\n')
    ecmp = tmp_path / "ecmp.toml"
    ecmp.write_text('local_addr = "fd00::1"\n[[planes]]\ndev = "p0"\ngateway_mac = "02:00:00:00:00:01"\n'
                    '[[connections]]\npeer = "fd00::2"\nlocal_qpn = 0x100\nremote_qpn = 0x200\n')
    for args, want in [
        (["load", "--config", str(bad)], "planes[0].gateway_mac"),
        # command-line overrides are validated with the file, before anything is loaded
        (["load", "--config", str(ecmp), "--mode", "srv6"], "planes[0].srv6_src: required in srv6 mode"),
        (["load", "--config", str(ecmp), "--instance", "no/slash"], "instance: 'no/slash' must be"),
        (["load", "--config", str(tmp_path / "missing.toml")], "no such config file"),
        (["stats", "--instance", "no-such-instance"], "not loaded"),
        (["unload", "--instance", "no-such-instance"], "not loaded"),
        (["status", "--instance", "no-such-instance"], "instance 'no-such-instance' is not loaded"),
        (["stats", "--watch", "-1"], "--watch -1: the refresh interval must be a number of seconds > 0"),
        (["stats", "--watch", "0"], "--watch 0: the refresh interval"),
        (["stats", "--watch", "--count", "0"], "--count 0: must be at least 1"),
    ]:
        r = cli(*args, check=False)
        assert r.returncode == 1, (args, r)
        assert want in r.stderr and "Traceback" not in r.stderr, (args, r.stderr)
        assert len(r.stderr.strip().splitlines()) == 1, r.stderr
    good = tmp_path / "nodev.toml"
    good.write_text('local_addr = "fd00::1"\n[[planes]]\ndev = "nosuchdev0"\ngateway_mac = "02:00:00:00:00:01"\n'
                    'app_dev = "nosuchmrc0"\n'.replace('app_dev = "nosuchmrc0"\n', ""))
    r = cli("load", "--config", str(good), "--instance", "t-nodev-%d" % os.getpid(), check=False)
    assert r.returncode == 1 and "no such device" in r.stderr, r.stderr


def xdp_attached(ns):
    out = subprocess.run(["ip", "-n", ns, "-d", "link", "show"], capture_output=True, text=True, check=True).stdout
    return out.count("prog/xdp")


CRASH_AFTER_TWO_ATTACHES = """
import os, sys
from mrc_xdp import config, loader
orig, n = loader._attach, [0]
def attach(*a):
    r = orig(*a)
    n[0] += 1
    if n[0] == 2:
        os._exit(3)          # killed between attaching and finishing the state file
    return r
loader._attach = attach
loader.load(config.HostConfig.from_toml(sys.argv[1]), netns_name=sys.argv[2])
"""


def test_unload_after_a_crash_midway_and_without_state_file(pair):
    ns, inst = pair["a"], pair["ia"]
    spath = "/run/mrc-xdp/%s.json" % inst
    r = subprocess.run([sys.executable, "-c", CRASH_AFTER_TWO_ATTACHES, pair["ta"], ns],
                       capture_output=True, text=True, timeout=120)
    assert r.returncode == 3, r.stderr
    # the state was written before attaching: it names the netns, devices and programs
    st = json.load(open(spath))
    assert st["netns"] == ns and st["complete"] is False and len(st["prog_ids"]) == 4
    assert xdp_attached(ns) == 2
    # worst case: the state file is gone too; unload still finds our programs by id
    os.unlink(spath)
    r = cli("unload", "--instance", inst)
    assert "mrc0" in r.stdout and "mrc0p" in r.stdout, r.stdout
    assert xdp_attached(ns) == 0
    assert not os.path.exists("/sys/fs/bpf/mrc/" + inst) and not os.path.exists(spath)

    # a complete load whose state file was cut short: the same
    cli("load", "--config", pair["ta"], "--netns", ns)
    assert xdp_attached(ns) == 4
    with open(spath, "w") as f:
        f.write('{"instance": "%s", "net' % inst)
    cli("unload", "--instance", inst)
    assert xdp_attached(ns) == 0
    assert not os.path.exists("/sys/fs/bpf/mrc/" + inst) and not os.path.exists(spath)


def srv6_toml(inst, local, peer, lq, rq, gw_macs):
    planes = "".join('[[planes]]\ndev = "p%d"\ngateway_mac = "%s"\nsrv6_src = "fcbb:0:%d::a"\n'
                     'local_sid = "fcbb:0:%d::a"\n\n' % (i, m, i, i) for i, m in enumerate(gw_macs))
    return ('instance = "%s"\nmode = "srv6"\nlocal_addr = "%s"\n\n%s'
            '[srv6_templates.peer]\nblock = "fcbb::"\nusids = [0x0b]\n\n'
            '[[connections]]\npeer = "%s"\nlocal_qpn = %d\nremote_qpn = %d\ntemplate = "peer"\n'
            % (inst, local, planes, peer, lq, rq))


def test_srv6_load_refuses_an_app_mtu_the_planes_cannot_carry(pair, tmp_path):
    ns = pair["a"]
    cfg = tmp_path / "srv6.toml"
    cfg.write_text(srv6_toml(pair["ia"], A_ADDR, B_ADDR, QA, QB, [mac_of(pair["b"], "p0"), mac_of(pair["b"], "p1")]))
    sh(ns, "ip link set p1 mtu 1600")          # the smallest plane MTU is the one named
    r = cli("load", "--config", str(cfg), "--netns", ns, check=False)
    assert r.returncode == 1 and "Traceback" not in r.stderr
    assert r.stderr.strip() == ("mrc-xdp: mrc0: MTU 1500 + 40 (SRv6 outer header) exceeds p0 MTU 1500 — "
                                "lower mrc0's MTU to 1460 or raise the plane MTU to 1540"), r.stderr
    assert not os.path.exists("/sys/fs/bpf/mrc/" + pair["ia"])
    assert xdp_attached(ns) == 0
    # the same config in ECMP mode has no outer header: no MTU constraint
    r = cli("load", "--config", pair["ta"], "--netns", ns)
    cli("unload", "--instance", pair["ia"])
    sh(ns, "ip link set mrc0 mtu 1460")
    r = cli("load", "--config", str(cfg), "--netns", ns, "--json")
    assert json.loads(r.stdout)["mode"] == "srv6"
    cli("unload", "--instance", pair["ia"])


def test_scapy_is_quiet_in_a_fresh_namespace():
    """scapy warns about every address-less interface of the netns it is imported in
    (lo in a fresh one); commands run with --netns must not print that."""
    ns = "mrcq-%x" % os.getpid()
    netns.create(ns)
    try:
        r = subprocess.run(["nsenter", "--net=/run/netns/" + ns, sys.executable, "-c", "import mrc_xdp.datapath.wire"],
                           capture_output=True, text=True, timeout=60)
    finally:
        netns.delete(ns)
    assert r.returncode == 0 and r.stderr == "", r.stderr
