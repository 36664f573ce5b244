/* SPDX-License-Identifier: (GPL-2.0 OR BSD-2-Clause) */
/*
 * mrc_datapath.c - the host's MRC multipath engine, three thin XDP entry points.
 *
 *   engine --mrc0==mrc0p--> [mrc_spray] --devmap--> plane NIC pN --> fabric
 *   fabric --> plane NIC [mrc_ingress] --devmap--> mrc0p==mrc0 [mrc_to_engine] --> XSK / stack
 *   PROBE_REQ from a peer --> plane NIC [mrc_ingress] --XDP_TX (its answer)--> fabric
 *   user space --test_run--> [mrc_evop]: operator / daemon EV state change under the swap lock
 *
 * Non-MRC frames leave every program byte-for-byte unchanged (XDP_PASS); malformed MRC
 * frames are counted by reason and dropped.  All policy lives in maps (mrc_shared.h).
 */
#include "maps.h"
#include "counters.h"
#include "parse.h"
#include "csum.h"
#include "ev_state.h"
#include "ev_select.h"
#include "srv6.h"
#include "probe.h"

static __always_inline struct mrc_config *cfg_get(void)
{
	__u32 k = 0;

	return mrc_cfg.lookup(&k);
}

static __always_inline int conn_matches(struct mrc_conn *c, __u8 *peer, __u32 qpn, __u32 dir)
{
	__u64 a0, a1, b0, b1;

	if ((dir == MRC_DIR_TX ? c->remote_qpn : c->local_qpn) != qpn)
		return 0;
	__builtin_memcpy(&a0, peer, 8);
	__builtin_memcpy(&a1, peer + 8, 8);
	__builtin_memcpy(&b0, c->peer, 8);
	__builtin_memcpy(&b1, c->peer + 8, 8);
	return a0 == b0 && a1 == b1;
}

static __always_inline __u32 psn_diff(__u32 a, __u32 b)   /* (a - b) mod 2^24 */
{
	return (a - b) & 0xFFFFFF;
}

/* Connection of (peer, qpn, dir): the previous packet's on this CPU if it matches
 * (an array lookup and a compare), else the hash map, which refills the cache. */
static __always_inline int conn_find(__u8 *peer, __u32 qpn, __u32 dir, __u32 *cid,
				     struct mrc_conn **c)
{
	struct mrc_conn_key key = {};
	struct mrc_ccache *cc;
	__u32 zero = 0, *id, last;

	cc = mrc_ccache.lookup(&zero);
	if (cc) {
		last = cc->cid1[dir & 1];
		if (last && last <= MRC_MAX_CONNS) {
			last -= 1;
			*c = mrc_conns.lookup(&last);
			if (*c && conn_matches(*c, peer, qpn, dir)) {
				*cid = last;
				return 0;
			}
		}
	}
	__builtin_memcpy(key.peer, peer, 16);
	key.qpn = qpn;
	key.dir = dir;
	id = mrc_connidx.lookup(&key);
	if (!id)
		return -1;
	*cid = *id;
	*c = mrc_conns.lookup(id);
	if (!*c)
		return -1;
	if (cc)
		cc->cid1[dir & 1] = *cid + 1;
	return 0;
}

/* Count a parse result: -1 = an MRC frame, go on; else the verdict (not MRC:
 * XDP_PASS, byte-for-byte unchanged; malformed MRC: XDP_DROP). */
static __always_inline int verdict(int rc, __u32 reason, __u32 non_mrc_ctr)
{
	if (rc == MRC_P_OK)
		return -1;
	if (rc == MRC_P_NOT) {
		ctr_inc(non_mrc_ctr);
		if (reason < MRC_C_MAX)
			ctr_inc(reason);
		return XDP_PASS;
	}
	ctr_inc(reason);
	return XDP_DROP;
}

/* Traffic class = DSCP << 2 | ECN, split over the first two IPv6 header bytes. */
static __always_inline void set_tc(struct ipv6hdr *ip6, __u8 tc)
{
	ip6->priority = tc >> 4;
	ip6->flow_lbl[0] = (ip6->flow_lbl[0] & 0x0f) | (tc << 4);
}

/* ------------------------------------------------------------------ spray */

