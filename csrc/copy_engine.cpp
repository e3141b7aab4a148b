// kvstore_service._native: batched block copies, CRC32C checksums and the pool slot headers of kvstore.
//
// Plain CPython C API (no torch, no pybind11) so it builds with just a C++17 compiler and the
// Python headers. Every function that touches block memory releases the GIL while it works.
//
// Memory safety: addresses are base + offset, and nothing here knows the size of the mappings.
// Keeping every (offset, size) inside its mapping is the caller's job; this module only rejects
// 64-bit overflow of base + offset + size. Overlapping source/destination ranges are undefined,
// as with memcpy (runs are reordered and copied in parallel).

#include <algorithm>
#include <cstddef>
#include <cstring>
#include <string_view>
#include <system_error>
#include <thread>
#include <utility>

#if defined(__x86_64__)
#include <immintrin.h>
#endif

#include "crc32c.h"
#include "kvstore_native.h"

namespace kvstore {

namespace {

// Below this many bytes per thread, spawning a thread costs more than it saves.
constexpr uint64_t kMinBytesPerThread = 256 * 1024;
// Thread counts above this are rejected: they are a configuration mistake, not a speedup.
constexpr int kMaxThreads = 256;
// Runs shorter than this are copied with memcpy (see stream_copy_avx2).
constexpr uint64_t kStreamMin = 4096;

struct Buffer {
  Py_buffer view{};
  bool held = false;
  ~Buffer() {
    if (held) PyBuffer_Release(&view);
  }
};

// True for a struct-module format code of a 64-bit integer in native byte order.
bool is_u64_format(const char* fmt, bool* is_signed) {
  if (fmt == nullptr) return false;
  if (*fmt == '@' || *fmt == '=') ++fmt;
#if !defined(__BYTE_ORDER__) || __BYTE_ORDER__ == __ORDER_LITTLE_ENDIAN__
  else if (*fmt == '<') ++fmt;
#else
  else if (*fmt == '>' || *fmt == '!') ++fmt;
#endif
  if (fmt[0] == '\0' || fmt[1] != '\0') return false;
  switch (fmt[0]) {
    case 'Q': case 'L': case 'N':
      *is_signed = false;
      return true;
    case 'q': case 'l': case 'n':
      *is_signed = true;
      return true;
    default:
      return false;
  }
}

bool is_byte_format(const char* fmt) {
  return fmt == nullptr || std::strcmp(fmt, "B") == 0 || std::strcmp(fmt, "b") == 0 ||
         std::strcmp(fmt, "c") == 0;
}

int effective_parts(int threads, uint64_t total_bytes, uint64_t max_parts) {
  uint64_t by_bytes = std::max<uint64_t>(1, total_bytes / kMinBytesPerThread);
  return static_cast<int>(std::min<uint64_t>({static_cast<uint64_t>(threads), by_bytes, max_parts}));
}

// Runs fn(0..parts-1), part 0 on the calling thread. If a thread cannot be started (resource
// limits), its part runs inline instead of failing the copy.
template <class Fn>
void run_parallel(int parts, Fn fn) {
  if (parts <= 1) {
    fn(0);
    return;
  }
  std::vector<std::thread> workers;
  workers.reserve(parts - 1);
  for (int t = 1; t < parts; ++t) {
    try {
      workers.emplace_back(fn, t);
    } catch (const std::system_error&) {
      fn(t);
    }
  }
  fn(0);
  for (auto& w : workers) w.join();
}

// Splits runs into `parts` lists of nearly equal byte counts. A run that crosses a boundary is
// cut (at 64-byte granularity), so two threads both work on a single huge run.
std::vector<std::vector<Run>> split_by_bytes(const std::vector<Run>& runs, int parts) {
  uint64_t total = 0;
  for (const Run& r : runs) total += r.size;
  std::vector<uint64_t> bound(parts);
  uint64_t share = (total / parts + 63) & ~uint64_t{63};
  for (int t = 0; t < parts; ++t) bound[t] = std::min(total, share * (t + 1));
  bound[parts - 1] = total;

  std::vector<std::vector<Run>> out(parts);
  uint64_t pos = 0;
  int t = 0;
  for (const Run& r : runs) {
    uint64_t off = 0;
    while (off < r.size) {
      while (pos >= bound[t] && t + 1 < parts) ++t;
      uint64_t take = std::min(r.size - off, bound[t] - pos);
      out[t].push_back(Run{r.src + off, r.dst + off, take});
      off += take;
      pos += take;
    }
  }
  return out;
}

#if defined(__x86_64__)
// Non-temporal stores: nothing reads a block of the pool right after it was copied, so skip the
// read-for-ownership memcpy does for every destination line. Measured here on 256 KiB blocks at
// random places: 22 GB/s against memcpy's 18.7. Not for small loads into an engine (`streaming`
// false, see backends/cpu.py): its next forward reads them at once.
__attribute__((target("avx2"))) void stream_copy_avx2(uint8_t* dst, const uint8_t* src, uint64_t n) {
  uint64_t head = std::min<uint64_t>(n, (32 - (reinterpret_cast<uintptr_t>(dst) & 31)) & 31);
  std::memcpy(dst, src, head);  // up to the first 32-byte aligned destination address
  dst += head, src += head, n -= head;
  for (; n >= 128; dst += 128, src += 128, n -= 128) {
    __m256i a = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(src));
    __m256i b = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(src + 32));
    __m256i c = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(src + 64));
    __m256i d = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(src + 96));
    _mm256_stream_si256(reinterpret_cast<__m256i*>(dst), a);
    _mm256_stream_si256(reinterpret_cast<__m256i*>(dst + 32), b);
    _mm256_stream_si256(reinterpret_cast<__m256i*>(dst + 64), c);
    _mm256_stream_si256(reinterpret_cast<__m256i*>(dst + 96), d);
  }
  std::memcpy(dst, src, n);
}

const bool kHaveAvx2 = __builtin_cpu_supports("avx2");
#endif

// Copies a list of runs; returns once every byte is visible to other threads.
void copy_list(const std::vector<Run>& list, bool streaming) {
  for (const Run& r : list) {
    auto* dst = reinterpret_cast<uint8_t*>(r.dst);
    const auto* src = reinterpret_cast<const uint8_t*>(r.src);
#if defined(__x86_64__)
    if (streaming && kHaveAvx2 && r.size >= kStreamMin) {
      stream_copy_avx2(dst, src, r.size);
      continue;
    }
#endif
    std::memcpy(dst, src, r.size);
  }
#if defined(__x86_64__)
  _mm_sfence();  // non-temporal stores are weakly ordered: fence them before the copy is reported done
#endif
}

void copy_runs(const std::vector<Run>& runs, int threads, bool streaming) {
  uint64_t total = 0;
  for (const Run& r : runs) total += r.size;
  int parts = effective_parts(threads, total, UINT64_MAX);
  if (parts <= 1) {
    copy_list(runs, streaming);
    return;
  }
  std::vector<std::vector<Run>> lists = split_by_bytes(runs, parts);
  run_parallel(parts, [&](int t) { copy_list(lists[t], streaming); });
}

bool parse_threads(int threads) {
  if (threads < 1 || threads > kMaxThreads) {
    PyErr_Format(PyExc_ValueError, "threads must be between 1 and %d (got %d)", kMaxThreads, threads);
    return false;
  }
  return true;
}

// base + offsets[i] + size for every block, rejecting 64-bit overflow.
bool block_addresses(uint64_t base, const std::vector<uint64_t>& offsets, uint64_t size, const char* name,
                     std::vector<uint64_t>* out) {
  out->resize(offsets.size());
  for (size_t i = 0; i < offsets.size(); ++i) {
    uint64_t addr, end;
    if (__builtin_add_overflow(base, offsets[i], &addr) || __builtin_add_overflow(addr, size, &end) ||
        end > UINTPTR_MAX) {
      PyErr_Format(PyExc_OverflowError, "block %zu: %s base + offset + size overflows the address space", i,
                   name);
      return false;
    }
    (*out)[i] = addr;
  }
  return true;
}

