"""The build cache (mrc_xdp.datapath.bpfcache): a build replayed from it is the build bcc
made; a damaged entry is rebuilt; MRC_BPF_CACHE=off compiles every time.

Each case uses its own cache directory, empty at its start (nothing from another test or
an earlier run), and real bcc builds loaded into the kernel."""
from __future__ import annotations

import json
import os

import pytest

pytestmark = pytest.mark.skipif(os.geteuid() != 0, reason="loads BPF: needs root")

FRAGS = ["-DMRC_FRAGS=1"]


@pytest.fixture
def cache(tmp_path, monkeypatch):
    d = tmp_path / "bpfcache"
    monkeypatch.setenv("MRC_BPF_CACHE", str(d))
    return d


def _fds() -> int:
    return len(os.listdir("/proc/self/fd"))


def _entries(d) -> list[str]:
    return sorted(f for f in os.listdir(d) if f.endswith(".json")) if d.exists() else []


def test_a_replayed_build_is_the_one_bcc_made(cache):
    """The second build of the datapath comes from the cache (no bcc object): the same
    functions with the same instructions (the kernel's tag masks map fds), each loaded
    frags-aware with the kernel's tag that of bcc's instructions, and every map made
    anew with bcc's type, sizes, entries and flags.  Closing it closes every fd it made."""
    from mrc_xdp.datapath import bpfcache, bpfsys, progload
    from mrc_xdp.datapath.bpfsrc import compile_bpf
    fd0 = _fds()
    built = compile_bpf("mrc_datapath.c", FRAGS)
    try:
        assert not isinstance(built, bpfcache.CachedBuild)
        assert len(_entries(cache)) == 1
        want = bpfcache.describe(built)
        fd1 = _fds()
        hit = compile_bpf("mrc_datapath.c", FRAGS)
        assert isinstance(hit, bpfcache.CachedBuild) and hit.path == str(cache / _entries(cache)[0])
        try:
            assert set(hit._insns) == set(want["funcs"]) >= {"mrc_spray", "mrc_ingress", "mrc_to_engine", "mrc_evop"}
            for name in want["funcs"]:
                mine = hit.dump_func(name.encode())
                assert progload.insn_tags(mine) == progload.insn_tags(built.dump_func(name.encode())), name
                fd = bpfsys.prog_load_xdp(name, mine, bpfsys.BPF_F_XDP_HAS_FRAGS)
                try:
                    assert bytes(bpfsys.prog_info(fd).tag) in progload.insn_tags(mine), name
                finally:
                    os.close(fd)
            for m in want["maps"]:
                mi = bpfsys.map_info(hit[m["name"]].map_fd)
                ref = bpfsys.map_info(built[m["name"].encode()].map_fd)
                assert (mi.type, mi.key_size, mi.value_size, mi.max_entries, mi.map_flags) == \
                    (ref.type, ref.key_size, ref.value_size, ref.max_entries, ref.map_flags), m
                assert mi.id != ref.id, m                # made anew, not bcc's map
            f = hit.load_func(b"mrc_to_engine")            # bcc's single-buffer load, flags 0
            assert bytes(bpfsys.prog_info(f.fd).tag) in progload.insn_tags(hit.dump_func("mrc_to_engine"))
        finally:
            hit.cleanup()
        assert _fds() == fd1
    finally:
        built.cleanup()
        built.tables.clear()
    assert _fds() == fd0


def test_the_loader_runs_from_a_cached_build(cache):
    """loader.build twice: the second Datapath's programs and maps come from the cache and
    work: a real write through its mrc_cfg map reads back."""
    from mrc_xdp.datapath import bpfcache, loader
    dps = []
    try:
        for _ in range(2):
            dps.append(loader.build())
        first, second = dps
        assert not isinstance(first.bpf, bpfcache.CachedBuild) and isinstance(second.bpf, bpfcache.CachedBuild)
        assert second.path_info["path"] == first.path_info["path"]
        cfg = second.maps["mrc_cfg"]
        raw = bytes(range(cfg.value_size))
        cfg.update(0, raw)
        assert cfg.lookup(0) == raw and first.maps["mrc_cfg"].lookup(0) != raw   # its own map
    finally:
        for dp in dps:
            dp.close()


