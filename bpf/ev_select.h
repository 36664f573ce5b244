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
 * the plane's share of packets is unchanged).  A plane whose NIC is down (MRC_PF_DOWN in
 * mrc_planes, set by the health daemon) or that the operator took out (MRC_PF_ADMIN,
 * `mrc-xdp plane out`) loses its turns: the round robin goes on over
 * the planes that are up, so they share the traffic equally, and its EVs keep their
 * states.  Rotation state is per CPU, so the hot path has no atomics.
 */
#ifndef MRC_EV_SELECT_H
#define MRC_EV_SELECT_H

#include "ev_state.h"
#include "parse.h"          /* mrc_barrier_var */

#define MRC_SELECT_TRIES 32        /* EV positions examined per packet, over all planes */

/* The next EV index of a plane's rotation: one 64-bit load and store of its state,
 * a division only when a round starts. */
static __always_inline __u32 rot_next(struct mrc_rot_plane *rp, struct mrc_conn *c, __u32 n)
{
	__u64 st = *(__u64 *)rp;
	__u32 i = st & 0xffff, cur = (st >> 16) & 0xffff;
	__u32 stride = (st >> 32) & 0xffff, round = st >> 48;
	__u32 k;

	if (i >= n || !stride || cur >= n) {
		round = stride ? (round + 1) & 0xffff : 0;
		stride = c->stride[round & 3];
		if (!stride || stride >= n)
			stride = 1;
		i = 0;
		cur = ((__u32)(round * 2654435761ULL) >> 8) % n;
	}
	k = cur;
	i++;
	cur += stride;
	if (cur >= n)
		cur -= n;
	*(__u64 *)rp = i | (__u64)cur << 16 | (__u64)stride << 32 | (__u64)round << 48;
	return k;
}

/* Is plane p out of rotation (its NIC down, or the operator's)?  An inlined array lookup
 * and a test. */
static __always_inline int plane_off(__u32 p)
{
	struct mrc_plane *pl = mrc_planes.lookup(&p);

	return pl && (pl->flags & MRC_PF_OUT);
}

/* One try in a plane: 1 = a GOOD slot, left in r->slot.  A SKIP EV met here has sat
 * out its rotation: it is GOOD again from the next one and loses this turn; only the
 * state flips here, the event and counters follow in skips_done(), so the loop body
 * stays small for the verifier. */
static __always_inline int ev_try(__u32 cid, struct mrc_conn *c, struct mrc_rot *r, __u32 plane,
				  __u32 n)
{
	struct mrc_ev *e;
	__u32 slot;

	plane &= MRC_MAX_PLANES - 1;
	slot = plane * n + rot_next(&r->p[plane], c, n);
	e = ev_at(cid, slot);
	if (!e)
		return 0;
	if (e->state == MRC_EV_GOOD) {
		r->slot = slot;
		return 1;
	}
	if (e->state == MRC_EV_SKIP) {
		if (r->nskip < MRC_SKIP_BATCH) {
			e->state = MRC_EV_GOOD;
			e->reason = MRC_R_SKIP_DONE;
			e->losses = 0;
			r->skipped[r->nskip & (MRC_SKIP_BATCH - 1)] = slot;
			r->nskip++;
		}
	} else if (e->state == MRC_EV_ASSUMED_BAD && !r->bad1) {
		r->bad1 = slot + 1;     /* retired but still in an active slot */
	}
	return 0;
}

/* Report the SKIP EVs this packet passed over: counters and one event each. */
static __always_inline void skips_done(__u32 cid, struct mrc_rot *r)
{
	struct mrc_ev_ctr *ec;
	struct mrc_ev *e;
	__u32 i;

#pragma clang loop unroll(disable)
	for (i = 0; i < MRC_SKIP_BATCH; i++) {
		if (i >= r->nskip)
			break;
		e = ev_at(cid, r->skipped[i]);
		if (!e)
			continue;
		ec = evctr_of(cid, e);
		if (ec)
			ec->skipped++;
		ctr_inc(MRC_C_SPRAY_SKIP);
		e->changed_ns = bpf_ktime_get_ns();
		ev_event(cid, r->skipped[i], e, MRC_EV_SKIP, MRC_R_SKIP_DONE, 0);
	}
	r->nskip = 0;
}