int mrc_spray(struct xdp_md *ctx)
{
	struct mrc_config *cfg = cfg_get();
	struct mrc_pkt p = {};
	struct mrc_conn *c;
	struct mrc_rot *rot;
	struct mrc_ev *e;
	struct mrc_plane *pl;
	struct mrc_ev_ctr *ec;
	struct ipv6hdr *ip6;
	struct udphdr *udp;
	void *data, *data_end;
	__u32 reason, cid, slot, plane, k;
	__u16 old_sport, new_sport, ts = 0;
	__u8 tc;
	int rc, icrc_frag = 0;

	if (!cfg)
		return XDP_PASS;
	ctr_inc(MRC_C_SPRAY_RX);
	rc = mrc_parse(ctx, &p, cfg->udp_port, 0, &reason);
	rc = verdict(rc, reason, MRC_C_SPRAY_NON_MRC);
	if (rc >= 0)
		return rc;
	if (p.udp_len - 6 >= MRC_ICRC_TBL_LEN) {
		ctr_inc(MRC_C_BAD_TOO_LONG);
		return XDP_DROP;
	}
	if (conn_find(p.daddr, p.dqpn, MRC_DIR_TX, &cid, &c)) {
		ctr_inc(MRC_C_SPRAY_NO_CONN);
		return XDP_PASS;
	}
	/* The engine's TSETH tx timestamp (TS flag) dates the packet for the loss rule:
	 * read here, before any rewrite moves the headers; no clock read in spray. */
	if (p.b8 & MRC_BTH_B8_TS) {
		__u8 *m = mrc_ext(ctx, &p, MRC_METH_LEN + MRC_TSETH_LEN);

		if (m)
			ts = ((__u16)m[MRC_METH_LEN] << 8) | m[MRC_METH_LEN + 1];
	}

	if (p.opcode == MRC_OP_PROBE_REQ) {
		/* a probe goes out on the EV it names, whatever its state but DENIED */
		e = probe_ev(cid, &p);
		if (!e)
			return XDP_DROP;
	} else {
		__u32 pref = MRC_MAX_PLANES;

		/* Feedback (SACK, NACK, ACK) goes back on the plane the peer's newest data
		 * came in on; a repeated SACK (RTX: the engine says its SACKs were not heard)
		 * on the next plane, so one of the two avoids a plane dead towards the peer
		 * only. */
		if (!mrc_is_data(p.opcode) && c->rx_plane && c->rx_plane <= MRC_MAX_PLANES) {
			pref = c->rx_plane - 1;
			if (p.b8 & MRC_BTH_B8_RTX)
				pref = pref + 1 < cfg->nplanes ? pref + 1 : 0;
		}
		rot = ev_select(cid, c, cfg->nplanes, pref);
		if (!rot) {
			ctr_inc(MRC_C_SPRAY_NO_EV);
			return XDP_DROP;
		}
		slot = rot->slot;
		e = ev_at(cid, slot);
		if (!e)
			return XDP_DROP;
	}
	plane = e->plane;
	k = plane;
	pl = mrc_planes.lookup(&k);
	if (!pl || !pl->ifindex) {
		ctr_inc(MRC_C_SPRAY_NO_PORT);
		return XDP_DROP;
	}

	/* Rewrite the EV: UDP sport = EV[31:16], flow label = EV[15:0]. */
	data = (void *)(long)ctx->data;
	data_end = (void *)(long)ctx->data_end;
	ip6 = data + MRC_ETH_LEN;
	udp = data + MRC_ETH_LEN + MRC_IPV6_LEN;
	if ((void *)(udp + 1) > data_end)
		return XDP_DROP;
	old_sport = bpf_ntohs(udp->source);
	new_sport = e->ev >> 16;
	ip6->flow_lbl[0] &= 0xf0;
	ip6->flow_lbl[1] = (e->ev >> 8) & 0xff;
	ip6->flow_lbl[2] = e->ev & 0xff;
	tc = p.tc;
	if (cfg->flags & MRC_CF_DSCP_REWRITE) {
		__u8 dscp = !mrc_is_data(p.opcode) ? cfg->dscp_ctrl :
			    (p.b8 & MRC_BTH_B8_RTX) ? cfg->dscp_rtx : cfg->dscp_data;
		tc = (dscp << 2) | (tc & 3);
	}
	if ((cfg->flags & MRC_CF_SET_ECT) && mrc_is_data(p.opcode) && !(tc & 3))
		tc |= 2;  /* ECT(0) */
	set_tc(ip6, tc);
	if (old_sport != new_sport) {
		udp->source = bpf_htons(new_sport);
		if (udp->check) {
			udp->check = bpf_htons(udp_csum_replace16(bpf_ntohs(udp->check), old_sport, new_sport));
			ctr_inc(MRC_C_SPRAY_CSUM_FIX);
		}
		if (icrc_update_sport(ctx, &p, udp, old_sport, new_sport, &icrc_frag)) {
			ctr_inc(MRC_C_BAD_TOO_LONG);
			return XDP_DROP;
		}
		ctr_inc(MRC_C_SPRAY_ICRC_FIX);
		if (icrc_frag)
			ctr_inc(MRC_C_SPRAY_ICRC_FRAG);
	}

	if (cfg->mode == MRC_MODE_SRV6) {
		struct mrc_srv6_tmpl *t;

		k = c->tmpl;
		t = mrc_srv6.lookup(&k);
		if (!t || !t->n_usid || srv6_encap(ctx, t, pl, plane, e->t1, cfg->hop_limit)) {
			ctr_inc(MRC_C_SPRAY_NO_TMPL);
			return XDP_DROP;
		}
		ctr_inc(MRC_C_SPRAY_SRV6_ENCAP);
	}
	data = (void *)(long)ctx->data;
	data_end = (void *)(long)ctx->data_end;
	if (data + MRC_ETH_LEN > data_end)
		return XDP_DROP;
	__builtin_memcpy(data, pl->dmac, 6);
	__builtin_memcpy(data + 6, pl->smac, 6);

	/* Only what is really sent is counted and remembered.  The PSN ring says which EV
	 * carried which PSN, and when, for loss attribution from SACK bitmaps. */
	if (mrc_is_data(p.opcode)) {
		struct mrc_psn_ent *pe;

		k = cid * MRC_PSN_RING + (p.psn & (MRC_PSN_RING - 1));
		pe = mrc_psn.lookup(&k);
		/* A retransmission of a stamped packet not yet judged (no loss attributed, no
		 * NACK) leaves the entry as it is: the loss rule judges the first transmission
		 * by its own send time, whenever the engine chose to resend it (its rule is
		 * the PSN distance: under reordering it resends packets that were not lost). */
		if (pe && (p.b8 & MRC_BTH_B8_RTX) && pe->psn == p.psn &&
		    (pe->flags & ~(MRC_PSNF_RESENT | MRC_PSNF_JUDGED)) == MRC_PSNF_VALID && pe->ts && ts) {
			pe->flags |= MRC_PSNF_RESENT;
			pe = 0;
		}
		if (pe) {
			/* a resend of a PSN the loss rule judged keeps the mark (late_arrival) */
			__u16 keep = pe->psn == p.psn ? pe->flags & MRC_PSNF_JUDGED : 0;

			pe->psn = p.psn;
			pe->ev = e->ev;
			pe->flags = MRC_PSNF_VALID | keep;
			pe->ts = ts;                    /* when: the engine's stamp (0: none) */
			/* send order, an atomic counter rather than bpf_ktime_get_ns() (the
			 * clock read costs more than the rest of spray on some hosts): the
			 * PSN-distance fallback's "sent before the trigger" */
			__u64 seq = __sync_fetch_and_add(&c->txseq, 1);

			pe->txseq = seq;
			/* the sent window's upper edge (ingress): the newest first send (a
			 * new QP on this connection starts a PSN space of its own), or a
			 * retransmission newer than that, whose first send never got here
			 * (dropped before the PSN ring saw it).  Otherwise every SACK of that
			 * PSN lies outside the window and is dropped, and the sender resends
			 * it until its QP fails: a collective's last packet did so (lab,
			 * rate-limited links, every EV skipping) */
			if (!(p.b8 & MRC_BTH_B8_RTX) || !seq ||
			    psn_diff(p.psn, c->psn_hi) - 1 < 0x7FFFFF)
				c->psn_hi = p.psn;
		}
		ctr_inc(MRC_C_SPRAY_DATA);
	} else {
		ctr_inc(MRC_C_SPRAY_CTRL);
	}
	ec = evctr_of(cid, e);
	if (ec) {
		ec->tx_pkts++;
		ec->tx_bytes += p.pkt_len;
	}
	ctr_inc(MRC_C_SPRAY_TX);
#if MRC_FRAGS
	if (p.frags)            /* the whole frame, frags included */
		ctr_add(MRC_C_SPRAY_BYTES, mrc_frame_len(ctx));
	else
#endif
	ctr_add(MRC_C_SPRAY_BYTES, (long)data_end - (long)data);
	return mrc_ports.redirect_map(plane, 0);
}

