"""MRC on the wire: scapy layers, EV fields, ICRC, UDP checksum, frame builders, SRv6.

Layouts follow docs/protocol.md (MRC 1.0 as its public material describes it); sizes,
opcodes, enums and every field the document marks (?) come from bpf/mrc_shared.h through
``mrc_xdp.datapath.shared``, so a correction there reaches this module without an edit here.

Dissection: ``parse(frame)`` returns ``Ether(frame)``.  UDP destination port 4791 leads to
``BTH``, the opcode to the extension headers (data: METH, TSETH only when the BTH TS bit is
set, RETH, ImmDt on the *_IMM opcodes).  The 4-byte ICRC trailer is not a layer: it stays
in the last ``Raw`` after the headers (after the data payload and its pad bytes on data
packets, alone on control packets).  ``split_icrc(udp_payload)`` separates it.

ICRC: RoCEv2 invariant CRC over IPv6, as Linux rxe (drivers/infiniband/sw/rxe/rxe_icrc.c)
computes it: zlib's CRC-32 over 8 bytes of 0xFF (the masked LRH), the IPv6 header with
traffic class, flow label and hop limit set to ones, the UDP header with its checksum set
to 0xFFFF, the BTH with byte 4 set to 0xFF, and the rest of the UDP payload up to the
trailer.  The trailer holds that value little-endian when MRC_ICRC_LITTLE_ENDIAN is 1.
"""
from __future__ import annotations

import functools
import ipaddress
import logging
import socket
import struct
import zlib

# scapy inspects the interfaces of the netns it is imported in and warns about each odd
# one ("Interface lo: no address assigned" in a fresh namespace): only errors matter here
logging.getLogger("scapy.runtime").setLevel(logging.ERROR)

from scapy.fields import (BitEnumField, BitField, ByteEnumField, ByteField, IntField,  # noqa: E402
                          ShortField, SignedShortField, StrFixedLenField, XBitField,
                          XByteField, XIntField, XLongField, XShortField)
from scapy.layers.inet import UDP  # noqa: E402
from scapy.layers.inet6 import IPv6  # noqa: E402
from scapy.layers.l2 import Ether  # noqa: E402
from scapy.packet import Packet, bind_bottom_up, bind_layers  # noqa: E402

from mrc_xdp.datapath.shared import CONSTS, NackReason, Opcode, SackM  # noqa: E402

UDP_PORT = CONSTS["MRC_UDP_PORT_DEFAULT"]
ETH_LEN = CONSTS["MRC_ETH_LEN"]
IPV6_LEN = CONSTS["MRC_IPV6_LEN"]
UDP_LEN = 8                       # the UDP header; not an MRC layout
BTH_LEN = CONSTS["MRC_BTH_LEN"]
ICRC_LEN = CONSTS["MRC_ICRC_LEN"]
ICRC_BYTEORDER = "little" if CONSTS["MRC_ICRC_LITTLE_ENDIAN"] else "big"

ETHERTYPE_IPV6 = 0x86DD
NH_UDP = socket.IPPROTO_UDP       # 17
NH_IPV6 = socket.IPPROTO_IPV6     # 41: IPv6 in IPv6 (SRv6 encapsulation)

DATA_OPCODES = frozenset(op for op in Opcode if op.name.startswith("WRITE_"))
IMM_OPCODES = frozenset(op for op in Opcode if op.name.endswith("_IMM"))

SETH_PR = 0x02                    # SETH byte 1 bit 1
DEFAULT_SMAC = "02:00:00:00:00:01"
DEFAULT_DMAC = "02:00:00:00:00:02"

_CRC32_POLY = 0xEDB88320          # reflected CRC-32 (Ethernet, zlib)
_MASKED_LRH = b"\xff" * 8


def _names(enum_cls) -> dict[int, str]:
    return {int(m): m.name for m in enum_cls}


