// fused_ema._C.tensor_walk: the model's tensors in a fixed order, read straight from the module
// instance dicts (no nn.Module attribute lookup), with a hash of every name on the way. What an
// update compares with its plan's walk (python_walk_check.cpp) at every step.
#include <Python.h>
#include <torch/csrc/Exceptions.h>
#include <torch/csrc/utils/object_ptr.h>

#include <algorithm>
#include <cstdint>
#include <vector>

namespace fused_ema {
namespace {
PyObject* g_parameters = nullptr;
PyObject* g_buffers = nullptr;
PyObject* g_non_persistent = nullptr;
PyObject* g_modules = nullptr;

bool intern_names() {
  if (g_modules != nullptr) {
    return true;
  }
  g_parameters = PyUnicode_InternFromString("_parameters");
  g_buffers = PyUnicode_InternFromString("_buffers");
  g_non_persistent = PyUnicode_InternFromString("_non_persistent_buffers_set");
  g_modules = PyUnicode_InternFromString("_modules");
  return g_parameters != nullptr && g_buffers != nullptr && g_non_persistent != nullptr &&
         g_modules != nullptr;
}

// Open-addressing set of object addresses: the modules already visited.
class PointerSet {
 public:
  PointerSet() : slots_(64, nullptr) {}

  // False if `p` was already in the set.
  bool insert(PyObject* p) {
    if (2 * (size_ + 1) > slots_.size()) {
      grow();
    }
    const size_t mask = slots_.size() - 1;
    for (size_t i = hash(p) & mask;; i = (i + 1) & mask) {
      if (slots_[i] == p) {
        return false;
      }
      if (slots_[i] == nullptr) {
        slots_[i] = p;
        ++size_;
        return true;
      }
    }
  }

 private:
  static size_t hash(PyObject* p) {
    return static_cast<size_t>((reinterpret_cast<uintptr_t>(p) >> 4) * 0x9E3779B97F4A7C15ull >> 16);
  }

  void grow() {
    std::vector<PyObject*> old(slots_.size() * 2, nullptr);
    old.swap(slots_);
    size_ = 0;
    for (PyObject* p : old) {
      if (p != nullptr) {
        insert(p);
      }
    }
  }

  std::vector<PyObject*> slots_;
  size_t size_ = 0;
};

// A module's four __dict__ entries the walk reads, borrowed.
struct ModuleDicts {
  PyObject* parameters = nullptr;
  PyObject* buffers = nullptr;
  PyObject* skip = nullptr;  // _non_persistent_buffers_set
  PyObject* children = nullptr;

