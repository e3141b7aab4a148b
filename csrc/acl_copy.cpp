// Ascend (CANN / AscendCL) copy path, the counterpart of cuda_copy.cpp.
//
// UNVERIFIED: written against the documented AscendCL API (acl_rt.h of CANN 8.x) and never run on
// Ascend hardware; no CANN toolkit was available where it was written.
//
// Compiled in only when setup.py finds the CANN headers (KVSTORE_WITH_ACL). The headers provide
// the long-standing types (aclError, aclrtStream, aclrtMemcpyKind, aclrtMemLocation); the library
// itself is dlopen'ed at runtime, like libcuda, so that
//  * the module imports on a node without the CANN runtime (functions raise RuntimeError), and
//  * aclrtMemcpyBatchAsync (CANN 8.5+) is used only when the installed libascendcl exports it,
//    whatever header version the build saw.
// Without KVSTORE_WITH_ACL the functions still exist, validate their arguments, and raise
// RuntimeError saying the build had no CANN headers.

#include "kvstore_native.h"

#if defined(KVSTORE_WITH_ACL)
#include <dlfcn.h>

#include <acl/acl.h>

#include <algorithm>
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
constexpr int kHostRegisterMapped = 0;              // ACL_HOST_REGISTER_MAPPED (aclrtHostRegisterType)
constexpr size_t kMaxBatch = 8192;

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
using PFN_aclrtHostUnregister = aclError (*)(void*);
using PFN_aclGetRecentErrMsg = const char* (*)();

struct Runtime {
  std::string error;
  PFN_aclrtGetDeviceCount get_device_count = nullptr;
  PFN_aclrtSetDevice set_device = nullptr;
  PFN_aclrtGetCurrentContext get_current_context = nullptr;
  PFN_aclrtSetCurrentContext set_current_context = nullptr;
  PFN_aclrtCreateStream create_stream = nullptr;
  PFN_aclrtSynchronizeStream synchronize_stream = nullptr;
  PFN_aclrtMemcpyAsync memcpy_async = nullptr;
  PFN_aclrtMemcpyBatchAsync memcpy_batch_async = nullptr;  // null: CANN older than 8.5
  PFN_aclrtHostRegister host_register = nullptr;
  PFN_aclrtHostUnregister host_unregister = nullptr;
  PFN_aclGetRecentErrMsg recent_error = nullptr;
};

std::string describe(const Runtime& rt, aclError rc) {
  std::string s = "aclError " + std::to_string(rc);
  const char* msg = rt.recent_error ? rt.recent_error() : nullptr;
  if (msg != nullptr && *msg != '\0') s += std::string(": ") + msg;
  return s;
}

Runtime load_runtime() {
  Runtime rt;
  void* lib = dlopen("libascendcl.so", RTLD_NOW | RTLD_LOCAL);
  if (lib == nullptr) {
    const char* why = dlerror();
    rt.error = std::string("Ascend runtime not available: cannot load libascendcl.so (") + (why ? why : "?") + ")";
    return rt;
  }
  auto sym = [&](const char* name) { return dlsym(lib, name); };
  auto init = reinterpret_cast<PFN_aclInit>(sym("aclInit"));
  rt.get_device_count = reinterpret_cast<PFN_aclrtGetDeviceCount>(sym("aclrtGetDeviceCount"));
  rt.set_device = reinterpret_cast<PFN_aclrtSetDevice>(sym("aclrtSetDevice"));
  rt.get_current_context = reinterpret_cast<PFN_aclrtGetCurrentContext>(sym("aclrtGetCurrentContext"));
  rt.set_current_context = reinterpret_cast<PFN_aclrtSetCurrentContext>(sym("aclrtSetCurrentContext"));
  rt.create_stream = reinterpret_cast<PFN_aclrtCreateStream>(sym("aclrtCreateStream"));
  rt.synchronize_stream = reinterpret_cast<PFN_aclrtSynchronizeStream>(sym("aclrtSynchronizeStream"));
  rt.memcpy_async = reinterpret_cast<PFN_aclrtMemcpyAsync>(sym("aclrtMemcpyAsync"));
  rt.memcpy_batch_async = reinterpret_cast<PFN_aclrtMemcpyBatchAsync>(sym("aclrtMemcpyBatchAsync"));
  rt.host_register = reinterpret_cast<PFN_aclrtHostRegister>(sym("aclrtHostRegister"));
  rt.host_unregister = reinterpret_cast<PFN_aclrtHostUnregister>(sym("aclrtHostUnregister"));
  rt.recent_error = reinterpret_cast<PFN_aclGetRecentErrMsg>(sym("aclGetRecentErrMsg"));
  if (!init || !rt.get_device_count || !rt.set_device || !rt.get_current_context || !rt.set_current_context ||
      !rt.create_stream || !rt.synchronize_stream || !rt.memcpy_async) {
    rt.error = "libascendcl.so lacks a required entry point (CANN too old?)";
    return rt;
  }
  // aclInit may be called once per process; the engine side (torch_npu) may have done it already.
  aclError rc = init(nullptr);
  if (rc != ACL_SUCCESS && rc != kAclRepeatInitialize) rt.error = "aclInit failed: " + describe(rt, rc);
  return rt;
}

