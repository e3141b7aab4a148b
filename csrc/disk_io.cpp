// kvstore_service._native, disk tier part: record reads and writes between the pool's memory and the
// segment files of kvstore_service/tiers/disk/, with preadv/pwritev (O_DIRECT when the files were opened so)
// on a few worker threads, the GIL released. One call moves a whole batch of records.
//
// A record is [4 KiB header block][payload padded to 4 KiB]. The header (RecordHeader below, at the
// start of its block, the rest of the block zero) is THE definition of the record layout (described in
// docs/formats.md); the tier takes its geometry from the constants this file exports and parses headers
// with disk_parse_header.
//
// Two ways to move a record (`mode`):
//   * staged (mode 1, disk.py's default): header and payload go through an aligned buffer of the
//     worker (a copy of the payload, with non-temporal stores), one request per record. Works for any
//     pool address.
//   * direct (mode 0): [header block][the payload's whole 4 KiB pages, straight from/into the pool]
//     [the payload's last partial page via a bounce buffer]: no copy of the payload. O_DIRECT needs every
//     piece of memory aligned to the file system's DIO memory alignment (`mem_align`, probed by disk.py:
//     512 on ext4 here); a record whose pool address is not aligned so (pool payloads are only 256-byte
//     aligned) is staged instead.
// Measured here (benchmarks/bench_disk.py, ext4 on a VM's virtio disk, the pool on /dev/shm): staged ran
// at the raw disk's speed, direct mostly at about half of it (pinning the pool's shared-memory pages for
// O_DIRECT takes the kernel's slow get_user_pages path). Direct was the faster one from anonymous memory.
//
// Each worker keeps one request in flight (Linux AIO) while it prepares the next write (header, copy)
// or checks the last read, so the CPU work hides behind the I/O and the disk still sees `threads`
// requests at a time, as from `threads` plain pread/pwrite loops. Measured against synchronous workers:
// reads of 2 MiB blocks 0.66 -> 0.78 of the raw disk's speed, writes 0.96 -> 1.00.
// Reads verify before they report success: the header must be valid and be the expected record
// (segment, offset, scope, key, length, payload CRC), and the payload's CRC32C is computed again.
//
// Memory safety as in kvstore_native.h: keeping base + offset + length inside the pool is the caller's job.

#include <fcntl.h>
#include <linux/aio_abi.h>
#include <sys/mman.h>
#include <sys/syscall.h>
#include <sys/uio.h>
#include <unistd.h>

#include <algorithm>
#include <atomic>
#include <cerrno>
#include <cstddef>
#include <cstdlib>
#include <cstring>
#include <mutex>
#include <system_error>
#include <thread>

#if defined(__x86_64__)
#include <immintrin.h>
#endif

#include "crc32c.h"
#include "kvstore_native.h"