uint64_t total_bytes(size_t n, uint64_t size) {
  uint64_t total;
  return __builtin_mul_overflow(static_cast<uint64_t>(n), size, &total) ? UINT64_MAX : total;
}

// ---- a job's chunk: planned and copied in one native call each ------------------------------------

// A region of the engine's layout as plan_transfer takes it: block b is `bytes` bytes at
// `start + b * stride`, inside the mapping [lo, hi).
struct PlanRegion {
  uint64_t start, stride, bytes, lo, hi;
};

// A checksum this engine cannot produce (CRC32C is 32 bits): "not known yet, do not check".
constexpr uint64_t kUnknownChecksum = UINT64_MAX;

// A whole load's regions are copied in groups holding at least this much of each block: a group's
// runs, sorted by pool address, read each block's part of it in one sweep. Region by region (a 32
// KiB run, then a jump of a block's size) a 16-block hit of 64 x 32 KiB regions copied 5-7% slower:
// in process, caches cold, medians of 60, 4.26 and 4.18 ms against 4.08 and 4.03 in groups of 8
// regions (256 KiB), 4.05 and 3.96 as one plain copy. The engine then sees a group's layers at once.
constexpr uint64_t kProgressGroupBytes = 256 << 10;

// Copies the plan's runs in layout order, a group of regions at a time, on this thread, plain or
// streaming, and after each group publishes `word | regions landed` at `progress` (release: the
// group's bytes are visible first), skipping the runs of blocks in `skip`.
void copy_regions_with_progress(const std::vector<Run>& runs, size_t blocks, const std::vector<char>& skip,
                                bool streaming, uint64_t* progress, uint64_t word) {
  const size_t regions = blocks == 0 ? 0 : runs.size() / blocks;
  std::vector<Run> part;
  for (size_t r = 0; r < regions;) {
    part.clear();
    uint64_t group_bytes = 0;  // of block 0 (every block has the same runs)
    do {
      group_bytes += runs[r * blocks].size;
      for (size_t k = 0; k < blocks; ++k) {
        const Run& run = runs[r * blocks + k];
        if (!skip[k] && run.size != 0) part.push_back(run);
      }
      ++r;
    } while (r < regions && group_bytes < kProgressGroupBytes);
    coalesce(&part);
    copy_list(part, streaming);  // ends with a store fence
    uint64_t landed = std::min<uint64_t>(r, 0xFFFF);
    __atomic_store_n(progress, word | landed, __ATOMIC_RELEASE);
  }
}

// Copies the runs of one block of a load (pool -> engine) and tells whether the CRC32C of its whole
// pool payload [slot, slot + size) is `expected`, reading it once: its runs' bytes as they are copied,
// the rest (other shards' parts) only read. Runs that leave the payload or overlap: the payload is
// verified first, and copied only if it matches.
bool copy_checked(std::vector<Run> runs, uint64_t slot, uint64_t size, bool streaming, uint64_t expected) {
  std::sort(runs.begin(), runs.end(), [](const Run& a, const Run& b) { return a.src < b.src; });
  uint64_t at = slot;
  bool inside = true;
  for (const Run& r : runs) {
    if (r.src < at || r.src > slot + size || r.size > slot + size - r.src) {
      inside = false;
      break;
    }
    at = r.src + r.size;
  }
  if (!inside) {
    if (crc32c(0, reinterpret_cast<const void*>(slot), size) != expected) return false;
    copy_list(runs, streaming);
    return true;
  }
  uint32_t crc = 0;
  at = slot;
  for (const Run& r : runs) {
    crc = crc32c(crc, reinterpret_cast<const void*>(at), r.src - at);
    crc = crc32c_copy(crc, reinterpret_cast<void*>(r.dst), reinterpret_cast<const void*>(r.src), r.size, streaming);
    at = r.src + r.size;
  }
  return crc32c(crc, reinterpret_cast<const void*>(at), slot + size - at) == expected;
}

// ---- Python entry points ---------------------------------------------------------------------

PyObject* py_copy_blocks(PyObject*, PyObject* args, PyObject* kwargs) {
  static const char* kwlist[] = {"src_base", "dst_base", "src_offsets", "dst_offsets", "sizes", "threads",
                                 "streaming", nullptr};
  PyObject *src_base_obj, *dst_base_obj, *src_offsets, *dst_offsets, *sizes;
  int threads = 1;
  int streaming = 1;
  if (!PyArg_ParseTupleAndKeywords(args, kwargs, "OOOOO|ip:copy_blocks", const_cast<char**>(kwlist),
                                   &src_base_obj, &dst_base_obj, &src_offsets, &dst_offsets, &sizes,
                                   &threads, &streaming)) {
    return nullptr;
  }
  uint64_t src_base, dst_base;
  if (!parse_u64(src_base_obj, "src_base", &src_base) || !parse_u64(dst_base_obj, "dst_base", &dst_base) ||
      !parse_threads(threads)) {
    return nullptr;
  }
  std::vector<Run> runs;
  if (!build_runs(src_base, dst_base, src_offsets, dst_offsets, sizes, &runs)) return nullptr;
  Py_BEGIN_ALLOW_THREADS
  copy_runs(runs, threads, streaming != 0);
  Py_END_ALLOW_THREADS
  return PyLong_FromSize_t(runs.size());
}

// Whether two of these values are equal (`same(i, j)` settling a tie of values i and j), in one pass
// over an open-addressing table: a sort of 2048 keys and ids took ~0.2 ms of a job's submit.
template <class Same>
bool has_duplicate(const std::vector<uint64_t>& values, Same same) {
  int bits = 4;
  while ((size_t{1} << bits) < 2 * values.size()) ++bits;
  const size_t mask = (size_t{1} << bits) - 1;
  std::vector<size_t> slots(mask + 1, SIZE_MAX);
  for (size_t i = 0; i < values.size(); ++i) {
    size_t at = static_cast<size_t>((values[i] * 0x9E3779B97F4A7C15ull) >> (64 - bits));  // (ids are not random)
    for (; slots[at] != SIZE_MAX; at = (at + 1) & mask) {
      if (values[slots[at]] == values[i] && same(slots[at], i)) return true;
    }
    slots[at] = i;
  }
  return false;
}

