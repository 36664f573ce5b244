"""The transport: RDMA Write over AF_XDP, the reliable connection of MRC.

- ``endpoint``: the Python API (this package re-exports it): ``Endpoint`` on a datapath
  instance, memory regions (``MR``), queue pairs (``QP``), a completion queue (``CQ``).
- ``engine/``: the C progress engine (engine.c, engine.h) and its cffi builder; the
  compiled module is ``mrc_xdp.transport._engine``.
- ``conns``: connections added to the datapath at run time, and reaping them.
- ``bootstrap``: the out-of-band TCP exchange of QP attributes (untrusted input, checked).
- ``perf``: the perftest-style tools (write-bw, write-lat, send / recv, qps) as functions.

Depends on ``mrc_xdp.datapath`` only.
"""
from mrc_xdp.transport.endpoint import (  # noqa: F401 - the package's API
    ACCESS_LOCAL, ACCESS_REMOTE_WRITE, CQ, DATA_OVERHEAD, MR, PAYLOAD_ALIGN, QP, QP_STATS_DIR,
    TSETH_LEN, XSKMAP, Completion, Endpoint, QpState, TransportError, WcOpcode, WcStatus,
    default_payload, icrc, local_addr, published_qps, send_slot_name)

__all__ = [
    "ACCESS_LOCAL", "ACCESS_REMOTE_WRITE", "CQ", "DATA_OVERHEAD", "MR", "PAYLOAD_ALIGN", "QP",
    "QP_STATS_DIR", "TSETH_LEN", "XSKMAP", "Completion", "Endpoint", "QpState",
    "TransportError", "WcOpcode", "WcStatus", "default_payload", "icrc", "local_addr",
    "published_qps", "send_slot_name"]