namespace kvstore {

namespace {

constexpr uint64_t kRecordAlign = 4096;  // header block size and payload padding
constexpr uint32_t kRecordMagic = 0x5244564B;  // "KVDR"
constexpr uint16_t kRecordVersion = 1;
constexpr uint16_t kKindRecord = 1;  // disk.py writes kind 2 (segment footer) with its own layout
constexpr int kMaxThreads = 64;

// Results per record (int64): 0 done; > 0 the record is not what was expected (corrupt, torn,
// overwritten); < 0 -errno of a failed system call.
constexpr int64_t kBadHeader = 1;   // invalid header, or another record's
constexpr int64_t kBadPayload = 2;  // the payload's CRC32C differs from the header's
constexpr int64_t kShortRead = 3;   // the file ends inside the record

#pragma pack(push, 1)
struct RecordHeader {
  uint32_t magic;        // kRecordMagic
  uint16_t version;      // kRecordVersion
  uint16_t kind;         // kKindRecord
  uint64_t segment;      // sequence number of the segment file the record was written to
  uint64_t offset;       // byte offset of the record in that file
  uint64_t payload_len;  // bytes of the block
  uint32_t payload_crc;  // CRC32C of the payload (the block's checksum in the pool)
  uint32_t key_len;      // 1..64
  uint8_t scope[16];     // namespace hash
  uint8_t key[64];       // key_len bytes, then zeros
  uint32_t header_crc;   // CRC32C of the bytes above
};
#pragma pack(pop)
constexpr size_t kHeaderCrcCovers = offsetof(RecordHeader, header_crc);
constexpr size_t kMaxKey = sizeof(RecordHeader::key);
static_assert(sizeof(RecordHeader) == 124 && kHeaderCrcCovers == 120,
              "the record header is the disk format: bump kRecordVersion (and disk.FORMAT_VERSION) to change it");
#if defined(__BYTE_ORDER__) && __BYTE_ORDER__ != __ORDER_LITTLE_ENDIAN__
#error "the disk format is little-endian"
#endif

uint64_t padded(uint64_t n) { return (n + kRecordAlign - 1) & ~(kRecordAlign - 1); }

// Aligned buffers, kept between calls so a batch does not page-fault fresh memory for each record.
class BufferCache {
 public:
  struct Buf {
    uint8_t* ptr = nullptr;
    size_t size = 0;
  };
  Buf get(size_t size) {
    {
      std::lock_guard<std::mutex> lock(mu_);
      size_t best = free_.size();  // the smallest that fits
      for (size_t i = 0; i < free_.size(); ++i) {
        if (free_[i].size >= size && (best == free_.size() || free_[i].size < free_[best].size)) best = i;
      }
      if (best < free_.size()) {
        Buf b = free_[best];
        free_.erase(free_.begin() + static_cast<std::ptrdiff_t>(best));
        return b;
      }
    }
    Buf b;
    b.size = size;
    void* p = mmap(nullptr, size, PROT_READ | PROT_WRITE, MAP_PRIVATE | MAP_ANONYMOUS | MAP_POPULATE, -1, 0);
    b.ptr = p == MAP_FAILED ? nullptr : static_cast<uint8_t*>(p);
    return b;
  }
  void put(Buf b) {
    if (b.ptr == nullptr) return;
    std::lock_guard<std::mutex> lock(mu_);
    if (free_.size() < kKeep) {
      free_.push_back(b);
    } else {
      munmap(b.ptr, b.size);
    }
  }

