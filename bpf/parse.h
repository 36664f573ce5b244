/* SPDX-License-Identifier: (GPL-2.0 OR BSD-2-Clause) */
/*
 * parse.h - classify a frame as MRC and locate its headers, never misparsing.
 *
 * A frame is MRC once it is Ethernet | IPv6 [| IPv6 inner, SRv6 ingress only] | UDP
 * with the configured destination port.  Before that point anything unexpected is
 * "not MRC" (passed byte-for-byte unchanged); after it, anything inconsistent is
 * "malformed MRC" with a counter reason (dropped by the caller).
 */
#ifndef MRC_PARSE_H
#define MRC_PARSE_H

#include <linux/if_ether.h>
#include <linux/ipv6.h>
#include <linux/udp.h>
#include <linux/in.h>
#include "mrc_shared.h"
#include "frags.h"

#define MRC_P_OK   0
#define MRC_P_NOT  1   /* not MRC: pass unchanged, *reason is a NON_MRC counter */
#define MRC_P_BAD  2   /* malformed MRC: drop, *reason is a BAD_* counter */

#define NEXTHDR_IPV6_ENCAP 41

/*
 * Hide from the compiler what it knows of var's range, so that a bounds check written
 * next to packet pointer math stays in the program and is made on the register the
 * math uses.  Without it clang drops a check it can prove redundant (e.g. the trailer
 * offset once udp_len - 6 was checked against the ICRC table) and adds a value that
 * the verifier of Linux 6.1 / 6.12 cannot bound: those track no range through a byte
 * swap (bpf_ntohs) nor back from a checked copy (r1 = r2 - 6; if r1 > N) to r2.
 */
#define mrc_barrier_var(var) asm volatile("" : "+r"(var))

struct mrc_pkt {
	__u32 l3_off;           /* IPv6 header carrying the UDP (inner one if encapsulated) */
	__u32 outer;            /* 1: an outer IPv6 (SRv6) header sits at MRC_ETH_LEN */
	__u32 udp_off;
	__u32 udp_len;
	__u32 ext_len;          /* BTH + extension headers */
	__u32 pkt_len;          /* bytes in the frame */
	__u8  opcode;
	__u8  b8;               /* BTH byte 8: AckReq, RTX, TS */
	__u8  tc;               /* traffic class of the IPv6 header carrying the UDP */
	__u8  frags;            /* 1: the frame goes on beyond its linear part (MRC_FRAGS) */
	__u32 dqpn;
	__u32 psn;
	__u32 ev;               /* EV read from UDP sport + flow label */
	__u8  saddr[16];
	__u8  daddr[16];
};

static __always_inline int mrc_is_data(__u8 op)
{
	return op >= MRC_OP_WRITE_FIRST && op <= MRC_OP_WRITE_ONLY_IMM;
}

static __always_inline int mrc_is_imm(__u8 op)
{
	return op == MRC_OP_WRITE_LAST_IMM || op == MRC_OP_WRITE_ONLY_IMM;
}

/* Bytes of BTH + extension headers for an MRC opcode (TS: TSETH present). */
static __always_inline __u32 mrc_ext_len(__u8 op, __u8 b8)
{
	if (mrc_is_data(op))
		return MRC_BTH_LEN + MRC_METH_LEN + ((b8 & MRC_BTH_B8_TS) ? MRC_TSETH_LEN : 0) +
		       MRC_RETH_LEN + (mrc_is_imm(op) ? MRC_IMMDT_LEN : 0);
	/* An if chain, not a switch: clang would turn a switch into a .rodata lookup
	 * table, which bcc cannot load. */
	if (op == MRC_OP_ACK)
		return MRC_BTH_LEN + MRC_AETH_LEN;
	if (op == MRC_OP_ENDPOINT_REQ)
		return MRC_BTH_LEN + MRC_ERTH_LEN;
	if (op == MRC_OP_ENDPOINT_RESP)
		return MRC_BTH_LEN + MRC_EETH_LEN;
	if (op == MRC_OP_SACK)
		return MRC_BTH_LEN + MRC_SETH_LEN + MRC_CCSTATE_LEN;
	if (op == MRC_OP_NACK)
		return MRC_BTH_LEN + MRC_NETH_LEN;
	if (op == MRC_OP_PROBE_REQ)
		return MRC_BTH_LEN + MRC_PETH_LEN;
	return 0;
}

static __always_inline int mrc_is_opcode(__u8 op)
{
	return mrc_is_data(op) || op == MRC_OP_ACK || op == MRC_OP_ENDPOINT_REQ ||
	       op == MRC_OP_ENDPOINT_RESP || op == MRC_OP_SACK || op == MRC_OP_NACK ||
	       op == MRC_OP_PROBE_REQ;
}

