// Ascend (CANN / AscendCL) copy path, the counterpart of cuda_copy.cpp.
//
// UNVERIFIED: written against the documented AscendCL API (acl_rt.h of CANN 8.x) and never run on
// Ascend hardware; no CANN toolkit was available where it was written.
//
// Compiled in only when setup.py finds the CANN headers (KVSTORE_WITH_ACL). The headers provide
// the long-standing types (aclError, aclrtStream, aclrtMemcpyKind, aclrtMemLocation); the library
// itself is dlopen'ed at runtime, like libcuda, so that
//  * the module imports on a node without the CANN runtime (functions raise RuntimeError), and
//  * the CANN 8.5 calls (aclrtMemcpyBatchAsync, aclrtHostRegisterV2, aclrtHostGetDevicePointer)
//    are used only when the installed libascendcl exports them, whatever header version the build saw.
// aclInit runs on the first copy or registration, never from features(): by then torch_npu has
// initialised ACL in the daemon (NpuBackend imports on the device first) and our call gets
// ACL_ERROR_REPEAT_INITIALIZE, which is fine; the other order would make torch_npu skip its config.
//  * Pool registration: aclrtHostRegisterV2(MAPPED | PINNED) page-locks; the legacy
//    aclrtHostRegister is the fallback and leaves copies synchronous (features()["acl_host_pinned"]).
//  * Batch copy: aclrtMemcpyBatchAsync (a trial API) for h2d/d2h only; on a "not supported" result
//    the process falls back to one aclrtMemcpyAsync per run and stays there. d2d never batches.
// Without KVSTORE_WITH_ACL the functions still exist, validate their arguments, and raise
// RuntimeError saying the build had no CANN headers.

#include "kvstore_native.h"

#if defined(KVSTORE_WITH_ACL)
#include <dlfcn.h>

#include <acl/acl.h>

#include <algorithm>
#include <atomic>
#include <functional>
#include <map>
#include <mutex>
#endif

