"""The package's shape (issue 16): one package per concern, dependencies one way.

Reads mrc_xdp/ with ast (no module is imported): every import between mrc_xdp's modules,
at any depth (function-level imports too), is an edge.  Fails on an import cycle, on a
library module that imports mrc_xdp.cli or argparse, on more than five modules at the top
level, and on a module anywhere in the repository that still uses a name that moved in
0.2 (those resolve only through mrc_xdp's compatibility aliases, for users' code)."""
from __future__ import annotations

import ast
import os

import pytest

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
PKG = os.path.join(ROOT, "mrc_xdp")

# a package may import only packages at its own layer or below (lower index)
LAYERS = [{"datapath"}, {"transport"}, {"health"}, {"observe", "collective", "torch", "lab", "fleet"}, {"cli"}]


def modules() -> dict[str, str]:
    out = {}
    for dp, dn, fn in os.walk(PKG):
        dn[:] = [d for d in dn if d != "__pycache__"]
        for f in fn:
            if f.endswith(".py"):
                path = os.path.join(dp, f)
                name = os.path.relpath(path, ROOT)[:-3].replace(os.sep, ".")
                out[name[:-9] if name.endswith(".__init__") else name] = path
    return out


MODS = modules()


def _resolve(name: str, node: ast.ImportFrom, is_pkg: bool) -> str:
    if not node.level:
        return node.module or ""
    parts = name.split(".") if is_pkg else name.split(".")[:-1]
    parts = parts[:len(parts) - (node.level - 1)]
    return ".".join(parts + ([node.module] if node.module else []))


def imports(name: str) -> set[str]:
    """mrc_xdp modules (and argparse) imported by module `name`."""
    path = MODS[name]
    tree = ast.parse(open(path, encoding="utf-8").read(), path)
    out = set()
    for n in ast.walk(tree):
        if isinstance(n, ast.Import):
            out |= {a.name for a in n.names if a.name.startswith("mrc_xdp") or a.name == "argparse"}
        elif isinstance(n, ast.ImportFrom):
            base = _resolve(name, n, path.endswith("__init__.py"))
            if base == "argparse":
                out.add(base)
            elif base == "mrc_xdp" or base.startswith("mrc_xdp."):
                for a in n.names:
                    sub = base + "." + a.name
                    out.add(sub if sub in MODS else base)
    return out


GRAPH = {m: {d for d in imports(m) if d != m} for m in MODS}


def _package(mod: str) -> str:
    parts = mod.split(".")
    return parts[1] if len(parts) > 1 else ""


def test_top_level_has_at_most_five_modules():
    top = [m for m in MODS if m.count(".") == 1 and not os.path.basename(MODS[m]) == "__init__.py"
           and m not in ("mrc_xdp.__main__",)]
    assert len(top) <= 5, sorted(top)


def test_no_import_cycle():
    """Tarjan's strongly connected components over module -> imported module (a package's
    __init__ counts as the package; importing a submodule is an edge to the submodule)."""
    index, low, stack, on, sccs = {}, {}, [], set(), []

    def strong(v):
        index[v] = low[v] = len(index)
        stack.append(v)
        on.add(v)
        for w in GRAPH.get(v, ()):
            if w not in MODS:
                continue
            if w not in index:
                strong(w)
                low[v] = min(low[v], low[w])
            elif w in on:
                low[v] = min(low[v], index[w])
        if low[v] == index[v]:
            comp = []
            while True:
                w = stack.pop()
                on.discard(w)
                comp.append(w)
                if w == v:
                    break
            if len(comp) > 1:
                sccs.append(sorted(comp))

    for v in sorted(MODS):
        if v not in index:
            strong(v)
    assert not sccs, "import cycles: %s" % sccs


@pytest.mark.parametrize("mod", sorted(m for m in MODS if _package(m) not in ("cli", "__main__")))
def test_library_module_knows_no_cli(mod):
    bad = sorted(d for d in GRAPH[mod] if d == "argparse" or d == "mrc_xdp.cli" or d.startswith("mrc_xdp.cli."))
    assert not bad, "%s imports %s: only mrc_xdp.cli may (libraries raise their own errors)" % (mod, bad)


def test_dependencies_point_towards_the_datapath():
    rank = {p: i for i, layer in enumerate(LAYERS) for p in layer}
    bad = []
    for m, deps in GRAPH.items():
        pm = _package(m)
        if pm not in rank:
            continue
        for d in deps:
            pd = _package(d)
            if pd in rank and rank[pd] > rank[pm]:
                bad.append("%s -> %s" % (m, d))
    assert not bad, "imports against the layering %s: %s" % (
        " <- ".join("/".join(sorted(l)) for l in LAYERS), bad)