def _bit_fields(width: int, named: dict[str, int], resv_prefix: str,
                enums: dict[str, dict[int, str]] | None = None) -> list:
    """BitFields covering a width-bit region, most significant bit first.

    ``named`` maps a field name to its mask within the region (one contiguous run of
    bits); every run of bits no mask claims becomes a reserved field named
    ``resv_prefix`` + its bit range, e.g. ``b8_resv3_0``.  ``enums`` gives value names to
    some fields.  Masks come from the header, so moving a flag there moves the field here.
    """
    owner: list[str | None] = [None] * width
    for name, mask in named.items():
        run = mask // (mask & -mask) if mask > 0 else 0     # mask shifted down to bit 0
        if not run or mask >> width or run & (run + 1):
            raise ValueError("%s: mask %#x is not one run of bits in %d bits" % (name, mask, width))
        for bit in range(width):
            if mask >> bit & 1:
                if owner[bit] is not None:
                    raise ValueError("%s overlaps %s at bit %d" % (name, owner[bit], bit))
                owner[bit] = name
    fields = []
    hi = width - 1
    while hi >= 0:
        lo = hi
        while lo > 0 and owner[lo - 1] == owner[hi]:
            lo -= 1
        name = owner[hi]
        if name is None:
            name = "%s%d" % (resv_prefix, hi) if hi == lo else "%s%d_%d" % (resv_prefix, hi, lo)
        if enums and name in enums:
            fields.append(BitEnumField(name, 0, hi - lo + 1, enums[name]))
        else:
            fields.append(BitField(name, 0, hi - lo + 1))
        hi = lo - 1
    return fields


def _bth_of(pkt: Packet):
    """The BTH a dissected extension header sits under, or None when built standalone."""
    layer = pkt.underlayer
    while layer is not None and not isinstance(layer, BTH):
        layer = layer.underlayer
    return layer


# ------------------------------------------------------------------ layers

class BTH(Packet):
    """Base Transport Header (12 bytes)."""
    name = "BTH"
    fields_desc = [
        ByteEnumField("opcode", Opcode.WRITE_ONLY, _names(Opcode)),
        BitField("se", 0, 1),
        BitField("migreq", 0, 1),
        BitField("padcnt", 0, 2),
        BitField("tver", 0, 4),
        XShortField("pkey", 0xFFFF),
        XByteField("resv8", 0),
        XBitField("dqpn", 0, 24),
        *_bit_fields(8, {"ackreq": CONSTS["MRC_BTH_B8_ACKREQ"],
                         "rtx": CONSTS["MRC_BTH_B8_RTX"],
                         "ts": CONSTS["MRC_BTH_B8_TS"]}, "b8_resv"),
        BitField("psn", 0, 24),
    ]


class METH(Packet):
    """Message sequence numbers; first header of every data packet."""
    name = "METH"
    fields_desc = [ShortField("rqmsn", 0), ShortField("msn", 0)]

    def guess_payload_class(self, payload):
        bth = _bth_of(self)
        return TSETH if bth is not None and bth.ts else RETH


class TSETH(Packet):
    """Transmit timestamp; present when the BTH TS bit is set."""
    name = "TSETH"
    fields_desc = [ShortField("tx_ts", 0), BitField("tsr", 0, 1),
                   BitField("resv", 0, 11), BitField("ftype", 0, 4)]


class RETH(Packet):
    """RDMA Extended Transport Header: final placement of this packet's payload."""
    name = "RETH"
    fields_desc = [XLongField("va", 0), XIntField("rkey", 0), IntField("dlen", 0)]

    def guess_payload_class(self, payload):
        bth = _bth_of(self)
        if bth is not None and bth.opcode in IMM_OPCODES:
            return ImmDt
        return super().guess_payload_class(payload)


class ImmDt(Packet):
    name = "ImmDt"
    fields_desc = [XIntField("imm", 0)]


class AETH(Packet):
    name = "AETH"
    fields_desc = [XByteField("syndrome", 0), BitField("msn", 0, 24)]


class SETH(Packet):
    """SACK extension header (28 bytes)."""
    name = "SETH"
    fields_desc = [
        BitField("type", 0, 4),
        BitField("next_hdr", 0, 5),                    # byte 0 bits 3-0, byte 1 bit 7
        *_bit_fields(7, {"m": CONSTS["MRC_SETH_M_MASK"] << CONSTS["MRC_SETH_M_SHIFT"],
                         "pr": SETH_PR}, "b1_resv", enums={"m": _names(SackM)}),
        SignedShortField("ack_psn_offset", 0),
        XIntField("entropy", 0),
        ShortField("spdcid", 0),
        ShortField("dpdcid", 0),
        XByteField("resv12", 0),
        BitField("cack_psn", 0, 24),
        BitField("cc_type", 0, 4),
        BitField("cc_flags", 0, 4),
        ByteField("mpr", 0),
        SignedShortField("sack_offset", 0),
        XLongField("sack_bitmap", 0),
    ]


