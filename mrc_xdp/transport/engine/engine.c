/* SPDX-License-Identifier: (GPL-2.0 OR BSD-2-Clause) */
/*
 * engine.c - the MRC transport engine: reliable multipath RDMA Write over AF_XDP.
 *
 * One endpoint: one AF_XDP socket (libxdp, program load inhibited: the datapath's
 * to_engine program redirects into its XSKMAP), one UMEM split into RX frames (always
 * on the fill ring or in the RX ring) and TX frames (a free stack, back through the
 * completion ring), and one progress thread.  The thread loops: RX batch (verify ICRC,
 * place data, SACK/NACK bookkeeping), completions, timers (delayed SACKs, RTO), TX
 * (retransmissions first, then new packets within the PSN window and the congestion
 * window), fill-ring refill; when there is nothing to do it first spins for a bounded,
 * adaptive time (opts.spin_us; watching the RX ring, new posts and its timers, no syscall:
 * a round trip's next frame is often microseconds away), then sleeps in ppoll() on the
 * socket and an eventfd, with the nearest timer as timeout (no spinning at 0 load: it
 * spins only after work).
 *
 * Wire format per docs/mrc-wire.md, constants from bpf/mrc_shared.h.
 *   data: Eth | IPv6 | UDP 4791 | BTH | METH | RETH | [ImmDt] | payload | pad | ICRC
 *     RETH on every packet: VA = where THIS packet's payload goes, R_Key, DMA length =
 *     length of the whole message (so any packet tells the receiver the message size).
 *     ImmDt only on the last packet of a Write-with-Immediate; AckReq on the last
 *     packet of every message.
 *   SACK: BTH(psn = cack) | SETH | CC_STATE; NACK: BTH | NETH.
 * ACK coalescing (receiver): at the end of each RX batch (<= 64 frames) a SACK for the
 * newest packet if ack_every data packets are unacknowledged, or a packet of the batch
 * left a hole, was a duplicate or carried AckReq; else ack_delay_us after the first
 * unacknowledged one.  CE-marked packets are SACKed the same way (ce_ack 1): the SACK
 * sets M=SKIP_ONCE, echoes the newest marked packet's EV and counts the marked packets
 * (SETH byte MRC_SETH_CE_OFF); ce_ack 2: a SACK of its own at once for each of them.
 * SACK bitmaps start at cack; when the newest packet is 64 or more beyond cack a second
 * SACK follows whose bitmap ends at it.
 * Loss (sender): RACK as in the datapath (bpf/mrc_datapath.c sack_losses): a PSN a SACK
 * reports missing at least loss_reorder below the newest PSN it acknowledges is lost if
 * its last transmission was sent before the packet that triggered the SACK; NACK TRIMMED: retransmit at once; RTO with exponential backoff, retry_limit
 * consecutive expiries without progress -> QP error.  Selective retransmission only.
 */
#define _GNU_SOURCE
#include <errno.h>
#include <fcntl.h>
#include <poll.h>
#include <pthread.h>
#include <signal.h>
#include <stdatomic.h>
#include <stddef.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/eventfd.h>
#include <sys/mman.h>
#include <sys/prctl.h>
#include <sys/socket.h>
#include <time.h>
#include <unistd.h>

#include <linux/types.h>
#include <linux/if_xdp.h>
#include <bpf/bpf.h>
#include <xdp/xsk.h>
#include <zlib.h>

#include "mrc_shared.h"
#include "engine.h"

/* AF_XDP multi-buffer (Linux 6.6+): Debian 12's linux/if_xdp.h predates both. */
#ifndef XDP_USE_SG
#define XDP_USE_SG    (1 << 4)   /* bind: the socket takes packets of several frames */
#endif
#ifndef XDP_MAX_TX_SKB_BUDGET
#define XDP_MAX_TX_SKB_BUDGET 9  /* setsockopt (Linux 6.17+): descriptors per send syscall */
#endif
#ifndef XDP_PKT_CONTD
#define XDP_PKT_CONTD (1 << 0)   /* xdp_desc.options: the packet goes on in the next descriptor */
#endif

#define PSN_MASK   0xFFFFFFu
#define PSN_HALF   0x800000u
#define RX_BATCH   64
#define TX_BUDGET  64          /* packets per QP per loop */
#define QP_HASH    1024
#define UDP_HLEN   8
#define HDR_DATA   (MRC_ETH_LEN + MRC_IPV6_LEN + UDP_HLEN + MRC_BTH_LEN + MRC_METH_LEN + MRC_RETH_LEN)
#define OFF_IP6    MRC_ETH_LEN
#define OFF_UDP    (OFF_IP6 + MRC_IPV6_LEN)
#define OFF_BTH    (OFF_UDP + UDP_HLEN)
#define OFF_EXT    (OFF_BTH + MRC_BTH_LEN)
#define ECT0       2
#define RX_MAX_SEGS RX_BATCH   /* frames of one received packet we can hold (a longer chain is dropped) */
#define RX_HDR_MIN 128         /* a multi-buffer packet's first frame holds at least this (every header) */

static inline uint32_t psn_sub(uint32_t a, uint32_t b) { return (a - b) & PSN_MASK; }

static inline uint64_t now_ns(void)
{
	struct timespec ts;

	clock_gettime(CLOCK_MONOTONIC, &ts);
	return (uint64_t)ts.tv_sec * 1000000000ull + ts.tv_nsec;
}

static inline uint16_t get16(const uint8_t *p) { return (uint16_t)(p[0] << 8 | p[1]); }
static inline uint32_t get24(const uint8_t *p) { return (uint32_t)p[0] << 16 | p[1] << 8 | p[2]; }
static inline uint32_t get32(const uint8_t *p) { return (uint32_t)p[0] << 24 | (uint32_t)p[1] << 16 | p[2] << 8 | p[3]; }
static inline uint64_t get64(const uint8_t *p) { return (uint64_t)get32(p) << 32 | get32(p + 4); }
static inline void put16(uint8_t *p, uint16_t v) { p[0] = v >> 8; p[1] = v; }
static inline void put24(uint8_t *p, uint32_t v) { p[0] = v >> 16; p[1] = v >> 8; p[2] = v; }
static inline void put32(uint8_t *p, uint32_t v) { p[0] = v >> 24; p[1] = v >> 16; p[2] = v >> 8; p[3] = v; }
static inline void put64(uint8_t *p, uint64_t v) { put32(p, v >> 32); put32(p + 4, (uint32_t)v); }

/* ------------------------------------------------------------------ ICRC */

/* CRC-32 as zlib's crc32() computes it.  On x86 with PCLMULQDQ the bulk (multiples of
 * 16 bytes, at least 64) is folded with carry-less multiplies (the folding method of
 * Intel's "Fast CRC Computation Using PCLMULQDQ", as Chromium's zlib does), the rest
 * goes through zlib.  mrc_eng_open checks it against zlib on random data first and
 * uses zlib alone if they ever differ (or the CPU lacks the instructions). */
static int crc_fast_ok;

#if defined(__x86_64__)
#include <immintrin.h>

__attribute__((target("pclmul,sse4.1")))
static uint32_t crc32_fold(const uint8_t *buf, size_t len, uint32_t crc)
{
	static const uint64_t __attribute__((aligned(16))) k1k2[] = { 0x0154442bd4, 0x01c6e41596 };
	static const uint64_t __attribute__((aligned(16))) k3k4[] = { 0x01751997d0, 0x00ccaa009e };
	static const uint64_t __attribute__((aligned(16))) k5k0[] = { 0x0163cd6124, 0x0000000000 };
	static const uint64_t __attribute__((aligned(16))) poly[] = { 0x01db710641, 0x01f7011641 };
	__m128i x0, x1, x2, x3, x4, x5, x6, x7, x8, y5, y6, y7, y8;

	x1 = _mm_loadu_si128((const __m128i *)(buf + 0x00));
	x2 = _mm_loadu_si128((const __m128i *)(buf + 0x10));
	x3 = _mm_loadu_si128((const __m128i *)(buf + 0x20));
	x4 = _mm_loadu_si128((const __m128i *)(buf + 0x30));
	x1 = _mm_xor_si128(x1, _mm_cvtsi32_si128((int)crc));
	x0 = _mm_load_si128((const __m128i *)k1k2);
	buf += 64;
	len -= 64;
	while (len >= 64) {
		x5 = _mm_clmulepi64_si128(x1, x0, 0x00);
		x6 = _mm_clmulepi64_si128(x2, x0, 0x00);
		x7 = _mm_clmulepi64_si128(x3, x0, 0x00);
		x8 = _mm_clmulepi64_si128(x4, x0, 0x00);
		x1 = _mm_clmulepi64_si128(x1, x0, 0x11);
		x2 = _mm_clmulepi64_si128(x2, x0, 0x11);
		x3 = _mm_clmulepi64_si128(x3, x0, 0x11);
		x4 = _mm_clmulepi64_si128(x4, x0, 0x11);
		y5 = _mm_loadu_si128((const __m128i *)(buf + 0x00));
		y6 = _mm_loadu_si128((const __m128i *)(buf + 0x10));
		y7 = _mm_loadu_si128((const __m128i *)(buf + 0x20));
		y8 = _mm_loadu_si128((const __m128i *)(buf + 0x30));
		x1 = _mm_xor_si128(_mm_xor_si128(x1, x5), y5);
		x2 = _mm_xor_si128(_mm_xor_si128(x2, x6), y6);
		x3 = _mm_xor_si128(_mm_xor_si128(x3, x7), y7);
		x4 = _mm_xor_si128(_mm_xor_si128(x4, x8), y8);
		buf += 64;
		len -= 64;
	}
	x0 = _mm_load_si128((const __m128i *)k3k4);
	x5 = _mm_clmulepi64_si128(x1, x0, 0x00);
	x1 = _mm_clmulepi64_si128(x1, x0, 0x11);
	x1 = _mm_xor_si128(_mm_xor_si128(x1, x2), x5);
	x5 = _mm_clmulepi64_si128(x1, x0, 0x00);
	x1 = _mm_clmulepi64_si128(x1, x0, 0x11);
	x1 = _mm_xor_si128(_mm_xor_si128(x1, x3), x5);
	x5 = _mm_clmulepi64_si128(x1, x0, 0x00);
	x1 = _mm_clmulepi64_si128(x1, x0, 0x11);
	x1 = _mm_xor_si128(_mm_xor_si128(x1, x4), x5);
	while (len >= 16) {
		x2 = _mm_loadu_si128((const __m128i *)buf);
		x5 = _mm_clmulepi64_si128(x1, x0, 0x00);
		x1 = _mm_clmulepi64_si128(x1, x0, 0x11);
		x1 = _mm_xor_si128(_mm_xor_si128(x1, x2), x5);
		buf += 16;
		len -= 16;
	}
	x2 = _mm_clmulepi64_si128(x1, x0, 0x10);
	x3 = _mm_setr_epi32(~0, 0, ~0, 0);
	x1 = _mm_srli_si128(x1, 8);
	x1 = _mm_xor_si128(x1, x2);
	x0 = _mm_loadl_epi64((const __m128i *)k5k0);
	x2 = _mm_srli_si128(x1, 4);
	x1 = _mm_and_si128(x1, x3);
	x1 = _mm_clmulepi64_si128(x1, x0, 0x00);
	x1 = _mm_xor_si128(x1, x2);
	x0 = _mm_load_si128((const __m128i *)poly);
	x2 = _mm_and_si128(x1, x3);
	x2 = _mm_clmulepi64_si128(x2, x0, 0x10);
	x2 = _mm_and_si128(x2, x3);
	x2 = _mm_clmulepi64_si128(x2, x0, 0x00);
	x1 = _mm_xor_si128(x1, x2);
	return (uint32_t)_mm_extract_epi32(x1, 1);
}
#endif

static uLong crc32_any(uLong crc, const uint8_t *buf, size_t len, int fast)
{
#if defined(__x86_64__)
	if (fast && len >= 64) {
		size_t chunk = len & ~(size_t)15;

		crc = ~crc32_fold(buf, chunk, ~(uint32_t)crc) & 0xFFFFFFFFul;
		buf += chunk;
		len -= chunk;
		if (!len)
			return crc;
	}
#endif
	return crc32_z(crc, buf, len);
}

static void crc_fast_check(void)
{
#if defined(__x86_64__)
	static uint8_t buf[4096 + 64];
	uint32_t i, n;

	if (!__builtin_cpu_supports("pclmul") || !__builtin_cpu_supports("sse4.1"))
		return;
	for (i = 0; i < sizeof(buf); i++)
		buf[i] = (uint8_t)(random() >> 7);
	for (n = 0; n <= 4096 + 33; n += 7)
		if (crc32_any(0x12345678ul * (n & 1), buf + (n & 7), n, 1) !=
		    crc32_z(0x12345678ul * (n & 1), buf + (n & 7), n))
			return;
	crc_fast_ok = 1;
#endif
}

/* As mrc_xdp/wire.py icrc(): CRC-32 over 8 bytes of 0xFF (masked LRH), then the IPv6
 * packet with traffic class, flow label and hop limit all ones, UDP checksum 0xFFFF,
 * BTH byte 4 0xFF; ip6 excludes the trailer. */
static uLong crc_lrh;

#define ICRC_HDR (MRC_IPV6_LEN + UDP_HLEN + MRC_BTH_LEN)   /* the masked part: IPv6, UDP, BTH */

/* The CRC after the masked LRH and the masked IPv6, UDP and BTH headers (ICRC_HDR bytes at ip6). */
static uLong icrc_hdr(const uint8_t *ip6)
{
	static const uint8_t lrh[8] = { 0xff, 0xff, 0xff, 0xff, 0xff, 0xff, 0xff, 0xff };
	uint8_t hdr[ICRC_HDR];

	memcpy(hdr, ip6, sizeof(hdr));
	hdr[0] |= 0x0F;
	hdr[1] = hdr[2] = hdr[3] = 0xFF;
	hdr[7] = 0xFF;
	hdr[MRC_IPV6_LEN + 6] = hdr[MRC_IPV6_LEN + 7] = 0xFF;
	hdr[MRC_IPV6_LEN + UDP_HLEN + 4] = 0xFF;
	if (!crc_lrh)
		crc_lrh = crc32(0L, lrh, sizeof(lrh));  /* a constant: once */
	return crc32(crc_lrh, hdr, sizeof(hdr));
}

static uint32_t icrc_calc(const uint8_t *ip6, uint32_t len, int fast)
{
	uLong crc;

	if (len < ICRC_HDR)
		return 0;
	crc = icrc_hdr(ip6);
	crc = crc32_any(crc, ip6 + ICRC_HDR, len - ICRC_HDR, fast);
	return (uint32_t)crc;
}

/* The same over a packet held in several frames (multi-buffer): nseg pieces seg[i] of
 * slen[i] bytes, the IPv6 header at offset off of the packet, len bytes (the trailer
 * excluded).  The first piece holds at least off + ICRC_HDR bytes (callers check). */
static uint32_t icrc_iov(uint8_t *const *seg, const uint32_t *slen, uint32_t nseg, uint32_t off,
			 uint32_t len, int fast)
{
	uLong crc;
	uint32_t i, k;

	if (len < ICRC_HDR || !nseg || slen[0] < off + ICRC_HDR)
		return 0;
	crc = icrc_hdr(seg[0] + off);
	off += ICRC_HDR;
	len -= ICRC_HDR;
	for (i = 0; i < nseg && len; i++) {
		if (off >= slen[i]) {
			off -= slen[i];
			continue;
		}
		k = slen[i] - off < len ? slen[i] - off : len;
		crc = crc32_any(crc, seg[i] + off, k, fast);
		len -= k;
		off = 0;
	}
	return (uint32_t)crc;
}

uint32_t mrc_eng_icrc(const uint8_t *ip6, uint32_t len)
{
	return icrc_calc(ip6, len, crc_fast_ok);
}

uint32_t mrc_eng_icrc2(const uint8_t *ip6, uint32_t len, int fast)
{
#if defined(__x86_64__)
	if (fast && !(__builtin_cpu_supports("pclmul") && __builtin_cpu_supports("sse4.1")))
		fast = 0;
#else
	fast = 0;
#endif
	return icrc_calc(ip6, len, fast);
}

