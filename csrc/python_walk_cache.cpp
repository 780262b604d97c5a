// fused_ema._C.walk_cache / walk_unchanged: an update's walk of the model without walking it.
// The cache remembers every module's dicts by address and dict version (CPython's ma_version_tag:
// globally unique, and new at every change of a dict), so an unchanged model is confirmed by a
// few integer compares per module and one signature compare per tensor; any change sends the
// update back to the full walk (python_walk.cpp) and its check (python_walk_check.cpp).
#include <Python.h>
#include <torch/csrc/Exceptions.h>
#include <torch/csrc/autograd/python_variable.h>

#include <algorithm>
#include <cstdint>
#include <memory>
#include <unordered_set>
#include <vector>

#include "lerp_plan.h"
#include "walk_item.h"

namespace fused_ema {

// Dict versions are read from the dict object; Python 3.12 deprecates the field (dict watchers
// replace it), so there the cache is never made and every update takes the full walk.
#if PY_VERSION_HEX < 0x030C0000
#define FUSED_EMA_WALK_CACHE 1
#else
#define FUSED_EMA_WALK_CACHE 0
#endif

#if FUSED_EMA_WALK_CACHE
namespace {

constexpr const char* kCapsule = "fused_ema.WalkCache";

PyObject* g_parameters = nullptr;
PyObject* g_buffers = nullptr;
PyObject* g_non_persistent = nullptr;
PyObject* g_modules = nullptr;

bool intern_names() {
  if (g_modules == nullptr) {
    g_parameters = PyUnicode_InternFromString("_parameters");
    g_buffers = PyUnicode_InternFromString("_buffers");
    g_non_persistent = PyUnicode_InternFromString("_non_persistent_buffers_set");
    g_modules = PyUnicode_InternFromString("_modules");
  }
  return g_parameters != nullptr && g_buffers != nullptr && g_non_persistent != nullptr &&
         g_modules != nullptr;
}

uint64_t version(PyObject* dict) { return reinterpret_cast<PyDictObject*>(dict)->ma_version_tag; }

// A module as the walk read it. The cache holds no references: a pointer is dereferenced only
// once the dict that holds its object has been found unchanged (the root is the caller's model).
struct CachedModule {
  PyObject* module = nullptr;
  PyObject* dict = nullptr;  // the instance __dict__
  uint64_t dict_version = 0;
  PyObject* params = nullptr;
  uint64_t params_version = 0;
  PyObject* children = nullptr;
  uint64_t children_version = 0;
  PyObject* buffers = nullptr;  // with buffers only
  uint64_t buffers_version = 0;
  PyObject* skip = nullptr;  // _non_persistent_buffers_set, when there are buffers
  size_t first_flag = 0;     // its buffers' "non-persistent" flags in WalkCache::skipped
  bool any_skipped = false;
};

// The instance dict entry `name`, borrowed; nullptr (no error set) when absent or not a dict.
PyObject* entry(PyObject* dict, PyObject* name) {
  PyObject* value = PyDict_GetItemWithError(dict, name);
  if (value == nullptr) {
    PyErr_Clear();
  }
  return value;
}

PyObject* instance_dict(PyObject* module) {
  PyObject** slot = _PyObject_GetDictPtr(module);
  PyObject* dict = slot != nullptr ? *slot : nullptr;
  return dict != nullptr && PyDict_CheckExact(dict) ? dict : nullptr;
}

class WalkCache {
 public:
  explicit WalkCache(bool with_buffers) : with_buffers_(with_buffers) {}

  // Walks `model` as tensor_walk does, remembering what it read; false (no error set) where a
  // module's dicts are not the plain kinds whose reads run no Python code.
  bool build(PyObject* model) {
    std::vector<PyObject*> stack{model};
    std::unordered_set<PyObject*> seen;
    while (!stack.empty()) {
      PyObject* module = stack.back();
      stack.pop_back();
      if (!seen.insert(module).second) {
        continue;
      }
      CachedModule m;
      m.module = module;
      if (!read(m) || !remember_items(m)) {
        return false;
      }
      modules_.push_back(m);
      const size_t first_child = stack.size();
      Py_ssize_t pos = 0;
      PyObject* key = nullptr;
      PyObject* child = nullptr;
      while (PyDict_Next(m.children, &pos, &key, &child)) {
        if (child != Py_None) {
          stack.push_back(child);
        }
      }
      std::reverse(stack.begin() + static_cast<std::ptrdiff_t>(first_child), stack.end());
    }
    return true;
  }

