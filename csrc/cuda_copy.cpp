// CUDA copy path: batched block copies between device memory and the host pool.
//
// Why dlopen instead of compiling against cuda.h and linking libcuda/libcudart:
//  * the same build works on machines with and without a CUDA toolkit (CI often has no nvcc), and
//    one wheel serves CPU-only and GPU nodes;
//  * importing the module never fails for a missing or mismatched driver; the CUDA functions
//    raise RuntimeError instead, and everything else keeps working;
//  * cuMemcpyBatchAsync (CUDA 12.8+) is found at runtime from the driver actually installed, not
//    from whichever toolkit the build machine had.
// The price is declaring the few driver types used here by hand. They are the stable C ABI of
// libcuda (ints, opaque pointers, one small struct); when cuda.h is present at build time
// (KVSTORE_CUDA_ABI_CHECK) static_asserts at the end of this file compare them with the real header.
//
// Without a GPU, tests/test_cuda_backend.py runs this file against a fake libcuda.so.1 that logs the
// calls (which ones, in which order: event queries, copies, pinning piece by piece); how a real driver
// answers them needs a GPU to be verified.
//
// The engine's IPC events are only ever queried from the host (cuEventQuery), never waited on by a
// daemon stream: a GPU-side wait on an event whose recording process died or stalls never ends, and
// it would hold the stream (and a copy thread) for good. The daemon polls with a deadline instead and
// stops when the engine's session ends (kvstore_service/jobs.py).

#include <dlfcn.h>
#include <strings.h>

#include <algorithm>
#include <cstddef>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <functional>
#include <initializer_list>
#include <map>
#include <mutex>
#include <utility>
#include <vector>

#include "copy_kernel_ptx.h"
#include "kvstore_native.h"

