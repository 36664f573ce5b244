/* SPDX-License-Identifier: (GPL-2.0 OR BSD-2-Clause) */
/* counters.h - per-CPU counters keyed by enum mrc_ctr (printed by name in user space). */
#ifndef MRC_COUNTERS_H
#define MRC_COUNTERS_H

#include "maps.h"

static __always_inline void ctr_add(__u32 idx, __u64 n)
{
	__u64 *v = mrc_stats.lookup(&idx);

	if (v)
		*v += n;
}

static __always_inline void ctr_inc(__u32 idx)
{
	ctr_add(idx, 1);
}

/* Per-EV counters follow the EV (cidx), not the slot it sits in. */
static __always_inline struct mrc_ev_ctr *evctr_of(__u32 cid, struct mrc_ev *e)
{
	__u32 k = cid * MRC_EV_SLOTS + (e->cidx & (MRC_EV_SLOTS - 1));

	return mrc_evctr.lookup(&k);
}

#endif