// check_job(keys, key_size, block_ids, num_blocks, distinct_ids) -> str: what is wrong with a job's keys
// (packed, key_size bytes each) and engine block ids (a uint64 buffer), "" if nothing; its checks at submit, in C
// (a 2048-block job's min, max and two sets cost ~0.3 ms of Python on our 2-vCPU VM).
PyObject* py_check_job(PyObject*, PyObject* args, PyObject* kwargs) {
  static const char* kwlist[] = {"keys", "key_size", "block_ids", "num_blocks", "distinct_ids", nullptr};
  Buffer keys;
  Py_ssize_t key_size;
  PyObject *ids, *num_obj;
  uint64_t num_blocks;
  int distinct_ids;
  if (!PyArg_ParseTupleAndKeywords(args, kwargs, "y*nOOp:check_job", const_cast<char**>(kwlist), &keys.view,
                                   &key_size, &ids, &num_obj, &distinct_ids)) {
    return nullptr;
  }
  keys.held = true;
  if (!parse_u64(num_obj, "num_blocks", &num_blocks)) return nullptr;  // ("K" would take -1 as 2**64-1)
  if (key_size < 1 || keys.view.len % key_size != 0) {
    PyErr_Format(PyExc_ValueError, "keys: %zd bytes are not keys of %zd bytes", keys.view.len, key_size);
    return nullptr;
  }
  std::vector<uint64_t> values;
  if (!parse_u64_array(ids, "block_ids", &values)) return nullptr;
  for (uint64_t v : values) {
    if (v >= num_blocks) {
      return PyUnicode_FromFormat("block id %llu is outside the registered cache (0..%lld)",
                                  static_cast<unsigned long long>(v), static_cast<long long>(num_blocks) - 1);
    }
  }
  // Duplicate keys: hashed by their first 8 bytes (keys are hashes), compared whole where those tie.
  const size_t n = static_cast<size_t>(keys.view.len / key_size);
  const char* packed = static_cast<const char*>(keys.view.buf);
  std::vector<uint64_t> prefixes(n);
  for (size_t i = 0; i < n; ++i) {
    std::memcpy(&prefixes[i], packed + i * key_size, std::min<size_t>(sizeof(uint64_t), key_size));
  }
  auto key = [&](size_t i) { return std::string_view(packed + i * key_size, static_cast<size_t>(key_size)); };
  if (has_duplicate(prefixes, [&](size_t a, size_t b) { return key(a) == key(b); })) {
    return PyUnicode_FromString("duplicate keys in one request");
  }
  if (distinct_ids) {
    if (has_duplicate(values, [](size_t, size_t) { return true; })) {
      return PyUnicode_FromString("duplicate block ids in one load: two blocks would land in the same place");
    }
  }
  return PyUnicode_FromString("");
}

// plan_transfer(slot_offsets, block_ids, regions, num_blocks, pool_size, shard_offset) -> bytes
// The byte runs of a chunk's blocks, region-major (region r's run of block k is run r * n + k): pool
// offset slot_offsets[k] + shard_offset + the bytes of the regions before r, engine address
// regions[r].start + block_ids[k] * regions[r].stride. Every run is checked against the pool and its
// mapping before it is returned (ValueError naming the block): nothing is copied past either.
PyObject* py_plan_transfer(PyObject*, PyObject* args, PyObject* kwargs) {
  static const char* kwlist[] = {"slot_offsets", "block_ids", "regions", "num_blocks", "pool_size",
                                 "shard_offset", nullptr};
  PyObject *slots_obj, *ids_obj, *regions_obj, *num_obj, *pool_obj, *shard_obj;
  if (!PyArg_ParseTupleAndKeywords(args, kwargs, "OOOOOO:plan_transfer", const_cast<char**>(kwlist), &slots_obj,
                                   &ids_obj, &regions_obj, &num_obj, &pool_obj, &shard_obj)) {
    return nullptr;
  }
  std::vector<uint64_t> slots, ids, flat;
  uint64_t num_blocks, pool_size, shard_offset;
  if (!parse_u64_array(slots_obj, "slot_offsets", &slots) || !parse_u64_array(ids_obj, "block_ids", &ids) ||
      !parse_u64_array(regions_obj, "regions", &flat) || !parse_u64(num_obj, "num_blocks", &num_blocks) ||
      !parse_u64(pool_obj, "pool_size", &pool_size) || !parse_u64(shard_obj, "shard_offset", &shard_offset)) {
    return nullptr;
  }
  if (slots.size() != ids.size()) {
    PyErr_Format(PyExc_ValueError, "%zu slot offsets but %zu block ids", slots.size(), ids.size());
    return nullptr;
  }
  if (flat.size() % 5 != 0) {
    PyErr_SetString(PyExc_ValueError, "regions must hold 5 values per region (start, stride, bytes, lo, hi)");
    return nullptr;
  }
  const size_t n = ids.size(), nregions = flat.size() / 5;
  std::vector<PlanRegion> regions(nregions);
  std::memcpy(regions.data(), flat.data(), flat.size() * sizeof(uint64_t));
  for (size_t k = 0; k < n; ++k) {
    if (ids[k] >= num_blocks) {
      PyErr_Format(PyExc_ValueError, "block id %llu is outside the registered cache (0..%llu)",
                   static_cast<unsigned long long>(ids[k]), static_cast<unsigned long long>(num_blocks - 1));
      return nullptr;
    }
  }
  const size_t total = n * nregions;
  PyObject* out = PyBytes_FromStringAndSize(nullptr, static_cast<Py_ssize_t>(3 * total * sizeof(uint64_t)));
  if (out == nullptr) return nullptr;
  auto* pool_offsets = reinterpret_cast<uint64_t*>(PyBytes_AS_STRING(out));
  uint64_t* engine = pool_offsets + total;
  uint64_t* sizes = engine + total;
  uint64_t before = shard_offset;
  for (size_t r = 0; r < nregions; ++r) {
    const PlanRegion& g = regions[r];
    for (size_t k = 0; k < n; ++k) {
      uint64_t rel, addr, end, pool_at, pool_end;
      bool bad_engine = __builtin_mul_overflow(ids[k], g.stride, &rel) ||
                        __builtin_add_overflow(g.start, rel, &addr) || __builtin_add_overflow(addr, g.bytes, &end) ||
                        addr < g.lo || end > g.hi;
      bool bad_pool = __builtin_add_overflow(slots[k], before, &pool_at) ||
                      __builtin_add_overflow(pool_at, g.bytes, &pool_end) || pool_end > pool_size;
      if (bad_engine || bad_pool) {
        Py_DECREF(out);
        PyErr_Format(PyExc_ValueError, "block %zu (id %llu), region %zu: its run lies outside %s", k,
                     static_cast<unsigned long long>(ids[k]), r,
                     bad_engine ? "the engine memory it was registered in" : "the pool");
        return nullptr;
      }
      pool_offsets[r * n + k] = pool_at;
      engine[r * n + k] = addr;
      sizes[r * n + k] = g.bytes;
    }
    before += g.bytes;
  }
  return out;
}

