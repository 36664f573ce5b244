"""libbpf through cffi: test_run, pins, and map access by fd.

bcc 0.26 has no BPF_PROG_TEST_RUN wrapper and no way to open a pinned map from another
process, so both go through libbpf.so.1 here.  Everything that reads live state after the
loader has exited (CLI ``stats``, exporters, tests) uses ``PinnedMap``.
"""
from __future__ import annotations

import errno
import os

import cffi

ffi = cffi.FFI()
ffi.cdef("""
struct bpf_test_run_opts {
    size_t sz;
    const void *data_in;
    void *data_out;
    uint32_t data_size_in;
    uint32_t data_size_out;
    const void *ctx_in;
    void *ctx_out;
    uint32_t ctx_size_in;
    uint32_t ctx_size_out;
    uint32_t retval;
    int repeat;
    uint32_t duration;
    uint32_t flags;
    uint32_t cpu;
    uint32_t batch_size;
};
int bpf_prog_test_run_opts(int prog_fd, struct bpf_test_run_opts *opts);
struct bpf_prog_load_opts {      /* libbpf 1.1 (Debian 12); sz says how much of it we know */
    size_t sz;
    int attempts;
    int expected_attach_type;
    uint32_t prog_btf_fd;
    uint32_t prog_flags;
    uint32_t prog_ifindex;
    uint32_t kern_version;
    uint32_t attach_btf_id;
    uint32_t attach_prog_fd;
    uint32_t attach_btf_obj_fd;
    const int *fd_array;
    const void *func_info;
    uint32_t func_info_cnt;
    uint32_t func_info_rec_size;
    const void *line_info;
    uint32_t line_info_cnt;
    uint32_t line_info_rec_size;
    uint32_t log_level;
    uint32_t log_size;
    char *log_buf;
};
int bpf_prog_load(int prog_type, const char *prog_name, const char *license,
                  const void *insns, size_t insn_cnt, const struct bpf_prog_load_opts *opts);
int bpf_obj_pin(int fd, const char *pathname);
int bpf_obj_get(const char *pathname);
int bpf_map_lookup_elem(int fd, const void *key, void *value);
int bpf_map_update_elem(int fd, const void *key, const void *value, uint64_t flags);
int bpf_map_delete_elem(int fd, const void *key);
int bpf_map_get_next_key(int fd, const void *key, void *next_key);
int bpf_map_update_batch(int fd, const void *keys, const void *values, uint32_t *count, const void *opts);
int bpf_map_lookup_batch(int fd, void *in_batch, void *out_batch, void *keys, void *values,
                         uint32_t *count, const void *opts);
int bpf_obj_get_info_by_fd(int bpf_fd, void *info, uint32_t *info_len);
int libbpf_num_possible_cpus(void);
struct bpf_map_create_opts {     /* libbpf 1.1 (Debian 12) */
    size_t sz;
    uint32_t btf_fd;
    uint32_t btf_key_type_id;
    uint32_t btf_value_type_id;
    uint32_t btf_vmlinux_value_type_id;
    uint32_t inner_map_fd;
    uint32_t map_flags;
    uint64_t map_extra;
    uint32_t numa_node;
    uint32_t map_ifindex;
};
int bpf_map_create(int map_type, const char *map_name, uint32_t key_size, uint32_t value_size,
                   uint32_t max_entries, const struct bpf_map_create_opts *opts);
int bpf_prog_get_next_id(uint32_t start_id, uint32_t *next_id);
int bpf_map_get_next_id(uint32_t start_id, uint32_t *next_id);
struct xdp_md_ctx { uint32_t data, data_end, data_meta, ingress_ifindex, rx_queue_index, egress_ifindex; };
struct mrc_map_info {
    uint32_t type; uint32_t id; uint32_t key_size; uint32_t value_size;
    uint32_t max_entries; uint32_t map_flags; char name[16];
};
struct mrc_prog_info {   /* uapi struct bpf_prog_info up to attach_btf_id (append-only ABI) */
    uint32_t type; uint32_t id; uint8_t tag[8]; uint32_t jited_prog_len; uint32_t xlated_prog_len;
    uint64_t jited_prog_insns; uint64_t xlated_prog_insns; uint64_t load_time;
    uint32_t created_by_uid; uint32_t nr_map_ids; uint64_t map_ids; char name[16];
    uint32_t ifindex; uint32_t gpl_compatible_bits; uint64_t netns_dev; uint64_t netns_ino;
    uint32_t nr_jited_ksyms; uint32_t nr_jited_func_lens; uint64_t jited_ksyms; uint64_t jited_func_lens;
    uint32_t btf_id; uint32_t func_info_rec_size; uint64_t func_info;
    uint32_t nr_func_info; uint32_t nr_line_info; uint64_t line_info; uint64_t jited_line_info;
    uint32_t nr_jited_line_info; uint32_t line_info_rec_size; uint32_t jited_line_info_rec_size;
    uint32_t nr_prog_tags; uint64_t prog_tags; uint64_t run_time_ns; uint64_t run_cnt;
    uint64_t recursion_misses; uint32_t verified_insns; uint32_t attach_btf_obj_id; uint32_t attach_btf_id;
    uint32_t pad;
};
struct ring_buffer;
typedef int (*ring_buffer_sample_fn)(void *ctx, void *data, size_t size);
struct ring_buffer *ring_buffer__new(int map_fd, ring_buffer_sample_fn sample_cb, void *ctx, const void *opts);
int ring_buffer__poll(struct ring_buffer *rb, int timeout_ms);
void ring_buffer__free(struct ring_buffer *rb);
""")

