/* SPDX-License-Identifier: (GPL-2.0 OR BSD-2-Clause) */
/*
 * engine.h - the C API of the MRC transport engine (mrc_xdp/engine/engine.c).
 *
 * One endpoint = one AF_XDP socket on the application side of a host's veth pair
 * (mrc0), one UMEM, and one progress thread that does every per-packet job:
 * packetise, transmit, receive, verify, place, SACK/NACK, retransmit, timers, window.
 * The functions below are called from any thread (Python, through cffi in API mode);
 * they hand work to the progress thread through locked queues and an eventfd and
 * never touch the rings themselves.  Completions come back through a CQ whose eventfd
 * (mrc_eng_cq_fd) is readable while completions are pending.
 *
 * Wire layouts, opcodes and sizes come from bpf/mrc_shared.h (one declaration).
 * cffi reads this header too: only plain types, enums and integer #defines here.
 */
#ifndef MRC_ENGINE_H
#define MRC_ENGINE_H

#include <stdint.h>
#include <stddef.h>

#define MRC_ENG_ACCESS_LOCAL        1
#define MRC_ENG_ACCESS_REMOTE_WRITE 2

/* Completion status (mrc_eng_wc.status). */
#define MRC_WC_SUCCESS          0
#define MRC_WC_RETRY_EXC_ERR    1   /* retry limit reached: peer unreachable */
#define MRC_WC_REM_ACCESS_ERR   2   /* the peer refused the R_Key or the range */
#define MRC_WC_WR_FLUSH_ERR     3   /* QP in error (or destroyed) before the WR ran */
#define MRC_WC_LOC_ACCESS_ERR   4   /* the local MR does not cover the range */

/* Completion opcode (mrc_eng_wc.opcode). */
#define MRC_WC_RDMA_WRITE       0   /* sender: a Write or Write-with-Immediate finished */
#define MRC_WC_RECV_RDMA_IMM    1   /* receiver: a Write-with-Immediate arrived whole */

/* QP states. */
#define MRC_QPS_INIT  1             /* created, not connected */
#define MRC_QPS_RTS   2             /* connected: sends and receives */
#define MRC_QPS_ERR   3

/* A sent PSN's send slot (mrc_qp_stats.una_state: the oldest unacknowledged PSN's, plus
 * MRC_TXP_QUEUED while it waits in the resend queue).  Python names them from here. */
enum mrc_txp_state { MRC_TXP_FREE = 0, MRC_TXP_IN_FLIGHT, MRC_TXP_ACKED, MRC_TXP_LOST };
#define MRC_TXP_QUEUED 4            /* a bit above every state */

/* NACK reason for a refused R_Key / range (no MRC code for it: UET's UNEXP_EVENT, with
 * vendor_info MRC_ENG_VI_ACCESS). */
#define MRC_ENG_VI_ACCESS 1

struct mrc_eng_wc {
	uint64_t wr_id;
	uint32_t qpn;
	uint32_t status;        /* MRC_WC_* */
	uint32_t opcode;        /* MRC_WC_RDMA_WRITE / MRC_WC_RECV_RDMA_IMM */
	uint32_t byte_len;
	uint32_t imm;
	uint32_t has_imm;
};

