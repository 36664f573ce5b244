/* SPDX-License-Identifier: (GPL-2.0 OR BSD-2-Clause) */
/*
 * linkmodel.c - the lab's link model: one XDP program, attached natively at the
 * receiving end of every fabric link in every namespace of a lab.  Lab ifindexes are
 * unique across the whole lab, so the maps are keyed by ingress ifindex.
 *
 * Per link end (mrc_lcfg[ifindex]):
 *   faults first: blackhole, periodic flap (down in the second half of each period),
 *   random loss (loss_ppm);
 *   then a phantom queue draining at rate_bps: the packet sees backlog q
 *     q > drop_bytes                         -> drop
 *     q > trim_bytes, MRC data, not ctrl DSCP -> trim to headers + 4-byte zero trailer,
 *                                               DSCP := dscp_trimmed
 *     q > ecn_bytes, MRC, ECT(0)/ECT(1)       -> CE in the outer traffic class
 *   and adds its (possibly trimmed) length to the backlog.
 * Frames that are not IPv6/UDP to udp_port are counted and queued, never modified.
 * Multi-buffer frames (MRC_FRAGS, frags.h): lengths are the whole frame's; headers are
 * parsed only in the linear part (a frame whose headers are not all there is not MRC
 * here, queued unchanged), and a trim keeps headers that are linear and shrinks the
 * frags away with bpf_xdp_adjust_tail.
 * MRC_LF_USID_END (srv6 labs on kernels without CONFIG_IPV6_SEG6_LWTUNNEL): a passed
 * frame whose outer destination is this switch's uN SID (block:self::/48) gets the
 * kernel's End with NEXT-CSID done here, block:self:next:..:last becomes
 * block:next:..:last:0, and the kernel forwards it on the next uSID's /48 route.
 * After a pass verdict, cfg.next_prog != 0 tail-calls mrc_lnext[next_prog - 1]
 * (a host's datapath ingress program sharing the same device).
 *
 * Loaded by mrc_xdp/lab/linkmodel.py with bcc; -I bpf/ for mrc_shared.h.
 */
#include <uapi/linux/bpf.h>
#include <linux/in.h>
#include <linux/if_ether.h>
#include <linux/ipv6.h>
#include <linux/udp.h>
#include "mrc_shared.h"
#include "frags.h"

/* Declared with the header's names; bcc cannot rewrite map calls spelled through a
 * macro, so calls below use the expanded names (a mismatch fails to compile). */
BPF_HASH(MRC_LMAP_CFG, __u32, struct mrc_link_cfg, MRC_LINK_MAX);
BPF_HASH(MRC_LMAP_STATE, __u32, struct mrc_link_state, MRC_LINK_MAX);
BPF_PERCPU_HASH(MRC_LMAP_STATS, __u32, struct mrc_link_ctr, MRC_LINK_MAX);
BPF_PROG_ARRAY(MRC_LMAP_NEXT, MRC_LNEXT_MAX);

#define NS_PER_SEC    1000000000ULL
#define IPPROTO_ROUTING_ 43
#define IPPROTO_IPV6_    41
#define SRH_MAX_BYTES    256     /* SRv6 routing headers longer than this: not parsed */

struct lm_pkt {
	__u32 len;        /* frame length */
	__u32 inner;      /* offset of the inner IPv6 header (SRv6), 0 = none */
	__u32 udp;        /* offset of the UDP header */
	__u32 hdr_len;    /* data packets: bytes kept by a trim (before the trailer) */
	__u8  mrc;        /* IPv6/UDP to udp_port with a BTH */
	__u8  data;       /* BTH opcode is an RDMA Write data opcode */
	__u8  dscp;       /* outer DSCP */
	__u8  pad;
};

static __always_inline int lm_parse(void *data, void *data_end, __u16 udp_port,
				    struct lm_pkt *p)
{
	struct ethhdr *eth = data;
	struct ipv6hdr *ip6;
	__u32 off = sizeof(*eth);
	__u8 nh;

