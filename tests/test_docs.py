"""The documentation's links: every relative link in README.md, docs/*.md and
vagrant/README.md names a file of this repository (and, with #anchor, a heading in it).

Pure file checks: no root, no network.  Anchors follow GitHub's heading slugs (lower
case, punctuation other than '-' and '_' dropped, spaces to '-')."""
from __future__ import annotations

import os
import re

import pytest

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
DOCS = ["README.md", "vagrant/README.md"] + sorted(
    "docs/" + f for f in os.listdir(os.path.join(ROOT, "docs")) if f.endswith(".md"))

LINK = re.compile(r"(?<!!)\[[^\]]*\]\(([^)\s]+)\)|!\[[^\]]*\]\(([^)\s]+)\)")
FENCE = re.compile(r"^```.*?^```", re.S | re.M)


def slug(heading: str) -> str:
    s = heading.strip().lower()
    s = re.sub(r"[^\w\- ]", "", s)
    return s.replace(" ", "-")


def anchors(path: str) -> set:
    text = FENCE.sub("", open(path, encoding="utf-8").read())
    return {slug(m.group(1)) for m in re.finditer(r"^#+\s+(.*)$", text, re.M)}


def links(path: str):
    text = FENCE.sub("", open(path, encoding="utf-8").read())
    for m in LINK.finditer(text):
        target = m.group(1) or m.group(2)
        if re.match(r"^[a-z][a-z0-9+.-]*:", target):      # http:, https:, mailto:
            continue
        yield target


def test_docs_exist():
    assert len([d for d in DOCS if d.startswith("docs/")]) >= 6, DOCS


@pytest.mark.parametrize("doc", DOCS)
def test_relative_links_resolve(doc):
    src = os.path.join(ROOT, doc)
    bad = []
    for target in links(src):
        path, _, frag = target.partition("#")
        dest = os.path.normpath(os.path.join(os.path.dirname(src), path)) if path else src
        if os.path.commonpath([dest, ROOT]) != ROOT:
            bad.append("%s: outside the repository" % target)
        elif not os.path.exists(dest):
            bad.append("%s: no such file" % target)
        elif frag and dest.endswith(".md") and frag not in anchors(dest):
            bad.append("%s: no heading #%s in %s" % (target, frag, os.path.relpath(dest, ROOT)))
    assert not bad, "%s: %s" % (doc, "; ".join(bad))


@pytest.mark.parametrize("doc", DOCS)
def test_code_fences_are_closed(doc):
    """An unclosed ``` swallows the rest of the page (and hides its links)."""
    text = open(os.path.join(ROOT, doc), encoding="utf-8").read()
    assert len(re.findall(r"^```", text, re.M)) % 2 == 0, "%s: a ``` block is not closed" % doc


@pytest.mark.parametrize("doc", DOCS)
def test_no_paths_outside_the_repository(doc):
    """A user who clones the repository has nothing outside it: no /work/..., no ../shared."""
    text = open(os.path.join(ROOT, doc), encoding="utf-8").read()
    hits = re.findall(r"(?:/work/\S+|\.\./shared\S*)", text)
    assert not hits, "%s names paths outside the repository: %s" % (doc, hits)


GENERATED = {"vagrant/topology.json"}      # written by `mrc-xdp lab render`
SRC_PATH = re.compile(r"`((?:mrc_xdp|bpf|tools|tests|examples|scripts|contrib|vagrant|docs|results)/[\w./-]*)`")
MODULE = re.compile(r"`(mrc_xdp(?:\.\w+)+)")


@pytest.mark.parametrize("doc", [d for d in DOCS if d != "docs/changelog.md"])   # it names old paths
def test_named_sources_exist(doc):
    """Every source path (`mrc_xdp/...`, `bpf/...`, `tools/...`) and module name
    (`mrc_xdp.x.y`, attributes after the module allowed) a page names is in the tree:
    a file that moved (0.2 moved most modules into packages) leaves no dead names behind."""
    text = open(os.path.join(ROOT, doc), encoding="utf-8").read()
    bad = []
    for p in set(SRC_PATH.findall(text)):
        if "*" not in p and p not in GENERATED and not os.path.exists(os.path.join(ROOT, p.rstrip("/"))):
            bad.append(p)
    for m in set(MODULE.findall(text)):
        parts = m.split(".")
        # the longest prefix that is a module or package decides; what follows may be attributes
        found = any(os.path.isfile(os.path.join(ROOT, *parts[:i]) + ".py")
                    or os.path.isdir(os.path.join(ROOT, *parts[:i]))
                    for i in range(len(parts), 1, -1))
        if not found and m != "mrc_xdp.transport._engine":     # built by `make setup`
            bad.append(m)
    assert not bad, "%s names what is not in the tree: %s" % (doc, sorted(bad))