/* ------------------------------------------------------------------ ingress */

static __always_inline int highest_bit(__u64 x)
{
	int n = 0;

	if (x >> 32) { n += 32; x >>= 32; }
	if (x >> 16) { n += 16; x >>= 16; }
	if (x >> 8)  { n += 8;  x >>= 8; }
	if (x >> 4)  { n += 4;  x >>= 4; }
	if (x >> 2)  { n += 2;  x >>= 2; }
	if (x >> 1)  { n += 1; }
	return n;
}

/*
 * The sent window: feedback speaks only of PSNs this connection has sent (threat model:
 * README).  The PSN a SACK acks and the PSN a NACK names must be among the last
 * MRC_PSN_RING PSNs sent, recorded in the PSN ring (hi: the newest new PSN sent); the
 * cumulative ack and the bitmap base lie at most MRC_FB_WINDOW behind hi + 1, never
 * ahead of it.  All in serial-number arithmetic mod 2^24.
 */
static __always_inline struct mrc_psn_ent *psn_sent(__u32 cid, __u32 hi, __u32 psn)
{
	struct mrc_psn_ent *pe;
	__u32 k;

	if (psn_diff(hi, psn) >= MRC_PSN_RING)
		return 0;
	k = cid * MRC_PSN_RING + (psn & (MRC_PSN_RING - 1));
	pe = mrc_psn.lookup(&k);
	if (!pe || pe->psn != psn || !(pe->flags & MRC_PSNF_VALID))
		return 0;
	return pe;
}

static __always_inline int psn_in_window(__u32 hi, __u32 psn)
{
	return psn_diff(hi + 1, psn) <= MRC_FB_WINDOW;
}

/*
 * Date the packet that triggered this SACK (its PSN ring entry, ape) and keep the
 * connection's reorder window.  The trigger was sent at the ring's timestamp, or at the
 * reflected one (CC_STATE) when that is earlier: an earlier transmission of the PSN
 * arrived (a reflection only ever dates the trigger earlier, so a forged one cannot
 * make a packet look lost, except for a PSN resent before it was judged, whose entry
 * still holds the first send).  The reflection is also an RTT sample (bpf_ktime_get_ns() is
 * the engine's clock): the window is min RTT / loss_window_div + 4 x RTT spread, at
 * most the mean RTT (min RTT + spread), never below loss_window_us.
 * Returns the trigger's send time, 0 when it was sent without a timestamp.
 */