class CCState(Packet):
    """Congestion state carried after the SETH (8 bytes)."""
    name = "CCState"
    fields_desc = [
        ShortField("tx_ts", 0),
        BitField("resv", 0, 1),
        BitField("ooo_count", 0, 15),
        BitField("r_c", 0, 1),
        BitField("rcv_cwnd_pen", 0, 7),
        BitField("rcvd_bytes", 0, 24),
    ]


class NETH(Packet):
    """NACK extension header (20 bytes)."""
    name = "NETH"
    fields_desc = [
        BitField("type", 0, 4),
        BitField("next_hdr", 0, 5),
        *_bit_fields(7, {}, "b1_resv"),
        ByteEnumField("nack_reason", NackReason.TRIMMED, _names(NackReason)),
        XByteField("vendor_info", 0),
        XIntField("entropy", 0),
        ShortField("spdcid", 0),
        ShortField("dpdcid", 0),
        XByteField("resv12", 0),
        BitField("nack_psn", 0, 24),
        BitField("cc_type", 0, 4),
        BitField("cc_flags", 0, 4),
        XByteField("resv17", 0),
        ShortField("tx_ts", 0),
    ]


class PETH(Packet):
    """Probe extension header (16 bytes)."""
    name = "PETH"
    fields_desc = [
        BitField("type", 0, 4),
        BitField("next_hdr", 0, 5),
        *_bit_fields(7, {}, "b1_resv"),
        XByteField("resv2", 0),
        XByteField("vendor_info", 0),
        ShortField("probe_id", 0),
        XShortField("resv6", 0),
        ShortField("spdcid", 0),
        ShortField("dpdcid", 0),
        ShortField("tx_ts", 0),
        BitField("tsr", 0, 1),
        BitField("resv", 0, 11),
        BitField("ftype", 0, 4),
    ]


class ERTH(Packet):
    """Endpoint request header, carried raw."""
    name = "ERTH"
    fields_desc = [StrFixedLenField("data", b"\0" * CONSTS["MRC_ERTH_LEN"],
                                    length=CONSTS["MRC_ERTH_LEN"])]


class EETH(Packet):
    """Endpoint response header, carried raw."""
    name = "EETH"
    fields_desc = [StrFixedLenField("data", b"\0" * CONSTS["MRC_EETH_LEN"],
                                    length=CONSTS["MRC_EETH_LEN"])]


bind_layers(UDP, BTH, dport=UDP_PORT)
for _op in DATA_OPCODES:
    bind_bottom_up(BTH, METH, opcode=int(_op))
bind_layers(BTH, AETH, opcode=int(Opcode.ACK))
bind_layers(BTH, ERTH, opcode=int(Opcode.ENDPOINT_REQ))
bind_layers(BTH, EETH, opcode=int(Opcode.ENDPOINT_RESP))
bind_layers(BTH, SETH, opcode=int(Opcode.SACK))
bind_layers(BTH, NETH, opcode=int(Opcode.NACK))
bind_layers(BTH, PETH, opcode=int(Opcode.PROBE_REQ))
bind_layers(TSETH, RETH)
bind_layers(SETH, CCState)


def parse(frame: bytes) -> Packet:
    """Dissect an Ethernet frame (plain or SRv6-encapsulated)."""
    return Ether(frame)


# ------------------------------------------------------------------ EV

def ev_to_fields(ev: int) -> tuple[int, int]:
    """EV -> (UDP source port, IPv6 flow label): EV[31:16] and EV[15:0]."""
    if not 0 <= ev <= 0xFFFFFFFF:
        raise ValueError("EV out of 32 bits: %r" % ev)
    return ev >> 16, ev & 0xFFFF


