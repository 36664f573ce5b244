"""Tier 2: the perftest-style commands through the real CLI on a live pair.

`mrc-xdp write-bw`, `write-lat`, `send` and `recv` run as two processes (server in B's
namespace, client in A's), bootstrap over TCP on the plane-0 veth (our XDP passes it),
and move data with the transport engine over both planes.  The pair's datapaths list no
connection: every QP's connection is added at connect and removed at the end.
"""
import filecmp
import json
import os
import subprocess
import sys
import uuid

import pytest

from mrc_xdp.transport import conns
from perf_pair import B_CTL, MTU, make_pair

pytestmark = pytest.mark.skipif(os.geteuid() != 0, reason="needs root (XDP, AF_XDP, netns)")

CLI = [sys.executable, "-m", "mrc_xdp.cli"]


@pytest.fixture(scope="module")
def pair():
    yield from make_pair("pf")


def run_pair(pair, server_args, client_args, timeout=120):
    port = str(19000 + (os.getpid() + len(" ".join(client_args))) % 2000)
    srv = subprocess.Popen(CLI + server_args + ["-i", pair["b"], "--bind", B_CTL, "--port", port, "--json"],
                           stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    try:
        cl = subprocess.run(CLI + client_args + ["-i", pair["a"], "--port", port, "--json"],
                            capture_output=True, text=True, timeout=timeout)
        so, se = srv.communicate(timeout=30)
    finally:
        if srv.poll() is None:
            srv.kill()
    assert cl.returncode == 0, cl.stderr
    assert srv.returncode == 0, se
    # nothing the QPs added stays in the datapaths
    for n in (pair["a"], pair["b"]):
        assert conns.list_(n) == []
    return json.loads(cl.stdout.splitlines()[-1]), json.loads(so.splitlines()[-1])


def test_write_bw(pair):
    c, s = run_pair(pair, ["write-bw"], ["write-bw", B_CTL, "--size", "65536", "--iters", "300", "--qps", "2"])
    assert c["iterations"] == 300 and c["qps"] == 2 and c["bytes"] == 65536
    assert c["bw_avg_bps"] > 0 and c["bw_peak_bps"] > 0
    assert c["qp_stats"]["tx_bytes"] >= 300 * 65536
    # the server's QPs placed every byte (retransmitted duplicates are not placed twice)
    assert s["server_qp_stats"]["rx_bytes"] == 300 * 65536
    assert c["payload"] == MTU - 88 - (MTU - 88) % 64


def test_write_bw_1000_qps(pair):
    """`write-bw --qps 1000` (MAX_QPS: the datapath holds MRC_MAX_CONNS 1024 connections):
    every QP is connected, written to round robin and closed, and the server placed every
    byte; run_pair checks that no connection is left in either datapath."""
    c, s = run_pair(pair, ["write-bw"], ["write-bw", B_CTL, "--size", "4096", "--iters", "2000", "--qps", "1000"],
                    timeout=300)
    assert c["iterations"] == 2000 and c["qps"] == 1000
    assert s["server_qp_stats"]["rx_bytes"] == 2000 * 4096


def test_write_lat(pair):
    c, s = run_pair(pair, ["write-lat"], ["write-lat", B_CTL, "--size", "8", "--iters", "300"])
    assert c["iterations"] == 300 and c["bytes"] == 8 and s["iterations"] == 300
    assert 0 < c["t_min_us"] <= c["p50_us"] <= c["p99_us"] <= c["p999_us"] <= c["t_max_us"]
    assert 0 < c["rtt_p50_us"] <= c["rtt_p99_us"] <= c["rtt_p999_us"]
    assert c["spin_us"] == 50 and c["cq_spin_us"] == 50          # the defaults
    assert c["engine"]["spin_ns"] + c["engine"]["caller_rx"] > 0     # the engine or the caller spun


@pytest.mark.parametrize("spins", [["--spin-us", "0", "--cq-spin-us", "0"], ["--spin-us", "0", "--cq-spin-us", "100"]])
def test_write_lat_spins(pair, spins):
    """--spin-us 0: the engines never spin (the loop as it was); --cq-spin-us: the callers
    spin for their completions (and may receive frames themselves): the same results."""
    c, s = run_pair(pair, ["write-lat"] + spins, ["write-lat", B_CTL, "--size", "8", "--iters", "200"] + spins)
    assert c["iterations"] == 200 and c["p50_us"] <= c["p99_us"] <= c["p999_us"]
    for e in (c["engine"], s["server_engine"]):
        assert (e["spin_hits"], e["spin_misses"], e["spin_ns"]) == (0, 0, 0), e
    assert c["spin_us"] == 0 and c["cq_spin_us"] == int(spins[-1])
    if spins[-1] == "0":            # nobody spins: every completion went through the eventfd
        assert c["engine"]["caller_rx"] == 0 and s["server_engine"]["caller_rx"] == 0


def test_write_lat_table_has_p999(pair):
    port = str(19000 + (os.getpid() + 77) % 2000)
    srv = subprocess.Popen(CLI + ["write-lat", "-i", pair["b"], "--bind", B_CTL, "--port", port],
                           stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    try:
        cl = subprocess.run(CLI + ["write-lat", B_CTL, "-i", pair["a"], "--port", port, "--iters", "50"],
                            capture_output=True, text=True, timeout=120)
        srv.communicate(timeout=30)
    finally:
        if srv.poll() is None:
            srv.kill()
    assert cl.returncode == 0, cl.stderr
    assert "t_p99.9[usec]" in cl.stdout and "p99.9" in cl.stdout.splitlines()[-1]


@pytest.mark.parametrize("flag", ["--spin-us", "--cq-spin-us"])
def test_write_lat_bad_spin_one_line(pair, flag):
    r = subprocess.run(CLI + ["write-lat", B_CTL, "-i", pair["a"], flag, "20000"],
                       capture_output=True, text=True, timeout=60)
    assert r.returncode == 1 and "Traceback" not in r.stderr
    assert len(r.stderr.strip().splitlines()) == 1 and "0 (off) .. 10000" in r.stderr, r.stderr


@pytest.mark.parametrize("size", [0, 1, 3 * 1024 * 1024 + 13])
def test_send_recv(pair, tmp_path, size):
    src = tmp_path / "blob.bin"
    src.write_bytes(os.urandom(size))
    out = tmp_path / "out"
    out.mkdir()
    c, s = run_pair(pair, ["recv", str(out)], ["send", str(src), B_CTL])
    assert c["intact"] and s["intact"] and c["sha256"] == s["sha256"]
    assert filecmp.cmp(src, out / "blob.bin", shallow=False)


def test_errors_one_line(pair):
    r = subprocess.run(CLI + ["write-bw", B_CTL, "-i", pair["a"], "--port", "1", "--timeout", "1"],
                       capture_output=True, text=True, timeout=60)
    assert r.returncode == 1 and "Traceback" not in r.stderr
    assert len(r.stderr.strip().splitlines()) == 1 and "start the server side first" in r.stderr
    r = subprocess.run(CLI + ["write-lat", "-i", "no-such-instance-%s" % uuid.uuid4().hex[:6]],
                       capture_output=True, text=True, timeout=60)
    assert r.returncode == 1 and "not loaded" in r.stderr and len(r.stderr.strip().splitlines()) == 1
    r = subprocess.run(CLI + ["send", "/nonexistent/file", B_CTL, "-i", pair["a"]],
                       capture_output=True, text=True, timeout=60)
    assert r.returncode == 1 and "cannot read /nonexistent/file" in r.stderr
    # a server nobody connects to gives up after --accept-timeout, in one line, and leaves
    # no QP or connection behind
    for cmd in (["write-bw"], ["write-lat"], ["recv", "/tmp"]):
        r = subprocess.run(CLI + cmd + ["-i", pair["b"], "--bind", B_CTL, "--port", "19%03d" % (os.getpid() % 1000),
                                        "--accept-timeout", "0.5"], capture_output=True, text=True, timeout=60)
        assert r.returncode == 1 and len(r.stderr.strip().splitlines()) == 1, r.stderr
        assert "no client connected to port" in r.stderr and "within 0 s" not in r.stderr, r.stderr
        assert conns.list_(pair["b"]) == []


def test_qps_from_another_process(pair):
    """A running session publishes its per-QP engine counters; `mrc-xdp qps` in another
    process reads them; the file is gone when the session ends."""
    import time
    port = str(21000 + os.getpid() % 2000)
    srv = subprocess.Popen(CLI + ["write-bw", "-i", pair["b"], "--bind", B_CTL, "--port", port, "--json"],
                           stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    cl = subprocess.Popen(CLI + ["write-bw", B_CTL, "-i", pair["a"], "--port", port, "--json", "--duration", "4",
                                 "--size", "65536"], stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    try:
        rows = []
        end = time.monotonic() + 30
        while time.monotonic() < end and not any(r["tx_pkts"] > 0 for r in rows):
            time.sleep(0.5)
            r = subprocess.run(CLI + ["qps", "-i", pair["a"], "--json"], capture_output=True, text=True, timeout=30)
            assert r.returncode == 0, r.stderr
            rows = json.loads(r.stdout)
        assert rows and rows[0]["cmd"] == "write-bw client" and rows[0]["tx_pkts"] > 0, rows
        assert rows[0]["state_name"] == "rts" and "rtx_pkts" in rows[0] and "cwnd" in rows[0]
        assert cl.wait(60) == 0 and srv.wait(30) == 0
    finally:
        for p in (cl, srv):
            if p.poll() is None:
                p.kill()
    r = subprocess.run(CLI + ["qps", "-i", pair["a"], "--json"], capture_output=True, text=True, timeout=30)
    assert json.loads(r.stdout) == []
    # and no empty publish directory is left behind per instance
    assert not os.path.exists(os.path.join("/run/mrc-xdp/qps", pair["a"]))
