/* SPDX-License-Identifier: (GPL-2.0 OR BSD-2-Clause) */
/*
 * probe.h - EV probes, answered in the datapath.
 *
 *   prober  user space --PROBE_REQ (EV in sport/flow label)--> mrc0 --> spray: sent on the
 *           EV it names (active or backup slot, any state but DENIED; no rotation)
 *   peer    ingress: PROBE_REQ from a configured peer, within the answer rate (GCRA token
 *           bucket, mrc_config.probe_rate/burst) --> rewritten in place into its answer, a
 *           SACK with PR set (mrc_shared.h: MRC_SETH_PR, MRC_PANS_ID_OFF), addresses
 *           swapped, ICRC recomputed, SRv6 outer header from the connection's row template
 *           in srv6 mode --> XDP_TX out the plane NIC it arrived on
 *   prober  ingress: a PR SACK matching a probe in flight (mrc_probes: id, peer, EV, PSN)
 *           gets rx_ns = now; the frame is dropped (nothing for the engine)
 *
 * Neither side waits for user space; the answer to user space is the mrc_probes entry,
 * so it works whether or not an engine's AF_XDP socket is bound on mrc0.
 */
#ifndef MRC_PROBE_H
#define MRC_PROBE_H

#include "maps.h"
#include "counters.h"
#include "parse.h"
#include "ev_state.h"
#include "srv6.h"

/* Probe and answer, plain (after decapsulation): constant offsets. */
#define MRC_PROBE_LEN  (MRC_ETH_LEN + MRC_IPV6_LEN + 8 + MRC_BTH_LEN + MRC_PETH_LEN + MRC_ICRC_LEN)
#define MRC_PANS_PLEN  (8 + MRC_BTH_LEN + MRC_SETH_LEN + MRC_CCSTATE_LEN + MRC_ICRC_LEN)
#define MRC_PANS_LEN   (MRC_ETH_LEN + MRC_IPV6_LEN + MRC_PANS_PLEN)
#define PA_IP   MRC_ETH_LEN
#define PA_UDP  (PA_IP + MRC_IPV6_LEN)
#define PA_BTH  (PA_UDP + 8)
#define PA_SETH (PA_BTH + MRC_BTH_LEN)
#define PA_CC   (PA_SETH + MRC_SETH_LEN)
#define PA_ICRC (PA_CC + MRC_CCSTATE_LEN)
/* CRC-32 register after the ICRC's 8 bytes of 0xFF (masked LRH), from ~0. */
#define MRC_CRC_LRH_STATE 0xdebb20e3

/* spray: the EV a PROBE_REQ names, in its connection's set, unless DENIED. */
static __always_inline struct mrc_ev *probe_ev(__u32 cid, struct mrc_pkt *p)
{
	struct mrc_evidx_key key = { .conn = cid, .ev = p->ev };
	struct mrc_ev *e = 0;
	__u32 *slotp;

	slotp = mrc_evidx.lookup(&key);
	if (slotp)
		e = ev_at(cid, *slotp);
	if (!e || e->ev != p->ev || e->state == MRC_EV_UNUSED) {
		ctr_inc(MRC_C_SPRAY_PROBE_NO_EV);
		return 0;
	}
	if (e->state == MRC_EV_DENIED) {
		ctr_inc(MRC_C_SPRAY_PROBE_DENIED);
		return 0;
	}
	ctr_inc(MRC_C_SPRAY_PROBE);
	return e;
}

/* GCRA: answer when tat - now <= (burst - 1) * interval; one cmpxchg, a lost race is a
 * refusal (counted as rate). */
static __always_inline int probe_admit(struct mrc_config *cfg)
{
	struct mrc_ptb *b;
	__u64 now, iv, tat, base, burst;
	__u32 k = 0;

	b = mrc_ptb.lookup(&k);
	if (!b || !cfg->probe_rate)
		return 0;
	now = bpf_ktime_get_ns();
	iv = 1000000000ULL / cfg->probe_rate;
	burst = cfg->probe_burst ? cfg->probe_burst - 1 : 0;
	tat = b->tat;
	base = tat > now ? tat : now;
	if (base - now > iv * burst)
		return 0;
	return __sync_val_compare_and_swap(&b->tat, tat, base + iv) == tat;
}

/* T1 of the way back (SRv6): the probed EV's when this side has it on the arrival plane,
 * else that of an active EV of the plane chosen by the EV. */
static __always_inline __u32 probe_t1(__u32 cid, struct mrc_conn *c, __u32 plane, __u32 ev)
{
	struct mrc_evidx_key key = { .conn = cid, .ev = ev };
	struct mrc_ev *e = 0;
	__u32 *slotp, n = c->ev_per_plane;

	slotp = mrc_evidx.lookup(&key);
	if (slotp)
		e = ev_at(cid, *slotp);
	if (e && e->ev == ev && e->plane == plane)
		return e->t1;
	if (!n || n > MRC_EV_ACTIVE_MAX)
		return 0;
	e = ev_at(cid, (plane & (MRC_MAX_PLANES - 1)) * n + ev % n);
	return e ? e->t1 : 0;
}

