// The pool's slot headers: written after a block's bytes, read back by a restarted daemon.

#include <cstddef>
#include <cstring>

#include "crc32c.h"
#include "kvstore_native.h"

namespace kvstore {

namespace {

// The pool's slot header: THE definition of its layout. Python has none of its own: it reads
// headers with parse_slot_header and takes SLOT_HEADER_BYTES, SLOT_MAGIC and SLOT_MAX_KEY from
// this module. Little-endian, packed; the CRC32C covers every byte before it. Header i of a
// segment starts at i * kSlotHeaderBytes; the bytes after `crc` up to there are unused (zero).
// Changing this layout changes the pool file format: bump POOL_VERSION in kvstore_service/pool.py.
// A header is written only after its block's bytes, so a crash never leaves a valid header over
// torn bytes; pool.invalidate() voids one by zeroing its first 4 bytes (the magic).
#pragma pack(push, 1)
struct SlotHeader {
  uint32_t magic;        // kSlotMagic; 0 once invalidated
  uint32_t state;        // pool.SlotState (STORED, SEALED)
  uint64_t payload_len;  // bytes of the block
  uint64_t checksum;     // CRC32C of the block once sealed, else 0
  uint64_t generation;   // store order, for LRU after a restart
  uint8_t ns_hash[16];   // namespace
  uint32_t key_len;      // 1..kSlotMaxKey
  uint8_t key[64];       // key_len bytes, then zeros
  uint32_t crc;          // CRC32C of the bytes above
};
#pragma pack(pop)

constexpr uint32_t kSlotMagic = 0x4B565342;  // "KVSB"
constexpr size_t kSlotHeaderBytes = 128;
constexpr size_t kSlotMaxKey = sizeof(SlotHeader::key);
constexpr size_t kSlotCrcCovers = offsetof(SlotHeader, crc);
static_assert(offsetof(SlotHeader, magic) == 0, "pool.invalidate() zeroes the first 4 bytes");
static_assert(offsetof(SlotHeader, key) == 52 && kSlotCrcCovers == 116 && sizeof(SlotHeader) == 120,
              "the slot header layout is the pool file format: bump POOL_VERSION when changing it");
static_assert(sizeof(SlotHeader) <= kSlotHeaderBytes, "a slot header must fit its slot");
#if defined(__BYTE_ORDER__) && __BYTE_ORDER__ != __ORDER_LITTLE_ENDIAN__
#error "the pool file format is little-endian"
#endif

// invalidate_slot_headers(base, slots, count): zero the magic of each slot's header, in a segment whose
// `count` headers start at `base`. Every slot is checked against count before any byte is written.
PyObject* py_invalidate_slot_headers(PyObject*, PyObject* const* args, Py_ssize_t nargs) {
  if (nargs != 3) {
    PyErr_SetString(PyExc_TypeError, "invalidate_slot_headers(base, slots, count) takes 3 arguments");
    return nullptr;
  }
  uint64_t base, count;
  if (!parse_u64(args[0], "base", &base) || !parse_u64(args[2], "count", &count)) return nullptr;
  if (!PyList_Check(args[1])) {
    PyErr_SetString(PyExc_TypeError, "invalidate_slot_headers: slots must be a list of ints");
    return nullptr;
  }
  PyObject* items = PyList_AsTuple(args[1]);  // (a slot's __index__ may change the list)
  if (items == nullptr) return nullptr;
  const Py_ssize_t n = PyTuple_GET_SIZE(items);
  std::vector<uint64_t> slots(static_cast<size_t>(n));
  for (Py_ssize_t i = 0; i < n; ++i) {
    if (!parse_u64(PyTuple_GET_ITEM(items, i), "slot", &slots[i])) {
      Py_DECREF(items);
      return nullptr;
    }
    if (slots[i] >= count) {
      PyErr_Format(PyExc_ValueError, "slot %llu is past the segment's %llu slots",
                   static_cast<unsigned long long>(slots[i]), static_cast<unsigned long long>(count));
      Py_DECREF(items);
      return nullptr;
    }
  }
  Py_DECREF(items);
  const uint32_t invalid = 0;
  for (uint64_t slot : slots) {
    std::memcpy(reinterpret_cast<void*>(base + slot * kSlotHeaderBytes + offsetof(SlotHeader, magic)), &invalid,
                sizeof invalid);
  }
  Py_RETURN_NONE;
}

PyObject* py_write_slot_headers(PyObject*, PyObject* args, PyObject* kwargs) {
  static const char* kwlist[] = {"base",    "offsets", "state",     "payload_len", "generation",
                                 "ns_hash", "keys",    "key_size",  "checksums",   nullptr};
  PyObject *base_obj, *offsets_obj, *payload_obj, *generation_obj, *checksums_obj = Py_None;
  unsigned int state;
  Py_buffer ns_hash, keys;
  Py_ssize_t key_size;
  if (!PyArg_ParseTupleAndKeywords(args, kwargs, "OOIOOy*y*n|O:write_slot_headers", const_cast<char**>(kwlist),
                                   &base_obj, &offsets_obj, &state, &payload_obj, &generation_obj, &ns_hash,
                                   &keys, &key_size, &checksums_obj)) {
    return nullptr;
  }
  uint64_t base, payload_len, generation;
  std::vector<uint64_t> offsets, checksums;
  bool ok = parse_u64(base_obj, "base", &base) && parse_u64(payload_obj, "payload_len", &payload_len) &&
            parse_u64(generation_obj, "generation", &generation) &&
            parse_u64_array(offsets_obj, "offsets", &offsets) &&
            (checksums_obj == Py_None || parse_u64_array(checksums_obj, "checksums", &checksums));
  const size_t n = offsets.size();
  if (ok && ns_hash.len != sizeof(SlotHeader::ns_hash)) {
    PyErr_Format(PyExc_ValueError, "ns_hash must be 16 bytes (got %zd)", ns_hash.len);
    ok = false;
  } else if (ok && (key_size < 1 || static_cast<size_t>(key_size) > kSlotMaxKey ||
                    static_cast<size_t>(keys.len) != n * static_cast<size_t>(key_size))) {
    PyErr_Format(PyExc_ValueError, "keys must be %zu keys of 1..%zu bytes (got %zd bytes, key_size %zd)", n,
                 kSlotMaxKey, keys.len, key_size);
    ok = false;
  } else if (ok && checksums_obj != Py_None && checksums.size() != n) {
    PyErr_Format(PyExc_ValueError, "%zu offsets but %zu checksums", n, checksums.size());
    ok = false;
  }
  if (ok) {
    const auto* key_bytes = static_cast<const uint8_t*>(keys.buf);
    SlotHeader h{};
    h.magic = kSlotMagic;
    h.state = state;
    h.payload_len = payload_len;
    h.generation = generation;
    std::memcpy(h.ns_hash, ns_hash.buf, sizeof(h.ns_hash));
    h.key_len = static_cast<uint32_t>(key_size);
    Py_BEGIN_ALLOW_THREADS
    for (size_t i = 0; i < n; ++i) {
      h.checksum = checksums.empty() ? 0 : checksums[i];
      std::memcpy(h.key, key_bytes + i * h.key_len, h.key_len);
      h.crc = crc32c(0, &h, kSlotCrcCovers);
      std::memcpy(reinterpret_cast<void*>(base + offsets[i]), &h, sizeof(h));
    }
    Py_END_ALLOW_THREADS
  }
  PyBuffer_Release(&ns_hash);
  PyBuffer_Release(&keys);
  if (!ok) return nullptr;
  Py_RETURN_NONE;
}

// parse_slot_header(data, offset) -> (state, payload_len, checksum, generation, ns_hash, key) or None
// when the bytes there are no valid header (never written, torn, invalidated).
PyObject* py_parse_slot_header(PyObject*, PyObject* args, PyObject* kwargs) {
  static const char* kwlist[] = {"data", "offset", nullptr};
  Buffer data;
  Py_ssize_t offset;
  if (!PyArg_ParseTupleAndKeywords(args, kwargs, "y*n:parse_slot_header", const_cast<char**>(kwlist), &data.view,
                                   &offset)) {
    return nullptr;
  }
  data.held = true;
  if (offset < 0 || data.view.len < static_cast<Py_ssize_t>(sizeof(SlotHeader)) ||
      offset > data.view.len - static_cast<Py_ssize_t>(sizeof(SlotHeader))) {
    PyErr_Format(PyExc_ValueError, "no %zu-byte slot header at offset %zd of a %zd-byte buffer", sizeof(SlotHeader),
                 offset, data.view.len);
    return nullptr;
  }
  SlotHeader h;
  std::memcpy(&h, static_cast<const uint8_t*>(data.view.buf) + offset, sizeof(h));
  if (h.magic != kSlotMagic || h.key_len > kSlotMaxKey || h.crc != crc32c(0, &h, kSlotCrcCovers)) {
    Py_RETURN_NONE;
  }
  return Py_BuildValue("(IKKKy#y#)", h.state, static_cast<unsigned long long>(h.payload_len),
                       static_cast<unsigned long long>(h.checksum), static_cast<unsigned long long>(h.generation),
                       reinterpret_cast<const char*>(h.ns_hash), static_cast<Py_ssize_t>(sizeof(h.ns_hash)),
                       reinterpret_cast<const char*>(h.key), static_cast<Py_ssize_t>(h.key_len));
}

PyMethodDef kSlotHeaderMethods[] = {
    {"write_slot_headers", KV_KW(py_write_slot_headers),
     "write_slot_headers(base, offsets, state, payload_len, generation, ns_hash, keys, key_size, checksums=None)\n\n"
     "Write the pool slot header of block i at base+offsets[i] (layout: SlotHeader in csrc/slot_headers.cpp),\n"
     "GIL released. keys: the blocks' keys packed, key_size bytes each; checksums: uint64 buffer, or None for 0."},
    {"invalidate_slot_headers", reinterpret_cast<PyCFunction>(reinterpret_cast<void (*)()>(py_invalidate_slot_headers)),
     METH_FASTCALL,
     "invalidate_slot_headers(base, slots, count)\n\n"
     "Void the slot header of each slot (of a segment whose `count` headers start at `base`): a recovery then\n"
     "finds none there. ValueError, before anything is written, for a slot not below count."},
    {"parse_slot_header", KV_KW(py_parse_slot_header),
     "parse_slot_header(data, offset) -> tuple | None\n\n"
     "(state, payload_len, checksum, generation, ns_hash, key) of the slot header at data[offset:], or None\n"
     "if none is valid there (bad magic, key length or CRC32C). ValueError if it would read past the buffer."},
    {nullptr, nullptr, 0, nullptr},
};

}  // namespace

bool add_slot_headers(PyObject* module) {
  return PyModule_AddIntConstant(module, "SLOT_HEADER_BYTES", static_cast<long>(kSlotHeaderBytes)) == 0 &&
         PyModule_AddIntConstant(module, "SLOT_MAGIC", static_cast<long>(kSlotMagic)) == 0 &&
         PyModule_AddIntConstant(module, "SLOT_MAX_KEY", static_cast<long>(kSlotMaxKey)) == 0 &&
         PyModule_AddFunctions(module, kSlotHeaderMethods) == 0;
}

}  // namespace kvstore