namespace kvstore {
namespace cu {

using CUresult = int;
using CUdevice = int;
using CUdeviceptr = unsigned long long;
using CUcontext = struct CUctx_st*;
using CUstream = struct CUstream_st*;
using CUevent = struct CUevent_st*;
using CUmodule = struct CUmod_st*;
using CUfunction = struct CUfunc_st*;

struct CUmemLocation {
  int type;  // CUmemLocationType
  int id;
};

// cudaIpcEventHandle_t / CUipcEventHandle: 64 opaque bytes, passed by value.
constexpr size_t kIpcHandleSize = 64;
struct CUipcEventHandle {
  char reserved[kIpcHandleSize];
};

struct CUmemcpyAttributes {
  int srcAccessOrder;  // CUmemcpySrcAccessOrder
  CUmemLocation srcLocHint;
  CUmemLocation dstLocHint;
  unsigned int flags;
};

constexpr CUresult kSuccess = 0;
constexpr CUresult kErrorOutOfMemory = 2;
constexpr CUresult kErrorNotReady = 600;
constexpr CUresult kErrorNotSupported = 801;
constexpr int kLocationInvalid = 0x0;  // a zeroed CUmemLocation: "no hint"
constexpr int kSrcAccessOrderStream = 0x1;
constexpr unsigned int kFlagPreferOverlapWithCompute = 0x1;
constexpr unsigned int kStreamNonBlocking = 0x1;
constexpr unsigned int kEventBlockingSync = 0x1;
constexpr unsigned int kEventDisableTiming = 0x2;
constexpr unsigned int kMemHostRegisterPortable = 0x1;
constexpr unsigned int kMemHostRegisterDeviceMap = 0x2;
constexpr int kAttrCanUseHostPointerForRegisteredMem = 91;  // CU_DEVICE_ATTRIBUTE_...
constexpr unsigned long long kGetProcAddressDefault = 0;

using PFN_cuInit = CUresult (*)(unsigned int);
using PFN_cuDriverGetVersion = CUresult (*)(int*);
using PFN_cuGetProcAddress_v2 = CUresult (*)(const char*, void**, int, unsigned long long, int*);
using PFN_cuGetProcAddress_v1 = CUresult (*)(const char*, void**, int, unsigned long long);
using PFN_cuGetErrorName = CUresult (*)(CUresult, const char**);
using PFN_cuGetErrorString = CUresult (*)(CUresult, const char**);
using PFN_cuDeviceGetCount = CUresult (*)(int*);
using PFN_cuDeviceGet = CUresult (*)(CUdevice*, int);
using PFN_cuDevicePrimaryCtxRetain = CUresult (*)(CUcontext*, CUdevice);
using PFN_cuCtxGetCurrent = CUresult (*)(CUcontext*);
using PFN_cuCtxSetCurrent = CUresult (*)(CUcontext);
using PFN_cuStreamCreate = CUresult (*)(CUstream*, unsigned int);
using PFN_cuEventCreate = CUresult (*)(CUevent*, unsigned int);
using PFN_cuEventRecord = CUresult (*)(CUevent, CUstream);
using PFN_cuEventSynchronize = CUresult (*)(CUevent);
using PFN_cuEventDestroy = CUresult (*)(CUevent);
using PFN_cuIpcOpenEventHandle = CUresult (*)(CUevent*, CUipcEventHandle);
using PFN_cuEventQuery = CUresult (*)(CUevent);
using PFN_cuMemcpyAsync = CUresult (*)(CUdeviceptr, CUdeviceptr, size_t, CUstream);
// The CUDA 12.8 ABI of cuMemcpyBatchAsync (with failIdx). CUDA 13 headers call this one
// cuMemcpyBatchAsync and add a _v2 without failIdx; asking cuGetProcAddress for version 12080
// returns this ABI from both 12.8+ and 13.x drivers.
using PFN_cuMemcpyBatchAsync = CUresult (*)(CUdeviceptr*, CUdeviceptr*, size_t*, size_t, CUmemcpyAttributes*,
                                            size_t*, size_t, size_t*, CUstream);
using PFN_cuMemHostRegister = CUresult (*)(void*, size_t, unsigned int);
using PFN_cuMemHostUnregister = CUresult (*)(void*);
using PFN_cuDeviceGetAttribute = CUresult (*)(int*, int, CUdevice);
using PFN_cuModuleLoadData = CUresult (*)(CUmodule*, const void*);
using PFN_cuModuleGetFunction = CUresult (*)(CUfunction*, CUmodule, const char*);
using PFN_cuModuleUnload = CUresult (*)(CUmodule);
using PFN_cuLaunchKernel = CUresult (*)(CUfunction, unsigned int, unsigned int, unsigned int, unsigned int,
                                        unsigned int, unsigned int, unsigned int, CUstream, void**, void**);
using PFN_cuMemAlloc = CUresult (*)(CUdeviceptr*, size_t);
using PFN_cuMemFree = CUresult (*)(CUdeviceptr);
using PFN_cuMemcpyHtoDAsync = CUresult (*)(CUdeviceptr, const void*, size_t, CUstream);

}  // namespace cu

namespace {

constexpr int kBatchApiVersion = 12080;  // cuMemcpyBatchAsync appeared in CUDA 12.8
// Copies per cuMemcpyBatchAsync call. The API documents no limit; bounding it keeps the staging
// arrays small and costs one extra call per 8192 runs.
constexpr size_t kMaxBatch = 8192;

// A switch read from the environment: `fallback`, unless the variable holds one of `flips` (any case).
bool env_switch(const char* name, bool fallback, std::initializer_list<const char*> flips) {
  const char* v = std::getenv(name);
  for (const char* flip : flips) {
    if (v != nullptr && strcasecmp(v, flip) == 0) return !fallback;
  }
  return fallback;
}

// KVSTORE_CUDA_BATCH_MEMCPY=0 (or false/no/off, any case) turns cuMemcpyBatchAsync off: every run
// is then copied with cuMemcpyAsync. turbomind disables the batch API on Blackwell (sm_100), where
// it is reported to crash. Unset, empty or any other value: the batch API is used where it exists.
bool batch_memcpy_allowed_by_env() {
  return env_switch("KVSTORE_CUDA_BATCH_MEMCPY", true, {"0", "false", "no", "off"});
}

// Streams one copy spreads its runs over (KVSTORE_CUDA_COPY_STREAMS overrides). On an H100 (PCIe 5),
// one copy of 256 KiB runs reaches 0.82-0.89 of a contiguous copy of the same bytes on one stream,
// 0.93-0.94 on four (benchmarks/bench_cuda_copy.py): the copy engines overlap the per-run costs of
// several streams. In the daemon, whose copy threads each run a copy at a time, two per copy did best
// (`kvstore bench --backend cuda`, same machine, two runs each: store 0.68 / 0.68 of the pinned copy
// with two, 0.63 / 0.63 with one, 0.65 / 0.58 with four). A copy of less than kMinStreamBytes per
// stream uses fewer streams.
constexpr size_t kStreamsPerCopy = 2;
constexpr uint64_t kMinStreamBytes = 4ull << 20;

// KVSTORE_CUDA_COPY_STREAMS: the streams one copy spreads its runs over (1-16; unset or invalid: the default).
size_t copy_streams_from_env(size_t fallback) {
  const char* v = std::getenv("KVSTORE_CUDA_COPY_STREAMS");
  long n = v != nullptr ? std::strtol(v, nullptr, 10) : 0;
  return n >= 1 && n <= 16 ? static_cast<size_t>(n) : fallback;
}

// KVSTORE_CUDA_COPY_KERNEL=1 (or true/yes/on): copies are made by the GPU's threads (csrc/copy_kernel.cu:
// one launch per copy, on one stream) instead of its copy engines, and the pool is registered mapped
// (the kernel reads and writes it through its host addresses). Off unless set: not measured on a GPU yet.
bool copy_kernel_from_env() {
  return env_switch("KVSTORE_CUDA_COPY_KERNEL", false, {"1", "true", "yes", "on"});
}
constexpr unsigned int kKernelThreads = 256;  // per block; four 16-byte words in flight each
constexpr unsigned int kKernelMaxBlocks = 1024;  // blocks take runs in turn beyond this
// A thread block moves one run at a time: runs are cut into pieces of at most this (a multiple of 16,
// aligned runs stay aligned), so that a copy of a few long coalesced runs still spreads over the SMs.
constexpr uint64_t kKernelRunPiece = 256 << 10;

struct Driver {
  std::string error;  // non-empty: CUDA is unusable here, and this says why
  int version = 0;
  bool batch_allowed = true;  // KVSTORE_CUDA_BATCH_MEMCPY, read once when the driver is loaded
  size_t copy_streams = 1;  // KVSTORE_CUDA_COPY_STREAMS, likewise
  bool copy_kernel = false;  // KVSTORE_CUDA_COPY_KERNEL, likewise
  cu::PFN_cuGetErrorName get_error_name = nullptr;
  cu::PFN_cuGetErrorString get_error_string = nullptr;
  cu::PFN_cuDeviceGetCount device_get_count = nullptr;
  cu::PFN_cuDeviceGet device_get = nullptr;
  cu::PFN_cuDevicePrimaryCtxRetain primary_ctx_retain = nullptr;
  cu::PFN_cuCtxGetCurrent ctx_get_current = nullptr;
  cu::PFN_cuCtxSetCurrent ctx_set_current = nullptr;
  cu::PFN_cuStreamCreate stream_create = nullptr;
  cu::PFN_cuEventCreate event_create = nullptr;
  cu::PFN_cuEventRecord event_record = nullptr;
  cu::PFN_cuEventSynchronize event_synchronize = nullptr;
  cu::PFN_cuEventDestroy event_destroy = nullptr;
  cu::PFN_cuIpcOpenEventHandle ipc_open_event = nullptr;
  cu::PFN_cuEventQuery event_query = nullptr;
  cu::PFN_cuMemcpyAsync memcpy_async = nullptr;
  cu::PFN_cuMemcpyBatchAsync memcpy_batch_async = nullptr;  // null: driver older than 12.8
  cu::PFN_cuMemHostRegister mem_host_register = nullptr;
  cu::PFN_cuMemHostUnregister mem_host_unregister = nullptr;
  // The copy kernel's (resolved only with KVSTORE_CUDA_COPY_KERNEL).
  cu::PFN_cuDeviceGetAttribute device_get_attribute = nullptr;
  cu::PFN_cuModuleLoadData module_load_data = nullptr;
  cu::PFN_cuModuleGetFunction module_get_function = nullptr;
  cu::PFN_cuModuleUnload module_unload = nullptr;
  cu::PFN_cuLaunchKernel launch_kernel = nullptr;
  cu::PFN_cuMemAlloc mem_alloc = nullptr;
  cu::PFN_cuMemFree mem_free = nullptr;
  cu::PFN_cuMemcpyHtoDAsync memcpy_htod_async = nullptr;
};

std::string describe(const Driver& d, cu::CUresult rc) {
  const char* name = nullptr;
  const char* text = nullptr;
  if (d.get_error_name) d.get_error_name(rc, &name);
  if (d.get_error_string) d.get_error_string(rc, &text);
  std::string s = name ? name : "CUDA error";
  s += " (" + std::to_string(rc) + ")";
  if (text) s += std::string(": ") + text;
  return s;
}

Driver load_driver() {
  Driver d;
  d.batch_allowed = batch_memcpy_allowed_by_env();
  d.copy_streams = copy_streams_from_env(kStreamsPerCopy);
  d.copy_kernel = copy_kernel_from_env();
  void* lib = dlopen("libcuda.so.1", RTLD_NOW | RTLD_LOCAL);
  if (lib == nullptr) {
    const char* why = dlerror();
    d.error = std::string("CUDA driver not available: cannot load libcuda.so.1 (") + (why ? why : "?") + ")";
    return d;
  }
  // Kept loaded for the life of the process.
  auto init = reinterpret_cast<cu::PFN_cuInit>(dlsym(lib, "cuInit"));
  auto get_version = reinterpret_cast<cu::PFN_cuDriverGetVersion>(dlsym(lib, "cuDriverGetVersion"));
  d.get_error_name = reinterpret_cast<cu::PFN_cuGetErrorName>(dlsym(lib, "cuGetErrorName"));
  d.get_error_string = reinterpret_cast<cu::PFN_cuGetErrorString>(dlsym(lib, "cuGetErrorString"));
  auto gpa_v2 = reinterpret_cast<cu::PFN_cuGetProcAddress_v2>(dlsym(lib, "cuGetProcAddress_v2"));
  auto gpa_v1 = reinterpret_cast<cu::PFN_cuGetProcAddress_v1>(dlsym(lib, "cuGetProcAddress"));
  if (init == nullptr || get_version == nullptr || (gpa_v2 == nullptr && gpa_v1 == nullptr)) {
    d.error = "CUDA driver too old: libcuda.so.1 lacks cuGetProcAddress (need CUDA 11.3 or newer)";
    return d;
  }
  if (get_version(&d.version) != cu::kSuccess) d.version = 0;
  cu::CUresult rc = init(0);
  if (rc != cu::kSuccess) {
    d.error = "CUDA not usable: cuInit failed: " + describe(d, rc);
    return d;
  }

  // Resolve each entry point with the ABI of an explicit CUDA version (the driver keeps older
  // ABIs for compatibility), so the signatures declared above stay right on newer drivers.
  auto resolve = [&](const char* name, int version) -> void* {
    void* fn = nullptr;
    version = std::min(version, d.version);
    if (gpa_v2 != nullptr) {
      int status = 0;
      if (gpa_v2(name, &fn, version, cu::kGetProcAddressDefault, &status) != cu::kSuccess || status != 0) {
        return nullptr;
      }
    } else if (gpa_v1(name, &fn, version, cu::kGetProcAddressDefault) != cu::kSuccess) {
      return nullptr;
    }
    return fn;
  };
  constexpr int kBase = 12000;  // ABI level for everything but the batch API
  d.device_get_count = reinterpret_cast<cu::PFN_cuDeviceGetCount>(resolve("cuDeviceGetCount", kBase));
  d.device_get = reinterpret_cast<cu::PFN_cuDeviceGet>(resolve("cuDeviceGet", kBase));
  d.primary_ctx_retain = reinterpret_cast<cu::PFN_cuDevicePrimaryCtxRetain>(resolve("cuDevicePrimaryCtxRetain", kBase));
  d.ctx_get_current = reinterpret_cast<cu::PFN_cuCtxGetCurrent>(resolve("cuCtxGetCurrent", kBase));
  d.ctx_set_current = reinterpret_cast<cu::PFN_cuCtxSetCurrent>(resolve("cuCtxSetCurrent", kBase));
  d.stream_create = reinterpret_cast<cu::PFN_cuStreamCreate>(resolve("cuStreamCreate", kBase));
  d.event_create = reinterpret_cast<cu::PFN_cuEventCreate>(resolve("cuEventCreate", kBase));
  d.event_record = reinterpret_cast<cu::PFN_cuEventRecord>(resolve("cuEventRecord", kBase));
  d.event_synchronize = reinterpret_cast<cu::PFN_cuEventSynchronize>(resolve("cuEventSynchronize", kBase));
  d.event_destroy = reinterpret_cast<cu::PFN_cuEventDestroy>(resolve("cuEventDestroy", kBase));
  d.ipc_open_event = reinterpret_cast<cu::PFN_cuIpcOpenEventHandle>(resolve("cuIpcOpenEventHandle", kBase));
  d.event_query = reinterpret_cast<cu::PFN_cuEventQuery>(resolve("cuEventQuery", kBase));
  d.memcpy_async = reinterpret_cast<cu::PFN_cuMemcpyAsync>(resolve("cuMemcpyAsync", kBase));
  d.mem_host_register = reinterpret_cast<cu::PFN_cuMemHostRegister>(resolve("cuMemHostRegister", kBase));
  d.mem_host_unregister = reinterpret_cast<cu::PFN_cuMemHostUnregister>(resolve("cuMemHostUnregister", kBase));
  if (d.version >= kBatchApiVersion && d.batch_allowed) {
    d.memcpy_batch_async = reinterpret_cast<cu::PFN_cuMemcpyBatchAsync>(resolve("cuMemcpyBatchAsync", kBatchApiVersion));
  }
  if (d.copy_kernel) {
    d.device_get_attribute = reinterpret_cast<cu::PFN_cuDeviceGetAttribute>(resolve("cuDeviceGetAttribute", kBase));
    d.module_load_data = reinterpret_cast<cu::PFN_cuModuleLoadData>(resolve("cuModuleLoadData", kBase));
    d.module_get_function = reinterpret_cast<cu::PFN_cuModuleGetFunction>(resolve("cuModuleGetFunction", kBase));
    d.module_unload = reinterpret_cast<cu::PFN_cuModuleUnload>(resolve("cuModuleUnload", kBase));
    d.launch_kernel = reinterpret_cast<cu::PFN_cuLaunchKernel>(resolve("cuLaunchKernel", kBase));
    d.mem_alloc = reinterpret_cast<cu::PFN_cuMemAlloc>(resolve("cuMemAlloc", kBase));
    d.mem_free = reinterpret_cast<cu::PFN_cuMemFree>(resolve("cuMemFree", kBase));
    d.memcpy_htod_async = reinterpret_cast<cu::PFN_cuMemcpyHtoDAsync>(resolve("cuMemcpyHtoDAsync", kBase));
    if (!d.device_get_attribute || !d.module_load_data || !d.module_get_function || !d.module_unload ||
        !d.launch_kernel || !d.mem_alloc || !d.mem_free || !d.memcpy_htod_async) {
      d.error = "KVSTORE_CUDA_COPY_KERNEL is set, but CUDA driver " + std::to_string(d.version) +
                " lacks an entry point the copy kernel needs";
      return d;
    }
  }
  if (!d.device_get_count || !d.device_get || !d.primary_ctx_retain || !d.ctx_get_current ||
      !d.ctx_set_current || !d.stream_create || !d.event_create || !d.event_record || !d.event_synchronize ||
      !d.event_destroy || !d.ipc_open_event || !d.event_query || !d.memcpy_async || !d.mem_host_register ||
      !d.mem_host_unregister) {
    d.error = "CUDA driver " + std::to_string(d.version) + " lacks a required entry point";
  }
  return d;
}

// Loaded once, on first use (thread-safe static init; called with the GIL released since cuInit
// can take a while).
const Driver& driver() {
  static const Driver d = load_driver();
  return d;
}

// A stream and an event for one copy at a time. Reused across calls: creating them per call
// would cost more than small copies do.
struct Lane {
  cu::CUstream stream = nullptr;
  cu::CUevent event = nullptr;
  cu::CUdeviceptr table = 0;  // the copy kernel's runs, in device memory (grown as needed)
  size_t table_runs = 0;
  std::vector<Run> pieces;  // the table's source: kept until the copy's wait (the upload is asynchronous)
};

struct DeviceState {
  cu::CUdevice device = 0;
  cu::CUcontext ctx = nullptr;
  std::mutex mu;
  std::vector<Lane> idle;
  std::mutex kernel_mu;  // the copy kernel's module, loaded on first use (not under `mu`: the JIT takes ~20 ms)
  bool kernel_tried = false;
  cu::CUfunction copy_kernel = nullptr;
  std::string kernel_error;
  std::string kernel_said;  // the last refusal written to stderr (each said once)
};

// Devices are set up once and kept for the life of the process (the primary context is retained
// and never released, so the pinned pool and streams stay valid).
// On failure *err says why and *code is the failed call's CUresult.
DeviceState* device_state(const Driver& d, int ordinal, std::string* err, cu::CUresult* code) {
  static std::mutex mu;
  static std::map<int, DeviceState*> devices;
  std::lock_guard<std::mutex> lock(mu);
  auto it = devices.find(ordinal);
  if (it != devices.end()) return it->second;
  int count = 0;
  cu::CUresult rc = d.device_get_count(&count);
  if (rc != cu::kSuccess) {
    *code = rc;
    *err = "cuDeviceGetCount failed: " + describe(d, rc);
    return nullptr;
  }
  if (ordinal < 0 || ordinal >= count) {
    *err = "CUDA device " + std::to_string(ordinal) + " does not exist (" + std::to_string(count) + " visible)";
    return nullptr;
  }
  cu::CUdevice dev = 0;
  cu::CUcontext ctx = nullptr;
  if ((rc = d.device_get(&dev, ordinal)) != cu::kSuccess ||
      (rc = d.primary_ctx_retain(&ctx, dev)) != cu::kSuccess) {
    *code = rc;
    *err = "cannot open CUDA device " + std::to_string(ordinal) + ": " + describe(d, rc);
    return nullptr;
  }
  auto* state = new DeviceState();
  state->device = dev;
  state->ctx = ctx;
  devices[ordinal] = state;
  return state;
}

// Makes the device's primary context current on this thread, restoring the previous one after.
class ContextScope {
 public:
  ContextScope(const Driver& d, cu::CUcontext ctx) : d_(d) {
    if (d_.ctx_get_current(&prev_) != cu::kSuccess) prev_ = nullptr;
    rc_ = d_.ctx_set_current(ctx);
  }
  ~ContextScope() { d_.ctx_set_current(prev_); }
  bool ok() const { return rc_ == cu::kSuccess; }
  cu::CUresult rc() const { return rc_; }

