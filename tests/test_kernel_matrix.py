"""Kernel matrix: the datapath loads and passes tier-1 cases on the kernels users run.

Each case boots one Debian kernel (tools/kmatrix.py: 6.1 = Debian 12, 6.12 = bookworm-
backports, 7 = trixie-backports) under QEMU with TCG through virtme-ng, on the host's own
root file system, and runs inside it the verifier-load test and a sample of tier-1 cases
(one bcc build per guest).  A kernel whose verifier rejects a program fails here.  The
kernels are fetched by `make kmatrix-setup` (part of `make test`) and cached under
/var/cache/mrc-xdp/kernels.  The guests boot side by side, one vCPU each (~2-4 min of
bcc build per kernel under TCG; the three together take about half their sum on 2 cores).

MRC_KMATRIX=0 skips the matrix (a quick local run; CI never sets it).
"""
from __future__ import annotations

import os
import re
import subprocess
import sys
import tempfile

import pytest

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, os.path.join(ROOT, "tools"))
import kmatrix  # noqa: E402

# The sample run in every guest (one bcc build for all): verifier headroom (all three
# programs load), the spray paths that once failed on 6.1 / 6.12 (EV rewrite with the
# ICRC and UDP checksum fix, the EV selection loop), SRv6 encap and decap, the PSN ring,
# ingress delivery and SACK loss attribution.  Explicit cases, few: under TCG each one
# costs ~1-3 s of map rewriting.
SAMPLE = [
    "tests/test_datapath_verifier.py::test_verifier_headroom",
    "tests/test_datapath_spray.py::test_spray_rewrites_every_opcode[WRITE_FIRST]",
    "tests/test_datapath_spray.py::test_spray_rewrites_every_opcode[WRITE_ONLY_IMM-ts-csum]",
    "tests/test_datapath_spray.py::test_spray_rewrites_every_opcode[sack-csum]",
    "tests/test_datapath_spray.py::test_spray_rewrites_every_opcode[data-big]",
    "tests/test_datapath_spray.py::test_spray_checksum_with_unaligned_trailer[data-odd-3]",
    "tests/test_datapath_spray.py::test_spray_second_connection",
    "tests/test_datapath_spray.py::test_spray_no_usable_ev_drops",
    "tests/test_datapath_spray.py::test_spray_srv6_encapsulates[sack2-tmpl-6-usids]",
    "tests/test_datapath_spray.py::test_spray_records_psn_to_ev",
    "tests/test_datapath_ingress.py::test_ingress_for_us_goes_to_engine[WRITE_ONLY_IMM-ts]",
    "tests/test_datapath_ingress.py::test_ingress_srv6_decap_every_opcode[1-sack]",
    "tests/test_datapath_ingress.py::test_ingress_srv6_feedback_applied_after_decap",
    "tests/test_datapath_evstate.py::test_sack_hole_loss[at-reorder]",
    "tests/test_datapath_evstate.py::test_no_usable_ev_in_a_plane_spills_to_the_other",
    "tests/test_datapath_evstate.py::test_many_holes_in_one_sack",
    "tests/test_probe_datapath.py::test_spray_sends_probe_on_its_ev[backup]",
    "tests/test_probe_datapath.py::test_ingress_srv6_answer_is_encapsulated[ev-foreign-1]",
    "tests/test_probe_datapath.py::test_ingress_answer_rate_limited",
    "tests/test_probe_datapath.py::test_evop_emits_event_and_respects_the_swap_lock",
]
# s, boot + bcc build + tests of one kernel under TCG: ~2-3 min on an idle 2-core host,
# 6.5-7 min measured with the host at load 10-12 (other test suites running alongside)
GUEST_TIMEOUT = 900


_guests: dict = {}


def _start_guests() -> None:
    """Boot every fetched kernel at once, one vCPU each: a guest's time is almost all one
    single-threaded bcc build under TCG, so on a 2-core host running them side by side
    takes about half as long as one after another (each test then waits for its own)."""
    if _guests:
        return
    for k in kmatrix.KERNELS:
        if not kmatrix.unpacked(k):
            continue
        log = tempfile.TemporaryFile(mode="w+")
        p = subprocess.Popen([sys.executable, os.path.join(ROOT, "tools", "kmatrix.py"), "run", k,
                              "--cpus", "1", "--timeout", str(GUEST_TIMEOUT), "--"]
                             + SAMPLE + ["--durations=3"],
                             cwd=ROOT, stdout=log, stderr=subprocess.STDOUT, text=True,
                             stdin=subprocess.DEVNULL)
        _guests[k] = (p, log)


@pytest.fixture(scope="module", autouse=True)
def _end_guests():
    yield
    for p, log in _guests.values():     # a test that failed early leaves no guest behind
        if p.poll() is None:
            p.terminate()
            try:
                p.wait(timeout=30)
            except subprocess.TimeoutExpired:
                p.kill()
        log.close()
    _guests.clear()


@pytest.mark.parametrize("kernel", list(kmatrix.KERNELS))
def test_datapath_on_kernel(kernel):
    if os.environ.get("MRC_KMATRIX") == "0":
        pytest.skip("MRC_KMATRIX=0: kernel matrix skipped on request")
    if os.geteuid() != 0:
        pytest.skip("the kernel matrix boots kernels and loads BPF: run as root")
    if not kmatrix.unpacked(kernel):
        pytest.fail("kernel %s is not fetched: run `make kmatrix-setup`" % kernel, pytrace=False)
    _start_guests()
    p, log = _guests[kernel]
    try:
        rc = p.wait(timeout=GUEST_TIMEOUT + 120)
    except subprocess.TimeoutExpired:
        p.kill()
        rc = p.wait()
    log.seek(0)
    out = log.read()
    print(out[-3000:])
    summary = [ln for ln in out.splitlines() if ln.startswith("kmatrix: %s " % kernel)]
    assert rc == 0, "kernel %s: %s" % (kernel, summary[-1] if summary else out[-2000:])
    # the guest ran the booted kernel it was meant to, and every sampled case passed there
    m = re.search(r"^kmatrix: %s (\S+): (\d+) passed in" % re.escape(kernel), out, re.M)
    assert m, "kernel %s: no pass summary: %s" % (kernel, summary)
    assert m.group(1).startswith(kmatrix.KERNELS[kernel][1]), \
        "kernel %s: the guest ran %s" % (kernel, m.group(1))
    assert int(m.group(2)) == len(SAMPLE), \
        "kernel %s: %s of %d sampled cases passed: %s" % (kernel, m.group(2), len(SAMPLE), summary)