/* Endpoint options.  Zero means "the default" for every numeric field. */
struct mrc_eng_opts {
	char     ifname[16];        /* mrc0 */
	uint32_t queue;             /* rx queue (0) */
	int32_t  xsks_fd;           /* the datapath's XSKMAP (pinned mrc_xsks); -1: none */
	uint8_t  local_addr[16];    /* this host's MRC address */
	uint8_t  src_mac[6];        /* mrc0's MAC */
	uint8_t  dst_mac[6];        /* mrc0p's MAC */
	uint16_t udp_port;          /* 4791 */
	uint32_t payload;           /* payload bytes per data packet (path MTU); multiple of 4 */
	uint32_t frames;            /* UMEM frames (power of 2; default 8192) */
	uint32_t frame_size;        /* 4096 */
	uint32_t ring;              /* ring sizes (default 2048) */
	uint32_t zero_copy;         /* 0 auto (zero copy if offered), 1 copy only, 2 zero copy only */
	uint32_t dscp_data;         /* DSCP of data (spray may rewrite it) */
	uint32_t dscp_ctrl;         /* DSCP of SACK/NACK */
	uint32_t dscp_trimmed;      /* the DSCP the fabric writes into trimmed frames (12) */
	uint32_t ack_every;         /* SACK at least every N data packets (8) */
	uint32_t ack_delay_us;      /* ... or this long after the first unacknowledged one (50) */
	uint32_t rto_min_us;        /* RTO floor (1000); the RTO is max(srtt + 4 rttvar, floor),
	                             * doubling per expiry up to rto_max_us */
	uint32_t rto_max_us;        /* RTO ceiling (500000) */
	uint32_t retry_limit;       /* consecutive timeouts before the QP goes to error (12) */
	uint32_t loss_reorder;      /* SACK holes this far below the newest SACKed PSN are lost (32) */
	uint32_t window;            /* PSN window (MPR) in packets, power of 2, 128..16384 (512: the
	                             * datapath attributes feedback only within MRC_PSN_RING) */
	uint32_t timestamps;        /* 1: TSETH on every data packet (BTH TS bit), reflected in the
	                             * SACK's CC_STATE: the datapath's time-based loss rule dates
	                             * packets by it, RTT samples from retransmissions too; 0
	                             * (default) or 2: none (the datapath's PSN-distance rule) */
	/* NSCC-style congestion window */
	uint32_t cc_init_cwnd;      /* bytes (default 64 packets) */
	uint32_t cc_min_cwnd;       /* bytes (default 1 packet: spray rotates EVs per packet) */
	uint32_t cc_max_cwnd;       /* bytes (default window * payload) */
	uint32_t cc_target_us;      /* target delay (default 200) */
	uint32_t cc_fair_inc;       /* fair increase: bytes per RTT (default 1 packet) */
	uint32_t cc_prop_gain;      /* proportional increase gain, percent of acked bytes at RTT 0 (default 100) */
	uint32_t cc_md_gamma;       /* multiplicative decrease: percent per (rtt-target)/rtt (default 100) */
	uint32_t cc_max_md;         /* max decrease per RTT, percent (default 50) */
	uint32_t cc_pace;           /* 1 (default): pace at cwnd per min RTT, in flight up to 4 cwnd;
	                             * 2: window only (cwnd bytes in flight, no pacing) */
	uint32_t rto_bulk_us;       /* from the second expiry, what was sent an RTO ago is lost if
	                             * the peer has SACKed a packet sent after it; the rest only
	                             * once the peer has been silent this long (50000): a peer (or
	                             * this thread) descheduled for a few ms on a busy host must
	                             * not cost a window of resends */
	uint32_t spin_us;           /* the most the progress thread spins (polling the RX ring,
	                             * new posts and its timers, no syscall) after its last work
	                             * before it sleeps in ppoll; adaptive below it (see progress()
	                             * in engine.c).  0: the default (MRC_ENG_SPIN_DEFAULT_US);
	                             * MRC_ENG_SPIN_OFF: never spin (sleep as soon as idle);
	                             * at most MRC_ENG_SPIN_MAX_US */
	uint32_t ce_ack;            /* feedback for CE-marked data: 1 (default) coalesced with the
	                             * rest (ack_every / ack_delay_us), the SACK's M=SKIP_ONCE
	                             * echoing the newest marked packet's EV and SETH byte
	                             * MRC_SETH_CE_OFF counting the marked packets; 2: a SACK of
	                             * its own at once for every marked packet (before 0.3) */
	uint32_t sg;                /* AF_XDP multi-buffer (bind flag XDP_USE_SG, kernel 6.6+; copy
	                             * mode too): a packet spans several UMEM frames, chained with
	                             * XDP_PKT_CONTD, so the payload may exceed one frame (up to
	                             * MRC_ENG_SG_MAX_FRAMES frames).  MRC_ENG_SG_AUTO (0): bound
	                             * with it only when the payload does not fit one frame, and if
	                             * the kernel refuses it the payload falls back to the largest
	                             * single-frame one; MRC_ENG_SG_OFF: never (the payload must fit
	                             * one frame); MRC_ENG_SG_ON: always, or the open fails */
	uint32_t umem_mr;           /* bytes of memory-region space inside the UMEM, after the
	                             * frames (rounded up to frame_size; 0: none).  A Write whose
	                             * source lies there goes without the engine's copy: a header
	                             * frame, descriptors pointing at the payload in place, a
	                             * trailer frame (needs multi-buffer: sg is then on).  The
	                             * space stays mapped after close (mrc_eng_umem_mr) */
	uint32_t tx_budget;         /* descriptors one send syscall hands the driver in copy mode
	                             * (setsockopt XDP_MAX_TX_SKB_BUDGET, Linux 6.17+; the kernel's
	                             * own is 32): default 256, at most the TX ring; older
	                             * kernels keep 32 (stats tx_budget says which) */
};