  // Whether the cache describes `walk` item for item; then records its signature.
  bool same_items(PyObject* walk) {
    if (static_cast<size_t>(PyList_GET_SIZE(walk)) != items_.size()) {
      return false;
    }
    for (size_t k = 0; k < items_.size(); ++k) {
      if (PyList_GET_ITEM(walk, static_cast<Py_ssize_t>(k)) != items_[k]) {
        return false;
      }
      ItemHeader header;
      c10::IntArrayRef sizes;
      if (!describe_item(items_[k], header, sizes)) {
        PyErr_Clear();
        return false;
      }
      const char* h = reinterpret_cast<const char*>(&header);
      const char* s = reinterpret_cast<const char*>(sizes.data());
      signature_.insert(signature_.end(), h, h + sizeof(header));
      signature_.insert(signature_.end(), s, s + sizes.size() * sizeof(int64_t));
    }
    return true;
  }

  // Fills `out` (a new list of items() slots) with the walk of `model` if nothing the walk reads
  // changed since build() and every item keeps its signature. False otherwise, with an error set
  // only for a failure of Python itself.
  bool unchanged(PyObject* model, PyObject* out) {
    if (modules_.empty() || model != modules_[0].module) {
      return false;
    }
    const size_t count = modules_.size();
    for (size_t i = 0; i < count; ++i) {
      prefetch_module(i);
      if (!module_unchanged(modules_[i])) {
        return false;
      }
    }
    return items_unchanged(out);
  }

  size_t items() const { return items_.size(); }

 private:
  static constexpr size_t kAhead = 8;

  bool read(CachedModule& m) const {
    m.dict = instance_dict(m.module);
    if (m.dict == nullptr) {
      return false;
    }
    m.dict_version = version(m.dict);
    m.params = entry(m.dict, g_parameters);
    m.children = entry(m.dict, g_modules);
    if (m.params == nullptr || m.children == nullptr || !PyDict_CheckExact(m.params) ||
        !PyDict_CheckExact(m.children)) {
      return false;
    }
    m.params_version = version(m.params);
    m.children_version = version(m.children);
    if (with_buffers_) {
      m.buffers = entry(m.dict, g_buffers);
      m.skip = entry(m.dict, g_non_persistent);
      if (m.buffers == nullptr || m.skip == nullptr || !PyDict_CheckExact(m.buffers)) {
        return false;
      }
      m.buffers_version = version(m.buffers);
    }
    return true;
  }

  bool remember_items(CachedModule& m) {
    Py_ssize_t pos = 0;
    PyObject* key = nullptr;
    PyObject* value = nullptr;
    while (PyDict_Next(m.params, &pos, &key, &value)) {
      items_.push_back(value);
    }
    if (!with_buffers_ || PyDict_GET_SIZE(m.buffers) == 0) {
      return true;
    }
    // Membership tests in an exact set of exact str keys run no Python code.
    if (!PyAnySet_CheckExact(m.skip)) {
      return false;
    }
    m.first_flag = skipped_.size();
    pos = 0;
    while (PyDict_Next(m.buffers, &pos, &key, &value)) {
      if (!PyUnicode_CheckExact(key)) {
        return false;
      }
      const int skipped = PySet_GET_SIZE(m.skip) > 0 ? PySet_Contains(m.skip, key) : 0;
      if (skipped < 0) {
        PyErr_Clear();
        return false;
      }
      skipped_.push_back(static_cast<char>(skipped));
      m.any_skipped |= skipped != 0;
      if (skipped == 0) {
        items_.push_back(value);
      }
    }
    return true;
  }

  void prefetch_module(size_t i) const {
    if (i + 2 * kAhead < modules_.size()) {
      // Python 3.11 keeps an object's managed __dict__ pointer just before its header.
      __builtin_prefetch(reinterpret_cast<const char*>(modules_[i + 2 * kAhead].module) - 32);
    }
    if (i + kAhead < modules_.size()) {
      const CachedModule& m = modules_[i + kAhead];  // its addresses as cached: only prefetched
      __builtin_prefetch(m.dict);
      __builtin_prefetch(m.params);
      __builtin_prefetch(m.children);
      __builtin_prefetch(m.buffers);
    }
  }

  bool module_unchanged(CachedModule& m) const {
    PyObject* dict = instance_dict(m.module);
    if (dict == nullptr) {
      return false;
    }
    if (dict != m.dict || version(dict) != m.dict_version) {
      // An attribute was set (say `training`): the walk's entries may still be the same objects.
      if (entry(dict, g_parameters) != m.params || entry(dict, g_modules) != m.children ||
          (with_buffers_ &&
           (entry(dict, g_buffers) != m.buffers || entry(dict, g_non_persistent) != m.skip))) {
        return false;
      }
      m.dict = dict;
      m.dict_version = version(dict);
    }
    if (version(m.params) != m.params_version || version(m.children) != m.children_version) {
      return false;
    }
    if (!with_buffers_) {
      return true;
    }
    if (version(m.buffers) != m.buffers_version) {
      return false;
    }
    if (PyDict_GET_SIZE(m.buffers) == 0 || (PySet_GET_SIZE(m.skip) == 0 && !m.any_skipped)) {
      return true;
    }
    // Sets have no version: the membership of each buffer name is tested again.
    const char* flags = skipped_.data() + m.first_flag;
    Py_ssize_t pos = 0;
    PyObject* key = nullptr;
    PyObject* value = nullptr;
    for (size_t j = 0; PyDict_Next(m.buffers, &pos, &key, &value); ++j) {
      const int skipped = PySet_GET_SIZE(m.skip) > 0 ? PySet_Contains(m.skip, key) : 0;
      if (skipped != flags[j]) {
        PyErr_Clear();
        return false;
      }
    }
    return true;
  }

