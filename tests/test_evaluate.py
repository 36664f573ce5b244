"""Smoke test of the evaluation (tools/evaluate.py --quick --only e,d): the datapath
cost bench and the ring all-reduce over MRC and TCP on a real netns lab, written up
into a temporary directory.  Checks the report, the plots and that they carry measured
numbers (every all-reduce verified against numpy's sum); asserts no speed."""
import json
import os
import subprocess
import sys

import pytest

pytestmark = pytest.mark.skipif(os.geteuid() != 0, reason="the lab and BPF need root")

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def test_evaluate_quick(tmp_path):
    out = tmp_path / "res"
    p = subprocess.run([sys.executable, os.path.join(ROOT, "tools", "evaluate.py"), "--quick", "--only", "e,d",
                        "--out", str(out)], capture_output=True, text=True, timeout=900, cwd=ROOT)
    assert p.returncode == 0, p.stderr[-2000:]
    assert "[evaluate" in p.stderr            # progress lines while it runs
    rep = (out / "REPORT.md").read_text()
    res = json.loads((out / "results.json").read_text())
    for png in ("d_allreduce.png", "e_xdp.png"):
        data = (out / png).read_bytes()
        assert data[:8] == b"\x89PNG\r\n\x1a\n" and len(data) > 10000, png
        assert "](%s)" % png in rep
    assert "## (d) Ring all-reduce" in rep and "## (e) Datapath cost per packet" in rep
    assert "load average" in rep and "rerun" in rep.lower()
    d = res["results"]["d"]
    for k in ("mrc_healthy", "tcp_healthy", "mrc_flap", "tcp_flap"):
        run = d["runs"][k]
        assert run["verified"] is True, k
        assert len(run["per_iter_s"]) == d["iters"] and all(t > 0 for t in run["per_iter_s"])
        assert "| %s | %.1f ms |" % (k.replace("_", ", "), 1e3 * run["median_s"]) in rep
    assert d["runs"]["mrc_flap"]["flaps"] >= 1 and d["runs"]["tcp_flap"]["flaps"] >= 1
    e = res["results"]["e"]
    assert e["baseline"]["ns"] > 0 and len(e["cases"]) >= 10
    for c in e["cases"]:
        if not c.get("formula"):              # timed as it is (the program or a copy): a cost
            assert c["ns"] > 0, c
            assert "| %s | %.1f |" % (c["name"], c["ns"]) in rep
        else:                                 # a difference of timings: noise can make it < 0
            assert c["method"] == "copy" and c["ns_min"] <= c["ns"] <= c["ns_max"], c
            assert "| %s * | %.1f |" % (c["name"], c["ns"]) in rep
    assert any(c["method"] == "direct" for c in e["cases"])
    for line in res["headline"]:                  # the headline lines are in the report
        assert "- " + line in rep
    assert any(line.startswith("(d)") for line in res["headline"])
    assert any(line.startswith("(e)") for line in res["headline"])


def test_fault_schedule_fixed_and_balanced():
    """(h)'s schedule: the same for a seed, the four kinds in equal numbers, every target
    in the lab, durations as the issue gives them (T1 5-30 s, NIC 10 s)."""
    sys.path.insert(0, os.path.join(ROOT, "tools"))
    import eval_jobs
    from mrc_xdp.lab import topology
    topo = topology.load(mode="ecmp")
    a, b = eval_jobs.schedule(topo, 20), eval_jobs.schedule(topo, 20)
    assert a == b and len(a) == 20
    assert a != eval_jobs.schedule(topo, 20, seed=eval_jobs.SEED + 1)
    kinds = [f["kind"] for f in a]
    assert sorted(set(kinds)) == sorted(eval_jobs.KINDS) and all(kinds.count(k) == 5 for k in eval_jobs.KINDS)
    links = {lk.name: lk for lk in topo.links}
    t1s = {topo.t1_name(p, j) for p in range(topo.planes) for j in range(topo.t1_per_plane)}
    for f in a:
        assert 0.5 <= f["start_s"] <= 3.0
        if f["kind"] == "t1_down":
            assert f["target"] in t1s and 5 <= f["duration_s"] <= 30
        elif f["kind"] == "nic_down":
            assert links[f["target"]].tier != "fabric" and f["duration_s"] == 10
        else:
            assert links[f["target"]].tier == "fabric"
        assert eval_jobs.fault_text(f)


def test_evaluate_jobs_quick(tmp_path):
    """--quick --only f,g: the job-level parts on a real lab, written up.
    (f) allreduce-perf over MRC and gloo (rate-limited, then unthrottled): every table row
    checked exact, every figure measured (> 0) and in the report.  (g) one DDP training
    run (examples/train_ddp.py) over MRC, gloo and gloo over MPTCP, each of which must
    finish: the evaluation stops at a failed (g) run, and a DDP job over "mrc" that died
    fails this test.  No speed is asserted.  Part h (jobs under faults) runs by hand
    (docs/testing.md).  A healthy MRC job that stalled here (CI, 2026-12-06) was a
    datapath defect, found and fixed (docs/testing.md)."""
    out = tmp_path / "res"
    p = subprocess.run([sys.executable, os.path.join(ROOT, "tools", "evaluate.py"), "--quick", "--only", "f,g",
                        "--out", str(out)], capture_output=True, text=True, timeout=1800, cwd=ROOT)
    assert p.returncode == 0, p.stderr[-3000:]
    rep = (out / "REPORT.md").read_text()
    res = json.loads((out / "results.json").read_text())["results"]
    for png, title in (("f_allreduce_perf.png", "## (f) allreduce-perf"), ("g_training.png", "## (g)")):
        data = (out / png).read_bytes()
        assert data[:8] == b"\x89PNG\r\n\x1a\n" and len(data) > 10000, png
        assert "](%s)" % png in rep and title in rep
    g = res["g"]
    for tr in ("mrc", "gloo", "mptcp"):
        runs = g["runs"][tr]
        assert len(runs) == 1 and runs[0]["samples_per_s"] > 0 and runs[0]["params"] > 0, tr
    f = res["f"]
    assert f["capacity"]["host_to_host_bps"] == 4 * f["rate_bps"]
    for kind in ("limited", "free"):
        for tr in ("mrc", "gloo"):
            rows = f[kind][tr]["rows"]
            assert rows and all(r["wrong"] == 0 and r["busbw"] > 0 for r in rows), (kind, tr)
    sizes = [r["size"] for r in f["limited"]["mrc"]["rows"]]
    assert sizes == [r["size"] for r in f["limited"]["gloo"]["rows"]] and sizes[0] == 1024
    heads = json.loads((out / "results.json").read_text())["headline"]
    assert any(line.startswith("(f)") for line in heads)
    for line in heads:
        assert "- " + line in rep
