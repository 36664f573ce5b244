"""Kernel matrix: the datapath loads and passes tier-1 cases on the kernels users run.

Each case boots one Debian kernel (tools/kmatrix.py: 6.1 = Debian 12, 6.12 = bookworm-
backports, 7 = trixie-backports) under QEMU with TCG through virtme-ng, on the host's own
root file system, and runs inside it the verifier-load test and a sample of tier-1 cases
(one bcc build per guest).  A kernel whose verifier rejects a program fails here.  The
kernels are fetched by `make kmatrix-setup` (part of `make test`) and cached under
/var/cache/mrc-xdp/kernels.  ~2-4 min per kernel on 2 cores, run one after another.

MRC_KMATRIX=0 skips the matrix (a quick local run; CI never sets it).
"""
from __future__ import annotations

import os
import re
import subprocess
import sys

import pytest

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, os.path.join(ROOT, "tools"))
import kmatrix  # noqa: E402

# The sample run in every guest: verifier headroom (all three programs load), the spray
# path that once failed on 6.1 / 6.12 (every opcode: EV rewrite, ICRC and UDP checksum
# fix), the EV selection loop (no usable EV, spill to the other plane), SRv6 encap and
# decap, the PSN ring, ingress delivery and SACK loss attribution.
SAMPLE = ["tests/test_datapath_verifier.py", "tests/test_datapath_spray.py",
          "tests/test_datapath_ingress.py", "tests/test_datapath_evstate.py",
          "-k", "verifier or rewrites_every_opcode or srv6_encapsulates or no_usable_ev or "
                "records_psn or for_us_goes_to_engine or srv6_decap_every_opcode or "
                "srv6_feedback_applied or sack_hole_loss or spills_to_the_other"]
GUEST_TIMEOUT = 540     # s, boot + bcc build + tests of one kernel under TCG


def _sample_size() -> int:
    """How many cases SAMPLE selects (collected on the host: the same checkout)."""
    p = subprocess.run([sys.executable, "-m", "pytest", "--collect-only", "-q",
                        "-p", "no:cacheprovider"] + SAMPLE,
                       cwd=ROOT, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
    m = re.search(r"(\d+)/\d+ tests collected", p.stdout)
    assert m, "cannot collect the sample: %s" % p.stdout[-500:]
    return int(m.group(1))


@pytest.fixture(scope="module")
def sample_size():
    return _sample_size()


@pytest.mark.parametrize("kernel", list(kmatrix.KERNELS))
def test_datapath_on_kernel(kernel, sample_size):
    if os.environ.get("MRC_KMATRIX") == "0":
        pytest.skip("MRC_KMATRIX=0: kernel matrix skipped on request")
    if os.geteuid() != 0:
        pytest.skip("the kernel matrix boots kernels and loads BPF: run as root")
    if not kmatrix.unpacked(kernel):
        pytest.fail("kernel %s is not fetched: run `make kmatrix-setup`" % kernel, pytrace=False)
    p = subprocess.run([sys.executable, os.path.join(ROOT, "tools", "kmatrix.py"), "run",
                        kernel, "--timeout", str(GUEST_TIMEOUT), "--"] + SAMPLE + ["-rs"],
                       cwd=ROOT, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True,
                       timeout=GUEST_TIMEOUT + 60)
    out = p.stdout
    print(out[-3000:])
    summary = [ln for ln in out.splitlines() if ln.startswith("kmatrix: %s " % kernel)]
    assert p.returncode == 0, "kernel %s: %s" % (kernel, summary[-1] if summary else out[-2000:])
    # the guest ran the booted kernel it was meant to, and every sampled case passed there
    m = re.search(r"^kmatrix: %s (\S+): (\d+) passed, \d+ deselected in" % re.escape(kernel),
                  out, re.M)
    assert m, "kernel %s: no pass summary: %s" % (kernel, summary)
    assert m.group(1).startswith(kmatrix.KERNELS[kernel][1]), \
        "kernel %s: the guest ran %s" % (kernel, m.group(1))
    assert int(m.group(2)) == sample_size, \
        "kernel %s: %s of %d sampled cases passed (skipped or missing: %s)" \
        % (kernel, m.group(2), sample_size, summary)