try:
    lib = ffi.dlopen("libbpf.so.1")
except OSError as e:  # pragma: no cover - set-up installs libbpf1
    raise ImportError("libbpf.so.1 not found: install the libbpf1 package (make setup does)") from e

XDP_ABORTED, XDP_DROP, XDP_PASS, XDP_TX, XDP_REDIRECT = range(5)
XDP_NAMES = {0: "ABORTED", 1: "DROP", 2: "PASS", 3: "TX", 4: "REDIRECT"}

# enum bpf_map_type values used here
MAP_PERCPU_HASH, MAP_PERCPU_ARRAY, MAP_LRU_PERCPU_HASH = 5, 6, 10
PERCPU_TYPES = {MAP_PERCPU_HASH, MAP_PERCPU_ARRAY, MAP_LRU_PERCPU_HASH}
BPF_ANY, BPF_NOEXIST, BPF_EXIST = 0, 1, 2

NCPUS = lib.libbpf_num_possible_cpus()


class BpfError(OSError):
    pass


def _check(rc: int, what: str) -> int:
    if rc < 0:
        e = -rc if rc != -1 else ffi.errno
        raise BpfError(e, "%s: %s" % (what, os.strerror(e)))
    return rc


TEST_RUN_LINEAR_MAX = 4096 - 256 - 320   # page - XDP_PACKET_HEADROOM - skb_shared_info


