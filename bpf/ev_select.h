/* SPDX-License-Identifier: (GPL-2.0 OR BSD-2-Clause) */
/*
 * ev_select.h - pick the EV for one packet.
 *
 * Planes take turns (round robin), so they stay equally loaded.  Inside a plane the
 * active EVs are visited in a pseudo-random rotation: rotation r visits position i at
 * (i * stride[r % 4] + off(r)) mod n, a permutation since each stride is coprime with
 * n.  Each EV is used once per rotation.  A SKIP EV loses its turn once and is GOOD
 * again; ASSUMED_BAD and DENIED are never used (feedback swaps a retired EV for a
 * backup at once; one denied by the operator just leaves its plane with one EV fewer,
 * the plane's share of packets is unchanged).  Rotation state is per CPU, so the hot
 * path has no atomics.
 */
#ifndef MRC_EV_SELECT_H
#define MRC_EV_SELECT_H

#include "ev_state.h"

#define MRC_SELECT_TRIES 32        /* EV positions examined per packet, over all planes */
#define MRC_NO_SLOT      0xFFFFFFFF

static __always_inline __u32 rot_index(__u64 pos, struct mrc_conn *c, __u32 n)
{
	__u64 round = pos / n;
	__u32 i = pos - round * n;
	__u32 stride = c->stride[round & 3];
	__u32 off = ((__u32)(round * 2654435761ULL) >> 8) % n;

	return (i * stride + off) % n;
}

/*
 * Returns the active slot to use, or MRC_NO_SLOT.  The packet's own plane p0 gets the
 * first `budget` tries (budget = its EV count, capped at an equal share of
 * MRC_SELECT_TRIES), then the next plane, and so on: a plane with no usable EV costs
 * its budget, never the packet.  Only t is carried across iterations, so the
 * verifier can prune.
 */
static __always_inline __u32 ev_select(__u32 cid, struct mrc_conn *c, __u32 nplanes)
{
	struct mrc_rot *r = mrc_rot.lookup(&cid);
	__u32 n = c->ev_per_plane;
	__u32 t, p0, plane, slot, budget, limit;
	struct mrc_ev *e;

	if (!r || !n || !nplanes || nplanes > MRC_MAX_PLANES || n * nplanes > MRC_EV_ACTIVE_MAX)
		return MRC_NO_SLOT;
	p0 = r->seq % nplanes;
	r->seq++;
	budget = MRC_SELECT_TRIES / nplanes;
	if (budget > n)
		budget = n;
	if (!budget)
		budget = 1;
	limit = budget * nplanes;
#pragma clang loop unroll(disable)
	for (t = 0; t < MRC_SELECT_TRIES; t++) {
		if (t >= limit)
			break;
		plane = ((p0 + t / budget) % nplanes) & (MRC_MAX_PLANES - 1);
		slot = plane * n + rot_index(r->pseq[plane]++, c, n);
		e = ev_at(cid, slot);
		if (!e)
			break;
		if (e->state == MRC_EV_GOOD)
			return slot;
		if (e->state == MRC_EV_SKIP) {
			/* It has now sat out its rotation: GOOD again from the next one. */
			struct mrc_ev_ctr *ec = evctr_of(cid, e);

			if (ec)
				ec->skipped++;
			ctr_inc(MRC_C_SPRAY_SKIP);
			ev_set(cid, slot, e, MRC_EV_GOOD, MRC_R_SKIP_DONE);
		}
	}
	return MRC_NO_SLOT;
}

#endif