namespace kvstore {

#if defined(KVSTORE_WITH_ACL)
namespace {

// aclrtMemcpyBatchAttr as documented for CANN 8.5 ({dstLoc, srcLoc, uint8_t rsv[16]}). Declared
// here because older headers lack it and the function is resolved at runtime anyway.
struct BatchAttr {
  aclrtMemLocation dstLoc;
  aclrtMemLocation srcLoc;
  uint8_t rsv[16];
};

constexpr aclError kAclRepeatInitialize = 100002;  // ACL_ERROR_REPEAT_INITIALIZE: already initialised
// Results meaning "this runtime/driver/chip does not offer the call" (acl_base.h / acl_rt.h):
// ACL_ERROR_RT_FEATURE_NOT_SUPPORT (the one the runtime returns for unsupported rt features, and
// the one Mooncake's Ascend transport falls back on for aclrtMemcpyBatchAsync),
// ACL_ERROR_FEATURE_UNSUPPORTED and ACL_ERROR_API_NOT_SUPPORT.
constexpr aclError kAclRtFeatureNotSupport = 207000;
constexpr aclError kAclFeatureUnsupported = 200006;
constexpr aclError kAclApiNotSupport = 200001;
constexpr int kHostRegisterMapped = 0;              // ACL_HOST_REGISTER_MAPPED (legacy aclrtHostRegisterType)
constexpr uint32_t kHostRegMapped = 0x2;            // ACL_HOST_REG_MAPPED (aclrtHostRegisterV2 flag, CANN 8.5)
constexpr uint32_t kHostRegPinned = 0x10000000;     // ACL_HOST_REG_PINNED (aclrtHostRegisterV2 flag, CANN 8.5)
constexpr uint64_t kHostPage = 4096;                // aclrtHostRegister[V2]: 4 KiB-aligned address and size
constexpr size_t kMaxBatch = 8192;

bool not_supported(aclError rc) {
  return rc == kAclRtFeatureNotSupport || rc == kAclFeatureUnsupported || rc == kAclApiNotSupport;
}

using PFN_aclInit = aclError (*)(const char*);
using PFN_aclrtGetDeviceCount = aclError (*)(uint32_t*);
using PFN_aclrtSetDevice = aclError (*)(int32_t);
using PFN_aclrtGetCurrentContext = aclError (*)(aclrtContext*);
using PFN_aclrtSetCurrentContext = aclError (*)(aclrtContext);
using PFN_aclrtCreateStream = aclError (*)(aclrtStream*);
using PFN_aclrtSynchronizeStream = aclError (*)(aclrtStream);
using PFN_aclrtMemcpyAsync = aclError (*)(void*, size_t, const void*, size_t, aclrtMemcpyKind, aclrtStream);
using PFN_aclrtMemcpyBatchAsync = aclError (*)(void**, size_t*, void**, size_t*, size_t, BatchAttr*, size_t*, size_t,
                                               size_t*, aclrtStream);
using PFN_aclrtHostRegister = aclError (*)(void*, uint64_t, int, void**);
using PFN_aclrtHostRegisterV2 = aclError (*)(void*, uint64_t, uint32_t);
using PFN_aclrtHostGetDevicePointer = aclError (*)(void*, void**, uint32_t);
using PFN_aclrtHostUnregister = aclError (*)(void*);
using PFN_aclGetRecentErrMsg = const char* (*)();

struct Runtime {
  std::string error;
  PFN_aclInit init = nullptr;
  PFN_aclrtGetDeviceCount get_device_count = nullptr;
  PFN_aclrtSetDevice set_device = nullptr;
  PFN_aclrtGetCurrentContext get_current_context = nullptr;
  PFN_aclrtSetCurrentContext set_current_context = nullptr;
  PFN_aclrtCreateStream create_stream = nullptr;
  PFN_aclrtSynchronizeStream synchronize_stream = nullptr;
  PFN_aclrtMemcpyAsync memcpy_async = nullptr;
  PFN_aclrtMemcpyBatchAsync memcpy_batch_async = nullptr;  // null: CANN older than 8.5
  PFN_aclrtHostRegister host_register = nullptr;           // legacy: maps for the device, does not pin
  PFN_aclrtHostRegisterV2 host_register_v2 = nullptr;      // null: CANN older than 8.5
  PFN_aclrtHostGetDevicePointer host_get_device_pointer = nullptr;
  PFN_aclrtHostUnregister host_unregister = nullptr;
  PFN_aclGetRecentErrMsg recent_error = nullptr;
};

// Set once aclrtMemcpyBatchAsync answered "not supported": later copies go run by run at once.
std::atomic<bool> g_batch_unsupported{false};
// -1: nothing registered yet; 0: the last registration used the legacy call (not page-locked); 1: pinned.
std::atomic<int> g_last_register_pinned{-1};

// The aclError of the last failed call on this thread: describe() runs for every failed call, and the
// Python error carries it (`acl_error`), so that kvstore_service.native can tell device-fatal errors.
thread_local aclError t_failed = ACL_SUCCESS;

std::string describe(const Runtime& rt, aclError rc) {
  t_failed = rc;
  std::string s = "aclError " + std::to_string(rc);
  const char* msg = rt.recent_error ? rt.recent_error() : nullptr;
  if (msg != nullptr && *msg != '\0') s += std::string(": ") + msg;
  return s;
}

// dlopen + dlsym only. aclInit is left to the first copy or registration (`initialized_runtime`):
// a features() probe must not initialise ACL before torch_npu does, or torch_npu would get
// ACL_ERROR_REPEAT_INITIALIZE, skip its acl.json configuration and never call aclFinalize.
Runtime load_runtime() {
  Runtime rt;
  void* lib = dlopen("libascendcl.so", RTLD_NOW | RTLD_LOCAL);
  if (lib == nullptr) {
    const char* why = dlerror();
    rt.error = std::string("Ascend runtime not available: cannot load libascendcl.so (") + (why ? why : "?") + ")";
    return rt;
  }
  auto sym = [&](const char* name) { return dlsym(lib, name); };
  rt.init = reinterpret_cast<PFN_aclInit>(sym("aclInit"));
  rt.get_device_count = reinterpret_cast<PFN_aclrtGetDeviceCount>(sym("aclrtGetDeviceCount"));
  rt.set_device = reinterpret_cast<PFN_aclrtSetDevice>(sym("aclrtSetDevice"));
  rt.get_current_context = reinterpret_cast<PFN_aclrtGetCurrentContext>(sym("aclrtGetCurrentContext"));
  rt.set_current_context = reinterpret_cast<PFN_aclrtSetCurrentContext>(sym("aclrtSetCurrentContext"));
  rt.create_stream = reinterpret_cast<PFN_aclrtCreateStream>(sym("aclrtCreateStream"));
  rt.synchronize_stream = reinterpret_cast<PFN_aclrtSynchronizeStream>(sym("aclrtSynchronizeStream"));
  rt.memcpy_async = reinterpret_cast<PFN_aclrtMemcpyAsync>(sym("aclrtMemcpyAsync"));
  rt.memcpy_batch_async = reinterpret_cast<PFN_aclrtMemcpyBatchAsync>(sym("aclrtMemcpyBatchAsync"));
  rt.host_register = reinterpret_cast<PFN_aclrtHostRegister>(sym("aclrtHostRegister"));
  rt.host_register_v2 = reinterpret_cast<PFN_aclrtHostRegisterV2>(sym("aclrtHostRegisterV2"));
  rt.host_get_device_pointer = reinterpret_cast<PFN_aclrtHostGetDevicePointer>(sym("aclrtHostGetDevicePointer"));
  rt.host_unregister = reinterpret_cast<PFN_aclrtHostUnregister>(sym("aclrtHostUnregister"));
  rt.recent_error = reinterpret_cast<PFN_aclGetRecentErrMsg>(sym("aclGetRecentErrMsg"));
  if (!rt.init || !rt.get_device_count || !rt.set_device || !rt.get_current_context || !rt.set_current_context ||
      !rt.create_stream || !rt.synchronize_stream || !rt.memcpy_async) {
    rt.error = "libascendcl.so lacks a required entry point (CANN too old?)";
  }
  return rt;
}

const Runtime& runtime() {
  static const Runtime rt = load_runtime();
  return rt;
}

// The runtime, with aclInit done (once per process; ACL_ERROR_REPEAT_INITIALIZE, i.e. torch_npu
// initialised it already, is success). Returns "" or the reason it is unusable.
std::string initialized_runtime(const Runtime** out) {
  const Runtime& rt = runtime();
  *out = &rt;
  if (!rt.error.empty()) return rt.error;
  static std::once_flag once;
  static std::string init_error;
  std::call_once(once, [&rt] {
    aclError rc = rt.init(nullptr);
    if (rc != ACL_SUCCESS && rc != kAclRepeatInitialize) init_error = "aclInit failed: " + describe(rt, rc);
  });
  return init_error;
}

struct DeviceState {
  aclrtContext ctx = nullptr;
  std::mutex mu;
  std::vector<aclrtStream> idle;
};

// aclrtSetDevice once per device; other threads then bind its context with aclrtSetCurrentContext
// (the documented way to share one device context across threads).
DeviceState* device_state(const Runtime& rt, int device, std::string* err) {
  static std::mutex mu;
  static std::map<int, DeviceState*> devices;
  std::lock_guard<std::mutex> lock(mu);
  auto it = devices.find(device);
  if (it != devices.end()) return it->second;
  uint32_t count = 0;
  aclError rc = rt.get_device_count(&count);
  if (rc != ACL_SUCCESS) {
    *err = "aclrtGetDeviceCount failed: " + describe(rt, rc);
    return nullptr;
  }
  if (device < 0 || static_cast<uint32_t>(device) >= count) {
    *err = "Ascend device " + std::to_string(device) + " does not exist (" + std::to_string(count) + " visible)";
    return nullptr;
  }
  aclrtContext ctx = nullptr;
  if ((rc = rt.set_device(device)) != ACL_SUCCESS || (rc = rt.get_current_context(&ctx)) != ACL_SUCCESS) {
    *err = "cannot open Ascend device " + std::to_string(device) + ": " + describe(rt, rc);
    return nullptr;
  }
  auto* state = new DeviceState();  // kept for the life of the process
  state->ctx = ctx;
  devices[device] = state;
  return state;
}

std::string bind(const Runtime& rt, int device, DeviceState** out) {
  std::string err;
  DeviceState* dev = device_state(rt, device, &err);
  if (dev == nullptr) return err;
  aclError rc = rt.set_current_context(dev->ctx);
  if (rc != ACL_SUCCESS) return "aclrtSetCurrentContext failed: " + describe(rt, rc);
  *out = dev;
  return "";
}

aclrtMemcpyKind memcpy_kind(Direction dir) {
  switch (dir) {
    case Direction::kHostToDevice: return ACL_MEMCPY_HOST_TO_DEVICE;
    case Direction::kDeviceToHost: return ACL_MEMCPY_DEVICE_TO_HOST;
    default: return ACL_MEMCPY_DEVICE_TO_DEVICE;
  }
}

// Enqueues runs[start..] with aclrtMemcpyBatchAsync, kMaxBatch at a time. Sets *next to the first
// run not enqueued. Returns the first failing result (ACL_SUCCESS when all went), *err describing it.
aclError enqueue_batched(const Runtime& rt, const std::vector<Run>& runs, Direction dir, int device,
                         aclrtStream stream, size_t* next, std::string* err) {
  BatchAttr attr{};
  aclrtMemLocation host{};
  host.id = 0;
  host.type = ACL_MEM_LOCATION_TYPE_HOST;
  aclrtMemLocation dev{};
  dev.id = static_cast<uint32_t>(device);
  dev.type = ACL_MEM_LOCATION_TYPE_DEVICE;
  attr.srcLoc = dir == Direction::kHostToDevice ? host : dev;
  attr.dstLoc = dir == Direction::kDeviceToHost ? host : dev;
  std::vector<void*> dsts, srcs;
  std::vector<size_t> sizes;
  for (size_t start = *next; start < runs.size(); start = *next) {
    size_t count = std::min(kMaxBatch, runs.size() - start);
    dsts.resize(count);
    srcs.resize(count);
    sizes.resize(count);
    for (size_t i = 0; i < count; ++i) {
      dsts[i] = reinterpret_cast<void*>(runs[start + i].dst);
      srcs[i] = reinterpret_cast<void*>(runs[start + i].src);
      sizes[i] = runs[start + i].size;
    }
    size_t attr_index = 0;
    size_t fail_index = SIZE_MAX;
    // destMaxs == sizes: each destination run is exactly as long as its copy.
    aclError rc = rt.memcpy_batch_async(dsts.data(), sizes.data(), srcs.data(), sizes.data(), count, &attr,
                                        &attr_index, 1, &fail_index, stream);
    if (rc != ACL_SUCCESS) {
      std::string where = fail_index == SIZE_MAX ? "" : " at run " + std::to_string(start + fail_index);
      *err = "aclrtMemcpyBatchAsync failed" + where + ": " + describe(rt, rc);
      return rc;
    }
    *next = start + count;
  }
  return ACL_SUCCESS;
}

constexpr uint64_t kCopyAlign = 64;

std::string enqueue_copies(const Runtime& rt, const std::vector<Run>& runs, Direction dir, int device,
                           aclrtStream stream, bool allow_batch) {
  size_t next = 0;
  // The batch call takes one direction per batch, host->device or device->host only (CANN doc;
  // vllm-ascend excludes D2D too): device-to-device always goes run by run.
  if (allow_batch && dir != Direction::kDeviceToDevice && rt.memcpy_batch_async != nullptr &&
      !g_batch_unsupported.load(std::memory_order_relaxed)) {
    std::string err;
    aclError rc = enqueue_batched(rt, runs, dir, device, stream, &next, &err);
    if (rc == ACL_SUCCESS) return "";
    // A trial API in CANN 8.5: a runtime/driver/chip without it answers "not supported". Remember
    // that and send the rest (from the failed chunk on; nothing of that chunk was enqueued) run by run.
    if (!not_supported(rc)) return err;
    g_batch_unsupported.store(true, std::memory_order_relaxed);
  }
  const aclrtMemcpyKind kind = memcpy_kind(dir);
  for (size_t i = next; i < runs.size(); ++i) {
    // CANN 8.0 documents aclrtMemcpyAsync for 64-byte-aligned addresses: say so, not the runtime's code.
    if ((runs[i].dst | runs[i].src) % kCopyAlign != 0) {
      return "aclrtMemcpyAsync needs " + std::to_string(kCopyAlign) + "-byte-aligned addresses (CANN 8.0): run " +
             std::to_string(i) + " copies " + std::to_string(runs[i].src) + " -> " + std::to_string(runs[i].dst);
    }
    aclError rc = rt.memcpy_async(reinterpret_cast<void*>(runs[i].dst), runs[i].size,
                                  reinterpret_cast<const void*>(runs[i].src), runs[i].size, kind, stream);
    if (rc != ACL_SUCCESS) return "aclrtMemcpyAsync failed at run " + std::to_string(i) + ": " + describe(rt, rc);
  }
  return "";
}

// `while_copying` runs on this thread once every run is enqueued, before the wait for them (as
// cuda_copy's: host work the DMA hides).
std::string acl_copy(const std::vector<Run>& runs, Direction dir, int device, uint64_t user_stream,
                     bool allow_batch, const std::function<void()>& while_copying) {
  const Runtime* rtp = nullptr;
  std::string err = initialized_runtime(&rtp);
  if (!err.empty()) return err;
  const Runtime& rt = *rtp;
  DeviceState* dev = nullptr;
  err = bind(rt, device, &dev);
  if (!err.empty()) return err;
  if (runs.empty()) {
    while_copying();
    return "";
  }
  aclrtStream stream = reinterpret_cast<aclrtStream>(user_stream);
  bool own = stream == nullptr;
  if (own) {
    std::lock_guard<std::mutex> lock(dev->mu);
    if (!dev->idle.empty()) {
      stream = dev->idle.back();
      dev->idle.pop_back();
    }
  }
  if (own && stream == nullptr) {
    aclError rc = rt.create_stream(&stream);
    if (rc != ACL_SUCCESS) return "aclrtCreateStream failed: " + describe(rt, rc);
  }
  err = enqueue_copies(rt, runs, dir, device, stream, allow_batch);
  if (err.empty()) while_copying();
  // Wait even after an enqueue error: earlier runs may still be in flight on the stream.
  aclError rc = rt.synchronize_stream(stream);
  if (err.empty() && rc != ACL_SUCCESS) err = "Ascend copy failed while waiting for it: " + describe(rt, rc);
  if (own) {
    std::lock_guard<std::mutex> lock(dev->mu);
    dev->idle.push_back(stream);
  }
  return err;
}

// Registers [addr, addr + size) with the device context of `device` current. Page-locking needs
// aclrtHostRegisterV2(MAPPED | PINNED) (CANN >= 8.5); the legacy aclrtHostRegister(MAPPED) only
// maps the memory for the device and does not pin it, so aclrtMemcpy[Batch]Async on it is
// synchronous. The legacy call is used only when V2 is absent or answers "not supported";
// *pinned tells the caller which one registered. The size is rounded up to 4 KiB (the mapping
// covers whole pages anyway); the address must be 4 KiB aligned.
std::string acl_register(uint64_t addr, uint64_t size, int device, bool reg, uint64_t* dev_ptr, bool* pinned) {
  const Runtime* rtp = nullptr;
  std::string err = initialized_runtime(&rtp);
  if (!err.empty()) return err;
  const Runtime& rt = *rtp;
  if ((rt.host_register == nullptr && rt.host_register_v2 == nullptr) || rt.host_unregister == nullptr) {
    return "libascendcl.so lacks aclrtHostRegister[V2]/aclrtHostUnregister";
  }
  DeviceState* dev = nullptr;
  err = bind(rt, device, &dev);
  if (!err.empty()) return err;
  void* ptr = reinterpret_cast<void*>(addr);
  if (!reg) {
    aclError rc = rt.host_unregister(ptr);
    return rc == ACL_SUCCESS ? "" : "aclrtHostUnregister failed: " + describe(rt, rc);
  }
  if (addr % kHostPage != 0) return "aclrtHostRegister needs a 4 KiB-aligned address";
  if (size == 0 || size > UINT64_MAX - (kHostPage - 1)) return "aclrtHostRegister: bad size";
  const uint64_t rounded = (size + kHostPage - 1) / kHostPage * kHostPage;
  *pinned = false;
  if (rt.host_register_v2 != nullptr) {
    aclError rc = rt.host_register_v2(ptr, rounded, kHostRegMapped | kHostRegPinned);
    if (rc == ACL_SUCCESS) {
      *pinned = true;
      void* mapped = nullptr;
      if (rt.host_get_device_pointer != nullptr && rt.host_get_device_pointer(ptr, &mapped, 0) == ACL_SUCCESS) {
        *dev_ptr = reinterpret_cast<uint64_t>(mapped);
      } else {
        *dev_ptr = 0;  // registered and pinned; the device alias is not needed for copies
      }
      return "";
    }
    if (!not_supported(rc) || rt.host_register == nullptr) return "aclrtHostRegisterV2 failed: " + describe(rt, rc);
  }
  void* mapped = nullptr;
  aclError rc = rt.host_register(ptr, rounded, kHostRegisterMapped, &mapped);
  if (rc != ACL_SUCCESS) return "aclrtHostRegister failed: " + describe(rt, rc);
  *dev_ptr = reinterpret_cast<uint64_t>(mapped);
  return "";
}

// RuntimeError(message) with the failed call's aclError (0: not a runtime call's) as `acl_error`.
void raise_acl_error(const std::string& message, aclError code) {
  PyObject* exc = PyObject_CallFunction(PyExc_RuntimeError, "s", message.c_str());
  if (exc == nullptr) return;
  PyObject* value = PyLong_FromLong(code);
  if (value == nullptr || PyObject_SetAttrString(exc, "acl_error", value) != 0) {
    Py_XDECREF(value);
    Py_DECREF(exc);
    return;
  }
  Py_DECREF(value);
  PyErr_SetObject(PyExc_RuntimeError, exc);
  Py_DECREF(exc);
}

}  // namespace
#else
namespace {
const char kNotBuilt[] =
    "Ascend support not compiled in: the CANN headers (acl/acl.h) were not found when kvstore was built";
}  // namespace
#endif

// A device copy with its arguments parsed: its runs enqueued, the host blocks checksummed meanwhile, then waited for.
static PyObject* copy_parsed(const DeviceCopyArgs& a) {
#if defined(KVSTORE_WITH_ACL)
  std::string err;
  aclError code = ACL_SUCCESS;
  std::vector<uint64_t> sums;
  Py_BEGIN_ALLOW_THREADS
  t_failed = ACL_SUCCESS;
  err = acl_copy(a.runs, a.dir, a.device, a.stream, a.allow_batch, [&] { sums = a.checksums(); });
  code = t_failed;
  Py_END_ALLOW_THREADS
  if (!err.empty()) {
    raise_acl_error(err, code);
    return nullptr;
  }
  return u64_bytes(sums);
#else
  (void)a;
  PyErr_SetString(PyExc_RuntimeError, kNotBuilt);
  return nullptr;
#endif
}

PyObject* py_acl_copy_blocks(PyObject*, PyObject* args, PyObject* kwargs) {
  DeviceCopyArgs a;
  if (!parse_device_copy_args(args, kwargs, "OOOOOOi|OpOOO:acl_copy_blocks", &a)) return nullptr;
  return copy_parsed(a);
}

PyObject* py_acl_transfer(PyObject*, PyObject* args, PyObject* kwargs) {
  DeviceCopyArgs a;
  if (!parse_device_transfer_args(args, kwargs, "OOpi|OO:acl_transfer", &a)) return nullptr;
  return copy_parsed(a);
}

static PyObject* acl_register_common(PyObject* args, PyObject* kwargs, bool reg) {
  static const char* reg_kw[] = {"addr", "size", "device", nullptr};
  static const char* unreg_kw[] = {"addr", "device", nullptr};
  PyObject *addr_obj, *size_obj = nullptr;
  int device = 0;
  bool parsed = reg ? PyArg_ParseTupleAndKeywords(args, kwargs, "OO|i:acl_host_register", const_cast<char**>(reg_kw),
                                                  &addr_obj, &size_obj, &device)
                    : PyArg_ParseTupleAndKeywords(args, kwargs, "O|i:acl_host_unregister",
                                                  const_cast<char**>(unreg_kw), &addr_obj, &device);
  if (!parsed) return nullptr;
  uint64_t addr, size = 0;
  if (!parse_u64(addr_obj, "addr", &addr) || (reg && !parse_u64(size_obj, "size", &size))) return nullptr;
#if defined(KVSTORE_WITH_ACL)
  std::string err;
  uint64_t dev_ptr = 0;
  bool pinned = false;
  aclError code = ACL_SUCCESS;
  Py_BEGIN_ALLOW_THREADS
  t_failed = ACL_SUCCESS;
  err = acl_register(addr, size, device, reg, &dev_ptr, &pinned);
  code = t_failed;
  Py_END_ALLOW_THREADS
  if (!err.empty()) {
    raise_acl_error(err, code);
    return nullptr;
  }
  if (reg) {
    g_last_register_pinned.store(pinned ? 1 : 0);
    return PyLong_FromUnsignedLongLong(dev_ptr);
  }
  Py_RETURN_NONE;
#else
  (void)device;
  PyErr_SetString(PyExc_RuntimeError, kNotBuilt);
  return nullptr;
#endif
}

PyObject* py_acl_host_register(PyObject*, PyObject* args, PyObject* kwargs) {
  return acl_register_common(args, kwargs, true);
}

PyObject* py_acl_host_unregister(PyObject*, PyObject* args, PyObject* kwargs) {
  return acl_register_common(args, kwargs, false);
}

static PyMethodDef kAclMethods[] = {
    {"acl_copy_blocks", KV_KW(py_acl_copy_blocks),
     "acl_copy_blocks(src_base, dst_base, src_offsets, dst_offsets, sizes, direction, device, stream=0,\n"
     "                allow_batch=True, checksum_base=0, checksum_offsets=None, checksum_size=0) -> bytes\n\n"
     "Ascend version of cuda_copy_blocks (aclrtMemcpyBatchAsync or aclrtMemcpyAsync). Unverified on hardware."},
    {"acl_transfer", KV_KW(py_acl_transfer),
     "acl_transfer(pool_base, runs, to_engine, device, checksum_offsets=None, checksum_size=0) -> bytes\n\n"
     "Ascend version of cuda_transfer. Unverified on hardware."},
    {"acl_host_register", KV_KW(py_acl_host_register),
     "acl_host_register(addr, size, device=0) -> int\n\n"
     "aclrtHostRegister(ptr, size, ACL_HOST_REGISTER_MAPPED); returns the device-side address."},
    {"acl_host_unregister", KV_KW(py_acl_host_unregister),
     "acl_host_unregister(addr, device=0) -> None\n\nUndo acl_host_register."},
    {nullptr, nullptr, 0, nullptr},
};

bool add_acl(PyObject* module) { return PyModule_AddFunctions(module, kAclMethods) == 0; }

bool add_acl_features(PyObject* features) {
  // Loads libascendcl.so and resolves its symbols; does not call aclInit (see load_runtime).
#if defined(KVSTORE_WITH_ACL)
  const Runtime* rt;
  Py_BEGIN_ALLOW_THREADS
  rt = &runtime();
  Py_END_ALLOW_THREADS
  const bool ok = rt->error.empty();
  const int pinned = g_last_register_pinned.load();
  PyObject* pinned_obj = pinned < 0 ? (Py_INCREF(Py_None), Py_None) : PyBool_FromLong(pinned);
  return set_item(features, "acl_compiled", PyBool_FromLong(1)) &&
         set_item(features, "acl_available", PyBool_FromLong(ok)) &&
         set_item(features, "acl_batch_memcpy",
                  PyBool_FromLong(ok && rt->memcpy_batch_async && !g_batch_unsupported.load())) &&
         set_item(features, "acl_host_register_v2", PyBool_FromLong(ok && rt->host_register_v2)) &&
         set_item(features, "acl_host_pinned", pinned_obj) &&
         set_item(features, "acl_error", PyUnicode_FromString(rt->error.c_str()));
#else
  return set_item(features, "acl_compiled", PyBool_FromLong(0)) &&
         set_item(features, "acl_available", PyBool_FromLong(0)) &&
         set_item(features, "acl_batch_memcpy", PyBool_FromLong(0)) &&
         set_item(features, "acl_host_register_v2", PyBool_FromLong(0)) &&
         set_item(features, "acl_host_pinned", (Py_INCREF(Py_None), Py_None)) &&
         set_item(features, "acl_error", PyUnicode_FromString(kNotBuilt));
#endif
}

}  // namespace kvstore