def ev_from_fields(sport: int, flowlabel: int) -> int:
    """(UDP source port, IPv6 flow label) -> EV.  Upper 4 label bits are not part of it."""
    return (sport & 0xFFFF) << 16 | (flowlabel & 0xFFFF)


def _udp_ipv6_offset(frame: bytes) -> int:
    """Offset of the IPv6 header carrying UDP: 14, or 54 behind an SRv6 outer header."""
    if len(frame) < ETH_LEN + IPV6_LEN or int.from_bytes(frame[12:14], "big") != ETHERTYPE_IPV6:
        raise ValueError("not an IPv6 Ethernet frame")
    off = ETH_LEN
    if frame[off + 6] == NH_IPV6:
        off += IPV6_LEN
    if len(frame) < off + IPV6_LEN + UDP_LEN or frame[off + 6] != NH_UDP:
        raise ValueError("no UDP directly inside the (inner) IPv6 header")
    return off


def inner_ipv6(frame: bytes) -> bytes:
    """The IPv6 packet carrying UDP (the inner one if SRv6), without Ethernet padding."""
    off = _udp_ipv6_offset(frame)
    plen = int.from_bytes(frame[off + 4:off + 6], "big")
    return bytes(frame[off:off + IPV6_LEN + plen])


def ev_of_frame(frame: bytes) -> int:
    """The EV a frame carries, read from the (inner) IPv6 flow label and UDP source port."""
    off = _udp_ipv6_offset(frame)
    flowlabel = int.from_bytes(frame[off:off + 4], "big") & 0xFFFFF
    sport = int.from_bytes(frame[off + IPV6_LEN:off + IPV6_LEN + 2], "big")
    return ev_from_fields(sport, flowlabel)


# ------------------------------------------------------------------ ICRC

def _require_roce6(ip6: bytes) -> None:
    if len(ip6) < IPV6_LEN + UDP_LEN + BTH_LEN or ip6[0] >> 4 != 6 or ip6[6] != NH_UDP:
        raise ValueError("not IPv6 | UDP | BTH")


def icrc(ip6: bytes) -> int:
    """ICRC of an IPv6 RoCEv2 packet given WITHOUT its 4-byte trailer.

    Length fields are used as they are (on the wire they count the trailer).
    """
    _require_roce6(ip6)
    hdr = bytearray(ip6[:IPV6_LEN + UDP_LEN + BTH_LEN])
    hdr[0] |= 0x0F                                 # traffic class, high nibble
    hdr[1:4] = b"\xff\xff\xff"                     # traffic class low nibble, flow label
    hdr[7] = 0xFF                                  # hop limit
    hdr[IPV6_LEN + 6:IPV6_LEN + 8] = b"\xff\xff"   # UDP checksum
    hdr[IPV6_LEN + UDP_LEN + 4] = 0xFF             # BTH reserved byte (FECN/BECN/resv6)
    crc = zlib.crc32(_MASKED_LRH)
    crc = zlib.crc32(hdr, crc)
    return zlib.crc32(memoryview(ip6)[len(hdr):], crc)


def pack_icrc(value: int) -> bytes:
    """The 4 trailer bytes holding an ICRC value."""
    return value.to_bytes(ICRC_LEN, ICRC_BYTEORDER)


def split_icrc(data: bytes) -> tuple[bytes, int]:
    """Bytes ending with the ICRC trailer (e.g. a UDP payload) -> (everything before, ICRC)."""
    if len(data) < ICRC_LEN:
        raise ValueError("shorter than the ICRC trailer")
    return bytes(data[:-ICRC_LEN]), int.from_bytes(data[-ICRC_LEN:], ICRC_BYTEORDER)


def _set_lengths(ip6: bytearray, plen: int) -> None:
    ip6[4:6] = plen.to_bytes(2, "big")
    ip6[IPV6_LEN + 4:IPV6_LEN + 6] = plen.to_bytes(2, "big")   # UDP length == IPv6 payload