def prog_test_run(prog_fd: int, data: bytes, repeat: int = 1, ifindex: int = 0,
                  rx_queue: int = 0, out_size: int = 0, linear: int | None = None):
    """Run an XDP program on one frame. Returns (retval, output bytes, duration ns/run).

    Use repeat=1 for correctness (the kernel reuses the buffer across repeats) and a
    large repeat only for timing.  ifindex sets xdp_md.ingress_ifindex (it must name a
    device in the caller's network namespace).

    Multi-buffer frames (net/bpf/test_run.c): a frame longer than TEST_RUN_LINEAR_MAX
    (3520 B with 4 KiB pages) is given to the program as that many linear bytes plus
    page-sized frags, whatever the program's frags flag.  linear (xdp_md.data_end) asks
    for a shorter linear part (6.1 and 6.18 take it; a kernel that wants data_end equal
    to the frame's length refuses it with EINVAL).
    """
    out = ffi.new("unsigned char[]", out_size or (len(data) + 512))
    opts = ffi.new("struct bpf_test_run_opts *")
    opts.sz = ffi.sizeof("struct bpf_test_run_opts")
    buf_in = ffi.from_buffer(data)
    opts.data_in = buf_in
    opts.data_size_in = len(data)
    opts.data_out = out
    opts.data_size_out = len(out)
    opts.repeat = repeat
    ctx = None
    if ifindex or rx_queue or linear is not None:
        ctx = ffi.new("struct xdp_md_ctx *")
        ctx.data_end = len(data) if linear is None else linear
        ctx.ingress_ifindex = ifindex
        ctx.rx_queue_index = rx_queue
        opts.ctx_in = ctx
        opts.ctx_size_in = ffi.sizeof("struct xdp_md_ctx")
    _check(lib.bpf_prog_test_run_opts(prog_fd, opts), "BPF_PROG_TEST_RUN")
    return opts.retval, bytes(ffi.buffer(out, opts.data_size_out)), opts.duration


BPF_PROG_TYPE_XDP = 6
BPF_XDP = 37                    # enum bpf_attach_type: expected_attach_type of an XDP program
BPF_F_XDP_HAS_FRAGS = 1 << 5    # prog_flags: the program handles multi-buffer frames (5.18+)
BPF_INSN_LEN = 8


class LoadRefused(BpfError):
    """The kernel refused a program load; .log holds the verifier's output (if any)."""

    def __init__(self, err: int, msg: str, log: str = ""):
        super().__init__(err, msg)
        self.log = log


def prog_load_xdp(name: str, insns: bytes, flags: int = 0, license: str = "GPL",
                  log_size: int = 1 << 20) -> int:
    """Load finished XDP instructions (e.g. bcc's ``BPF.dump_func``: map fds already in
    their ld_imm64) with program flags, which bcc 0.26's Python ``load_func`` cannot pass.
    Returns the program fd (close it yourself); LoadRefused with the verifier log when the
    kernel says no (retried with the log on, so a good load costs one verification)."""
    if len(insns) % BPF_INSN_LEN or not insns:
        raise ValueError("%s: %d bytes are not whole BPF instructions" % (name, len(insns)))
    buf = ffi.from_buffer(insns)
    cnt = len(insns) // BPF_INSN_LEN

    def _load(log):
        opts = ffi.new("struct bpf_prog_load_opts *")
        opts.sz = ffi.sizeof("struct bpf_prog_load_opts")
        opts.expected_attach_type = BPF_XDP
        opts.prog_flags = flags
        if log is not None:
            opts.log_level = 1
            opts.log_size = len(log)
            opts.log_buf = log
        return lib.bpf_prog_load(BPF_PROG_TYPE_XDP, name[:15].encode(), license.encode(), buf, cnt, opts)

    fd = _load(None)
    if fd >= 0:
        return fd
    err = -fd if fd != -1 else ffi.errno
    log = ffi.new("char[]", log_size)
    fd = _load(log)
    if fd >= 0:          # a transient failure (EAGAIN past libbpf's retries): loaded now
        return fd
    text = ffi.string(log).decode(errors="replace")
    raise LoadRefused(err, "load %s (prog_flags %#x): %s" % (name, flags, os.strerror(err)), text)


def obj_pin(fd: int, path: str) -> None:
    _check(lib.bpf_obj_pin(fd, path.encode()), "pin %s" % path)


def obj_get(path: str) -> int:
    return _check(lib.bpf_obj_get(path.encode()), "open pin %s" % path)


def map_create(map_type: int, key_size: int, value_size: int, max_entries: int, name: str = "",
               flags: int = 0) -> int:
    """A new map (an fd; close it yourself); flags: BPF_F_* map flags."""
    opts = ffi.NULL
    if flags:
        opts = ffi.new("struct bpf_map_create_opts *")
        opts.sz = ffi.sizeof("struct bpf_map_create_opts")
        opts.map_flags = flags
    return _check(lib.bpf_map_create(map_type, name[:15].encode() if name else ffi.NULL, key_size, value_size,
                                     max_entries, opts), "map create %s" % (name or "(unnamed)"))