def test_a_damaged_entry_is_rebuilt(cache):
    from mrc_xdp.datapath import bpfcache
    from mrc_xdp.datapath.bpfsrc import compile_bpf
    compile_bpf("linkmodel.c", FRAGS).cleanup()
    (name,) = _entries(cache)
    path = cache / name
    good = json.loads(path.read_text())
    doc = json.loads(path.read_text())
    f = next(iter(doc["body"]["funcs"].values()))
    f["insns"] = "AAAA" + f["insns"][4:]                  # an instruction changed, digest kept
    path.write_text(json.dumps(doc))
    b = compile_bpf("linkmodel.c", FRAGS)
    try:
        assert not isinstance(b, bpfcache.CachedBuild)    # not replayed: compiled again
    finally:
        b.cleanup()
    assert _entries(cache) == [name] and json.loads(path.read_text())["body"] == good["body"]
    b = compile_bpf("linkmodel.c", FRAGS)                 # and the rewritten entry serves
    try:
        assert isinstance(b, bpfcache.CachedBuild)
    finally:
        b.cleanup()
    path.write_text("{not json")
    b = compile_bpf("linkmodel.c", FRAGS)
    try:
        assert not isinstance(b, bpfcache.CachedBuild)
    finally:
        b.cleanup()


def test_flags_are_part_of_the_key_and_off_compiles_every_time(cache, monkeypatch):
    from mrc_xdp.datapath import bpfcache
    from mrc_xdp.datapath.bpfsrc import compile_bpf
    for flags in (FRAGS, ["-DMRC_FRAGS=0"]):
        compile_bpf("linkmodel.c", flags).cleanup()
    assert len(_entries(cache)) == 2
    monkeypatch.setenv("MRC_BPF_CACHE", "off")
    assert bpfcache.directory() is None
    for _ in range(2):
        b = compile_bpf("linkmodel.c", FRAGS)
        try:
            assert not isinstance(b, bpfcache.CachedBuild)
        finally:
            b.cleanup()
    assert len(_entries(cache)) == 2


def test_entries_move_to_another_cache(cache, tmp_path, monkeypatch):
    """What the VM lab does between guests: one cache's entries (bpfcache.entries) are
    imported into another (bpfcache.import_entries), which then replays them; entries
    that do not check out (a changed byte, a foreign name) are not imported."""
    from mrc_xdp.datapath import bpfcache
    from mrc_xdp.datapath.bpfsrc import compile_bpf
    compile_bpf("linkmodel.c", FRAGS).cleanup()
    got = bpfcache.entries()
    assert list(got) == _entries(cache)
    other = tmp_path / "other"
    name = next(iter(got))
    bad = dict(got)
    bad["x-" + "0" * 32 + ".json"] = got[name]                    # a name its content does not carry
    bad["../escape-" + "0" * 32 + ".json"] = got[name]
    assert bpfcache.import_entries(bad, str(other)) == [name]
    assert bpfcache.import_entries(got, str(other)) == []           # held already
    damaged = {name: got[name].replace('"insns": "', '"insns": "AAAA', 1)}
    other2 = tmp_path / "other2"
    assert bpfcache.import_entries(damaged, str(other2)) == []
    monkeypatch.setenv("MRC_BPF_CACHE", str(other))
    b = compile_bpf("linkmodel.c", FRAGS)
    try:
        assert isinstance(b, bpfcache.CachedBuild) and b.path == str(other / name)
    finally:
        b.cleanup()
    assert sorted(os.listdir(tmp_path)) == ["bpfcache", "other", "other2"] and \
        os.listdir(other) == [name]                                  # nothing escaped


def test_an_entry_others_may_write_is_not_used(cache):
    """What is in the cache runs in the kernel: a cache directory or entry that another
    user could write is not replayed (the build compiles)."""
    from mrc_xdp.datapath import bpfcache
    from mrc_xdp.datapath.bpfsrc import compile_bpf
    compile_bpf("linkmodel.c", FRAGS).cleanup()
    (name,) = _entries(cache)
    for path, mode in ((cache, 0o777), (cache / name, 0o666)):
        old = os.stat(path).st_mode & 0o777
        os.chmod(path, mode)
        try:
            b = compile_bpf("linkmodel.c", FRAGS)
            try:
                assert not isinstance(b, bpfcache.CachedBuild), path
            finally:
                b.cleanup()
        finally:
            os.chmod(path, old)
    b = compile_bpf("linkmodel.c", FRAGS)
    try:
        assert isinstance(b, bpfcache.CachedBuild)
    finally:
        b.cleanup()