// transfer(pool_base, pool_offsets, engine_addresses, sizes, to_engine, blocks, threads=1, streaming=True,
//          progress=0, progress_word=0, check=None, check_offsets=None, check_size=0, expected=None) -> bytes
// One chunk of a job in one call, GIL released throughout: the runs are `regions` x `blocks`, region-major
// (plan_transfer). The blocks at positions `check` are verified: the CRC32C of their pool bytes (check_size
// bytes at pool_base + check_offsets[i]) against expected[i] (UINT64_MAX: not known, not checked); one that
// differs is corrupt. With `progress` (an address: the engine may read each region as it lands) they are
// verified before the copy, and a corrupt one is not copied; the copy runs in layout order on this thread,
// posting progress_word | regions landed after each group of regions (kProgressGroupBytes). Else (the
// engine reads nothing before the job's completion, which names the corrupt blocks) a load's checked
// blocks are checksummed as they are copied, reading their bytes once, and the other runs are coalesced
// over `threads`. Returns the corrupt positions (native uint64).
PyObject* py_transfer(PyObject*, PyObject* args, PyObject* kwargs) {
  static const char* kwlist[] = {"pool_base", "pool_offsets", "engine_addresses", "sizes", "to_engine", "blocks",
                                 "threads", "streaming", "progress", "progress_word", "check", "check_offsets",
                                 "check_size", "expected", nullptr};
  PyObject *base_obj, *pool_obj, *engine_obj, *sizes_obj;
  int to_engine, threads = 1, streaming = 1;
  Py_ssize_t blocks;
  PyObject *progress_obj = nullptr, *word_obj = nullptr, *check_obj = Py_None, *check_offsets_obj = Py_None,
           *check_size_obj = nullptr, *expected_obj = Py_None;
  if (!PyArg_ParseTupleAndKeywords(args, kwargs, "OOOOpn|ipOOOOOO:transfer", const_cast<char**>(kwlist),
                                   &base_obj, &pool_obj, &engine_obj, &sizes_obj, &to_engine, &blocks, &threads,
                                   &streaming, &progress_obj, &word_obj, &check_obj, &check_offsets_obj,
                                   &check_size_obj, &expected_obj)) {
    return nullptr;
  }
  uint64_t pool_base, progress = 0, word = 0, check_size = 0;
  std::vector<uint64_t> pool_offsets, engine, sizes, check, check_offsets, expected;
  if (!parse_u64(base_obj, "pool_base", &pool_base) || !parse_threads(threads) ||
      !parse_u64_array(pool_obj, "pool_offsets", &pool_offsets) ||
      !parse_u64_array(engine_obj, "engine_addresses", &engine) || !parse_u64_array(sizes_obj, "sizes", &sizes) ||
      (progress_obj != nullptr && !parse_u64(progress_obj, "progress", &progress)) ||
      (word_obj != nullptr && !parse_u64(word_obj, "progress_word", &word)) ||
      (check_size_obj != nullptr && !parse_u64(check_size_obj, "check_size", &check_size)) ||
      (check_obj != Py_None && !parse_u64_array(check_obj, "check", &check)) ||
      (check_offsets_obj != Py_None && !parse_u64_array(check_offsets_obj, "check_offsets", &check_offsets)) ||
      (expected_obj != Py_None && !parse_u64_array(expected_obj, "expected", &expected))) {
    return nullptr;
  }
  const size_t runs_n = sizes.size();
  if (pool_offsets.size() != runs_n || engine.size() != runs_n) {
    PyErr_Format(PyExc_ValueError, "pool_offsets, engine_addresses and sizes must have the same length (got %zu, "
                 "%zu, %zu)", pool_offsets.size(), engine.size(), runs_n);
    return nullptr;
  }
  if (blocks <= 0 ? runs_n != 0 : runs_n % static_cast<size_t>(blocks) != 0) {
    PyErr_Format(PyExc_ValueError, "%zu runs are not whole regions of %zd blocks", runs_n, blocks);
    return nullptr;
  }
  if (check.size() != check_offsets.size() || check.size() != expected.size()) {
    PyErr_Format(PyExc_ValueError, "check, check_offsets and expected must have the same length (got %zu, %zu, %zu)",
                 check.size(), check_offsets.size(), expected.size());
    return nullptr;
  }
  const size_t nblocks = blocks > 0 ? static_cast<size_t>(blocks) : 0;
  std::vector<uint64_t> check_addrs;
  if (!block_addresses(pool_base, check_offsets, check_size, "checksum", &check_addrs)) return nullptr;
  for (size_t i = 0; i < check.size(); ++i) {
    if (check[i] >= nblocks) {
      PyErr_Format(PyExc_ValueError, "check[%zu] = %llu is not a position among %zu blocks", i,
                   static_cast<unsigned long long>(check[i]), nblocks);
      return nullptr;
    }
  }
  std::vector<Run> runs(runs_n);
  for (size_t i = 0; i < runs_n; ++i) {
    uint64_t pool_at, pool_end, engine_end;
    if (__builtin_add_overflow(pool_base, pool_offsets[i], &pool_at) ||
        __builtin_add_overflow(pool_at, sizes[i], &pool_end) || __builtin_add_overflow(engine[i], sizes[i], &engine_end) ||
        pool_end > UINTPTR_MAX || engine_end > UINTPTR_MAX) {
      PyErr_Format(PyExc_OverflowError, "run %zu: base + offset + size overflows the address space", i);
      return nullptr;
    }
    runs[i] = to_engine ? Run{pool_at, engine[i], sizes[i]} : Run{engine[i], pool_at, sizes[i]};
  }
  std::vector<uint64_t> corrupt;
  Py_BEGIN_ALLOW_THREADS
  const bool on_the_way = progress == 0 && to_engine;
  std::vector<char> skip(nblocks, 0);  // verified first and corrupt, or checked on the way: not in the bulk copy
  std::vector<size_t> checked_at(nblocks, SIZE_MAX);  // position -> its index in `check`
  for (size_t i = 0; i < check.size(); ++i) {
    if (expected[i] == kUnknownChecksum) continue;
    if (on_the_way) {
      skip[check[i]] = 1;
      checked_at[check[i]] = i;
    } else if (crc32c(0, reinterpret_cast<const void*>(check_addrs[i]), check_size) != expected[i]) {
      skip[check[i]] = 1;
      corrupt.push_back(check[i]);
    }
  }
  if (progress != 0) {
    copy_regions_with_progress(runs, nblocks, skip, streaming != 0, reinterpret_cast<uint64_t*>(progress), word);
  } else {
    std::vector<std::vector<Run>> checked_runs(check.size());
    size_t out = 0;
    for (size_t i = 0; i < runs_n; ++i) {
      size_t k = i % nblocks;
      if (!skip[k]) {
        runs[out++] = runs[i];
      } else if (checked_at[k] != SIZE_MAX && runs[i].size != 0) {
        checked_runs[checked_at[k]].push_back(runs[i]);
      }
    }
    runs.resize(out);
    for (size_t i = 0; i < check.size(); ++i) {
      if (checked_at[check[i]] == i &&
          !copy_checked(checked_runs[i], check_addrs[i], check_size, streaming != 0, expected[i])) {
        corrupt.push_back(check[i]);
      }
    }
    runs.erase(std::remove_if(runs.begin(), runs.end(), [](const Run& r) { return r.size == 0; }), runs.end());
    coalesce(&runs);
    copy_runs(runs, threads, streaming != 0);
  }
  Py_END_ALLOW_THREADS
  return u64_bytes(corrupt);
}

PyObject* py_checksum_blocks(PyObject*, PyObject* args, PyObject* kwargs) {
  static const char* kwlist[] = {"base", "offsets", "size", "threads", nullptr};
  PyObject *base_obj, *offsets_obj, *size_obj;
  int threads = 1;
  if (!PyArg_ParseTupleAndKeywords(args, kwargs, "OOO|i:checksum_blocks", const_cast<char**>(kwlist), &base_obj,
                                   &offsets_obj, &size_obj, &threads)) {
    return nullptr;
  }
  uint64_t base, size;
  std::vector<uint64_t> offsets, addrs;
  if (!parse_u64(base_obj, "base", &base) || !parse_u64(size_obj, "size", &size) || !parse_threads(threads) ||
      !parse_u64_array(offsets_obj, "offsets", &offsets) ||
      !block_addresses(base, offsets, size, "checksum", &addrs)) {
    return nullptr;
  }
  const size_t n = addrs.size();
  std::vector<uint64_t> sums(n);
  Py_BEGIN_ALLOW_THREADS
  int parts = effective_parts(threads, total_bytes(n, size), std::max<size_t>(n, 1));
  run_parallel(parts, [&](int t) {
    for (size_t i = n * t / parts; i < n * (t + 1) / parts; ++i) {
      sums[i] = crc32c(0, reinterpret_cast<const void*>(addrs[i]), size);
    }
  });
  Py_END_ALLOW_THREADS
  return u64_bytes(sums);
}

// crc32c(data, crc=0): checksum of one buffer, continuing from `crc`.
PyObject* crc32c_common(PyObject* args, PyObject* kwargs, const char* fmt, bool portable) {
  static const char* kwlist[] = {"data", "crc", nullptr};
  Buffer data;
  unsigned int crc = 0;
  if (!PyArg_ParseTupleAndKeywords(args, kwargs, fmt, const_cast<char**>(kwlist), &data.view, &crc)) {
    return nullptr;
  }
  data.held = true;
  uint32_t result;
  if (data.view.len >= 65536) {
    Py_BEGIN_ALLOW_THREADS
    result = portable ? crc32c_portable(crc, data.view.buf, data.view.len) : crc32c(crc, data.view.buf, data.view.len);
    Py_END_ALLOW_THREADS
  } else {
    result = portable ? crc32c_portable(crc, data.view.buf, data.view.len) : crc32c(crc, data.view.buf, data.view.len);
  }
  return PyLong_FromUnsignedLong(result);
}