def _ids(next_fn) -> set[int]:
    out, cur = set(), ffi.new("uint32_t *")
    start = 0
    while next_fn(start, cur) == 0:
        start = cur[0]
        out.add(start)
    return out


def prog_ids() -> set[int]:
    """The id of every BPF program in the kernel now (BPF_PROG_GET_NEXT_ID)."""
    return _ids(lib.bpf_prog_get_next_id)


def map_ids() -> set[int]:
    """The id of every BPF map in the kernel now (BPF_MAP_GET_NEXT_ID)."""
    return _ids(lib.bpf_map_get_next_id)


def map_info(fd: int):
    info = ffi.new("struct mrc_map_info *")
    n = ffi.new("uint32_t *", ffi.sizeof("struct mrc_map_info"))
    _check(lib.bpf_obj_get_info_by_fd(fd, info, n), "map info")
    return info


def prog_info(fd: int):
    info = ffi.new("struct mrc_prog_info *")
    n = ffi.new("uint32_t *", ffi.sizeof("struct mrc_prog_info"))
    _check(lib.bpf_obj_get_info_by_fd(fd, info, n), "prog info")
    return info


class Map:
    """A BPF map by fd: raw-bytes access, per-CPU values split per CPU."""

    def __init__(self, fd: int, name: str = "", owns_fd: bool = True):
        self.fd = fd
        self.owns_fd = owns_fd
        info = map_info(fd)
        self.type = info.type
        self.key_size = info.key_size
        self.value_size = info.value_size
        self.max_entries = info.max_entries
        self.name = name or ffi.string(info.name).decode()
        self.percpu = self.type in PERCPU_TYPES
        self._stride = (self.value_size + 7) & ~7
        self._vbuf_len = self._stride * NCPUS if self.percpu else self.value_size

    @classmethod
    def open_pinned(cls, path: str) -> "Map":
        return cls(obj_get(path), os.path.basename(path))

    def close(self):
        if self.owns_fd and self.fd >= 0:
            os.close(self.fd)
            self.fd = -1

    def __enter__(self):
        return self

    def __exit__(self, *a):
        self.close()

    def _key(self, key) -> bytes:
        if isinstance(key, int):
            key = key.to_bytes(self.key_size, "little")
        if len(key) != self.key_size:
            raise ValueError("%s: key is %d bytes, map wants %d" % (self.name, len(key), self.key_size))
        return key

    def lookup(self, key):
        """bytes (or list of per-CPU bytes), or None when absent."""
        v = ffi.new("unsigned char[]", self._vbuf_len)
        rc = lib.bpf_map_lookup_elem(self.fd, self._key(key), v)
        if rc < 0:
            e = -rc if rc != -1 else ffi.errno
            if e == errno.ENOENT:
                return None
            _check(rc, "lookup %s" % self.name)
        raw = bytes(ffi.buffer(v, self._vbuf_len))
        if self.percpu:
            return [raw[i * self._stride:i * self._stride + self.value_size] for i in range(NCPUS)]
        return raw

    def update(self, key, value, flags: int = BPF_ANY) -> None:
        if self.percpu:
            if isinstance(value, (bytes, bytearray)):
                value = [value] * NCPUS
            buf = b"".join(bytes(v).ljust(self._stride, b"\0") for v in value)
        else:
            buf = bytes(value)
            if len(buf) != self.value_size:
                raise ValueError("%s: value is %d bytes, map wants %d" % (self.name, len(buf), self.value_size))
        _check(lib.bpf_map_update_elem(self.fd, self._key(key), buf, flags), "update %s" % self.name)

    def delete(self, key) -> bool:
        rc = lib.bpf_map_delete_elem(self.fd, self._key(key))
        if rc < 0:
            e = -rc if rc != -1 else ffi.errno
            if e == errno.ENOENT:
                return False
            _check(rc, "delete %s" % self.name)
        return True

    def keys(self):
        cur = ffi.NULL
        nxt = ffi.new("unsigned char[]", self.key_size)
        while True:
            rc = lib.bpf_map_get_next_key(self.fd, cur, nxt)
            if rc < 0:
                return
            k = bytes(ffi.buffer(nxt, self.key_size))
            yield k
            cur = ffi.new("unsigned char[]", k)

    def items(self):
        for k in list(self.keys()):
            v = self.lookup(k)
            if v is not None:
                yield k, v

    def clear(self):
        for k in list(self.keys()):
            self.delete(k)

    def zero_range(self, start: int, n: int) -> None:
        """Write zeros to the n entries of an array map from index start, in one
        BPF_MAP_UPDATE_BATCH (Linux 5.6+; entry by entry where it is refused)."""
        if n <= 0:
            return
        keys = ffi.new("uint32_t[]", list(range(start, start + n)))
        vals = ffi.new("unsigned char[]", self._vbuf_len * n)
        cnt = ffi.new("uint32_t *", n)
        if lib.bpf_map_update_batch(self.fd, keys, vals, cnt, ffi.NULL) == 0 and cnt[0] == n:
            return
        zero = bytes(self.value_size)
        for k in range(start, start + n):
            self.update(k, zero)

    def keys_batch(self, chunk: int = 4096) -> list[bytes]:
        """Every key of a hash map, read with BPF_MAP_LOOKUP_BATCH (chunk entries per call;
        falls back to keys() where the kernel refuses it): one system call per chunk
        instead of one per key."""
        out: list[bytes] = []
        tok_in, tok_out = ffi.new("uint64_t *"), ffi.new("uint64_t *")   # the hash's bucket cursor
        keys = ffi.new("unsigned char[]", self.key_size * chunk)
        vals = ffi.new("unsigned char[]", self._vbuf_len * chunk)
        first = True
        while True:
            cnt = ffi.new("uint32_t *", chunk)
            rc = lib.bpf_map_lookup_batch(self.fd, ffi.NULL if first else tok_in, tok_out, keys, vals,
                                          cnt, ffi.NULL)
            e = 0 if rc >= 0 else (-rc if rc != -1 else ffi.errno)
            if rc < 0 and e != errno.ENOENT:
                if first:
                    return list(self.keys())
                _check(rc, "lookup batch %s" % self.name)
            raw = bytes(ffi.buffer(keys, self.key_size * cnt[0]))
            out += [raw[i:i + self.key_size] for i in range(0, len(raw), self.key_size)]
            if e == errno.ENOENT:
                return out
            tok_in[0] = tok_out[0]
            first = False


