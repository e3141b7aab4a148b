// Shared pieces of the kvstore_service._native extension (plain CPython C API, no torch).
//
// One file per concern, each adding its functions to the module (add_*, called by module.cpp):
//   buffers.cpp       Python ints and uint64 buffers in, bytes out (this header's parsing helpers)
//   copy.cpp          the copy engine: runs coalesced and split over threads, streaming stores
//   checksums.cpp     CRC32C of blocks and buffers (crc32c.cpp holds the algorithm)
//   plan.cpp          a job's checks at submit, and a chunk's runs planned and bounds-checked (Runs)
//   transfer.cpp      a chunk in one call: checksum sample, copy, progress posts
//   slot_headers.cpp  the pool's slot header, the one definition of its layout
//   device_args.cpp   the arguments the device copies share; cuda_copy.cpp, acl_copy.cpp the copies
//   block.cpp, disk_io.cpp, guard.cpp, populate.cpp: the index's records, disk I/O, guards, populate
//
// Memory safety: addresses are base + offset, and the copy functions do not know the mappings' sizes:
// keeping every (offset, size) inside its mapping is the caller's job (plan.cpp checks a chunk's runs
// against the pool and the engine's regions); the copies only reject 64-bit overflow of
// base + offset + size. Overlapping source/destination ranges are undefined, as with memcpy.
#pragma once

#define PY_SSIZE_T_CLEAN
#include <Python.h>

#include <cstdint>
#include <string>
#include <system_error>
#include <thread>
#include <vector>

// A PyMethodDef's function and flags for an entry point taking (self, args, kwargs).
#define KV_KW(fn) reinterpret_cast<PyCFunction>(reinterpret_cast<void (*)(void)>(fn)), METH_VARARGS | METH_KEYWORDS

namespace kvstore {

// One contiguous copy: absolute source and destination addresses and a length in bytes.
struct Run {
  uint64_t src;
  uint64_t dst;
  uint64_t size;
};

// A Py_buffer released when it goes out of scope (set `held` once it was filled).
struct Buffer {
  Py_buffer view{};
  bool held = false;
  ~Buffer() {
    if (held) PyBuffer_Release(&view);
  }
};

// ---- buffers.cpp --------------------------------------------------------------------------------

// Parses a Python int (or anything with __index__) as an unsigned 64-bit address/offset.
// Returns false with a Python exception set.
bool parse_u64(PyObject* obj, const char* name, uint64_t* out);

// Copies a uint64 buffer (array('Q'), numpy uint64/int64, bytes of native uint64, ...) into `out`.
// Returns false with a Python exception set (ValueError for a wrong item size or format).
bool parse_u64_array(PyObject* obj, const char* name, std::vector<uint64_t>* out);

// ValueError unless 1 <= threads <= kMaxThreads (more is a configuration mistake, not a speedup).
bool parse_threads(int threads);

// base + offsets[i] for every block of `size` bytes, rejecting 64-bit overflow (OverflowError naming `name`).
bool block_addresses(uint64_t base, const std::vector<uint64_t>& offsets, uint64_t size, const char* name,
                     std::vector<uint64_t>* out);

// A bytes object of native-endian uint64 values.
PyObject* u64_bytes(const std::vector<uint64_t>& values);

// Helper for feature dicts: sets features[key] = value (steals nothing); false on error.
bool set_item(PyObject* dict, const char* key, PyObject* value);

// ---- copy.cpp -----------------------------------------------------------------------------------

// Validates the offset/size buffers (equal lengths, no address overflow), adds the bases, drops
// empty runs and merges runs contiguous in both source and destination (after sorting by
// source address). Bounds are not checked. Needs the GIL; returns false with a Python exception set.
bool build_runs(uint64_t src_base, uint64_t dst_base, PyObject* src_offsets, PyObject* dst_offsets,
                PyObject* sizes, std::vector<Run>* runs);

// Sorts runs by source address, drops empty ones and merges neighbours contiguous on both sides. Pure,
// no GIL needed.
void coalesce(std::vector<Run>* runs);

// How many threads share `total_bytes` (at least 256 KiB each, at most `threads` and `max_parts`).
int effective_parts(int threads, uint64_t total_bytes, uint64_t max_parts);

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

// Copies a list of runs on this thread (`streaming`: non-temporal stores for runs of 4 KiB and more);
// returns once every byte is visible to other threads. No GIL needed.
void copy_list(const std::vector<Run>& list, bool streaming);

// Copies runs on up to `threads` threads, split by bytes. No GIL needed.
void copy_runs(const std::vector<Run>& runs, int threads, bool streaming);

// ---- plan.cpp -----------------------------------------------------------------------------------

// The runs of a Runs object (plan_transfer's), pool -> engine if `to_engine`, as absolute addresses:
// run i is the pool's pool_base + pool offset and the engine address. `blocks`: the runs' blocks (the
// runs are region-major, `blocks` per region). False with TypeError (not a Runs) or OverflowError set.
bool runs_of_plan(PyObject* plan, uint64_t pool_base, bool to_engine, std::vector<Run>* runs, size_t* blocks);

// ---- device_args.cpp ----------------------------------------------------------------------------

// Copy direction of the device paths.
enum class Direction { kHostToDevice, kDeviceToHost, kDeviceToDevice };

// What a device copy does: its runs, direction, device and stream, and the host blocks (checksum_size
// bytes at each of checksum_addrs) it checksums while its DMA runs.
struct DeviceCopyArgs {
  std::vector<Run> runs;
  Direction dir = Direction::kHostToDevice;
  int device = 0;
  uint64_t stream = 0;
  bool allow_batch = true;
  std::vector<uint64_t> checksum_addrs;
  uint64_t checksum_size = 0;