	if ((void *)(eth + 1) > data_end || eth->h_proto != bpf_htons(ETH_P_IPV6))
		return 0;
	ip6 = data + off;
	if ((void *)(ip6 + 1) > data_end)
		return 0;
	p->dscp = (ip6->priority << 2) | (ip6->flow_lbl[0] >> 6);
	nh = ip6->nexthdr;
	off += sizeof(*ip6);
	if (nh == IPPROTO_ROUTING_) {
		__u8 *rh = data + off;
		__u32 rlen;

		if ((void *)(rh + 2) > data_end)
			return 0;
		rlen = ((__u32)rh[1] + 1) * 8;
		if (rlen > SRH_MAX_BYTES)
			return 0;
		nh = rh[0];
		off += rlen;
	}
	if (nh == IPPROTO_IPV6_) {
		struct ipv6hdr *in6 = data + off;

		if ((void *)(in6 + 1) > data_end)
			return 0;
		p->inner = off;
		nh = in6->nexthdr;
		off += sizeof(*in6);
	}
	if (nh != IPPROTO_UDP)
		return 0;
	{
		struct udphdr *udp = data + off;
		__u8 *bth = (__u8 *)(udp + 1);
		__u32 ext;
		__u8 op;

		if ((void *)(bth + MRC_BTH_LEN) > data_end)
			return 0;
		if (udp->dest != bpf_htons(udp_port))
			return 0;
		p->udp = off;
		p->mrc = 1;
		op = bth[0];
		if (op < MRC_OP_WRITE_FIRST || op > MRC_OP_WRITE_ONLY_IMM)
			return 1;
		ext = MRC_METH_LEN + MRC_RETH_LEN;
		if (bth[8] & MRC_BTH_B8_TS)
			ext += MRC_TSETH_LEN;
		if (op == MRC_OP_WRITE_LAST_IMM || op == MRC_OP_WRITE_ONLY_IMM)
			ext += MRC_IMMDT_LEN;
		p->data = 1;
		p->hdr_len = off + sizeof(*udp) + MRC_BTH_LEN + ext;
	}
	return 1;
}

static __always_inline void lm_set_dscp(struct ipv6hdr *ip6, __u8 dscp)
{
	ip6->priority = dscp >> 2;
	ip6->flow_lbl[0] = (ip6->flow_lbl[0] & 0x3f) | ((dscp & 3) << 6);
}

/* Phantom queue: the backlog this packet sees, after draining since the last packet.
 * A last_ns in the future (set by tests) freezes the queue. */
static __always_inline __u64 lm_drained(struct mrc_link_state *st, __u64 rate_bps, __u64 now)
{
	__u64 q = st->backlog, last = st->last_ns, dt, drain;

	if (now <= last)
		return q;
	dt = now - last;
	if (dt < 10000000ULL)                   /* < 10 ms: ns precision, rate <= 1 Tbit/s */
		drain = rate_bps * dt / (8 * NS_PER_SEC);
	else if (dt < 10 * NS_PER_SEC)          /* ms precision */
		drain = rate_bps * (dt / 1000000ULL) / 8000ULL;
	else
		return 0;
	return q > drain ? q - drain : 0;
}

/* uN: End with NEXT-CSID, 32-bit block, 16-bit uSIDs (RFC 9800), on the outer header.
 * Without a next uSID the kernel's End would read an SRH: such frames (none in the lab,
 * which sends no SRH) are left to the kernel. */
static __always_inline void lm_usid_end(void *data, void *data_end, struct mrc_link_cfg *cfg,
					struct mrc_link_ctr *c)
{
	struct ethhdr *eth = data;
	struct ipv6hdr *ip6 = data + sizeof(*eth);
	__u16 *w;

	if ((void *)(ip6 + 1) > data_end || eth->h_proto != bpf_htons(ETH_P_IPV6))
		return;
	w = (__u16 *)&ip6->daddr;
	if ((((__u32)bpf_ntohs(w[0]) << 16) | bpf_ntohs(w[1])) != cfg->usid_block ||
	    bpf_ntohs(w[2]) != cfg->usid_self || !w[3])
		return;
	w[2] = w[3];
	w[3] = w[4];
	w[4] = w[5];
	w[5] = w[6];
	w[6] = w[7];
	w[7] = 0;
	c->usid_end++;
}

enum { LM_PASS = 0, LM_MARK = 1, LM_TRIM = 2, LM_DROP = 4 };

