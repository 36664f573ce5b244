/* SPDX-License-Identifier: (GPL-2.0 OR BSD-2-Clause) */
/*
 * ev_state.h - the EV state machine, in one place.
 *
 *   GOOD --SACK M=SKIP_ONCE / NACK TRIMMED--> SKIP --one rotation--> GOOD
 *   GOOD|SKIP --SACK M=ALWAYS_SKIP / loss (time-based, or the PSN-distance fallback)-->
 *        ASSUMED_BAD, and the active slot takes a GOOD backup EV of the SAME plane
 *        (planes stay equally loaded)
 *   any --operator deny--> DENIED (user space; never auto-recovers)
 *   ASSUMED_BAD|DENIED --operator allow / probes--> GOOD (user space)
 *   (user space changes go through mrc_evop: under the swap lock, with an event)
 *
 * Slots [0, MRC_EV_ACTIVE_MAX) are active, plane p owning [p*n, (p+1)*n); backups of
 * plane p sit at MRC_EV_ACTIVE_MAX + [p*b, (p+1)*b).  A replacement swaps the two
 * entries (the retired EV becomes a backup, to be probed) and re-points mrc_evidx.
 * Every change is written to the mrc_events ring buffer (a full ring is counted as
 * events_lost), those user space makes through mrc_evop included.
 */
#ifndef MRC_EV_STATE_H
#define MRC_EV_STATE_H

#include "maps.h"
#include "counters.h"

#define MRC_BACKUP_MAX MRC_BACKUP_PER_PLANE_MAX
#define MRC_NO_SLOT    0xFFFFFFFF

static __always_inline struct mrc_ev *ev_at(__u32 cid, __u32 slot)
{
	__u32 k = cid * MRC_EV_SLOTS + (slot & (MRC_EV_SLOTS - 1));

	return mrc_evs.lookup(&k);
}

static __always_inline void ev_event(__u32 cid, __u32 slot, struct mrc_ev *e, __u8 old,
				     __u8 reason, __u32 other_ev)
{
	struct mrc_event ev = {};

	ev.ts_ns = bpf_ktime_get_ns();
	ev.conn = cid;
	ev.ev = e->ev;
	ev.slot = slot;
	ev.old_state = old;
	ev.new_state = e->state;
	ev.reason = reason;
	ev.plane = e->plane;
	ev.other_ev = other_ev;
	if (mrc_events.ringbuf_output(&ev, sizeof(ev), 0))
		ctr_inc(MRC_C_EVENTS_LOST);
}

static __always_inline void ev_set(__u32 cid, __u32 slot, struct mrc_ev *e, __u8 state,
				   __u8 reason)
{
	__u8 old = e->state;

	e->state = state;
	e->reason = reason;
	e->changed_ns = bpf_ktime_get_ns();
	if (state == MRC_EV_GOOD)
		e->losses = 0;
	ev_event(cid, slot, e, old, reason, 0);
}

/* Congestion on the forward path (ECN echo, trimmed packet): skip once. */
static __always_inline int ev_skip(__u32 cid, __u32 slot, struct mrc_ev *e, __u8 reason)
{
	if (e->state != MRC_EV_GOOD)
		return 0;
	ev_set(cid, slot, e, MRC_EV_SKIP, reason);
	return 1;
}

/*
 * Swap the unusable active slot with the first GOOD backup of its plane.
 * Returns 1 when replaced, 0 when the plane has no GOOD backup, -1 if busy.
 */
static __always_inline int ev_replace(__u32 cid, struct mrc_conn *c, __u32 slot)
{
	struct mrc_evidx_key k = { .conn = cid };
	struct mrc_ev *ea, *eb, tmp;
	__u32 base, b = c->backup_per_plane, bslot, j;
	int done = 0;

	if (slot >= MRC_EV_ACTIVE_MAX || !b)
		return 0;
	ea = ev_at(cid, slot);
	if (!ea)
		return 0;
	if (__sync_val_compare_and_swap(&c->lock, 0, 1) != 0)
		return -1;
	base = MRC_EV_ACTIVE_MAX + (__u32)ea->plane * b;
	/* A constant trip count, fully unrolled: straight-line code prunes far better in
	 * the verifier than a loop.  Slots past this plane's b backups hold another
	 * plane's EVs or none, which the plane and state checks reject. */
#pragma unroll
	for (j = 0; j < MRC_BACKUP_MAX; j++) {
		if (j >= b)
			continue;
		bslot = base + j;
		eb = ev_at(cid, bslot);
		if (!eb || eb->state != MRC_EV_GOOD || eb->plane != ea->plane)
			continue;
		tmp = *ea;
		*ea = *eb;
		*eb = tmp;
		ea->reason = MRC_R_REPLACED;
		ea->changed_ns = bpf_ktime_get_ns();
		k.ev = ea->ev;
		mrc_evidx.update(&k, &slot);
		k.ev = eb->ev;
		mrc_evidx.update(&k, &bslot);
		ev_event(cid, slot, ea, MRC_EV_GOOD, MRC_R_REPLACED, eb->ev);
		done = 1;
		break;
	}
	c->lock = 0;
	return done;
}

/* The path is assumed broken: never use it again until user space resurrects it. */
static __always_inline void ev_retire(__u32 cid, struct mrc_conn *c, __u32 slot,
				      struct mrc_ev *e, __u8 reason)
{
	int r;

	if (e->state != MRC_EV_GOOD && e->state != MRC_EV_SKIP)
		return;
	ev_set(cid, slot, e, MRC_EV_ASSUMED_BAD, reason);
	ctr_inc(MRC_C_ING_FB_BAD);
	/* a constant index per branch: a computed one would be a constant map key the
	 * verifier tracks precisely, and every reason a state of its own */
	if (reason == MRC_R_LOSS)
		ctr_inc(MRC_C_RETIRE_LOSS);
	else if (reason == MRC_R_LOSS_PSN)
		ctr_inc(MRC_C_RETIRE_LOSS_PSN);
	else
		ctr_inc(MRC_C_RETIRE_ALWAYS);
	if (slot >= MRC_EV_ACTIVE_MAX)
		return;
	r = ev_replace(cid, c, slot);
	if (r > 0)
		ctr_inc(MRC_C_ING_FB_REPLACED);
	else if (r == 0)
		ctr_inc(MRC_C_ING_FB_NO_BACKUP);
	else
		ctr_inc(MRC_C_ING_FB_BUSY);   /* spray swaps it in when it next meets the slot */
}

#endif
