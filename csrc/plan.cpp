// A job's checks at submit, and a chunk's byte runs planned over the engine's regions: a Runs object,
// bounds-checked when it is made, that stays here until a copy (transfer.cpp, the device copies) takes
// it. Python holds it as an opaque handle: no chunk's runs cross into Python and back.

#include <algorithm>
#include <cstring>
#include <new>
#include <string_view>
#include <utility>

#include "kvstore_native.h"

namespace kvstore {

namespace {

// ---- a job's checks at submit -------------------------------------------------------------------

// Whether two of these values are equal (`same(i, j)` settling a tie of values i and j), in one pass
// over an open-addressing table: a sort of 2048 keys and ids took ~0.2 ms of a job's submit.
template <class Same>
bool has_duplicate(const std::vector<uint64_t>& values, Same same) {
  int bits = 4;
  while ((size_t{1} << bits) < 2 * values.size()) ++bits;
  const size_t mask = (size_t{1} << bits) - 1;
  std::vector<size_t> slots(mask + 1, SIZE_MAX);
  for (size_t i = 0; i < values.size(); ++i) {
    size_t at = static_cast<size_t>((values[i] * 0x9E3779B97F4A7C15ull) >> (64 - bits));  // (ids are not random)
    for (; slots[at] != SIZE_MAX; at = (at + 1) & mask) {
      if (values[slots[at]] == values[i] && same(slots[at], i)) return true;
    }
    slots[at] = i;
  }
  return false;
}

// check_job(keys, key_size, block_ids, num_blocks, distinct_ids) -> str: what is wrong with a job's keys
// (packed, key_size bytes each) and engine block ids (a uint64 buffer), "" if nothing; its checks at submit, in C
// (a 2048-block job's min, max and two sets cost ~0.3 ms of Python on our 2-vCPU VM).
PyObject* py_check_job(PyObject*, PyObject* args, PyObject* kwargs) {
  static const char* kwlist[] = {"keys", "key_size", "block_ids", "num_blocks", "distinct_ids", nullptr};
  Buffer keys;
  Py_ssize_t key_size;
  PyObject *ids, *num_obj;
  uint64_t num_blocks;
  int distinct_ids;
  if (!PyArg_ParseTupleAndKeywords(args, kwargs, "y*nOOp:check_job", const_cast<char**>(kwlist), &keys.view,
                                   &key_size, &ids, &num_obj, &distinct_ids)) {
    return nullptr;
  }
  keys.held = true;
  if (!parse_u64(num_obj, "num_blocks", &num_blocks)) return nullptr;  // ("K" would take -1 as 2**64-1)
  if (key_size < 1 || keys.view.len % key_size != 0) {
    PyErr_Format(PyExc_ValueError, "keys: %zd bytes are not keys of %zd bytes", keys.view.len, key_size);
    return nullptr;
  }
  std::vector<uint64_t> values;
  if (!parse_u64_array(ids, "block_ids", &values)) return nullptr;
  for (uint64_t v : values) {
    if (v >= num_blocks) {
      return PyUnicode_FromFormat("block id %llu is outside the registered cache (0..%lld)",
                                  static_cast<unsigned long long>(v), static_cast<long long>(num_blocks) - 1);
    }
  }
  // Duplicate keys: hashed by their first 8 bytes (keys are hashes), compared whole where those tie.
  const size_t n = static_cast<size_t>(keys.view.len / key_size);
  const char* packed = static_cast<const char*>(keys.view.buf);
  std::vector<uint64_t> prefixes(n);
  for (size_t i = 0; i < n; ++i) {
    std::memcpy(&prefixes[i], packed + i * key_size, std::min<size_t>(sizeof(uint64_t), key_size));
  }
  auto key = [&](size_t i) { return std::string_view(packed + i * key_size, static_cast<size_t>(key_size)); };
  if (has_duplicate(prefixes, [&](size_t a, size_t b) { return key(a) == key(b); })) {
    return PyUnicode_FromString("duplicate keys in one request");
  }
  if (distinct_ids) {
    if (has_duplicate(values, [](size_t, size_t) { return true; })) {
      return PyUnicode_FromString("duplicate block ids in one load: two blocks would land in the same place");
    }
  }
  return PyUnicode_FromString("");
}

// ---- Runs: a chunk's byte runs ------------------------------------------------------------------

// One run of a chunk: `size` bytes at offset `pool` of the pool and at address `engine`.
struct PlanRun {
  uint64_t pool, engine, size;
};

// The runs of `blocks` blocks, region-major (region r's run of block k is run r * blocks + k), each made
// by plan_transfer (checked against the pool and the engine's regions) or from arrays (Runs(...), for
// tests and the device checks).
struct RunsObject {
  PyObject_HEAD
  std::vector<PlanRun>* runs;  // (owned: Python allocates the object and runs no constructor)
  size_t blocks;
  uint64_t total_bytes;
};

extern PyTypeObject kRunsType;

PyObject* new_runs(std::vector<PlanRun>&& runs, size_t blocks) {
  auto* self = reinterpret_cast<RunsObject*>(kRunsType.tp_alloc(&kRunsType, 0));
  if (self == nullptr) return nullptr;
  self->runs = new (std::nothrow) std::vector<PlanRun>(std::move(runs));
  if (self->runs == nullptr) {
    Py_DECREF(self);
    return PyErr_NoMemory();
  }
  self->blocks = blocks;
  self->total_bytes = 0;
  for (const PlanRun& r : *self->runs) self->total_bytes += r.size;
  return reinterpret_cast<PyObject*>(self);
}

void runs_dealloc(PyObject* self) {
  delete reinterpret_cast<RunsObject*>(self)->runs;
  Py_TYPE(self)->tp_free(self);
}

// Runs(pool_offsets, engine_addresses, sizes, blocks=None): runs from arrays, `blocks` per region (None: one
// region, a block per run). Not bounds-checked: for tests and diagnostics; the daemon plans with plan_transfer.
PyObject* runs_new(PyTypeObject*, PyObject* args, PyObject* kwargs) {
  static const char* kwlist[] = {"pool_offsets", "engine_addresses", "sizes", "blocks", nullptr};
  PyObject *pool_obj, *engine_obj, *sizes_obj, *blocks_obj = Py_None;
  if (!PyArg_ParseTupleAndKeywords(args, kwargs, "OOO|O:Runs", const_cast<char**>(kwlist), &pool_obj, &engine_obj,
                                   &sizes_obj, &blocks_obj)) {
    return nullptr;
  }
  std::vector<uint64_t> pool, engine, sizes;
  uint64_t blocks = 0;
  if (!parse_u64_array(pool_obj, "pool_offsets", &pool) || !parse_u64_array(engine_obj, "engine_addresses", &engine) ||
      !parse_u64_array(sizes_obj, "sizes", &sizes) ||
      (blocks_obj != Py_None && !parse_u64(blocks_obj, "blocks", &blocks))) {
    return nullptr;
  }
  const size_t n = sizes.size();
  if (pool.size() != n || engine.size() != n) {
    PyErr_Format(PyExc_ValueError, "pool_offsets, engine_addresses and sizes must have the same length (got %zu, "
                 "%zu, %zu)", pool.size(), engine.size(), n);
    return nullptr;
  }
  if (blocks_obj == Py_None) blocks = n;
  if (blocks == 0 ? n != 0 : n % blocks != 0) {
    PyErr_Format(PyExc_ValueError, "%zu runs are not whole regions of %llu blocks", n,
                 static_cast<unsigned long long>(blocks));
    return nullptr;
  }
  std::vector<PlanRun> runs(n);
  for (size_t i = 0; i < n; ++i) runs[i] = PlanRun{pool[i], engine[i], sizes[i]};
  return new_runs(std::move(runs), static_cast<size_t>(blocks));
}

// runs.without(positions) -> Runs: the runs of every block but those at these positions (corrupt ones).
PyObject* runs_without(PyObject* self_obj, PyObject* positions_obj) {
  auto* self = reinterpret_cast<RunsObject*>(self_obj);
  std::vector<uint64_t> positions;
  if (!parse_u64_array(positions_obj, "positions", &positions)) return nullptr;
  std::vector<char> drop(self->blocks, 0);
  for (uint64_t k : positions) {
    if (k >= self->blocks) {
      PyErr_Format(PyExc_ValueError, "position %llu is not among %zu blocks", static_cast<unsigned long long>(k),
                   self->blocks);
      return nullptr;
    }
    drop[k] = 1;
  }
  const size_t kept = static_cast<size_t>(std::count(drop.begin(), drop.end(), 0));
  std::vector<PlanRun> runs;
  runs.reserve(self->blocks == 0 ? 0 : self->runs->size() / self->blocks * kept);
  for (size_t i = 0; i < self->runs->size(); ++i) {
    if (!drop[i % self->blocks]) runs.push_back((*self->runs)[i]);
  }
  return new_runs(std::move(runs), kept);
}

// runs.columns() -> bytes: the pool offsets, then the engine addresses, then the sizes (native uint64), for
// tests and diagnostics.
PyObject* runs_columns(PyObject* self_obj, PyObject*) {
  const std::vector<PlanRun>& runs = *reinterpret_cast<RunsObject*>(self_obj)->runs;
  std::vector<uint64_t> out(3 * runs.size());
  for (size_t i = 0; i < runs.size(); ++i) {
    out[i] = runs[i].pool;
    out[runs.size() + i] = runs[i].engine;
    out[2 * runs.size() + i] = runs[i].size;
  }
  return u64_bytes(out);
}

PyObject* runs_blocks(PyObject* self, void*) { return PyLong_FromSize_t(reinterpret_cast<RunsObject*>(self)->blocks); }

PyObject* runs_total_bytes(PyObject* self, void*) {
  return PyLong_FromUnsignedLongLong(reinterpret_cast<RunsObject*>(self)->total_bytes);
}

Py_ssize_t runs_len(PyObject* self) {
  return static_cast<Py_ssize_t>(reinterpret_cast<RunsObject*>(self)->runs->size());
}

PyMethodDef kRunsMethods[] = {
    {"without", runs_without, METH_O,
     "without(positions) -> Runs: the runs of every block but those at these positions (a uint64 buffer)."},
    {"columns", runs_columns, METH_NOARGS,
     "columns() -> bytes: the pool offsets, engine addresses and sizes, native uint64, one column after another."},
    {nullptr, nullptr, 0, nullptr},
};

PyGetSetDef kRunsGetSet[] = {
    {"blocks", runs_blocks, nullptr, "the blocks the runs are of (the runs are region-major, this many per region)",
     nullptr},
    {"total_bytes", runs_total_bytes, nullptr, "the bytes of every run", nullptr},
    {nullptr, nullptr, nullptr, nullptr, nullptr},
};

PySequenceMethods kRunsSequence = {runs_len};

PyTypeObject kRunsType = {
    PyVarObject_HEAD_INIT(nullptr, 0) "kvstore_service._native.Runs",  // tp_name
    sizeof(RunsObject),                                                // tp_basicsize
};

// ---- a chunk planned ----------------------------------------------------------------------------

// A region of the engine's layout as plan_transfer takes it: block b is `bytes` bytes at
// `start + b * stride`, inside the mapping [lo, hi).
struct PlanRegion {
  uint64_t start, stride, bytes, lo, hi;
};

// plan_transfer(slot_offsets, block_ids, regions, num_blocks, pool_size, shard_offset) -> Runs
// The byte runs of a chunk's blocks, region-major (region r's run of block k is run r * n + k): pool
// offset slot_offsets[k] + shard_offset + the bytes of the regions before r, engine address
// regions[r].start + block_ids[k] * regions[r].stride. Every run is checked against the pool and its
// mapping before it is returned (ValueError naming the block): nothing is copied past either.
PyObject* py_plan_transfer(PyObject*, PyObject* args, PyObject* kwargs) {
  static const char* kwlist[] = {"slot_offsets", "block_ids", "regions", "num_blocks", "pool_size",
                                 "shard_offset", nullptr};
  PyObject *slots_obj, *ids_obj, *regions_obj, *num_obj, *pool_obj, *shard_obj;
  if (!PyArg_ParseTupleAndKeywords(args, kwargs, "OOOOOO:plan_transfer", const_cast<char**>(kwlist), &slots_obj,
                                   &ids_obj, &regions_obj, &num_obj, &pool_obj, &shard_obj)) {
    return nullptr;
  }
  std::vector<uint64_t> slots, ids, flat;
  uint64_t num_blocks, pool_size, shard_offset;
  if (!parse_u64_array(slots_obj, "slot_offsets", &slots) || !parse_u64_array(ids_obj, "block_ids", &ids) ||
      !parse_u64_array(regions_obj, "regions", &flat) || !parse_u64(num_obj, "num_blocks", &num_blocks) ||
      !parse_u64(pool_obj, "pool_size", &pool_size) || !parse_u64(shard_obj, "shard_offset", &shard_offset)) {
    return nullptr;
  }
  if (slots.size() != ids.size()) {
    PyErr_Format(PyExc_ValueError, "%zu slot offsets but %zu block ids", slots.size(), ids.size());
    return nullptr;
  }
  if (flat.size() % 5 != 0) {
    PyErr_SetString(PyExc_ValueError, "regions must hold 5 values per region (start, stride, bytes, lo, hi)");
    return nullptr;
  }
  const size_t n = ids.size(), nregions = flat.size() / 5;
  std::vector<PlanRegion> regions(nregions);
  std::memcpy(regions.data(), flat.data(), flat.size() * sizeof(uint64_t));
  for (size_t k = 0; k < n; ++k) {
    if (ids[k] >= num_blocks) {
      PyErr_Format(PyExc_ValueError, "block id %llu is outside the registered cache (0..%llu)",
                   static_cast<unsigned long long>(ids[k]), static_cast<unsigned long long>(num_blocks - 1));
      return nullptr;
    }
  }
  std::vector<PlanRun> runs(n * nregions);
  uint64_t before = shard_offset;
  for (size_t r = 0; r < nregions; ++r) {
    const PlanRegion& g = regions[r];
    for (size_t k = 0; k < n; ++k) {
      uint64_t rel = 0, addr = 0, end = 0, pool_at = 0, pool_end = 0;
      bool bad_engine = __builtin_mul_overflow(ids[k], g.stride, &rel) ||
                        __builtin_add_overflow(g.start, rel, &addr) || __builtin_add_overflow(addr, g.bytes, &end) ||
                        addr < g.lo || end > g.hi;
      bool bad_pool = __builtin_add_overflow(slots[k], before, &pool_at) ||
                      __builtin_add_overflow(pool_at, g.bytes, &pool_end) || pool_end > pool_size;
      if (bad_engine || bad_pool) {
        PyErr_Format(PyExc_ValueError, "block %zu (id %llu), region %zu: its run lies outside %s", k,
                     static_cast<unsigned long long>(ids[k]), r,
                     bad_engine ? "the engine memory it was registered in" : "the pool");
        return nullptr;
      }
      runs[r * n + k] = PlanRun{pool_at, addr, g.bytes};
    }
    before += g.bytes;
  }
  return new_runs(std::move(runs), n);
}


PyMethodDef kPlanMethods[] = {
    {"check_job", KV_KW(py_check_job),
     "check_job(keys, key_size, block_ids, num_blocks, distinct_ids) -> str\n\n"
     "What is wrong with a job's keys (packed, key_size bytes each) and block ids (uint64 buffer): an id outside\n"
     "0..num_blocks-1, duplicate keys, duplicate ids (if distinct_ids); \"\" if nothing."},
    {"plan_transfer", KV_KW(py_plan_transfer),
     "plan_transfer(slot_offsets, block_ids, regions, num_blocks, pool_size, shard_offset) -> Runs\n\n"
     "The runs of a chunk's blocks, region-major. regions: 5 values per region (start, stride, bytes, lo, hi).\n"
     "Every run is bounds-checked against the pool and its mapping [lo, hi) (ValueError)."},
    {nullptr, nullptr, 0, nullptr},
};

}  // namespace

bool runs_of_plan(PyObject* plan, uint64_t pool_base, bool to_engine, std::vector<Run>* runs, size_t* blocks) {
  if (!PyObject_TypeCheck(plan, &kRunsType)) {
    PyErr_Format(PyExc_TypeError, "runs must be a Runs (native.plan_transfer's), not %.100s", Py_TYPE(plan)->tp_name);
    return false;
  }
  const auto* self = reinterpret_cast<const RunsObject*>(plan);
  runs->resize(self->runs->size());
  for (size_t i = 0; i < runs->size(); ++i) {
    const PlanRun& r = (*self->runs)[i];
    uint64_t pool_at, pool_end, engine_end;
    if (__builtin_add_overflow(pool_base, r.pool, &pool_at) || __builtin_add_overflow(pool_at, r.size, &pool_end) ||
        __builtin_add_overflow(r.engine, r.size, &engine_end) || pool_end > UINTPTR_MAX || engine_end > UINTPTR_MAX) {
      PyErr_Format(PyExc_OverflowError, "run %zu: base + offset + size overflows the address space", i);
      return false;
    }
    (*runs)[i] = to_engine ? Run{pool_at, r.engine, r.size} : Run{r.engine, pool_at, r.size};
  }
  *blocks = self->blocks;
  return true;
}

bool add_plan(PyObject* module) {
  kRunsType.tp_flags = Py_TPFLAGS_DEFAULT;
  kRunsType.tp_doc = "Runs(pool_offsets, engine_addresses, sizes, blocks=None): a chunk's byte runs, held natively.";
  kRunsType.tp_dealloc = runs_dealloc;
  kRunsType.tp_as_sequence = &kRunsSequence;
  kRunsType.tp_methods = kRunsMethods;
  kRunsType.tp_getset = kRunsGetSet;
  kRunsType.tp_new = runs_new;
  if (PyType_Ready(&kRunsType) < 0) return false;
  Py_INCREF(&kRunsType);
  if (PyModule_AddObject(module, "Runs", reinterpret_cast<PyObject*>(&kRunsType)) < 0) {
    Py_DECREF(&kRunsType);
    return false;
  }
  return PyModule_AddFunctions(module, kPlanMethods) == 0;
}

}  // namespace kvstore