PyObject* py_crc32c(PyObject*, PyObject* args, PyObject* kwargs) {
  return crc32c_common(args, kwargs, "y*|I:crc32c", false);
}

PyObject* py_crc32c_portable(PyObject*, PyObject* args, PyObject* kwargs) {
  return crc32c_common(args, kwargs, "y*|I:crc32c_portable", true);
}

// crc32c_copy(src, dst): src copied into dst, and src's CRC32C, in one pass over src: each chunk is
// checksummed, then copied from the CPU caches (a fetched block is verified as it lands in the pool).
PyObject* py_crc32c_copy(PyObject*, PyObject* args, PyObject* kwargs) {
  static const char* kwlist[] = {"src", "dst", nullptr};
  Buffer src, dst;
  if (!PyArg_ParseTupleAndKeywords(args, kwargs, "y*w*:crc32c_copy", const_cast<char**>(kwlist), &src.view,
                                   &dst.view)) {
    return nullptr;
  }
  src.held = dst.held = true;
  if (dst.view.len < src.view.len) {
    PyErr_Format(PyExc_ValueError, "crc32c_copy: dst holds %zd bytes, src has %zd", dst.view.len, src.view.len);
    return nullptr;
  }
  constexpr uint64_t kChunk = 64 << 10;  // stays in L2 between the checksum and the copy
  uint32_t crc = 0;
  Py_BEGIN_ALLOW_THREADS
  const auto* from = static_cast<const uint8_t*>(src.view.buf);
  auto* to = static_cast<uint8_t*>(dst.view.buf);
  const uint64_t n = static_cast<uint64_t>(src.view.len);
  std::vector<Run> chunk(1);
  for (uint64_t off = 0; off < n; off += kChunk) {
    const uint64_t len = std::min(kChunk, n - off);
    crc = crc32c(crc, from + off, len);
    chunk[0] = Run{reinterpret_cast<uint64_t>(from + off), reinterpret_cast<uint64_t>(to + off), len};
    copy_list(chunk, true);
  }
  Py_END_ALLOW_THREADS
  return PyLong_FromUnsignedLong(crc);
}

// ---- slot headers -------------------------------------------------------------------------------
//
// The pool's slot header: THE definition of its layout. Python has none of its own: it reads
// headers with parse_slot_header and takes SLOT_HEADER_BYTES, SLOT_MAGIC and SLOT_MAX_KEY from
// this module. Little-endian, packed; the CRC32C covers every byte before it. Header i of a
// segment starts at i * kSlotHeaderBytes; the bytes after `crc` up to there are unused (zero).
// Changing this layout changes the pool file format: bump POOL_VERSION in kvstore_service/pool.py.
// A header is written only after its block's bytes, so a crash never leaves a valid header over
// torn bytes; pool.invalidate() voids one by zeroing its first 4 bytes (the magic).
#pragma pack(push, 1)
struct SlotHeader {
  uint32_t magic;        // kSlotMagic; 0 once invalidated
  uint32_t state;        // pool.SlotState (STORED, SEALED)
  uint64_t payload_len;  // bytes of the block
  uint64_t checksum;     // CRC32C of the block once sealed, else 0
  uint64_t generation;   // store order, for LRU after a restart
  uint8_t ns_hash[16];   // namespace
  uint32_t key_len;      // 1..kSlotMaxKey
  uint8_t key[64];       // key_len bytes, then zeros
  uint32_t crc;          // CRC32C of the bytes above
};
#pragma pack(pop)

constexpr uint32_t kSlotMagic = 0x4B565342;  // "KVSB"
constexpr size_t kSlotHeaderBytes = 128;
constexpr size_t kSlotMaxKey = sizeof(SlotHeader::key);
constexpr size_t kSlotCrcCovers = offsetof(SlotHeader, crc);
static_assert(offsetof(SlotHeader, magic) == 0, "pool.invalidate() zeroes the first 4 bytes");
static_assert(offsetof(SlotHeader, key) == 52 && kSlotCrcCovers == 116 && sizeof(SlotHeader) == 120,
              "the slot header layout is the pool file format: bump POOL_VERSION when changing it");
static_assert(sizeof(SlotHeader) <= kSlotHeaderBytes, "a slot header must fit its slot");
#if defined(__BYTE_ORDER__) && __BYTE_ORDER__ != __ORDER_LITTLE_ENDIAN__
#error "the pool file format is little-endian"
#endif

// invalidate_slot_headers(base, slots, count): zero the magic of each slot's header, in a segment whose
// `count` headers start at `base`. Every slot is checked against count before any byte is written.
PyObject* py_invalidate_slot_headers(PyObject*, PyObject* const* args, Py_ssize_t nargs) {
  if (nargs != 3) {
    PyErr_SetString(PyExc_TypeError, "invalidate_slot_headers(base, slots, count) takes 3 arguments");
    return nullptr;
  }
  uint64_t base, count;
  if (!parse_u64(args[0], "base", &base) || !parse_u64(args[2], "count", &count)) return nullptr;
  if (!PyList_Check(args[1])) {
    PyErr_SetString(PyExc_TypeError, "invalidate_slot_headers: slots must be a list of ints");
    return nullptr;
  }
  PyObject* items = PyList_AsTuple(args[1]);  // (a slot's __index__ may change the list)
  if (items == nullptr) return nullptr;
  const Py_ssize_t n = PyTuple_GET_SIZE(items);
  std::vector<uint64_t> slots(static_cast<size_t>(n));
  for (Py_ssize_t i = 0; i < n; ++i) {
    if (!parse_u64(PyTuple_GET_ITEM(items, i), "slot", &slots[i])) {
      Py_DECREF(items);
      return nullptr;
    }
    if (slots[i] >= count) {
      PyErr_Format(PyExc_ValueError, "slot %llu is past the segment's %llu slots",
                   static_cast<unsigned long long>(slots[i]), static_cast<unsigned long long>(count));
      Py_DECREF(items);
      return nullptr;
    }
  }
  Py_DECREF(items);
  const uint32_t invalid = 0;
  for (uint64_t slot : slots) {
    std::memcpy(reinterpret_cast<void*>(base + slot * kSlotHeaderBytes + offsetof(SlotHeader, magic)), &invalid,
                sizeof invalid);
  }
  Py_RETURN_NONE;
}

