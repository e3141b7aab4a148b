// kvstore_service._native: the daemon's native engine, plain CPython C API (no torch, no pybind11) so it
// builds with just a C++17 compiler and the Python headers. Every function that touches block memory
// releases the GIL while it works. Each unit adds its functions here; kvstore_native.h lists them.

#include <thread>

#include "crc32c.h"
#include "kvstore_native.h"

namespace kvstore {

namespace {

PyObject* py_features(PyObject*, PyObject*) {
  PyObject* d = PyDict_New();
  if (d == nullptr) return nullptr;
  bool ok = set_item(d, "cpu_threads", PyLong_FromUnsignedLong(std::thread::hardware_concurrency())) &&
            set_item(d, "checksum", PyUnicode_FromString("crc32c")) &&
            set_item(d, "crc32c_impl", PyUnicode_FromString(crc32c_impl())) &&
            set_item(d, "crc32c_hardware", PyBool_FromLong(crc32c_hardware())) &&
            add_cuda_features(d) && add_acl_features(d);
  if (!ok) {
    Py_DECREF(d);
    return nullptr;
  }
  return d;
}

PyMethodDef kMethods[] = {
    {"features", reinterpret_cast<PyCFunction>(py_features), METH_NOARGS,
     "features() -> dict\n\nWhat was compiled in and what the machine offers (probes the CUDA/ACL runtimes)."},
    {nullptr, nullptr, 0, nullptr},
};

PyModuleDef kModule = {
    PyModuleDef_HEAD_INIT, "_native",
    "Native batched block copy and CRC32C checksum engine of the kvstore daemon.", -1, kMethods,
    nullptr, nullptr, nullptr, nullptr,
};

}  // namespace

}  // namespace kvstore

PyMODINIT_FUNC PyInit__native(void) {
  using namespace kvstore;
  PyObject* m = PyModule_Create(&kModule);
  if (m == nullptr) return nullptr;
  if (!add_copy(m) || !add_checksums(m) || !add_plan(m) || !add_transfer(m) || !add_slot_headers(m) || !add_cuda(m) ||
      !add_acl(m) || !add_block_type(m) || !add_guard(m) || !add_populate(m) || !add_disk_io(m)) {
    Py_DECREF(m);
    return nullptr;
  }
  return m;
}