  void hold() const {
    for (PyObject* obj : {parameters, buffers, skip, children}) {
      Py_XINCREF(obj);
    }
  }
  void release() const {
    for (PyObject* obj : {parameters, buffers, skip, children}) {
      Py_XDECREF(obj);
    }
  }
};

PyObject* dict_entry(PyObject* instance_dict, PyObject* module, PyObject* name) {
  PyObject* value = PyDict_GetItemWithError(instance_dict, name);
  if (value == nullptr && !PyErr_Occurred()) {
    PyErr_Format(PyExc_TypeError,
                 "tensor_walk: a %.200s in the module tree has no %U in its __dict__ "
                 "(only torch.nn.Module trees can be walked)",
                 Py_TYPE(module)->tp_name, name);
  }
  return value;
}

bool read_dicts(PyObject* module, bool with_buffers, ModuleDicts& out) {
  PyObject* dict = PyObject_GenericGetDict(module, nullptr);
  if (dict == nullptr) {
    PyErr_Clear();
    PyErr_Format(PyExc_TypeError,
                 "tensor_walk: a %.200s in the module tree has no __dict__ "
                 "(only torch.nn.Module trees can be walked)",
                 Py_TYPE(module)->tp_name);
    return false;
  }
  Py_DECREF(dict);  // the module keeps it alive; the safe walk holds what it reads from it
  out.parameters = dict_entry(dict, module, g_parameters);
  out.children = out.parameters ? dict_entry(dict, module, g_modules) : nullptr;
  if (with_buffers && out.children != nullptr) {
    out.buffers = dict_entry(dict, module, g_buffers);
    out.skip = out.buffers ? dict_entry(dict, module, g_non_persistent) : nullptr;
  }
  if (out.children == nullptr || (with_buffers && out.skip == nullptr)) {
    return false;
  }
  __builtin_prefetch(out.parameters);  // all three are read next: let their misses overlap
  __builtin_prefetch(out.children);
  __builtin_prefetch(out.buffers);
  return true;
}

// Whether reading the module's dicts and set can run no Python code: exact dicts, an exact set,
// string buffer names (the set's membership test hashes and compares them).
bool python_free(const ModuleDicts& d, bool with_buffers) {
  if (!PyDict_CheckExact(d.parameters) || !PyDict_CheckExact(d.children)) {
    return false;
  }
  if (!with_buffers) {
    return true;
  }
  if (!PyDict_CheckExact(d.buffers)) {
    return false;
  }
  if (PyDict_GET_SIZE(d.buffers) == 0) {
    return true;
  }
  if (!PyAnySet_CheckExact(d.skip)) {
    return false;
  }
  if (PySet_GET_SIZE(d.skip) > 0) {
    Py_ssize_t pos = 0;
    PyObject* name = nullptr;
    PyObject* value = nullptr;
    while (PyDict_Next(d.buffers, &pos, &name, &value)) {
      if (!PyUnicode_CheckExact(name)) {
        return false;
      }
    }
  }
  return true;
}

// Calls visit(key, value) for every item of an exact dict (insertion order), or of another
// mapping through its items(), which may run Python code; false on error.
template <typename Visit>
bool for_each_item(PyObject* mapping, Visit&& visit) {
  if (PyDict_CheckExact(mapping)) {
    if (PyDict_GET_SIZE(mapping) == 0) {
      return true;
    }
    Py_ssize_t pos = 0;
    PyObject* key = nullptr;
    PyObject* value = nullptr;
    while (PyDict_Next(mapping, &pos, &key, &value)) {
      if (!visit(key, value)) {
        return false;
      }
    }
    return true;
  }
  THPObjectPtr items(PyMapping_Items(mapping));
  if (!items) {
    return false;
  }
  const Py_ssize_t n = PyList_GET_SIZE(items.get());
  for (Py_ssize_t i = 0; i < n; ++i) {
    PyObject* pair = PyList_GET_ITEM(items.get(), i);
    if (!PyTuple_Check(pair) || PyTuple_GET_SIZE(pair) != 2) {
      PyErr_SetString(PyExc_TypeError, "tensor_walk: items() did not give (key, value) pairs");
      return false;
    }
    if (!visit(PyTuple_GET_ITEM(pair, 0), PyTuple_GET_ITEM(pair, 1))) {
      return false;
    }
  }
  return true;
}

enum class Outcome { kDone, kError, kNeedsSafeWalk };

// The walk proper. Items are always owned references. The fast walk (Safe = false) holds no
// references to modules, dicts or sets, which is sound only while no Python code runs: it gives
// up, for the safe walk to start over, at the first module that could run some.
template <bool Safe>
class Walk {
 public:
  explicit Walk(bool with_buffers) : with_buffers_(with_buffers) { items.reserve(256); }

  ~Walk() {
    release(items);
    if (Safe) {
      release(stack_);
      release(held_);
    }
  }

  Outcome run(PyObject* model) {
    push_module(model);
    while (!stack_.empty()) {
      PyObject* module = stack_.back();
      stack_.pop_back();
      if (Safe) {
        held_.push_back(module);  // keeps its address its own until the walk ends
      }
      if (!seen_.insert(module)) {
        continue;
      }
      const Outcome outcome = visit(module);
      if (outcome != Outcome::kDone) {
        return outcome;
      }
    }
    return Outcome::kDone;
  }

  // Hands the items over to a new list.
  PyObject* to_list() {
    PyObject* list = PyList_New(static_cast<Py_ssize_t>(items.size()));
    if (list != nullptr) {
      for (size_t i = 0; i < items.size(); ++i) {
        PyList_SET_ITEM(list, static_cast<Py_ssize_t>(i), items[i]);
      }
      items.clear();
    }
    return list;
  }

  std::vector<PyObject*> items;
  // Folds in every parameter, buffer and child name in walk order: renaming a module, which
  // leaves the tensors and their order as they were, still changes it.
  uint64_t names_hash = 0xcbf29ce484222325ull;

 private:
  bool mix(PyObject* key) {
    if (!Safe && !PyUnicode_CheckExact(key)) {
      needs_safe_ = true;  // hashing it could run Python code
      return false;
    }
    const Py_hash_t h = PyObject_Hash(key);  // cached for str
    if (h == -1) {
      return false;
    }
    names_hash = (names_hash ^ static_cast<uint64_t>(h)) * 0x100000001b3ull;
    return true;
  }