static inline void put_icrc(uint8_t *p, uint32_t v)
{
#if MRC_ICRC_LITTLE_ENDIAN
	p[0] = v; p[1] = v >> 8; p[2] = v >> 16; p[3] = v >> 24;
#else
	put32(p, v);
#endif
}

static inline uint32_t get_icrc(const uint8_t *p)
{
#if MRC_ICRC_LITTLE_ENDIAN
	return (uint32_t)p[0] | p[1] << 8 | p[2] << 16 | (uint32_t)p[3] << 24;
#else
	return get32(p);
#endif
}

/* ------------------------------------------------------------------ state */

struct mr {
	uint64_t addr, len;
	uint32_t rkey, access;
	int used;
};

struct wr {
	struct wr *next;
	uint64_t wr_id;
	uint64_t laddr, len, raddr;
	uint32_t rkey, imm;
	int with_imm;
	uint16_t msn;
	uint32_t first_psn;      /* valid once packetising started */
	uint32_t npkts;
	uint32_t acked;          /* packets acknowledged */
	int started;
};

struct txp {                 /* one sent PSN (slot psn & (win - 1)) */
	struct wr *wr;
	uint64_t off;            /* offset of its payload in the WR */
	uint64_t tx_ns;
	uint64_t txseq;          /* the QP's send order of the last transmission */
	uint32_t psn, len;
	uint8_t state, nsent, queued, last;   /* state: enum mrc_txp_state (engine.h) */
	uint8_t rto;             /* resent by the RTO: 1 (AckReq), 2 (its probe of a repeated
	                          * expiry: AckReq, and sent twice) */
};

struct rmsg {                /* receiver: one message by MSN */
	uint64_t dlen, got;
	uint32_t imm;
	uint16_t msn;
	uint8_t valid, has_imm, has_last;
};

struct qp {
	struct qp *hnext, *next, *prev;
	uint32_t qpn, rqpn, state, win, mask, payload;
	uint8_t peer[16];
	/* sender */
	uint32_t snd_next, snd_una;
	struct wr *wr_head, *wr_tail, *wr_cur;   /* wr_cur: next to packetise */
	uint64_t cur_off;
	uint16_t msn_next;
	struct txp *tx;
	uint32_t *rtxq;
	uint32_t rtx_head, rtx_tail;             /* ring of PSNs to retransmit */
	uint64_t txseq;
	uint64_t cwnd, inflight;
	uint64_t srtt, rttvar, min_rtt, rto, last_md_ns, rto_deadline;
	uint64_t cc_acked, cc_ecn, cc_win_end;   /* this RTT's acked bytes, those in CE-echoing SACKs */
	uint32_t cc_alpha;                       /* EWMA of the ECN fraction, /1024 (DCTCP's alpha) */
	uint64_t pace_ns;                        /* pacing: the next packet leaves no earlier */
	uint32_t retries, peer_mpr;
	uint64_t fb_ns;                          /* the peer's last feedback in the window (SACK/NACK) */
	uint64_t rack_seq;                       /* the latest-sent transmission (txseq) the peer SACKed */
	/* the time-based loss rule (timestamps=1): see reo_window() */
	uint64_t reo_spread, reo_wnd;
	/* receiver */
	uint32_t rcv_cack, rcv_ooo;
	uint64_t *rcv_bm;                        /* win bits, by psn & mask */
	struct rmsg *msgs;                       /* win entries, by msn & mask */
	uint16_t rmsn_next;
	uint32_t ack_pending, ack_psn, ack_ev, ack_ts;   /* ack_ts: TSETH tx_ts + 1 (0: none) */
	uint32_t ack_ce, ack_ce_ev;              /* CE-marked packets since the last SACK, the newest one's EV */
	uint64_t ack_deadline, rcvd_bytes;
	int ack_now, ack_dup;
	struct mrc_qp_stats st;
};

/* The packet rx_frame is reading: its frames in order (one unless multi-buffer). */
struct rxpkt {
	uint32_t n, total;
	uint8_t *seg[RX_MAX_SEGS];
	uint32_t len[RX_MAX_SEGS];
};

struct mrc_eng {
	struct mrc_eng_opts o;
	pthread_mutex_t mu;          /* QPs, MRs, WRs: everything but the CQ */
	pthread_mutex_t cq_mu;
	pthread_t thr;
	int thr_started;
	atomic_int stop;
	int wake_fd, cq_fd, xsk_fd;
	/* AF_XDP */
	void *area;
	uint64_t area_len;
	struct xsk_umem *umem;
	struct xsk_socket *xsk;
	struct xsk_ring_prod fill, tx;
	struct xsk_ring_cons comp, rx;
	uint64_t *tx_free;
	uint32_t n_tx_free, n_tx_frames, n_rx_frames;
	uint32_t tx_pending;         /* descriptors submitted, not yet kicked */
	/* multi-buffer (XDP_USE_SG): a packet spans frames chained by XDP_PKT_CONTD */
	int sg;                      /* bound with XDP_USE_SG */
	uint32_t rx_cap;             /* bytes one RX frame holds (frame_size - XDP_PACKET_HEADROOM) */
	uint32_t tx_fpp;             /* TX frames a full data packet takes */
	uint64_t mr_off, mr_len;     /* the memory-region space: UMEM offsets [mr_off, +mr_len) */
	int mr_given;                /* ... handed to the caller (mrc_eng_umem_mr): not unmapped here */
	struct rxpkt rxp;            /* the packet being received */
	int rx_skip;                 /* dropping the rest of a chain too long to hold */
	/* QPs, MRs */
	struct qp *qph[QP_HASH];
	struct qp *qps;              /* all QPs, a list */
	struct qp *tx_next;          /* round-robin: the QP the next TX round starts with (the
	                              * first one the last round left waiting for TX frames) */
	uint32_t nqps, next_qpn;
	struct mr *mrs;
	uint32_t nmrs, cap_mrs;
	/* CQ */
	struct mrc_eng_wc *cq;
	uint32_t cq_head, cq_len, cq_cap;
	int cq_fd_set;               /* the eventfd holds a count (under cq_mu) */
	atomic_uint cq_pending;      /* cq_len, readable without cq_mu (a spinning caller) */
	atomic_int cq_spinners;      /* callers spinning in mrc_eng_cq_wait: no eventfd write */
	atomic_uint cq_skip, cq_skip_left;   /* callers' spins to skip after empty ones */
	atomic_ulong caller_skipped;
	/* spin (progress()) */
	atomic_uint posts;           /* posts and callers' progress rounds: the thread sees
	                              * work done or queued outside it */
	_Atomic uint64_t sleep_until; /* 0: the thread is awake; else it is in (or about to
	                              * enter) ppoll until then (UINT64_MAX: no timeout) */
	uint64_t active_ns;          /* the thread's last work (its own clock) */
	atomic_ulong post_wakeups;   /* stats.post_wakeups (written outside mu) */
	atomic_ulong caller_wakeups; /* stats.caller_wakeups (likewise) */
	atomic_ulong caller_preempted;
	uint64_t spin_max_ns, spin_cur_ns, spin_hold_until;
	struct mrc_eng_stats st;
};

/* ------------------------------------------------------------------ completions */

static void cq_push(struct mrc_eng *e, uint64_t wr_id, uint32_t qpn, uint32_t status,
		    uint32_t opcode, uint32_t byte_len, int has_imm, uint32_t imm)
{
	struct mrc_eng_wc *w;
	uint64_t one = 1;

	pthread_mutex_lock(&e->cq_mu);
	if (e->cq_len == e->cq_cap) {
		uint32_t cap = e->cq_cap ? e->cq_cap * 2 : 1024, i;
		struct mrc_eng_wc *n = malloc(sizeof(*n) * cap);

		if (!n) {
			pthread_mutex_unlock(&e->cq_mu);
			return;
		}
		for (i = 0; i < e->cq_len; i++)
			n[i] = e->cq[(e->cq_head + i) % e->cq_cap];
		free(e->cq);
		e->cq = n;
		e->cq_head = 0;
		e->cq_cap = cap;
	}
	w = &e->cq[(e->cq_head + e->cq_len) % e->cq_cap];
	w->wr_id = wr_id;
	w->qpn = qpn;
	w->status = status;
	w->opcode = opcode;
	w->byte_len = byte_len;
	w->imm = imm;
	w->has_imm = has_imm;
	atomic_store(&e->cq_pending, ++e->cq_len);
	/* the eventfd is readable while completions are pending, except while a caller spins
	 * in mrc_eng_cq_wait: it sees cq_pending, and the write (a syscall, and a wake-up of
	 * whatever sleeps on the eventfd) is left to mrc_eng_poll should completions remain */
	if (!e->cq_fd_set && !atomic_load(&e->cq_spinners)) {
		(void)!write(e->cq_fd, &one, sizeof(one));
		e->cq_fd_set = 1;
	}
	pthread_mutex_unlock(&e->cq_mu);
}

int mrc_eng_poll(struct mrc_eng *e, struct mrc_eng_wc *wc, int max)
{
	uint64_t v, one = 1;
	int n = 0;

	pthread_mutex_lock(&e->cq_mu);
	while (n < max && e->cq_len) {
		wc[n++] = e->cq[e->cq_head];
		e->cq_head = (e->cq_head + 1) % e->cq_cap;
		e->cq_len--;
	}
	atomic_store(&e->cq_pending, e->cq_len);
	if (!e->cq_len && e->cq_fd_set) {
		(void)!read(e->cq_fd, &v, sizeof(v));   /* nonblocking: drain */
		e->cq_fd_set = 0;
	} else if (e->cq_len && !e->cq_fd_set) {    /* pushed while a caller spun */
		(void)!write(e->cq_fd, &one, sizeof(one));
		e->cq_fd_set = 1;
	}
	pthread_mutex_unlock(&e->cq_mu);
	return n;
}

static inline void cpu_relax(void)
{
#if defined(__x86_64__) || defined(__i386__)
	__builtin_ia32_pause();
#elif defined(__aarch64__)
	__asm__ __volatile__("yield");
#endif
}

int mrc_eng_cq_fd(struct mrc_eng *e) { return e->cq_fd; }

/* ------------------------------------------------------------------ MRs */

static struct mr *mr_find(struct mrc_eng *e, uint32_t rkey)
{
	uint32_t slot = (rkey >> 8) - 1;

	if ((rkey >> 8) == 0 || slot >= e->nmrs || !e->mrs[slot].used || e->mrs[slot].rkey != rkey)
		return NULL;
	return &e->mrs[slot];
}

int mrc_eng_reg_mr(struct mrc_eng *e, uint64_t addr, uint64_t len, uint32_t access, uint32_t *rkey)
{
	uint32_t i;
	struct mr *m;

	pthread_mutex_lock(&e->mu);
	for (i = 0; i < e->nmrs; i++)
		if (!e->mrs[i].used)
			break;
	if (i == e->nmrs) {
		if (e->nmrs == e->cap_mrs) {
			uint32_t cap = e->cap_mrs ? e->cap_mrs * 2 : 64;
			struct mr *n;

			if (cap > (1u << 24)) {
				pthread_mutex_unlock(&e->mu);
				return -ENOSPC;
			}
			n = realloc(e->mrs, sizeof(*n) * cap);
			if (!n) {
				pthread_mutex_unlock(&e->mu);
				return -ENOMEM;
			}
			e->mrs = n;
			e->cap_mrs = cap;
		}
		e->nmrs++;
	}
	m = &e->mrs[i];
	m->addr = addr;
	m->len = len;
	m->access = access;
	m->rkey = (i + 1) << 8 | ((uint32_t)random() & 0xFF);
	m->used = 1;
	*rkey = m->rkey;
	pthread_mutex_unlock(&e->mu);
	return 0;
}

int mrc_eng_dereg_mr(struct mrc_eng *e, uint32_t rkey)
{
	struct mr *m;
	int rc = -ENOENT;

	pthread_mutex_lock(&e->mu);
	m = mr_find(e, rkey);
	if (m) {
		m->used = 0;
		rc = 0;
	}
	pthread_mutex_unlock(&e->mu);
	return rc;
}

/* ------------------------------------------------------------------ QPs */

static struct qp *qp_find(struct mrc_eng *e, uint32_t qpn)
{
	struct qp *q;

	for (q = e->qph[qpn % QP_HASH]; q; q = q->hnext)
		if (q->qpn == qpn)
			return q;
	return NULL;
}

static void qp_flush(struct mrc_eng *e, struct qp *q, uint32_t first_status)
{
	struct wr *w = q->wr_head, *n;
	uint32_t status = first_status;

	while (w) {
		n = w->next;
		cq_push(e, w->wr_id, q->qpn, status, MRC_WC_RDMA_WRITE, (uint32_t)w->len, 0, 0);
		q->st.wr_error++;
		status = MRC_WC_WR_FLUSH_ERR;
		free(w);
		w = n;
	}
	q->wr_head = q->wr_tail = q->wr_cur = NULL;
	memset(q->tx, 0, sizeof(*q->tx) * q->win);
	q->rtx_head = q->rtx_tail = 0;
	q->inflight = 0;
	q->snd_una = q->snd_next;
}

static void qp_error(struct mrc_eng *e, struct qp *q, uint32_t status)
{
	if (q->state == MRC_QPS_ERR)
		return;
	q->state = MRC_QPS_ERR;
	qp_flush(e, q, status);
	q->ack_pending = 0;
}

static void qp_free(struct qp *q)
{
	free(q->tx);
	free(q->rtxq);
	free(q->rcv_bm);
	free(q->msgs);
	free(q);
}

int mrc_eng_qp_create(struct mrc_eng *e, uint32_t qpn, uint32_t start_psn, uint32_t *qpn_out)
{
	struct qp *q;
	uint32_t tries;

	if (qpn > PSN_MASK || qpn == MRC_QPN_PROBE)
		return -EINVAL;
	q = calloc(1, sizeof(*q));
	if (!q)
		return -ENOMEM;
	q->win = e->o.window;
	q->mask = q->win - 1;
	q->tx = calloc(q->win, sizeof(*q->tx));
	q->rtxq = calloc(2 * q->win, sizeof(*q->rtxq));   /* PSNs to resend (stale ones skipped) */
	q->rcv_bm = calloc(q->win / 64, sizeof(uint64_t));
	q->msgs = calloc(q->win, sizeof(*q->msgs));
	if (!q->tx || !q->rtxq || !q->rcv_bm || !q->msgs) {
		qp_free(q);
		return -ENOMEM;
	}
	pthread_mutex_lock(&e->mu);
	if (!qpn) {
		for (tries = 0; tries < PSN_MASK; tries++) {
			qpn = e->next_qpn++;
			if (e->next_qpn > PSN_MASK)
				e->next_qpn = 0x1000;
			if (qpn >= 0x1000 && !qp_find(e, qpn))
				break;
		}
	} else if (qp_find(e, qpn)) {
		pthread_mutex_unlock(&e->mu);
		qp_free(q);
		return -EEXIST;
	}
	q->qpn = qpn;
	q->state = MRC_QPS_INIT;
	q->snd_next = q->snd_una = start_psn & PSN_MASK;
	q->payload = e->o.payload;
	q->cwnd = e->o.cc_init_cwnd;
	q->rto = (uint64_t)e->o.rto_min_us * 1000;
	q->peer_mpr = q->win;
	q->hnext = e->qph[qpn % QP_HASH];
	e->qph[qpn % QP_HASH] = q;
	q->next = e->qps;
	if (e->qps)
		e->qps->prev = q;
	e->qps = q;
	e->nqps++;
	pthread_mutex_unlock(&e->mu);
	*qpn_out = qpn;
	return 0;
}