static __always_inline __u32 sack_clock(struct mrc_conn *c, struct mrc_config *cfg,
					struct mrc_psn_ent *ape, __u32 refl)
{
	__u32 trig = ape->ts, rtt, mn, spread, w, steps;
	__u64 now, back;

	if (!trig)
		return 0;
	if (!refl)
		return trig;
	/* resent unjudged (the ring still holds the first send): the reflection says which
	 * send triggered the SACK */
	if ((__s16)(trig - refl) > 0 || (ape->flags & MRC_PSNF_RESENT))
		trig = refl;
	now = bpf_ktime_get_ns();
	rtt = ((__u32)(now / MRC_TS_UNIT_NS) - refl) & 0xFFFF;
	if (rtt >= MRC_TS_WINDOW_MAX)
		return trig;                    /* not a sample of this clock */
	ctr_inc(MRC_C_ING_RTT);
	mn = c->min_rtt;
	if (!mn || rtt < mn || now - c->min_rtt_ns > MRC_MIN_RTT_WLEN_NS) {
		mn = rtt ? rtt : 1;
		c->min_rtt = mn;
		c->min_rtt_ns = now;
	}
	/* the mean excess of RTT samples over the minimum (gain 1/8, as TCP's srtt): the
	 * queueing and scheduling delay that reorders paths.  Four of it, as TCP's RTO
	 * allows four mean deviations: a window of a few RTTs at most, so a loss is still
	 * found within a small multiple of the RTT */
	spread = c->rtt_spread;
	spread = spread - (spread >> 3) + ((rtt - mn) >> 3);
	c->rtt_spread = spread;
	w = 4 * spread + (cfg->loss_window_div ? mn / cfg->loss_window_div : 0);
	/* at most the mean RTT (RACK bounds its window by SRTT): the engine resends a hole
	 * about an RTT after it is reported, and a hole filled before the window ran out
	 * is never judged, so a longer window would never find a loss at all */
	if (w > mn + spread)
		w = mn + spread;
	if (w < cfg->loss_window_us)
		w = cfg->loss_window_us;
	/* packets judged lost that were late (late_arrival) widened the window by steps;
	 * a step back per second without one, every second since the last step counted (a
	 * connection idle for seconds starts again with the RTT-based window, not one step
	 * narrower than where it stopped) */
	steps = c->reo_steps;
	if (steps && now - c->reo_ns > MRC_REO_DECAY_NS) {
		back = (now - c->reo_ns) / MRC_REO_DECAY_NS;
		steps = back >= steps ? 0 : steps - (__u32)back;
		c->reo_steps = steps;
		c->reo_ns = now;
	}
	w *= 1 + (steps & 15);
	if (w >= MRC_TS_WINDOW_MAX)
		w = MRC_TS_WINDOW_MAX - 1;
	c->reo_wnd = w;
	return trig;
}

/*
 * Packets the time-based rule judged lost (MRC_PSNF_JUDGED) that arrived after all: the
 * reorder window then widens a step (sack_clock), one step per RTT at most: this fabric
 * and these CPUs reorder more than the RTT samples show (a descheduled NAPI, a T1 that
 * carries a whole plane while its twin is dead).  RACK widens its window on D-SACKs the
 * same way.  The EV it blamed stays retired until the health daemon's probes bring it
 * back.  Three proofs, each one entry (no loop: ingress's verifier budget is spent):
 *  - the cumulative ack passed the PSN it held back (c->fb_cack, the oldest outstanding)
 *    while it was not resent (MRC_PSNF_LOST still set) or resent less than a min RTT ago
 *    (too recently for the resend to be what arrived);
 *  - the PSN the rule judged last (c->judged), anywhere in the window, shows up in this
 *    SACK (its bitmap bit, or below the cumulative ack) before any resend of it;
 *  - the SACK's trigger (ape) is a judged PSN whose entry a resend took, and the SACK
 *    reflects an older timestamp than that resend's: the receiver SACKs a duplicate at
 *    once, dated by it, so the send judged lost has arrived (the usual proof when the
 *    engine resent first).
 */
static __always_inline void late_arrival(__u32 cid, struct mrc_conn *c, __u32 cack, __u32 base,
					 __u64 bitmap, struct mrc_psn_ent *ape, __u32 refl)
{
	__u32 from = c->fb_cack, n = psn_diff(cack, from), d, j = c->judged, off;
	struct mrc_psn_ent *pe = 0;
	__u64 now;

	if ((ape->flags & MRC_PSNF_JUDGED) && !(ape->flags & MRC_PSNF_LOST) && refl && ape->ts &&
	    (__s16)(ape->ts - refl) > 0)
		pe = ape;               /* an earlier send than the resend in the entry arrived */
	if (!pe && (j & MRC_JUDGED_VALID)) {
		j &= 0xFFFFFF;
		off = psn_diff(j, base);
		if ((psn_diff(j, cack) & 0x800000) || (off < 64 && ((bitmap >> (off & 63)) & 1))) {
			c->judged = 0;
			pe = psn_sent(cid, c->psn_hi, j);
			if (pe && (pe->flags & (MRC_PSNF_JUDGED | MRC_PSNF_LOST)) !=
				  (MRC_PSNF_JUDGED | MRC_PSNF_LOST))
				pe = 0;         /* resent (or judged again since): either may be it */
		}
	}
	if (n && !(n & 0x800000)) {
		c->fb_cack = cack;
		if (!pe) {
			pe = psn_sent(cid, c->psn_hi, from);
			if (pe && !(pe->flags & MRC_PSNF_JUDGED))
				pe = 0;
			if (pe && !(pe->flags & MRC_PSNF_LOST)) {       /* resent: how long ago? */
				d = ((__u32)(bpf_ktime_get_ns() / MRC_TS_UNIT_NS) - pe->ts) & 0xFFFF;
				if (d >= c->min_rtt)
					pe = 0;  /* the resend may be what arrived; the mark
						  * stays for the first send's duplicate */
			}
		}
	}
	if (!pe)
		return;
	pe->flags &= ~MRC_PSNF_JUDGED;
	now = bpf_ktime_get_ns();
	ctr_inc(MRC_C_ING_LATE);
	if (c->reo_steps < MRC_REO_STEPS_MAX &&
	    now - c->reo_ns > (__u64)(c->min_rtt + c->rtt_spread) * MRC_TS_UNIT_NS) {
		c->reo_steps++;
		c->reo_ns = now;
		ctr_inc(MRC_C_ING_REO_GROW);
	}
}

