// A chunk of a job in one native call: its checksum sample verified, its runs copied (for a whole load, in
// layout order with each group of regions' arrival posted in the engine's completion channel).

#include <algorithm>

#include "crc32c.h"
#include "kvstore_native.h"

namespace kvstore {

namespace {

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
        if (!skip[k]) part.push_back(run);
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

// transfer(pool_base, runs, to_engine, threads=1, streaming=True, progress=0, progress_word=0, check=None,
//          check_offsets=None, check_size=0, expected=None) -> bytes
// One chunk of a job in one call, GIL released throughout: its Runs (plan_transfer's, region-major), pool ->
// engine if to_engine. The blocks at positions `check` are verified: the CRC32C of their pool bytes (check_size
// bytes at pool_base + check_offsets[i]) against expected[i] (UINT64_MAX: not known, not checked); one that
// differs is corrupt. With `progress` (an address: the engine may read each region as it lands) they are
// verified before the copy, and a corrupt one is not copied; the copy runs in layout order on this thread,
// posting progress_word | regions landed after each group of regions (kProgressGroupBytes). Else (the
// engine reads nothing before the job's completion, which names the corrupt blocks) a load's checked
// blocks are checksummed as they are copied, reading their bytes once, and the other runs are coalesced
// over `threads`. Returns the corrupt positions (native uint64).
PyObject* py_transfer(PyObject*, PyObject* args, PyObject* kwargs) {
  static const char* kwlist[] = {"pool_base", "runs", "to_engine", "threads", "streaming", "progress", "progress_word",
                                 "check", "check_offsets", "check_size", "expected", nullptr};
  PyObject *base_obj, *runs_obj;
  int to_engine, threads = 1, streaming = 1;
  PyObject *progress_obj = nullptr, *word_obj = nullptr, *check_obj = Py_None, *check_offsets_obj = Py_None,
           *check_size_obj = nullptr, *expected_obj = Py_None;
  if (!PyArg_ParseTupleAndKeywords(args, kwargs, "OOp|ipOOOOOO:transfer", const_cast<char**>(kwlist), &base_obj,
                                   &runs_obj, &to_engine, &threads, &streaming, &progress_obj, &word_obj, &check_obj,
                                   &check_offsets_obj, &check_size_obj, &expected_obj)) {
    return nullptr;
  }
  uint64_t pool_base, progress = 0, word = 0, check_size = 0;
  std::vector<uint64_t> check, check_offsets, expected;
  std::vector<Run> runs;
  size_t nblocks = 0;
  if (!parse_u64(base_obj, "pool_base", &pool_base) || !parse_threads(threads) ||
      !runs_of_plan(runs_obj, pool_base, to_engine != 0, &runs, &nblocks) ||
      (progress_obj != nullptr && !parse_u64(progress_obj, "progress", &progress)) ||
      (word_obj != nullptr && !parse_u64(word_obj, "progress_word", &word)) ||
      (check_size_obj != nullptr && !parse_u64(check_size_obj, "check_size", &check_size)) ||
      (check_obj != Py_None && !parse_u64_array(check_obj, "check", &check)) ||
      (check_offsets_obj != Py_None && !parse_u64_array(check_offsets_obj, "check_offsets", &check_offsets)) ||
      (expected_obj != Py_None && !parse_u64_array(expected_obj, "expected", &expected))) {
    return nullptr;
  }
  const size_t runs_n = runs.size();
  if (check.size() != check_offsets.size() || check.size() != expected.size()) {
    PyErr_Format(PyExc_ValueError, "check, check_offsets and expected must have the same length (got %zu, %zu, %zu)",
                 check.size(), check_offsets.size(), expected.size());
    return nullptr;
  }
  std::vector<uint64_t> check_addrs;
  if (!block_addresses(pool_base, check_offsets, check_size, "checksum", &check_addrs)) return nullptr;
  for (size_t i = 0; i < check.size(); ++i) {
    if (check[i] >= nblocks) {
      PyErr_Format(PyExc_ValueError, "check[%zu] = %llu is not a position among %zu blocks", i,
                   static_cast<unsigned long long>(check[i]), nblocks);
      return nullptr;
    }
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
    coalesce(&runs);
    copy_runs(runs, threads, streaming != 0);
  }
  Py_END_ALLOW_THREADS
  return u64_bytes(corrupt);
}

PyMethodDef kTransferMethods[] = {
    {"transfer", KV_KW(py_transfer),
     "transfer(pool_base, runs, to_engine, threads=1, streaming=True, progress=0, progress_word=0, check=None,\n"
     "         check_offsets=None, check_size=0, expected=None) -> bytes\n\n"
     "One chunk in one call, GIL released: verify the sampled blocks' CRC32C, copy every run of the others\n"
     "(in layout order posting progress when `progress` is an address), return the corrupt positions."},
    {nullptr, nullptr, 0, nullptr},
};

}  // namespace

bool add_transfer(PyObject* module) { return PyModule_AddFunctions(module, kTransferMethods) == 0; }

}  // namespace kvstore