/* ECMP: the entropy for the way back through T1 t1 of the arrival plane: a GOOD active EV
 * of this side's connection that the fabric hashes onto that T1 (the EV-to-T1 map the
 * EV set was drawn with), or 0 when there is none (the answer keeps the probed EV). */
static __always_inline __u32 probe_back_ev(__u32 cid, struct mrc_conn *c, __u32 plane, __u32 t1)
{
	__u32 n = c->ev_per_plane, j, lim;
	struct mrc_ev *e;

	if (!n || n > MRC_EV_ACTIVE_MAX)
		return 0;
#pragma clang loop unroll(disable)
	for (j = 0; j < MRC_EV_ACTIVE_MAX; j++) {
		lim = n;
		mrc_barrier_var(lim);   /* two exits, as in ev_select(): for the 6.1 verifier */
		if (j >= lim)
			break;
		e = ev_at(cid, (plane & (MRC_MAX_PLANES - 1)) * n + j);
		if (e && e->plane == plane && e->t1 == t1 && e->state == MRC_EV_GOOD)
			return e->ev;
	}
	return 0;
}

/* CRC-32 (reflected, table mrc_crc) of the answer's masked IPv6 packet. */
static __always_inline int probe_icrc(void *data, void *data_end, __u32 *out)
{
	__u32 c = MRC_CRC_LRH_STATE, i, idx, *t;
	__u8 *q;

#pragma clang loop unroll(disable)
	for (i = 0; i < PA_ICRC - PA_IP; i++) {
		q = data + PA_IP + i;
		if ((void *)(q + 1) > data_end)
			return -1;
		idx = (c ^ *q) & 0xff;
		t = mrc_crc.lookup(&idx);
		if (!t)
			return -1;
		c = *t ^ (c >> 8);
	}
	*out = ~c;
	return 0;
}

static __always_inline int probe_bad(void)
{
	ctr_inc(MRC_C_ING_PROBE_BAD);
	return XDP_DROP;
}