PyObject* py_write_slot_headers(PyObject*, PyObject* args, PyObject* kwargs) {
  static const char* kwlist[] = {"base",    "offsets", "state",     "payload_len", "generation",
                                 "ns_hash", "keys",    "key_size",  "checksums",   nullptr};
  PyObject *base_obj, *offsets_obj, *payload_obj, *generation_obj, *checksums_obj = Py_None;
  unsigned int state;
  Py_buffer ns_hash, keys;
  Py_ssize_t key_size;
  if (!PyArg_ParseTupleAndKeywords(args, kwargs, "OOIOOy*y*n|O:write_slot_headers", const_cast<char**>(kwlist),
                                   &base_obj, &offsets_obj, &state, &payload_obj, &generation_obj, &ns_hash,
                                   &keys, &key_size, &checksums_obj)) {
    return nullptr;
  }
  uint64_t base, payload_len, generation;
  std::vector<uint64_t> offsets, checksums;
  bool ok = parse_u64(base_obj, "base", &base) && parse_u64(payload_obj, "payload_len", &payload_len) &&
            parse_u64(generation_obj, "generation", &generation) &&
            parse_u64_array(offsets_obj, "offsets", &offsets) &&
            (checksums_obj == Py_None || parse_u64_array(checksums_obj, "checksums", &checksums));
  const size_t n = offsets.size();
  if (ok && ns_hash.len != sizeof(SlotHeader::ns_hash)) {
    PyErr_Format(PyExc_ValueError, "ns_hash must be 16 bytes (got %zd)", ns_hash.len);
    ok = false;
  } else if (ok && (key_size < 1 || static_cast<size_t>(key_size) > kSlotMaxKey ||
                    static_cast<size_t>(keys.len) != n * static_cast<size_t>(key_size))) {
    PyErr_Format(PyExc_ValueError, "keys must be %zu keys of 1..%zu bytes (got %zd bytes, key_size %zd)", n,
                 kSlotMaxKey, keys.len, key_size);
    ok = false;
  } else if (ok && checksums_obj != Py_None && checksums.size() != n) {
    PyErr_Format(PyExc_ValueError, "%zu offsets but %zu checksums", n, checksums.size());
    ok = false;
  }
  if (ok) {
    const auto* key_bytes = static_cast<const uint8_t*>(keys.buf);
    SlotHeader h{};
    h.magic = kSlotMagic;
    h.state = state;
    h.payload_len = payload_len;
    h.generation = generation;
    std::memcpy(h.ns_hash, ns_hash.buf, sizeof(h.ns_hash));
    h.key_len = static_cast<uint32_t>(key_size);
    Py_BEGIN_ALLOW_THREADS
    for (size_t i = 0; i < n; ++i) {
      h.checksum = checksums.empty() ? 0 : checksums[i];
      std::memcpy(h.key, key_bytes + i * h.key_len, h.key_len);
      h.crc = crc32c(0, &h, kSlotCrcCovers);
      std::memcpy(reinterpret_cast<void*>(base + offsets[i]), &h, sizeof(h));
    }
    Py_END_ALLOW_THREADS
  }
  PyBuffer_Release(&ns_hash);
  PyBuffer_Release(&keys);
  if (!ok) return nullptr;
  Py_RETURN_NONE;
}

// parse_slot_header(data, offset) -> (state, payload_len, checksum, generation, ns_hash, key) or None
// when the bytes there are no valid header (never written, torn, invalidated).
PyObject* py_parse_slot_header(PyObject*, PyObject* args, PyObject* kwargs) {
  static const char* kwlist[] = {"data", "offset", nullptr};
  Buffer data;
  Py_ssize_t offset;
  if (!PyArg_ParseTupleAndKeywords(args, kwargs, "y*n:parse_slot_header", const_cast<char**>(kwlist), &data.view,
                                   &offset)) {
    return nullptr;
  }
  data.held = true;
  if (offset < 0 || data.view.len < static_cast<Py_ssize_t>(sizeof(SlotHeader)) ||
      offset > data.view.len - static_cast<Py_ssize_t>(sizeof(SlotHeader))) {
    PyErr_Format(PyExc_ValueError, "no %zu-byte slot header at offset %zd of a %zd-byte buffer", sizeof(SlotHeader),
                 offset, data.view.len);
    return nullptr;
  }
  SlotHeader h;
  std::memcpy(&h, static_cast<const uint8_t*>(data.view.buf) + offset, sizeof(h));
  if (h.magic != kSlotMagic || h.key_len > kSlotMaxKey || h.crc != crc32c(0, &h, kSlotCrcCovers)) {
    Py_RETURN_NONE;
  }
  return Py_BuildValue("(IKKKy#y#)", h.state, static_cast<unsigned long long>(h.payload_len),
                       static_cast<unsigned long long>(h.checksum), static_cast<unsigned long long>(h.generation),
                       reinterpret_cast<const char*>(h.ns_hash), static_cast<Py_ssize_t>(sizeof(h.ns_hash)),
                       reinterpret_cast<const char*>(h.key), static_cast<Py_ssize_t>(h.key_len));
}

// coalesce_runs(src_offsets, dst_offsets, sizes) -> [(src, dst, size), ...]: the run list the copy
// functions (CPU and device) would execute, for tests and diagnostics.
PyObject* py_coalesce_runs(PyObject*, PyObject* args, PyObject* kwargs) {
  static const char* kwlist[] = {"src_offsets", "dst_offsets", "sizes", nullptr};
  PyObject *src_offsets, *dst_offsets, *sizes;
  if (!PyArg_ParseTupleAndKeywords(args, kwargs, "OOO:coalesce_runs", const_cast<char**>(kwlist), &src_offsets,
                                   &dst_offsets, &sizes)) {
    return nullptr;
  }
  std::vector<Run> runs;
  if (!build_runs(0, 0, src_offsets, dst_offsets, sizes, &runs)) return nullptr;
  PyObject* list = PyList_New(static_cast<Py_ssize_t>(runs.size()));
  if (list == nullptr) return nullptr;
  for (size_t i = 0; i < runs.size(); ++i) {
    PyObject* item = Py_BuildValue("(KKK)", static_cast<unsigned long long>(runs[i].src),
                                   static_cast<unsigned long long>(runs[i].dst),
                                   static_cast<unsigned long long>(runs[i].size));
    if (item == nullptr) {
      Py_DECREF(list);
      return nullptr;
    }
    PyList_SET_ITEM(list, static_cast<Py_ssize_t>(i), item);
  }
  return list;
}

PyObject* py_features(PyObject*, PyObject*) {
  PyObject* d = PyDict_New();
  if (d == nullptr) return nullptr;
  bool ok = set_item(d, "cpu_threads", PyLong_FromUnsignedLong(std::thread::hardware_concurrency())) &&
            set_item(d, "checksum", PyUnicode_FromString("crc32c")) &&
            set_item(d, "crc32c_impl", PyUnicode_FromString(crc32c_impl())) &&
            set_item(d, "crc32c_hardware", PyBool_FromLong(crc32c_hardware())) &&
            add_cuda_features(d) && add_acl_features(d);
  if (!ok) {
    Py_DECREF(d);
    return nullptr;
  }
  return d;
}

#define KV_KW(fn) reinterpret_cast<PyCFunction>(reinterpret_cast<void (*)(void)>(fn)), METH_VARARGS | METH_KEYWORDS