 private:
  const Driver& d_;
  cu::CUcontext prev_ = nullptr;
  cu::CUresult rc_ = cu::kSuccess;
};

bool acquire_lane(const Driver& d, DeviceState* dev, Lane* lane, std::string* err, cu::CUresult* code) {
  {
    std::lock_guard<std::mutex> lock(dev->mu);
    if (!dev->idle.empty()) {
      *lane = std::move(dev->idle.back());
      dev->idle.pop_back();
      return true;
    }
  }
  cu::CUresult rc;
  // Non-blocking: no implicit sync with the legacy default stream the engine may be using.
  if ((rc = d.stream_create(&lane->stream, cu::kStreamNonBlocking)) != cu::kSuccess) {
    *code = rc;
    *err = "cuStreamCreate failed: " + describe(d, rc);
    return false;
  }
  // Blocking sync: the waiting thread sleeps instead of spinning a core the engine could use.
  if ((rc = d.event_create(&lane->event, cu::kEventBlockingSync | cu::kEventDisableTiming)) !=
      cu::kSuccess) {
    *code = rc;
    *err = "cuEventCreate failed: " + describe(d, rc);
    return false;  // the stream leaks; this only happens when the device is already broken
  }
  return true;
}

void release_lane(DeviceState* dev, Lane& lane) {
  std::lock_guard<std::mutex> lock(dev->mu);
  dev->idle.push_back(std::move(lane));
}

// The copy kernel on this device (its context current), loaded on first use; null when it cannot run
// here: the copies then go to the copy engines, and stderr says why once per device and answer (the
// module was refused, the device cannot use the pool's host addresses; out of memory is tried again).
cu::CUfunction copy_kernel_of(const Driver& d, DeviceState* dev) {
  std::lock_guard<std::mutex> lock(dev->kernel_mu);
  if (!dev->kernel_tried) {
    dev->kernel_tried = true;
    int host_pointers = 0;
    cu::CUmodule module = nullptr;
    cu::CUresult rc = d.device_get_attribute(&host_pointers, cu::kAttrCanUseHostPointerForRegisteredMem, dev->device);
    if (rc != cu::kSuccess) {
      dev->kernel_error = "cuDeviceGetAttribute failed: " + describe(d, rc);
    } else if (host_pointers != 1) {
      dev->kernel_error = "this GPU cannot use the pool's host addresses in a kernel";
    } else if ((rc = d.module_load_data(&module, kCopyKernelPtx)) != cu::kSuccess) {
      dev->kernel_error = "the driver refused the copy kernel: " + describe(d, rc);
      // Out of memory (the JIT's, or the module's) may pass: the next copy tries again.
      dev->kernel_tried = rc != cu::kErrorOutOfMemory;
    } else if ((rc = d.module_get_function(&dev->copy_kernel, module, "kvstore_copy_runs")) != cu::kSuccess) {
      dev->copy_kernel = nullptr;
      dev->kernel_error = "the driver refused the copy kernel: " + describe(d, rc);
      d.module_unload(module);
    }
  }
  if (dev->copy_kernel == nullptr && dev->kernel_error != dev->kernel_said) {
    dev->kernel_said = dev->kernel_error;
    std::fprintf(stderr, "kvstore: KVSTORE_CUDA_COPY_KERNEL is set, but on GPU %d %s: copying with the copy "
                 "engines%s\n", static_cast<int>(dev->device), dev->kernel_error.c_str(),
                 dev->kernel_tried ? "" : " (the kernel is tried again)");
  }
  return dev->copy_kernel;
}

// Enqueues all runs on the lane's stream as one launch of the copy kernel: the runs, cut into pieces of
// at most kKernelRunPiece, go to the lane's device table first.
std::string enqueue_kernel(const Driver& d, cu::CUfunction fn, Lane* lane, const Run* whole, size_t runs,
                           cu::CUresult* code) {
  std::vector<Run>& pieces = lane->pieces;
  pieces.clear();
  for (size_t i = 0; i < runs; ++i) {
    for (uint64_t at = 0; at < whole[i].size; at += kKernelRunPiece) {
      pieces.push_back({whole[i].src + at, whole[i].dst + at, std::min(kKernelRunPiece, whole[i].size - at)});
    }
  }
  const size_t n = pieces.size();
  if (n == 0) return "";  // (runs of no bytes: a launch of no blocks would be an error)
  cu::CUresult rc = cu::kSuccess;
  if (lane->table_runs < n) {  // (the lane's last copy has ended: cuda_copy waits for it)
    if (lane->table != 0 && (rc = d.mem_free(lane->table)) != cu::kSuccess) {
      *code = rc;
      return "cuMemFree of the copy kernel's table failed: " + describe(d, rc);
    }
    lane->table = 0;
    lane->table_runs = 0;
    if ((rc = d.mem_alloc(&lane->table, n * sizeof(Run))) != cu::kSuccess) {
      *code = rc;
      return "cuMemAlloc of the copy kernel's table failed: " + describe(d, rc);
    }
    lane->table_runs = n;
  }
  if ((rc = d.memcpy_htod_async(lane->table, pieces.data(), n * sizeof(Run), lane->stream)) != cu::kSuccess) {
    *code = rc;
    return "cuMemcpyHtoDAsync of the copy kernel's table failed: " + describe(d, rc);
  }
  unsigned long long count = n;
  void* params[] = {&lane->table, &count};
  unsigned int blocks = static_cast<unsigned int>(std::min<size_t>(n, kKernelMaxBlocks));
  if ((rc = d.launch_kernel(fn, blocks, 1, 1, kKernelThreads, 1, 1, 0, lane->stream, params, nullptr)) !=
      cu::kSuccess) {
    *code = rc;
    return "cuLaunchKernel of the copy kernel failed: " + describe(d, rc);
  }
  return "";
}

// Enqueues all runs on `stream`; returns "" or an error message (and the CUresult in *code).
std::string enqueue_copies(const Driver& d, const Run* runs, size_t n, cu::CUstream stream, bool allow_batch,
                           cu::CUresult* code) {
  bool used_batch = false;
  if (allow_batch && d.memcpy_batch_async != nullptr) {
    // Location hints stay zeroed (CU_MEM_LOCATION_TYPE_INVALID), as vLLM and turbomind pass them:
    // the driver ignores them for memory that is not managed, and the pool and the IPC memory are not.
    cu::CUmemcpyAttributes attr{};
    attr.srcAccessOrder = cu::kSrcAccessOrderStream;
    // KV offload runs next to inference: prefer copy engines over SMs where the driver can.
    attr.flags = cu::kFlagPreferOverlapWithCompute;
    std::vector<cu::CUdeviceptr> dsts, srcs;
    std::vector<size_t> sizes;
    for (size_t start = 0; start < n; start += kMaxBatch) {
      size_t count = std::min(kMaxBatch, n - start);
      dsts.resize(count);
      srcs.resize(count);
      sizes.resize(count);
      for (size_t i = 0; i < count; ++i) {
        dsts[i] = runs[start + i].dst;
        srcs[i] = runs[start + i].src;
        sizes[i] = runs[start + i].size;
      }
      size_t attr_index = 0;
      size_t fail_index = SIZE_MAX;
      cu::CUresult rc = d.memcpy_batch_async(dsts.data(), srcs.data(), sizes.data(), count, &attr, &attr_index, 1,
                                             &fail_index, stream);
      if (rc == cu::kErrorNotSupported && start == 0) break;  // e.g. unsupported platform: per-run below
      if (rc != cu::kSuccess) {
        *code = rc;
        std::string where = fail_index == SIZE_MAX ? "" : " at run " + std::to_string(start + fail_index);
        return "cuMemcpyBatchAsync failed" + where + ": " + describe(d, rc);
      }
      used_batch = true;
    }
    if (used_batch) return "";
  }
  for (size_t i = 0; i < n; ++i) {
    cu::CUresult rc = d.memcpy_async(runs[i].dst, runs[i].src, runs[i].size, stream);
    if (rc != cu::kSuccess) {
      *code = rc;
      return "cuMemcpyAsync failed at run " + std::to_string(i) + ": " + describe(d, rc);
    }
  }
  return "";
}

// Runs fn(d, dev) with `device`'s primary context current (restored afterwards): its error text, or
// the driver's, the device's or the context's.
template <typename Fn>
std::string in_context(int device, cu::CUresult* code, Fn fn) {
  const Driver& d = driver();
  if (!d.error.empty()) return d.error;
  std::string err;
  DeviceState* dev = device_state(d, device, &err, code);
  if (dev == nullptr) return err;
  ContextScope scope(d, dev->ctx);
  if (!scope.ok()) {
    *code = scope.rc();
    return "cannot make the context of CUDA device " + std::to_string(device) + " current: " + describe(d, *code);
  }
  return fn(d, dev);
}

// The runs cut into at most `streams` consecutive parts of about equal bytes: [begin, end) each.
std::vector<std::pair<size_t, size_t>> split_runs(const std::vector<Run>& runs, size_t streams) {
  uint64_t total = 0;
  for (const Run& r : runs) total += r.size;
  size_t parts = std::min<size_t>({streams, runs.size(), std::max<uint64_t>(1, total / kMinStreamBytes)});
  std::vector<std::pair<size_t, size_t>> out;
  uint64_t done = 0;
  size_t begin = 0;
  for (size_t i = 0; i < runs.size(); ++i) {
    done += runs[i].size;
    bool last_part = out.size() + 1 == parts;
    if (!last_part && done * parts >= total * (out.size() + 1)) {
      out.emplace_back(begin, i + 1);
      begin = i + 1;
    }
  }
  if (begin < runs.size()) out.emplace_back(begin, runs.size());
  return out;
}

// The whole device copy, run with the GIL released. Returns "" or an error message; *code is the
// CUresult of the failed driver call (0 when the failure was not a driver call's). Ordering against
// the engine is the caller's (cuda_query_event before the copy). Without a caller's stream, the runs
// are spread over up to copy_streams streams of our own. `while_copying` runs on this thread once
// every run is enqueued, before the wait for them: host work the DMA hides.
std::string cuda_copy(const std::vector<Run>& runs, int device, uint64_t user_stream, bool allow_batch,
                      cu::CUresult* code, const std::function<void()>& while_copying) {
  return in_context(device, code, [&](const Driver& d, DeviceState* dev) -> std::string {
    if (runs.empty()) {
      while_copying();
      return "";
    }
    std::string err;
    // The copy kernel's, on one stream of our own; null: the copy engines.
    cu::CUfunction kernel = d.copy_kernel && user_stream == 0 ? copy_kernel_of(d, dev) : nullptr;
    auto parts = split_runs(runs, user_stream != 0 || kernel != nullptr ? 1 : d.copy_streams);
    std::vector<Lane> lanes(parts.size());
    size_t acquired = 0;
    while (acquired < lanes.size() && acquire_lane(d, dev, &lanes[acquired], &err, code)) ++acquired;
    auto release = [&] {
      for (size_t i = 0; i < acquired; ++i) release_lane(dev, lanes[i]);
    };
    if (acquired < lanes.size()) {
      release();
      return err;
    }
    auto stream_of = [&](size_t i) {
      return user_stream != 0 ? reinterpret_cast<cu::CUstream>(user_stream) : lanes[i].stream;
    };
    size_t enqueued = 0;
    for (; enqueued < parts.size() && err.empty(); ++enqueued) {
      auto [begin, end] = parts[enqueued];
      const Run* part = runs.data() + begin;
      err = kernel != nullptr ? enqueue_kernel(d, kernel, &lanes[enqueued], part, end - begin, code)
                              : enqueue_copies(d, part, end - begin, stream_of(enqueued), allow_batch, code);
    }
    if (err.empty()) while_copying();
    // Wait even after an enqueue error: earlier runs may still be in flight on the streams.
    for (size_t i = 0; i < enqueued; ++i) {
      cu::CUresult rc = d.event_record(lanes[i].event, stream_of(i));
      if (rc == cu::kSuccess) rc = d.event_synchronize(lanes[i].event);
      if (err.empty() && rc != cu::kSuccess) {
        *code = rc;
        err = "CUDA copy failed while waiting for it: " + describe(d, rc);
      }
    }
    release();
    return err;
  });
}

std::string host_register(uint64_t addr, uint64_t size, int device, bool reg, cu::CUresult* code) {
  return in_context(device, code, [&](const Driver& d, DeviceState*) -> std::string {
    void* ptr = reinterpret_cast<void*>(addr);
    // Portable: the pinning is visible to every context, so one registration serves all GPUs. Mapped
    // too for the copy kernel, which reads and writes the pool by its host addresses.
    unsigned int flags = cu::kMemHostRegisterPortable | (d.copy_kernel ? cu::kMemHostRegisterDeviceMap : 0);
    cu::CUresult rc = reg ? d.mem_host_register(ptr, size, flags)
                          : d.mem_host_unregister(ptr);
    if (rc != cu::kSuccess) {
      *code = rc;
      return std::string(reg ? "cuMemHostRegister" : "cuMemHostUnregister") + " failed: " + describe(d, rc);
    }
    return "";
  });
}

// Whether the work recorded in `event` (an engine's event opened with cuda_open_ipc_event) is done:
// cuEventQuery, which never blocks. *done is set; any answer but success / not-ready is an error.
std::string query_event(uint64_t event, int device, bool* done, cu::CUresult* code) {
  return in_context(device, code, [&](const Driver& d, DeviceState*) -> std::string {
    cu::CUresult rc = d.event_query(reinterpret_cast<cu::CUevent>(event));
    *done = rc == cu::kSuccess;
    if (rc == cu::kSuccess || rc == cu::kErrorNotReady) return "";
    *code = rc;
    return "cuEventQuery on the engine's event failed: " + describe(d, rc);
  });
}

// Opens the engine's interprocess event (cuIpcOpenEventHandle) in the device's primary context, the
// one the copy streams live in; *event is the CUevent. Or destroys one opened so (cuEventDestroy).
std::string ipc_event(const cu::CUipcEventHandle* handle, uint64_t* event, int device, cu::CUresult* code) {
  return in_context(device, code, [&](const Driver& d, DeviceState*) -> std::string {
    cu::CUresult rc;
    if (handle != nullptr) {
      cu::CUevent opened = nullptr;
      rc = d.ipc_open_event(&opened, *handle);
      *event = reinterpret_cast<uint64_t>(opened);
    } else {
      rc = d.event_destroy(reinterpret_cast<cu::CUevent>(*event));
    }
    if (rc != cu::kSuccess) {
      *code = rc;
      return std::string(handle ? "cuIpcOpenEventHandle" : "cuEventDestroy") + " failed: " + describe(d, rc);
    }
    return "";
  });
}

// RuntimeError(message) with the failed call's CUresult as its `cuda_error` attribute (0: not a
// driver error), so that Python can tell errors that leave the context unusable (sticky) apart.
void raise_cuda_error(const std::string& message, cu::CUresult code) {
  PyObject* exc = PyObject_CallFunction(PyExc_RuntimeError, "s", message.c_str());
  if (exc == nullptr) return;  // an exception (e.g. MemoryError) is already set
  PyObject* value = PyLong_FromLong(code);
  if (value == nullptr || PyObject_SetAttrString(exc, "cuda_error", value) != 0) {
    Py_XDECREF(value);
    Py_DECREF(exc);
    return;
  }
  Py_DECREF(value);
  PyErr_SetObject(PyExc_RuntimeError, exc);
  Py_DECREF(exc);
}

// A device copy with its arguments parsed: its runs enqueued, the host blocks checksummed meanwhile, then waited for.
PyObject* copy_parsed(const DeviceCopyArgs& a) {
  std::string err;
  cu::CUresult code = cu::kSuccess;
  std::vector<uint64_t> sums;
  Py_BEGIN_ALLOW_THREADS
  err = cuda_copy(a.runs, a.device, a.stream, a.allow_batch, &code, [&] { sums = a.checksums(); });
  Py_END_ALLOW_THREADS
  if (!err.empty()) {
    raise_cuda_error(err, code);
    return nullptr;
  }
  return u64_bytes(sums);
}

}  // namespace

PyObject* py_cuda_copy_blocks(PyObject*, PyObject* args, PyObject* kwargs) {
  DeviceCopyArgs a;
  if (!parse_device_copy_args(args, kwargs, "OOOOOOi|OpOOO:cuda_copy_blocks", &a)) return nullptr;
  return copy_parsed(a);
}

PyObject* py_cuda_transfer(PyObject*, PyObject* args, PyObject* kwargs) {
  DeviceCopyArgs a;
  if (!parse_device_transfer_args(args, kwargs, "OOpi|OO:cuda_transfer", &a)) return nullptr;
  return copy_parsed(a);
}

static PyObject* host_register_common(PyObject* args, PyObject* kwargs, bool reg) {
  static const char* reg_kw[] = {"addr", "size", "device", nullptr};
  static const char* unreg_kw[] = {"addr", "device", nullptr};
  PyObject *addr_obj, *size_obj = nullptr;
  int device = 0;
  bool parsed = reg ? PyArg_ParseTupleAndKeywords(args, kwargs, "OO|i:cuda_host_register", const_cast<char**>(reg_kw),
                                                  &addr_obj, &size_obj, &device)
                    : PyArg_ParseTupleAndKeywords(args, kwargs, "O|i:cuda_host_unregister",
                                                  const_cast<char**>(unreg_kw), &addr_obj, &device);
  if (!parsed) return nullptr;
  uint64_t addr, size = 0;
  if (!parse_u64(addr_obj, "addr", &addr) || (reg && !parse_u64(size_obj, "size", &size))) return nullptr;
  std::string err;
  cu::CUresult code = cu::kSuccess;
  Py_BEGIN_ALLOW_THREADS
  err = host_register(addr, size, device, reg, &code);
  Py_END_ALLOW_THREADS
  if (!err.empty()) {
    raise_cuda_error(err, code);
    return nullptr;
  }
  Py_RETURN_NONE;
}

PyObject* py_cuda_host_register(PyObject*, PyObject* args, PyObject* kwargs) {
  return host_register_common(args, kwargs, true);
}

PyObject* py_cuda_host_unregister(PyObject*, PyObject* args, PyObject* kwargs) {
  return host_register_common(args, kwargs, false);
}

PyObject* py_cuda_open_ipc_event(PyObject*, PyObject* args, PyObject* kwargs) {
  static const char* kw[] = {"handle", "device", nullptr};
  Py_buffer handle;
  int device = 0;
  if (!PyArg_ParseTupleAndKeywords(args, kwargs, "y*|i:cuda_open_ipc_event", const_cast<char**>(kw), &handle,
                                   &device)) {
    return nullptr;
  }
  cu::CUipcEventHandle h{};
  bool sized = handle.len == static_cast<Py_ssize_t>(cu::kIpcHandleSize);
  if (sized) std::memcpy(h.reserved, handle.buf, cu::kIpcHandleSize);
  PyBuffer_Release(&handle);
  if (!sized) {
    PyErr_Format(PyExc_ValueError, "an IPC event handle has %d bytes", static_cast<int>(cu::kIpcHandleSize));
    return nullptr;
  }
  std::string err;
  uint64_t event = 0;
  cu::CUresult code = cu::kSuccess;
  Py_BEGIN_ALLOW_THREADS
  err = ipc_event(&h, &event, device, &code);
  Py_END_ALLOW_THREADS
  if (!err.empty()) {
    raise_cuda_error(err, code);
    return nullptr;
  }
  return PyLong_FromUnsignedLongLong(event);
}

PyObject* py_cuda_query_event(PyObject*, PyObject* args, PyObject* kwargs) {
  static const char* kw[] = {"event", "device", nullptr};
  PyObject* event_obj;
  int device = 0;
  if (!PyArg_ParseTupleAndKeywords(args, kwargs, "O|i:cuda_query_event", const_cast<char**>(kw), &event_obj,
                                   &device)) {
    return nullptr;
  }
  uint64_t event = 0;
  if (!parse_u64(event_obj, "event", &event)) return nullptr;
  std::string err;
  bool done = false;
  cu::CUresult code = cu::kSuccess;
  Py_BEGIN_ALLOW_THREADS
  err = query_event(event, device, &done, &code);
  Py_END_ALLOW_THREADS
  if (!err.empty()) {
    raise_cuda_error(err, code);
    return nullptr;
  }
  return PyBool_FromLong(done);
}

PyObject* py_cuda_destroy_event(PyObject*, PyObject* args, PyObject* kwargs) {
  static const char* kw[] = {"event", "device", nullptr};
  PyObject* event_obj;
  int device = 0;
  if (!PyArg_ParseTupleAndKeywords(args, kwargs, "O|i:cuda_destroy_event", const_cast<char**>(kw), &event_obj,
                                   &device)) {
    return nullptr;
  }
  uint64_t event = 0;
  if (!parse_u64(event_obj, "event", &event)) return nullptr;
  std::string err;
  cu::CUresult code = cu::kSuccess;
  Py_BEGIN_ALLOW_THREADS
  err = ipc_event(nullptr, &event, device, &code);
  Py_END_ALLOW_THREADS
  if (!err.empty()) {
    raise_cuda_error(err, code);
    return nullptr;
  }
  Py_RETURN_NONE;
}

PyMethodDef kCudaMethods[] = {
    {"cuda_copy_blocks", KV_KW(py_cuda_copy_blocks),
     "cuda_copy_blocks(src_base, dst_base, src_offsets, dst_offsets, sizes, direction, device, stream=0,\n"
     "                 allow_batch=True, checksum_base=0, checksum_offsets=None, checksum_size=0) -> bytes\n\n"
     "Copy merged runs with cuMemcpyBatchAsync (driver >= 12.8) or cuMemcpyAsync per run, on `stream` or\n"
     "a dedicated stream of `device`, and wait for completion (GIL released). direction: 'h2d', 'd2h', 'd2d'.\n"
     "Returns the CRC32C (native-endian uint64 values) of the host blocks of checksum_size bytes at\n"
     "checksum_base + checksum_offsets[i], taken once the runs are enqueued, while they copy."},
    {"cuda_transfer", KV_KW(py_cuda_transfer),
     "cuda_transfer(pool_base, runs, to_engine, device, checksum_offsets=None, checksum_size=0) -> bytes\n\n"
     "A chunk's Runs (plan_transfer's) copied as cuda_copy_blocks copies, pool -> engine if to_engine; the\n"
     "CRC32C of the pool blocks of checksum_size bytes at pool_base + checksum_offsets[i], taken meanwhile."},
    {"cuda_host_register", KV_KW(py_cuda_host_register),
     "cuda_host_register(addr, size, device=0) -> None\n\nPin host memory (cuMemHostRegister, portable)."},
    {"cuda_host_unregister", KV_KW(py_cuda_host_unregister),
     "cuda_host_unregister(addr, device=0) -> None\n\nUndo cuda_host_register."},
    {"cuda_open_ipc_event", KV_KW(py_cuda_open_ipc_event),
     "cuda_open_ipc_event(handle, device=0) -> int\n\n"
     "Open another process's 64-byte IPC event handle (cuIpcOpenEventHandle) on `device`; the CUevent."},
    {"cuda_query_event", KV_KW(py_cuda_query_event),
     "cuda_query_event(event, device=0) -> bool\n\n"
     "Whether the work recorded in an event cuda_open_ipc_event opened is done (cuEventQuery; never blocks)."},
    {"cuda_destroy_event", KV_KW(py_cuda_destroy_event),
     "cuda_destroy_event(event, device=0) -> None\n\nDestroy an event cuda_open_ipc_event opened."},
    {nullptr, nullptr, 0, nullptr},
};

bool add_cuda(PyObject* module) { return PyModule_AddFunctions(module, kCudaMethods) == 0; }

bool add_cuda_features(PyObject* features) {
  const Driver* d;
  Py_BEGIN_ALLOW_THREADS
  d = &driver();
  Py_END_ALLOW_THREADS
  bool ok = set_item(features, "cuda_compiled", PyBool_FromLong(1)) &&
#if defined(KVSTORE_CUDA_ABI_CHECK)
            set_item(features, "cuda_abi_checked", PyBool_FromLong(1)) &&
#else
            set_item(features, "cuda_abi_checked", PyBool_FromLong(0)) &&
#endif
            set_item(features, "cuda_available", PyBool_FromLong(d->error.empty())) &&
            set_item(features, "cuda_driver_version", PyLong_FromLong(d->version)) &&
            // The switch as read from KVSTORE_CUDA_BATCH_MEMCPY, reported with or without a driver.
            set_item(features, "cuda_batch_memcpy_allowed", PyBool_FromLong(d->batch_allowed)) &&
            set_item(features, "cuda_copy_streams", PyLong_FromSize_t(d->copy_streams)) &&
            set_item(features, "cuda_copy_kernel", PyBool_FromLong(d->copy_kernel)) &&  // KVSTORE_CUDA_COPY_KERNEL
            // Whether copies use cuMemcpyBatchAsync: allowed, and the driver (12.8+) has it.
            set_item(features, "cuda_batch_memcpy", PyBool_FromLong(d->error.empty() && d->memcpy_batch_async)) &&
            set_item(features, "cuda_error", PyUnicode_FromString(d->error.c_str()));
  return ok;
}

}  // namespace kvstore

