#!/usr/bin/python
# The role's command runner: ansible.builtin.command/shell, except that the output is read
# to the end of both pipes (subprocess communicate) before the result is made.
#
# Why: ansible-core's AnsibleModule.run_command (2.19.14, the version setup.sh pins) reads
# the pipes in a loop of select(1 s) and leaves it when a select timed out *and* the process
# has exited; a process that writes its output and exits between the two is reported with
# rc 0 and no stdout (ansible/ansible#51393, "run_command() scheduling race").  A CLI that
# prints its JSON at the end of a 10-20 s run in a QEMU TCG guest hits that window: the VM
# fleet test saw `status --json` come back empty on a guest (from_json failed in
# plane-drain.yml) and "Is the datapath loaded" come back empty on a loaded guest (the
# second deploy reloaded its datapath, changed=1).  Every task of the role that reads a
# command's output runs through this module.
from __future__ import annotations

DOCUMENTATION = r"""
module: mrc_xdp_command
short_description: run a command and return its complete output (the mrc_xdp role)
options:
  cmd: {description: the command line, type: str, required: true}
  shell: {description: run it with /bin/sh -c (as ansible.builtin.shell), type: bool, default: false}
  chdir: {description: change into this directory first, type: path}
"""

import datetime
import os
import shlex
import subprocess

from ansible.module_utils.basic import AnsibleModule


def main():
    m = AnsibleModule(argument_spec={"cmd": {"type": "str", "required": True},
                                     "shell": {"type": "bool", "default": False},
                                     "chdir": {"type": "path"}},
                      supports_check_mode=False)
    cmd, shell, chdir = m.params["cmd"], m.params["shell"], m.params["chdir"]
    argv = ["/bin/sh", "-c", cmd] if shell else shlex.split(cmd)
    start = datetime.datetime.now()
    try:
        p = subprocess.run(argv, stdin=subprocess.DEVNULL, capture_output=True, cwd=chdir or None)
    except OSError as e:
        m.fail_json(msg="%s: %s" % (argv[0], e.strerror or e), rc=e.errno or 2, cmd=cmd, stdout="", stderr="")
    end = datetime.datetime.now()
    out = p.stdout.decode("utf-8", "replace").rstrip("\n")
    err = p.stderr.decode("utf-8", "replace").rstrip("\n")
    res = {"cmd": cmd, "rc": p.returncode, "stdout": out, "stderr": err, "changed": True,
           "start": str(start), "end": str(end), "delta": str(end - start)}
    if p.returncode != 0:
        m.fail_json(msg="non-zero return code", **res)
    m.exit_json(**res)


if __name__ == "__main__":
    main()