/*
 * Holes in the SACK bitmap (below its highest set bit, hb) that are losses; the PSN
 * ring names the EV that carried each, and each send is counted once.
 *  - time-based (RACK), for packets the engine stamped (TSETH): the missing packet was
 *    sent more than the reorder window before the packet that triggered the SACK
 *    (trig_ts).  Reordering, however many PSNs deep, is no loss; a lost packet is
 *    found as soon as a packet sent one window after it is SACKed.
 *  - the PSN-distance fallback, for packets sent without a timestamp: the hole lies at
 *    least loss_reorder PSNs below the newest SACKed PSN and was sent (ack_seq: send
 *    order) before the triggering packet.
 * A hole whose retransmission is still in flight (sent after the trigger) is not blamed
 * on the retransmission's EV either way.  always: the SACK's M=ALWAYS_SKIP retires the
 * EV it echoes (ev_echo) in the same pass (one inlined copy of ev_retire, whose backup
 * scan is long, for both).
 */
static __always_inline void sack_losses(__u32 cid, struct mrc_conn *c, struct mrc_config *cfg,
					__u32 cack, __u32 base, __u64 bitmap, __u32 hb, __u32 ack_seq,
					__u32 trig_ts, __u32 ev_echo, int always)
{
	__u32 lost_ev[MRC_LOSS_BATCH * 2] = {};
	__u32 nlost = 0, n, wnd = c->reo_wnd, tmask, i, k, psn, slot, d, zero = 0, *slotp;
	struct mrc_evidx_key key = { .conn = cid };
	struct mrc_ccache *cc = mrc_ccache.lookup(&zero);
	struct mrc_psn_ent *pe;
	struct mrc_ev_ctr *ec;
	struct mrc_ev *e;
	__u8 why;

	if (!cc)
		return;
	if (wnd < cfg->loss_window_us)      /* no RTT sample yet: the floor */
		wnd = cfg->loss_window_us;
	/* a mask, not a test of trig_ts in the loop: clang would unswitch the loop (two
	 * copies of it) on a loop-invariant test */
	tmask = trig_ts ? 0xFFFF : 0;
	mrc_barrier_var(tmask);
#pragma clang loop unroll(disable)
	for (i = 0; i < 64; i++) {
		/* no set bit from i up: past the highest (hb), no holes left.  (Not i >= hb:
		 * the verifier would narrow hb's range in every iteration, states that do
		 * not prune.) */
		if (!(bitmap >> i) || nlost >= MRC_LOSS_BATCH)
			break;
		if (bitmap & (1ULL << i))
			continue;
		psn = (base + i) & 0xFFFFFF;
		if (psn_diff(psn, cack) & 0x800000)   /* before cack: already received */
			continue;
		k = cid * MRC_PSN_RING + (psn & (MRC_PSN_RING - 1));
		pe = mrc_psn.lookup(&k);
		if (!pe || pe->psn != psn || (pe->flags & ~(MRC_PSNF_RESENT | MRC_PSNF_JUDGED)) != MRC_PSNF_VALID)
			continue;
		if (pe->ts & tmask) {
			d = (trig_ts - pe->ts) & 0xFFFF;
			if (d <= wnd || d >= 0x8000)
				continue;       /* within the window, or sent after the trigger */
			why = MRC_R_LOSS;
		} else {
			if (i + cfg->loss_reorder > hb)
				continue;
			if ((__s32)(pe->txseq - (__u32)ack_seq) > 0)
				continue;       /* (re)sent after the packet being acked: in flight */
			why = MRC_R_LOSS_PSN;
		}
		pe->flags |= MRC_PSNF_LOST | (why == MRC_R_LOSS ? MRC_PSNF_JUDGED : 0);
		if (why == MRC_R_LOSS)
			c->judged = MRC_JUDGED_VALID | psn;     /* late_arrival watches it */
		lost_ev[nlost & (MRC_LOSS_BATCH - 1)] = pe->ev;
		cc->why[nlost & (MRC_LOSS_BATCH - 1)] = why;
		nlost++;
	}
	n = nlost;
	if (always) {
		lost_ev[n & (2 * MRC_LOSS_BATCH - 1)] = ev_echo;
		cc->why[n & (2 * MRC_LOSS_BATCH - 1)] = MRC_R_SACK_ALWAYS;
		n++;
	}
	/* Count every loss; every EV over the threshold is retired now (up to
	 * MRC_LOSS_BATCH per SACK: one SACK can report losses on several paths). */
#pragma clang loop unroll(disable)
	for (i = 0; i < MRC_LOSS_BATCH + 1; i++) {
		if (i >= n)
			break;
		key.ev = lost_ev[i & (2 * MRC_LOSS_BATCH - 1)];
		slotp = mrc_evidx.lookup(&key);
		if (!slotp)
			continue;
		slot = *slotp;
		e = ev_at(cid, slot);
		if (!e)
			continue;
		why = cc->why[i & (2 * MRC_LOSS_BATCH - 1)];
		if (why != MRC_R_SACK_ALWAYS) {
			ctr_inc(MRC_C_ING_LOSS);
			if (why == MRC_R_LOSS_PSN)
				ctr_inc(MRC_C_ING_LOSS_PSN);
			ec = evctr_of(cid, e);
			if (ec)
				ec->loss++;
			e->losses++;
			if (e->losses < cfg->loss_thresh)
				continue;
		}
		ev_retire(cid, c, slot, e, why);   /* only a GOOD or SKIP EV */
	}
}

