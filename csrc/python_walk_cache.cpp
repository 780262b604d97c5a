// fused_ema._C.walk_cache / walk_unchanged: an update's walk of the model without walking it.
// The cache records what the walk (module_walk.h) read and watches every dict it read with
// CPython's dict watchers (3.12+), so that one flag confirms the model holds the same objects.
// Older Pythons have no watchers: there is no cache and every update takes the full walk and its
// check (python_walk.cpp).
#include <Python.h>

#include <algorithm>
#include <memory>
#include <unordered_map>
#include <vector>

#include "module_walk.h"

namespace fused_ema {

#if PY_VERSION_HEX >= 0x030C0000
#define FUSED_EMA_WALK_CACHE 1
#else
#define FUSED_EMA_WALK_CACHE 0
#endif

#if FUSED_EMA_WALK_CACHE
namespace {

constexpr const char* kCapsule = "fused_ema.WalkCache";

class WalkCache;

// Which caches read each watched dict. One watcher for the process; a dict stays watched while
// some cache reads it. Touched with the GIL held only (the callback runs with it).
class DictWatch {
 public:
  static DictWatch& get() {
    static DictWatch watch;
    return watch;
  }

  // False with an error set if the watcher cannot be had.
  bool watch(PyObject* dict, bool instance_dict, WalkCache* reader) {
    if (id_ < 0 && (id_ = PyDict_AddWatcher(&DictWatch::on_event)) < 0) {
      return false;
    }
    Readers& readers = readers_[dict];
    if (readers.caches.empty() && PyDict_Watch(id_, dict) < 0) {
      readers_.erase(dict);
      return false;
    }
    readers.instance_dict = instance_dict;
    readers.caches.push_back(reader);
    return true;
  }

  void unwatch(PyObject* dict, WalkCache* reader) {
    const auto found = readers_.find(dict);
    if (found == readers_.end()) {
      return;  // deallocated since (or read under another cache's name)
    }
    std::vector<WalkCache*>& caches = found->second.caches;
    caches.erase(std::remove(caches.begin(), caches.end(), reader), caches.end());
    if (caches.empty()) {
      readers_.erase(found);
      if (PyDict_Unwatch(id_, dict) < 0) {
        PyErr_Clear();
      }
    }
  }

 private:
  struct Readers {
    bool instance_dict = false;  // a module's __dict__: only the walk's four keys matter
    std::vector<WalkCache*> caches;
  };

  static int on_event(PyDict_WatchEvent event, PyObject* dict, PyObject* key, PyObject*);
  static bool walk_key(PyObject* key);

  int id_ = -1;
  std::unordered_map<PyObject*, Readers> readers_;
};

class WalkCache {
 public:
  explicit WalkCache(bool with_buffers) : with_buffers_(with_buffers) {}
  WalkCache(const WalkCache&) = delete;
  WalkCache& operator=(const WalkCache&) = delete;
  ~WalkCache() {
    for (PyObject* dict : watched_) {
      DictWatch::get().unwatch(dict, this);
    }
  }

  // The walk's visitor: remembers every dict it reads and every item. Stops (no error set) at a
  // module whose reads could run Python code, which a cache could not repeat without walking.
  bool module(PyObject* module, const ModuleDicts& d, size_t /*tag*/) {
    if (root_ == nullptr) {
      root_ = module;  // the walk's first module
    }
    PyObject* buffers = d.buffers.get();
    if (!PyDict_CheckExact(d.dict.get()) || !PyDict_CheckExact(d.parameters.get()) ||
        !PyDict_CheckExact(d.children.get()) || (with_buffers_ && !PyDict_CheckExact(buffers))) {
      return false;
    }
    read(d.dict.get(), true);
    read(d.parameters.get(), false);
    read(d.children.get(), false);
    if (!with_buffers_) {
      return true;
    }
    read(buffers, false);
    return PyDict_GET_SIZE(buffers) == 0 || remember_persistence(buffers, d.skip.get());
  }
  bool item(PyObject* /*name*/, PyObject* value, bool /*is_param*/) {
    items_.push_back(value);
    return true;
  }
  bool child(PyObject* /*name*/, PyObject* /*child*/, size_t& /*tag*/) { return true; }