/*
 * Pick the EV slot for this packet: returns the rotation state with the slot in
 * r->slot, or NULL when no EV is usable.  pref < nplanes: try that plane first and
 * leave the planes' round robin as it is (feedback follows the peer's data, see
 * mrc_conn.rx_plane); otherwise planes take turns; the packet's plane p0
 * gets the first `budget` tries (its EV count, capped at an equal share of
 * MRC_SELECT_TRIES), then the next plane, and so on (planes out of rotation passed
 * over): a plane with no usable EV costs its budget, never the packet, and the round
 * robin goes on after the plane that took its turn, so the planes that can send share
 * the turns equally.  The first try is the fast path; the loop (which divides) runs
 * only when it fails.  The slot travels through map memory, not a
 * register, so every exit reaches the caller in the same verifier state and the rest
 * of the program is verified once, not once per exit.
 */
static __always_inline struct mrc_rot *ev_select(__u32 cid, struct mrc_conn *c, __u32 nplanes,
						 __u32 pref)
{
	struct mrc_rot *r = mrc_rot.lookup(&cid);
	__u32 n = c->ev_per_plane;
	__u32 t, p0, q, budget, limit, skip1;
	int found = 1;

	if (!r || !n || !nplanes || nplanes > MRC_MAX_PLANES || n * nplanes > MRC_EV_ACTIVE_MAX)
		return 0;
	if (pref < nplanes) {
		p0 = pref;              /* feedback: the plane asked for, the round robin untouched */
	} else {
		p0 = r->plane < nplanes ? r->plane : 0;
		r->plane = p0 + 1 < nplanes ? p0 + 1 : 0;
	}
	r->nskip = 0;
	r->bad1 = 0;
	if (!plane_off(p0) && ev_try(cid, c, r, p0, n))
		goto out;

	budget = MRC_SELECT_TRIES / nplanes;
	if (budget > n)
		budget = n;
	if (!budget)
		budget = 1;
	limit = budget * nplanes;
#pragma clang loop unroll(disable)
	for (t = 1; t < MRC_SELECT_TRIES; t++) {
		__u32 lim = limit;

		/* Opaque in every iteration: otherwise clang folds both exits into one trip
		 * count min(limit - 1, 31) left by `t == count`, and the verifiers of Linux
		 * 6.1 and 6.12 learn nothing from a failed `==` against a range: they walk
		 * the loop until they give up ("The sequence of 8193 jumps is too complex").
		 * So the constant bound stays an exit of its own; same iterations. */
		mrc_barrier_var(lim);
		if (t >= lim)
			break;
		q = (p0 + t / budget) % nplanes;
		if (plane_off(q))
			continue;
		if (ev_try(cid, c, r, q, n)) {
			/* another plane took p0's turn: the round robin goes on after it, so
			 * the planes that can send share the turns equally */
			if (q != p0 && pref >= nplanes)
				r->plane = q + 1 < nplanes ? q + 1 : 0;
			goto out;
		}
	}
	found = 0;
out:
	/* every EV tried was sitting out its SKIP turn (ECN marks on all of them): the
	 * first of them is GOOD again and takes the packet (below), which a congested
	 * path still delivers; dropping it would only make the sender resend it */
	skip1 = r->nskip ? r->skipped[0] + 1 : 0;
	if (r->nskip)
		skips_done(cid, r);
	/* A retired EV still in an active slot takes a GOOD backup of its plane now: a
	 * replacement feedback could not make (lock busy, or no backup back then) is made
	 * here.  A DENIED EV stays where the operator left it.  Costs a backup scan only
	 * on packets that met one. */
	if (r->bad1 && c->backup_per_plane && ev_replace(cid, c, r->bad1 - 1) > 0)
		ctr_inc(MRC_C_SPRAY_SWAP);
	/* No GOOD EV on any plane in rotation: send on the first retired EV met (or the
	 * backup just swapped into its slot) rather than drop.  A retired EV may well be
	 * alive (loss retires on one lost packet); without a health daemon to probe them
	 * back, random loss would otherwise retire every EV and the connection could never
	 * send again.  Never a DENIED EV, never a plane out of rotation. */
	if (!found && skip1) {
		r->slot = skip1 - 1;
		ctr_inc(MRC_C_SPRAY_SKIP_RESORT);
		found = 1;
	}
	if (!found && r->bad1) {
		r->slot = r->bad1 - 1;
		ctr_inc(MRC_C_SPRAY_LAST_RESORT);
		found = 1;
	}
	return found ? r : 0;
}

#endif