int MRC_PROG_LINK(struct xdp_md *ctx)
{
	void *data = (void *)(long)ctx->data;
	void *data_end = (void *)(long)ctx->data_end;
	__u32 ifindex = ctx->ingress_ifindex;
	struct mrc_link_cfg *cfg;
	struct mrc_link_ctr *c;
	struct mrc_link_state *st;
	struct lm_pkt p = {};
	__u32 act = LM_PASS, next;
	__u64 now;

	cfg = mrc_lcfg.lookup(&ifindex);
	if (!cfg)
		return XDP_PASS;
	c = mrc_lstats.lookup(&ifindex);
	if (!c) {
		struct mrc_link_ctr zero = {};

		mrc_lstats.update(&ifindex, &zero);
		c = mrc_lstats.lookup(&ifindex);
		if (!c)
			return XDP_PASS;
	}
	p.len = mrc_frame_len(ctx);     /* linear part + frags */
	c->pkts++;
	c->bytes += p.len;
	lm_parse(data, data_end, cfg->udp_port, &p);
	if (p.mrc)
		c->mrc_pkts++;

	/* faults */
	if (cfg->flags & MRC_LF_BLACKHOLE) {
		c->drop_blackhole++;
		return XDP_DROP;
	}
	now = bpf_ktime_get_ns();
	if (cfg->flap_period_ms) {
		__u64 per = (__u64)cfg->flap_period_ms * 1000000ULL;

		if (now % per >= per / 2) {
			c->drop_flap++;
			return XDP_DROP;
		}
	}
	if (cfg->loss_ppm && bpf_get_prandom_u32() % 1000000 < cfg->loss_ppm) {
		c->drop_loss++;
		return XDP_DROP;
	}

	/* phantom queue */
	st = mrc_lstate.lookup(&ifindex);
	if (st && cfg->rate_bps) {
		int locked = 0, i;

#pragma unroll
		for (i = 0; i < 4; i++) {
			if (__sync_val_compare_and_swap(&st->lock, 0, 1) == 0) {
				locked = 1;
				break;
			}
		}
		if (locked) {
			__u64 q = lm_drained(st, cfg->rate_bps, now);
			__u64 add = p.len;

			if (cfg->drop_bytes && q > cfg->drop_bytes) {
				act = LM_DROP;
				add = 0;
			} else {
				if ((cfg->flags & MRC_LF_TRIM) && p.data && q > cfg->trim_bytes &&
				    p.dscp != cfg->dscp_ctrl && p.len > p.hdr_len + MRC_ICRC_LEN) {
					act = LM_TRIM;
					add = p.hdr_len + MRC_ICRC_LEN;
				}
				if ((cfg->flags & MRC_LF_ECN) && p.mrc && q > cfg->ecn_bytes)
					act |= LM_MARK;
			}
			st->backlog = q + add;
			if (now > st->last_ns)
				st->last_ns = now;
			__sync_fetch_and_and(&st->lock, 0);
		}
	}
	if (act & LM_DROP) {
		c->drop_queue++;
		return XDP_DROP;
	}
	if (act & LM_MARK) {
		struct ipv6hdr *ip6 = data + sizeof(struct ethhdr);

		if ((void *)(ip6 + 1) <= data_end) {
			__u8 ecn = (ip6->flow_lbl[0] >> 4) & 3;

			if (ecn == 1 || ecn == 2) {
				ip6->flow_lbl[0] |= 0x30;
				c->marked++;
			}
		}
	}
	if (act & LM_TRIM) {
		struct ipv6hdr *ip6 = data + sizeof(struct ethhdr), *in6 = 0;
		__u32 hl = p.hdr_len, nl, ioff = p.inner, uoff = p.udp;
		struct udphdr *udp;
		__u8 *trailer;

		/* bounds for the verifier (lm_parse keeps these far below) */
		if (hl > 2048 || ioff > 512 || uoff > 1024)
			goto out;
		nl = hl + MRC_ICRC_LEN;
		trailer = data + hl;
		udp = data + uoff;
		if ((void *)(trailer + MRC_ICRC_LEN) > data_end || (void *)(ip6 + 1) > data_end ||
		    (void *)(udp + 1) > data_end)
			goto out;
		if (ioff) {
			in6 = data + ioff;
			if ((void *)(in6 + 1) > data_end)
				goto out;
		}
		__builtin_memset(trailer, 0, MRC_ICRC_LEN);
		ip6->payload_len = bpf_htons(nl - sizeof(struct ethhdr) - sizeof(*ip6));
		lm_set_dscp(ip6, cfg->dscp_trimmed);
		if (in6) {
			in6->payload_len = bpf_htons(nl - ioff - sizeof(*in6));
			lm_set_dscp(in6, cfg->dscp_trimmed);
		}
		udp->len = bpf_htons(nl - uoff);
		udp->check = 0;
		if (bpf_xdp_adjust_tail(ctx, (int)nl - (int)p.len) == 0)
			c->trimmed++;
	}
out:
	if (cfg->flags & MRC_LF_USID_END)
		lm_usid_end((void *)(long)ctx->data, (void *)(long)ctx->data_end, cfg, c);
	next = cfg->next_prog;
	if (next)
		mrc_lnext.call(ctx, next - 1);
	return XDP_PASS;
}