  // Whether the recorded walk is `walk` item for item; then starts watching the dicts read.
  // False (no error set) where the cache cannot be used.
  bool finish(PyObject* walk) {
    if (static_cast<size_t>(PyList_GET_SIZE(walk)) != items_.size()) {
      return false;
    }
    for (size_t k = 0; k < items_.size(); ++k) {
      if (PyList_GET_ITEM(walk, static_cast<Py_ssize_t>(k)) != items_[k]) {
        return false;
      }
    }
    for (const ReadDict& read : read_) {
      if (!DictWatch::get().watch(read.dict.get(), read.instance_dict, this)) {
        PyErr_Clear();
        return false;
      }
      watched_.push_back(read.dict.get());
    }
    read_.clear();  // watched from now on: a change or deallocation invalidates the cache
    read_.shrink_to_fit();
    return true;
  }

  void invalidate() { changed_ = true; }

  const std::vector<PyObject*>& items() const { return items_; }

  // Whether no dict the walk read has changed and no buffer changed its persistence: then `model`
  // holds the same tensor objects under the same names (their metadata is the caller's to check).
  bool fresh(PyObject* model) const {
    if (changed_ || model != root_) {
      return false;
    }
    for (const Persistence& p : persistence_) {
      if (!same_persistence(p)) {
        return false;
      }
    }
    return true;
  }

 private:
  // A module's buffers and which of them its _non_persistent_buffers_set names (sets have no
  // watchers: membership is tested again at every check).
  struct Persistence {
    PyObject* buffers;
    PyObject* skip;
    size_t first_flag;
    bool any_skipped;
  };

  // A dict the walk read, held until it is watched.
  struct ReadDict {
    OwnedRef dict;
    bool instance_dict;
  };

  void read(PyObject* dict, bool instance_dict) {
    read_.push_back({OwnedRef(dict), instance_dict});
  }

  bool remember_persistence(PyObject* buffers, PyObject* skip) {
    // Membership tests in an exact set of exact str keys run no Python code.
    if (!PyAnySet_CheckExact(skip)) {
      return false;
    }
    const size_t first = flags_.size();
    Py_ssize_t pos = 0;
    PyObject* key = nullptr;
    PyObject* value = nullptr;
    bool any = false;
    while (PyDict_Next(buffers, &pos, &key, &value)) {
      if (!PyUnicode_CheckExact(key)) {
        return false;
      }
      const int skipped = PySet_Contains(skip, key);
      if (skipped < 0) {
        PyErr_Clear();
        return false;
      }
      flags_.push_back(static_cast<char>(skipped));
      any |= skipped != 0;
    }
    persistence_.push_back({buffers, skip, first, any});
    return true;
  }

  bool same_persistence(const Persistence& p) const {
    if (PySet_GET_SIZE(p.skip) == 0 && !p.any_skipped) {
      return true;
    }
    const char* flags = flags_.data() + p.first_flag;
    Py_ssize_t pos = 0;
    PyObject* key = nullptr;
    PyObject* value = nullptr;
    for (size_t j = 0; PyDict_Next(p.buffers, &pos, &key, &value); ++j) {
      const int skipped = PySet_GET_SIZE(p.skip) > 0 ? PySet_Contains(p.skip, key) : 0;
      if (skipped != flags[j]) {
        PyErr_Clear();
        return false;
      }
    }
    return true;
  }

