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
