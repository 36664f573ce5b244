/* SPDX-License-Identifier: (GPL-2.0 OR BSD-2-Clause) */
/*
 * mrc_shared.h - the one declaration of everything that crosses the C/Python line.
 *
 * BPF programs include it; Python reads it with cffi (mrc_xdp/shared.py), so no
 * layout, enum or map name is ever written twice.  Rules that keep it readable by
 * cffi: fixed-width __uN types only, naturally aligned structs (no packed), integer
 * #defines, identifier #defines only for map names (MRC_MAP_* / MRC_LMAP_*), no
 * function-like macros, no other preprocessor logic besides the include guard.
 */
#ifndef MRC_SHARED_H
#define MRC_SHARED_H

/* ------------------------------------------------------------------ sizes */
#define MRC_MAX_CONNS        1024   /* connections per host instance (every per-connection
                                     * map is sized from it: docs/datapath.md, "Scale") */
#define MRC_MAX_PLANES       8
#define MRC_EV_SLOTS         128    /* per connection: active + backup (a power of 2) */
#define MRC_EV_ACTIVE_MAX    64     /* slots [0,64) active, [64,128) backup: ev_per_plane x
                                     * planes <= 64, backup_per_plane x planes <= 64 */
#define MRC_PSN_RING         1024   /* PSN -> EV ring per connection */
#define MRC_MAX_TMPL         256    /* SRv6 row templates */
#define MRC_USID_MAX         6      /* uSIDs in one F3216 address */
#define MRC_ICRC_TBL_LEN     32832  /* ICRC update rows: udp_len - 6 < this (a 32 KiB payload) */
#define MRC_RXEV_MAX         16384  /* receiver-side per-EV counters (LRU): 16 x MRC_MAX_CONNS */
#define MRC_LOSS_BATCH       2      /* losses attributed per SACK at most */
#define MRC_FB_WINDOW        32768  /* feedback: cack and bitmap base at most this far behind
                                     * the newest PSN sent + 1 (the reach of SETH's offsets) */
#define MRC_BACKUP_PER_PLANE_MAX 16 /* backup EVs per plane (bounds the replacement scan) */
#define MRC_XSK_MAX          64     /* AF_XDP sockets (one per rx queue) */
#define MRC_EVENTS_BYTES     262144 /* EV state-change ring buffer */
#define MRC_LINK_MAX         1024   /* lab link models (keyed by ifindex) */
#define MRC_PROBE_SLOTS      4096   /* probes in flight from user space (mrc_probes) */

/* ------------------------------------------------------------------ wire */
#define MRC_UDP_PORT_DEFAULT 4791
#define MRC_BTH_LEN          12
#define MRC_METH_LEN         4
#define MRC_TSETH_LEN        4
#define MRC_RETH_LEN         16
#define MRC_IMMDT_LEN        4
#define MRC_AETH_LEN         4
#define MRC_SETH_LEN         28
#define MRC_CCSTATE_LEN      8
#define MRC_NETH_LEN         20
#define MRC_PETH_LEN         16
#define MRC_ERTH_LEN         16
#define MRC_EETH_LEN         36
#define MRC_ICRC_LEN         4
#define MRC_IPV6_LEN         40
#define MRC_ETH_LEN          14
/* Fields marked (?) in mrc-wire.md: one constant each, corrected here only. */
#define MRC_BTH_B8_ACKREQ    0x80   /* BTH byte 8 bit 7 */
#define MRC_BTH_B8_RTX       0x20   /* (?) BTH byte 8 bit 5: retransmission */
#define MRC_BTH_B8_TS        0x10   /* (?) BTH byte 8 bit 4: TSETH present */
/* TSETH's tx timestamp (16 bits, echoed in the SACK's CC_STATE): CLOCK_MONOTONIC in units
 * of MRC_TS_UNIT_NS, truncated (wraps every 65.5 ms; 0 = no timestamp, the engine sends 1
 * instead).  The engine stamps with clock_gettime(CLOCK_MONOTONIC), ingress reads the same
 * clock (bpf_ktime_get_ns), so RTTs and reorder windows up to 32 ms compare correctly. */
#define MRC_TS_UNIT_NS       1000
#define MRC_TS_WINDOW_MAX    30000  /* reorder windows and RTT samples, in TS units, below this */
#define MRC_MIN_RTT_WLEN_NS  10000000000  /* min RTT: the least sample of (about) 10 s */
#define MRC_SETH_M_SHIFT     5      /* SETH byte 1 bits 6-5 */
#define MRC_SETH_M_MASK      3
#define MRC_SETH_CE_OFF      12     /* (?) SETH byte 12 (reserved in the public layout): the
                                     * number of CE-marked data packets this SACK reports (since
                                     * the receiver's previous SACK, at most 255): mrc-xdp's
                                     * receiver coalesces SACKs for marked packets and echoes the
                                     * newest marked packet's EV, and the sender's window counts
                                     * this many packets as marked (0 from a receiver that does
                                     * not fill it: every byte the SACK acknowledges) */
#define MRC_QPN_PROBE        2      /* connectionless EV probes */
#define MRC_SETH_PR          0x02   /* SETH byte 1 bit 1: the SACK answers a PROBE_REQ */
#define MRC_REO_STEPS_MAX    8      /* the reorder window grows to (1 + steps) x itself */
#define MRC_REO_DECAY_NS     1000000000ULL  /* one step back per second without a late packet */
/* A probe answer is a SACK with PR set: entropy = the probed EV, cack_psn = the probe's
 * PSN, spdcid/dpdcid swapped, CC_STATE tx timestamp = the probe's, and the probe id in the
 * SETH bytes below (sack_offset: no bitmap rides on a probe answer). */
#define MRC_PANS_ID_OFF      18     /* (?) SETH byte offset of the echoed probe id */
#define MRC_PETH_VI_OFF      3      /* PETH vendor_info: 0, or 1 + the T1 the probed EV
                                     * goes through (our probers set it); the answer comes
                                     * back through that same T1, so a probe of a live path
                                     * is not lost on a dead T1 of the way back */
/* The ICRC trailer is the CRC-32 value stored little-endian, as Linux rxe does. */
#define MRC_ICRC_LITTLE_ENDIAN 1

enum mrc_opcode {
	MRC_OP_WRITE_FIRST      = 0xC6,
	MRC_OP_WRITE_MIDDLE     = 0xC7,
	MRC_OP_WRITE_LAST       = 0xC8,
	MRC_OP_WRITE_LAST_IMM   = 0xC9,
	MRC_OP_WRITE_ONLY       = 0xCA,
	MRC_OP_WRITE_ONLY_IMM   = 0xCB,
	MRC_OP_ACK              = 0xD1,
	MRC_OP_ENDPOINT_REQ     = 0xD8,
	MRC_OP_ENDPOINT_RESP    = 0xD9,
	MRC_OP_SACK             = 0xDC,
	MRC_OP_NACK             = 0xDD,
	MRC_OP_PROBE_REQ        = 0xDE,
};

enum mrc_sack_m {
	MRC_M_NONE        = 0,
	MRC_M_SKIP_ONCE   = 1,
	MRC_M_ALWAYS_SKIP = 2,
};

enum mrc_nack_reason {
	MRC_NACK_TRIMMED         = 0x01,
	MRC_NACK_TRIMMED_LASTHOP = 0x02,
	MRC_NACK_NO_BITMAP       = 0x06,
	MRC_NACK_NO_PKT_BUFFER   = 0x07,
	MRC_NACK_NO_RESOURCE     = 0x0A,
	MRC_NACK_PSN_OOR_WINDOW  = 0x0B,
	MRC_NACK_UNEXP_EVENT     = 0x19,
};

/* ------------------------------------------------------------------ EV state */
enum mrc_ev_state {
	MRC_EV_UNUSED      = 0,   /* slot holds no EV */
	MRC_EV_GOOD        = 1,
	MRC_EV_SKIP        = 2,   /* skipped for one rotation, then GOOD */
	MRC_EV_ASSUMED_BAD = 3,   /* never selected; probed, resurrected by user space */
	MRC_EV_DENIED      = 4,   /* operator; never auto-recovers */
};

/* Why an EV changed state (events, per-EV counters). */
enum mrc_ev_reason {
	MRC_R_NONE        = 0,
	MRC_R_SACK_SKIP   = 1,   /* SACK M=SKIP_ONCE: forward path ECN-marked */
	MRC_R_NACK_TRIM   = 2,   /* NACK TRIMMED (TRIMMED_LASTHOP is counted only: last-hop
	                          * congestion hits every EV, skipping one cannot help) */
	MRC_R_SACK_ALWAYS = 3,   /* SACK M=ALWAYS_SKIP */
	MRC_R_LOSS        = 4,   /* SACK bitmap hole sent more than the reorder window before
	                          * the packet whose SACK reports it (time-based, TSETH) */
	MRC_R_SKIP_DONE   = 5,   /* SKIP consumed by one rotation */
	MRC_R_REPLACED    = 6,   /* backup EV promoted into an active slot */
	MRC_R_OPERATOR    = 7,   /* deny / allow from user space */
	MRC_R_PROBE_OK    = 8,   /* resurrected after probes */
	MRC_R_LINK_DOWN   = 9,   /* the plane NIC went down (daemon) */
	MRC_R_LINK_UP     = 10,  /* the plane NIC came back up (daemon) */
	MRC_R_PROBE_FAIL  = 11,  /* background probes of a GOOD EV went unanswered (daemon) */
	MRC_R_LOSS_PSN    = 12,  /* SACK bitmap hole loss_reorder PSNs below the newest SACKed
	                          * PSN: the fallback rule for packets sent without TSETH */
};

/* Operator / daemon EV change, run by user space through BPF_PROG_TEST_RUN of mrc_evop
 * (the frame is this struct): under the connection's swap lock, emits an event. */
struct mrc_evop {
	__u32 conn;
	__u32 ev;
	__u32 slot;             /* out: the slot the EV was in */
	__u8  state;            /* in: new enum mrc_ev_state */
	__u8  reason;           /* in: enum mrc_ev_reason */
	__u8  old_state;        /* out */
	__u8  pad;
};
#define MRC_EVOP_OK        0
#define MRC_EVOP_BUSY      1   /* the connection's swap lock is held: try again */
#define MRC_EVOP_NO_EV     2   /* the EV is not in the connection's set */
#define MRC_EVOP_BAD       3   /* malformed request (connection id, state) */

enum mrc_mode {
	MRC_MODE_ECMP = 0,
	MRC_MODE_SRV6 = 1,
};

/* mrc_config.flags */
#define MRC_CF_DSCP_REWRITE  1   /* spray writes DSCP by packet class */
#define MRC_CF_SET_ECT       2   /* spray marks Not-ECT data ECT(0) so the fabric can mark CE */

/* ------------------------------------------------------------------ maps */
/* Map names: at most 15 characters, spelled once.  Pinned under
 * /sys/fs/bpf/mrc/<instance>/<name>. */
#define MRC_MAP_CFG      mrc_cfg       /* ARRAY[1]            struct mrc_config */
#define MRC_MAP_PLANES   mrc_planes    /* ARRAY[MAX_PLANES]   struct mrc_plane */
#define MRC_MAP_IFPLANE  mrc_ifplane   /* HASH ifindex ->     __u32 plane */
#define MRC_MAP_PORTS    mrc_ports     /* DEVMAP: plane p -> NIC; MRC_PORT_ENGINE -> fabric side of mrc0 */
#define MRC_MAP_CONNIDX  mrc_connidx   /* HASH struct mrc_conn_key -> __u32 conn id */
#define MRC_MAP_CONNS    mrc_conns     /* ARRAY[MAX_CONNS]    struct mrc_conn */
#define MRC_MAP_EVS      mrc_evs       /* ARRAY[MAX_CONNS*EV_SLOTS] struct mrc_ev */
#define MRC_MAP_EVIDX    mrc_evidx     /* HASH struct mrc_evidx_key -> __u32 slot */
#define MRC_MAP_EVCTR    mrc_evctr     /* PERCPU_ARRAY[MAX_CONNS*EV_SLOTS] struct mrc_ev_ctr, by cidx */
#define MRC_MAP_ROT      mrc_rot       /* PERCPU_ARRAY[MAX_CONNS] struct mrc_rot */
#define MRC_MAP_CCACHE   mrc_ccache    /* PERCPU_ARRAY[1] struct mrc_ccache */
#define MRC_MAP_PSN      mrc_psn       /* ARRAY[MAX_CONNS*PSN_RING] struct mrc_psn_ent */
#define MRC_MAP_SRV6     mrc_srv6      /* ARRAY[MAX_TMPL]     struct mrc_srv6_tmpl */
#define MRC_MAP_ICRC     mrc_icrc      /* ARRAY[ICRC_TBL_LEN] struct mrc_icrc_row */
#define MRC_MAP_STATS    mrc_stats     /* PERCPU_ARRAY[MRC_C_MAX] __u64 */
#define MRC_MAP_RXEV     mrc_rxev      /* LRU_PERCPU_HASH struct mrc_evidx_key -> struct mrc_rxev_ctr */
#define MRC_MAP_EVENTS   mrc_events    /* RINGBUF struct mrc_event */
#define MRC_MAP_XSKS     mrc_xsks      /* XSKMAP rx queue -> AF_XDP socket */
#define MRC_MAP_PROBES   mrc_probes    /* HASH __u32 probe id -> struct mrc_probe (user space inserts) */
#define MRC_MAP_PTB      mrc_ptb       /* ARRAY[1] struct mrc_ptb: probe answer token bucket */
#define MRC_MAP_CRC      mrc_crc       /* ARRAY[256] __u32: CRC-32 table (probe answers' ICRC) */

#define MRC_PORT_ENGINE  MRC_MAX_PLANES  /* devmap key of the fabric side of mrc0 */
#define MRC_PORTS_LEN    9               /* MRC_MAX_PLANES + 1 */

/* Program names (function names in bpf/mrc_datapath.c). */
#define MRC_PROG_SPRAY   mrc_spray
#define MRC_PROG_INGRESS mrc_ingress
#define MRC_PROG_ENGINE  mrc_to_engine
#define MRC_PROG_EVOP    mrc_evop      /* never attached: run by user space (test_run) */

struct mrc_config {
	__u32 mode;             /* enum mrc_mode */
	__u32 nplanes;
	__u32 udp_port;         /* 4791 */
	__u32 flags;            /* MRC_CF_* */
	__u32 loss_reorder;     /* fallback (packets without TSETH): a SACK hole this many PSNs
	                         * below the newest SACKed PSN is a loss */
	__u32 loss_thresh;      /* losses on one EV before ASSUMED_BAD */
	__u8  local_addr[16];   /* this host's MRC address (inner destination of our traffic) */
	__u8  app_mac[6];       /* mrc0 (engine side): destination MAC of frames to the engine */
	__u8  fab_mac[6];       /* mrc0p: source MAC of frames to the engine */
	__u8  dscp_data;        /* trimmable data */
	__u8  dscp_ctrl;        /* SACK/NACK/ACK/probes, never trimmed */
	__u8  dscp_rtx;         /* retransmissions */
	__u8  hop_limit;        /* outer IPv6 hop limit (SRv6) */
	__u32 probe_rate;       /* probe answers per second at most (token bucket); 0 = none */
	__u32 probe_burst;      /* bucket depth: answers in one burst */
	/* Time-based loss (RACK): a SACK hole is a loss when the missing packet was sent more
	 * than the reorder window before the packet whose SACK reports it.  The window is
	 * max(loss_window_us, min(min RTT / loss_window_div + 4 x RTT spread, mean RTT))
	 * (RACK: min RTT / 4, at most SRTT; the spread, the mean of RTT samples above the
	 * minimum, is the reordering queues and busy CPUs make between paths), per
	 * connection (mrc_conn.reo_wnd). */
	__u32 loss_window_us;   /* floor, MRC_TS_UNIT_NS units (us), below MRC_TS_WINDOW_MAX */
	__u32 loss_window_div;  /* min RTT divisor; 0: the floor alone */
};

struct mrc_plane {
	__u32 ifindex;          /* plane NIC */
	__u8  smac[6];          /* plane NIC MAC */
	__u8  dmac[6];          /* next hop (T0 port) MAC */
	__u8  src_addr[16];     /* SRv6: outer source, our locator on this plane */
	__u8  local_sid[16];    /* SRv6: outer DA of traffic to us; first 48 bits compared */
	__u32 flags;            /* MRC_PF_*: written at load (0) and by the health daemon */
};
/* mrc_plane.flags */
#define MRC_PF_DOWN          1   /* plane NIC down: spray uses none of the plane's EVs (the
                                  * other planes share its turns equally); EV states unchanged */
#define MRC_PF_ADMIN         2   /* out of rotation by the operator (`mrc-xdp plane out`);
                                  * the daemon never touches it */
#define MRC_PF_OUT           3   /* either: spray passes the plane's turns on */

#define MRC_DIR_TX 0   /* key: peer address + the peer's (destination) QPN */
#define MRC_DIR_RX 1   /* key: peer address + our QPN (feedback and data to us) */

struct mrc_conn_key {
	__u8  peer[16];
	__u32 qpn;
	__u32 dir;
};

struct mrc_conn {
	__u8  peer[16];
	__u32 local_qpn;
	__u32 remote_qpn;
	__u16 ev_per_plane;     /* active EVs per plane: slots [p*n, (p+1)*n) */
	__u16 backup_per_plane; /* backups per plane: slots 256 + [p*n, (p+1)*n) */
	__u16 tmpl;             /* SRv6 row template index */
	__u16 flags;
	__u16 stride[4];        /* rotation strides, each coprime with ev_per_plane */
	__u64 lock;             /* cmpxchg guard for slot swaps */
	__u64 txseq;            /* data packets sent (atomic): send order for loss attribution */
	__u32 psn_hi;           /* PSN of the newest data sent (not retransmissions): the upper
	                         * edge of the sent window that feedback must fall in */
	__u32 reo_wnd;          /* reorder window of the time-based loss rule, TS units (ingress) */
	__u32 min_rtt;          /* least RTT sample (TS units) from reflected TSETH timestamps;
	                         * 0 = none yet */
	__u32 rtt_spread;       /* how far RTT samples lie above min_rtt: the mean of
	                         * (rtt - min_rtt), gain 1/8 per sample (TS units) */
	__u64 min_rtt_ns;       /* bpf_ktime_get_ns() when min_rtt was taken (it ages out after
	                         * MRC_MIN_RTT_WLEN_NS) */
	__u32 rx_plane;         /* 1 + the plane the peer's newest data arrived on (ingress);
	                         * 0 = none yet.  Our SACKs and NACKs go back on that plane
	                         * first: it is alive towards us, and a plane whose NIC or
	                         * link died at either end carries nothing to us once the
	                         * peer has retired it, so our feedback avoids it too */
	__u32 reo_steps;        /* packets judged lost that arrived after all (late) widened
	                         * the reorder window to (1 + reo_steps) x the RTT-based one,
	                         * one step per RTT at most; one step back per
	                         * MRC_REO_DECAY_NS without one, every such period
	                         * counted at the next RTT sample (RACK grows its window on
	                         * D-SACKs the same way) */
	__u64 reo_ns;           /* bpf_ktime_get_ns() of the last step up or down */
	__u32 fb_cack;          /* the newest cumulative ack seen in a SACK (ingress) */
	__u32 judged;           /* MRC_JUDGED_VALID | the PSN the time-based rule judged lost
	                         * last (ingress): a later SACK that shows it arrived before
	                         * any resend of it proves it late (late_arrival) */
};
#define MRC_JUDGED_VALID 0x80000000

struct mrc_ev {
	__u32 ev;               /* EV[31:16] -> UDP sport, EV[15:0] -> flow label */
	__u8  state;            /* enum mrc_ev_state */
	__u8  plane;
	__u8  t1;               /* T1 index for SRv6 paths */
	__u8  reason;           /* enum mrc_ev_reason of the last change */
	__u32 cidx;             /* counter index: slot where this EV was configured */
	__u32 losses;           /* attributed losses since last GOOD */
	__u64 changed_ns;       /* bpf_ktime_get_ns() of the last change */
};

struct mrc_evidx_key {
	__u32 conn;
	__u32 ev;
};

struct mrc_ev_ctr {
	__u64 tx_pkts;
	__u64 tx_bytes;
	__u64 sack;             /* SACKs echoing this EV */
	__u64 nack;
	__u64 ecn;              /* SACK M=SKIP_ONCE (forward path marked) */
	__u64 trim;             /* NACK TRIMMED */
	__u64 loss;             /* losses attributed from SACK bitmaps */
	__u64 skipped;          /* rotations in which the EV was passed over */
};

struct mrc_rxev_ctr {
	__u64 pkts;
	__u64 bytes;
	__u64 ce;
};

/* Rotation inside one plane: position i of round r uses EV index
 * (i * stride_r + off_r) mod n, kept incrementally (cur) so the hot path divides only
 * when a round starts.  The four fields are read and written as one 64-bit word
 * (little-endian hosts: i is the low 16 bits).  Positions consumed = round * n + i. */
struct mrc_rot_plane {
	__u16 i;                /* position within the current round (n: round finished) */
	__u16 cur;              /* EV index for position i */
	__u16 stride;           /* 0: never used */
	__u16 round;
};

#define MRC_SKIP_BATCH 4   /* SKIP EVs passed over (and reported) per packet at most */

struct mrc_rot {
	__u32 plane;                    /* plane of the next packet (round robin) */
	__u32 slot;                     /* the slot ev_select() chose for this packet */
	__u32 nskip;                    /* SKIP EVs passed over by this packet ... */
	__u32 skipped[MRC_SKIP_BATCH];  /* ... and their slots */
	__u32 bad1;                     /* an ASSUMED_BAD active slot met (slot + 1), to swap */
	struct mrc_rot_plane p[MRC_MAX_PLANES];
};

/* Per CPU: the connection of the previous packet, per direction (id + 1; 0 = none); and
 * ingress scratch: why each EV a SACK retires is retired (enum mrc_ev_reason), kept in
 * map memory so the verifier walks the retirement once, not once per reason constant. */
struct mrc_ccache {
	__u32 cid1[2];
	__u8  why[8];
};

struct mrc_psn_ent {
	__u32 psn;
	__u32 ev;
	__u16 flags;            /* MRC_PSNF_* */
	__u16 ts;               /* TSETH tx timestamp of this transmission; 0 = none (fallback) */
	__u32 txseq;            /* the connection's send order of this transmission: a hole is
	                         * a loss only if sent before the packet that triggered the SACK */
};
#define MRC_PSNF_VALID  1
#define MRC_PSNF_LOST   2
#define MRC_PSNF_RESENT 4   /* resent before the loss rule judged it: the entry is still the
                             * first send's; a SACK it triggers is dated by its reflection */
#define MRC_PSNF_JUDGED 8   /* the loss rule judged this PSN lost: kept by the retransmission
                             * that takes the entry, so that when the cumulative ack passes
                             * the PSN before that resend can have arrived, the first send
                             * was only late (ingress: late_arrival) */

struct mrc_srv6_tmpl {
	__u8  block[4];                 /* 32-bit uSID block */
	__u16 usid[MRC_USID_MAX];       /* host order, plane bits zero */
	__u8  n_usid;
	__u8  t1_pos;                   /* index of the T1 uSID; 255 = none */
	__u8  plane_shift;              /* plane number << plane_shift is OR-ed into every uSID */
	__u8  t1_shift;                 /* t1 index << t1_shift is OR-ed into usid[t1_pos] */
};

/* CRC-32 delta of flipping sport bit i (bit 15 = MSB of the first wire byte),
 * followed by n zero bytes (n = udp_len - 6): row n of mrc_icrc. */
struct mrc_icrc_row {
	__u32 bit[16];
};

/* One probe in flight: user space inserts it (BPF_NOEXIST: ids are taken atomically
 * across processes) before sending, ingress fills rx_ns when the answer arrives. */
struct mrc_probe {
	__u8  peer[16];         /* the answer must come from here ... */
	__u32 ev;               /* ... echo this EV ... */
	__u32 psn;              /* ... and this PSN (the probe's BTH PSN, a nonce) */
	__u64 sent_ns;          /* CLOCK_MONOTONIC (bpf_ktime_get_ns) just before sending */
	__u64 rx_ns;            /* answer arrival, bpf_ktime_get_ns(); 0 = none yet */
	__u32 plane;            /* plane the answer arrived on */
	__u32 owner;            /* pid of the prober (stale entries are reaped by it) */
};

/* GCRA token bucket: a probe is answered when tat - now <= (burst - 1) / rate. */
struct mrc_ptb {
	__u64 tat;              /* theoretical arrival time of the next answer, ns */
};

struct mrc_event {
	__u64 ts_ns;
	__u32 conn;
	__u32 ev;
	__u16 slot;
	__u8  old_state;
	__u8  new_state;
	__u8  reason;
	__u8  plane;
	__u16 pad;
	__u32 other_ev;         /* for MRC_R_REPLACED: the EV that was retired */
	__u32 pad2;
};

/* Global counters, per CPU, summed and printed by name by user space. */
enum mrc_ctr {
	MRC_C_SPRAY_RX = 0,         /* frames seen by spray */
	MRC_C_SPRAY_TX,             /* MRC frames sprayed and redirected */
	MRC_C_SPRAY_BYTES,
	MRC_C_SPRAY_NON_MRC,        /* passed unchanged */
	MRC_C_SPRAY_NO_CONN,        /* MRC for an unknown connection: passed unchanged */
	MRC_C_SPRAY_NO_EV,          /* no usable EV: dropped */
	MRC_C_SPRAY_NO_PORT,        /* plane has no NIC: dropped */
	MRC_C_SPRAY_SRV6_ENCAP,
	MRC_C_SPRAY_NO_TMPL,        /* SRv6: connection's template missing or encap failed: dropped */
	MRC_C_SPRAY_ICRC_FIX,
	MRC_C_SPRAY_CSUM_FIX,
	MRC_C_SPRAY_SKIP,           /* SKIP EV passed over (and returned to GOOD) */
	MRC_C_SPRAY_SWAP,           /* retired EV met in an active slot: a backup swapped in */
	MRC_C_SPRAY_DATA,
	MRC_C_SPRAY_CTRL,
	MRC_C_ING_RX,               /* frames seen by ingress */
	MRC_C_ING_NON_MRC,
	MRC_C_ING_DECAP,
	MRC_C_ING_CE_COPY,          /* outer CE copied to inner on decap */
	MRC_C_ING_NOT_OURS,         /* MRC not addressed to this host: passed */
	MRC_C_ING_DATA,
	MRC_C_ING_DATA_CE,
	MRC_C_ING_SACK,
	MRC_C_ING_NACK,
	MRC_C_ING_ACK,
	MRC_C_ING_PROBE,
	MRC_C_ING_OTHER,            /* endpoint request/response */
	MRC_C_ING_TO_ENGINE,
	MRC_C_ING_FB_NO_CONN,       /* feedback not from a known connection: no EV change */
	MRC_C_ING_FB_NO_EV,         /* feedback echoing an EV not in the set */
	MRC_C_ING_FB_SKIP,
	MRC_C_ING_FB_BAD,
	MRC_C_ING_FB_REPLACED,
	MRC_C_ING_FB_NO_BACKUP,
	MRC_C_ING_FB_BUSY,          /* replacement raced another CPU: spray retries it */
	MRC_C_ING_NACK_LASTHOP,     /* NACK TRIMMED_LASTHOP: counted, no EV change */
	MRC_C_ING_LOSS,
	MRC_C_ENG_RX,               /* mrc0: frames arriving for the engine */
	MRC_C_ENG_XSK,              /* redirected to an AF_XDP socket */
	MRC_C_ENG_PASS,             /* to the kernel stack (UDP fallback) */
	MRC_C_BAD_TRUNC_IPV6,       /* malformed MRC (UDP 4791): counted, dropped */
	MRC_C_BAD_TRUNC_UDP,
	MRC_C_BAD_UDP_LEN,
	MRC_C_BAD_TRUNC_BTH,
	MRC_C_BAD_TRUNC_EXT,
	MRC_C_BAD_TOO_LONG,         /* beyond the ICRC update table */
	MRC_C_BAD_SRV6,             /* SRv6 (ingress): outer length is not exactly the inner packet */
	MRC_C_NON_MRC_VLAN,         /* subsets of NON_MRC, for the curious */
	MRC_C_NON_MRC_IPV4,
	MRC_C_NON_MRC_EXTHDR,
	MRC_C_NON_MRC_ROCE,         /* UDP 4791 with a BTH opcode MRC does not use (plain RoCEv2) */
	MRC_C_EVENTS_LOST,          /* EV events the ring buffer had no room for */
	MRC_C_ING_FB_OOW,           /* feedback outside the sent window (PSNs never sent or no
	                             * longer in flight): no EV change, no loss attribution */
	MRC_C_SPRAY_PROBE,          /* PROBE_REQ sent on the EV it names (no rotation) */
	MRC_C_SPRAY_PROBE_NO_EV,    /* PROBE_REQ naming an EV not in the set: dropped */
	MRC_C_SPRAY_PROBE_DENIED,   /* PROBE_REQ naming a DENIED EV: dropped */
	MRC_C_ING_PROBE_ANSWERED,   /* PROBE_REQ turned into its answer and sent back (XDP_TX) */
	MRC_C_ING_PROBE_NOT_PEER,   /* PROBE_REQ from no configured peer: dropped */
	MRC_C_ING_PROBE_RATE,       /* PROBE_REQ over the answer rate limit: dropped */
	MRC_C_ING_PROBE_BAD,        /* PROBE_REQ not answerable (not a bare PETH, no plane,
	                             * no room, no template): dropped */
	MRC_C_ING_PROBE_ANS,        /* probe answer for one of our probes: recorded, dropped */
	MRC_C_ING_PROBE_ANS_UNKNOWN,/* probe answer matching no probe in flight: dropped */
	MRC_C_EVOP,                 /* EV state set by user space (mrc_evop) */
	MRC_C_EVOP_BUSY,            /* ... found the swap lock held (retried by user space) */
	MRC_C_SPRAY_LAST_RESORT,    /* no GOOD EV on any plane in rotation: sent on a retired
	                             * (ASSUMED_BAD) EV rather than dropped */
	MRC_C_SPRAY_SKIP_RESORT,    /* every EV tried sat out its SKIP turn (ECN): sent on the
	                             * first of them (GOOD again) rather than dropped */
	MRC_C_ING_LOSS_PSN,         /* losses (in ING_LOSS) found by the PSN-distance fallback */
	MRC_C_ING_RTT,              /* RTT samples from reflected TSETH timestamps */
	MRC_C_ING_LATE,             /* packets judged lost by the time-based rule that arrived
	                             * after all (the cumulative ack passed the oldest first) */
	MRC_C_ING_REO_GROW,         /* ... that widened the reorder window one step */
	/* EVs retired (GOOD/SKIP -> ASSUMED_BAD or DENIED), by why: */
	MRC_C_RETIRE_LOSS,          /* time-based loss (MRC_R_LOSS) */
	MRC_C_RETIRE_LOSS_PSN,      /* PSN-distance fallback (MRC_R_LOSS_PSN) */
	MRC_C_RETIRE_ALWAYS,        /* SACK M=ALWAYS_SKIP */
	MRC_C_RETIRE_PROBE,         /* user space, MRC_R_PROBE_FAIL: the daemon's probes */
	MRC_C_RETIRE_OPERATOR,      /* user space, MRC_R_OPERATOR: deny */
	/* multi-buffer frames (frags-aware programs only, docs/datapath.md): */
	MRC_C_NON_MRC_FRAG_HDR,     /* subset of NON_MRC: a multi-buffer frame whose Ethernet, IPv6,
	                             * UDP headers or BTH opcode are not all in its linear part */
	MRC_C_BAD_FRAG_HDR,         /* MRC whose BTH + extension headers are not all in the linear
	                             * part of its multi-buffer frame: counted, dropped */
	MRC_C_SPRAY_ICRC_FRAG,      /* subset of SPRAY_ICRC_FIX: the trailer was beyond the linear
	                             * part (bpf_xdp_load_bytes / store_bytes) */
	MRC_C_MAX,
};

/* ------------------------------------------------------------------ lab link model */
/* bpf/linkmodel.c: one XDP program at the receiving end of every fabric link of a lab,
 * maps keyed by the receiving ifindex (unique across the lab), pinned under
 * /sys/fs/bpf/mrc/lab-<prefix>/. */
#define MRC_LMAP_CFG     mrc_lcfg      /* HASH ifindex -> struct mrc_link_cfg */
#define MRC_LMAP_STATE   mrc_lstate    /* HASH ifindex -> struct mrc_link_state */
#define MRC_LMAP_STATS   mrc_lstats    /* PERCPU_HASH ifindex -> struct mrc_link_ctr */
#define MRC_LMAP_NEXT    mrc_lnext     /* PROG_ARRAY[MRC_LNEXT_MAX]: run after the model */
#define MRC_PROG_LINK    mrc_link
#define MRC_LNEXT_MAX    2048          /* host index * planes + plane: 250 hosts x 8 planes */

#define MRC_LF_ECN       1             /* mark CE above ecn_bytes (off on the last hop) */
#define MRC_LF_TRIM      2             /* trim MRC data above trim_bytes */
#define MRC_LF_BLACKHOLE 4             /* drop everything */
#define MRC_LF_USID_END  8             /* srv6 lab on a kernel without seg6local: uN here */

struct mrc_link_cfg {
	__u64 rate_bps;         /* phantom queue drain rate; 0 = unlimited (no queue) */
	__u32 ecn_bytes;        /* mark CE above this backlog */
	__u32 trim_bytes;       /* trim above this backlog */
	__u32 drop_bytes;       /* drop above this backlog; 0 = never */
	__u32 loss_ppm;         /* random loss, parts per million */
	__u32 flags;            /* MRC_LF_* */
	__u32 flap_period_ms;   /* 0 = no flap; else down for the second half of each period */
	__u8  dscp_trimmed;     /* DSCP written into trimmed packets (outer and inner) */
	__u8  dscp_ctrl;        /* packets with this DSCP are never trimmed */
	__u16 udp_port;         /* MRC UDP destination port (4791) */
	__u32 next_prog;        /* 0: XDP_PASS; n: tail-call mrc_lnext[n - 1] after a pass */
	__u32 usid_block;       /* MRC_LF_USID_END: the F3216 block (DA bytes 0-3, host order) */
	__u32 usid_self;        /* MRC_LF_USID_END: this switch's uSID (DA bytes 4-5) */
};

struct mrc_link_state {
	__u64 backlog;          /* phantom queue bytes at last_ns */
	__u64 last_ns;          /* bpf_ktime_get_ns() of the last update; in the future = frozen */
	__u64 lock;             /* cmpxchg guard */
};

/* Per link end, per CPU.  pkts/bytes/mrc_pkts count every arriving frame (before
 * any drop); the rest count what the model did. */
struct mrc_link_ctr {
	__u64 pkts;
	__u64 bytes;
	__u64 marked;           /* CE set */
	__u64 trimmed;
	__u64 drop_queue;       /* backlog above drop_bytes */
	__u64 drop_loss;        /* loss_ppm */
	__u64 drop_blackhole;
	__u64 drop_flap;
	__u64 mrc_pkts;         /* IPv6/UDP to udp_port (any opcode) */
	__u64 usid_end;         /* MRC_LF_USID_END: outer destinations shifted to the next uSID */
};

#endif /* MRC_SHARED_H */