// ---- ABI check against the real header ------------------------------------------------------
#if defined(KVSTORE_CUDA_ABI_CHECK)
#include <cuda.h>

static_assert(sizeof(kvstore::cu::CUdeviceptr) == sizeof(::CUdeviceptr), "CUdeviceptr");
static_assert(sizeof(kvstore::cu::CUresult) == sizeof(::CUresult), "CUresult");
static_assert(sizeof(kvstore::cu::CUdevice) == sizeof(::CUdevice), "CUdevice");
static_assert(kvstore::cu::kErrorNotSupported == ::CUDA_ERROR_NOT_SUPPORTED, "kErrorNotSupported");
static_assert(kvstore::cu::kErrorNotReady == ::CUDA_ERROR_NOT_READY, "kErrorNotReady");
static_assert(kvstore::cu::kStreamNonBlocking == ::CU_STREAM_NON_BLOCKING, "kStreamNonBlocking");
static_assert(kvstore::cu::kEventBlockingSync == ::CU_EVENT_BLOCKING_SYNC, "kEventBlockingSync");
static_assert(kvstore::cu::kEventDisableTiming == ::CU_EVENT_DISABLE_TIMING, "kEventDisableTiming");
static_assert(kvstore::cu::kMemHostRegisterPortable == CU_MEMHOSTREGISTER_PORTABLE, "PORTABLE");
static_assert(kvstore::cu::kMemHostRegisterDeviceMap == CU_MEMHOSTREGISTER_DEVICEMAP, "DEVICEMAP");
static_assert(kvstore::cu::kAttrCanUseHostPointerForRegisteredMem ==
              ::CU_DEVICE_ATTRIBUTE_CAN_USE_HOST_POINTER_FOR_REGISTERED_MEM, "CAN_USE_HOST_POINTER");
