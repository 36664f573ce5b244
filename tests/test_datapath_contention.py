"""Tier 1: operator EV changes (maps.set_ev_state -> mrc_evop) racing the datapath's own
swaps, on every CPU at once.

One thread sprays data and feeds SACKs with M=ALWAYS_SKIP on random active EVs (each
retires an EV and swaps a backup of its plane in, in ingress or in spray); another sets
random EVs GOOD (mostly) / ASSUMED_BAD / DENIED as an operator or the daemon would (an
allowed EV refills the backups, so swaps go on).  A change written from user space as a
whole struct mrc_ev (read, modify, write back) would lose a swap made in between: an EV
written back into a slot it had left appears twice, the one swapped in vanishes.  Through
mrc_evop, under the swap lock, that cannot happen: afterwards every configured EV is in
exactly one slot, mrc_evidx points at it, and every operator change made its event.

The operator thread drains the event ring itself, every DRAIN_EVERY changes.  A third
thread draining "as events come" does not keep up: the operator's loop of short test_run
calls drops and retakes the GIL so often that CPython never hands it to a waiting thread
(seconds between drains on 2 CPUs), while ~100k events/s overrun the ring's ~6.5k, counted
as events_lost.  Drained by their producer, at most DRAIN_EVERY operator events wait in the
ring, and the datapath's own (a retirement, a swap) each use up a GOOD EV that only an
operator change or the initial set makes: a few times DRAIN_EVERY at most.
"""
from __future__ import annotations

import os
import random
import threading
import time

from helpers import ACTIVE_MAX, CONN_A, SLOTS, data
from mrc_xdp.datapath import bpfsys, netns
from mrc_xdp.datapath import maps as libmaps
from mrc_xdp.datapath.shared import EvReason, EvState, SackM, const, sizeof

SECONDS = 3.0              # both threads run this long, side by side
# the events the ring holds (each has an 8-byte ring header); the operator drains it
# well before that: its own DRAIN_EVERY plus the datapath's they allowed
RING_EVENTS = const("MRC_EVENTS_BYTES") // (sizeof("struct mrc_event") + 8)
DRAIN_EVERY = RING_EVENTS // 16


def test_operator_changes_race_swaps_without_loss(dp_env):
    env = dp_env
    old = os.sched_getaffinity(0)
    os.sched_setaffinity(0, set(range(os.cpu_count() or 1)))   # both sides on every CPU
    try:
        env.use("ecmp")
        act, bak = env.ev_sets(CONN_A)
        configured = sorted(s.ev for sets in (act, bak) for plane in sets for s in plane)
        active = [s.ev for plane in act for s in plane]
        env.spray_evs(1)                              # PSN 0 sent: the SACKs ack it
        sack = {ev: env.feedback("sack", ev, m=SackM.ALWAYS_SKIP) for ev in configured}
        evop = env.dp.fd("evop")
        frames = [data(psn=1 + i) for i in range(500)]
        errors, events = [], []
        made = {"op": 0, "fb": 0}
        deadline = time.monotonic() + SECONDS

        def traffic():
            rng = random.Random(1)
            try:
                with netns.enter(env.ns):       # ingress_ifindex names p0 of the test netns
                    while time.monotonic() < deadline:
                        bpfsys.prog_test_run(env.dp.fd("spray"), frames[made["fb"] % 500])
                        bpfsys.prog_test_run(env.dp.fd("ingress"), sack[rng.choice(active + configured)],
                                             ifindex=env.ifindex["p0"])
                        made["fb"] += 1
            except Exception as e:     # reported by the main thread
                errors.append(e)

        def operator():
            rng = random.Random(2)
            try:
                while time.monotonic() < deadline:
                    st = rng.choice([EvState.GOOD] * 4 + [EvState.ASSUMED_BAD, EvState.DENIED])
                    libmaps.set_ev_state(env.maps["mrc_evs"], env.maps["mrc_evidx"], CONN_A,
                                         rng.choice(configured), st, EvReason.OPERATOR, evop_fd=evop)
                    made["op"] += 1
                    if made["op"] % DRAIN_EVERY == 0:
                        events.extend(env.events())     # the only reader while the threads run
            except Exception as e:
                errors.append(e)

        before = env.counters()
        ts = [threading.Thread(target=traffic), threading.Thread(target=operator)]
        for t in ts:
            t.start()
        for t in ts:
            t.join()
        events += env.events()
        assert not errors, errors
        after = env.counters()

        # every configured EV in exactly one slot, and mrc_evidx pointing at it
        slots = {}
        for slot in list(range(ACTIVE_MAX)) + list(range(ACTIVE_MAX, SLOTS)):
            e = env.ev_at(CONN_A, slot)
            if e.state != EvState.UNUSED:
                slots.setdefault(e.ev, []).append(slot)
        assert sorted(slots) == configured, "EVs lost or added"
        assert all(len(v) == 1 for v in slots.values()), \
            "EVs in two slots: %s" % {hex(k): v for k, v in slots.items() if len(v) > 1}
        for ev, (slot,) in slots.items():
            assert env.slot_of(CONN_A, ev) == slot
        # every operator change made its event, none was lost
        n = made["op"]
        assert n > 100 and made["fb"] > 100
        assert sum(1 for e in events if e.reason == EvReason.OPERATOR) == n
        assert after["events_lost"] == before["events_lost"]
        assert after["evop"] - before["evop"] == n
        swaps = (after["ing_fb_replaced"] - before["ing_fb_replaced"] +
                 after["spray_swap"] - before["spray_swap"])
        print("\n%d operator changes, %d SACKs, %d swaps, operator found the lock held %d times, "
              "ingress %d times" % (n, made["fb"], swaps, after["evop_busy"] - before["evop_busy"],
                                    after["ing_fb_busy"] - before["ing_fb_busy"]))
        assert swaps > 100, "the datapath hardly swapped: no contention was tested"
    finally:
        os.sched_setaffinity(0, old)
