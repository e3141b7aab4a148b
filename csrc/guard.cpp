// kvstore_service._native, guard part: engine memory the daemon maps although its owner can still shrink it
// (a memfd without F_SEAL_SHRINK: SGLang's shared host pool is made so). A copy touching a page past the
// file's new end would raise SIGBUS and end the daemon. A guarded range instead gets, on such a fault,
// anonymous memory mapped over its rest (MAP_FIXED), and is marked faulted: the copy goes on over zeros,
// and the caller fails every job of the range from then on (guard_faulted). The technique is Wayland's for
// its clients' shared-memory pools (libwayland-server, wl_shm: SIGBUS handler and an anonymous remap).
//
// The handler is async-signal-safe: it reads a fixed table with atomics and calls mmap(2). A SIGBUS outside
// every guarded range goes to the handler installed before ours (Python's faulthandler, or the default).

#include <signal.h>
#include <sys/mman.h>
#include <unistd.h>

#include <atomic>
#include <cstdint>
#include <mutex>

#include "kvstore_native.h"

namespace kvstore {
namespace {

constexpr int kMaxGuards = 4096;  // ranges guarded at once (one per mapped unsealed memfd)

struct Guard {
  std::atomic<uintptr_t> base{0};  // 0: a free entry
  std::atomic<uintptr_t> size{0};
  std::atomic<int> faulted{0};
};

Guard g_guards[kMaxGuards];
std::mutex g_table;  // guard/unguard (the handler only reads)
uintptr_t g_page = 4096;  // set before the handler is installed (sysconf is not async-signal-safe)
struct sigaction g_previous;
bool g_installed = false;

void on_sigbus(int sig, siginfo_t* info, void* context) {
  const uintptr_t at = reinterpret_cast<uintptr_t>(info->si_addr);
  for (Guard& g : g_guards) {
    const uintptr_t base = g.base.load(std::memory_order_acquire);
    const uintptr_t size = g.size.load(std::memory_order_acquire);
    if (base == 0 || at < base || at - base >= size) continue;
    const uintptr_t page = at & ~(g_page - 1);
    void* over = mmap(reinterpret_cast<void*>(page), base + size - page, PROT_READ | PROT_WRITE,
                      MAP_PRIVATE | MAP_ANONYMOUS | MAP_FIXED | MAP_NORESERVE, -1, 0);
    if (over == MAP_FAILED) break;  // cannot repair: fall through to the previous handler
    g.faulted.store(1, std::memory_order_release);
    return;  // the faulting access runs again, on the anonymous pages
  }
  if ((g_previous.sa_flags & SA_SIGINFO) && g_previous.sa_sigaction != nullptr) {
    g_previous.sa_sigaction(sig, info, context);
  } else if (g_previous.sa_handler != SIG_DFL && g_previous.sa_handler != SIG_IGN) {
    g_previous.sa_handler(sig);
  } else {
    struct sigaction fallback = {};
    fallback.sa_handler = SIG_DFL;
    sigaction(SIGBUS, &fallback, nullptr);  // returning re-faults: the default action ends the process
  }
}

// guard_memory(base, size) -> int: guard [base, base + size) (page-aligned, mapped by the caller).
PyObject* py_guard_memory(PyObject*, PyObject* args) {
  PyObject *base_obj, *size_obj;
  if (!PyArg_ParseTuple(args, "OO:guard_memory", &base_obj, &size_obj)) return nullptr;
  uint64_t base, size;
  if (!parse_u64(base_obj, "base", &base) || !parse_u64(size_obj, "size", &size)) return nullptr;
  if (base == 0 || size == 0 || base % static_cast<uint64_t>(sysconf(_SC_PAGESIZE)) != 0) {
    PyErr_SetString(PyExc_ValueError, "guard_memory: a page-aligned, non-empty range is needed");
    return nullptr;
  }
  std::lock_guard<std::mutex> lock(g_table);
  if (!g_installed) {
    g_page = static_cast<uintptr_t>(sysconf(_SC_PAGESIZE));
    struct sigaction action = {};
    action.sa_sigaction = on_sigbus;
    action.sa_flags = SA_SIGINFO | SA_NODEFER;
    sigemptyset(&action.sa_mask);
    if (sigaction(SIGBUS, &action, &g_previous) != 0) return PyErr_SetFromErrno(PyExc_OSError);
    g_installed = true;
  }
  for (int i = 0; i < kMaxGuards; ++i) {
    if (g_guards[i].base.load(std::memory_order_relaxed) != 0) continue;
    g_guards[i].faulted.store(0, std::memory_order_relaxed);
    g_guards[i].size.store(size, std::memory_order_release);
    g_guards[i].base.store(base, std::memory_order_release);
    return PyLong_FromLong(i);
  }
  PyErr_Format(PyExc_ValueError, "guard_memory: %d ranges are guarded already", kMaxGuards);
  return nullptr;
}

bool parse_guard(PyObject* args, const char* format, int* id) {
  if (!PyArg_ParseTuple(args, format, id)) return false;
  if (*id < 0 || *id >= kMaxGuards) {
    PyErr_Format(PyExc_ValueError, "no guard %d", *id);
    return false;
  }
  return true;
}

// guard_faulted(id) -> bool: whether the range faulted since it was guarded (its memory is gone).
PyObject* py_guard_faulted(PyObject*, PyObject* args) {
  int id;
  if (!parse_guard(args, "i:guard_faulted", &id)) return nullptr;
  return PyBool_FromLong(g_guards[id].faulted.load(std::memory_order_acquire));
}

// unguard_memory(id): the range is about to be unmapped; no copy touches it any more.
PyObject* py_unguard_memory(PyObject*, PyObject* args) {
  int id;
  if (!parse_guard(args, "i:unguard_memory", &id)) return nullptr;
  std::lock_guard<std::mutex> lock(g_table);
  g_guards[id].base.store(0, std::memory_order_release);
  g_guards[id].size.store(0, std::memory_order_release);
  Py_RETURN_NONE;
}

PyMethodDef kGuardMethods[] = {
    {"guard_memory", py_guard_memory, METH_VARARGS,
     "guard_memory(base, size) -> int\n\nGuard a mapped range of shrinkable memory: a SIGBUS in it maps anonymous\n"
     "memory over its rest and marks it faulted, instead of ending the process. Returns the guard's id."},
    {"guard_faulted", py_guard_faulted, METH_VARARGS,
     "guard_faulted(id) -> bool\n\nWhether the guarded range faulted (its owner shrank it): its copies are void."},
    {"unguard_memory", py_unguard_memory, METH_VARARGS, "unguard_memory(id)\n\nStop guarding (before unmapping)."},
    {nullptr, nullptr, 0, nullptr},
};

}  // namespace

bool add_guard(PyObject* module) { return PyModule_AddFunctions(module, kGuardMethods) == 0; }

}  // namespace kvstore