int mrc_eng_qp_connect(struct mrc_eng *e, uint32_t qpn, const uint8_t *peer, uint32_t rqpn,
		       uint32_t rpsn, uint32_t payload)
{
	struct qp *q;
	int rc = 0;

	if (!rqpn || rqpn > PSN_MASK || !payload || payload % 4 || payload > e->o.payload)
		return -EINVAL;
	pthread_mutex_lock(&e->mu);
	q = qp_find(e, qpn);
	if (!q)
		rc = -ENOENT;
	else if (q->state != MRC_QPS_INIT)
		rc = -EISCONN;
	else {
		memcpy(q->peer, peer, 16);
		q->rqpn = rqpn;
		q->rcv_cack = rpsn & PSN_MASK;
		q->payload = payload;
		q->state = MRC_QPS_RTS;
	}
	pthread_mutex_unlock(&e->mu);
	return rc;
}

int mrc_eng_qp_destroy(struct mrc_eng *e, uint32_t qpn)
{
	struct qp *q, **pp;

	pthread_mutex_lock(&e->mu);
	for (pp = &e->qph[qpn % QP_HASH]; *pp; pp = &(*pp)->hnext)
		if ((*pp)->qpn == qpn)
			break;
	q = *pp;
	if (!q) {
		pthread_mutex_unlock(&e->mu);
		return -ENOENT;
	}
	*pp = q->hnext;
	if (e->tx_next == q)
		e->tx_next = NULL;
	if (q->prev)
		q->prev->next = q->next;
	else
		e->qps = q->next;
	if (q->next)
		q->next->prev = q->prev;
	e->nqps--;
	qp_flush(e, q, MRC_WC_WR_FLUSH_ERR);
	pthread_mutex_unlock(&e->mu);
	qp_free(q);
	return 0;
}

static void fill_qp_stats(struct qp *q, struct mrc_qp_stats *s)
{
	*s = q->st;
	s->state = q->state;
	s->srtt_ns = q->srtt;
	s->rttvar_ns = q->rttvar;
	s->min_rtt_ns = q->min_rtt;
	s->reo_wnd_ns = q->reo_wnd;
	{
		const struct txp *u = &q->tx[q->snd_una & q->mask];
		uint64_t now = now_ns();

		if (q->snd_una != q->snd_next && u->psn == q->snd_una)
			s->una_state = u->state + MRC_TXP_QUEUED * u->queued;
		s->pace_wait_ns = q->pace_ns > now ? q->pace_ns - now : 0;
	}
	s->rtx_queued = q->rtx_tail - q->rtx_head;
	s->rto_ns = q->rto;
	s->cwnd = q->cwnd;
	s->inflight = q->inflight;
	s->next_psn = q->snd_next;
	s->una_psn = q->snd_una;
	s->rcv_cack = q->rcv_cack;
	s->peer_mpr = q->peer_mpr;
	s->retries = q->retries;
}

int mrc_eng_qp_stats(struct mrc_eng *e, uint32_t qpn, struct mrc_qp_stats *out)
{
	struct qp *q;
	int rc = 0;

	pthread_mutex_lock(&e->mu);
	q = qp_find(e, qpn);
	if (q)
		fill_qp_stats(q, out);
	else
		rc = -ENOENT;
	pthread_mutex_unlock(&e->mu);
	return rc;
}

void mrc_eng_stats(struct mrc_eng *e, struct mrc_eng_stats *out)
{
	pthread_mutex_lock(&e->mu);
	*out = e->st;
	out->qps = e->nqps;
	out->umem_free = e->n_tx_free;
	out->spin_limit_ns = e->spin_cur_ns;
	out->post_wakeups = atomic_load_explicit(&e->post_wakeups, memory_order_relaxed);
	out->caller_wakeups = atomic_load_explicit(&e->caller_wakeups, memory_order_relaxed);
	out->caller_preempted = atomic_load_explicit(&e->caller_preempted, memory_order_relaxed);
	out->caller_skipped = atomic_load_explicit(&e->caller_skipped, memory_order_relaxed);
	pthread_mutex_unlock(&e->mu);
	{
		struct xdp_statistics xs;
		socklen_t len = sizeof(xs);

		memset(&xs, 0, sizeof(xs));
		if (e->xsk_fd >= 0 && !getsockopt(e->xsk_fd, SOL_XDP, XDP_STATISTICS, &xs, &len)) {
			out->xsk_rx_dropped = xs.rx_dropped;
			out->xsk_tx_invalid = xs.tx_invalid_descs;
			out->xsk_rx_ring_full = len >= offsetof(struct xdp_statistics, rx_ring_full) + 8 ? xs.rx_ring_full : 0;
			out->xsk_fill_empty = len >= offsetof(struct xdp_statistics, rx_fill_ring_empty_descs) + 8 ?
					      xs.rx_fill_ring_empty_descs : 0;
		}
	}
}

void mrc_eng_get_opts(struct mrc_eng *e, struct mrc_eng_opts *out) { *out = e->o; }

void mrc_eng_umem_mr(struct mrc_eng *e, uint64_t *addr, uint64_t *len)
{
	*addr = e->mr_len ? (uint64_t)(uintptr_t)e->area + e->mr_off : 0;
	*len = e->mr_len;
	e->mr_given = e->mr_len != 0;
}

static int qp_tx(struct mrc_eng *e, struct qp *q, uint64_t now);
static void tx_kick(struct mrc_eng *e);
static void tx_complete(struct mrc_eng *e);

int mrc_eng_post_write(struct mrc_eng *e, uint32_t qpn, uint64_t wr_id, uint64_t laddr,
		       uint32_t lkey, uint64_t len, uint64_t raddr, uint32_t rkey,
		       int with_imm, uint32_t imm)
{
	struct qp *q;
	struct mr *m;
	struct wr *w;
	uint64_t one = 1, now, deadline, su;
	int rc = 0, more;

	if (len > 0xFFFFFFFFull)
		return -EMSGSIZE;          /* RETH DMA length is 32 bits */
	w = calloc(1, sizeof(*w));
	if (!w)
		return -ENOMEM;
	pthread_mutex_lock(&e->mu);
	q = qp_find(e, qpn);
	m = mr_find(e, lkey);
	if (!q)
		rc = -ENOENT;
	else if (q->state != MRC_QPS_RTS)
		rc = q->state == MRC_QPS_ERR ? -EPIPE : -ENOTCONN;
	else if (!m || !(m->access & MRC_ENG_ACCESS_LOCAL) || laddr < m->addr ||
		 laddr + len > m->addr + m->len)
		rc = -EFAULT;
	if (rc) {
		pthread_mutex_unlock(&e->mu);
		free(w);
		return rc;
	}
	w->wr_id = wr_id;
	w->laddr = laddr;
	w->len = len;
	w->raddr = raddr;
	w->rkey = rkey;
	w->with_imm = with_imm;
	w->imm = imm;
	w->msn = q->msn_next++;
	w->npkts = len ? (uint32_t)((len + q->payload - 1) / q->payload) : 1;
	if (q->wr_tail)
		q->wr_tail->next = w;
	else
		q->wr_head = w;
	q->wr_tail = w;
	if (!q->wr_cur) {
		q->wr_cur = w;
		q->cur_off = 0;
	}
	q->st.wr_posted++;
	/* transmit what the window allows now, in the caller's thread: the packet leaves
	 * without waiting for the progress thread to wake (one scheduling delay less on the
	 * latency path); the thread is woken, off that path, to arm the RTO and send the
	 * rest (with spin, only when it must be: below) */
	now = now_ns();
	tx_complete(e);
	qp_tx(e, q, now);
	tx_kick(e);
	if (e->spin_max_ns && q->snd_una != q->snd_next) {
		/* arm the RTO here, as qp_timers would: a thread asleep until before it need
		 * not be woken for it */
		if (!q->fb_ns)
			q->fb_ns = now;
		if (!q->rto_deadline)
			q->rto_deadline = now + q->rto;
	}
	more = q->wr_cur || q->rtx_head != q->rtx_tail;
	deadline = q->rto_deadline ? q->rto_deadline : UINT64_MAX;
	pthread_mutex_unlock(&e->mu);
	/* With spin the thread is woken only when it must be: it sleeps (sleep_until != 0)
	 * and this post left packets it must send, or armed an RTO before its wake-up (a
	 * thread that had work in the last 100 ms sleeps at most rto_min_us at a time, so a
	 * ping-pong's posts wake nobody).  An awake thread sees the new post count: it stores
	 * sleep_until, then reads posts once more before ppoll, and this side adds to posts,
	 * then reads sleep_until, so one of the two sees the other's store.  Without spin the
	 * eventfd is written every time, as it always was. */
	atomic_fetch_add(&e->posts, 1);
	su = e->spin_max_ns ? atomic_load(&e->sleep_until) : 1;
	if (!e->spin_max_ns || (su && (more || deadline < su))) {
		(void)!write(e->wake_fd, &one, sizeof(one));
		atomic_fetch_add_explicit(&e->post_wakeups, 1, memory_order_relaxed);
	}
	return 0;
}

/* ------------------------------------------------------------------ TX frames */

static uint8_t *tx_frame(struct mrc_eng *e, uint64_t *addr)
{
	if (!e->n_tx_free)
		return NULL;
	*addr = e->tx_free[--e->n_tx_free];
	return (uint8_t *)e->area + *addr;
}

/* Queue a built frame on the TX ring; on a full ring the frame goes back (-1). */
static int tx_submit(struct mrc_eng *e, uint64_t addr, uint32_t len)
{
	uint32_t idx;
	struct xdp_desc *d;

	if (xsk_ring_prod__reserve(&e->tx, 1, &idx) != 1) {
		e->tx_free[e->n_tx_free++] = addr;
		e->st.tx_ring_full++;
		return -1;
	}
	d = xsk_ring_prod__tx_desc(&e->tx, idx);
	d->addr = addr;
	d->len = len;
	d->options = 0;
	xsk_ring_prod__submit(&e->tx, 1);
	e->tx_pending++;
	e->st.tx_frames++;
	e->st.tx_bytes += len;
	return 0;
}

/* Multi-buffer TX: n free frames for one packet, all or none (-1). */
static int tx_frames(struct mrc_eng *e, uint32_t n, uint64_t *addr)
{
	uint32_t i;

	if (e->n_tx_free < n)
		return -1;
	for (i = 0; i < n; i++)
		addr[i] = e->tx_free[--e->n_tx_free];
	return 0;
}

/* Queue one packet of n frames (len[i] bytes each) on the TX ring as one chain: every
 * descriptor but the last carries XDP_PKT_CONTD.  All or nothing: on a full ring the
 * frames go back (-1). */
static int tx_submit_chain(struct mrc_eng *e, const uint64_t *addr, const uint32_t *len, uint32_t n)
{
	uint32_t idx, i, total = 0;
	struct xdp_desc *d;

	if (xsk_ring_prod__reserve(&e->tx, n, &idx) != n) {
		for (i = 0; i < n; i++)
			if (!e->mr_len || addr[i] < e->mr_off)
				e->tx_free[e->n_tx_free++] = addr[i];
		e->st.tx_ring_full++;
		return -1;
	}
	for (i = 0; i < n; i++) {
		d = xsk_ring_prod__tx_desc(&e->tx, idx + i);
		d->addr = addr[i];
		d->len = len[i];
		d->options = i + 1 < n ? XDP_PKT_CONTD : 0;
		total += len[i];
	}
	xsk_ring_prod__submit(&e->tx, n);
	e->tx_pending += n;
	e->st.tx_frames++;
	e->st.tx_bytes += total;
	e->st.tx_mb++;
	e->st.tx_mb_frames += n;
	return 0;
}

/* Write n bytes at offset off of a packet laid out over frames fr[] of fs bytes each. */
static void tx_put(uint8_t *const *fr, uint32_t fs, uint32_t off, const uint8_t *src, uint32_t n)
{
	uint32_t i = off / fs, o = off % fs, k;

	for (; n; i++, o = 0) {
		k = fs - o < n ? fs - o : n;
		memcpy(fr[i] + o, src, k);
		src += k;
		n -= k;
	}
}

static void tx_kick(struct mrc_eng *e)
{
	int i;

	if (!e->tx_pending)
		return;
	if (!xsk_ring_prod__needs_wakeup(&e->tx)) {  /* zero copy: the driver is polling */
		e->tx_pending = 0;
		return;
	}
	/* copy mode sends at most 32 descriptors per call (-EAGAIN: more left) */
	for (i = 0; i < 64; i++) {
		if (sendto(e->xsk_fd, NULL, 0, MSG_DONTWAIT, NULL, 0) >= 0)
			break;
		if (errno != EAGAIN && errno != EBUSY && errno != ENOBUFS)
			break;
		if (errno != EAGAIN)
			break;
	}
	e->st.wakeups++;
	e->tx_pending = 0;
}

static void tx_complete(struct mrc_eng *e)
{
	uint32_t idx, n, i;

	n = xsk_ring_cons__peek(&e->comp, e->n_tx_frames, &idx);
	for (i = 0; i < n; i++) {
		uint64_t a = *xsk_ring_cons__comp_addr(&e->comp, idx + i);

		if (a < e->mr_off || !e->mr_len)     /* (not a payload in a memory region) */
			e->tx_free[e->n_tx_free++] = a;
	}
	if (n)
		xsk_ring_cons__release(&e->comp, n);
}

/* Ethernet + IPv6 + UDP + BTH of a frame to the peer; returns the IPv6 header. */
static uint8_t *build_hdrs(struct mrc_eng *e, struct qp *q, uint8_t *f, uint32_t ip_plen,
			   uint8_t tc, uint8_t opcode, uint32_t dqpn, uint8_t b1, uint8_t b8, uint32_t psn)
{
	uint8_t *ip6 = f + OFF_IP6, *udp = f + OFF_UDP, *bth = f + OFF_BTH;

	memcpy(f, e->o.dst_mac, 6);
	memcpy(f + 6, e->o.src_mac, 6);
	f[12] = 0x86;
	f[13] = 0xDD;
	ip6[0] = 0x60 | tc >> 4;
	ip6[1] = (uint8_t)(tc << 4);
	ip6[2] = ip6[3] = 0;
	put16(ip6 + 4, ip_plen);
	ip6[6] = 17;
	ip6[7] = 64;
	memcpy(ip6 + 8, e->o.local_addr, 16);
	memcpy(ip6 + 24, q->peer, 16);
	put16(udp, 0);                       /* spray writes EV[31:16] */
	put16(udp + 2, e->o.udp_port);
	put16(udp + 4, ip_plen);
	put16(udp + 6, 0);
	bth[0] = opcode;
	bth[1] = b1;
	put16(bth + 2, 0xFFFF);
	bth[4] = 0;
	put24(bth + 5, dqpn);
	bth[8] = b8;
	put24(bth + 9, psn);
	return ip6;
}

static void finish_frame(uint8_t *f, uint32_t frame_len)
{
	uint8_t *ip6 = f + OFF_IP6;
	uint32_t ip_len = frame_len - OFF_IP6;

	put_icrc(f + frame_len - MRC_ICRC_LEN, mrc_eng_icrc(ip6, ip_len - MRC_ICRC_LEN));
}

/* The headers of a data packet into frame f (Ethernet to ImmDt); returns where the
 * payload goes. */
static uint8_t *data_hdrs(struct mrc_eng *e, struct qp *q, struct txp *t, uint8_t *f, uint32_t ip_plen,
			  uint8_t opcode, uint32_t pad, int last, int imm, int ts_on, uint64_t now, int rtx)
{
	struct wr *w = t->wr;
	uint8_t *p;

	build_hdrs(e, q, f, ip_plen, (uint8_t)(e->o.dscp_data << 2 | ECT0), opcode, q->rqpn,
		   (uint8_t)(pad << 4), (last || t->rto ? MRC_BTH_B8_ACKREQ : 0) | (rtx ? MRC_BTH_B8_RTX : 0) |
		   (ts_on ? MRC_BTH_B8_TS : 0), t->psn);
	p = f + OFF_EXT;
	put16(p, 0);                             /* RQMSN */
	put16(p + 2, w->msn);                    /* MSN */
	p += MRC_METH_LEN;
	if (ts_on) {   /* TSETH: tx time (MRC_TS_UNIT_NS, 16 bits), TSR 0, ftype 0: the datapath
			* dates each packet by it for its loss rule, the SACK reflects it */
		uint16_t ts = (uint16_t)(now / MRC_TS_UNIT_NS);

		put16(p, ts ? ts : 1);           /* 0 means "no timestamp" when reflected */
		put16(p + 2, 0);
		p += MRC_TSETH_LEN;
	}
	put64(p, w->raddr + t->off);             /* RETH: this packet's placement */
	put32(p + 8, w->rkey);
	put32(p + 12, (uint32_t)w->len);         /* the whole message's length */
	p += MRC_RETH_LEN;
	if (imm) {
		put32(p, w->imm);
		p += MRC_IMMDT_LEN;
	}
	return p;
}

