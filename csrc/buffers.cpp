// Python values in and out of the extension: ints as uint64, uint64 buffers, thread counts, bytes of
// uint64 values. Every unit parses its arguments with these, so one error message names each mistake.

#include <cstring>

#include "kvstore_native.h"

namespace kvstore {

namespace {

// Thread counts above this are rejected: they are a configuration mistake, not a speedup.
constexpr int kMaxThreads = 256;

// True for a struct-module format code of a 64-bit integer in native byte order.
bool is_u64_format(const char* fmt, bool* is_signed) {
  if (fmt == nullptr) return false;
  if (*fmt == '@' || *fmt == '=') ++fmt;
#if !defined(__BYTE_ORDER__) || __BYTE_ORDER__ == __ORDER_LITTLE_ENDIAN__
  else if (*fmt == '<') ++fmt;
#else
  else if (*fmt == '>' || *fmt == '!') ++fmt;
#endif
  if (fmt[0] == '\0' || fmt[1] != '\0') return false;
  switch (fmt[0]) {
    case 'Q': case 'L': case 'N':
      *is_signed = false;
      return true;
    case 'q': case 'l': case 'n':
      *is_signed = true;
      return true;
    default:
      return false;
  }
}

bool is_byte_format(const char* fmt) {
  return fmt == nullptr || std::strcmp(fmt, "B") == 0 || std::strcmp(fmt, "b") == 0 ||
         std::strcmp(fmt, "c") == 0;
}

}  // namespace

bool parse_u64(PyObject* obj, const char* name, uint64_t* out) {
  PyObject* index = PyNumber_Index(obj);
  if (index == nullptr) {
    PyErr_Format(PyExc_TypeError, "%s must be an int, not %.100s", name, Py_TYPE(obj)->tp_name);
    return false;
  }
  unsigned long long value = PyLong_AsUnsignedLongLong(index);
  Py_DECREF(index);
  if (value == static_cast<unsigned long long>(-1) && PyErr_Occurred()) {
    PyErr_Format(PyExc_OverflowError, "%s must be an int in [0, 2**64)", name);
    return false;
  }
  *out = value;
  return true;
}

bool parse_u64_array(PyObject* obj, const char* name, std::vector<uint64_t>* out) {
  Buffer buf;
  if (PyObject_GetBuffer(obj, &buf.view, PyBUF_C_CONTIGUOUS | PyBUF_FORMAT) != 0) {
    PyErr_Format(PyExc_TypeError, "%s must be a contiguous buffer of uint64 (e.g. array('Q')), not %.100s", name,
                 Py_TYPE(obj)->tp_name);
    return false;
  }
  buf.held = true;
  bool is_signed = false;
  if (buf.view.itemsize == 8 && is_u64_format(buf.view.format, &is_signed)) {
    // typed 64-bit integers
  } else if (buf.view.itemsize == 1 && is_byte_format(buf.view.format) && buf.view.len % 8 == 0) {
    // raw bytes holding native-endian uint64 values
  } else {
    PyErr_Format(PyExc_ValueError,
                 "%s must hold 64-bit unsigned integers (itemsize 8, e.g. array('Q')); got format '%s' "
                 "with itemsize %zd",
                 name, buf.view.format ? buf.view.format : "B", buf.view.itemsize);
    return false;
  }
  out->resize(static_cast<size_t>(buf.view.len) / 8);
  if (!out->empty()) std::memcpy(out->data(), buf.view.buf, static_cast<size_t>(buf.view.len));
  if (is_signed) {
    for (size_t i = 0; i < out->size(); ++i) {
      if (static_cast<int64_t>((*out)[i]) < 0) {
        PyErr_Format(PyExc_ValueError, "%s[%zu] is negative", name, i);
        return false;
      }
    }
  }
  return true;
}

bool parse_threads(int threads) {
  if (threads < 1 || threads > kMaxThreads) {
    PyErr_Format(PyExc_ValueError, "threads must be between 1 and %d (got %d)", kMaxThreads, threads);
    return false;
  }
  return true;
}

bool block_addresses(uint64_t base, const std::vector<uint64_t>& offsets, uint64_t size, const char* name,
                     std::vector<uint64_t>* out) {
  out->resize(offsets.size());
  for (size_t i = 0; i < offsets.size(); ++i) {
    uint64_t addr, end;
    if (__builtin_add_overflow(base, offsets[i], &addr) || __builtin_add_overflow(addr, size, &end) ||
        end > UINTPTR_MAX) {
      PyErr_Format(PyExc_OverflowError, "block %zu: %s base + offset + size overflows the address space", i,
                   name);
      return false;
    }
    (*out)[i] = addr;
  }
  return true;
}

PyObject* u64_bytes(const std::vector<uint64_t>& values) {
  return PyBytes_FromStringAndSize(reinterpret_cast<const char*>(values.data()),
                                   static_cast<Py_ssize_t>(values.size() * sizeof(uint64_t)));
}

bool set_item(PyObject* dict, const char* key, PyObject* value) {
  if (value == nullptr) return false;
  int rc = PyDict_SetItemString(dict, key, value);
  Py_DECREF(value);
  return rc == 0;
}

}  // namespace kvstore