const Runtime& runtime() {
  static const Runtime rt = load_runtime();
  return rt;
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

std::string enqueue_copies(const Runtime& rt, const std::vector<Run>& runs, Direction dir, int device,
                           aclrtStream stream, bool allow_batch) {
  if (allow_batch && rt.memcpy_batch_async != nullptr) {
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
    for (size_t start = 0; start < runs.size(); start += kMaxBatch) {
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
        return "aclrtMemcpyBatchAsync failed" + where + ": " + describe(rt, rc);
      }
    }
    return "";
  }
  const aclrtMemcpyKind kind = memcpy_kind(dir);
  for (size_t i = 0; i < runs.size(); ++i) {
    aclError rc = rt.memcpy_async(reinterpret_cast<void*>(runs[i].dst), runs[i].size,
                                  reinterpret_cast<const void*>(runs[i].src), runs[i].size, kind, stream);
    if (rc != ACL_SUCCESS) return "aclrtMemcpyAsync failed at run " + std::to_string(i) + ": " + describe(rt, rc);
  }
  return "";
}

std::string acl_copy(const std::vector<Run>& runs, Direction dir, int device, uint64_t user_stream,
                     bool allow_batch) {
  const Runtime& rt = runtime();
  if (!rt.error.empty()) return rt.error;
  DeviceState* dev = nullptr;
  std::string err = bind(rt, device, &dev);
  if (!err.empty() || runs.empty()) return err;
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
  // Wait even after an enqueue error: earlier runs may still be in flight on the stream.
  aclError rc = rt.synchronize_stream(stream);
  if (err.empty() && rc != ACL_SUCCESS) err = "Ascend copy failed while waiting for it: " + describe(rt, rc);
  if (own) {
    std::lock_guard<std::mutex> lock(dev->mu);
    dev->idle.push_back(stream);
  }
  return err;
}

std::string acl_register(uint64_t addr, uint64_t size, int device, bool reg, uint64_t* dev_ptr) {
  const Runtime& rt = runtime();
  if (!rt.error.empty()) return rt.error;
  if (rt.host_register == nullptr || rt.host_unregister == nullptr) {
    return "libascendcl.so lacks aclrtHostRegister/aclrtHostUnregister";
  }
  DeviceState* dev = nullptr;
  std::string err = bind(rt, device, &dev);
  if (!err.empty()) return err;
  void* ptr = reinterpret_cast<void*>(addr);
  if (!reg) {
    aclError rc = rt.host_unregister(ptr);
    return rc == ACL_SUCCESS ? "" : "aclrtHostUnregister failed: " + describe(rt, rc);
  }
  void* mapped = nullptr;
  aclError rc = rt.host_register(ptr, size, kHostRegisterMapped, &mapped);
  if (rc != ACL_SUCCESS) return "aclrtHostRegister failed: " + describe(rt, rc);
  *dev_ptr = reinterpret_cast<uint64_t>(mapped);
  return "";
}

}  // namespace
#else
namespace {
const char kNotBuilt[] =
    "Ascend support not compiled in: the CANN headers (acl/acl.h) were not found when kvstore was built";
}  // namespace
#endif

PyObject* py_acl_copy_blocks(PyObject*, PyObject* args, PyObject* kwargs) {
  DeviceCopyArgs a;
  if (!parse_device_copy_args(args, kwargs, "OOOOOOi|Op:acl_copy_blocks", &a)) return nullptr;
#if defined(KVSTORE_WITH_ACL)
  std::string err;
  Py_BEGIN_ALLOW_THREADS
  err = acl_copy(a.runs, a.dir, a.device, a.stream, a.allow_batch);
  Py_END_ALLOW_THREADS
  if (!err.empty()) {
    PyErr_SetString(PyExc_RuntimeError, err.c_str());
    return nullptr;
  }
  Py_RETURN_NONE;
#else
  PyErr_SetString(PyExc_RuntimeError, kNotBuilt);
  return nullptr;
#endif
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
  Py_BEGIN_ALLOW_THREADS
  err = acl_register(addr, size, device, reg, &dev_ptr);
  Py_END_ALLOW_THREADS
  if (!err.empty()) {
    PyErr_SetString(PyExc_RuntimeError, err.c_str());
    return nullptr;
  }
  if (reg) return PyLong_FromUnsignedLongLong(dev_ptr);
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

bool add_acl_features(PyObject* features) {
#if defined(KVSTORE_WITH_ACL)
  const Runtime* rt;
  Py_BEGIN_ALLOW_THREADS
  rt = &runtime();
  Py_END_ALLOW_THREADS
  return set_item(features, "acl_compiled", PyBool_FromLong(1)) &&
         set_item(features, "acl_available", PyBool_FromLong(rt->error.empty())) &&
         set_item(features, "acl_batch_memcpy", PyBool_FromLong(rt->error.empty() && rt->memcpy_batch_async)) &&
         set_item(features, "acl_error", PyUnicode_FromString(rt->error.c_str()));
#else
  return set_item(features, "acl_compiled", PyBool_FromLong(0)) &&
         set_item(features, "acl_available", PyBool_FromLong(0)) &&
         set_item(features, "acl_batch_memcpy", PyBool_FromLong(0)) &&
         set_item(features, "acl_error", PyUnicode_FromString(kNotBuilt));
#endif
}

}  // namespace kvstore
