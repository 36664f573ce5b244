"""Where a lab node's set-up runs: a network namespace here, or a VM over SSH.

The lab code (fabric.py, hosts.py) configures a node through one of these executors,
whatever the node is:

- ``NetnsNode(ns)``: the node is network namespace ``ns`` of this machine (the netns lab);
- ``SshNode(name, argv)``: the node is a VM reached with ``argv + [command]`` (plain QEMU
  with a forwarded port, or Vagrant's ssh-config); the guest image carries this checkout
  at /opt/mrc-xdp with its own .venv (vagrant/build-image.sh runs scripts/setup.sh in it).

Both offer the same operations: ``sysctls(pairs)``, ``ip_batch(lines)`` (iproute2 batch),
and ``run(argv)``; a VM also ``run_module``, through which mrc_xdp.lab.agent runs the
lab's own functions on the node (``agent.call(node, fn, **kwargs)``).
"""
from __future__ import annotations

import json
import shlex
import subprocess

GUEST_ROOT = "/opt/mrc-xdp"
GUEST_PY = GUEST_ROOT + "/.venv/bin/python"


class ExecError(RuntimeError):
    """A command on a node failed; str() is one line."""


def _last_line(text: str, rc: int) -> str:
    lines = [ln for ln in (text or "").strip().splitlines() if ln.strip()]
    return lines[-1].strip() if lines else "exit status %d" % rc


class NetnsNode:
    """A lab node that is a network namespace of this machine."""

    kind = "netns"

    def __init__(self, name: str, ns: str):
        self.name, self.ns = name, ns

    @property
    def netns_name(self) -> str:
        return self.ns

    def sysctls(self, pairs) -> None:
        from mrc_xdp.datapath import netns
        with netns.enter(self.ns):
            for k, v in pairs:
                with open("/proc/sys/" + k.replace(".", "/"), "w") as f:
                    f.write(str(v))

    def ip_batch(self, lines, timeout: float = 60) -> None:
        if not lines:
            return
        p = subprocess.run(["ip", "-n", self.ns, "-batch", "-"], input="\n".join(lines) + "\n",
                           stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, timeout=timeout)
        if p.returncode:
            raise ExecError("%s: ip -batch failed: %s" % (self.name, _last_line(p.stderr, p.returncode)))

    def run(self, argv, input: str | None = None, timeout: float = 60, check: bool = True):
        from mrc_xdp.datapath import netns
        p = netns.run_cmd(self.ns, argv, check=False, timeout=timeout, input=input)
        if check and p.returncode:
            raise ExecError("%s: %s failed: %s" % (self.name, argv[0], _last_line(p.stderr, p.returncode)))
        return p



class SshNode:
    """A lab node that is a VM; ``argv`` runs a shell command on it as root."""

    kind = "vm"
    netns_name = None

    def __init__(self, name: str, argv: list[str]):
        self.name, self.argv = name, list(argv)

    def _ssh(self, command: str, input: str | None, timeout: float):
        try:
            return subprocess.run(self.argv + [command], input=input, stdout=subprocess.PIPE,
                                  stderr=subprocess.PIPE, text=True, timeout=timeout)
        except subprocess.TimeoutExpired:
            raise ExecError("%s: `%s` did not finish in %d s" % (self.name, command[:60], timeout)) from None

    def sysctls(self, pairs) -> None:
        if pairs:
            self.run(["sysctl", "-q", "-w"] + ["%s=%s" % (k, v) for k, v in pairs])

    def ip_batch(self, lines, timeout: float = 120) -> None:
        if not lines:
            return
        p = self._ssh("ip -batch -", "\n".join(lines) + "\n", timeout)
        if p.returncode:
            raise ExecError("%s: ip -batch failed: %s" % (self.name, _last_line(p.stderr, p.returncode)))

    def run(self, argv, input: str | None = None, timeout: float = 120, check: bool = True):
        p = self._ssh(" ".join(shlex.quote(a) for a in argv), input, timeout)
        if check and p.returncode:
            raise ExecError("%s: %s failed: %s" % (self.name, argv[0], _last_line(p.stderr, p.returncode)))
        return p

    def run_module(self, module: str, fn: str, kwargs: dict, timeout: float = 900):
        """``python -m MODULE FN`` in the guest's checkout, kwargs as JSON on stdin; the
        result from the JSON line it prints (mrc_xdp.lab.agent's protocol)."""
        p = self._ssh("cd %s && %s -m %s %s" % (GUEST_ROOT, GUEST_PY, module, fn), json.dumps(kwargs), timeout)
        out = [ln for ln in p.stdout.splitlines() if ln.startswith("{")]
        res = json.loads(out[-1]) if out else None
        if p.returncode or not isinstance(res, dict) or "error" in (res or {}):
            why = (res or {}).get("error") or _last_line(p.stderr, p.returncode)
            raise ExecError("%s: %s: %s" % (self.name, fn, why))
        return res.get("result")