static __always_inline int ipv6_is_exthdr(__u8 nh)
{
	return nh == 0 || nh == 43 || nh == 44 || nh == 50 || nh == 51 || nh == 60 ||
	       nh == 135 || nh == 139 || nh == 140;
}

static __always_inline __u8 ipv6_tc(struct ipv6hdr *ip6)
{
	return (ip6->priority << 4) | (ip6->flow_lbl[0] >> 4);
}

/* A header of a frame that is not MRC (yet) runs past the linear part: a runt, or (frags)
 * a multi-buffer frame whose headers are not all linear.  Either way not MRC, passed
 * unchanged; the second is counted. */
static __always_inline int mrc_not_linear(struct xdp_md *ctx, __u32 *reason)
{
	if (mrc_has_frags(ctx))
		*reason = MRC_C_NON_MRC_FRAG_HDR;
	return MRC_P_NOT;
}

/*
 * allow_encap: an IPv6-in-IPv6 frame (next header 41) is parsed through to the
 * inner header (SRv6 ingress); otherwise it is not MRC.
 *
 * Multi-buffer frames (MRC_FRAGS): every header up to the last extension header must be
 * in the linear part.  p->pkt_len is the linear length unless the IPv6 payload length
 * says the packet goes on beyond it; only then is the whole frame's length asked for
 * (one helper call; p->frags = 1), so linear frames pay nothing for frags support.
 */