 private:
  static constexpr size_t kKeep = 32;  // 4 per worker: enough for a few concurrent calls
  std::mutex mu_;
  std::vector<Buf> free_;
};

BufferCache& buffers() {
  static BufferCache* cache = new BufferCache();  // never destroyed: threads may outlive static teardown
  return *cache;
}

// One batch, parsed while holding the GIL.
struct Batch {
  std::vector<uint64_t> fds, file_offsets, segments, addrs, crcs;  // per record
  uint64_t length = 0;
  const uint8_t* scope = nullptr;
  const uint8_t* keys = nullptr;
  size_t key_size = 0;
  int threads = 1;
  int mode = 0;
  uint64_t mem_align = kRecordAlign;
};

// Full pread/pwrite of an iovec list: retries EINTR and continues after short transfers. Returns 0,
// -errno, or kShortRead when a read meets the end of the file.
int64_t transfer(int fd, struct iovec* iov, int count, uint64_t offset, bool write) {
  while (count > 0) {
    ssize_t n = write ? pwritev(fd, iov, count, static_cast<off_t>(offset))
                      : preadv(fd, iov, count, static_cast<off_t>(offset));
    if (n < 0) {
      if (errno == EINTR) continue;
      return -static_cast<int64_t>(errno);
    }
    if (n == 0) return write ? -static_cast<int64_t>(EIO) : kShortRead;
    offset += static_cast<uint64_t>(n);
    auto left = static_cast<size_t>(n);
    while (count > 0 && left >= iov->iov_len) {
      left -= iov->iov_len;
      ++iov, --count;
    }
    if (count > 0) {
      iov->iov_base = static_cast<uint8_t*>(iov->iov_base) + left;
      iov->iov_len -= left;
    }
  }
  return 0;
}

void fill_header(const Batch& b, size_t i, uint8_t* block) {
  std::memset(block, 0, kRecordAlign);
  RecordHeader h{};
  h.magic = kRecordMagic;
  h.version = kRecordVersion;
  h.kind = kKindRecord;
  h.segment = b.segments[i];
  h.offset = b.file_offsets[i];
  h.payload_len = b.length;
  h.payload_crc = static_cast<uint32_t>(b.crcs[i]);
  h.key_len = static_cast<uint32_t>(b.key_size);
  std::memcpy(h.scope, b.scope, sizeof(h.scope));
  std::memcpy(h.key, b.keys + i * b.key_size, b.key_size);
  h.header_crc = crc32c(0, &h, kHeaderCrcCovers);
  std::memcpy(block, &h, sizeof(h));
}

bool header_matches(const Batch& b, size_t i, const uint8_t* block) {
  RecordHeader h;
  std::memcpy(&h, block, sizeof(h));
  return h.magic == kRecordMagic && h.version == kRecordVersion && h.kind == kKindRecord &&
         h.header_crc == crc32c(0, &h, kHeaderCrcCovers) && h.segment == b.segments[i] &&
         h.offset == b.file_offsets[i] && h.payload_len == b.length &&
         h.payload_crc == static_cast<uint32_t>(b.crcs[i]) && h.key_len == b.key_size &&
         std::memcmp(h.scope, b.scope, sizeof(h.scope)) == 0 &&
         std::memcmp(h.key, b.keys + i * b.key_size, b.key_size) == 0;
}

// Copies with non-temporal stores where AVX2 is there: the destination (a staging buffer the device
// reads next, or a pool slot) is not read again soon, and skipping the read-for-ownership of every
// destination line doubles a cold 2 MiB copy here (19 GB/s against memcpy's 9.5; as in copy.cpp).
#if defined(__x86_64__)
__attribute__((target("avx2"))) void stream_copy_avx2(uint8_t* dst, const uint8_t* src, uint64_t n) {
  uint64_t head = std::min<uint64_t>(n, (32 - (reinterpret_cast<uintptr_t>(dst) & 31)) & 31);
  std::memcpy(dst, src, head);
  dst += head, src += head, n -= head;
  for (; n >= 128; dst += 128, src += 128, n -= 128) {
    for (int k = 0; k < 128; k += 32) {
      _mm256_stream_si256(reinterpret_cast<__m256i*>(dst + k),
                          _mm256_loadu_si256(reinterpret_cast<const __m256i*>(src + k)));
    }
  }
  std::memcpy(dst, src, n);
  _mm_sfence();
}
const bool kHaveAvx2 = __builtin_cpu_supports("avx2");
#endif

void copy(uint8_t* dst, const uint8_t* src, uint64_t n) {
#if defined(__x86_64__)
  if (kHaveAvx2 && n >= kRecordAlign) {
    stream_copy_avx2(dst, src, n);
    return;
  }
#endif
  std::memcpy(dst, src, n);
}

// Linux native AIO (io_submit), used to keep one request of each worker in flight while it copies and
// checksums another: a worker overlaps its CPU work with its I/O, and the disk still sees one request
// per worker at a time (the queue depth of `threads` plain pread/pwrite workers). Without a context
// (io_setup refused: aio-max-nr reached) a worker does the same work synchronously.
class Aio {
 public:
  // A context from the cache (io_destroy waits for an RCU grace period: milliseconds, per call).
  Aio() {
    std::lock_guard<std::mutex> lock(mu());
    if (!spare().empty()) {
      ctx_ = spare().back();
      spare().pop_back();
      ok_ = true;
    } else {
      ok_ = syscall(SYS_io_setup, 2, &ctx_) == 0;
    }
  }
  ~Aio() {  // only ever idle here: every request was waited for
    if (!ok_) return;
    std::lock_guard<std::mutex> lock(mu());
    if (spare().size() < kKeep) {
      spare().push_back(ctx_);
    } else {
      syscall(SYS_io_destroy, ctx_);
    }
  }
  Aio(const Aio&) = delete;
  Aio& operator=(const Aio&) = delete;
  bool ok() const { return ok_; }
  // Starts a preadv/pwritev; false (errno set) if it could not be submitted.
  bool submit(struct iocb* cb) {
    struct iocb* list[1] = {cb};
    for (;;) {
      long rc = syscall(SYS_io_submit, ctx_, 1, list);
      if (rc == 1) return true;
      if (rc < 0 && errno == EINTR) continue;
      if (rc == 0) errno = EAGAIN;
      return false;
    }
  }
  // Waits for the one request in flight: its result (bytes moved, or -errno).
  int64_t wait() {
    struct io_event ev{};
    for (;;) {
      long rc = syscall(SYS_io_getevents, ctx_, 1, 1, &ev, nullptr);
      if (rc == 1) return static_cast<int64_t>(ev.res);
      if (rc < 0 && errno == EINTR) continue;
      return -static_cast<int64_t>(errno ? errno : EIO);
    }
  }