#define MRC_ENG_SG_AUTO         0
#define MRC_ENG_SG_OFF          1
#define MRC_ENG_SG_ON           2
#define MRC_ENG_SG_MAX_FRAMES   18  /* frames per packet: copy-mode TX builds one skb of at most
                                     * MAX_SKB_FRAGS (17) + 1 buffers */
#define MRC_ENG_RX_HEADROOM     256 /* XDP_PACKET_HEADROOM: an RX frame holds frame_size - this */

#define MRC_ENG_LOSS_WINDOW_US  200 /* floor of the time-based loss rule's window: the
                                     * datapath's loss_window_us default (config.md) */
#define MRC_ENG_SPIN_DEFAULT_US 0   /* off: spinning pays only with a caller that spins too
                                     * (write-lat turns both on; docs/transport.md) */
#define MRC_ENG_SPIN_MAX_US     10000
#define MRC_ENG_SPIN_OFF        0xFFFFFFFF

struct mrc_eng_stats {
	uint64_t rx_frames;         /* frames read from the RX ring */
	uint64_t rx_bytes;
	uint64_t rx_data;
	uint64_t rx_sack;
	uint64_t rx_nack;
	uint64_t tx_frames;
	uint64_t tx_bytes;
	uint64_t bad_icrc;          /* ICRC mismatch: dropped */
	uint64_t bad_qpn;           /* no QP with this destination QPN (or another peer): dropped */
	uint64_t bad_rkey;          /* R_Key unknown, no remote write access, or range outside */
	uint64_t out_of_window;     /* PSN beyond the receive window: dropped */
	uint64_t truncated;         /* shorter than its headers / lengths disagree: dropped */
	uint64_t duplicates;        /* data PSN already received: SACKed again, not placed */
	uint64_t trimmed;           /* trimmed data frames (answered with NACK TRIMMED) */
	uint64_t not_mrc;           /* not IPv6/UDP/MRC: dropped */
	uint64_t tx_ring_full;      /* TX ring or UMEM had no room: retried later */
	uint64_t fill_empty;        /* no free UMEM frame to refill the fill ring */
	uint64_t wakeups;           /* sendto() kicks (need_wakeup) */
	uint64_t loops;             /* progress-thread iterations */
	uint64_t sleeps;            /* poll() sleeps */
	uint64_t qps;               /* QPs alive */
	uint64_t umem_free;         /* TX frames free right now */
	uint64_t zero_copy;         /* 1 if the socket is bound in zero-copy mode */
	uint64_t crc_fast;          /* 1: CRC-32 folded with PCLMULQDQ (checked against zlib) */
	uint64_t fb_oow;            /* SACK/NACK naming a PSN outside the sent window: ignored */
	uint64_t spin_hits;         /* spins after work that found more (an RX frame, a post, a
	                             * timer) before their limit: a ppoll sleep and wake-up saved */
	uint64_t spin_misses;       /* spins that ran out: the thread then slept */
	uint64_t spin_yields;       /* spins given up because a caller spins in mrc_eng_cq_wait */
	uint64_t spin_preempted;    /* spins cut short because the thread was descheduled mid-spin
	                             * (CPUs oversubscribed): the limit then drops to 0 for 10 ms */
	uint64_t spin_ns;           /* time spent spinning, in all */
	uint64_t spin_limit_ns;     /* the adaptive spin limit now (0..spin_us) */
	uint64_t post_wakeups;      /* posts that had to wake the sleeping thread (eventfd) */
	uint64_t caller_rx;         /* progress rounds run by a caller spinning in mrc_eng_cq_wait
	                             * (frames it received itself, no hand-off) */
	uint64_t caller_wakeups;    /* ... after which the sleeping thread had to be woken (a
	                             * timer before its wake-up, or packets left to send) */
	uint64_t caller_preempted;  /* caller spins cut short: descheduled mid-spin */
	uint64_t caller_skipped;    /* caller waits that did not spin: the spins before them came
	                             * back empty (1, 3, 7 .. 63 waits skip after each empty one) */
	/* the kernel's counts for the socket (getsockopt XDP_STATISTICS): frames lost
	 * before the engine saw them */
	uint64_t xsk_rx_dropped;    /* dropped by the kernel (e.g. no room in the UMEM) */
	uint64_t xsk_rx_ring_full;  /* RX ring full: the progress thread too slow to read it */
	uint64_t xsk_fill_empty;    /* the fill ring had no frame for an arriving packet */
	/* multi-buffer (opts.sg) */
	uint64_t sg;                /* 1: bound with XDP_USE_SG (multi-buffer path); 0: single-buffer */
	uint64_t sg_refused;        /* errno of the kernel's refusal of XDP_USE_SG (0: not refused or
	                             * not tried); with sg 0 the payload fell back to one frame */
	uint64_t tx_frames_pkt;     /* UMEM frames a full data packet takes on TX (1: single-buffer) */
	uint64_t rx_frames_pkt;     /* ... and on RX (frame_size - MRC_ENG_RX_HEADROOM per frame) */
	uint64_t rx_mb;             /* multi-buffer packets received (chains of XDP_PKT_CONTD frames) */
	uint64_t rx_mb_frames;      /* frames in them */
	uint64_t rx_mb_bad;         /* chains dropped: more than MRC_ENG_SG_MAX_FRAMES frames, or the
	                             * headers not all in the first frame */
	uint64_t tx_mb;             /* multi-buffer packets sent */
	uint64_t tx_mb_frames;      /* frames in them */
	uint64_t xsk_tx_invalid;    /* TX descriptors the kernel refused (XDP_STATISTICS) */
	uint64_t tx_inplace;        /* data packets sent from UMEM memory regions without a copy */
	uint64_t tx_budget;         /* descriptors per send syscall in force (32: the kernel's) */
};

