// Shared pieces of the kvstore_service._native extension (plain CPython C API, no torch).
#pragma once

#define PY_SSIZE_T_CLEAN
#include <Python.h>

#include <cstdint>
#include <string>
#include <vector>

namespace kvstore {

// One contiguous copy: absolute source and destination addresses and a length in bytes.
struct Run {
  uint64_t src;
  uint64_t dst;
  uint64_t size;
};

// Parses a Python int (or anything with __index__) as an unsigned 64-bit address/offset.
// Returns false with a Python exception set.
bool parse_u64(PyObject* obj, const char* name, uint64_t* out);

// Copies a uint64 buffer (array('Q'), numpy uint64/int64, bytes of native uint64, ...) into `out`.
// Returns false with a Python exception set (ValueError for a wrong item size or format).
bool parse_u64_array(PyObject* obj, const char* name, std::vector<uint64_t>* out);

// Validates the offset/size buffers (equal lengths, no address overflow), adds the bases, drops
// empty entries and merges runs contiguous in both source and destination (after sorting by
// source address). Bounds are not checked: keeping offsets inside the mappings is the caller's job.
// Needs the GIL; returns false with a Python exception set.
bool build_runs(uint64_t src_base, uint64_t dst_base, PyObject* src_offsets, PyObject* dst_offsets,
                PyObject* sizes, std::vector<Run>* runs);

// Sorts runs by source address and merges neighbours contiguous on both sides. Pure, no GIL needed.
void coalesce(std::vector<Run>* runs);

// Copy direction of the device paths.
enum class Direction { kHostToDevice, kDeviceToHost, kDeviceToDevice };
// Parses "h2d" / "d2h" / "d2d"; returns false with ValueError set.
bool parse_direction(PyObject* obj, Direction* out);

// The arguments of cuda_copy_blocks / acl_copy_blocks: (src_base, dst_base, src_offsets,
// dst_offsets, sizes, direction, device, stream=None, allow_batch=True, checksum_base=0,
// checksum_offsets=None, checksum_size=0), runs already built; the checksum arguments name host
// blocks of checksum_size bytes at checksum_base + checksum_offsets[i] to checksum while the copy runs.
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
// A bytes object of native-endian uint64 values.
PyObject* u64_bytes(const std::vector<uint64_t>& values);

// `format` is "OOOOOOi|OpOOO:<function name>". Returns false with a Python exception set.
bool parse_device_copy_args(PyObject* args, PyObject* kwargs, const char* format, DeviceCopyArgs* out);

// Device paths (cuda_copy.cpp, acl_copy.cpp): Python entry points and feature reporting.
PyObject* py_cuda_copy_blocks(PyObject* self, PyObject* args, PyObject* kwargs);
PyObject* py_cuda_host_register(PyObject* self, PyObject* args, PyObject* kwargs);
PyObject* py_cuda_host_unregister(PyObject* self, PyObject* args, PyObject* kwargs);
PyObject* py_cuda_open_ipc_event(PyObject* self, PyObject* args, PyObject* kwargs);
PyObject* py_cuda_query_event(PyObject* self, PyObject* args, PyObject* kwargs);
PyObject* py_cuda_destroy_event(PyObject* self, PyObject* args, PyObject* kwargs);
// Adds cuda_* keys to `features`; probes the driver (dlopen + cuInit) on first use.
bool add_cuda_features(PyObject* features);

PyObject* py_acl_copy_blocks(PyObject* self, PyObject* args, PyObject* kwargs);
PyObject* py_acl_host_register(PyObject* self, PyObject* args, PyObject* kwargs);
PyObject* py_acl_host_unregister(PyObject* self, PyObject* args, PyObject* kwargs);
bool add_acl_features(PyObject* features);

// Disk tier I/O (disk_io.cpp): adds the disk_* functions and DISK_* constants to the module.
bool add_disk_io(PyObject* module);

// populate (populate.cpp): a fresh pool's pages faulted in on several threads.
bool add_populate(PyObject* module);

// guard_memory / guard_faulted / unguard_memory (guard.cpp): mappings of shrinkable memory, SIGBUS-safe.
bool add_guard(PyObject* module);

// The index's block record type and make_blocks (block.cpp).
bool add_block_type(PyObject* module);

// Helper for feature dicts: sets features[key] = value (steals nothing); false on error.
bool set_item(PyObject* dict, const char* key, PyObject* value);

}  // namespace kvstore