/* Send (or resend) the data packet of PSN slot t.  Three layouts: one frame (the payload
 * copied after the headers); a multi-buffer packet (XDP_USE_SG) of frames of fs bytes,
 * the headers at the start of the first, the payload copied on through the others; and,
 * for a source in the UMEM's memory-region space (opts.umem_mr), no copy: a header frame,
 * descriptors pointing at the payload where it lies (split at frame boundaries, as the
 * kernel wants a descriptor inside one chunk), and a trailer frame with the pad and the
 * ICRC, computed over all of them. */
static int send_data(struct mrc_eng *e, struct qp *q, struct txp *t, int rtx)
{
	struct wr *w = t->wr;
	uint32_t pad = (4 - (t->len & 3)) & 3, ext, frame_len, ip_plen;
	int first = t->off == 0, last = t->last, imm = w->with_imm && last;
	uint8_t opcode, *f, *p;
	uint64_t addr;
	uint64_t addrs[MRC_ENG_SG_MAX_FRAMES];
	uint8_t *fr[MRC_ENG_SG_MAX_FRAMES];
	uint32_t flen[MRC_ENG_SG_MAX_FRAMES], nfr, fs = e->o.frame_size, i;

	if (w->npkts == 1)
		opcode = w->with_imm ? MRC_OP_WRITE_ONLY_IMM : MRC_OP_WRITE_ONLY;
	else if (first)
		opcode = MRC_OP_WRITE_FIRST;
	else if (last)
		opcode = w->with_imm ? MRC_OP_WRITE_LAST_IMM : MRC_OP_WRITE_LAST;
	else
		opcode = MRC_OP_WRITE_MIDDLE;
	int ts_on = e->o.timestamps == 1;   /* 0 (default) and 2: none */
	uint64_t now = now_ns();

	ext = MRC_METH_LEN + MRC_RETH_LEN + (imm ? MRC_IMMDT_LEN : 0) + (ts_on ? MRC_TSETH_LEN : 0);
	frame_len = OFF_EXT + ext + t->len + pad + MRC_ICRC_LEN;
	ip_plen = frame_len - OFF_UDP;
	if (e->mr_len && e->sg && t->len) {
		uint64_t src = w->laddr + t->off, base = (uint64_t)(uintptr_t)e->area;

		if (src >= base + e->mr_off && src + t->len <= base + e->mr_off + e->mr_len &&
		    (src - base) % fs + t->len <= (uint64_t)(MRC_ENG_SG_MAX_FRAMES - 2) * fs) {
			uint64_t hf[2], a = src - base;
			uint32_t left = t->len, k;
			uint8_t *tr;

			if (tx_frames(e, 2, hf))
				return -1;
			f = (uint8_t *)e->area + hf[0];
			p = data_hdrs(e, q, t, f, ip_plen, opcode, pad, last, imm, ts_on, now, rtx);
			addrs[0] = hf[0];
			fr[0] = f;
			flen[0] = (uint32_t)(p - f);
			nfr = 1;
			for (; left; nfr++, a += k, left -= k) {
				k = fs - (uint32_t)(a % fs) < left ? fs - (uint32_t)(a % fs) : left;
				addrs[nfr] = a;
				fr[nfr] = (uint8_t *)e->area + a;
				flen[nfr] = k;
			}
			tr = (uint8_t *)e->area + hf[1];
			memset(tr, 0, pad);
			addrs[nfr] = hf[1];
			fr[nfr] = tr;
			flen[nfr] = pad + MRC_ICRC_LEN;
			nfr++;
			put_icrc(tr + pad, icrc_iov(fr, flen, nfr, OFF_IP6, frame_len - OFF_IP6 - MRC_ICRC_LEN,
						    crc_fast_ok));
			if (tx_submit_chain(e, addrs, flen, nfr))
				return -1;
			e->st.tx_inplace++;
			goto sent;
		}
	}
	nfr = (frame_len + fs - 1) / fs;
	if (nfr > MRC_ENG_SG_MAX_FRAMES || (nfr > 1 && !e->sg))
		return -1;                       /* mrc_eng_open's checks make this impossible */
	if (nfr == 1) {
		f = tx_frame(e, &addr);
		if (!f)
			return -1;
	} else {
		if (tx_frames(e, nfr, addrs))
			return -1;
		for (i = 0; i < nfr; i++) {
			fr[i] = (uint8_t *)e->area + addrs[i];
			flen[i] = frame_len - i * fs < fs ? frame_len - i * fs : fs;
		}
		addr = addrs[0];
		f = (uint8_t *)e->area + addrs[0];
	}
	p = data_hdrs(e, q, t, f, ip_plen, opcode, pad, last, imm, ts_on, now, rtx);
	if (nfr == 1) {
		memcpy(p, (const void *)(uintptr_t)(w->laddr + t->off), t->len);
		memset(p + t->len, 0, pad);
		finish_frame(f, frame_len);
		if (tx_submit(e, addr, frame_len))
			return -1;
	} else {
		static const uint8_t zero[4];
		uint32_t off = (uint32_t)(p - f);
		uint8_t tr[MRC_ICRC_LEN];

		tx_put(fr, fs, off, (const uint8_t *)(uintptr_t)(w->laddr + t->off), t->len);
		tx_put(fr, fs, off + t->len, zero, pad);
		put_icrc(tr, icrc_iov(fr, flen, nfr, OFF_IP6, frame_len - OFF_IP6 - MRC_ICRC_LEN, crc_fast_ok));
		tx_put(fr, fs, frame_len - MRC_ICRC_LEN, tr, MRC_ICRC_LEN);
		if (tx_submit_chain(e, addrs, flen, nfr))
			return -1;
	}
sent:
	t->tx_ns = now;                          /* the stamp's clock read (one per packet) */
	t->txseq = q->txseq++;
	t->nsent++;
	t->state = MRC_TXP_IN_FLIGHT;
	q->inflight += t->len ? t->len : 1;
	q->st.tx_pkts++;
	q->st.tx_bytes += t->len;
	if (rtx)
		q->st.rtx_pkts++;
	if (!q->rto_deadline)
		q->rto_deadline = t->tx_ns + q->rto;
	return 0;
}

/* ------------------------------------------------------------------ receiver: SACK / NACK */

static inline int rcv_has(struct qp *q, uint32_t psn)
{
	uint32_t i = psn & q->mask;

	return (q->rcv_bm[i / 64] >> (i % 64)) & 1;
}

static inline void rcv_set(struct qp *q, uint32_t psn, int v)
{
	uint32_t i = psn & q->mask;

	if (v)
		q->rcv_bm[i / 64] |= 1ull << (i % 64);
	else
		q->rcv_bm[i / 64] &= ~(1ull << (i % 64));
}

/* One SACK frame whose bitmap starts at base; 0 if it went out. */
static int sack_frame(struct mrc_eng *e, struct qp *q, uint32_t base, int with_m, int repeat)
{
	uint32_t frame_len = OFF_EXT + MRC_SETH_LEN + MRC_CCSTATE_LEN + MRC_ICRC_LEN;
	uint32_t cack = q->rcv_cack, trig = q->ack_psn, i, d;
	uint64_t addr, bm = 0;
	uint8_t *f, *h, *cc;
	int16_t aoff, soff;

	f = tx_frame(e, &addr);
	if (!f)
		return -1;                       /* no frame: the timer retries */
	d = psn_sub(trig, cack);
	for (i = 0; i < 64; i++) {
		uint32_t p = (base + i) & PSN_MASK;

		if (psn_sub(p, cack) < q->win && rcv_has(q, p))
			bm |= 1ull << i;
	}
	if (d < PSN_HALF)
		aoff = (int16_t)(d > 32767 ? 32767 : d);
	else
		aoff = (int16_t)-(int32_t)(PSN_MASK + 1 - d > 32768 ? 32768 : PSN_MASK + 1 - d);
	soff = (int16_t)psn_sub(base, cack);
	build_hdrs(e, q, f, frame_len - OFF_UDP, (uint8_t)(e->o.dscp_ctrl << 2), MRC_OP_SACK, q->rqpn,
		   0, repeat ? MRC_BTH_B8_RTX : 0, cack);
	h = f + OFF_EXT;
	memset(h, 0, MRC_SETH_LEN + MRC_CCSTATE_LEN);
	with_m = with_m && q->ack_ce;
	h[1] = (uint8_t)((with_m ? MRC_M_SKIP_ONCE : MRC_M_NONE) << MRC_SETH_M_SHIFT);
	put16(h + 2, (uint16_t)aoff);
	/* The echo: the triggering packet's EV, or with M=SKIP_ONCE the newest CE-marked
	 * packet's (the datapath skips the EV a SACK echoes; ack_psn and the reflected
	 * timestamp still date the triggering packet for the loss rule and RTT). */
	put32(h + 4, with_m ? q->ack_ce_ev : q->ack_ev);
	h[MRC_SETH_CE_OFF] = (uint8_t)(with_m ? (q->ack_ce > 255 ? 255 : q->ack_ce) : 0);
	put24(h + 13, cack);
	h[17] = (uint8_t)(q->win / 128 > 255 ? 255 : q->win / 128);   /* MPR */
	put16(h + 18, (uint16_t)soff);
	put64(h + 20, bm);
	cc = h + MRC_SETH_LEN;
	put16(cc, q->ack_ts ? (uint16_t)(q->ack_ts - 1) : 0);   /* reflected TSETH tx timestamp (0: none) */
	put16(cc + 2, (uint16_t)(q->rcv_ooo > 0x7FFF ? 0x7FFF : q->rcv_ooo));
	cc[4] = 0;                               /* r_c 0, rcv_cwnd_pen 0 */
	put24(cc + 5, (uint32_t)(q->rcvd_bytes & 0xFFFFFF));
	finish_frame(f, frame_len);
	if (tx_submit(e, addr, frame_len))
		return -1;
	q->st.sacks_tx++;
	if (with_m)
		q->st.sacks_tx_ecn++;
	return 0;
}

/* SACK the newest packet (ack_psn).  The bitmap starts at cack: exact news of the holes
 * recovery needs first.  When the newest packet lies 64 or more beyond cack, a second
 * SACK with the bitmap ending at it acknowledges what arrived out there too. */
static void send_sack(struct mrc_eng *e, struct qp *q)
{
	uint32_t d = psn_sub(q->ack_psn, q->rcv_cack);

	if (sack_frame(e, q, q->rcv_cack, 1, 0))
		return;
	if (d >= 64 && d < PSN_HALF)
		sack_frame(e, q, (q->ack_psn - 63) & PSN_MASK, 0, 0);
	/* A duplicate says the sender did not hear our last SACK (or its packet was late),
	 * and an RTO probe (RTX with AckReq) that it heard nothing for a while: say it
	 * twice.  Spray sends our feedback on the plane the peer's newest data came in on,
	 * and the second copy (RTX set) on the next plane, so with a plane (or a T1) dead
	 * one of the two gets through; without it the sender's RTO probe and our answer
	 * each cross the dead plane half the time, and a QP could spend its retry budget on
	 * coin tosses. */
	if (q->ack_dup)
		sack_frame(e, q, q->rcv_cack, 0, 1);   /* the CE echo counted once */
	q->ack_dup = 0;
	q->ack_pending = 0;
	q->ack_now = 0;
	q->ack_ce = 0;
	q->ack_deadline = 0;
}

static void send_nack(struct mrc_eng *e, struct qp *q, uint32_t psn, uint32_t ev, uint8_t reason,
		      uint8_t vendor, int repeat)
{
	uint32_t frame_len = OFF_EXT + MRC_NETH_LEN + MRC_ICRC_LEN;
	uint64_t addr;
	uint8_t *f, *h;

	f = tx_frame(e, &addr);
	if (!f)
		return;
	build_hdrs(e, q, f, frame_len - OFF_UDP, (uint8_t)(e->o.dscp_ctrl << 2), MRC_OP_NACK, q->rqpn,
		   0, repeat ? MRC_BTH_B8_RTX : 0, q->rcv_cack);
	h = f + OFF_EXT;
	memset(h, 0, MRC_NETH_LEN);
	h[2] = reason;
	h[3] = vendor;
	put32(h + 4, ev);
	put24(h + 13, psn);
	finish_frame(f, frame_len);
	tx_submit(e, addr, frame_len);
}

/* ------------------------------------------------------------------ receiver: data */

/* Copy n bytes from offset off of the packet being received (e->rxp) to dst: one memcpy
 * for a single-frame packet, one per frame it spans for a multi-buffer one. */
static void rx_place(struct mrc_eng *e, uint8_t *dst, uint32_t off, uint32_t n)
{
	const struct rxpkt *p = &e->rxp;
	uint32_t i = 0, k;

	if (p->n == 1) {
		memcpy(dst, p->seg[0] + off, n);
		return;
	}
	while (i < p->n && off >= p->len[i])
		off -= p->len[i++];
	for (; n && i < p->n; i++, off = 0) {
		k = p->len[i] - off < n ? p->len[i] - off : n;
		memcpy(dst, p->seg[i] + off, k);
		dst += k;
		n -= k;
	}
}