def add_icrc(ip6: bytes) -> bytes:
    """Append the ICRC trailer to an IPv6 RoCEv2 packet.

    Length fields that do not count the trailer yet (IPv6 payload length == bytes after
    the IPv6 header, as scapy builds them) grow by 4 first; fields that already count it
    are kept.  A non-zero UDP checksum is recomputed over the result.
    """
    _require_roce6(ip6)
    pkt = bytearray(ip6)
    plen = int.from_bytes(pkt[4:6], "big")
    if plen == len(pkt) - IPV6_LEN:
        _set_lengths(pkt, plen + ICRC_LEN)
    elif plen != len(pkt) - IPV6_LEN + ICRC_LEN:
        raise ValueError("IPv6 payload length %d fits neither with nor without the trailer" % plen)
    pkt += pack_icrc(icrc(pkt))
    if pkt[IPV6_LEN + 6:IPV6_LEN + 8] != b"\0\0":
        return with_udp6_checksum(pkt)
    return bytes(pkt)


def check_icrc(ip6: bytes) -> bool:
    """Whether an IPv6 RoCEv2 packet's trailer matches its ICRC."""
    body, trailer = split_icrc(ip6)
    return icrc(body) == trailer


def frame_icrc_ok(frame: bytes) -> bool:
    """check_icrc on an Ethernet frame's (inner, if SRv6) IPv6 packet."""
    return check_icrc(inner_ipv6(frame))


@functools.lru_cache(maxsize=None)
def _crc32_table() -> tuple[int, ...]:
    """Reflected CRC-32 table: entry b = raw CRC (init 0, no final xor) of the byte b."""
    table = []
    for byte in range(256):
        c = byte
        for _ in range(8):
            c = (c >> 1) ^ (_CRC32_POLY if c & 1 else 0)
        table.append(c)
    return tuple(table)


def _raw_crc32(data: bytes, state: int = 0) -> int:
    table = _crc32_table()
    for byte in data:
        state = (state >> 8) ^ table[(state ^ byte) & 0xFF]
    return state


def icrc_update_rows(n_rows: int) -> list[list[int]]:
    """ICRC update table for rewriting the UDP source port in place.

    Row n, bit i: raw CRC-32 (reflected, init 0, no final xor) of the 2-byte big-endian
    value 1 << i followed by n zero bytes.  CRC-32 is linear and the two messages have the
    same length, so after a source port change
        new_icrc = old_icrc ^ XOR(row[udp_len - 6][i] for each bit i of old ^ new sport)
    (udp_len - 6 bytes follow the source port up to the trailer).  Row n + 1 is row n
    advanced through one more zero byte.
    """
    table = _crc32_table()
    row = [_raw_crc32((1 << i).to_bytes(2, "big")) for i in range(16)]
    rows = []
    for _ in range(n_rows):
        rows.append(row)
        row = [(c >> 8) ^ table[c & 0xFF] for c in row]
    return rows


def icrc_sport_delta(rows: list[list[int]], udp_len: int, old_sport: int, new_sport: int) -> int:
    """What to XOR into the ICRC when the source port of a udp_len-byte datagram changes."""
    row = rows[udp_len - 2 - ICRC_LEN]    # bytes after the source port, before the trailer
    diff = old_sport ^ new_sport
    delta = 0
    for i in range(16):
        if diff >> i & 1:
            delta ^= row[i]
    return delta


# ------------------------------------------------------------------ UDP checksum

