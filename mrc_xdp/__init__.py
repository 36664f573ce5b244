"""mrc-xdp: MRC (Multipath Reliable Connection) on Linux hosts, with XDP and AF_XDP.

One package per concern; dependencies point one way, towards the datapath:

    cli  ->  lab, observe, collective (+ torch)  ->  health  ->  transport  ->  datapath

- ``datapath``: the XDP programs' control plane (config, compile and load, the pinned maps,
  the C/Python contract, packet layouts).
- ``transport``: the reliable connection (the AF_XDP engine in C and its Python API, run-time
  connections, the bootstrap, the perftest-style tools).
- ``health``: the path health daemon, probes, fabric check.
- ``observe``: the Prometheus endpoint and ``top``.
- ``collective``: collectives over the transport; ``torch``: the PyTorch backend "mrc".
- ``lab``: the multi-plane lab (network namespaces or VMs), its link model, the demos.
- ``cli``: ``mrc-xdp``, the only package that knows argparse.

Modules that moved in 0.2 keep working under their old names (``mrc_xdp.maps``,
``mrc_xdp.probe``, ...): importing one gives the new module itself, with a
DeprecationWarning naming the new path (docs/changelog.md lists them).
"""
from __future__ import annotations

import importlib
import importlib.abc
import importlib.util
import sys
import warnings

# old module name -> new one (0.1 -> 0.2)
MOVED = {
    **{"mrc_xdp." + m: "mrc_xdp.datapath." + m
       for m in ("config", "validate", "names", "shared", "bpfsrc", "bpfsys", "kheaders", "loader",
                 "maps", "wire", "netns")},
    **{"mrc_xdp." + m: "mrc_xdp.transport." + m for m in ("conns", "bootstrap", "perf")},
    "mrc_xdp.engine": "mrc_xdp.transport.engine",
    "mrc_xdp.engine.build": "mrc_xdp.transport.engine.build",
    "mrc_xdp._engine": "mrc_xdp.transport._engine",
    "mrc_xdp.probe": "mrc_xdp.health.probe",
    "mrc_xdp.fabriccheck": "mrc_xdp.health.fabriccheck",
    "mrc_xdp.metrics": "mrc_xdp.observe.metrics",
    "mrc_xdp.top": "mrc_xdp.observe.top",
    "mrc_xdp.traffic": "mrc_xdp.lab.traffic",
    "mrc_xdp.demo": "mrc_xdp.lab.demo",
    "mrc_xdp.train_demo": "mrc_xdp.lab.train_demo",
    "mrc_xdp.lab.cli": "mrc_xdp.cli.lab",
}


class _MovedFinder(importlib.abc.MetaPathFinder, importlib.abc.Loader):
    """Resolves an old module name to the moved module (the same object, so state and
    monkeypatching are shared)."""

    def find_spec(self, name, path=None, target=None):
        if name in MOVED:
            return importlib.util.spec_from_loader(name, self)
        return None

    def create_module(self, spec):
        new = MOVED[spec.name]
        warnings.warn("%s moved to %s" % (spec.name, new), DeprecationWarning, stacklevel=2)
        return importlib.import_module(new)

    def exec_module(self, module):
        pass


if not any(isinstance(f, _MovedFinder) for f in sys.meta_path):
    sys.meta_path.append(_MovedFinder())