/* SACK / NACK: apply the EV state machine at once, for known connections only.
 * Returns 1 for feedback outside the sent window: dropped, the engine never sees it. */
static __always_inline int feedback(struct xdp_md *ctx, struct mrc_pkt *p, struct mrc_config *cfg)
{
	struct mrc_evidx_key key = {};
	struct mrc_conn *c;
	struct mrc_ev *e;
	struct mrc_ev_ctr *ec;
	struct mrc_psn_ent *ape;
	__u32 cid, slot, hi, *slotp;
	__u8 *h;

	if (conn_find(p->saddr, p->dqpn, MRC_DIR_RX, &cid, &c)) {
		ctr_inc(MRC_C_ING_FB_NO_CONN);
		return 0;
	}
	h = mrc_ext(ctx, p, p->opcode == MRC_OP_SACK ? MRC_SETH_LEN + MRC_CCSTATE_LEN : MRC_NETH_LEN);
	if (!h)
		return 0;
	/* Outside the sent window: counted, nothing else (no EV change, no loss). */
	hi = c->psn_hi;
	if (p->opcode == MRC_OP_SACK) {
		__u32 cack = get24(h + 13);
		__s16 aoff = (__s16)(((__u16)h[2] << 8) | h[3]);
		__s16 soff = (__s16)(((__u16)h[18] << 8) | h[19]);
		__u32 base = (cack + soff) & 0xFFFFFF;
		__u64 bitmap = get64(h + 20);
		__u32 hb = highest_bit(bitmap);   /* the newest PSN SACKed: base + hb */

		ape = c->txseq ? psn_sent(cid, hi, (cack + aoff) & 0xFFFFFF) : 0;
		if (!ape || !psn_in_window(hi, cack) || !psn_in_window(hi, base) ||
		    (bitmap && (psn_diff(hi, base + hb) & 0x800000))) {
			ctr_inc(MRC_C_ING_FB_OOW);
			return 1;
		}
		__u32 refl = ((__u32)h[MRC_SETH_LEN] << 8) | h[MRC_SETH_LEN + 1];

		late_arrival(cid, c, cack, base, bitmap, ape, refl);
		/* The bitmap speaks for the connection, whatever EV the SACK echoes. */
		sack_losses(cid, c, cfg, cack, base, bitmap, hb, ape->txseq,
			    sack_clock(c, cfg, ape, refl),
			    get32(h + 4), ((h[1] >> MRC_SETH_M_SHIFT) & MRC_SETH_M_MASK) == MRC_M_ALWAYS_SKIP);
	} else {
		ape = c->txseq ? psn_sent(cid, hi, get24(h + 13)) : 0;
		if (!ape) {
			ctr_inc(MRC_C_ING_FB_OOW);
			return 1;
		}
	}
	key.conn = cid;
	key.ev = get32(h + 4);
	slotp = mrc_evidx.lookup(&key);
	if (!slotp) {
		ctr_inc(MRC_C_ING_FB_NO_EV);
		return 0;
	}
	slot = *slotp;
	e = ev_at(cid, slot);
	if (!e)
		return 0;
	ec = evctr_of(cid, e);

	if (p->opcode == MRC_OP_SACK) {
		__u8 m = (h[1] >> MRC_SETH_M_SHIFT) & MRC_SETH_M_MASK;

		if (ec)
			ec->sack++;
		e->losses = 0;          /* it delivered: losses count since the last delivery */
		if (m == MRC_M_SKIP_ONCE) {
			if (ec)
				ec->ecn++;
			if (ev_skip(cid, slot, e, MRC_R_SACK_SKIP))
				ctr_inc(MRC_C_ING_FB_SKIP);
		}                       /* M=ALWAYS_SKIP: retired in sack_losses() */
	} else {
		__u8 why = h[2];

		/* the receiving engine sends each NACK twice, the copy (RTX) on the next
		 * plane: it counts once */
		if (ec && !(p->b8 & MRC_BTH_B8_RTX))
			ec->nack++;
		/* A trimmed send is accounted for: the SACK-bitmap hole it leaves until its
		 * retransmission lands is no untrimmed loss (sack_losses skips it). */
		if (why == MRC_NACK_TRIMMED || why == MRC_NACK_TRIMMED_LASTHOP)
			ape->flags |= MRC_PSNF_LOST;
		if (why == MRC_NACK_TRIMMED_LASTHOP)
			ctr_inc(MRC_C_ING_NACK_LASTHOP);
		if (why == MRC_NACK_TRIMMED) {
			if (ec && !(p->b8 & MRC_BTH_B8_RTX))
				ec->trim++;
			if (ev_skip(cid, slot, e, MRC_R_NACK_TRIM))
				ctr_inc(MRC_C_ING_FB_SKIP);
		}
	}
	return 0;
}

