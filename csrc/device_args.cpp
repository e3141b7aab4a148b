// The arguments the device copies (cuda_copy.cpp, acl_copy.cpp) share, parsed once for both: a copy of
// arrays of offsets (the benchmarks', the device checks') or of a chunk's Runs (the daemon's).

#include <cstring>

#include "crc32c.h"
#include "kvstore_native.h"

namespace kvstore {

namespace {

// Parses "h2d" / "d2h" / "d2d"; returns false with ValueError set.
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

}  // namespace

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

bool parse_device_transfer_args(PyObject* args, PyObject* kwargs, const char* format, DeviceCopyArgs* out) {
  static const char* kwlist[] = {"pool_base", "runs", "to_engine", "device", "checksum_offsets", "checksum_size",
                                 nullptr};
  PyObject *base_obj, *runs_obj, *checksum_offsets_obj = Py_None, *checksum_size_obj = nullptr;
  int to_engine;
  if (!PyArg_ParseTupleAndKeywords(args, kwargs, format, const_cast<char**>(kwlist), &base_obj, &runs_obj, &to_engine,
                                   &out->device, &checksum_offsets_obj, &checksum_size_obj)) {
    return false;
  }
  uint64_t pool_base;
  size_t blocks;
  std::vector<uint64_t> checksum_offsets;
  if (!parse_u64(base_obj, "pool_base", &pool_base) ||
      !runs_of_plan(runs_obj, pool_base, to_engine != 0, &out->runs, &blocks) ||
      (checksum_size_obj != nullptr && !parse_u64(checksum_size_obj, "checksum_size", &out->checksum_size)) ||
      (checksum_offsets_obj != Py_None &&
       (!parse_u64_array(checksum_offsets_obj, "checksum_offsets", &checksum_offsets) ||
        !block_addresses(pool_base, checksum_offsets, out->checksum_size, "checksum", &out->checksum_addrs)))) {
    return false;
  }
  out->dir = to_engine ? Direction::kHostToDevice : Direction::kDeviceToHost;
  coalesce(&out->runs);
  return true;
}

}  // namespace kvstore