def test_nothing_in_the_repository_uses_a_moved_name():
    """The aliases are for users' code; ours imports the new paths (so the aliases'
    DeprecationWarning never fires from here)."""
    from mrc_xdp import MOVED
    bad = []
    for d in ("mrc_xdp", "tests", "tools", "examples"):
        for dp, dn, fn in os.walk(os.path.join(ROOT, d)):
            dn[:] = [x for x in dn if x != "__pycache__"]
            for f in fn:
                if not f.endswith(".py"):
                    continue
                path = os.path.join(dp, f)
                rel = os.path.relpath(path, ROOT)
                if rel == os.path.join("mrc_xdp", "__init__.py"):
                    continue
                tree = ast.parse(open(path, encoding="utf-8").read(), path)
                for n in ast.walk(tree):
                    names = []
                    if isinstance(n, ast.Import):
                        names = [a.name for a in n.names]
                    elif isinstance(n, ast.ImportFrom) and not n.level and n.module:
                        names = [n.module] + [n.module + "." + a.name for a in n.names]
                    for x in names:
                        if x in MOVED:
                            bad.append("%s:%d %s" % (rel, n.lineno, x))
    assert not bad, "old module names (use the new ones, docs/changelog.md): %s" % bad


def test_old_names_resolve_to_the_new_modules():
    """A user's `import mrc_xdp.maps` still works: the same module object, with a warning."""
    import importlib
    import sys
    from mrc_xdp import MOVED
    for old in ("mrc_xdp.maps", "mrc_xdp.probe", "mrc_xdp.lab.cli"):
        sys.modules.pop(old, None)
        with pytest.warns(DeprecationWarning, match="moved to " + MOVED[old]):
            m = importlib.import_module(old)
        assert m is importlib.import_module(MOVED[old])
    from mrc_xdp import health
    from mrc_xdp.health import daemon
    assert health.Daemon is daemon.Daemon


JSON_COMMANDS = ["load", "unload", "status", "ev list", "ev deny", "ev allow", "plane list", "plane out",
                 "plane in", "stats", "events", "version", "write-bw", "write-lat", "send", "recv", "qps",
                 "allreduce-perf", "fabric check", "lab status", "lab inventory", "fleet inventory"]


@pytest.mark.parametrize("cmd", JSON_COMMANDS)
def test_commands_keep_json(cmd):
    """The CLI's split into command groups kept every command's --json (scripts and the
    Ansible role read it): each of these parses --json."""
    from mrc_xdp.cli import build_parser
    argv = cmd.split() + ["--json"]
    needs = {"ev deny": ["0x1"], "ev allow": ["0x1"], "plane out": ["1"], "plane in": ["1"], "send": ["f", "p"],
             "recv": ["d"]}
    args = build_parser().parse_args(cmd.split() + needs.get(cmd, []) + ["--json"])
    assert args.json is True, argv


def test_cli_groups_table_is_the_full_parser():
    """cli.GROUPS (the one group imported for a command) names every top-level command
    once, each with the group that registers it; a command's parser built from its group
    alone parses as the full one, and `version` imports no transport, collective or lab
    library."""
    import argparse
    import importlib
    import subprocess
    import sys
    from mrc_xdp import cli
    full = cli.build_parser()
    sub = next(a for a in full._actions if isinstance(a, argparse._SubParsersAction))
    listed = [c for cmds in cli.GROUPS.values() for c in cmds]
    assert sorted(listed) == sorted(set(listed)) == sorted(sub.choices)
    for g, cmds in cli.GROUPS.items():
        p = argparse.ArgumentParser()
        s = p.add_subparsers(dest="cmd")
        m = importlib.import_module("mrc_xdp.cli." + g)
        (m.add_parsers if hasattr(m, "add_parsers") else m.add_parser)(s)
        assert sorted(s.choices) == sorted(cmds), g
    argv = ["status", "--instance", "x", "--json"]
    assert vars(cli.build_parser(argv).parse_args(argv)) == vars(full.parse_args(argv))
    code = ("import sys; from mrc_xdp import cli; cli.build_parser(['version']); "
            "print(sorted(m for m in sys.modules if m.startswith(('mrc_xdp.transport', 'mrc_xdp.collective', "
            "'mrc_xdp.lab', 'numpy'))))")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True).stdout
    assert out.strip() == "[]", out