def udp6_checksum(ip6: bytes) -> int:
    """UDP checksum of an IPv6 packet (its checksum field ignored); 0 comes out as 0xFFFF."""
    udp_len = int.from_bytes(ip6[IPV6_LEN + 4:IPV6_LEN + 6], "big")
    seg = bytearray(ip6[IPV6_LEN:IPV6_LEN + udp_len])
    seg[6:8] = b"\0\0"
    data = bytes(ip6[8:40]) + struct.pack("!IxxxB", udp_len, NH_UDP) + seg
    if len(data) % 2:
        data += b"\0"
    total = sum(struct.unpack("!%dH" % (len(data) // 2), data))
    while total >> 16:
        total = (total & 0xFFFF) + (total >> 16)
    return (~total & 0xFFFF) or 0xFFFF


def udp6_checksum_ok(ip6: bytes, allow_zero: bool = True) -> bool:
    """Whether the UDP checksum is valid; 0 (not computed, usual for RoCEv2) passes if allowed."""
    field = int.from_bytes(ip6[IPV6_LEN + 6:IPV6_LEN + 8], "big")
    if field == 0:
        return allow_zero
    return field == udp6_checksum(ip6)


def with_udp6_checksum(ip6: bytes) -> bytes:
    """A copy of an IPv6 | UDP packet with a computed UDP checksum."""
    pkt = bytearray(ip6)
    pkt[IPV6_LEN + 6:IPV6_LEN + 8] = udp6_checksum(pkt).to_bytes(2, "big")
    return bytes(pkt)


# ------------------------------------------------------------------ frame builders

def _frame(src: str, dst: str, transport: Packet, *, ev: int | None = None, tc: int = 0,
           hlim: int = 64, smac: str = DEFAULT_SMAC, dmac: str = DEFAULT_DMAC,
           udp_csum: bool = False) -> bytes:
    """Ethernet | IPv6 | UDP 4791 | transport | ICRC.  ev None means EV 0: the spray
    program chooses the real EV."""
    sport, flowlabel = ev_to_fields(ev or 0)
    pkt = (Ether(src=smac, dst=dmac) /
           IPv6(src=src, dst=dst, tc=tc, fl=flowlabel, hlim=hlim) /
           UDP(sport=sport, dport=UDP_PORT, chksum=0) / transport)
    raw = bytes(pkt)
    ip6 = add_icrc(raw[ETH_LEN:])
    if udp_csum:
        ip6 = with_udp6_checksum(ip6)
    return raw[:ETH_LEN] + ip6


def data_frame(src: str, dst: str, dqpn: int, psn: int, payload: bytes = b"",
               opcode: int = Opcode.WRITE_ONLY, ev: int | None = None, va: int = 0,
               rkey: int = 0, dlen: int | None = None, rqmsn: int = 0, msn: int = 0,
               imm: int | None = None, ts: int | None = None, ackreq: bool = False,
               rtx: bool = False, tc: int = 0, smac: str = DEFAULT_SMAC,
               dmac: str = DEFAULT_DMAC, udp_csum: bool = False, hlim: int = 64) -> bytes:
    """An RDMA Write data frame: BTH | METH | [TSETH if ts is given] | RETH | [ImmDt] |
    payload padded to 4 bytes (BTH PadCnt).  dlen defaults to len(payload); imm defaults to
    0 on *_IMM opcodes and is refused on the others."""
    if opcode not in DATA_OPCODES:
        raise ValueError("not a data opcode: %#x" % opcode)
    if imm is not None and opcode not in IMM_OPCODES:
        raise ValueError("imm given for an opcode without ImmDt")
    pad = -len(payload) % 4
    transport = BTH(opcode=opcode, padcnt=pad, dqpn=dqpn, psn=psn, ackreq=int(ackreq),
                    rtx=int(rtx), ts=int(ts is not None)) / METH(rqmsn=rqmsn, msn=msn)
    if ts is not None:
        transport /= TSETH(tx_ts=ts)
    transport /= RETH(va=va, rkey=rkey, dlen=len(payload) if dlen is None else dlen)
    if opcode in IMM_OPCODES:
        transport /= ImmDt(imm=imm or 0)
    if payload:
        transport /= bytes(payload) + b"\0" * pad
    return _frame(src, dst, transport, ev=ev, tc=tc, hlim=hlim, smac=smac, dmac=dmac,
                  udp_csum=udp_csum)


def sack_frame(src: str, dst: str, dqpn: int, psn: int, cack_psn: int, ev_echo: int,
               m: int = SackM.NONE, ack_psn_offset: int = 0, sack_offset: int = 0,
               bitmap: int = 0, seth: dict | None = None, cc: dict | None = None,
               **frame_opts) -> bytes:
    """SACK: BTH | SETH | CCState.  seth: further SETH fields (mpr, pr, spdcid, ...);
    cc: CCState fields; frame_opts: ev, tc, hlim, smac, dmac, udp_csum."""
    transport = (BTH(opcode=Opcode.SACK, dqpn=dqpn, psn=psn) /
                 SETH(cack_psn=cack_psn, entropy=ev_echo, m=m, ack_psn_offset=ack_psn_offset,
                      sack_offset=sack_offset, sack_bitmap=bitmap, **(seth or {})) /
                 CCState(**(cc or {})))
    return _frame(src, dst, transport, **frame_opts)


def nack_frame(src: str, dst: str, dqpn: int, psn: int, nack_psn: int, ev_echo: int,
               reason: int = NackReason.TRIMMED, neth: dict | None = None,
               **frame_opts) -> bytes:
    """NACK: BTH | NETH.  neth: further NETH fields; frame_opts as in sack_frame."""
    transport = (BTH(opcode=Opcode.NACK, dqpn=dqpn, psn=psn) /
                 NETH(nack_psn=nack_psn, entropy=ev_echo, nack_reason=reason, **(neth or {})))
    return _frame(src, dst, transport, **frame_opts)


def probe_frame(src: str, dst: str, dqpn: int = CONSTS["MRC_QPN_PROBE"], psn: int = 0,
                probe_id: int = 0, tx_ts: int = 0, peth: dict | None = None,
                **frame_opts) -> bytes:
    """PROBE_REQ: BTH | PETH (elicits a SACK).  The default QPN is the connectionless EV
    probe QPN.  peth: further PETH fields; frame_opts as in sack_frame."""
    transport = (BTH(opcode=Opcode.PROBE_REQ, dqpn=dqpn, psn=psn) /
                 PETH(probe_id=probe_id, tx_ts=tx_ts, **(peth or {})))
    return _frame(src, dst, transport, **frame_opts)


def ack_frame(src: str, dst: str, dqpn: int, psn: int, msn: int = 0, syndrome: int = 0,
              **frame_opts) -> bytes:
    """ACK: BTH | AETH.  frame_opts as in sack_frame."""
    transport = BTH(opcode=Opcode.ACK, dqpn=dqpn, psn=psn) / AETH(syndrome=syndrome, msn=msn)
    return _frame(src, dst, transport, **frame_opts)


# ------------------------------------------------------------------ SRv6

def usid_address(block: str, usids: list[int]) -> str:
    """F3216 uSID address: the 32-bit block (an address or /32 prefix such as
    "fcbb:bb00::"), then one 16-bit uSID per hop, then zeros."""
    base = int(ipaddress.IPv6Address(block.split("/")[0]))
    if base & ((1 << 96) - 1):
        raise ValueError("block %r has bits set beyond the first 32" % block)
    if len(usids) > CONSTS["MRC_USID_MAX"]:
        raise ValueError("at most %d uSIDs in one address" % CONSTS["MRC_USID_MAX"])
    for k, usid in enumerate(usids):
        if not 0 < usid <= 0xFFFF:
            raise ValueError("uSID out of range (1..0xffff): %r" % usid)
        base |= usid << (96 - 16 * (k + 1))
    return str(ipaddress.IPv6Address(base))


def srv6_encap(frame: bytes, outer_src: str, outer_dst: str, hlim: int = 64) -> bytes:
    """Put an outer IPv6 header (next header 41) around a plain frame's IPv6 packet.  The
    outer version / traffic class / flow label word is the inner one."""
    if _udp_ipv6_offset(frame) != ETH_LEN:
        raise ValueError("frame is already encapsulated")
    inner = inner_ipv6(frame)
    outer = (inner[:4] + struct.pack("!HBB", len(inner), NH_IPV6, hlim) +
             socket.inet_pton(socket.AF_INET6, outer_src) +
             socket.inet_pton(socket.AF_INET6, outer_dst))
    return bytes(frame[:ETH_LEN]) + outer + inner


def srv6_decap(frame: bytes) -> bytes:
    """Remove the outer IPv6 header of an SRv6 frame.  An outer CE mark is copied to an
    ECN-capable inner packet (RFC 6040), as the ingress program does."""
    if _udp_ipv6_offset(frame) != ETH_LEN + IPV6_LEN:
        raise ValueError("frame is not SRv6-encapsulated")
    inner = bytearray(inner_ipv6(frame))
    outer_ecn = frame[ETH_LEN + 1] >> 4 & 3
    if outer_ecn == 3 and inner[1] >> 4 & 3:
        inner[1] |= 0x30
    return bytes(frame[:ETH_LEN]) + bytes(inner)