static void rx_data(struct mrc_eng *e, struct qp *q, uint8_t *f, uint32_t ip_end, uint32_t ev, int ce)
{
	uint8_t *bth = f + OFF_BTH, *meth = f + OFF_EXT, *reth = meth + MRC_METH_LEN;
	uint8_t op = bth[0];
	int imm = op == MRC_OP_WRITE_LAST_IMM || op == MRC_OP_WRITE_ONLY_IMM;
	int last = op == MRC_OP_WRITE_LAST || op == MRC_OP_WRITE_ONLY || imm;
	uint32_t psn = get24(bth + 9), pad = (bth[1] >> 4) & 3, d, hdr, len, rkey, ts = 0;
	uint64_t va, dlen;
	struct rmsg *m;
	struct mr *mr;
	uint16_t msn;

	hdr = OFF_EXT + MRC_METH_LEN + MRC_RETH_LEN + (imm ? MRC_IMMDT_LEN : 0);
	if (bth[8] & MRC_BTH_B8_TS) {
		hdr += MRC_TSETH_LEN;
		reth += MRC_TSETH_LEN;
		ts = (uint32_t)get16(meth + MRC_METH_LEN) + 1;
	}
	if (ip_end < hdr + pad + MRC_ICRC_LEN) {
		e->st.truncated++;
		return;
	}
	len = ip_end - MRC_ICRC_LEN - pad - hdr;
	d = psn_sub(psn, q->rcv_cack);
	if (d >= PSN_HALF || (d < q->win && rcv_has(q, psn))) {
		e->st.duplicates++;
		q->st.rx_dup++;
		q->ack_psn = psn;
		q->ack_ev = ev;
		q->ack_ts = ts;
		q->ack_now = 1;
		q->ack_dup = 1;
		/* SACKed now, not at the end of the batch, where the next packet would be
		 * the trigger: a SACK triggered by the duplicate (its PSN, EV and reflected
		 * timestamp) is how the sender's datapath learns that a send it judged lost
		 * was only late (late_arrival in bpf/mrc_datapath.c) and widens its window */
		send_sack(e, q);
		return;
	}
	if (d >= q->win) {
		e->st.out_of_window++;
		return;
	}
	va = get64(reth);
	rkey = get32(reth + 8);
	dlen = get32(reth + 12);
	mr = mr_find(e, rkey);
	if (!mr || !(mr->access & MRC_ENG_ACCESS_REMOTE_WRITE) || va < mr->addr ||
	    va + len > mr->addr + mr->len || va + len < va) {
		e->st.bad_rkey++;
		q->st.nacks_tx_access++;
		send_nack(e, q, psn, ev, MRC_NACK_UNEXP_EVENT, MRC_ENG_VI_ACCESS, 0);
		qp_error(e, q, MRC_WC_REM_ACCESS_ERR);
		return;
	}
	rx_place(e, (uint8_t *)(uintptr_t)va, hdr, len);
	rcv_set(q, psn, 1);
	q->rcvd_bytes += len;
	q->st.rx_pkts++;
	q->st.rx_bytes += len;
	if (ce)
		q->st.rx_ce++;
	if (d == 0) {
		while (rcv_has(q, q->rcv_cack)) {
			rcv_set(q, q->rcv_cack, 0);
			q->rcv_cack = (q->rcv_cack + 1) & PSN_MASK;
			if (q->rcv_cack != ((psn + 1) & PSN_MASK))
				q->rcv_ooo--;
		}
	} else {
		q->rcv_ooo++;
		q->ack_now = 1;                  /* a hole behind it: SACK at once */
	}
	/* message bookkeeping: complete (in MSN order) when every byte is there */
	msn = get16(meth + 2);
	m = &q->msgs[msn & q->mask];
	if (!m->valid || m->msn != msn) {
		memset(m, 0, sizeof(*m));
		m->valid = 1;
		m->msn = msn;
	}
	m->dlen = dlen;
	m->got += len;
	if (imm) {
		m->has_imm = 1;
		m->imm = get32(reth + MRC_RETH_LEN);
	}
	if (last)
		m->has_last = 1;
	for (;;) {
		m = &q->msgs[q->rmsn_next & q->mask];
		if (!m->valid || m->msn != q->rmsn_next || !m->has_last || m->got < m->dlen)
			break;
		if (m->has_imm)
			cq_push(e, 0, q->qpn, MRC_WC_SUCCESS, MRC_WC_RECV_RDMA_IMM, (uint32_t)m->dlen, 1, m->imm);
		q->st.rx_msgs++;
		m->valid = 0;
		q->rmsn_next++;
	}
	q->ack_psn = psn;
	q->ack_ev = ev;
	q->ack_ts = ts;
	q->ack_pending++;
	if (ce) {
		/* echoed with M=SKIP_ONCE by the next SACK, coalesced like the rest (ce_ack 1);
		 * ce_ack 2: a SACK of its own at once */
		q->ack_ce++;
		q->ack_ce_ev = ev;
		if (e->o.ce_ack == 2) {
			send_sack(e, q);
			return;
		}
	}
	if (bth[8] & MRC_BTH_B8_ACKREQ)
		q->ack_now = 1;
	if ((bth[8] & (MRC_BTH_B8_ACKREQ | MRC_BTH_B8_RTX)) == (MRC_BTH_B8_ACKREQ | MRC_BTH_B8_RTX))
		q->ack_dup = 1;                  /* the sender's RTO probe: answered twice, see send_sack */
	if (q->ack_pending >= e->o.ack_every)
		q->ack_now = 1;
	if (!q->ack_deadline)
		q->ack_deadline = now_ns() + (uint64_t)e->o.ack_delay_us * 1000;
}

/* ------------------------------------------------------------------ sender: feedback */

static void rtx_queue(struct qp *q, struct txp *t)
{
	if (t->queued || q->rtx_tail - q->rtx_head >= 2 * q->win)
		return;
	t->queued = 1;
	q->rtxq[q->rtx_tail++ & (2 * q->win - 1)] = t->psn;
}

static void mark_lost(struct qp *q, struct txp *t)
{
	if (t->state != MRC_TXP_IN_FLIGHT)
		return;
	t->state = MRC_TXP_LOST;
	q->inflight -= t->len ? t->len : 1;
	rtx_queue(q, t);
}

static uint64_t ack_one(struct qp *q, uint32_t psn)
{
	struct txp *t = &q->tx[psn & q->mask];

	if (t->psn != psn || (t->state != MRC_TXP_IN_FLIGHT && t->state != MRC_TXP_LOST))
		return 0;
	if (t->state == MRC_TXP_IN_FLIGHT)
		q->inflight -= t->len ? t->len : 1;
	t->state = MRC_TXP_ACKED;
	t->wr->acked++;
	return t->len;
}

static void complete_wrs(struct mrc_eng *e, struct qp *q)
{
	struct wr *w;

	while ((w = q->wr_head) && w->started && w->acked >= w->npkts && w != q->wr_cur) {
		q->wr_head = w->next;
		if (!q->wr_head)
			q->wr_tail = NULL;
		cq_push(e, w->wr_id, q->qpn, MRC_WC_SUCCESS, MRC_WC_RDMA_WRITE, (uint32_t)w->len, 0, 0);
		q->st.wr_done++;
		free(w);
	}
}

/* The congestion controller's "once per RTT": srtt, at least 20 us. */
static inline uint64_t cc_rtt(const struct qp *q)
{
	return q->srtt > 20000 ? q->srtt : 20000;
}

/* one multiplicative decrease of pct/1024 at most once per RTT (shared by ECN and trims) */
static int cc_md(struct mrc_eng *e, struct qp *q, uint64_t frac1024, uint64_t now)
{
	if (q->last_md_ns && now - q->last_md_ns < cc_rtt(q))
		return 0;
	q->cwnd -= q->cwnd * frac1024 / 1024;
	if (q->cwnd < e->o.cc_min_cwnd)
		q->cwnd = e->o.cc_min_cwnd;
	q->last_md_ns = now;
	q->st.cc_dec++;
	return 1;
}

/* NSCC-style window.  ECN leads: the fraction of acked bytes that came back in CE-echoing
 * SACKs is averaged per RTT (DCTCP's alpha, gain 1/16) and, whenever an RTT saw marks, the
 * window shrinks by alpha/2 once per RTT, whatever the RTT (a fabric whose queues mark and
 * trim without delaying, like the lab's phantom queues, never shows a high RTT).  RTT lags:
 * above the target with ECN, a decrease proportional to the excess (at most cc_max_md %).
 * Increase: proportional to the distance below the target while no mark was seen for a
 * while (alpha ~ 0), else one cc_fair_inc per window (additive, fair). */
static void cc_update(struct mrc_eng *e, struct qp *q, uint64_t acked, uint64_t marked, int ecn,
		      uint64_t rtt, uint64_t now)
{
	uint64_t target = (uint64_t)e->o.cc_target_us * 1000, dec;

	if (!rtt)
		rtt = q->srtt;
	q->cc_acked += acked;
	/* marked: the acked bytes that came CE-marked (the SACK's count x payload, at most
	 * what it acknowledged; all of them from a peer that does not count) */
	if (ecn)
		q->cc_ecn += acked ? (marked < acked ? marked : acked) : q->payload;
	if (now >= q->cc_win_end) {
		uint64_t f = q->cc_acked ? q->cc_ecn * 1024 / q->cc_acked : (q->cc_ecn ? 1024 : 0);

		if (f > 1024)
			f = 1024;
		q->cc_alpha = (uint32_t)((q->cc_alpha * 15 + f) / 16);
		if (q->cc_ecn && f)
			cc_md(e, q, (q->cc_alpha > f ? q->cc_alpha : f) / 2, now);   /* NSCC quick adapt: the fresh fraction when it is higher */
		q->cc_acked = q->cc_ecn = 0;
		q->cc_win_end = now + cc_rtt(q);
	}
	if (!ecn && rtt < target && q->cc_alpha < 16) {
		q->cwnd += acked * e->o.cc_prop_gain / 100 * (target - rtt) / target;
		q->st.cc_inc_prop++;
	} else if (!ecn) {
		q->cwnd += (uint64_t)e->o.cc_fair_inc * acked / (q->cwnd ? q->cwnd : 1);
		q->st.cc_inc_fair++;
	} else if (rtt >= target) {
		dec = (uint64_t)e->o.cc_md_gamma * (rtt - target) / rtt;
		if (dec > e->o.cc_max_md)
			dec = e->o.cc_max_md;
		cc_md(e, q, dec * 1024 / 100, now);
	} else {
		q->st.cc_hold++;
	}
	if (q->cwnd < e->o.cc_min_cwnd)
		q->cwnd = e->o.cc_min_cwnd;
	if (q->cwnd > e->o.cc_max_cwnd)
		q->cwnd = e->o.cc_max_cwnd;
}

static void rtt_sample(struct mrc_eng *e, struct qp *q, uint64_t r)
{
	uint64_t rto, err;

	if (!q->min_rtt || r < q->min_rtt)
		q->min_rtt = r;
	if (!q->srtt) {
		q->srtt = r;
		q->rttvar = r / 2;
	} else {
		err = r > q->srtt ? r - q->srtt : q->srtt - r;
		q->rttvar = (3 * q->rttvar + err) / 4;
		q->srtt = (7 * q->srtt + r) / 8;
	}
	rto = q->srtt + 4 * q->rttvar;
	if (rto < (uint64_t)e->o.rto_min_us * 1000)
		rto = (uint64_t)e->o.rto_min_us * 1000;
	if (rto > (uint64_t)e->o.rto_max_us * 1000)
		rto = (uint64_t)e->o.rto_max_us * 1000;
	q->rto = rto;
}

/* The reorder window of the engine's time-based loss rule (timestamps=1): twice the
 * datapath's (sack_clock in bpf/mrc_datapath.c) computed from the engine's own
 * reflected-timestamp RTT samples, max(MRC_ENG_LOSS_WINDOW_US, min(min RTT / 4 +
 * 4 x spread, min RTT + spread)).  The datapath judges a hole on the SACK that shows it
 * one window old and retires the EV that carried it (widening its window when such a
 * packet turns out late); the engine resends it a window later.  Resending first (the
 * PSN-distance rule does so 32 packets on) fills the hole before the datapath has
 * judged it: a dead path's EVs then stay in rotation and every packet they carry is
 * resent.  The engine's samples run longer than the datapath's (they include the hop
 * to the engine), so its window errs long. */
static uint64_t reo_window(struct qp *q, uint64_t sample)
{
	uint64_t w, floor = (uint64_t)MRC_ENG_LOSS_WINDOW_US * 1000, mean;

	if (sample && q->min_rtt) {
		uint64_t ex = sample > q->min_rtt ? sample - q->min_rtt : 0;

		q->reo_spread = q->reo_spread - q->reo_spread / 8 + ex / 8;
	}
	w = q->min_rtt / 4 + 4 * q->reo_spread;
	mean = q->min_rtt + q->reo_spread;
	if (w > mean)
		w = mean;
	if (w < floor)
		w = floor;
	q->reo_wnd = 2 * w;
	return q->reo_wnd;
}

static void advance_una(struct mrc_eng *e, struct qp *q, uint64_t now)
{
	uint32_t old = q->snd_una;

	while (q->snd_una != q->snd_next) {
		struct txp *t = &q->tx[q->snd_una & q->mask];

		if (t->psn != q->snd_una || t->state != MRC_TXP_ACKED)
			break;
		t->state = MRC_TXP_FREE;
		q->snd_una = (q->snd_una + 1) & PSN_MASK;
	}
	if (old != q->snd_una) {
		q->retries = 0;
		q->rto_deadline = q->snd_una != q->snd_next ? now + q->rto : 0;
	}
	complete_wrs(e, q);
}

/* feedback from the peer, in the window: how long it had been silent (with data in flight) */
static void fb_seen(struct qp *q, uint64_t now)
{
	if (q->fb_ns && now - q->fb_ns > q->st.fb_gap_max_ns)
		q->st.fb_gap_max_ns = now - q->fb_ns;
	q->fb_ns = now;
}

static void rx_sack(struct mrc_eng *e, struct qp *q, const uint8_t *h)
{
	uint32_t cack = get24(h + 13), span = psn_sub(q->snd_next, q->snd_una), base, trig, i, p;
	int16_t aoff = (int16_t)get16(h + 2), soff = (int16_t)get16(h + 18);
	uint64_t bm = get64(h + 20), acked = 0, rtt = 0, now = now_ns(), trig_seq = 0, wnd = 0, trig_ns = 0;
	uint64_t rtt_ts0 = q->st.rtt_ts;
	uint8_t m = (h[1] >> MRC_SETH_M_SHIFT) & MRC_SETH_M_MASK;
	uint32_t nce = 0;                        /* CE-marked packets the SACK reports */
	struct txp *tt;
	int trig_known = 0;

	q->st.sacks_rx++;
	/* Feedback outside the sent window changes nothing (README's threat model): its
	 * cumulative ack lies between snd_una and snd_next, so a forged or stale SACK moves
	 * no state, not even the peer's MPR. */
	if (psn_sub(cack, q->snd_una) > span) {
		e->st.fb_oow++;
		return;
	}
	fb_seen(q, now);
	if (m == MRC_M_SKIP_ONCE) {
		q->st.sacks_rx_ecn++;
		nce = h[MRC_SETH_CE_OFF] ? h[MRC_SETH_CE_OFF] : 1;
		q->st.ce_reported += nce;
	}
	if (h[17])
		q->peer_mpr = (uint32_t)h[17] * 128 < q->win ? (uint32_t)h[17] * 128 : q->win;
	trig = (cack + aoff) & PSN_MASK;
	base = (cack + soff) & PSN_MASK;
	tt = &q->tx[trig & q->mask];
	if (psn_sub(trig, q->snd_una) < span && tt->psn == trig && tt->state != MRC_TXP_FREE) {
		trig_known = 1;
		trig_seq = tt->txseq;
		trig_ns = tt->tx_ns;
		if (trig_seq > q->rack_seq)
			q->rack_seq = trig_seq;
		if (tt->nsent == 1 && tt->state == MRC_TXP_IN_FLIGHT)
			rtt = now - tt->tx_ns;   /* Karn: never from a retransmitted packet */
	}
	for (p = q->snd_una; p != cack; p = (p + 1) & PSN_MASK)
		acked += ack_one(q, p);
	for (i = 0; i < 64; i++) {
		p = (base + i) & PSN_MASK;
		if ((bm >> i & 1) && psn_sub(p, q->snd_una) < span)
			acked += ack_one(q, p);
	}
	if (e->o.timestamps == 1 && get16(h + MRC_SETH_LEN)) {
		/* a reflected timestamp times retransmissions too (no Karn ambiguity) */
		uint32_t us = ((uint32_t)(now / MRC_TS_UNIT_NS) - get16(h + MRC_SETH_LEN)) & 0xFFFF;

		rtt = (uint64_t)us * MRC_TS_UNIT_NS;
		if (!rtt)
			rtt = 1;
		q->st.rtt_ts++;
	}
	if (rtt)
		rtt_sample(e, q, rtt);
	if (e->o.timestamps == 1)
		wnd = reo_window(q, q->st.rtt_ts != rtt_ts0 ? rtt : 0);
	/* RACK, as the datapath's sack_losses(): a PSN the SACK reports missing at least
	 * loss_reorder below the newest PSN it acknowledges (the bitmap's highest bit, or the
	 * triggering packet when that lies beyond the bitmap), sent before the triggering
	 * packet, is lost.  cack itself is always missing; PSNs between cack and a bitmap
	 * that starts later (another receiver's choice) are unknown and wait. */
	if (trig_known) {
		int32_t hi_eff = bm ? 63 - __builtin_clzll(bm) : -1;
		uint32_t toff = psn_sub(trig, base), gap = psn_sub(base, cack);

		if (toff < PSN_HALF && (int32_t)toff > hi_eff)
			hi_eff = (int32_t)toff;
		/* stamped (timestamps=1): time-based, the hole sent more than the reorder
		 * window before the trigger, however many PSNs lie between (wnd) */
		uint32_t reo = wnd ? 1 : e->o.loss_reorder;

		if (gap && gap < span && (int64_t)hi_eff + gap >= reo) {
			struct txp *t = &q->tx[cack & q->mask];

			if (t->psn == cack && t->state == MRC_TXP_IN_FLIGHT && t->txseq < trig_seq &&
			    (!wnd || trig_ns > t->tx_ns + wnd)) {
				mark_lost(q, t);
				q->st.rtx_sack++;
			}
		}
		for (i = 0; (int64_t)i + reo <= hi_eff && i < 64; i++) {
			struct txp *t;

			if (bm >> i & 1)
				continue;
			p = (base + i) & PSN_MASK;
			if (psn_sub(p, cack) >= PSN_HALF || psn_sub(p, q->snd_una) >= span)
				continue;
			t = &q->tx[p & q->mask];
			if (t->psn == p && t->state == MRC_TXP_IN_FLIGHT && t->txseq < trig_seq &&
			    (!wnd || trig_ns > t->tx_ns + wnd)) {
				mark_lost(q, t);
				q->st.rtx_sack++;
			}
		}
	}
	if (acked || rtt)
		cc_update(e, q, acked, h[MRC_SETH_CE_OFF] ? (uint64_t)nce * q->payload : acked,
			  m == MRC_M_SKIP_ONCE, rtt, now);
	advance_una(e, q, now);
}