def sum_u64_percpu(values, nfields: int = 1):
    """Sum per-CPU values made of nfields little-endian u64s -> list of nfields ints."""
    tot = [0] * nfields
    for v in values:
        for i in range(nfields):
            tot[i] += int.from_bytes(v[i * 8:(i + 1) * 8], "little")
    return tot


class RingReader:
    """Poll a BPF ring buffer (by map fd) through libbpf; callback gets raw bytes."""

    def __init__(self, map_fd: int, callback):
        self._cb_user = callback

        @ffi.callback("int(void *, void *, size_t)")
        def _cb(ctx, data, size):
            try:
                self._cb_user(bytes(ffi.buffer(data, size)))
            except Exception:  # never let an exception cross the C boundary
                return -1
            return 0

        self._cb = _cb
        self.rb = lib.ring_buffer__new(map_fd, _cb, ffi.NULL, ffi.NULL)
        if self.rb == ffi.NULL:
            raise BpfError(ffi.errno, "ring_buffer__new: %s" % os.strerror(ffi.errno))

    def poll(self, timeout_ms: int = 100) -> int:
        return lib.ring_buffer__poll(self.rb, timeout_ms)

    def close(self):
        if self.rb != ffi.NULL:
            lib.ring_buffer__free(self.rb)
            self.rb = ffi.NULL