  const bool with_buffers_;
  bool changed_ = false;
  PyObject* root_ = nullptr;  // compared by address only
  std::vector<ReadDict> read_;
  std::vector<PyObject*> watched_;
  std::vector<Persistence> persistence_;
  std::vector<char> flags_;
  std::vector<PyObject*> items_;  // the walk
};

bool DictWatch::walk_key(PyObject* key) {
  const WalkNames* n = WalkNames::get();
  if (n == nullptr) {
    PyErr_Clear();
    return true;
  }
  for (PyObject* name : {n->parameters, n->buffers, n->non_persistent, n->modules}) {
    if (key == name || (PyUnicode_Check(key) && PyUnicode_Compare(key, name) == 0)) {
      return true;
    }
  }
  return false;
}

int DictWatch::on_event(PyDict_WatchEvent event, PyObject* dict, PyObject* key, PyObject*) {
  DictWatch& self = get();
  const auto found = self.readers_.find(dict);
  if (found == self.readers_.end()) {
    return 0;
  }
  if (found->second.instance_dict && key != nullptr && !walk_key(key)) {
    return 0;  // another attribute (say `training`)
  }
  for (WalkCache* cache : found->second.caches) {
    cache->invalidate();
  }
  if (event == PyDict_EVENT_DEALLOCATED) {
    self.readers_.erase(found);
  }
  return 0;
}

void destroy(PyObject* capsule) {
  delete static_cast<WalkCache*>(PyCapsule_GetPointer(capsule, kCapsule));
}

}  // namespace
#endif

PyObject* python_walk_cache(PyObject* /*module*/, PyObject* const* args, Py_ssize_t nargs) {
  return python_entry([&]() -> PyObject* {
    if (nargs != 3 || !PyList_Check(args[2])) {
      PyErr_SetString(PyExc_TypeError, "walk_cache(model, with_buffers: bool, walk: list)");
      return nullptr;
    }
    const int with_buffers = PyObject_IsTrue(args[1]);
    if (with_buffers < 0) {
      return nullptr;
    }
#if FUSED_EMA_WALK_CACHE
    auto cache = std::make_unique<WalkCache>(with_buffers != 0);
    if (walk_modules(args[0], with_buffers != 0, *cache) && cache->finish(args[2])) {
      PyObject* capsule = PyCapsule_New(cache.get(), kCapsule, destroy);
      if (capsule != nullptr) {
        cache.release();
      }
      return capsule;
    }
    if (PyErr_Occurred()) {
      return nullptr;
    }
#endif
    Py_RETURN_NONE;
  });
}

bool walk_cache_fresh(PyObject* cache, PyObject* model) {
#if FUSED_EMA_WALK_CACHE
  const auto* walk = static_cast<WalkCache*>(PyCapsule_GetPointer(cache, kCapsule));
  return walk != nullptr && walk->fresh(model);
#else
  PyErr_SetString(PyExc_RuntimeError, "walk_cache_fresh: no walk cache on this Python (3.12+)");
  return false;
#endif
}

PyObject* python_walk_unchanged(PyObject* /*module*/, PyObject* const* args, Py_ssize_t nargs) {
  if (nargs != 2) {
    PyErr_SetString(PyExc_TypeError, "walk_unchanged(cache, model)");
    return nullptr;
  }
#if FUSED_EMA_WALK_CACHE
  auto* cache = static_cast<WalkCache*>(PyCapsule_GetPointer(args[0], kCapsule));
  if (cache == nullptr) {
    return nullptr;
  }
  // The list comes first: nothing allocates (so no collection runs) while the cache is read.
  const std::vector<PyObject*>& items = cache->items();
  PyObject* out = PyList_New(static_cast<Py_ssize_t>(items.size()));
  if (out == nullptr) {
    return nullptr;
  }
  if (!cache->fresh(args[1])) {
    Py_DECREF(out);
    Py_RETURN_NONE;
  }
  for (size_t k = 0; k < items.size(); ++k) {
    PyList_SET_ITEM(out, static_cast<Py_ssize_t>(k), Py_NewRef(items[k]));
  }
  return out;
#else
  PyErr_SetString(PyExc_RuntimeError, "walk_unchanged: no walk cache on this Python (3.12+)");
  return nullptr;
#endif
}

}  // namespace fused_ema
