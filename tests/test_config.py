"""Host config: explicit EV sets (as the ECMP lab's EV discovery writes them)."""
import pytest

from mrc_xdp.datapath.config import ConfigError, HostConfig

PLANES = [{"dev": "p0", "gateway_mac": "02:00:00:00:00:01"}, {"dev": "p1", "gateway_mac": "02:00:00:00:00:02"}]


def conf(**conn):
    c = {"peer": "fd00::2", "local_qpn": 0x100, "remote_qpn": 0x200, "ev_per_plane": 2,
         "backup_per_plane": 1}
    c.update(conn)
    return {"local_addr": "fd00::1", "planes": PLANES, "connections": [c]}


def test_explicit_evs_are_used_as_given():
    evs = [[0x10001, 0, 0], [0x20002, 0, 1], [0x30003, 1, 0], [0x40004, 1, 1]]
    backup = [[0x50005, 0, 1], [0x60006, 1, 0]]
    c = HostConfig.from_dict(conf(evs=evs, backup_evs=backup)).connections[0]
    active, back = c.ev_sets(2)
    assert [[(e.ev, e.plane, e.t1) for e in pl] for pl in active] == \
        [[(0x10001, 0, 0), (0x20002, 0, 1)], [(0x30003, 1, 0), (0x40004, 1, 1)]]
    assert [[(e.ev, e.plane, e.t1) for e in pl] for pl in back] == [[(0x50005, 0, 1)], [(0x60006, 1, 0)]]


@pytest.mark.parametrize("kw,msg", [
    (dict(evs=[[0x10001, 0, 0], [0x20002, 0, 1], [0x30003, 1, 0]], backup_evs=[]),
     "connections[0].evs: plane 1 has 1 EVs, the connection wants 2 per plane"),
    (dict(evs=[[0x10001, 0, 0], [0x10001, 0, 1], [0x30003, 1, 0], [0x40004, 1, 1]], backup_evs=[]),
     "connections[0].evs[1]: EV 0x10001 appears twice"),
    (dict(evs=[[0x10001, 0, 0], [0x20002, 0, 1], [0x30003, 2, 0], [0x40004, 1, 1]], backup_evs=[]),
     "connections[0].evs[2] plane: 2 is out of range [0, 1]"),
    (dict(evs=[[5, 0, 0], [0x20002, 0, 1], [0x30003, 1, 0], [0x40004, 1, 1]], backup_evs=[]),
     "connections[0].evs[0] ev: 5 is out of range"),
    (dict(backup_evs=[[0x50005, 0, 1], [0x60006, 1, 0]]), "connections[0].backup_evs: needs evs too"),
    (dict(evs="x"), "connections[0].evs: expected a list of [ev, plane, t1]"),
])
def test_explicit_evs_are_validated(kw, msg):
    with pytest.raises(ConfigError) as e:
        HostConfig.from_dict(conf(**kw))
    assert msg in str(e.value)


def test_loss_window_knobs():
    """The time-based loss rule's reorder window: floor (us) and min-RTT divisor, with
    defaults, validated to one-line errors."""
    from mrc_xdp.datapath.config import LOSS_WINDOW_US
    from mrc_xdp.datapath.shared import const
    c = HostConfig.from_dict(conf())
    assert (c.loss_window_us, c.loss_window_div) == (LOSS_WINDOW_US, 4)
    c = HostConfig.from_dict(dict(conf(), loss_window_us=50, loss_window_div=0))
    assert (c.loss_window_us, c.loss_window_div) == (50, 0)
    top = const("MRC_TS_WINDOW_MAX")
    for k, v in (("loss_window_us", top), ("loss_window_us", -1), ("loss_window_div", "4")):
        with pytest.raises(ConfigError) as e:
            HostConfig.from_dict(dict(conf(), **{k: v}))
        assert str(e.value).startswith(k) and "\n" not in str(e.value), str(e.value)
