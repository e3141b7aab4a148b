// kvstore_service._native, populate part: fault a fresh pool's pages in at start, on several threads.
// The kernel's MADV_POPULATE_WRITE on one thread runs at the speed of one core's page faults (on this
// VM 8 GiB took 5.6 s); the faults of disjoint ranges run in parallel, so the pool is ready in about a
// core count's fraction of that (issue "Big nodes": a 1 TiB pool took minutes on one thread). Before
// that, `interleave` spreads the pages over NUMA nodes (the pool is shared by every device's engines).

#include <sys/mman.h>
#include <sys/syscall.h>
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

// interleave(base, size, nodemask) -> int: the pages of [base, base + size), faulted in from now on,
// go round-robin to the NUMA nodes of `nodemask` (bit n: node n; mbind MPOL_INTERLEAVE, kept by the
// shared memory object). 0, or the errno (ENOSYS: a kernel without NUMA).
PyObject* py_interleave(PyObject*, PyObject* args) {
  PyObject *base_obj, *size_obj, *mask_obj;
  if (!PyArg_ParseTuple(args, "OOO:interleave", &base_obj, &size_obj, &mask_obj)) return nullptr;
  uint64_t base, size, mask;
  if (!parse_u64(base_obj, "base", &base) || !parse_u64(size_obj, "size", &size) ||
      !parse_u64(mask_obj, "nodemask", &mask))
    return nullptr;
  if (mask == 0) {
    PyErr_SetString(PyExc_ValueError, "interleave: an empty nodemask");
    return nullptr;
  }
  constexpr int kMpolInterleave = 3;
  unsigned long nodes = static_cast<unsigned long>(mask);
  // (maxnode counts one past the mask's bits: the kernel reads maxnode - 1 of them)
  const long rc = syscall(SYS_mbind, base, size, kMpolInterleave, &nodes, 8 * sizeof(nodes) + 1, 0);
  return PyLong_FromLong(rc == 0 ? 0 : errno);
}

PyMethodDef kPopulateMethods[] = {
    {"populate", py_populate, METH_VARARGS,
     "populate(base, size, threads) -> int\n\nFault [base, base + size) in for writing (MADV_POPULATE_WRITE) on\n"
     "`threads` threads, GIL released; 0, or the errno of the first failure."},
    {"interleave", py_interleave, METH_VARARGS,
     "interleave(base, size, nodemask) -> int\n\nSpread the pages of [base, base + size) faulted in from now on over\n"
     "the NUMA nodes of `nodemask` (bit n: node n); 0, or the errno."},
    {nullptr, nullptr, 0, nullptr},
};

}  // namespace

bool add_populate(PyObject* module) { return PyModule_AddFunctions(module, kPopulateMethods) == 0; }

}  // namespace kvstore
