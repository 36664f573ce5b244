"""Path health: what keeps a host's EVs usable while the fabric changes.

- ``daemon``: the health daemon (probe and resurrect retired EVs, background probes, plane
  NIC state, the event hub that serves ``mrc-xdp events`` and ``top``).
- ``probe``: probes answered in the datapath (``Prober``), one EV at a time or in batches.
- ``fabriccheck``: probe every path to every peer and localise a bad link or switch.

Depends on ``mrc_xdp.datapath`` and ``mrc_xdp.transport.conns``.
"""

_DAEMON_API = ("Daemon", "HealthConfig", "HealthError", "DEFAULT_SOCKET", "SOCKET_ENV", "socket_path",
               "status", "connect", "request_lines", "event_dict", "format_event", "load_prober",
               "ProberUnavailable", "ev_states")


def __getattr__(name):
    """mrc_xdp.health was the daemon's module before 0.2: its API is still found here
    (imported on first use, so ``health.probe`` does not load the daemon)."""
    if name in _DAEMON_API:
        from mrc_xdp.health import daemon
        return getattr(daemon, name)
    raise AttributeError("module %r has no attribute %r" % (__name__, name))