static_assert(sizeof(kvstore::Run) == 3 * sizeof(unsigned long long), "Run: the copy kernel's layout");
static_assert(kvstore::cu::kIpcHandleSize == CU_IPC_HANDLE_SIZE, "CU_IPC_HANDLE_SIZE");
static_assert(sizeof(kvstore::cu::CUipcEventHandle) == sizeof(::CUipcEventHandle), "CUipcEventHandle");
// Everything checked outside the version guard exists in CUDA 12.0 headers (CU_MEM_LOCATION_TYPE_HOST
// does not: it came with 12.2, and nothing here uses it).
static_assert(kvstore::cu::kLocationInvalid == ::CU_MEM_LOCATION_TYPE_INVALID, "LOCATION_INVALID");
#if CUDA_VERSION >= 12080
static_assert(kvstore::cu::kSrcAccessOrderStream == ::CU_MEMCPY_SRC_ACCESS_ORDER_STREAM, "ORDER");
static_assert(kvstore::cu::kFlagPreferOverlapWithCompute == ::CU_MEMCPY_FLAG_PREFER_OVERLAP_WITH_COMPUTE,
              "FLAG");
static_assert(sizeof(kvstore::cu::CUmemcpyAttributes) == sizeof(::CUmemcpyAttributes), "CUmemcpyAttributes size");
static_assert(offsetof(kvstore::cu::CUmemcpyAttributes, srcLocHint) == offsetof(::CUmemcpyAttributes, srcLocHint),
              "srcLocHint");
static_assert(offsetof(kvstore::cu::CUmemcpyAttributes, dstLocHint) == offsetof(::CUmemcpyAttributes, dstLocHint),
              "dstLocHint");
static_assert(offsetof(kvstore::cu::CUmemcpyAttributes, flags) == offsetof(::CUmemcpyAttributes, flags), "flags");
static_assert(sizeof(kvstore::cu::CUmemLocation) == sizeof(::CUmemLocation), "CUmemLocation");
#endif
#endif
