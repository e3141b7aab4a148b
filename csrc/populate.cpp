// kvstore_service._native, populate part: fault a fresh pool's pages in at start, on several threads.
// The kernel's MADV_POPULATE_WRITE on one thread runs at the speed of one core's page faults (on this
// VM 8 GiB took 5.6 s); the faults of disjoint ranges run in parallel, so the pool is ready in about a
// core count's fraction of that (issue "Big nodes": a 1 TiB pool took minutes on one thread).

#include <sys/mman.h>
#include <unistd.h>

#include <algorithm>
#include <atomic>
#include <cerrno>
#include <thread>
#include <vector>

#include "kvstore_native.h"

#ifndef MADV_POPULATE_WRITE
#define MADV_POPULATE_WRITE 23
#endif

namespace kvstore {
namespace {

constexpr uint64_t kStep = 64ull << 20;  // threads take the range 64 MiB at a time (fast ones take more)

// populate(base, size, threads) -> int: MADV_POPULATE_WRITE over [base, base + size) on `threads`
// threads, GIL released. Returns 0, or the errno of the first failure (EINVAL: a kernel before 5.14).
PyObject* py_populate(PyObject*, PyObject* args) {
  PyObject *base_obj, *size_obj;
  int threads;
  if (!PyArg_ParseTuple(args, "OOi:populate", &base_obj, &size_obj, &threads)) return nullptr;
  uint64_t base, size;
  if (!parse_u64(base_obj, "base", &base) || !parse_u64(size_obj, "size", &size)) return nullptr;
  const uint64_t page = static_cast<uint64_t>(sysconf(_SC_PAGESIZE));
  if (base % page != 0 || threads < 1 || threads > 1024) {
    PyErr_SetString(PyExc_ValueError, "populate: a page-aligned base and 1 to 1024 threads are needed");
    return nullptr;
  }
  std::atomic<uint64_t> next{0};
  std::atomic<int> failure{0};
  auto work = [&] {
    for (uint64_t at = next.fetch_add(kStep); at < size && failure.load() == 0; at = next.fetch_add(kStep)) {
      const uint64_t n = std::min(kStep, size - at);
      if (madvise(reinterpret_cast<void*>(base + at), (n + page - 1) / page * page, MADV_POPULATE_WRITE) != 0) {
        int expected = 0;
        failure.compare_exchange_strong(expected, errno);
      }
    }
  };
  Py_BEGIN_ALLOW_THREADS
  std::vector<std::thread> pool;
  const int extra = static_cast<int>(std::min<uint64_t>(threads, (size + kStep - 1) / kStep)) - 1;
  for (int i = 0; i < extra; ++i) pool.emplace_back(work);
  work();
  for (std::thread& t : pool) t.join();
  Py_END_ALLOW_THREADS
  return PyLong_FromLong(failure.load());
}

PyMethodDef kPopulateMethods[] = {
    {"populate", py_populate, METH_VARARGS,
     "populate(base, size, threads) -> int\n\nFault [base, base + size) in for writing (MADV_POPULATE_WRITE) on\n"
     "`threads` threads, GIL released; 0, or the errno of the first failure."},
    {nullptr, nullptr, 0, nullptr},
};

}  // namespace

bool add_populate(PyObject* module) { return PyModule_AddFunctions(module, kPopulateMethods) == 0; }

}  // namespace kvstore
