// The index's block record (kvstore_service/index.py `Block` subclasses it), its batch constructor and
// the LRU lists of blocks.
//
// A store makes a block per slot it reserves, thousands per job, on the event loop while the copies
// run. A dataclass's __init__ is Python code per block (~0.3 us); here a batch of blocks is made in
// one C call. Its fields are object slots, as a `__slots__` class's (reading one costs the same), but
// for the payload and header offsets: plain integers.
// The LRU lists are intrusive (each block links to its neighbours): a store appends thousands of
// blocks to one, an eviction unlinks as many, without hashing or allocating (an OrderedDict's update
// was a seventh of a full pool's store bookkeeping).

#include "kvstore_native.h"  // (Python.h first)

#include <structmember.h>

#include <cstring>
#include <vector>

namespace kvstore {
namespace {

struct BlockObject {
  PyObject_HEAD
  PyObject* key;
  PyObject* ns;
  PyObject* segment;
  PyObject* slot;
  PyObject* state;
  PyObject* pins;
  PyObject* checksum;
  PyObject* shards_in;
  PyObject* shards_copying;
  PyObject* tail;
  PyObject* promoted;
  // Plain integers, not objects: a block made or freed allocates two ints fewer, and a chunk's or a
  // seal's offsets are read without making any (block_offsets).
  uint64_t offset;  // of the payload in the pool file
  uint64_t header;  // of the slot header in the pool file
  // On an LRU list (which holds a reference), or all null.
  struct LruObject* lru;
  BlockObject* prev;
  BlockObject* next;
};

struct LruObject {
  PyObject_HEAD
  BlockObject* head;  // least recently used
  BlockObject* tail;
  Py_ssize_t size;
};

constexpr int kFields = 11;  // the object fields, key to promoted

PyObject** fields(BlockObject* b) { return &b->key; }

#define KV_FIELD(name, member) {name, T_OBJECT_EX, offsetof(BlockObject, member), 0, nullptr}
PyMemberDef kMembers[] = {
    KV_FIELD("key", key),
    KV_FIELD("namespace", ns),
    KV_FIELD("segment", segment),
    KV_FIELD("slot", slot),
    KV_FIELD("state", state),
    KV_FIELD("pins", pins),
    KV_FIELD("checksum", checksum),
    KV_FIELD("shards_in", shards_in),
    KV_FIELD("shards_copying", shards_copying),
    KV_FIELD("tail", tail),
    KV_FIELD("promoted", promoted),
    {"offset", T_ULONGLONG, offsetof(BlockObject, offset), 0, nullptr},
    {"header", T_ULONGLONG, offsetof(BlockObject, header), 0, nullptr},
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
  // From snapshots of the lists (an allocation may run a GC, whose finalizers could change them).
  PyObject* key_items = PyList_AsTuple(keys);
  PyObject* slot_items = PyList_AsTuple(slots);
  PyObject* out = key_items && slot_items ? PyList_New(n) : nullptr;
  PyObject* zero = PyLong_FromLong(0);
  if (out == nullptr || zero == nullptr) goto fail;
  for (Py_ssize_t i = 0; i < n; ++i) {
    uint64_t s = PyLong_AsUnsignedLongLong(PyTuple_GET_ITEM(slot_items, i));
    if (s == static_cast<uint64_t>(-1) && PyErr_Occurred()) goto fail;
    uint64_t offset, header;  // (overflow checked: a wrapped offset would pass the copies' bounds checks)
    if (__builtin_mul_overflow(s, payload_stride, &offset) || __builtin_add_overflow(offset, payload_base, &offset) ||
        __builtin_mul_overflow(s, header_stride, &header) || __builtin_add_overflow(header, header_base, &header)) {
      PyErr_Format(PyExc_OverflowError, "make_blocks: slot %llu's offsets overflow 64 bits", static_cast<unsigned long long>(s));
      goto fail;
    }
    auto* b = reinterpret_cast<BlockObject*>(type->tp_alloc(type, 0));
    if (b == nullptr) goto fail;
    PyList_SET_ITEM(out, i, reinterpret_cast<PyObject*>(b));
    b->offset = offset;
    b->header = header;
    b->key = Py_NewRef(PyTuple_GET_ITEM(key_items, i));
    b->ns = Py_NewRef(ns);
    b->segment = Py_NewRef(segment);
    b->slot = Py_NewRef(PyTuple_GET_ITEM(slot_items, i));
    b->state = Py_NewRef(state);
    b->pins = Py_NewRef(zero);
    b->checksum = Py_NewRef(Py_None);
    b->shards_in = Py_NewRef(zero);
    b->shards_copying = Py_NewRef(zero);
    b->tail = Py_NewRef(Py_False);
    b->promoted = Py_NewRef(Py_False);
  }
  Py_DECREF(zero);
  Py_DECREF(key_items);
  Py_DECREF(slot_items);
  return out;
fail:
  Py_XDECREF(zero);
  Py_XDECREF(out);
  Py_XDECREF(key_items);
  Py_XDECREF(slot_items);
  return nullptr;
}


// ---- LRU lists --------------------------------------------------------------------------------

void unlink(BlockObject* b) {
  LruObject* l = b->lru;
  (b->prev ? b->prev->next : l->head) = b->next;
  (b->next ? b->next->prev : l->tail) = b->prev;
  b->prev = b->next = nullptr;
  b->lru = nullptr;
  --l->size;
}

void link_last(LruObject* l, BlockObject* b) {
  b->lru = l;
  b->prev = l->tail;
  b->next = nullptr;
  (l->tail ? l->tail->next : l->head) = b;
  l->tail = b;
  ++l->size;
}

// Each item of `blocks` (a list) as a block, or a TypeError.
BlockObject* block_at(PyObject* blocks, Py_ssize_t i) {
  PyObject* item = PyList_GET_ITEM(blocks, i);
  if (!PyObject_TypeCheck(item, &kBlockType)) {
    PyErr_Format(PyExc_TypeError, "LruList: a %.100s is not a block", Py_TYPE(item)->tp_name);
    return nullptr;
  }
  return reinterpret_cast<BlockObject*>(item);
}

bool is_list(PyObject* blocks) {
  if (PyList_Check(blocks)) return true;
  PyErr_SetString(PyExc_TypeError, "LruList: blocks must be a list");
  return false;
}

void lru_dealloc(PyObject* self) {
  auto* l = reinterpret_cast<LruObject*>(self);
  while (l->head != nullptr) {
    BlockObject* b = l->head;
    unlink(b);
    Py_DECREF(b);
  }
  Py_TYPE(self)->tp_free(self);
}

enum class LruOp {
  kAppend,  // each block to the end (most recent), from wherever it was (this list, another, none)
  kTouch,   // those of the blocks on this list to its end; the others stay where they are
  kRemove,  // those of the blocks on this list off it
};

PyObject* lru_apply(PyObject* self, PyObject* blocks, LruOp op) {
  auto* l = reinterpret_cast<LruObject*>(self);
  if (!is_list(blocks)) return nullptr;
  for (Py_ssize_t i = 0; i < PyList_GET_SIZE(blocks); ++i) {
    BlockObject* b = block_at(blocks, i);
    if (b == nullptr) return nullptr;
    if (op != LruOp::kAppend && b->lru != l) continue;
    if (b->lru != nullptr) {
      unlink(b);
    } else {
      Py_INCREF(b);  // (kAppend of a block on no list: the list's reference)
    }
    if (op == LruOp::kRemove) {
      Py_DECREF(b);
    } else {
      link_last(l, b);
    }
  }
  Py_RETURN_NONE;
}

PyObject* lru_append(PyObject* self, PyObject* blocks) { return lru_apply(self, blocks, LruOp::kAppend); }
PyObject* lru_touch(PyObject* self, PyObject* blocks) { return lru_apply(self, blocks, LruOp::kTouch); }
PyObject* lru_remove(PyObject* self, PyObject* blocks) { return lru_apply(self, blocks, LruOp::kRemove); }

bool is_zero(PyObject* n, PyObject* zero) {
  int overflow = 0;  // (a huge count is not zero, and leaves no error set)
  return n == zero || (n != nullptr && PyLong_Check(n) && PyLong_AsLongAndOverflow(n, &overflow) == 0 && !overflow);
}

// victims(n, committed, evictable): up to n blocks from the oldest, each unpinned in state
// `committed` (checked here) or one for which evictable(block) is true (called for the others only).
PyObject* lru_victims(PyObject* self, PyObject* const* args, Py_ssize_t nargs) {
  auto* l = reinterpret_cast<LruObject*>(self);
  if (nargs != 3) {
    PyErr_SetString(PyExc_TypeError, "victims takes 3 arguments");
    return nullptr;
  }
  Py_ssize_t n = PyLong_AsSsize_t(args[0]);
  if (n == -1 && PyErr_Occurred()) return nullptr;
  PyObject *committed = args[1], *evictable = args[2];
  PyObject* out = PyList_New(0);
  if (out == nullptr) return nullptr;
  PyObject* zero = PyLong_FromLong(0);
  // evictable() only reads; one that changed the list around the block it was asked about is an
  // error (both blocks held meanwhile: neither is freed under us).
  for (BlockObject* b = l->head; b != nullptr && PyList_GET_SIZE(out) < n;) {
    BlockObject* next = b->next;
    int take = b->state == committed && is_zero(b->pins, zero);
    if (!take) {
      Py_INCREF(b);
      Py_XINCREF(next);
      PyObject* r = PyObject_CallOneArg(evictable, reinterpret_cast<PyObject*>(b));
      take = r == nullptr ? -1 : PyObject_IsTrue(r);
      Py_XDECREF(r);
      const bool changed = b->lru != l || b->next != next;
      Py_DECREF(b);  // (unchanged: still on the list, which holds it)
      Py_XDECREF(next);
      if (take >= 0 && changed) {
        PyErr_SetString(PyExc_RuntimeError, "LruList.victims: evictable() changed the list");
        take = -1;
      }
    }
    if (take < 0 || (take && PyList_Append(out, reinterpret_cast<PyObject*>(b)) < 0)) {
      Py_DECREF(zero);
      Py_DECREF(out);
      return nullptr;
    }
    b = next;
  }
  Py_DECREF(zero);
  return out;
}

Py_ssize_t lru_len(PyObject* self) { return reinterpret_cast<LruObject*>(self)->size; }

// iter(lru): over a snapshot, oldest first (the loop may evict what it sees).
PyObject* lru_iter(PyObject* self) {
  auto* l = reinterpret_cast<LruObject*>(self);
  PyObject* snapshot = PyList_New(l->size);
  if (snapshot == nullptr) return nullptr;
  if (PyList_GET_SIZE(snapshot) != l->size) {  // (the allocation ran a GC whose finalizers changed the list)
    Py_DECREF(snapshot);
    PyErr_SetString(PyExc_RuntimeError, "LruList changed while a snapshot of it was made");
    return nullptr;
  }
  Py_ssize_t i = 0;
  for (BlockObject* b = l->head; b != nullptr; b = b->next) {
    PyList_SET_ITEM(snapshot, i++, Py_NewRef(reinterpret_cast<PyObject*>(b)));
  }
  PyObject* it = PyObject_GetIter(snapshot);
  Py_DECREF(snapshot);
  return it;
}

PyMethodDef kLruMethods[] = {
    {"append", lru_append, METH_O, "append(blocks): each block to the end (most recent), from wherever it was."},
    {"touch", lru_touch, METH_O, "touch(blocks): those of the blocks on this list to its end."},
    {"remove", lru_remove, METH_O, "remove(blocks): those of the blocks on this list off it."},
    {"victims", reinterpret_cast<PyCFunction>(reinterpret_cast<void (*)()>(lru_victims)), METH_FASTCALL,
     "victims(n, committed, evictable) -> list: up to n blocks from the oldest, each unpinned in state\n"
     "`committed`, or one for which evictable(block) is true (asked of the others only)."},
    {nullptr, nullptr, 0, nullptr},
};

PySequenceMethods kLruSequence = {lru_len};

PyTypeObject kLruType = {
    PyVarObject_HEAD_INIT(nullptr, 0) "kvstore_service._native.LruList",  // tp_name
    sizeof(LruObject),                                                   // tp_basicsize
};

// ---- bookkeeping over many blocks ----------------------------------------------------------------

// add_pins(blocks, delta, doomed): each block's pins += delta, in order (a block named twice counts
// twice); returns those whose pins reached 0 in state `doomed` (an unpin then frees their slots).
// Pins never go below 0: a block that would is an unbalanced unpin, and every change is undone.
PyObject* py_add_pins(PyObject*, PyObject* const* args, Py_ssize_t nargs) {
  if (nargs != 3) {
    PyErr_SetString(PyExc_TypeError, "add_pins(blocks, delta, doomed) takes 3 arguments");
    return nullptr;
  }
  long delta = PyLong_AsLong(args[1]);
  if (delta == -1 && PyErr_Occurred()) return nullptr;
  PyObject* doomed = args[2];
  // A snapshot (a list could change under an allocation's GC); each block's old count is kept, so
  // that undoing allocates nothing.
  PyObject* seq = PySequence_Tuple(args[0]);
  if (seq == nullptr) return nullptr;
  const Py_ssize_t n = PyTuple_GET_SIZE(seq);
  std::vector<PyObject*> old;
  old.reserve(n);
  PyObject* out = PyList_New(0);
  for (Py_ssize_t i = 0; out != nullptr && i < n; ++i) {
    PyObject* item = PyTuple_GET_ITEM(seq, i);
    if (!PyObject_TypeCheck(item, &kBlockType)) {
      PyErr_Format(PyExc_TypeError, "add_pins: a %.100s is not a block", Py_TYPE(item)->tp_name);
      break;
    }
    auto* b = reinterpret_cast<BlockObject*>(item);
    if (b->pins == nullptr) {
      PyErr_SetString(PyExc_AttributeError, "add_pins: a block without pins (never initialized)");
      break;
    }
    long pins = PyLong_AsLong(b->pins);
    if (pins == -1 && PyErr_Occurred()) break;
    long now;
    if (__builtin_add_overflow(pins, delta, &now)) {
      PyErr_SetString(PyExc_OverflowError, "add_pins: a block's pins would overflow");
      break;
    }
    if (now < 0) {
      PyErr_SetString(PyExc_ValueError, "add_pins: unbalanced unpin (a block's pins would go below 0)");
      break;
    }
    PyObject* value = PyLong_FromLong(now);
    if (value == nullptr) break;
    old.push_back(b->pins);  // (its reference moves here)
    b->pins = value;
    if (now == 0 && b->state == doomed && PyList_Append(out, item) < 0) break;
  }
  if (out == nullptr || PyErr_Occurred()) {
    for (size_t k = old.size(); k-- > 0;) {  // undo, newest first (a block named twice ends at its first old count)
      auto* b = reinterpret_cast<BlockObject*>(PyTuple_GET_ITEM(seq, k));
      Py_SETREF(b->pins, old[k]);
    }
    old.clear();
    Py_CLEAR(out);
  }
  for (PyObject* o : old) Py_DECREF(o);
  Py_DECREF(seq);
  return out;
}

// commit(blocks, writing, committed, state): each block still in `writing` under its key is moved to
// `committed` and set to `state`; returns those, in order.
PyObject* py_commit(PyObject*, PyObject* const* args, Py_ssize_t nargs) {
  if (nargs != 4 || !PyList_Check(args[0]) || !PyDict_CheckExact(args[1]) || !PyDict_CheckExact(args[2])) {
    PyErr_SetString(PyExc_TypeError, "commit(blocks: list, writing: dict, committed: dict, state)");
    return nullptr;
  }
  PyObject *blocks = args[0], *writing = args[1], *committed = args[2], *state = args[3];
  PyObject* out = PyList_New(0);
  if (out == nullptr) return nullptr;
  for (Py_ssize_t i = 0; i < PyList_GET_SIZE(blocks); ++i) {
    BlockObject* b = block_at(blocks, i);
    if (b == nullptr) goto fail;
    if (b->key == nullptr) {
      PyErr_SetString(PyExc_AttributeError, "commit: a block without a key (never initialized)");
      goto fail;
    }
    PyObject* now = PyDict_GetItemWithError(writing, b->key);  // (borrowed)
    if (now == nullptr && PyErr_Occurred()) goto fail;
    if (now != reinterpret_cast<PyObject*>(b)) continue;  // dropped (or replaced) while it was copied
    if (PyDict_SetItem(committed, b->key, now) < 0 || PyDict_DelItem(writing, b->key) < 0 ||
        PyList_Append(out, now) < 0) {
      goto fail;
    }
    Py_XSETREF(b->state, Py_NewRef(state));  // (a record never given a state has none)
  }
  return out;
fail:
  Py_DECREF(out);
  return nullptr;
}

// block_offsets(blocks, headers): the blocks' payload offsets (header offsets if `headers`) as bytes of
// native uint64s, for the copy and checksum calls.
PyObject* py_block_offsets(PyObject*, PyObject* const* args, Py_ssize_t nargs) {
  if (nargs != 2 || !PyList_Check(args[0])) {
    PyErr_SetString(PyExc_TypeError, "block_offsets(blocks: list, headers: bool)");
    return nullptr;
  }
  int headers = PyObject_IsTrue(args[1]);
  if (headers < 0) return nullptr;
  PyObject* blocks = args[0];
  const Py_ssize_t n = PyList_GET_SIZE(blocks);
  PyObject* out = PyBytes_FromStringAndSize(nullptr, n * static_cast<Py_ssize_t>(sizeof(uint64_t)));
  if (out == nullptr) return nullptr;
  auto* values = reinterpret_cast<uint64_t*>(PyBytes_AS_STRING(out));
  for (Py_ssize_t i = 0; i < n; ++i) {
    BlockObject* b = block_at(blocks, i);
    if (b == nullptr) {
      Py_DECREF(out);
      return nullptr;
    }
    std::memcpy(values + i, headers ? &b->header : &b->offset, sizeof(uint64_t));
  }
  return out;
}

}  // namespace

PyMethodDef kBlockMethods[] = {
    {"make_blocks", reinterpret_cast<PyCFunction>(reinterpret_cast<void (*)()>(py_make_blocks)), METH_FASTCALL,
     "make_blocks(cls, keys, namespace, segment, slots, payload_base, payload_stride, header_base, header_stride,\n"
     "            state) -> list\n\n"
     "A block of `cls` (a BlockRecord subclass) in `state` for each key, in the slot beside it, of one segment:\n"
     "payload at payload_base + slot * payload_stride, header at header_base + slot * header_stride; no pins,\n"
     "no checksum, no shards, neither tail nor promoted."},
    {"add_pins", reinterpret_cast<PyCFunction>(reinterpret_cast<void (*)()>(py_add_pins)), METH_FASTCALL,
     "add_pins(blocks, delta, doomed) -> list\n\n"
     "Each block's pins += delta; returns those whose pins reached 0 in state `doomed`. ValueError, before any\n"
     "change, if a block's pins would go below 0."},
    {"commit", reinterpret_cast<PyCFunction>(reinterpret_cast<void (*)()>(py_commit)), METH_FASTCALL,
     "commit(blocks, writing, committed, state) -> list\n\n"
     "Each block still in the dict `writing` under its key moved to the dict `committed` and set to `state`;\n"
     "returns those, in order."},
    {"block_offsets", reinterpret_cast<PyCFunction>(reinterpret_cast<void (*)()>(py_block_offsets)), METH_FASTCALL,
     "block_offsets(blocks, headers) -> bytes\n\n"
     "The blocks' payload offsets (their slot headers' if `headers`) as native-endian uint64s."},
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
  // Not tracked by the collector: nothing a list holds refers back to it.
  kLruType.tp_flags = Py_TPFLAGS_DEFAULT;
  kLruType.tp_doc = "LruList(): blocks, least recently used first; each block is on one list at most.";
  kLruType.tp_dealloc = lru_dealloc;
  kLruType.tp_as_sequence = &kLruSequence;
  kLruType.tp_iter = lru_iter;
  kLruType.tp_methods = kLruMethods;
  kLruType.tp_new = PyType_GenericNew;
  if (PyType_Ready(&kLruType) < 0) return false;
  Py_INCREF(&kLruType);
  if (PyModule_AddObject(module, "LruList", reinterpret_cast<PyObject*>(&kLruType)) < 0) {
    Py_DECREF(&kLruType);
    return false;
  }
  return PyModule_AddFunctions(module, kBlockMethods) == 0;
}

}  // namespace kvstore