PyMethodDef kMethods[] = {
    {"copy_blocks", KV_KW(py_copy_blocks),
     "copy_blocks(src_base, dst_base, src_offsets, dst_offsets, sizes, threads=1, streaming=True) -> int\n\n"
     "Copy block i from src_base+src_offsets[i] to dst_base+dst_offsets[i] (sizes[i] bytes) with memcpy on\n"
     "`threads` threads, GIL released. Offsets/sizes: uint64 buffers. Runs contiguous on both sides are\n"
     "merged first; returns the number of merged runs. Bounds are the caller's job. streaming: non-temporal\n"
     "stores for runs of 4 KiB and more (for a destination nothing reads soon)."},
    {"check_job", KV_KW(py_check_job),
     "check_job(keys, key_size, block_ids, num_blocks, distinct_ids) -> str\n\n"
     "What is wrong with a job's keys (packed, key_size bytes each) and block ids (uint64 buffer): an id outside\n"
     "0..num_blocks-1, duplicate keys, duplicate ids (if distinct_ids); \"\" if nothing."},
    {"plan_transfer", KV_KW(py_plan_transfer),
     "plan_transfer(slot_offsets, block_ids, regions, num_blocks, pool_size, shard_offset) -> bytes\n\n"
     "The runs of a chunk's blocks, region-major, as native uint64: n*R pool offsets, then engine addresses,\n"
     "then sizes. regions: 5 values per region (start, stride, bytes, lo, hi). Every run is bounds-checked\n"
     "against the pool and its mapping [lo, hi) (ValueError)."},
    {"transfer", KV_KW(py_transfer),
     "transfer(pool_base, pool_offsets, engine_addresses, sizes, to_engine, blocks, threads=1, streaming=True,\n"
     "         progress=0, progress_word=0, check=None, check_offsets=None, check_size=0, expected=None) -> bytes\n\n"
     "One chunk in one call, GIL released: verify the sampled blocks' CRC32C, copy every run of the others\n"
     "(in layout order posting progress when `progress` is an address), return the corrupt positions."},
    {"checksum_blocks", KV_KW(py_checksum_blocks),
     "checksum_blocks(base, offsets, size, threads=1) -> bytes\n\n"
     "CRC32C of each `size`-byte block at base+offsets[i], as native-endian uint64 values."},
    {"crc32c", KV_KW(py_crc32c), "crc32c(data, crc=0) -> int\n\nCRC32C of a bytes-like object, continuing from crc."},
    {"crc32c_portable", KV_KW(py_crc32c_portable),
     "crc32c_portable(data, crc=0) -> int\n\nSame as crc32c, always with the table-driven implementation."},
    {"crc32c_copy", KV_KW(py_crc32c_copy),
     "crc32c_copy(src, dst) -> int\n\nCopy src into dst (a writable buffer at least as long), GIL released;\n"
     "returns src's CRC32C, computed in the same pass."},
    {"write_slot_headers", KV_KW(py_write_slot_headers),
     "write_slot_headers(base, offsets, state, payload_len, generation, ns_hash, keys, key_size, checksums=None)\n\n"
     "Write the pool slot header of block i at base+offsets[i] (layout: SlotHeader in csrc/copy_engine.cpp),\n"
     "GIL released. keys: the blocks' keys packed, key_size bytes each; checksums: uint64 buffer, or None for 0."},
    {"invalidate_slot_headers", reinterpret_cast<PyCFunction>(reinterpret_cast<void (*)()>(py_invalidate_slot_headers)),
     METH_FASTCALL,
     "invalidate_slot_headers(base, slots, count)\n\n"
     "Void the slot header of each slot (of a segment whose `count` headers start at `base`): a recovery then\n"
     "finds none there. ValueError, before anything is written, for a slot not below count."},
    {"parse_slot_header", KV_KW(py_parse_slot_header),
     "parse_slot_header(data, offset) -> tuple | None\n\n"
     "(state, payload_len, checksum, generation, ns_hash, key) of the slot header at data[offset:], or None\n"
     "if none is valid there (bad magic, key length or CRC32C). ValueError if it would read past the buffer."},
    {"coalesce_runs", KV_KW(py_coalesce_runs),
     "coalesce_runs(src_offsets, dst_offsets, sizes) -> list[tuple[int, int, int]]\n\n"
     "The merged (src, dst, size) runs the copy functions would execute."},
    {"cuda_copy_blocks", KV_KW(py_cuda_copy_blocks),
     "cuda_copy_blocks(src_base, dst_base, src_offsets, dst_offsets, sizes, direction, device, stream=0,\n"
     "                 allow_batch=True, checksum_base=0, checksum_offsets=None, checksum_size=0) -> bytes\n\n"
     "Copy merged runs with cuMemcpyBatchAsync (driver >= 12.8) or cuMemcpyAsync per run, on `stream` or\n"
     "a dedicated stream of `device`, and wait for completion (GIL released). direction: 'h2d', 'd2h', 'd2d'.\n"
     "Returns the CRC32C (native-endian uint64 values) of the host blocks of checksum_size bytes at\n"
     "checksum_base + checksum_offsets[i], taken once the runs are enqueued, while they copy."},
    {"cuda_host_register", KV_KW(py_cuda_host_register),
     "cuda_host_register(addr, size, device=0) -> None\n\nPin host memory (cuMemHostRegister, portable)."},
    {"cuda_host_unregister", KV_KW(py_cuda_host_unregister),
     "cuda_host_unregister(addr, device=0) -> None\n\nUndo cuda_host_register."},
    {"cuda_open_ipc_event", KV_KW(py_cuda_open_ipc_event),
     "cuda_open_ipc_event(handle, device=0) -> int\n\n"
     "Open another process's 64-byte IPC event handle (cuIpcOpenEventHandle) on `device`; the CUevent."},
    {"cuda_query_event", KV_KW(py_cuda_query_event),
     "cuda_query_event(event, device=0) -> bool\n\n"
     "Whether the work recorded in an event cuda_open_ipc_event opened is done (cuEventQuery; never blocks)."},
    {"cuda_destroy_event", KV_KW(py_cuda_destroy_event),
     "cuda_destroy_event(event, device=0) -> None\n\nDestroy an event cuda_open_ipc_event opened."},
    {"acl_copy_blocks", KV_KW(py_acl_copy_blocks),
     "acl_copy_blocks(src_base, dst_base, src_offsets, dst_offsets, sizes, direction, device, stream=0,\n"
     "                allow_batch=True, checksum_base=0, checksum_offsets=None, checksum_size=0) -> bytes\n\n"
     "Ascend version of cuda_copy_blocks (aclrtMemcpyBatchAsync or aclrtMemcpyAsync). Unverified on hardware."},
    {"acl_host_register", KV_KW(py_acl_host_register),
     "acl_host_register(addr, size, device=0) -> int\n\n"
     "aclrtHostRegister(ptr, size, ACL_HOST_REGISTER_MAPPED); returns the device-side address."},
    {"acl_host_unregister", KV_KW(py_acl_host_unregister),
     "acl_host_unregister(addr, device=0) -> None\n\nUndo acl_host_register."},
    {"features", reinterpret_cast<PyCFunction>(py_features), METH_NOARGS,
     "features() -> dict\n\nWhat was compiled in and what the machine offers (probes the CUDA/ACL runtimes)."},
    {nullptr, nullptr, 0, nullptr},
};

PyModuleDef kModule = {
    PyModuleDef_HEAD_INIT, "_native",
    "Native batched block copy and CRC32C checksum engine of the kvstore daemon.", -1, kMethods,
    nullptr, nullptr, nullptr, nullptr,
};

}  // namespace

// ---- shared helpers (declared in kvstore_native.h) -------------------------------------------

bool set_item(PyObject* dict, const char* key, PyObject* value) {
  if (value == nullptr) return false;
  int rc = PyDict_SetItemString(dict, key, value);
  Py_DECREF(value);
  return rc == 0;
}

bool parse_u64(PyObject* obj, const char* name, uint64_t* out) {
  PyObject* index = PyNumber_Index(obj);
  if (index == nullptr) {
    PyErr_Format(PyExc_TypeError, "%s must be an int, not %.100s", name, Py_TYPE(obj)->tp_name);
    return false;
  }
  unsigned long long value = PyLong_AsUnsignedLongLong(index);
  Py_DECREF(index);
  if (value == static_cast<unsigned long long>(-1) && PyErr_Occurred()) {
    PyErr_Format(PyExc_OverflowError, "%s must be an int in [0, 2**64)", name);
    return false;
  }
  *out = value;
  return true;
}

bool parse_u64_array(PyObject* obj, const char* name, std::vector<uint64_t>* out) {
  Buffer buf;
  if (PyObject_GetBuffer(obj, &buf.view, PyBUF_C_CONTIGUOUS | PyBUF_FORMAT) != 0) {
    PyErr_Format(PyExc_TypeError, "%s must be a contiguous buffer of uint64 (e.g. array('Q')), not %.100s", name,
                 Py_TYPE(obj)->tp_name);
    return false;
  }
  buf.held = true;
  bool is_signed = false;
  if (buf.view.itemsize == 8 && is_u64_format(buf.view.format, &is_signed)) {
    // typed 64-bit integers
  } else if (buf.view.itemsize == 1 && is_byte_format(buf.view.format) && buf.view.len % 8 == 0) {
    // raw bytes holding native-endian uint64 values
  } else {
    PyErr_Format(PyExc_ValueError,
                 "%s must hold 64-bit unsigned integers (itemsize 8, e.g. array('Q')); got format '%s' "
                 "with itemsize %zd",
                 name, buf.view.format ? buf.view.format : "B", buf.view.itemsize);
    return false;
  }
  out->resize(static_cast<size_t>(buf.view.len) / 8);
  if (!out->empty()) std::memcpy(out->data(), buf.view.buf, static_cast<size_t>(buf.view.len));
  if (is_signed) {
    for (size_t i = 0; i < out->size(); ++i) {
      if (static_cast<int64_t>((*out)[i]) < 0) {
        PyErr_Format(PyExc_ValueError, "%s[%zu] is negative", name, i);
        return false;
      }
    }
  }
  return true;
}