  bool items_unchanged(PyObject* out) const {
    const char* cursor = signature_.data();
    const char* const end = cursor + signature_.size();
    const size_t count = items_.size();
    for (size_t k = 0; k < count; ++k) {
      if (k + 2 * kAhead < count) {
        __builtin_prefetch(items_[k + 2 * kAhead]);
      }
      if (k + kAhead < count && items_[k + kAhead] != Py_None &&
          THPVariable_Check(items_[k + kAhead])) {
        prefetch_tensor_impl(THPVariable_Unpack(items_[k + kAhead]).unsafeGetTensorImpl());
      }
      PyObject* item = items_[k];
      Py_INCREF(item);
      PyList_SET_ITEM(out, static_cast<Py_ssize_t>(k), item);
      bool error = false;
      if (!item_matches(item, cursor, end, error)) {
        return false;
      }
    }
    return cursor == end;
  }

  const bool with_buffers_;
  std::vector<CachedModule> modules_;  // in walk order: a parent before its children
  std::vector<PyObject*> items_;       // the walk
  std::vector<char> skipped_;
  std::vector<char> signature_;  // walk_signature(walk)
};

void destroy(PyObject* capsule) {
  delete static_cast<WalkCache*>(PyCapsule_GetPointer(capsule, kCapsule));
}

// Runs `fn` with the cyclic collector off: reading a module's __dict__ may materialise it, and
// a collection then could run finalizers that change the model half-way through.
template <typename Fn>
auto without_gc(Fn&& fn) {
  const int gc_was_enabled = PyGC_Disable();
  auto result = fn();
  if (gc_was_enabled) {
    PyGC_Enable();
  }
  return result;
}

}  // namespace
#endif

PyObject* python_walk_cache(PyObject* /*module*/, PyObject* const* args, Py_ssize_t nargs) {
  HANDLE_TH_ERRORS
  if (nargs != 3 || !PyList_Check(args[2])) {
    PyErr_SetString(PyExc_TypeError, "walk_cache(model, with_buffers: bool, walk: list)");
    return nullptr;
  }
  const int with_buffers = PyObject_IsTrue(args[1]);
  if (with_buffers < 0) {
    return nullptr;
  }
#if FUSED_EMA_WALK_CACHE
  if (!intern_names()) {
    return nullptr;
  }
  auto cache = std::make_unique<WalkCache>(with_buffers != 0);
  const bool ok = without_gc([&] { return cache->build(args[0]) && cache->same_items(args[2]); });
  if (ok) {
    PyObject* capsule = PyCapsule_New(cache.get(), kCapsule, destroy);
    if (capsule != nullptr) {
      cache.release();
    }
    return capsule;
  }
#endif
  Py_RETURN_NONE;
  END_HANDLE_TH_ERRORS
}

PyObject* python_walk_unchanged(PyObject* /*module*/, PyObject* const* args, Py_ssize_t nargs) {
  HANDLE_TH_ERRORS
  if (nargs != 2) {
    PyErr_SetString(PyExc_TypeError, "walk_unchanged(cache, model)");
    return nullptr;
  }
#if FUSED_EMA_WALK_CACHE
  auto* cache = static_cast<WalkCache*>(PyCapsule_GetPointer(args[0], kCapsule));
  if (cache == nullptr) {
    return nullptr;
  }
  // The list comes first: nothing allocates once the model has been found unchanged.
  PyObject* out = PyList_New(static_cast<Py_ssize_t>(cache->items()));
  if (out == nullptr) {
    return nullptr;
  }
  if (without_gc([&] { return cache->unchanged(args[1], out); })) {
    return out;
  }
  Py_DECREF(out);
  if (PyErr_Occurred()) {
    return nullptr;
  }
  Py_RETURN_NONE;
#else
  PyErr_SetString(PyExc_RuntimeError, "walk_unchanged: no walk cache on this Python");
  return nullptr;
#endif
  END_HANDLE_TH_ERRORS
}

}  // namespace fused_ema
