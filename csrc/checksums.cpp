// Checksums: the CRC32C of blocks (a seal's, a disk write's) and of buffers, and a buffer copied and
// checksummed in one pass (a fetched block verified as it lands). crc32c.cpp holds the algorithm.

#include <algorithm>

#include "crc32c.h"
#include "kvstore_native.h"

namespace kvstore {

namespace {

uint64_t total_bytes(size_t n, uint64_t size) {
  uint64_t total;
  return __builtin_mul_overflow(static_cast<uint64_t>(n), size, &total) ? UINT64_MAX : total;
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

PyMethodDef kChecksumMethods[] = {
    {"checksum_blocks", KV_KW(py_checksum_blocks),
     "checksum_blocks(base, offsets, size, threads=1) -> bytes\n\n"
     "CRC32C of each `size`-byte block at base+offsets[i], as native-endian uint64 values."},
    {"crc32c", KV_KW(py_crc32c), "crc32c(data, crc=0) -> int\n\nCRC32C of a bytes-like object, continuing from crc."},
    {"crc32c_portable", KV_KW(py_crc32c_portable),
     "crc32c_portable(data, crc=0) -> int\n\nSame as crc32c, always with the table-driven implementation."},
    {"crc32c_copy", KV_KW(py_crc32c_copy),
     "crc32c_copy(src, dst) -> int\n\nCopy src into dst (a writable buffer at least as long), GIL released;\n"
     "returns src's CRC32C, computed in the same pass."},
    {nullptr, nullptr, 0, nullptr},
};

}  // namespace

bool add_checksums(PyObject* module) { return PyModule_AddFunctions(module, kChecksumMethods) == 0; }

}  // namespace kvstore