  Outcome failed() const { return needs_safe_ ? Outcome::kNeedsSafeWalk : Outcome::kError; }

  static void release(std::vector<PyObject*>& refs) {
    for (PyObject* ref : refs) {
      Py_XDECREF(ref);
    }
    refs.clear();
  }

  void push_item(PyObject* item) {
    Py_INCREF(item);
    items.push_back(item);
  }

  void push_module(PyObject* module) {
    if (Safe) {
      Py_INCREF(module);
    }
    __builtin_prefetch(reinterpret_cast<char*>(module) - 32);  // its header and __dict__ slot
    stack_.push_back(module);
  }

  Outcome visit(PyObject* module) {
    ModuleDicts d;
    if (!read_dicts(module, with_buffers_, d)) {
      return Outcome::kError;
    }
    if (!Safe && !python_free(d, with_buffers_)) {
      return Outcome::kNeedsSafeWalk;
    }
    if (Safe) {
      d.hold();
    }
    const Outcome outcome = read_items(d);
    if (Safe) {
      d.release();
    }
    return outcome;
  }

  Outcome read_items(const ModuleDicts& d) {
    names_hash = (names_hash + 1) * 0x100000001b3ull;  // a module boundary
    if (!for_each_item(d.parameters, [&](PyObject* name, PyObject* value) {
          push_item(value);
          return mix(name);
        })) {
      return failed();
    }
    if (with_buffers_ && (!PyDict_CheckExact(d.buffers) || PyDict_GET_SIZE(d.buffers) > 0)) {
      const bool skip_any = !PyAnySet_Check(d.skip) || PySet_GET_SIZE(d.skip) > 0;
      if (!for_each_item(d.buffers, [&](PyObject* name, PyObject* value) {
            const int skipped = skip_any ? PySequence_Contains(d.skip, name) : 0;
            if (skipped == 0) {
              push_item(value);
              return mix(name);
            }
            return skipped >= 0;
          })) {
        return failed();
      }
    }
    const size_t first_child = stack_.size();
    if (!for_each_item(d.children, [&](PyObject* name, PyObject* child) {
          if (child != Py_None) {
            push_module(child);
            return mix(name);
          }
          return true;
        })) {
      return failed();
    }
    std::reverse(stack_.begin() + static_cast<std::ptrdiff_t>(first_child), stack_.end());
    return Outcome::kDone;
  }

  const bool with_buffers_;
  bool needs_safe_ = false;
  std::vector<PyObject*> stack_;
  std::vector<PyObject*> held_;
  PointerSet seen_;
};

}  // namespace

PyObject* python_tensor_walk(PyObject* /*module*/, PyObject* args, PyObject* kwargs) {
  HANDLE_TH_ERRORS
  static const char* kKeywords[] = {"model", "with_buffers", "names", nullptr};
  PyObject* model = nullptr;
  int with_buffers = 1;
  int names = 0;
  if (!PyArg_ParseTupleAndKeywords(args, kwargs, "O|pp:tensor_walk", const_cast<char**>(kKeywords),
                                   &model, &with_buffers, &names) ||
      !intern_names()) {
    return nullptr;
  }
  // With names=True: (list, hash of every name in walk order), for a cheap rename check.
  const auto result = [names](auto& walk) -> PyObject* {
    const uint64_t hash = walk.names_hash;
    PyObject* list = walk.to_list();
    if (list == nullptr || !names) {
      return list;
    }
    return Py_BuildValue("(NK)", list, static_cast<unsigned long long>(hash));
  };
  {
    Walk<false> fast(with_buffers != 0);
    // Materialising a module's __dict__ allocates; a collection then could run finalizers.
    const int gc_was_enabled = PyGC_Disable();
    const Outcome outcome = fast.run(model);
    if (gc_was_enabled) {
      PyGC_Enable();
    }
    if (outcome == Outcome::kDone) {
      return result(fast);
    }
    if (outcome == Outcome::kError) {
      return nullptr;
    }
  }
  Walk<true> safe(with_buffers != 0);
  return safe.run(model) == Outcome::kDone ? result(safe) : nullptr;
  END_HANDLE_TH_ERRORS
}

}  // namespace fused_ema
