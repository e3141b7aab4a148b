// The copy engine: a list of runs (source, destination, size) coalesced, split over threads by bytes
// and copied with memcpy or non-temporal stores, the GIL released. What every CPU copy of the daemon
// ends in (transfer.cpp's chunks, checksums.cpp's crc32c_copy, the benchmarks' copy_blocks).

#include <algorithm>
#include <cstring>

#if defined(__x86_64__)
#include <immintrin.h>
#endif

#include "kvstore_native.h"

namespace kvstore {

namespace {

// Below this many bytes per thread, spawning a thread costs more than it saves.
constexpr uint64_t kMinBytesPerThread = 256 * 1024;
// Runs shorter than this are copied with memcpy (see stream_copy_avx2).
constexpr uint64_t kStreamMin = 4096;

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

}  // namespace

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

namespace {

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

PyMethodDef kCopyMethods[] = {
    {"copy_blocks", KV_KW(py_copy_blocks),
     "copy_blocks(src_base, dst_base, src_offsets, dst_offsets, sizes, threads=1, streaming=True) -> int\n\n"
     "Copy block i from src_base+src_offsets[i] to dst_base+dst_offsets[i] (sizes[i] bytes) with memcpy on\n"
     "`threads` threads, GIL released. Offsets/sizes: uint64 buffers. Runs contiguous on both sides are\n"
     "merged first; returns the number of merged runs. Bounds are the caller's job. streaming: non-temporal\n"
     "stores for runs of 4 KiB and more (for a destination nothing reads soon)."},
    {"coalesce_runs", KV_KW(py_coalesce_runs),
     "coalesce_runs(src_offsets, dst_offsets, sizes) -> list[tuple[int, int, int]]\n\n"
     "The merged (src, dst, size) runs the copy functions would execute."},
    {nullptr, nullptr, 0, nullptr},
};

}  // namespace

int effective_parts(int threads, uint64_t total_bytes, uint64_t max_parts) {
  uint64_t by_bytes = std::max<uint64_t>(1, total_bytes / kMinBytesPerThread);
  return static_cast<int>(std::min<uint64_t>({static_cast<uint64_t>(threads), by_bytes, max_parts}));
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
    if (r.size == 0) continue;
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
    runs->push_back(Run{src, dst, sizes[i]});
  }
  coalesce(runs);
  return true;
}

bool add_copy(PyObject* module) { return PyModule_AddFunctions(module, kCopyMethods) == 0; }

}  // namespace kvstore