/* ingress: turn a PROBE_REQ (plain, after decap) into its answer and send it back. */
/* cid, c: the connection of (source, destination QPN), found by the caller. */
static __always_inline int probe_answer(struct xdp_md *ctx, struct mrc_pkt *p, struct mrc_config *cfg,
					__u32 cid, struct mrc_conn *c)
{
	struct mrc_srv6_tmpl *t = 0;
	struct mrc_plane *pl;
	__u32 k, plane, t1 = 0, dqpn, psn = p->psn, ev = p->ev, crc, *pidx, back = 0;
	__u8 peth[MRC_PETH_LEN], *d, *h, tc;
	void *data, *data_end;

	if (p->pkt_len != MRC_PROBE_LEN || p->udp_len != MRC_PROBE_LEN - PA_UDP)
		return probe_bad();
	k = ctx->ingress_ifindex;
	pidx = mrc_ifplane.lookup(&k);
	if (!pidx)
		return probe_bad();
	plane = *pidx;
	k = plane;
	pl = mrc_planes.lookup(&k);
	if (!pl || !pl->ifindex)
		return probe_bad();
	if (cfg->mode == MRC_MODE_SRV6) {
		k = c->tmpl;
		t = mrc_srv6.lookup(&k);
		if (!t || !t->n_usid)
			return probe_bad();
		t1 = probe_t1(cid, c, plane, ev);
	}
	if (!probe_admit(cfg)) {
		ctr_inc(MRC_C_ING_PROBE_RATE);
		return XDP_DROP;
	}
	dqpn = p->dqpn == MRC_QPN_PROBE ? MRC_QPN_PROBE : c->remote_qpn;
	h = mrc_ext(ctx, p, MRC_PETH_LEN);
	if (!h)
		return probe_bad();
	__builtin_memcpy(peth, h, MRC_PETH_LEN);
	/* back through the T1 the probe came through, when the prober named it */
	if (peth[MRC_PETH_VI_OFF]) {
		if (t)
			t1 = peth[MRC_PETH_VI_OFF] - 1;
		else
			back = probe_back_ev(cid, c, plane, peth[MRC_PETH_VI_OFF] - 1);
	}
	if (bpf_xdp_adjust_tail(ctx, MRC_PANS_LEN - MRC_PROBE_LEN))
		return probe_bad();
	data = (void *)(long)ctx->data;
	data_end = (void *)(long)ctx->data_end;
	d = data;
	if ((void *)(d + MRC_PANS_LEN) > data_end)
		return probe_bad();

	/* IPv6 and UDP, with the fields the ICRC masks set to ones first */
	d[PA_IP + 0] = 0x6F;
	d[PA_IP + 1] = 0xFF;
	d[PA_IP + 2] = 0xFF;
	d[PA_IP + 3] = 0xFF;
	d[PA_IP + 4] = 0;
	d[PA_IP + 5] = MRC_PANS_PLEN;
	d[PA_IP + 7] = 0xFF;
	__builtin_memcpy(d + PA_IP + 8, p->daddr, 16);
	__builtin_memcpy(d + PA_IP + 24, p->saddr, 16);
	if (back) {                         /* ECMP: the way back's entropy, ICRC-covered */
		d[PA_UDP + 0] = back >> 24;
		d[PA_UDP + 1] = back >> 16;
	}
	d[PA_UDP + 4] = 0;
	d[PA_UDP + 5] = MRC_PANS_PLEN;
	d[PA_UDP + 6] = 0xFF;
	d[PA_UDP + 7] = 0xFF;
	/* BTH: SACK to the prober's QP (or the probe QPN), the probe's PSN */
	d[PA_BTH + 0] = MRC_OP_SACK;
	d[PA_BTH + 1] = 0;
	d[PA_BTH + 4] = 0xFF;
	d[PA_BTH + 5] = dqpn >> 16;
	d[PA_BTH + 6] = dqpn >> 8;
	d[PA_BTH + 7] = dqpn;
	d[PA_BTH + 8] = 0;
	/* SETH + CC_STATE */
	__builtin_memset(d + PA_SETH, 0, MRC_SETH_LEN + MRC_CCSTATE_LEN);
	d[PA_SETH + 1] = MRC_SETH_PR;
	d[PA_SETH + 4] = ev >> 24;
	d[PA_SETH + 5] = ev >> 16;
	d[PA_SETH + 6] = ev >> 8;
	d[PA_SETH + 7] = ev;
	d[PA_SETH + 8] = peth[10];          /* spdcid <- the probe's dpdcid */
	d[PA_SETH + 9] = peth[11];
	d[PA_SETH + 10] = peth[8];          /* dpdcid <- the probe's spdcid */
	d[PA_SETH + 11] = peth[9];
	d[PA_SETH + 13] = psn >> 16;
	d[PA_SETH + 14] = psn >> 8;
	d[PA_SETH + 15] = psn;
	d[PA_SETH + MRC_PANS_ID_OFF] = peth[4];
	d[PA_SETH + MRC_PANS_ID_OFF + 1] = peth[5];
	d[PA_CC + 0] = peth[12];            /* reflected tx timestamp */
	d[PA_CC + 1] = peth[13];
	if (probe_icrc(data, data_end, &crc))
		return probe_bad();
	d[PA_ICRC + 0] = crc;               /* stored little-endian (MRC_ICRC_LITTLE_ENDIAN) */
	d[PA_ICRC + 1] = crc >> 8;
	d[PA_ICRC + 2] = crc >> 16;
	d[PA_ICRC + 3] = crc >> 24;
	/* now the masked fields: control class, flow label = EV[15:0], hop limit, no checksum */
	tc = cfg->dscp_ctrl << 2;
	d[PA_IP + 0] = 0x60 | (tc >> 4);
	d[PA_IP + 1] = tc << 4;
	d[PA_IP + 2] = (back ? back : ev) >> 8;
	d[PA_IP + 3] = back ? back : ev;
	d[PA_IP + 7] = cfg->hop_limit;
	d[PA_UDP + 6] = 0;
	d[PA_UDP + 7] = 0;
	d[PA_BTH + 4] = 0;

	if (t) {
		if (srv6_encap(ctx, t, pl, plane, t1, cfg->hop_limit))
			return probe_bad();
		data = (void *)(long)ctx->data;
		data_end = (void *)(long)ctx->data_end;
	}
	if (data + MRC_ETH_LEN > data_end)
		return XDP_DROP;
	__builtin_memcpy(data, pl->dmac, 6);
	__builtin_memcpy(data + 6, pl->smac, 6);
	ctr_inc(MRC_C_ING_PROBE_ANSWERED);
	return XDP_TX;
}

/* ingress: a probe answer (SACK with PR) for one of our probes in flight. */
static __always_inline void probe_result(struct xdp_md *ctx, struct mrc_pkt *p, __u8 *h)
{
	__u32 id = ((__u32)h[MRC_PANS_ID_OFF] << 8) | h[MRC_PANS_ID_OFF + 1];
	__u32 k = ctx->ingress_ifindex, *pidx;
	struct mrc_probe *pr;

	pr = mrc_probes.lookup(&id);
	if (!pr || pr->rx_ns || pr->ev != get32(h + 4) || pr->psn != get24(h + 13) ||
	    !addr_eq(pr->peer, p->saddr, 16)) {
		ctr_inc(MRC_C_ING_PROBE_ANS_UNKNOWN);
		return;
	}
	pidx = mrc_ifplane.lookup(&k);
	pr->plane = pidx ? *pidx : 0xFFFFFFFF;
	pr->rx_ns = bpf_ktime_get_ns();
	ctr_inc(MRC_C_ING_PROBE_ANS);
}

#endif