static void rx_nack(struct mrc_eng *e, struct qp *q, const uint8_t *h)
{
	uint32_t psn = get24(h + 13), span = psn_sub(q->snd_next, q->snd_una);
	uint8_t why = h[2];
	struct txp *t = &q->tx[psn & q->mask];
	uint64_t now;

	if (why == MRC_NACK_TRIMMED || why == MRC_NACK_TRIMMED_LASTHOP)
		q->st.nacks_rx_trim++;
	else
		q->st.nacks_rx_other++;
	/* A NACK names one PSN we sent and have not seen acknowledged; any other changes
	 * nothing, whatever its reason (a forger who knows only the QPN must not end the QP). */
	if (psn_sub(psn, q->snd_una) >= span || t->psn != psn ||
	    (t->state != MRC_TXP_IN_FLIGHT && t->state != MRC_TXP_LOST)) {
		e->st.fb_oow++;
		return;
	}
	now = now_ns();
	fb_seen(q, now);
	if (why == MRC_NACK_TRIMMED || why == MRC_NACK_TRIMMED_LASTHOP) {
		if (t->state != MRC_TXP_IN_FLIGHT)
			return;
		/* resent less than an RTT ago: the NACK (or its repeated copy) is about
		 * an earlier transmission, already resent */
		if (t->nsent > 1 && now - t->tx_ns < q->min_rtt) {
			q->st.nacks_rx_stale++;
			return;
		}
		mark_lost(q, t);
		q->st.rtx_nack_trim++;
		/* trimming is congestion (UET NSCC: a NACK is a decrease signal): at most one
		 * multiplicative decrease per RTT, half of cc_max_md; it also counts as marked
		 * bytes for the ECN average */
		q->cc_ecn += t->len;
		cc_md(e, q, (uint64_t)e->o.cc_max_md * 1024 / 200, now);
		return;
	}
	if (why == MRC_NACK_UNEXP_EVENT && h[3] == MRC_ENG_VI_ACCESS)
		qp_error(e, q, MRC_WC_REM_ACCESS_ERR);
}

/* ------------------------------------------------------------------ receive path */

static void rx_frame(struct mrc_eng *e, uint8_t *f, uint32_t len)
{
	uint8_t *ip6 = f + OFF_IP6, *udp = f + OFF_UDP, *bth = f + OFF_BTH, op, tc;
	uint32_t plen, ip_end, qpn, ev, psn;
	struct qp *q;
	int data, trimmed;

	e->st.rx_frames++;
	e->st.rx_bytes += len;
	if (len < OFF_UDP + UDP_HLEN || f[12] != 0x86 || f[13] != 0xDD || ip6[6] != 17 ||
	    get16(udp + 2) != e->o.udp_port) {
		e->st.not_mrc++;
		return;
	}
	plen = get16(ip6 + 4);
	ip_end = OFF_UDP + plen;                 /* frame offset where the IPv6 packet ends */
	if (ip_end > len || get16(udp + 4) != plen || plen < UDP_HLEN + MRC_BTH_LEN + MRC_ICRC_LEN) {
		e->st.truncated++;
		return;
	}
	op = bth[0];
	data = op >= MRC_OP_WRITE_FIRST && op <= MRC_OP_WRITE_ONLY_IMM;
	tc = (uint8_t)((ip6[0] & 0x0F) << 4 | ip6[1] >> 4);
	trimmed = data && (tc >> 2) == e->o.dscp_trimmed;
	if (!trimmed) {
		uint32_t want;
		uint8_t tr[MRC_ICRC_LEN];

		if (e->rxp.n == 1) {
			want = mrc_eng_icrc(ip6, ip_end - OFF_IP6 - MRC_ICRC_LEN);
			memcpy(tr, f + ip_end - MRC_ICRC_LEN, MRC_ICRC_LEN);
		} else {       /* multi-buffer: the CRC runs over every frame; the trailer may straddle two */
			want = icrc_iov(e->rxp.seg, e->rxp.len, e->rxp.n, OFF_IP6,
					ip_end - OFF_IP6 - MRC_ICRC_LEN, crc_fast_ok);
			rx_place(e, tr, ip_end - MRC_ICRC_LEN, MRC_ICRC_LEN);
		}
		if (want != get_icrc(tr)) {
			e->st.bad_icrc++;
			return;
		}
	}
	qpn = get24(bth + 5);
	q = qp_find(e, qpn);
	if (!q || q->state == MRC_QPS_INIT || memcmp(ip6 + 8, q->peer, 16) ||
	    memcmp(ip6 + 24, e->o.local_addr, 16)) {
		e->st.bad_qpn++;
		return;
	}
	if (q->state != MRC_QPS_RTS)
		return;
	ev = (uint32_t)get16(udp) << 16 | get16(ip6 + 2);
	psn = get24(bth + 9);
	if (trimmed) {
		e->st.trimmed++;
		if (psn_sub(psn, q->rcv_cack) < q->win && !rcv_has(q, psn)) {
			/* Twice: the second copy (RTX) goes back on the next plane (spray), as a
			 * repeated SACK does.  We send no data to the peer, so our EVs through
			 * a dead switch are never retired, and a NACK lost there would leave
			 * the sender a hole its loss rule blames on the EV that was only
			 * trimmed (a live path retired). */
			q->st.nacks_tx_trim++;
			send_nack(e, q, psn, ev, MRC_NACK_TRIMMED, 0, 0);
			send_nack(e, q, psn, ev, MRC_NACK_TRIMMED, 0, 1);
		}
		return;
	}
	if (data) {
		e->st.rx_data++;
		rx_data(e, q, f, ip_end, ev, (tc & 3) == 3);
	} else if (op == MRC_OP_SACK) {
		e->st.rx_sack++;
		if (ip_end < OFF_EXT + MRC_SETH_LEN + MRC_CCSTATE_LEN + MRC_ICRC_LEN) {
			e->st.truncated++;
			return;
		}
		rx_sack(e, q, f + OFF_EXT);
	} else if (op == MRC_OP_NACK) {
		e->st.rx_nack++;
		if (ip_end < OFF_EXT + MRC_NETH_LEN + MRC_ICRC_LEN) {
			e->st.truncated++;
			return;
		}
		rx_nack(e, q, f + OFF_EXT);
	} else {
		e->st.not_mrc++;
	}
}

/* One RX descriptor as rx_descs reads it. */
struct rxd {
	uint8_t *p;
	uint32_t len, opt;
};

/* Read n descriptors.  With XDP_USE_SG a packet is a chain of descriptors, each but the
 * last with XDP_PKT_CONTD: headers come from its first frame, payload from each
 * (rx_place), the ICRC over all.  The kernel makes a packet's descriptors visible
 * together, so a chain that the batch cut (n == max: the ring may hold more) is left for
 * the next round; a chain longer than a whole batch, or whose first frame does not hold
 * every header, is counted (rx_mb_bad) and dropped (a chain too long to hold: the rest of
 * it too, as it comes).  Returns the descriptors consumed. */
static uint32_t rx_descs(struct mrc_eng *e, const struct rxd *d, uint32_t n, uint32_t max)
{
	struct rxpkt *p = &e->rxp;
	uint32_t i, j, k;

	for (i = 0; i < n; i = j + 1) {
		if (e->rx_skip) {                /* the rest of a chain dropped before */
			e->rx_skip = !!(d[i].opt & XDP_PKT_CONTD);
			j = i;
			continue;
		}
		if (!(d[i].opt & XDP_PKT_CONTD)) {        /* one frame: the common case */
			j = i;
			p->n = 1;
			p->seg[0] = d[i].p;
			p->len[0] = p->total = d[i].len;
			rx_frame(e, d[i].p, d[i].len);
			continue;
		}
		for (j = i; j < n && (d[j].opt & XDP_PKT_CONTD); j++)
			;
		if (j == n) {                    /* the chain goes on past these descriptors */
			if (i || n < max)
				break;               /* the rest next round */
			e->st.rx_mb_bad++;           /* longer than a batch: never ours; its */
			e->rx_skip = 1;              /* rest is dropped as it comes */
			j = n - 1;
			continue;
		}
		p->n = j - i + 1;
		p->total = 0;
		for (k = 0; k < p->n; k++) {
			p->seg[k] = d[i + k].p;
			p->len[k] = d[i + k].len;
			p->total += d[i + k].len;
		}
		if (p->len[0] < RX_HDR_MIN) {
			e->st.rx_mb_bad++;           /* headers not all in the first frame */
			continue;
		}
		e->st.rx_mb++;
		e->st.rx_mb_frames += p->n;
		rx_frame(e, p->seg[0], p->total);
	}
	return i;
}

/* Read up to RX_BATCH descriptors from the RX ring (rx_descs); every frame read goes
 * back to the fill ring, a cut chain's stay in the ring.  Returns the descriptors seen
 * (RX_BATCH: the ring may hold more), 0 if none could be consumed. */
static int rx_batch(struct mrc_eng *e)
{
	struct rxd d[RX_BATCH];
	uint32_t idx, fidx, n, i, got, done;

	n = xsk_ring_cons__peek(&e->rx, RX_BATCH, &idx);
	if (!n)
		return 0;
	for (i = 0; i < n; i++) {
		const struct xdp_desc *x = xsk_ring_cons__rx_desc(&e->rx, idx + i);

		d[i].p = (uint8_t *)e->area + xsk_umem__add_offset_to_addr(x->addr);
		d[i].len = x->len;
		d[i].opt = x->options;
	}
	done = rx_descs(e, d, n, RX_BATCH);
	/* the frames read go straight back to the fill ring (it has room for all of them) */
	got = xsk_ring_prod__reserve(&e->fill, done, &fidx);
	for (i = 0; i < got; i++)
		*xsk_ring_prod__fill_addr(&e->fill, fidx + i) =
			xsk_umem__extract_addr(xsk_ring_cons__rx_desc(&e->rx, idx + i)->addr);
	if (got)
		xsk_ring_prod__submit(&e->fill, got);
	if (got < done)
		e->st.fill_empty += done - got;
	if (done < n)
		xsk_ring_cons__cancel(&e->rx, n - done);
	if (done)
		xsk_ring_cons__release(&e->rx, done);
	return done ? (int)n : 0;
}

/* Tests: run frames through the receive path as if they were n RX descriptors (bufs[i],
 * lens[i] bytes, options opts[i]: XDP_PKT_CONTD chains), under the engine's lock, as one
 * batch of n.  Returns the descriptors consumed (a chain cut at the end is not). */
int mrc_eng_rx_inject(struct mrc_eng *e, uint8_t *const *bufs, const uint32_t *lens,
		      const uint32_t *opts, uint32_t n)
{
	struct rxd d[RX_BATCH];
	uint32_t i, done;

	if (n > RX_BATCH)
		return -EINVAL;
	for (i = 0; i < n; i++) {
		d[i].p = bufs[i];
		d[i].len = lens[i];
		d[i].opt = opts[i];
	}
	pthread_mutex_lock(&e->mu);
	done = rx_descs(e, d, n, RX_BATCH);
	pthread_mutex_unlock(&e->mu);
	return (int)done;
}

/* ------------------------------------------------------------------ sender: transmit */

/* Pacing (cc_pace 1).  The window is the bytes per base RTT (min RTT): packets leave
 * cwnd / min_rtt apart, so the rate follows the window even when the window is below
 * one packet (the lab's 400 Mbit/s at ~25 us is ~1.2 KB in flight), and not the time
 * SACKs take to come back (a delayed SACK or a busy CPU stretches the RTT, and with it a
 * window-clocked rate).  In flight is capped at 4 windows plus 2 packets: an RTT up to
 * 4 min RTTs (a delayed SACK) keeps the rate, a longer one (a stalled peer, a host
 * queueing what the sender sends faster than it forwards) holds the sender back as a
 * window does (scaling the cap with the RTT ran away: more in flight, longer queues,
 * longer RTT).  A burst of at most max(min RTT, 50 us) of sending time is allowed after
 * a pause (the thread's sleep is not exact). */
static uint64_t cc_cap(struct mrc_eng *e, struct qp *q)
{
	if (e->o.cc_pace != 1 || !q->min_rtt)
		return q->cwnd;
	return 4 * q->cwnd + 2 * (uint64_t)q->payload;
}

static int cc_paced(struct mrc_eng *e, struct qp *q, uint64_t now)
{
	return e->o.cc_pace == 1 && q->min_rtt && q->pace_ns > now;
}

static void cc_pace_sent(struct mrc_eng *e, struct qp *q, uint32_t len, uint64_t now)
{
	uint64_t slack = q->min_rtt > 50000 ? q->min_rtt : 50000, base;

	if (e->o.cc_pace != 1 || !q->min_rtt)
		return;
	base = q->pace_ns + slack > now ? q->pace_ns : now - slack;
	q->pace_ns = base + (uint64_t)(len ? len : 1) * q->min_rtt / (q->cwnd ? q->cwnd : 1);
}

static int qp_tx(struct mrc_eng *e, struct qp *q, uint64_t now)
{
	int sent = 0;
	uint32_t lim;

	if (q->state != MRC_QPS_RTS)
		return 0;
	while (sent < TX_BUDGET) {
		struct txp *t;

		if (q->rtx_head != q->rtx_tail) {
			uint32_t psn = q->rtxq[q->rtx_head & (2 * q->win - 1)];

			t = &q->tx[psn & q->mask];
			if (t->psn != psn || t->state != MRC_TXP_LOST) {
				t->queued = t->psn == psn ? 0 : t->queued;
				q->rtx_head++;
				continue;
			}
			if (q->inflight && q->inflight + t->len > cc_cap(e, q))
				break;
			if (cc_paced(e, q, now))
				break;
			if (send_data(e, q, t, 1))
				break;
			cc_pace_sent(e, q, t->len, now);
			t->queued = 0;
			q->rtx_head++;
			sent++;
			if (t->rto == 2) {
				/* the second copy of a repeated RTO's probe: spray puts it on
				 * another plane than the first; one PSN in flight, counted once */
				if (!send_data(e, q, t, 1)) {
					q->inflight -= t->len ? t->len : 1;
					sent++;
				}
			}
			t->rto = 0;
			continue;
		}
		if (!q->wr_cur)
			break;
		lim = q->peer_mpr < q->win ? q->peer_mpr : q->win;
		if (psn_sub(q->snd_next, q->snd_una) >= lim)
			break;
		if (q->inflight && q->inflight + q->payload > cc_cap(e, q))
			break;
		if (cc_paced(e, q, now))
			break;
		{
			struct wr *w = q->wr_cur;
			uint64_t left = w->len - q->cur_off;
			uint32_t len = left > q->payload ? q->payload : (uint32_t)left;

			t = &q->tx[q->snd_next & q->mask];
			memset(t, 0, sizeof(*t));
			t->wr = w;
			t->off = q->cur_off;
			t->len = len;
			t->psn = q->snd_next;
			t->last = q->cur_off + len >= w->len;
			if (!w->started) {
				w->started = 1;
				w->first_psn = q->snd_next;
			}
			if (send_data(e, q, t, 0)) {
				t->state = MRC_TXP_FREE;
				break;
			}
			cc_pace_sent(e, q, len, now);
			q->snd_next = (q->snd_next + 1) & PSN_MASK;
			q->cur_off += len;
			if (t->last) {
				q->wr_cur = w->next;
				q->cur_off = 0;
			}
			sent++;
		}
	}
	return sent;
}

/* ------------------------------------------------------------------ timers */