struct mrc_qp_stats {
	uint64_t state;             /* MRC_QPS_* */
	uint64_t tx_pkts;           /* data packets sent, retransmissions included */
	uint64_t tx_bytes;          /* payload bytes sent, retransmissions included */
	uint64_t rtx_pkts;          /* retransmissions, by reason: */
	uint64_t rtx_timeout;
	uint64_t rtx_sack;          /* loss seen in a SACK bitmap (RACK) */
	uint64_t rtx_nack_trim;     /* NACK TRIMMED */
	uint64_t timeouts;          /* RTO expiries */
	uint64_t sacks_rx;
	uint64_t sacks_rx_ecn;      /* SACK M=SKIP_ONCE: forward path CE-marked */
	uint64_t nacks_rx_trim;
	uint64_t nacks_rx_other;
	uint64_t wr_posted;
	uint64_t wr_done;
	uint64_t wr_error;
	uint64_t rx_pkts;           /* data packets placed */
	uint64_t rx_bytes;          /* payload bytes placed */
	uint64_t rx_dup;
	uint64_t rx_msgs;           /* messages received whole */
	uint64_t rx_ce;             /* data packets that arrived CE-marked */
	uint64_t sacks_tx;
	uint64_t nacks_tx_trim;
	uint64_t nacks_tx_access;
	uint64_t srtt_ns;
	uint64_t rttvar_ns;
	uint64_t min_rtt_ns;
	uint64_t rto_ns;
	uint64_t cwnd;              /* bytes */
	uint64_t inflight;          /* bytes sent, not acked nor declared lost */
	uint64_t cc_inc_prop;       /* NSCC decisions, per SACK */
	uint64_t cc_inc_fair;
	uint64_t cc_dec;
	uint64_t cc_hold;
	uint64_t next_psn;          /* next new PSN to send */
	uint64_t una_psn;           /* oldest PSN not acknowledged */
	uint64_t rcv_cack;          /* receiver: every PSN below has arrived */
	uint64_t peer_mpr;          /* the peer's advertised window, PSNs */
	uint64_t retries;           /* consecutive timeouts now */
	uint64_t rtt_ts;            /* RTT samples from reflected TSETH timestamps */
	uint64_t retries_max;       /* most timeouts in a row (past retry_limit: QP error) */
	uint64_t rto_deferred;      /* expiries put off: feedback still waiting in the RX ring */
	uint64_t fb_gap_max_ns;     /* longest time with data in flight and no feedback read (the
	                             * peer silent, or this thread descheduled) */
	uint64_t reo_wnd_ns;        /* the time-based loss rule's reorder window (timestamps=1) */
	uint64_t nacks_rx_stale;    /* NACK TRIMMED of a PSN resent since (the receiver sends
	                             * each twice, on two planes): ignored */
	uint64_t una_state;         /* the oldest unacknowledged PSN's send slot (enum
	                             * mrc_txp_state), + MRC_TXP_QUEUED when queued for resend */
	uint64_t rtx_queued;        /* entries in the resend queue (stale ones included) */
	uint64_t pace_wait_ns;      /* how far ahead of now the pacer holds the next send */
	uint64_t sacks_tx_ecn;      /* receiver: SACKs sent with M=SKIP_ONCE (CE echoed) */
	uint64_t ce_reported;       /* sender: CE-marked packets the peer's SACKs reported
	                             * (SETH byte MRC_SETH_CE_OFF; 1 per M=SKIP_ONCE SACK from a
	                             * peer that leaves it 0) */
};