static __always_inline void count_rx_data(struct xdp_md *ctx, struct mrc_pkt *p)
{
	struct mrc_evidx_key key = {};
	struct mrc_rxev_ctr *rc, zero = {};
	struct mrc_conn *c;
	__u32 cid, k, *pidx;

	/* MRC_MAX_CONNS: data of no known connection */
	key.conn = conn_find(p->saddr, p->dqpn, MRC_DIR_RX, &cid, &c) ? MRC_MAX_CONNS : cid;
	if (key.conn != MRC_MAX_CONNS) {
		/* the plane this data came in on: our feedback goes back on it (spray) */
		k = ctx->ingress_ifindex;
		pidx = mrc_ifplane.lookup(&k);
		if (pidx && *pidx < MRC_MAX_PLANES && c->rx_plane != *pidx + 1)
			c->rx_plane = *pidx + 1;
	}
	key.ev = p->ev;
	rc = mrc_rxev.lookup(&key);
	if (!rc) {
		mrc_rxev.update(&key, &zero);
		rc = mrc_rxev.lookup(&key);
		if (!rc)
			return;
	}
	rc->pkts++;
	rc->bytes += p->pkt_len;
	if ((p->tc & 3) == 3) {
		rc->ce++;
		ctr_inc(MRC_C_ING_DATA_CE);
	}
}

/* Is the outer (SRv6) destination our SID on the plane this frame arrived on? */
static __always_inline int srv6_sid_ours(struct xdp_md *ctx)
{
	void *data = (void *)(long)ctx->data;
	void *data_end = (void *)(long)ctx->data_end;
	struct ipv6hdr *outer = data + MRC_ETH_LEN;
	struct mrc_plane *pl;
	__u32 k = ctx->ingress_ifindex, *pidx;

	pidx = mrc_ifplane.lookup(&k);
	if (!pidx)
		return 0;
	k = *pidx;
	pl = mrc_planes.lookup(&k);
	if (!pl || (void *)(outer + 1) > data_end)
		return 0;
	return addr_eq((__u8 *)&outer->daddr, pl->local_sid, 6);
}

int mrc_ingress(struct xdp_md *ctx)
{
	struct mrc_config *cfg = cfg_get();
	struct mrc_pkt p = {};
	void *data, *data_end;
	__u32 reason;
	int rc;

	if (!cfg)
		return XDP_PASS;
	ctr_inc(MRC_C_ING_RX);
	rc = mrc_parse(ctx, &p, cfg->udp_port, cfg->mode == MRC_MODE_SRV6, &reason);
	/* SRv6 transit (not our SID) is none of our business, whatever it carries: a
	 * malformed inner packet is only ours to drop behind our SID.  (rc first: testing
	 * p.outer first costs plain frames ~10 ns in the code clang emits.) */
	if (rc == MRC_P_BAD && p.outer && !srv6_sid_ours(ctx)) {
		ctr_inc(MRC_C_ING_NOT_OURS);
		return XDP_PASS;
	}
	rc = verdict(rc, reason, MRC_C_ING_NON_MRC);
	if (rc >= 0)
		return rc;
	if (p.outer && !srv6_sid_ours(ctx)) {
		ctr_inc(MRC_C_ING_NOT_OURS);
		return XDP_PASS;
	}
	/* Checked before decapsulation, so what is not ours leaves unchanged. */
	if (!addr_eq(p.daddr, cfg->local_addr, 16)) {
		ctr_inc(MRC_C_ING_NOT_OURS);
		return XDP_PASS;
	}
	if (p.outer) {
		rc = srv6_decap(ctx);
		if (rc < 0) {
			ctr_inc(MRC_C_BAD_SRV6);
			return XDP_DROP;
		}
		if (rc > 0) {
			ctr_inc(MRC_C_ING_CE_COPY);
			p.tc |= 3;
		}
		/* Now a plain frame: the same constant offsets as one that came plain, so
		 * the verifier walks what follows once, not once per kind of frame. */
		p.outer = 0;
		p.l3_off = MRC_ETH_LEN;
		p.udp_off = MRC_ETH_LEN + MRC_IPV6_LEN;
		p.pkt_len -= MRC_IPV6_LEN;
		ctr_inc(MRC_C_ING_DECAP);
	}

	if (mrc_is_data(p.opcode)) {
		ctr_inc(MRC_C_ING_DATA);
		count_rx_data(ctx, &p);
	} else if (p.opcode == MRC_OP_SACK) {
		__u8 *h = mrc_ext(ctx, &p, MRC_SETH_LEN);

		if (h && (h[1] & MRC_SETH_PR)) {     /* a probe answer: for the prober, not the engine */
			probe_result(ctx, &p, h);
			return XDP_DROP;
		}
		ctr_inc(MRC_C_ING_SACK);
		if (feedback(ctx, &p, cfg))
			return XDP_DROP;
	} else if (p.opcode == MRC_OP_NACK) {
		ctr_inc(MRC_C_ING_NACK);
		if (feedback(ctx, &p, cfg))
			return XDP_DROP;
	} else if (p.opcode == MRC_OP_ACK) {
		ctr_inc(MRC_C_ING_ACK);
	} else if (p.opcode == MRC_OP_PROBE_REQ) {
		struct mrc_conn *c;
		__u32 cid;

		ctr_inc(MRC_C_ING_PROBE);
		/* answered here, only to configured peers; never handed to the engine */
		if (conn_find(p.saddr, p.dqpn, MRC_DIR_RX, &cid, &c)) {
			ctr_inc(MRC_C_ING_PROBE_NOT_PEER);
			return XDP_DROP;
		}
		return probe_answer(ctx, &p, cfg, cid, c);
	} else {
		ctr_inc(MRC_C_ING_OTHER);
	}

	data = (void *)(long)ctx->data;
	data_end = (void *)(long)ctx->data_end;
	if (data + MRC_ETH_LEN > data_end)
		return XDP_DROP;
	__builtin_memcpy(data, cfg->app_mac, 6);
	__builtin_memcpy(data + 6, cfg->fab_mac, 6);
	ctr_inc(MRC_C_ING_TO_ENGINE);
	return mrc_ports.redirect_map(MRC_PORT_ENGINE, 0);
}

