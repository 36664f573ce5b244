/* SPDX-License-Identifier: (GPL-2.0 OR BSD-2-Clause) */
/*
 * maps.h - the host datapath's maps, declared with the names from mrc_shared.h.
 * bcc cannot call map methods through a macro, so use sites spell the identifier
 * (mrc_cfg.lookup); a name changed in the header then fails to compile here.
 */
#ifndef MRC_MAPS_H
#define MRC_MAPS_H

#include "mrc_shared.h"

BPF_ARRAY(MRC_MAP_CFG, struct mrc_config, 1);
BPF_ARRAY(MRC_MAP_PLANES, struct mrc_plane, MRC_MAX_PLANES);
BPF_HASH(MRC_MAP_IFPLANE, __u32, __u32, MRC_MAX_PLANES);
BPF_DEVMAP(MRC_MAP_PORTS, MRC_PORTS_LEN);
/* per connection: (peer, remote QPN, TX), (peer, local QPN, RX), and for connectionless
 * probes (peer, MRC_QPN_PROBE, TX/RX) naming the first connection to that peer */
BPF_HASH(MRC_MAP_CONNIDX, struct mrc_conn_key, __u32, 4 * MRC_MAX_CONNS);
BPF_ARRAY(MRC_MAP_CONNS, struct mrc_conn, MRC_MAX_CONNS);
BPF_ARRAY(MRC_MAP_EVS, struct mrc_ev, MRC_MAX_CONNS * MRC_EV_SLOTS);
BPF_HASH(MRC_MAP_EVIDX, struct mrc_evidx_key, __u32, MRC_MAX_CONNS * MRC_EV_SLOTS);
BPF_PERCPU_ARRAY(MRC_MAP_EVCTR, struct mrc_ev_ctr, MRC_MAX_CONNS * MRC_EV_SLOTS);
BPF_PERCPU_ARRAY(MRC_MAP_ROT, struct mrc_rot, MRC_MAX_CONNS);
BPF_PERCPU_ARRAY(MRC_MAP_CCACHE, struct mrc_ccache, 1);
BPF_ARRAY(MRC_MAP_PSN, struct mrc_psn_ent, MRC_MAX_CONNS * MRC_PSN_RING);
BPF_ARRAY(MRC_MAP_SRV6, struct mrc_srv6_tmpl, MRC_MAX_TMPL);
BPF_ARRAY(MRC_MAP_ICRC, struct mrc_icrc_row, MRC_ICRC_TBL_LEN);
BPF_PERCPU_ARRAY(MRC_MAP_STATS, __u64, MRC_C_MAX);
BPF_TABLE("lru_percpu_hash", struct mrc_evidx_key, struct mrc_rxev_ctr, MRC_MAP_RXEV, MRC_RXEV_MAX);
BPF_RINGBUF_OUTPUT(MRC_MAP_EVENTS, MRC_EVENTS_BYTES / 4096);
BPF_XSKMAP(MRC_MAP_XSKS, MRC_XSK_MAX);
BPF_HASH(MRC_MAP_PROBES, __u32, struct mrc_probe, MRC_PROBE_SLOTS);
BPF_ARRAY(MRC_MAP_PTB, struct mrc_ptb, 1);
BPF_ARRAY(MRC_MAP_CRC, __u32, 256);

#endif