void coalesce(std::vector<Run>* runs) {
  auto by_src = [](const Run& a, const Run& b) { return a.src < b.src; };
  // Block lists usually arrive sorted; skip the sort then.
  if (!std::is_sorted(runs->begin(), runs->end(), by_src)) {
    std::stable_sort(runs->begin(), runs->end(), by_src);
  }
  size_t out = 0;
  for (size_t i = 0; i < runs->size(); ++i) {
    const Run& r = (*runs)[i];
    if (out > 0) {
      Run& prev = (*runs)[out - 1];
      if (prev.src + prev.size == r.src && prev.dst + prev.size == r.dst) {
        prev.size += r.size;
        continue;
      }
    }
    (*runs)[out++] = r;
  }
  runs->resize(out);
}

bool build_runs(uint64_t src_base, uint64_t dst_base, PyObject* src_offsets_obj, PyObject* dst_offsets_obj,
                PyObject* sizes_obj, std::vector<Run>* runs) {
  std::vector<uint64_t> src_offsets, dst_offsets, sizes;
  if (!parse_u64_array(src_offsets_obj, "src_offsets", &src_offsets) ||
      !parse_u64_array(dst_offsets_obj, "dst_offsets", &dst_offsets) ||
      !parse_u64_array(sizes_obj, "sizes", &sizes)) {
    return false;
  }
  if (src_offsets.size() != dst_offsets.size() || src_offsets.size() != sizes.size()) {
    PyErr_Format(PyExc_ValueError,
                 "src_offsets, dst_offsets and sizes must have the same length (got %zu, %zu, %zu)",
                 src_offsets.size(), dst_offsets.size(), sizes.size());
    return false;
  }
  runs->clear();
  runs->reserve(sizes.size());
  for (size_t i = 0; i < sizes.size(); ++i) {
    uint64_t src, dst, src_end, dst_end;
    if (__builtin_add_overflow(src_base, src_offsets[i], &src) ||
        __builtin_add_overflow(src, sizes[i], &src_end) || __builtin_add_overflow(dst_base, dst_offsets[i], &dst) ||
        __builtin_add_overflow(dst, sizes[i], &dst_end) || src_end > UINTPTR_MAX || dst_end > UINTPTR_MAX) {
      PyErr_Format(PyExc_OverflowError, "block %zu: base + offset + size overflows the address space", i);
      return false;
    }
    if (sizes[i] != 0) runs->push_back(Run{src, dst, sizes[i]});
  }
  coalesce(runs);
  return true;
}

bool parse_direction(PyObject* obj, Direction* out) {
  const char* s = PyUnicode_Check(obj) ? PyUnicode_AsUTF8(obj) : nullptr;
  if (s != nullptr && std::strcmp(s, "h2d") == 0) {
    *out = Direction::kHostToDevice;
  } else if (s != nullptr && std::strcmp(s, "d2h") == 0) {
    *out = Direction::kDeviceToHost;
  } else if (s != nullptr && std::strcmp(s, "d2d") == 0) {
    *out = Direction::kDeviceToDevice;
  } else {
    PyErr_Clear();
    PyErr_SetString(PyExc_ValueError, "direction must be 'h2d', 'd2h' or 'd2d'");
    return false;
  }
  return true;
}

PyObject* u64_bytes(const std::vector<uint64_t>& values) {
  return PyBytes_FromStringAndSize(reinterpret_cast<const char*>(values.data()),
                                   static_cast<Py_ssize_t>(values.size() * sizeof(uint64_t)));
}

std::vector<uint64_t> DeviceCopyArgs::checksums() const {
  std::vector<uint64_t> sums(checksum_addrs.size());
  for (size_t i = 0; i < sums.size(); ++i) {
    sums[i] = crc32c(0, reinterpret_cast<const void*>(checksum_addrs[i]), checksum_size);
  }
  return sums;
}

bool parse_device_copy_args(PyObject* args, PyObject* kwargs, const char* format, DeviceCopyArgs* out) {
  static const char* kwlist[] = {"src_base",    "dst_base",      "src_offsets",      "dst_offsets",
                                 "sizes",       "direction",     "device",           "stream",
                                 "allow_batch", "checksum_base", "checksum_offsets", "checksum_size",
                                 nullptr};
  PyObject *src_base_obj, *dst_base_obj, *src_offsets, *dst_offsets, *sizes, *direction_obj;
  PyObject *stream_obj = nullptr, *checksum_base_obj = nullptr, *checksum_offsets_obj = Py_None,
           *checksum_size_obj = nullptr;
  int allow_batch = 1;
  if (!PyArg_ParseTupleAndKeywords(args, kwargs, format, const_cast<char**>(kwlist),
                                   &src_base_obj, &dst_base_obj, &src_offsets, &dst_offsets, &sizes, &direction_obj,
                                   &out->device, &stream_obj, &allow_batch, &checksum_base_obj,
                                   &checksum_offsets_obj, &checksum_size_obj)) {
    return false;
  }
  uint64_t src_base, dst_base, checksum_base = 0;
  std::vector<uint64_t> checksum_offsets;
  if (!parse_u64(src_base_obj, "src_base", &src_base) || !parse_u64(dst_base_obj, "dst_base", &dst_base) ||
      !parse_direction(direction_obj, &out->dir) ||
      (stream_obj != nullptr && stream_obj != Py_None && !parse_u64(stream_obj, "stream", &out->stream)) ||
      (checksum_base_obj != nullptr && !parse_u64(checksum_base_obj, "checksum_base", &checksum_base)) ||
      (checksum_size_obj != nullptr && !parse_u64(checksum_size_obj, "checksum_size", &out->checksum_size)) ||
      (checksum_offsets_obj != Py_None &&
       (!parse_u64_array(checksum_offsets_obj, "checksum_offsets", &checksum_offsets) ||
        !block_addresses(checksum_base, checksum_offsets, out->checksum_size, "checksum", &out->checksum_addrs)))) {
    return false;
  }
  out->allow_batch = allow_batch != 0;
  return build_runs(src_base, dst_base, src_offsets, dst_offsets, sizes, &out->runs);
}

}  // namespace kvstore

PyMODINIT_FUNC PyInit__native(void) {
  PyObject* m = PyModule_Create(&kvstore::kModule);
  if (m == nullptr) return nullptr;
  if (PyModule_AddIntConstant(m, "SLOT_HEADER_BYTES", static_cast<long>(kvstore::kSlotHeaderBytes)) < 0 ||
      PyModule_AddIntConstant(m, "SLOT_MAGIC", static_cast<long>(kvstore::kSlotMagic)) < 0 ||
      PyModule_AddIntConstant(m, "SLOT_MAX_KEY", static_cast<long>(kvstore::kSlotMaxKey)) < 0 ||
      !kvstore::add_block_type(m) || !kvstore::add_guard(m) || !kvstore::add_populate(m) ||
      !kvstore::add_disk_io(m)) {
    Py_DECREF(m);
    return nullptr;
  }
  return m;
}