  // The CRC32C of each checksum block: what the copy call returns (taken while its DMA runs).
  std::vector<uint64_t> checksums() const;
};

// The arguments of cuda_copy_blocks / acl_copy_blocks: (src_base, dst_base, src_offsets, dst_offsets, sizes,
// direction, device, stream=None, allow_batch=True, checksum_base=0, checksum_offsets=None, checksum_size=0);
// `format` is "OOOOOOi|OpOOO:<function name>". Returns false with a Python exception set.
bool parse_device_copy_args(PyObject* args, PyObject* kwargs, const char* format, DeviceCopyArgs* out);

// The arguments of cuda_transfer / acl_transfer: (pool_base, runs, to_engine, device, checksum_offsets=None,
// checksum_size=0), a chunk's Runs copied pool -> engine (h2d) or engine -> pool (d2h), checksumming
// pool blocks; `format` is "OOpi|OO:<function name>". Returns false with a Python exception set.
bool parse_device_transfer_args(PyObject* args, PyObject* kwargs, const char* format, DeviceCopyArgs* out);

// ---- the units' functions, added to the module by module.cpp --------------------------------------

bool add_copy(PyObject* module);          // copy_blocks, coalesce_runs
bool add_checksums(PyObject* module);     // checksum_blocks, crc32c, crc32c_portable, crc32c_copy
bool add_plan(PyObject* module);          // check_job, plan_transfer, Runs
bool add_transfer(PyObject* module);      // transfer
bool add_slot_headers(PyObject* module);  // write/parse/invalidate_slot_headers, SLOT_* constants
bool add_cuda(PyObject* module);          // cuda_* (cuda_copy.cpp)
bool add_acl(PyObject* module);           // acl_* (acl_copy.cpp)
bool add_disk_io(PyObject* module);       // disk_* and DISK_* constants (disk_io.cpp)
bool add_populate(PyObject* module);      // populate, interleave (populate.cpp)
bool add_guard(PyObject* module);         // guard_memory / guard_faulted / unguard_memory (guard.cpp)
bool add_block_type(PyObject* module);    // BlockRecord, LruList and their batch operations (block.cpp)

// Adds cuda_* / acl_* keys to `features`; CUDA probes the driver (dlopen + cuInit) on first use.
bool add_cuda_features(PyObject* features);
bool add_acl_features(PyObject* features);

}  // namespace kvstore
