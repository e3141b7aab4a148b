// The index's block record (kvstore_service/index.py `Block` subclasses it) and its batch constructor.
//
// A store makes a block per slot it reserves, thousands per job, on the event loop while the copies
// run. A dataclass's __init__ is Python code per block (~0.3 us); here a batch of blocks is made in
// one C call. Every field is a plain object slot, as a `__slots__` class's: reading one costs the same.

#include "kvstore_native.h"  // (Python.h first)

#include <structmember.h>

namespace kvstore {
namespace {

struct BlockObject {
  PyObject_HEAD
  PyObject* key;
  PyObject* ns;
  PyObject* segment;
  PyObject* slot;
  PyObject* offset;
  PyObject* header;
  PyObject* state;
  PyObject* pins;
  PyObject* checksum;
  PyObject* shards_in;
  PyObject* shards_copying;
  PyObject* tail;
  PyObject* promoted;
};

constexpr int kFields = 13;

PyObject** fields(BlockObject* b) { return &b->key; }

#define KV_FIELD(name, member) {name, T_OBJECT_EX, offsetof(BlockObject, member), 0, nullptr}
PyMemberDef kMembers[] = {
    KV_FIELD("key", key),
    KV_FIELD("namespace", ns),
    KV_FIELD("segment", segment),
    KV_FIELD("slot", slot),
    KV_FIELD("offset", offset),
    KV_FIELD("header", header),
    KV_FIELD("state", state),
    KV_FIELD("pins", pins),
    KV_FIELD("checksum", checksum),
    KV_FIELD("shards_in", shards_in),
    KV_FIELD("shards_copying", shards_copying),
    KV_FIELD("tail", tail),
    KV_FIELD("promoted", promoted),
    {nullptr, 0, 0, 0, nullptr},
};
#undef KV_FIELD

// Blocks and their namespace refer to each other (a namespace's maps hold its blocks): collectable.
int block_traverse(PyObject* self, visitproc visit, void* arg) {
  PyObject** f = fields(reinterpret_cast<BlockObject*>(self));
  for (int i = 0; i < kFields; ++i) Py_VISIT(f[i]);
  return 0;
}

int block_clear(PyObject* self) {
  PyObject** f = fields(reinterpret_cast<BlockObject*>(self));
  for (int i = 0; i < kFields; ++i) Py_CLEAR(f[i]);
  return 0;
}

void block_dealloc(PyObject* self) {
  PyObject_GC_UnTrack(self);
  block_clear(self);
  Py_TYPE(self)->tp_free(self);  // (a Python subclass's type is released by its subtype_dealloc)
}

PyTypeObject kBlockType = {
    PyVarObject_HEAD_INIT(nullptr, 0) "kvstore_service._native.BlockRecord",  // tp_name
    sizeof(BlockObject),                                                       // tp_basicsize
};

// make_blocks(cls, keys, namespace, segment, slots, payload_base, payload_stride, header_base, header_stride, state)
PyObject* py_make_blocks(PyObject*, PyObject* const* args, Py_ssize_t nargs) {
  if (nargs != 10) {
    PyErr_SetString(PyExc_TypeError, "make_blocks takes 10 arguments");
    return nullptr;
  }
  PyObject *cls = args[0], *keys = args[1], *ns = args[2], *segment = args[3], *slots = args[4], *state = args[9];
  if (!PyType_Check(cls) || !PyType_IsSubtype(reinterpret_cast<PyTypeObject*>(cls), &kBlockType)) {
    PyErr_SetString(PyExc_TypeError, "make_blocks: cls must be a BlockRecord type");
    return nullptr;
  }
  if (!PyList_Check(keys) || !PyList_Check(slots) || PyList_GET_SIZE(keys) != PyList_GET_SIZE(slots)) {
    PyErr_SetString(PyExc_ValueError, "make_blocks: keys and slots must be lists of one length");
    return nullptr;
  }
  uint64_t payload_base, payload_stride, header_base, header_stride;
  if (!parse_u64(args[5], "payload_base", &payload_base) || !parse_u64(args[6], "payload_stride", &payload_stride) ||
      !parse_u64(args[7], "header_base", &header_base) || !parse_u64(args[8], "header_stride", &header_stride)) {
    return nullptr;
  }
  auto* type = reinterpret_cast<PyTypeObject*>(cls);
  const Py_ssize_t n = PyList_GET_SIZE(keys);
  PyObject* out = PyList_New(n);
  if (out == nullptr) return nullptr;
  PyObject* zero = PyLong_FromLong(0);
  for (Py_ssize_t i = 0; i < n; ++i) {
    PyObject* slot = PyList_GET_ITEM(slots, i);
    uint64_t s = PyLong_AsUnsignedLongLong(slot);
    if (s == static_cast<uint64_t>(-1) && PyErr_Occurred()) goto fail;
    auto* b = reinterpret_cast<BlockObject*>(type->tp_alloc(type, 0));
    if (b == nullptr) goto fail;
    PyList_SET_ITEM(out, i, reinterpret_cast<PyObject*>(b));
    b->offset = PyLong_FromUnsignedLongLong(payload_base + s * payload_stride);
    b->header = PyLong_FromUnsignedLongLong(header_base + s * header_stride);
    if (b->offset == nullptr || b->header == nullptr) goto fail;
    b->key = Py_NewRef(PyList_GET_ITEM(keys, i));
    b->ns = Py_NewRef(ns);
    b->segment = Py_NewRef(segment);
    b->slot = Py_NewRef(slot);
    b->state = Py_NewRef(state);
    b->pins = Py_NewRef(zero);
    b->checksum = Py_NewRef(Py_None);
    b->shards_in = Py_NewRef(zero);
    b->shards_copying = Py_NewRef(zero);
    b->tail = Py_NewRef(Py_False);
    b->promoted = Py_NewRef(Py_False);
  }
  Py_DECREF(zero);
  return out;
fail:
  Py_DECREF(zero);
  Py_DECREF(out);
  return nullptr;
}

}  // namespace

PyMethodDef kBlockMethods[] = {
    {"make_blocks", reinterpret_cast<PyCFunction>(reinterpret_cast<void (*)()>(py_make_blocks)), METH_FASTCALL,
     "make_blocks(cls, keys, namespace, segment, slots, payload_base, payload_stride, header_base, header_stride,\n"
     "            state) -> list\n\n"
     "A block of `cls` (a BlockRecord subclass) in `state` for each key, in the slot beside it, of one segment:\n"
     "payload at payload_base + slot * payload_stride, header at header_base + slot * header_stride; no pins,\n"
     "no checksum, no shards, neither tail nor promoted."},
    {nullptr, nullptr, 0, nullptr},
};

bool add_block_type(PyObject* module) {
  kBlockType.tp_flags = Py_TPFLAGS_DEFAULT | Py_TPFLAGS_BASETYPE | Py_TPFLAGS_HAVE_GC;
  kBlockType.tp_traverse = block_traverse;
  kBlockType.tp_clear = block_clear;
  kBlockType.tp_doc = "The fields of an index block (kvstore_service.index.Block), as object slots.";
  kBlockType.tp_members = kMembers;
  kBlockType.tp_dealloc = block_dealloc;
  kBlockType.tp_new = PyType_GenericNew;
  if (PyType_Ready(&kBlockType) < 0) return false;
  Py_INCREF(&kBlockType);
  if (PyModule_AddObject(module, "BlockRecord", reinterpret_cast<PyObject*>(&kBlockType)) < 0) {
    Py_DECREF(&kBlockType);
    return false;
  }
  return PyModule_AddFunctions(module, kBlockMethods) == 0;
}

}  // namespace kvstore