 private:
  static constexpr size_t kKeep = 64;
  static std::mutex& mu() {
    static auto* m = new std::mutex();
    return *m;
  }
  static std::vector<aio_context_t>& spare() {
    static auto* v = new std::vector<aio_context_t>();
    return *v;
  }
  aio_context_t ctx_ = 0;
  bool ok_ = false;
};

// One record's I/O: its buffers and the iovec list of the request (header block, payload, tail).
struct Slot {
  BufferCache::Buf stage, small;
  struct iovec iov[3];
  int count = 0;
  struct iocb cb{};
  size_t index = 0;
  uint64_t bytes = 0;  // of the request
  ~Slot() {
    buffers().put(stage);
    buffers().put(small);
  }
};

bool use_direct(const Batch& b, size_t i) {
  return b.mode == 0 && b.addrs[i] % b.mem_align == 0 && b.length >= kRecordAlign;
}

// Builds record i's request in `s` (for a write: with the header and, staged, the payload copied in).
void prepare(const Batch& b, size_t i, Slot& s, bool write) {
  const uint64_t record = kRecordAlign + padded(b.length);
  auto* mem = reinterpret_cast<uint8_t*>(b.addrs[i]);
  s.index = i;
  s.bytes = record;
  if (!use_direct(b, i)) {
    if (write) {
      fill_header(b, i, s.stage.ptr);
      copy(s.stage.ptr + kRecordAlign, mem, b.length);
      std::memset(s.stage.ptr + kRecordAlign + b.length, 0, record - kRecordAlign - b.length);
    }
    s.iov[0] = {s.stage.ptr, record};
    s.count = 1;
    return;
  }
  const uint64_t body = b.length & ~(kRecordAlign - 1), tail = b.length - body;
  uint8_t* head = s.small.ptr;
  uint8_t* last = head + kRecordAlign;
  if (write) fill_header(b, i, head);
  s.iov[0] = {head, kRecordAlign};
  s.iov[1] = {mem, body};
  s.count = 2;
  if (tail) {
    if (write) {
      std::memcpy(last, mem + body, tail);
      std::memset(last + tail, 0, kRecordAlign - tail);
    }
    s.iov[s.count++] = {last, kRecordAlign};
  }
}

// The rest of a request that moved `done` bytes so far (-errno: failed), synchronously: 0 when all of
// it moved, else -errno or kShortRead.
int64_t finish_io(const Batch& b, Slot& s, int64_t done, bool write) {
  if (done < 0) return done;
  struct iovec iov[3];
  std::memcpy(iov, s.iov, sizeof(iov));
  struct iovec* at = iov;
  int count = s.count;
  auto left = static_cast<uint64_t>(done);
  while (count > 0 && left >= at->iov_len) {
    left -= at->iov_len;
    ++at, --count;
  }
  if (count == 0) return 0;
  at->iov_base = static_cast<uint8_t*>(at->iov_base) + left;
  at->iov_len -= left;
  return transfer(static_cast<int>(b.fds[s.index]), at, count, b.file_offsets[s.index] + done, write);
}

// Verifies a record read into `s` and, staged, copies its payload into the pool.
int64_t check_read(const Batch& b, Slot& s) {
  const size_t i = s.index;
  auto* dst = reinterpret_cast<uint8_t*>(b.addrs[i]);
  const auto want = static_cast<uint32_t>(b.crcs[i]);
  if (s.count == 1) {  // staged
    if (!header_matches(b, i, s.stage.ptr)) return kBadHeader;
    if (crc32c(0, s.stage.ptr + kRecordAlign, b.length) != want) return kBadPayload;
    copy(dst, s.stage.ptr + kRecordAlign, b.length);
    return 0;
  }
  if (!header_matches(b, i, s.small.ptr)) return kBadHeader;
  const uint64_t body = b.length & ~(kRecordAlign - 1);
  if (b.length > body) std::memcpy(dst + body, s.small.ptr + kRecordAlign, b.length - body);
  return crc32c(0, dst, b.length) == want ? 0 : kBadPayload;
}

// Starts s's request (AIO), or runs it now (no AIO, or it could not be submitted); returns false when it
// ran now, its result in *result.
bool start(const Batch& b, Slot& s, Aio& aio, bool write, int64_t* result) {
  if (aio.ok()) {
    std::memset(&s.cb, 0, sizeof(s.cb));
    s.cb.aio_fildes = static_cast<uint32_t>(b.fds[s.index]);
    s.cb.aio_lio_opcode = write ? IOCB_CMD_PWRITEV : IOCB_CMD_PREADV;
    s.cb.aio_buf = reinterpret_cast<uint64_t>(s.iov);
    s.cb.aio_nbytes = static_cast<uint64_t>(s.count);
    s.cb.aio_offset = static_cast<int64_t>(b.file_offsets[s.index]);
    if (aio.submit(&s.cb)) return true;
  }
  *result = finish_io(b, s, 0, write);
  return false;
}

// One worker: takes records in order (shared counter) and keeps one request in flight while it
// prepares the next write, or checks the last read.
void worker(const Batch& b, bool write, std::atomic<size_t>& next, std::vector<int64_t>& results) {
  const size_t n = b.addrs.size();
  Slot slots[2];
  for (Slot& s : slots) {
    s.stage = buffers().get(kRecordAlign + padded(b.length));
    s.small = buffers().get(2 * kRecordAlign);
  }
  if (!slots[0].stage.ptr || !slots[0].small.ptr || !slots[1].stage.ptr || !slots[1].small.ptr) {
    for (size_t i = next.fetch_add(1); i < n; i = next.fetch_add(1)) results[i] = -ENOMEM;
    return;
  }
  Aio aio;
  Slot* cur = &slots[0];
  Slot* other = &slots[1];
  size_t i = next.fetch_add(1);
  if (i >= n) return;
  prepare(b, i, *cur, write);
  int64_t rc = 0;
  bool in_flight = start(b, *cur, aio, write, &rc);
  for (;;) {
    const size_t j = next.fetch_add(1);
    const bool more = j < n;
    if (write && more) prepare(b, j, *other, true);  // while cur's write is in flight
    if (in_flight) rc = finish_io(b, *cur, aio.wait(), write);
    int64_t next_rc = 0;
    bool next_in_flight = false;
    if (!write && more) {  // start the next read, then check this one while it is in flight
      prepare(b, j, *other, false);
      next_in_flight = start(b, *other, aio, false, &next_rc);
    }
    results[cur->index] = (rc == 0 && !write) ? check_read(b, *cur) : rc;
    if (!more) return;
    if (write) next_in_flight = start(b, *other, aio, true, &next_rc);
    std::swap(cur, other);
    in_flight = next_in_flight;
    rc = next_rc;
  }
}

// Runs every record of the batch on b.threads workers (the calling thread one of them), each taking
// the next record in order, so the file sees a nearly sequential stream with b.threads requests in flight.
std::vector<int64_t> run_batch(const Batch& b, bool write) {
  const size_t n = b.addrs.size();
  std::vector<int64_t> results(n, 0);
  std::atomic<size_t> next{0};
  auto work = [&]() { worker(b, write, next, results); };
  const int parts = static_cast<int>(std::min<size_t>(static_cast<size_t>(b.threads), n));
  std::vector<std::thread> workers;
  for (int t = 1; t < parts; ++t) {
    try {
      workers.emplace_back(work);
    } catch (const std::system_error&) {
      break;  // the threads already started (and this one) take the records
    }
  }
  work();
  for (auto& w : workers) w.join();
  return results;
}

bool parse_batch(PyObject* args, PyObject* kwargs, const char* format, Batch* b, Py_buffer* scope,
                 Py_buffer* keys) {
  static const char* kwlist[] = {"fds",   "file_offsets", "segments", "base",    "offsets",  "length",
                                 "crcs",  "scope",        "keys",     "key_size", "threads", "mode",
                                 "mem_align", nullptr};
  PyObject *fds, *file_offsets, *segments, *base_obj, *offsets_obj, *length_obj, *crcs;
  Py_ssize_t key_size;
  unsigned long long mem_align = kRecordAlign;
  if (!PyArg_ParseTupleAndKeywords(args, kwargs, format, const_cast<char**>(kwlist), &fds, &file_offsets,
                                   &segments, &base_obj, &offsets_obj, &length_obj, &crcs, scope, keys, &key_size,
                                   &b->threads, &b->mode, &mem_align)) {
    return false;
  }
  uint64_t base;
  std::vector<uint64_t> offsets;
  if (!parse_u64(base_obj, "base", &base) || !parse_u64(length_obj, "length", &b->length) ||
      !parse_u64_array(fds, "fds", &b->fds) || !parse_u64_array(file_offsets, "file_offsets", &b->file_offsets) ||
      !parse_u64_array(segments, "segments", &b->segments) || !parse_u64_array(offsets_obj, "offsets", &offsets) ||
      !parse_u64_array(crcs, "crcs", &b->crcs)) {
    return false;
  }
  const size_t n = offsets.size();
  if (b->fds.size() != n || b->file_offsets.size() != n || b->segments.size() != n || b->crcs.size() != n) {
    PyErr_Format(PyExc_ValueError, "fds, file_offsets, segments, offsets and crcs must have the same length "
                 "(got %zu, %zu, %zu, %zu, %zu)", b->fds.size(), b->file_offsets.size(), b->segments.size(), n,
                 b->crcs.size());
    return false;
  }
  if (scope->len != 16) {
    PyErr_Format(PyExc_ValueError, "scope must be 16 bytes (got %zd)", scope->len);
    return false;
  }
  if (key_size < 1 || static_cast<size_t>(key_size) > kMaxKey ||
      static_cast<size_t>(keys->len) != n * static_cast<size_t>(key_size)) {
    PyErr_Format(PyExc_ValueError, "keys must be %zu keys of 1..%zu bytes (got %zd bytes, key_size %zd)", n, kMaxKey,
                 keys->len, key_size);
    return false;
  }
  if (b->length == 0 || b->length > (uint64_t{1} << 40)) {
    PyErr_Format(PyExc_ValueError, "length must be between 1 and 2**40 (got %llu)",
                 static_cast<unsigned long long>(b->length));
    return false;
  }
  if (b->threads < 1 || b->threads > kMaxThreads || (b->mode != 0 && b->mode != 1) || mem_align == 0 ||
      (mem_align & (mem_align - 1)) != 0 || mem_align > kRecordAlign) {
    PyErr_Format(PyExc_ValueError, "threads must be 1..%d, mode 0 or 1, mem_align a power of two up to %llu", kMaxThreads,
                 static_cast<unsigned long long>(kRecordAlign));
    return false;
  }
  b->mem_align = mem_align;
  b->addrs.resize(n);
  for (size_t i = 0; i < n; ++i) {
    uint64_t addr, end;
    if (__builtin_add_overflow(base, offsets[i], &addr) || __builtin_add_overflow(addr, b->length, &end) ||
        end > UINTPTR_MAX || b->fds[i] > INT32_MAX) {
      PyErr_Format(PyExc_OverflowError, "record %zu: base + offset + length overflows, or its fd is invalid", i);
      return false;
    }
    b->addrs[i] = addr;
  }
  b->scope = static_cast<const uint8_t*>(scope->buf);
  b->keys = static_cast<const uint8_t*>(keys->buf);
  b->key_size = static_cast<size_t>(key_size);
  return true;
}

PyObject* disk_batch(PyObject* args, PyObject* kwargs, const char* format, bool write) {
  Batch b;
  Py_buffer scope{}, keys{};
  bool ok = parse_batch(args, kwargs, format, &b, &scope, &keys);
  std::vector<int64_t> results;
  if (ok) {
    Py_BEGIN_ALLOW_THREADS
    results = run_batch(b, write);
    Py_END_ALLOW_THREADS
  }
  if (scope.obj != nullptr) PyBuffer_Release(&scope);
  if (keys.obj != nullptr) PyBuffer_Release(&keys);
  if (!ok) return nullptr;
  return PyBytes_FromStringAndSize(reinterpret_cast<const char*>(results.data()),
                                   static_cast<Py_ssize_t>(results.size() * sizeof(int64_t)));
}

// disk_raw_io(fd, offset, count, size, write, threads=1): `count` requests of `size` bytes at offset,
// offset + size, ... from/into one aligned buffer per thread (pseudo-random bytes: a disk or host that
// compresses must not flatter it), threads taking the next request like run_batch: the file system's
// own speed with this engine's threading, for benchmarks.
PyObject* py_disk_raw_io(PyObject*, PyObject* args, PyObject* kwargs) {
  static const char* kwlist[] = {"fd", "offset", "count", "size", "write", "threads", nullptr};
  int fd, write, threads = 1;
  unsigned long long offset, count, size;
  if (!PyArg_ParseTupleAndKeywords(args, kwargs, "iKKKp|i:disk_raw_io", const_cast<char**>(kwlist), &fd, &offset,
                                   &count, &size, &write, &threads)) {
    return nullptr;
  }
  if (threads < 1 || threads > kMaxThreads || size == 0 || size % kRecordAlign || offset % kRecordAlign) {
    PyErr_SetString(PyExc_ValueError, "disk_raw_io: threads 1..64, size and offset multiples of 4096");
    return nullptr;
  }
  std::atomic<uint64_t> next{0};
  std::atomic<int64_t> error{0};
  Py_BEGIN_ALLOW_THREADS
  auto work = [&]() {
    BufferCache::Buf buf = buffers().get(size);
    if (buf.ptr == nullptr) {
      error = -ENOMEM;
      return;
    }
    uint64_t x = 0x9E3779B97F4A7C15ull ^ reinterpret_cast<uintptr_t>(buf.ptr);  // incompressible bytes
    for (uint64_t k = 0; k + 8 <= size; k += 8) {
      x ^= x << 13, x ^= x >> 7, x ^= x << 17;
      std::memcpy(buf.ptr + k, &x, 8);
    }
    for (uint64_t i = next.fetch_add(1); i < count && error == 0; i = next.fetch_add(1)) {
      struct iovec iov = {buf.ptr, size};
      int64_t rc = transfer(fd, &iov, 1, offset + i * size, write != 0);
      if (rc != 0) error = rc;
    }
    buffers().put(buf);
  };
  std::vector<std::thread> workers;
  for (int t = 1; t < threads; ++t) {
    try {
      workers.emplace_back(work);
    } catch (const std::system_error&) {
      break;
    }
  }
  work();
  for (auto& w : workers) w.join();
  Py_END_ALLOW_THREADS
  if (error != 0) {
    errno = error < 0 ? static_cast<int>(-error) : EIO;
    return PyErr_SetFromErrno(PyExc_OSError);
  }
  Py_RETURN_NONE;
}

PyObject* py_disk_write(PyObject*, PyObject* args, PyObject* kwargs) {
  return disk_batch(args, kwargs, "OOOOOOOy*y*n|iiK:disk_write", true);
}

PyObject* py_disk_read(PyObject*, PyObject* args, PyObject* kwargs) {
  return disk_batch(args, kwargs, "OOOOOOOy*y*n|iiK:disk_read", false);
}

// disk_parse_header(data, offset) -> (kind, segment, offset, payload_len, payload_crc, scope, key) or None
PyObject* py_disk_parse_header(PyObject*, PyObject* args, PyObject* kwargs) {
  static const char* kwlist[] = {"data", "offset", nullptr};
  Py_buffer data;
  Py_ssize_t offset;
  if (!PyArg_ParseTupleAndKeywords(args, kwargs, "y*n:disk_parse_header", const_cast<char**>(kwlist), &data,
                                   &offset)) {
    return nullptr;
  }
  RecordHeader h;
  const bool fits = offset >= 0 && data.len >= static_cast<Py_ssize_t>(sizeof(h)) &&
                    offset <= data.len - static_cast<Py_ssize_t>(sizeof(h));
  if (fits) std::memcpy(&h, static_cast<const uint8_t*>(data.buf) + offset, sizeof(h));
  PyBuffer_Release(&data);
  if (!fits) {
    PyErr_Format(PyExc_ValueError, "no %zu-byte record header at offset %zd", sizeof(h), offset);
    return nullptr;
  }
  if (h.magic != kRecordMagic || h.version != kRecordVersion || h.kind != kKindRecord || h.key_len < 1 ||
      h.key_len > kMaxKey || h.header_crc != crc32c(0, &h, kHeaderCrcCovers)) {
    Py_RETURN_NONE;
  }
  return Py_BuildValue("(IKKKIy#y#)", static_cast<unsigned>(h.kind), static_cast<unsigned long long>(h.segment),
                       static_cast<unsigned long long>(h.offset), static_cast<unsigned long long>(h.payload_len),
                       static_cast<unsigned>(h.payload_crc), reinterpret_cast<const char*>(h.scope),
                       static_cast<Py_ssize_t>(sizeof(h.scope)), reinterpret_cast<const char*>(h.key),
                       static_cast<Py_ssize_t>(h.key_len));
}

PyMethodDef kDiskMethods[] = {
    {"disk_write", KV_KW(py_disk_write),
     "disk_write(fds, file_offsets, segments, base, offsets, length, crcs, scope, keys, key_size, threads=1,\n"
     "           mode=0, mem_align=4096) -> bytes\n\n"
     "Write record i (header + the `length` bytes at base+offsets[i], CRC32C crcs[i]) to fds[i] at\n"
     "file_offsets[i], as part of segment segments[i]; keys: packed, key_size bytes each. mode 0: payload\n"
     "pages straight from memory where aligned to mem_align, else staged; 1: always staged. GIL released.\n"
     "Returns native int64 results: 0 done, -errno failed."},
    {"disk_read", KV_KW(py_disk_read),
     "disk_read(fds, file_offsets, segments, base, offsets, length, crcs, scope, keys, key_size, threads=1,\n"
     "          mode=0, mem_align=4096) -> bytes\n\n"
     "Read record i into base+offsets[i] and verify it (the expected header; the payload's CRC32C == crcs[i]).\n"
     "Returns native int64 results: 0 verified, 1 bad header, 2 bad payload, 3 file too short, -errno failed."},
    {"disk_raw_io", KV_KW(py_disk_raw_io),
     "disk_raw_io(fd, offset, count, size, write, threads=1) -> None\n\n"
     "`count` sequential pwrite (write=True) or pread requests of `size` bytes at offset + i*size, on `threads`\n"
     "threads from per-thread aligned buffers, GIL released: the file's own speed, for benchmarks."},
    {"disk_parse_header", KV_KW(py_disk_parse_header),
     "disk_parse_header(data, offset) -> tuple | None\n\n"
     "(kind, segment, offset, payload_len, payload_crc, scope, key) of the record header at data[offset:],\n"
     "or None if none is valid there."},
    {nullptr, nullptr, 0, nullptr},
};

}  // namespace

bool add_disk_io(PyObject* module) {
  return PyModule_AddFunctions(module, kDiskMethods) == 0 &&
         PyModule_AddIntConstant(module, "DISK_RECORD_ALIGN", static_cast<long>(kRecordAlign)) == 0 &&
         PyModule_AddIntConstant(module, "DISK_RECORD_MAGIC", static_cast<long>(kRecordMagic)) == 0 &&
         PyModule_AddIntConstant(module, "DISK_RECORD_VERSION", kRecordVersion) == 0 &&
         PyModule_AddIntConstant(module, "DISK_MAX_KEY", static_cast<long>(kMaxKey)) == 0 &&
         PyModule_AddIntConstant(module, "DISK_CORRUPT_HEADER", static_cast<long>(kBadHeader)) == 0 &&
         PyModule_AddIntConstant(module, "DISK_CORRUPT_PAYLOAD", static_cast<long>(kBadPayload)) == 0 &&
         PyModule_AddIntConstant(module, "DISK_SHORT_READ", static_cast<long>(kShortRead)) == 0;
}

}  // namespace kvstore