static __always_inline int mrc_parse(struct xdp_md *ctx, struct mrc_pkt *p, __u16 udp_port,
				     int allow_encap, __u32 *reason)
{
	void *data = (void *)(long)ctx->data;
	void *data_end = (void *)(long)ctx->data_end;
	struct ethhdr *eth = data;
	struct ipv6hdr *ip6;
	struct udphdr *udp;
	__u8 *bth;
	__u32 plen, outer_plen;

	p->pkt_len = data_end - data;
	p->frags = 0;
	*reason = MRC_C_MAX;
	if ((void *)(eth + 1) > data_end)
		return mrc_not_linear(ctx, reason);
	if (eth->h_proto == bpf_htons(ETH_P_8021Q) || eth->h_proto == bpf_htons(ETH_P_8021AD)) {
		*reason = MRC_C_NON_MRC_VLAN;
		return MRC_P_NOT;
	}
	if (eth->h_proto == bpf_htons(ETH_P_IP)) {
		*reason = MRC_C_NON_MRC_IPV4;
		return MRC_P_NOT;
	}
	if (eth->h_proto != bpf_htons(ETH_P_IPV6))
		return MRC_P_NOT;

	ip6 = data + MRC_ETH_LEN;
	if ((void *)(ip6 + 1) > data_end)
		return mrc_not_linear(ctx, reason);
	p->outer = 0;
	p->l3_off = MRC_ETH_LEN;
	outer_plen = bpf_ntohs(ip6->payload_len);
	if (ip6->nexthdr == NEXTHDR_IPV6_ENCAP && allow_encap) {
		if (ip6->version != 6)
			return MRC_P_NOT;
		ip6 = data + MRC_ETH_LEN + MRC_IPV6_LEN;
		if ((void *)(ip6 + 1) > data_end)
			return mrc_not_linear(ctx, reason);
		p->outer = 1;
		p->l3_off = MRC_ETH_LEN + MRC_IPV6_LEN;
	}
	if (ip6->version != 6)
		return MRC_P_NOT;
	if (ip6->nexthdr != IPPROTO_UDP) {
		if (ipv6_is_exthdr(ip6->nexthdr))
			*reason = MRC_C_NON_MRC_EXTHDR;
		return MRC_P_NOT;
	}
	udp = (void *)(ip6 + 1);
	if ((void *)(udp + 1) > data_end)
		return mrc_not_linear(ctx, reason);
	if (udp->dest != bpf_htons(udp_port))
		return MRC_P_NOT;
	/* UDP 4791 carries plain RoCEv2 too: it is MRC only with an MRC opcode. */
	bth = (void *)(udp + 1);
	if ((void *)(bth + 1) > data_end)
		return mrc_not_linear(ctx, reason);
	if (!mrc_is_opcode(bth[0])) {
		*reason = MRC_C_NON_MRC_ROCE;
		return MRC_P_NOT;
	}

	/* From here on it is MRC: every inconsistency is a named malformation. */
	p->udp_off = p->l3_off + MRC_IPV6_LEN;
	p->udp_len = bpf_ntohs(udp->len);
	plen = bpf_ntohs(ip6->payload_len);
	if (p->l3_off + MRC_IPV6_LEN + plen > p->pkt_len) {
#if MRC_FRAGS
		/* longer than the linear part: the rest may be in frags */
		p->pkt_len = mrc_frame_len(ctx);
		p->frags = 1;
		if (p->l3_off + MRC_IPV6_LEN + plen > p->pkt_len) {
			*reason = MRC_C_BAD_TRUNC_IPV6;
			return MRC_P_BAD;
		}
#else
		*reason = MRC_C_BAD_TRUNC_IPV6;
		return MRC_P_BAD;
#endif
	}
	if (p->outer && outer_plen != MRC_IPV6_LEN + plen) {   /* outer must hold the inner packet */
		*reason = MRC_C_BAD_SRV6;
		return MRC_P_BAD;
	}
	if (p->udp_len != plen) {
		*reason = MRC_C_BAD_UDP_LEN;
		return MRC_P_BAD;
	}
	if (p->udp_len < sizeof(*udp) + MRC_BTH_LEN + MRC_ICRC_LEN) {
		*reason = MRC_C_BAD_TRUNC_BTH;
		return MRC_P_BAD;
	}
	if ((void *)(bth + MRC_BTH_LEN) > data_end) {  /* implied by the checks above, */
		*reason = p->frags ? MRC_C_BAD_FRAG_HDR : MRC_C_BAD_TRUNC_BTH;  /* linear frames */
		return MRC_P_BAD;
	}
	p->opcode = bth[0];
	p->b8 = bth[8];
	p->dqpn = ((__u32)bth[5] << 16) | ((__u32)bth[6] << 8) | bth[7];
	p->psn = ((__u32)bth[9] << 16) | ((__u32)bth[10] << 8) | bth[11];
	p->ext_len = mrc_ext_len(p->opcode, p->b8);
	if (sizeof(*udp) + p->ext_len + MRC_ICRC_LEN > p->udp_len) {
		*reason = MRC_C_BAD_TRUNC_EXT;
		return MRC_P_BAD;
	}
#if MRC_FRAGS
	/* the extension headers too must be linear (a linear frame: implied above) */
	if (p->frags && p->udp_off + sizeof(*udp) + p->ext_len > (__u32)(data_end - data)) {
		*reason = MRC_C_BAD_FRAG_HDR;
		return MRC_P_BAD;
	}
#endif
	/* Re-read what callers use: fresh loads carry none of the range facts the checks
	 * above attached to each opcode's path, so the verifier merges those paths instead
	 * of verifying everything after parsing once per opcode.  (Same bytes, no writes
	 * in between: the values are the validated ones.) */
	p->opcode = *(volatile __u8 *)&bth[0];
	p->b8 = *(volatile __u8 *)&bth[8];
	p->udp_len = bpf_ntohs(*(volatile __u16 *)&udp->len);
	p->tc = ipv6_tc(ip6);
	p->ev = ((__u32)bpf_ntohs(udp->source) << 16) |
		((__u32)ip6->flow_lbl[1] << 8) | ip6->flow_lbl[2];
	__builtin_memcpy(p->saddr, &ip6->saddr, 16);
	__builtin_memcpy(p->daddr, &ip6->daddr, 16);
	return MRC_P_OK;
}

/* Pointer to the first extension header after the BTH, bounds-checked for len bytes. */
static __always_inline __u8 *mrc_ext(struct xdp_md *ctx, struct mrc_pkt *p, __u32 len)
{
	void *data = (void *)(long)ctx->data;
	void *data_end = (void *)(long)ctx->data_end;
	__u32 off = p->udp_off + sizeof(struct udphdr) + MRC_BTH_LEN;
	__u8 *h;

	if (off > MRC_ETH_LEN + 2 * MRC_IPV6_LEN + sizeof(struct udphdr) + MRC_BTH_LEN)
		return 0;
	h = data + off;
	if ((void *)(h + len) > data_end)
		return 0;
	return h;
}

static __always_inline __u32 get24(__u8 *b)
{
	return ((__u32)b[0] << 16) | ((__u32)b[1] << 8) | b[2];
}

static __always_inline __u32 get32(__u8 *b)
{
	return ((__u32)b[0] << 24) | ((__u32)b[1] << 16) | ((__u32)b[2] << 8) | b[3];
}

static __always_inline __u64 get64(__u8 *b)
{
	return ((__u64)get32(b) << 32) | get32(b + 4);
}

static __always_inline int addr_eq(const __u8 *a, const __u8 *b, int n)
{
	int i;

#pragma unroll
	for (i = 0; i < 16; i++) {
		if (i >= n)
			break;
		if (a[i] != b[i])
			return 0;
	}
	return 1;
}

#endif
