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
        assert c["ns"] > 0
        assert "| %s | %.1f |" % (c["name"], c["ns"]) in rep
    for line in res["headline"]:                  # the headline lines are in the report
        assert "- " + line in rep
    assert any(line.startswith("(d)") for line in res["headline"])
    assert any(line.startswith("(e)") for line in res["headline"])