/* rx_backlog: the RX ring still held frames after this round's batch (a thread that was
 * descheduled finds a ring full of SACKs): an RTO is not judged before they are read, or a
 * stall of our own would look like a silent peer and resend what the SACKs acknowledge */
static void qp_timers(struct mrc_eng *e, struct qp *q, uint64_t now, uint64_t *next, int rx_backlog)
{
	if (q->state != MRC_QPS_RTS)
		return;
	if (q->ack_pending && (q->ack_now || (q->ack_deadline && now >= q->ack_deadline)))
		send_sack(e, q);
	else if (q->ack_now && !q->ack_pending)
		send_sack(e, q);           /* duplicate: say again what we have */
	if (q->ack_pending && q->ack_deadline && q->ack_deadline < *next)
		*next = q->ack_deadline;
	if (q->snd_una == q->snd_next) {
		q->rto_deadline = 0;
		q->fb_ns = 0;               /* nothing in flight: the peer owes us nothing */
		return;
	}
	if (!q->fb_ns)
		q->fb_ns = now;             /* a flight began: the peer's silence counts from here */
	if (!q->rto_deadline)
		q->rto_deadline = now + q->rto;
	if (now >= q->rto_deadline && rx_backlog) {
		q->st.rto_deferred++;
	} else if (now >= q->rto_deadline) {
		uint32_t p;
		int silent;

		q->st.timeouts++;
		if (++q->retries > q->st.retries_max)
			q->st.retries_max = q->retries;
		if (q->retries > e->o.retry_limit) {
			qp_error(e, q, MRC_WC_RETRY_EXC_ERR);
			return;
		}
		silent = now - q->fb_ns >= (uint64_t)e->o.rto_bulk_us * 1000;
		/* first expiry since progress: a probe (the oldest PSN only, its SACK lets RACK
		 * find the rest; a host that merely stalled the thread costs one packet); from
		 * the second on, what was sent at least one RTO ago is presumed lost if the peer
		 * has since SACKed a packet sent after it (RACK's rule, the RTO its reorder
		 * window), or, for the rest, once the peer has said nothing for rto_bulk_us (a
		 * busy host deschedules a receiver for milliseconds: measured, 102 spurious
		 * resends of 12k packets in a loaded CI run); it is resent selectively, and the
		 * window halves (at most once per RTT); the probe then
		 * goes out twice (two planes: see send_sack), as a plane whose failure the
		 * datapath has not seen yet would otherwise take half of the probes */
		for (p = q->snd_una; p != q->snd_next; p = (p + 1) & PSN_MASK) {
			struct txp *t = &q->tx[p & q->mask];

			if (t->psn == p && t->state == MRC_TXP_IN_FLIGHT &&
			    (p == q->snd_una || (q->retries > 1 && t->tx_ns + q->rto <= now &&
			                         (silent || t->txseq < q->rack_seq)))) {
				t->rto = 1;
				mark_lost(q, t);
				q->st.rtx_timeout++;
			}
		}
		if (q->retries > 1) {        /* the probe: sent twice when it goes out */
			struct txp *u = &q->tx[q->snd_una & q->mask];

			if (u->psn == q->snd_una && u->state == MRC_TXP_LOST)
				u->rto = 2;
		}
		q->rto = q->rto * 2 > (uint64_t)e->o.rto_max_us * 1000 ? (uint64_t)e->o.rto_max_us * 1000 : q->rto * 2;
		if (q->retries > 1)
			cc_md(e, q, 512, now);
		q->rto_deadline = now + q->rto;
	}
	if (q->rto_deadline < *next)
		*next = q->rto_deadline;
}

/* ------------------------------------------------------------------ progress thread */

/* Spin after work (opts.spin_us).  The thread spins only once it has had work; what
 * it watches needs no lock and no syscall: the RX ring's producer index, the post
 * count, the nearest timer, and the completion ring when TX frames ran out.  The limit
 * adapts between 0 and spin_us, as KVM's halt polling does: a spin that found work
 * doubles it; a spin that ran out leaves it, and the sleep that follows tells what
 * would have helped: woken by work within spin_us of the spin's start, a longer spin
 * would have caught it (the limit grows to 5/4 of that gap); later (or by a timer
 * alone), spinning was a waste (the limit halves, to 0 below 1 us).  So a ping-pong
 * whose turns come back within spin_us keeps the thread awake, and a stream of sparse
 * events soon stops costing spins.  An endpoint with nothing to do never spins. */
static int spin_found(struct mrc_eng *e, unsigned posts_seen, uint64_t next, int blocked)
{
	if (__atomic_load_n(e->rx.producer, __ATOMIC_ACQUIRE) !=
	    __atomic_load_n(e->rx.consumer, __ATOMIC_RELAXED))
		return 1;
	if (atomic_load_explicit(&e->posts, memory_order_acquire) != posts_seen)
		return 1;
	if (blocked && __atomic_load_n(e->comp.producer, __ATOMIC_ACQUIRE) !=
	               __atomic_load_n(e->comp.consumer, __ATOMIC_RELAXED))
		return 1;
	if (atomic_load(&e->stop))
		return 1;
	if (next != UINT64_MAX && now_ns() >= next)
		return 1;
	return atomic_load_explicit(&e->cq_spinners, memory_order_relaxed) ? 2 : 0;
}

/* A spin (the thread's or a caller's) whose clock jumps by more than this between two
 * looks was descheduled: the CPUs have more runnable threads than they can run, and a
 * spinner then only takes time from the threads it waits for (measured on the 2-core
 * VM at load 5-6: round trip p50 61 us without spin, 140 us with the thread spinning,
 * 186 us with the caller spinning too).  The thread's limit drops to 0 and stays there
 * SPIN_HOLD_NS; a caller stops spinning and sleeps on the CQ's eventfd. */
#define SPIN_PREEMPT_NS 20000ull
#define SPIN_HOLD_NS    10000000ull

/* One round of the progress loop, under e->mu: RX batch, timers, TX, kicks.  Returns the
 * frames received and sent; *now, the time it used; *next lowered to the nearest timer;
 * *blocked set if a QP waits for TX frames.  TX visits the QPs in turn (up to TX_BUDGET
 * packets each), starting with the first one the last round left waiting for TX frames,
 * so with 1024 QPs none waits behind the same others every round.  The progress thread
 * runs it, and so does a caller spinning in mrc_eng_cq_wait when the RX ring has frames. */
static int progress_once(struct mrc_eng *e, uint64_t *nowp, uint64_t *next, int *blocked, int *more)
{
	int work, rx;
	uint64_t now;
	struct qp *q, *first;
	uint32_t i;

	e->st.loops++;
	rx = rx_batch(e);
	work = rx;
	tx_complete(e);
	*nowp = now = now_ns();
	for (q = e->qps; q; q = q->next)
		qp_timers(e, q, now, next, rx == RX_BATCH);
	first = e->tx_next ? e->tx_next : e->qps;
	e->tx_next = NULL;
	for (q = first, i = 0; q && i < e->nqps; q = q->next ? q->next : e->qps, i++) {
		work += qp_tx(e, q, now);
		if (q->state == MRC_QPS_RTS && (q->wr_cur || q->rtx_head != q->rtx_tail))
			*more = 1;
		if (q->state == MRC_QPS_RTS && (q->wr_cur || q->rtx_head != q->rtx_tail) &&
		    e->n_tx_free < e->tx_fpp) {
			*blocked = 1;
			if (!e->tx_next)
				e->tx_next = q;
		}
		if (q->state == MRC_QPS_RTS && (q->wr_cur || q->rtx_head != q->rtx_tail) &&
		    cc_paced(e, q, now) && q->pace_ns < *next)
			*next = q->pace_ns;      /* paced: wake when the next packet may go */
	}
	tx_kick(e);
	tx_complete(e);
	if (xsk_ring_prod__needs_wakeup(&e->fill))
		recvfrom(e->xsk_fd, NULL, 0, MSG_DONTWAIT, NULL, NULL);
	return work;
}

int mrc_eng_cq_wait(struct mrc_eng *e, struct mrc_eng_wc *wc, int max, uint32_t spin_us)
{
	uint64_t end, now, next, one = 1, prev;
	int n = mrc_eng_poll(e, wc, max), blocked, more;

	if (n || !spin_us)
		return n;
	if (atomic_load_explicit(&e->cq_skip_left, memory_order_relaxed)) {
		/* recent spins came back empty: this wait sleeps on the eventfd at once */
		atomic_fetch_sub_explicit(&e->cq_skip_left, 1, memory_order_relaxed);
		atomic_fetch_add_explicit(&e->caller_skipped, 1, memory_order_relaxed);
		return 0;
	}
	atomic_fetch_add(&e->cq_spinners, 1);
	prev = now_ns();
	end = prev + (uint64_t)spin_us * 1000;
	while (!atomic_load_explicit(&e->cq_pending, memory_order_acquire)) {
		/* frames in the RX ring: receive them in this thread (the completion they make
		 * comes to this caller without a hand-off); the progress thread is not needed
		 * for it, and does not spin while a caller does */
		if (__atomic_load_n(e->rx.producer, __ATOMIC_ACQUIRE) !=
		    __atomic_load_n(e->rx.consumer, __ATOMIC_RELAXED) &&
		    !pthread_mutex_trylock(&e->mu)) {
			uint64_t su;

			next = UINT64_MAX;
			blocked = more = 0;
			e->st.caller_rx++;
			progress_once(e, &now, &next, &blocked, &more);
			pthread_mutex_unlock(&e->mu);
			/* the thread sleeps past a timer this round set (a delayed SACK, an RTO),
			 * or packets are left to send: wake it.  The round counts as a post: a
			 * thread about to sleep on a deadline it computed before this round looks
			 * again (the same two-sided check as post_write's) */
			atomic_fetch_add(&e->posts, 1);
			su = atomic_load(&e->sleep_until);
			if (su && (more || next < su)) {
				(void)!write(e->wake_fd, &one, sizeof(one));
				atomic_fetch_add_explicit(&e->caller_wakeups, 1, memory_order_relaxed);
			}
			prev = now_ns();
			continue;
		}
		now = now_ns();
		if (now >= end)
			break;
		if (now - prev > SPIN_PREEMPT_NS) {       /* descheduled: stop spinning */
			atomic_fetch_add_explicit(&e->caller_preempted, 1, memory_order_relaxed);
			break;
		}
		prev = now;
		cpu_relax();
	}
	atomic_fetch_sub(&e->cq_spinners, 1);
	/* a completion pushed while this caller spun wrote no eventfd: take it now (the
	 * caller sleeps on the eventfd only after a poll that found none) */
	n = mrc_eng_poll(e, wc, max);
	/* a spin that came back empty (ran out, or was descheduled) makes the next 1, 3, 7
	 * ... 63 waits skip theirs; one that got its completion spins again next time.  On
	 * the 2-core VM a caller that shares its CPU with the thread it waits for (the
	 * peer's, through the other side's datapath) only delays it by spinning (measured:
	 * both ends pinned to one CPU, round trip p50 187 us with spins against 50 without;
	 * on two CPUs 19.5 against 85-129) */
	if (n) {
		atomic_store_explicit(&e->cq_skip, 0, memory_order_relaxed);
	} else {
		unsigned k = atomic_load_explicit(&e->cq_skip, memory_order_relaxed) * 2 + 1;

		k = k > 63 ? 63 : k;
		atomic_store_explicit(&e->cq_skip, k, memory_order_relaxed);
		atomic_store_explicit(&e->cq_skip_left, k, memory_order_relaxed);
	}
	return n;
}

static void spin_grow(struct mrc_eng *e, uint64_t to)
{
	if (to < 1000)
		to = 1000;
	e->spin_cur_ns = to > e->spin_max_ns ? e->spin_max_ns : to;
}

static void *progress(void *arg)
{
	struct mrc_eng *e = arg;
	struct pollfd pfd[2];
	sigset_t all;
	unsigned posts_seen = 0;
	uint64_t last_work = 0, missed_at = 0;   /* missed_at: start of a spin that ran out */

	sigfillset(&all);
	pthread_sigmask(SIG_BLOCK, &all, NULL);
	prctl(PR_SET_TIMERSLACK, 5000UL, 0, 0, 0);   /* pacing sleeps: 5 us, not the default 50 */
	prctl(PR_SET_NAME, "mrc-engine", 0, 0, 0);    /* top -H, /proc/<pid>/task/<tid>/comm */
	pfd[0].fd = e->xsk_fd;
	pfd[1].fd = e->wake_fd;
	pfd[1].events = POLLIN;
	while (!atomic_load(&e->stop)) {
		uint64_t now, next = UINT64_MAX, v;
		int work = 0, blocked = 0, more = 0;
		unsigned posts = atomic_load(&e->posts);

		pthread_mutex_lock(&e->mu);
		work = progress_once(e, &now, &next, &blocked, &more);
		pthread_mutex_unlock(&e->mu);
		if (e->spin_max_ns) {
			int event = work || posts != posts_seen;

			posts_seen = posts;
			if (event) {
				if (missed_at) {        /* woken by work after a spin ran out */
					if (now < e->spin_hold_until)
						;               /* held at 0 after a preempted spin */
					else if (now - missed_at <= e->spin_max_ns)
						spin_grow(e, (now - missed_at) * 5 / 4);
					else
						e->spin_cur_ns = e->spin_cur_ns / 2 < 1000 ? 0 : e->spin_cur_ns / 2;
					missed_at = 0;
				}
				last_work = e->active_ns = now;
			}
			if (work)
				continue;
			if (last_work && e->spin_cur_ns && now - last_work < e->spin_cur_ns &&
			    !atomic_load(&e->cq_spinners)) {     /* a spinning caller receives */
				uint64_t t0 = now, end = last_work + e->spin_cur_ns, t, prev = now;
				int found;

				while (!(found = spin_found(e, posts_seen, next, blocked)) && (t = now_ns()) < end) {
					if (t - prev > SPIN_PREEMPT_NS) {
						found = 3;      /* descheduled mid-spin: see SPIN_PREEMPT_NS */
						break;
					}
					prev = t;
					cpu_relax();
				}
				t = now_ns();
				pthread_mutex_lock(&e->mu);
				e->st.spin_ns += t - t0;
				if (found == 1) {
					e->st.spin_hits++;
					spin_grow(e, e->spin_cur_ns * 2);
				} else if (!found) {
					e->st.spin_misses++;
					missed_at = t0;
				} else if (found == 3) {
					e->st.spin_preempted++;
					e->spin_cur_ns = 0;
					e->spin_hold_until = t + SPIN_HOLD_NS;
					missed_at = 0;
				} else {
					e->st.spin_yields++;   /* a caller spins and receives: sleep */
				}
				e->st.spin_limit_ns = e->spin_cur_ns;
				pthread_mutex_unlock(&e->mu);
				if (found == 1)
					continue;
				now = t;
			} else if (missed_at && now - missed_at > e->spin_max_ns) {
				/* slept past spin_us (a timer woke it, no work): spinning was a waste */
				e->spin_cur_ns = e->spin_cur_ns / 2 < 1000 ? 0 : e->spin_cur_ns / 2;
				missed_at = 0;
			}
			last_work = 0;              /* the next spin needs new work */
			if (!missed_at && !e->spin_cur_ns && now >= e->spin_hold_until)
				missed_at = now;        /* spin limit 0: the next wake-up says if it should grow */
		} else if (work) {
			continue;
		}
		{
			struct timespec ts, *tsp = NULL;

			if (blocked && next > now + 20000)
				next = now + 20000;
			if (next != UINT64_MAX) {
				uint64_t dt = next > now ? next - now : 0;

				ts.tv_sec = dt / 1000000000ull;
				ts.tv_nsec = dt % 1000000000ull;
				tsp = &ts;
			}
			pfd[0].events = POLLIN;
			e->st.sleeps++;
			if (e->spin_max_ns) {
				uint64_t cap = (uint64_t)e->o.rto_min_us * 1000;

				/* active in the last 100 ms: sleep at most rto_min_us, so that a
				 * post's RTO (at least rto_min_us away) needs no wake-up (idle after
				 * traffic: at most 100 ms of such wake-ups, then no timeout) */
				if (now - e->active_ns < 100000000ull && (!tsp || next > now + cap)) {
					next = now + cap;
					ts.tv_sec = cap / 1000000000ull;
					ts.tv_nsec = cap % 1000000000ull;
					tsp = &ts;
				}
				atomic_store(&e->sleep_until, tsp ? (next > now ? next : now) : UINT64_MAX);
				/* a post between this iteration's read of the count and the store
				 * above may have woken nobody: look again */
				if (atomic_load(&e->posts) != posts_seen) {
					atomic_store(&e->sleep_until, 0);
					continue;
				}
			}
			if (ppoll(pfd, 2, tsp, NULL) > 0 && (pfd[1].revents & POLLIN))
				(void)!read(e->wake_fd, &v, sizeof(v));
			atomic_store(&e->sleep_until, 0);
		}
	}
	return NULL;
}