struct mrc_eng;

/* Open the socket on opts->ifname (in the calling thread's network namespace), insert
 * it into opts->xsks_fd at opts->queue, start the progress thread.  NULL on failure,
 * with one line in err. */
struct mrc_eng *mrc_eng_open(const struct mrc_eng_opts *opts, char *err, size_t errlen);
/* Stop the thread, free everything (QPs, socket, UMEM), remove the XSKMAP entry. */
void mrc_eng_close(struct mrc_eng *e);
int  mrc_eng_cq_fd(struct mrc_eng *e);
void mrc_eng_stats(struct mrc_eng *e, struct mrc_eng_stats *out);
/* The options as they are in force (defaults filled in). */
void mrc_eng_get_opts(struct mrc_eng *e, struct mrc_eng_opts *out);

/* Memory regions: the engine reads/writes the memory directly; the caller keeps it
 * alive until mrc_eng_dereg_mr.  Returns 0 and the key, or -errno. */
int  mrc_eng_reg_mr(struct mrc_eng *e, uint64_t addr, uint64_t len, uint32_t access, uint32_t *rkey);
int  mrc_eng_dereg_mr(struct mrc_eng *e, uint32_t rkey);

/* Queue pairs, named by their (local) QPN, 1..2^24-1; 0 asks for a free one. */
int  mrc_eng_qp_create(struct mrc_eng *e, uint32_t qpn, uint32_t start_psn, uint32_t *qpn_out);
int  mrc_eng_qp_connect(struct mrc_eng *e, uint32_t qpn, const uint8_t *peer_addr16,
			uint32_t remote_qpn, uint32_t remote_start_psn, uint32_t payload);
int  mrc_eng_qp_destroy(struct mrc_eng *e, uint32_t qpn);
int  mrc_eng_qp_stats(struct mrc_eng *e, uint32_t qpn, struct mrc_qp_stats *out);

/* Post an RDMA Write (with_imm: Write-with-Immediate) of len bytes at local address
 * laddr (inside MR lkey) to raddr/rkey of the peer.  0 or -errno. */
int  mrc_eng_post_write(struct mrc_eng *e, uint32_t qpn, uint64_t wr_id, uint64_t laddr,
			uint32_t lkey, uint64_t len, uint64_t raddr, uint32_t rkey,
			int with_imm, uint32_t imm);
/* Take up to max completions; returns how many. */
int  mrc_eng_poll(struct mrc_eng *e, struct mrc_eng_wc *wc, int max);
/* As mrc_eng_poll, but when none is pending spin up to spin_us for the first one (no
 * syscall; the CQ's eventfd is not written while a caller spins), receiving frames that
 * arrive meanwhile in the calling thread; 0: none came, wait on mrc_eng_cq_fd.  For a
 * caller that expects a completion within microseconds. */
int  mrc_eng_cq_wait(struct mrc_eng *e, struct mrc_eng_wc *wc, int max, uint32_t spin_us);

/* ICRC of an IPv6 RoCEv2 packet without its trailer (as mrc_xdp.wire.icrc).  fast: use
 * the PCLMULQDQ fold (if the CPU has it and it matched zlib), else zlib alone. */
uint32_t mrc_eng_icrc(const uint8_t *ip6, uint32_t len);
uint32_t mrc_eng_icrc2(const uint8_t *ip6, uint32_t len, int fast);

/* Tests: run frames through the receive path as n RX descriptors (bufs[i], lens[i] bytes,
 * options opts[i]; MRC_ENG_PKT_CONTD chains a packet's frames), as one RX batch of the
 * progress thread would.  Returns the descriptors consumed (a chain cut at the end is
 * left), or -EINVAL for n above 64. */
#define MRC_ENG_PKT_CONTD 1         /* XDP_PKT_CONTD */

/* The memory-region space inside the UMEM (opts.umem_mr): its address and length (0 if
 * none).  The caller carves memory regions from it (mrc_eng_reg_mr as any other); it
 * stays mapped after mrc_eng_close: the caller munmaps it once nothing uses it. */
void mrc_eng_umem_mr(struct mrc_eng *e, uint64_t *addr, uint64_t *len);
int  mrc_eng_rx_inject(struct mrc_eng *e, uint8_t *const *bufs, const uint32_t *lens,
		       const uint32_t *opts, uint32_t n);

#endif /* MRC_ENGINE_H */