/* ------------------------------------------------------------------ engine side (mrc0) */

int mrc_to_engine(struct xdp_md *ctx)
{
	struct mrc_config *cfg = cfg_get();
	struct mrc_pkt p = {};
	__u32 reason, q = ctx->rx_queue_index;

	if (!cfg)
		return XDP_PASS;
	if (mrc_parse(ctx, &p, cfg->udp_port, 0, &reason) != MRC_P_OK)
		return XDP_PASS;
	ctr_inc(MRC_C_ENG_RX);
	if (mrc_xsks.lookup(&q)) {
		ctr_inc(MRC_C_ENG_XSK);
		return mrc_xsks.redirect_map(q, XDP_PASS);
	}
	ctr_inc(MRC_C_ENG_PASS);
	return XDP_PASS;
}

/* ------------------------------------------------------------------ user space EV changes */

/*
 * Operator deny/allow and the health daemon's writes: user space runs this program with
 * BPF_PROG_TEST_RUN, the frame being a struct mrc_evop.  It takes the connection's swap
 * lock (the one ev_replace takes), so a change never interleaves with a swap and lands in
 * the slot the EV is in at that moment; it emits the event like every datapath change.
 * Returns MRC_EVOP_*; slot and old_state come back in the frame.
 */
int mrc_evop(struct xdp_md *ctx)
{
	void *data = (void *)(long)ctx->data;
	void *data_end = (void *)(long)ctx->data_end;
	struct mrc_evop *op = data;
	struct mrc_evidx_key key = {};
	struct mrc_conn *c;
	struct mrc_ev *e = 0;
	__u32 cid, slot = 0, *slotp;
	int rc = MRC_EVOP_NO_EV;

	if ((void *)(op + 1) > data_end)
		return MRC_EVOP_BAD;
	cid = op->conn;
	if (cid >= MRC_MAX_CONNS || op->state == MRC_EV_UNUSED || op->state > MRC_EV_DENIED)
		return MRC_EVOP_BAD;
	c = mrc_conns.lookup(&cid);
	if (!c)
		return MRC_EVOP_BAD;
	if (__sync_val_compare_and_swap(&c->lock, 0, 1) != 0) {
		ctr_inc(MRC_C_EVOP_BUSY);
		return MRC_EVOP_BUSY;
	}
	key.conn = cid;
	key.ev = op->ev;
	slotp = mrc_evidx.lookup(&key);
	if (slotp) {
		slot = *slotp;
		e = ev_at(cid, slot);
	}
	if (e && e->ev == op->ev && e->state != MRC_EV_UNUSED) {
		op->slot = slot;
		op->old_state = e->state;
		e->losses = 0;
		ev_set(cid, slot, e, op->state, op->reason);
		ctr_inc(MRC_C_EVOP);
		/* retirements counted by why, as the datapath's own (ev_retire) */
		if ((op->old_state == MRC_EV_GOOD || op->old_state == MRC_EV_SKIP) &&
		    (op->state == MRC_EV_ASSUMED_BAD || op->state == MRC_EV_DENIED)) {
			if (op->reason == MRC_R_PROBE_FAIL)
				ctr_inc(MRC_C_RETIRE_PROBE);
			else if (op->reason == MRC_R_OPERATOR)
				ctr_inc(MRC_C_RETIRE_OPERATOR);
		}
		rc = MRC_EVOP_OK;
	}
	c->lock = 0;
	return rc;
}
