"""Fixtures of the tier-1 datapath tests (tests/test_datapath_*.py).

``dp_env`` (session): one bcc build of bpf/mrc_datapath.c and a private network
namespace ``mrct1-<pid>`` holding veth pairs mrc0/mrc0p, p0/q0, p1/q1; the namespace is
deleted at the end of the session whatever happened.
``datapath`` (per test): the same, with the test pinned to one CPU.
``ecmp`` / ``srv6`` (per test): ``datapath`` with every map rewritten from the ECMP or
SRv6 test configuration and all run-time state zeroed (tests/helpers.py).

Everything is lazy: tests that do not ask for these fixtures never build BPF.
"""
from __future__ import annotations

import os
import sys

import pytest

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))   # tests/helpers.py

NS_PREFIX = "mrct1-"


def _reap_stale_namespaces() -> None:
    """Remove namespaces left by earlier sessions that were killed (their pid is gone)."""
    from mrc_xdp.datapath import netns
    for name in netns.list_names(NS_PREFIX):
        pid = name[len(NS_PREFIX):]
        if pid.isdigit() and not os.path.exists("/proc/%s" % pid):
            netns.delete(name)


@pytest.fixture(scope="session")
def dp_env():
    import helpers

    if os.geteuid() != 0:
        pytest.skip("tier-1 datapath tests load BPF programs: run them as root")
    why = helpers.bpf_available()
    if why:
        pytest.skip("BPF is not available on this kernel: %s" % why)
    try:
        import bcc  # noqa: F401
    except ImportError as e:   # a set-up problem, not a missing kernel feature: fail loudly
        pytest.fail("bcc is not importable (%s): run `make setup`" % e, pytrace=False)
    from mrc_xdp.datapath import netns

    _reap_stale_namespaces()
    env = helpers.Env("%s%d" % (NS_PREFIX, os.getpid()))
    env.cpu = min(os.sched_getaffinity(0))
    try:
        try:
            env.setup()
        except netns.NetnsError as e:
            pytest.skip("cannot create a network namespace here: %s" % e)
        yield env
    finally:
        env.close()


@pytest.fixture
def datapath(dp_env):
    """The session's datapath, with this test pinned to one CPU: rotation state and
    counters are per CPU, and a test that follows a rotation must see one CPU's state.
    (Only for the test: processes other tests fork must not inherit the pinning.)"""
    old = os.sched_getaffinity(0)
    os.sched_setaffinity(0, {dp_env.cpu})
    try:
        yield dp_env
    finally:
        os.sched_setaffinity(0, old)


@pytest.fixture
def ecmp(datapath):
    """The datapath in ECMP mode, freshly configured (connections A and B, two planes)."""
    return datapath.use("ecmp")


@pytest.fixture
def srv6(datapath):
    """The datapath in SRv6 mode, freshly configured (templates to_a, to_b)."""
    return datapath.use("srv6")
