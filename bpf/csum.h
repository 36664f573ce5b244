/* SPDX-License-Identifier: (GPL-2.0 OR BSD-2-Clause) */
/*
 * csum.h - keep the UDP checksum and the RoCEv2 ICRC valid across an EV rewrite.
 *
 * Of the fields spray rewrites, the ICRC masks the flow label and the UDP checksum but
 * not the UDP source port.  CRC-32 is linear: for equal-length messages
 * crc(a) ^ crc(b) = crc0(a ^ b) (init 0, no final xor), and a ^ b is zero except the
 * 2-byte source port followed by udp_len - 6 covered bytes.  Row udp_len - 6 of
 * mrc_icrc holds crc0 of each of the 16 single-bit port changes, filled by user space.
 */
#ifndef MRC_CSUM_H
#define MRC_CSUM_H

#include "maps.h"
#include "parse.h"

static __always_inline __u16 csum_fold32(__u32 s)
{
	s = (s & 0xffff) + (s >> 16);
	s = (s & 0xffff) + (s >> 16);
	return (__u16)s;
}

/* RFC 1624 eqn. 3 for one 16-bit word; UDP over IPv6 never sends 0 (0xFFFF instead). */
static __always_inline __u16 udp_csum_replace16(__u16 check, __u16 old, __u16 new)
{
	__u32 s = (__u16)~check + (__u32)(__u16)~old + new;
	__u16 r = ~csum_fold32(s);

	return r ? r : 0xFFFF;
}

/* Branchless: sixteen conditional XORs become masks. */
static __always_inline __u32 icrc_delta(struct mrc_icrc_row *row, __u16 d)
{
	__u32 delta = 0;
	int i;

#pragma unroll
	for (i = 0; i < 16; i++)
		delta ^= row->bit[i] & (0U - ((d >> i) & 1));
	return delta;
}

/*
 * The UDP checksum covers the ICRC trailer too: fold the trailer's change into a
 * non-zero checksum, one 16-bit word at a time.  A trailer at an odd offset from the
 * UDP header straddles the checksum's words; byte-swapped words account for that
 * (RFC 1071, byte order independence).
 */
static __always_inline void udp_csum_trailer(struct udphdr *udp, struct mrc_pkt *p,
					     __u32 old_raw, __u32 new_raw)
{
	__u32 o = bpf_ntohl(old_raw), n = bpf_ntohl(new_raw);   /* wire byte 0 on top */
	__u16 c, o0 = o >> 16, o1 = o & 0xffff, n0 = n >> 16, n1 = n & 0xffff;

	if (!udp->check)
		return;
	if ((p->udp_len - MRC_ICRC_LEN) & 1) {
		o0 = __builtin_bswap16(o0);
		o1 = __builtin_bswap16(o1);
		n0 = __builtin_bswap16(n0);
		n1 = __builtin_bswap16(n1);
	}
	c = udp_csum_replace16(bpf_ntohs(udp->check), o0, n0);
	c = udp_csum_replace16(c, o1, n1);
	udp->check = bpf_htons(c);
}

static __always_inline __u32 icrc_apply(__u32 v, __u32 delta)
{
#if (MRC_ICRC_LITTLE_ENDIAN && __BYTE_ORDER__ == __ORDER_LITTLE_ENDIAN__) || \
    (!MRC_ICRC_LITTLE_ENDIAN && __BYTE_ORDER__ == __ORDER_BIG_ENDIAN__)
	return v ^ delta;
#else
	return v ^ __builtin_bswap32(delta);
#endif
}

/*
 * Apply the ICRC change of sport old -> new (and keep a non-zero UDP checksum valid
 * across the trailer change): by direct packet access when the trailer is in the
 * linear part; in a multi-buffer frame (MRC_FRAGS, p->frags) whose trailer lies beyond
 * it, through bpf_xdp_load_bytes / bpf_xdp_store_bytes at its offset in the whole frame
 * (*in_frag = 1).  udp: the frame's UDP header, already bounds-checked.  Returns 0, or
 * -1 if out of table or frame.
 */
static __always_inline int icrc_update_sport(struct xdp_md *ctx, struct mrc_pkt *p,
					     struct udphdr *udp, __u16 old_sport, __u16 new_sport,
					     int *in_frag)
{
	void *data = (void *)(long)ctx->data;
	void *data_end = (void *)(long)ctx->data_end;
	__u32 n = p->udp_len - 6;
	struct mrc_icrc_row *row;
	__u32 off, v, old, delta;
	__u32 *trailer;

	if (n >= MRC_ICRC_TBL_LEN)
		return -1;
	row = mrc_icrc.lookup(&n);
	if (!row)
		return -1;
	delta = icrc_delta(row, old_sport ^ new_sport);
	off = p->udp_off + p->udp_len - MRC_ICRC_LEN;
	mrc_barrier_var(off);           /* keep this check: see mrc_barrier_var */
	if (off <= 0x3FFF) {            /* (direct access: a bounded offset) */
		trailer = data + off;
		if ((void *)(trailer + 1) <= data_end) {
			old = v = *trailer;
			v = icrc_apply(v, delta);
			*trailer = v;
			udp_csum_trailer(udp, p, old, v);
			return 0;
		}
	}
#if MRC_FRAGS
	/* beyond the linear part: any offset the frame has (a 32 KiB payload's trailer lies
	 * past 16 KiB, which direct access does not reach) */
	if (!p->frags || bpf_xdp_load_bytes(ctx, off, &old, MRC_ICRC_LEN))
		return -1;
	v = icrc_apply(old, delta);
	udp_csum_trailer(udp, p, old, v);   /* before the store: udp stays valid */
	if (bpf_xdp_store_bytes(ctx, off, &v, MRC_ICRC_LEN))
		return -1;
	*in_frag = 1;
	return 0;
#else
	return -1;
#endif
}

#endif
