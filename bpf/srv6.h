/* SPDX-License-Identifier: (GPL-2.0 OR BSD-2-Clause) */
/*
 * srv6.h - SRv6 uSID (F3216) outer header from a per-destination row template.
 *
 * Destination = 32-bit block | uSID 0 .. uSID n-1 | zeros.  The template stores each
 * uSID with its plane bits zero; the EV's plane is OR-ed into every uSID and its T1
 * into the T1 uSID, so no 128-bit address is stored per path.
 */
#ifndef MRC_SRV6_H
#define MRC_SRV6_H

#include "maps.h"
#include "parse.h"

static __always_inline void srv6_dst(struct mrc_srv6_tmpl *t, __u32 plane, __u32 t1, __u8 *da)
{
	int i;

#pragma unroll
	for (i = 0; i < 4; i++)
		da[i] = t->block[i];
#pragma unroll
	for (i = 0; i < MRC_USID_MAX; i++) {
		__u16 u = 0;

		if (i < t->n_usid) {
			u = t->usid[i] | (__u16)(plane << (t->plane_shift & 15));
			if (i == t->t1_pos)
				u |= (__u16)(t1 << (t->t1_shift & 15));
		}
		da[4 + 2 * i] = u >> 8;
		da[5 + 2 * i] = u & 0xff;
	}
}

/*
 * Push an outer IPv6 header (next header 41) in front of the frame's IPv6 header.
 * Traffic class and flow label are copied from the inner header so the fabric can
 * mark ECN on the outer one.  Returns 0, or -1 (frame unchanged) on failure.
 */
static __always_inline int srv6_encap(struct xdp_md *ctx, struct mrc_srv6_tmpl *t,
				      struct mrc_plane *pl, __u32 plane, __u32 t1, __u8 hlim)
{
	void *data, *data_end;
	struct ipv6hdr *outer, *inner;
	struct ethhdr *eth;

	if (bpf_xdp_adjust_head(ctx, -(int)MRC_IPV6_LEN))
		return -1;
	data = (void *)(long)ctx->data;
	data_end = (void *)(long)ctx->data_end;
	eth = data;
	outer = data + MRC_ETH_LEN;
	inner = data + MRC_ETH_LEN + MRC_IPV6_LEN;
	if ((void *)(inner + 1) > data_end)
		return -1;
	eth->h_proto = bpf_htons(ETH_P_IPV6);
	outer->version = 6;
	outer->priority = inner->priority;
	outer->flow_lbl[0] = inner->flow_lbl[0];
	outer->flow_lbl[1] = inner->flow_lbl[1];
	outer->flow_lbl[2] = inner->flow_lbl[2];
	outer->payload_len = bpf_htons(bpf_ntohs(inner->payload_len) + MRC_IPV6_LEN);
	outer->nexthdr = NEXTHDR_IPV6_ENCAP;
	outer->hop_limit = hlim;
	__builtin_memcpy(&outer->saddr, pl->src_addr, 16);
	srv6_dst(t, plane, t1, (__u8 *)&outer->daddr);
	return 0;
}

/*
 * Remove the outer IPv6 header; a CE mark on it is copied to an ECN-capable inner
 * header first (RFC 6040 normal mode).  Returns 1 if CE was copied, 0, or -1.
 */
static __always_inline int srv6_decap(struct xdp_md *ctx)
{
	void *data = (void *)(long)ctx->data;
	void *data_end = (void *)(long)ctx->data_end;
	struct ethhdr *eth = data, *neth;
	struct ipv6hdr *outer = data + MRC_ETH_LEN;
	struct ipv6hdr *inner = data + MRC_ETH_LEN + MRC_IPV6_LEN;
	int ce = 0;

	if ((void *)(inner + 1) > data_end)
		return -1;
	if ((outer->flow_lbl[0] & 0x30) == 0x30 && (inner->flow_lbl[0] & 0x30) &&
	    (inner->flow_lbl[0] & 0x30) != 0x30) {
		inner->flow_lbl[0] |= 0x30;
		ce = 1;
	}
	neth = (void *)inner - MRC_ETH_LEN;
	__builtin_memmove(neth, eth, MRC_ETH_LEN);
	if (bpf_xdp_adjust_head(ctx, (int)MRC_IPV6_LEN))
		return -1;
	return ce;
}

#endif