/* ------------------------------------------------------------------ open / close */

#define DEF(field, v) do { if (!o->field) o->field = (v); } while (0)

static void defaults(struct mrc_eng_opts *o)
{
	DEF(udp_port, MRC_UDP_PORT_DEFAULT);
	DEF(payload, 1024);
	DEF(frames, 8192);
	DEF(frame_size, 4096);
	DEF(ring, 2048);
	DEF(dscp_trimmed, 12);
	DEF(ack_every, 8);
	DEF(ack_delay_us, 50);
	DEF(rto_min_us, 1000);      /* the RTO is max(srtt + 4 rttvar, this) */
	DEF(rto_max_us, 500000);
	DEF(rto_bulk_us, 50000);
	DEF(retry_limit, 12);
	DEF(loss_reorder, 32);
	DEF(window, MRC_PSN_RING / 2);   /* the datapath counts feedback for < MRC_PSN_RING in flight */
	DEF(cc_init_cwnd, 64 * o->payload);
	DEF(cc_pace, 1);
	/* paced, the window may be below one packet (it sets the rate); unpaced, one packet
	 * (spraying rotates EVs per packet: even 1 packet in flight uses every path) */
	DEF(cc_min_cwnd, o->cc_pace == 1 ? o->payload / 16 : o->payload);
	DEF(cc_max_cwnd, o->window * o->payload);
	DEF(cc_target_us, 200);
	DEF(cc_fair_inc, o->cc_pace == 1 ? o->payload / 8 : o->payload);   /* per RTT */
	DEF(cc_prop_gain, 100);
	DEF(cc_md_gamma, 100);
	DEF(cc_max_md, 50);
	DEF(spin_us, MRC_ENG_SPIN_DEFAULT_US);
	DEF(ce_ack, 1);
}

static int pow2(uint32_t v) { return v && !(v & (v - 1)); }

/* every header of any frame lies in a multi-buffer packet's first frame */
_Static_assert(HDR_DATA + MRC_TSETH_LEN + MRC_IMMDT_LEN <= RX_HDR_MIN, "data headers past RX_HDR_MIN");
_Static_assert(OFF_EXT + MRC_SETH_LEN + MRC_CCSTATE_LEN <= RX_HDR_MIN, "SACK headers past RX_HDR_MIN");
_Static_assert(OFF_EXT + MRC_NETH_LEN <= RX_HDR_MIN, "NACK headers past RX_HDR_MIN");

/* The longest data frame of the endpoint's payload, Ethernet header to ICRC (every
 * optional header; a full packet's payload is a multiple of 4: no pad). */
static uint32_t data_frame_max(const struct mrc_eng_opts *o, uint32_t payload)
{
	return HDR_DATA + MRC_IMMDT_LEN + (o->timestamps == 1 ? MRC_TSETH_LEN : 0) + payload + MRC_ICRC_LEN;
}

/* The largest payload whose frames fit one RX frame (a multiple of 64, as the Python
 * side's default payload is). */
static uint32_t single_frame_payload(const struct mrc_eng_opts *o)
{
	uint32_t cap = o->frame_size - MRC_ENG_RX_HEADROOM, over = data_frame_max(o, 0);

	return cap > over + 64 ? (cap - over) / 64 * 64 : 0;
}

static void eng_free(struct mrc_eng *e)
{
	struct qp *q, *n;

	if (e->xsk)
		xsk_socket__delete(e->xsk);
	if (e->umem)
		xsk_umem__delete(e->umem);
	if (e->area)       /* the memory-region space stays: its owner unmaps it (mrc_eng_umem_mr) */
		munmap(e->area, e->mr_given ? e->mr_off : e->area_len);
	if (e->wake_fd >= 0)
		close(e->wake_fd);
	if (e->cq_fd >= 0)
		close(e->cq_fd);
	for (q = e->qps; q; q = n) {
		n = q->next;
		qp_free(q);
	}
	pthread_mutex_destroy(&e->mu);
	pthread_mutex_destroy(&e->cq_mu);
	free(e->tx_free);
	free(e->mrs);
	free(e->cq);
	free(e);
}

static int make_socket(struct mrc_eng *e, uint16_t bind_flags)
{
	struct xsk_umem_config uc = {
		.fill_size = e->n_rx_frames, .comp_size = e->n_tx_frames,
		.frame_size = e->o.frame_size, .frame_headroom = 0, .flags = 0,
	};
	struct xsk_socket_config sc = {
		.rx_size = e->o.ring, .tx_size = e->o.ring,
		.libxdp_flags = XSK_LIBXDP_FLAGS__INHIBIT_PROG_LOAD,
		.xdp_flags = 0, .bind_flags = bind_flags,
	};
	int rc;

	/* tests: a kernel without AF_XDP multi-buffer (before 6.6) refuses the flag so */
	if ((bind_flags & XDP_USE_SG) && getenv("MRC_ENG_TEST_REFUSE_SG"))
		return -EINVAL;
	rc = xsk_umem__create(&e->umem, e->area, e->area_len, &e->fill, &e->comp, &uc);
	if (rc)
		return rc;
	rc = xsk_socket__create(&e->xsk, e->o.ifname, e->o.queue, e->umem, &e->rx, &e->tx, &sc);
	if (rc) {
		e->xsk = NULL;
		xsk_umem__delete(e->umem);
		e->umem = NULL;
	}
	return rc;
}

struct mrc_eng *mrc_eng_open(const struct mrc_eng_opts *opts, char *err, size_t errlen)
{
	struct mrc_eng *e = calloc(1, sizeof(*e));
	uint32_t i, idx, fmax;
	int rc, need_sg, want_sg;

	if (!e) {
		snprintf(err, errlen, "out of memory");
		return NULL;
	}
	e->o = *opts;
	defaults(&e->o);
	e->wake_fd = e->cq_fd = -1;
	pthread_mutex_init(&e->mu, NULL);
	pthread_mutex_init(&e->cq_mu, NULL);
	e->next_qpn = 0x1000;
	if (!pow2(e->o.frames) || e->o.frames < 64 || !pow2(e->o.ring) || !pow2(e->o.window) ||
	    e->o.window < 128 || e->o.window > 16384 || e->o.payload % 4 || !pow2(e->o.frame_size) ||
	    e->o.frame_size < 2048 || e->o.sg > MRC_ENG_SG_ON) {
		snprintf(err, errlen, "engine options: frames, ring, window and frame_size must be powers "
			 "of 2 (window 128..16384, frame_size at least 2048), payload a multiple of 4, "
			 "sg 0..2");
		goto fail;
	}
	/* one frame or several (multi-buffer) per packet: the payload decides */
	fmax = data_frame_max(&e->o, e->o.payload);
	if (fmax - OFF_UDP > 0xFFFF || (fmax + e->o.frame_size - 1) / e->o.frame_size > MRC_ENG_SG_MAX_FRAMES) {
		snprintf(err, errlen, "payload %u: too large (an IPv6 packet is at most 65535 bytes, and "
			 "a packet at most %u UMEM frames of %u bytes)", e->o.payload,
			 MRC_ENG_SG_MAX_FRAMES, e->o.frame_size);
		goto fail;
	}
	need_sg = fmax > e->o.frame_size - MRC_ENG_RX_HEADROOM;
	if (need_sg && e->o.sg == MRC_ENG_SG_OFF) {
		snprintf(err, errlen, "payload %u does not fit one %u-byte UMEM frame (at most %u) and "
			 "multi-buffer (sg) is off", e->o.payload, e->o.frame_size, single_frame_payload(&e->o));
		goto fail;
	}
	want_sg = need_sg || e->o.sg == MRC_ENG_SG_ON || e->o.umem_mr;
	if (e->o.umem_mr && e->o.sg == MRC_ENG_SG_OFF) {
		snprintf(err, errlen, "umem_mr (memory regions sent without a copy) needs multi-buffer "
			 "(sg), which is off");
		goto fail;
	}
	if (e->o.spin_us != MRC_ENG_SPIN_OFF && e->o.spin_us > MRC_ENG_SPIN_MAX_US) {
		snprintf(err, errlen, "engine options: spin_us %u: at most %u microseconds (or off)",
			 e->o.spin_us, MRC_ENG_SPIN_MAX_US);
		goto fail;
	}
	if (e->o.ce_ack > 2) {
		snprintf(err, errlen, "engine options: ce_ack %u: 1 (CE echoes coalesced) or 2 (a SACK "
			 "per CE-marked packet)", e->o.ce_ack);
		goto fail;
	}
	e->spin_max_ns = e->o.spin_us == MRC_ENG_SPIN_OFF ? 0 : (uint64_t)e->o.spin_us * 1000;
	e->spin_cur_ns = e->spin_max_ns;
	e->wake_fd = eventfd(0, EFD_NONBLOCK | EFD_CLOEXEC);
	e->cq_fd = eventfd(0, EFD_NONBLOCK | EFD_CLOEXEC);
	if (e->wake_fd < 0 || e->cq_fd < 0) {
		snprintf(err, errlen, "eventfd: %s", strerror(errno));
		goto fail;
	}
	e->n_rx_frames = e->o.frames / 2;
	e->n_tx_frames = e->o.frames / 2;
	e->mr_off = (uint64_t)e->o.frames * e->o.frame_size;
	e->mr_len = ((uint64_t)e->o.umem_mr + e->o.frame_size - 1) / e->o.frame_size * e->o.frame_size;
	e->area_len = e->mr_off + e->mr_len;
	e->area = mmap(NULL, e->area_len, PROT_READ | PROT_WRITE, MAP_PRIVATE | MAP_ANONYMOUS, -1, 0);
	if (e->area == MAP_FAILED) {
		e->area = NULL;
		snprintf(err, errlen, "UMEM of %llu bytes: %s", (unsigned long long)e->area_len, strerror(errno));
		goto fail;
	}
	/* The kernel frees a closed socket's hold on the queue from a workqueue, so a queue
	 * just given up may still be busy for a moment: retry EBUSY for up to a second. */
	for (i = 0; i < 50; i++) {
		uint16_t sgf = want_sg ? XDP_USE_SG : 0;

		rc = -EOPNOTSUPP;
		if (e->o.zero_copy != 1)
			rc = make_socket(e, XDP_USE_NEED_WAKEUP | XDP_ZEROCOPY | sgf);
		if (rc == 0)
			e->st.zero_copy = 1;
		else if (e->o.zero_copy != 2)
			rc = make_socket(e, XDP_USE_NEED_WAKEUP | XDP_COPY | sgf);
		if (want_sg && (rc == -EINVAL || rc == -EOPNOTSUPP)) {
			/* the kernel refuses XDP_USE_SG (before 6.6 the flag is unknown: EINVAL) */
			e->st.sg_refused = (uint64_t)-rc;
			if (e->o.sg == MRC_ENG_SG_ON) {
				snprintf(err, errlen, "AF_XDP multi-buffer (XDP_USE_SG) refused by the kernel "
					 "on %s: %s (Linux 6.6+ has it); payload %u needs %s",
					 e->o.ifname, strerror(-rc), e->o.payload,
					 need_sg ? "it (or a payload of one frame)" : "it only with sg=2");
				goto fail;
			}
			/* auto: the single-buffer path, the largest payload one frame holds */
			uint32_t fs = e->o.frame_size;

			want_sg = 0;
			e->o = *opts;
			e->o.frame_size = fs;
			e->o.payload = single_frame_payload(&e->o);
			e->o.sg = MRC_ENG_SG_AUTO;
			defaults(&e->o);
			i--;
			continue;
		}
		if (rc != -EBUSY)
			break;
		usleep(20000);
	}
	e->sg = want_sg;
	e->st.sg = (uint64_t)want_sg;
	fmax = data_frame_max(&e->o, e->o.payload);
	e->rx_cap = e->o.frame_size - MRC_ENG_RX_HEADROOM;
	e->tx_fpp = want_sg ? (fmax + e->o.frame_size - 1) / e->o.frame_size : 1;
	e->st.tx_frames_pkt = e->tx_fpp;
	e->st.rx_frames_pkt = want_sg ? (fmax + e->rx_cap - 1) / e->rx_cap : 1;
	if (rc) {
		if (rc == -EAFNOSUPPORT || rc == -ENOPROTOOPT)
			snprintf(err, errlen, "AF_XDP sockets are not available in this kernel "
				 "(CONFIG_XDP_SOCKETS): the transport engine cannot run here");
		else if (rc == -EBUSY)
			snprintf(err, errlen, "%s queue %u already has an AF_XDP socket: one endpoint "
				 "per instance; close the other one first", e->o.ifname, e->o.queue);
		else
			snprintf(err, errlen, "AF_XDP socket on %s queue %u: %s: is the datapath loaded "
				 "and the device up?", e->o.ifname, e->o.queue, strerror(-rc));
		goto fail;
	}
	e->xsk_fd = xsk_socket__fd(e->xsk);
	{       /* copy mode: more descriptors per send syscall than the kernel's 32 (a multi-buffer
		 * packet takes several); kernels before 6.17 refuse the option and keep 32 */
		unsigned int b = e->o.tx_budget ? e->o.tx_budget : 256;

		if (b > e->o.ring)
			b = e->o.ring;
		e->st.tx_budget = 32;
		if (b > 32 && !setsockopt(e->xsk_fd, SOL_XDP, XDP_MAX_TX_SKB_BUDGET, &b, sizeof(b)))
			e->st.tx_budget = b;
	}
	if (e->o.xsks_fd >= 0) {
		__u32 key = e->o.queue;
		int fd = e->xsk_fd;

		if (bpf_map_update_elem(e->o.xsks_fd, &key, &fd, 0)) {
			snprintf(err, errlen, "inserting the socket into the datapath's XSKMAP: %s",
				 strerror(errno));
			goto fail;
		}
	}
	/* RX frames [0, n_rx) on the fill ring; TX frames [n_rx, frames) free */
	if (xsk_ring_prod__reserve(&e->fill, e->n_rx_frames, &idx) != e->n_rx_frames) {
		snprintf(err, errlen, "fill ring smaller than %u", e->n_rx_frames);
		goto fail;
	}
	for (i = 0; i < e->n_rx_frames; i++)
		*xsk_ring_prod__fill_addr(&e->fill, idx + i) = (uint64_t)i * e->o.frame_size;
	xsk_ring_prod__submit(&e->fill, e->n_rx_frames);
	e->tx_free = malloc(sizeof(uint64_t) * e->n_tx_frames);
	if (!e->tx_free) {
		snprintf(err, errlen, "out of memory");
		goto fail;
	}
	for (i = 0; i < e->n_tx_frames; i++)
		e->tx_free[e->n_tx_free++] = (uint64_t)(e->n_rx_frames + i) * e->o.frame_size;
	srandom((unsigned)now_ns());
	crc_fast_check();
	e->st.crc_fast = crc_fast_ok;
	if ((rc = pthread_create(&e->thr, NULL, progress, e))) {
		snprintf(err, errlen, "progress thread: %s", strerror(rc));
		goto fail;
	}
	e->thr_started = 1;
	return e;
fail:
	eng_free(e);
	return NULL;
}

void mrc_eng_close(struct mrc_eng *e)
{
	uint64_t one = 1;

	if (!e)
		return;
	atomic_store(&e->stop, 1);
	(void)!write(e->wake_fd, &one, sizeof(one));
	if (e->thr_started)
		pthread_join(e->thr, NULL);
	eng_free(e);
}
