/* SPDX-License-Identifier: (GPL-2.0 OR BSD-2-Clause) */
/*
 * frags.h - multi-buffer ("frags") XDP frames.
 *
 * MRC_FRAGS=1 (-DMRC_FRAGS=1, set by mrc_xdp/datapath/progload.py) builds the programs
 * that are loaded with BPF_F_XDP_HAS_FRAGS: a frame may then be a linear part
 * (ctx->data .. ctx->data_end) plus frags.  The rule everywhere: headers are read and
 * written only in the linear part; bytes beyond it (the ICRC trailer, payload) only
 * through bpf_xdp_load_bytes / bpf_xdp_store_bytes at offsets from the frame's start,
 * whose full length is bpf_xdp_get_buff_len().  A frame that fits its linear part
 * takes the direct-access path it took before, at the same cost: the helpers are called
 * only when the headers say the frame is longer than its linear part.
 * MRC_FRAGS=0 (the default) builds exactly the single-buffer programs of before.
 */
#ifndef MRC_FRAGS_H
#define MRC_FRAGS_H

#ifndef MRC_FRAGS
#define MRC_FRAGS 0
#endif

/* Bytes of the whole frame: linear part and frags (the linear part alone when the
 * programs are built single-buffer). */
static __always_inline __u32 mrc_frame_len(struct xdp_md *ctx)
{
#if MRC_FRAGS
	return bpf_xdp_get_buff_len(ctx);
#else
	return ctx->data_end - ctx->data;
#endif
}

/* Does the frame go on beyond its linear part (always 0 single-buffer)? */
static __always_inline int mrc_has_frags(struct xdp_md *ctx)
{
#if MRC_FRAGS
	return bpf_xdp_get_buff_len(ctx) > (__u64)(ctx->data_end - ctx->data);
#else
	return 0;
#endif
}

#endif
