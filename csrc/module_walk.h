// The one definition of an EMA's walk of a model: every distinct module once, depth first in
// named_modules order; per module its parameters (None entries kept), then its persistent
// buffers, then its children. tensor_walk (python_walk.cpp) and the walk cache's record
// (python_walk_cache.cpp) are visitors of this traversal; CPython's documented C API only.
#pragma once

#include <Python.h>

#include <algorithm>
#include <cstdint>
#include <exception>
#include <utility>
#include <vector>

namespace fused_ema {

// Sets the Python error of a C++ exception as torch's own bindings map them (ValueError, TypeError,
// IndexError, NotImplementedError, else RuntimeError; MemoryError for bad_alloc), with the message
// and no C++ backtrace (prepared_handles.cpp).
void set_python_error(const std::exception& err);

// Runs a CPython entry point's body: no C++ exception may cross into the interpreter.
template <typename Body>
PyObject* python_entry(Body&& body) {
  try {
    return body();
  } catch (const std::exception& err) {
    set_python_error(err);
    return nullptr;
  }
}

// The instance-dict keys the walk reads, interned once.
struct WalkNames {
  PyObject* parameters = nullptr;
  PyObject* buffers = nullptr;
  PyObject* non_persistent = nullptr;
  PyObject* modules = nullptr;

  // Nullptr with an error set if interning failed.
  static const WalkNames* get() {
    static WalkNames names;
    if (names.modules == nullptr) {
      names.parameters = PyUnicode_InternFromString("_parameters");
      names.buffers = PyUnicode_InternFromString("_buffers");
      names.non_persistent = PyUnicode_InternFromString("_non_persistent_buffers_set");
      names.modules = PyUnicode_InternFromString("_modules");
      if (names.parameters == nullptr || names.buffers == nullptr ||
          names.non_persistent == nullptr || names.modules == nullptr) {
        names.modules = nullptr;
        return nullptr;
      }
    }
    return &names;
  }
};

// A strong reference, dropped when this goes.
class OwnedRef {
 public:
  OwnedRef() = default;
  explicit OwnedRef(PyObject* borrowed) : p_(borrowed) { Py_XINCREF(p_); }
  static OwnedRef steal(PyObject* owned) {
    OwnedRef ref;
    ref.p_ = owned;
    return ref;
  }
  OwnedRef(OwnedRef&& other) noexcept : p_(other.p_) { other.p_ = nullptr; }
  OwnedRef& operator=(OwnedRef&& other) noexcept {
    std::swap(p_, other.p_);
    return *this;
  }
  OwnedRef(const OwnedRef&) = delete;
  OwnedRef& operator=(const OwnedRef&) = delete;
  ~OwnedRef() { Py_XDECREF(p_); }
  PyObject* get() const { return p_; }

 private:
  PyObject* p_ = nullptr;
};

// What the walk reads of one module, each held for the visit: whatever Python code runs meanwhile
// (a mapping's items(), a key's __eq__, a finalizer), nothing it reads can go away under it.
struct ModuleDicts {
  OwnedRef dict;        // the instance __dict__
  OwnedRef parameters;  // _parameters
  OwnedRef buffers;     // _buffers (walks with buffers only)
  OwnedRef skip;        // _non_persistent_buffers_set (walks with buffers, when there are any)
  OwnedRef children;    // _modules
};

namespace walk_detail {

inline bool read_dicts(PyObject* module, bool with_buffers, const WalkNames& n, ModuleDicts& d) {
  d.dict = OwnedRef::steal(PyObject_GenericGetDict(module, nullptr));
  if (d.dict.get() == nullptr || !PyDict_Check(d.dict.get())) {
    PyErr_Clear();
    PyErr_Format(PyExc_TypeError,
                 "tensor_walk: a %.200s in the module tree has no __dict__ "
                 "(only torch.nn.Module trees can be walked)",
                 Py_TYPE(module)->tp_name);
    return false;
  }
  // into = the instance dict's entry `name`, held; false with an error set if it has none.
  const auto entry = [&](PyObject* name, OwnedRef& into) {
    PyObject* value = PyDict_GetItemWithError(d.dict.get(), name);
    if (value == nullptr && !PyErr_Occurred()) {
      PyErr_Format(PyExc_TypeError,
                   "tensor_walk: a %.200s in the module tree has no %U in its __dict__ "
                   "(only torch.nn.Module trees can be walked)",
                   Py_TYPE(module)->tp_name, name);
    }
    into = OwnedRef(value);
    return value != nullptr;
  };
  if (!entry(n.parameters, d.parameters) || !entry(n.modules, d.children)) {
    return false;
  }
  if (!with_buffers) {
    return true;
  }
  if (!entry(n.buffers, d.buffers)) {
    return false;
  }
  // Which buffers are persistent matters only where there are buffers: most modules have none,
  // and the set would be one more object read per module.
  PyObject* buffers = d.buffers.get();
  return (PyDict_CheckExact(buffers) && PyDict_GET_SIZE(buffers) == 0) ||
         entry(n.non_persistent, d.skip);
}

// Calls visit(key, value) for every item of an exact dict (insertion order), or of another
// mapping through its items(); false with an error set on failure.
template <typename Visit>
bool for_each_item(PyObject* mapping, Visit&& visit) {
  if (PyDict_CheckExact(mapping)) {
    Py_ssize_t pos = 0;
    PyObject* key = nullptr;
    PyObject* value = nullptr;
    while (PyDict_Next(mapping, &pos, &key, &value)) {
      // Held across the visit: a key's hash or __eq__ may run Python code that edits the dict.
      const OwnedRef hold_key(key);
      const OwnedRef hold_value(value);
      if (!visit(key, value)) {
        return false;
      }
    }
    return true;
  }
  const OwnedRef items = OwnedRef::steal(PyMapping_Items(mapping));
  if (items.get() == nullptr) {
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

// Open-addressing set of object addresses: the modules already visited (each held until the
// walk ends, so an address cannot be reused meanwhile).
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

}  // namespace walk_detail

// Walks `model`, calling on the visitor (each returns false, with an error set, to stop):
//   module(module, dicts, tag)  once per distinct module, before its items;
//   item(name, value, is_param) for each parameter slot and persistent buffer;
//   child(name, child, tag&)    for each child slot that is not None;
// and returns false if the walk stopped. The tag child() sets (say, where the visitor keeps the
// child's name prefix) comes back with the child's module() call; the model's is 0. With
// every_path, a module reachable by several paths is visited along each (as state_dict() names
// it), a cycle still only once.
template <typename Visitor>
bool walk_modules(PyObject* model, bool with_buffers, Visitor& visitor, bool every_path = false) {
  using namespace walk_detail;
  const WalkNames* names = WalkNames::get();
  if (names == nullptr) {
    return false;
  }
  struct Pending {
    OwnedRef module;
    size_t tag;
    size_t depth;
  };
  std::vector<Pending> stack;
  std::vector<OwnedRef> visited;
  std::vector<PyObject*> path;  // every_path: the modules above the one visited
  PointerSet seen;
  stack.push_back({OwnedRef(model), 0, 0});
  while (!stack.empty()) {
    const size_t tag = stack.back().tag;
    const size_t depth = stack.back().depth;
    visited.push_back(std::move(stack.back().module));
    stack.pop_back();
    PyObject* module = visited.back().get();
    if (every_path) {
      path.resize(depth);
      if (std::find(path.begin(), path.end(), module) != path.end()) {
        continue;  // a module inside itself
      }
      path.push_back(module);
    } else if (!seen.insert(module)) {
      continue;
    }
    ModuleDicts d;
    if (!read_dicts(module, with_buffers, *names, d) || !visitor.module(module, d, tag)) {
      return false;
    }
    if (!for_each_item(d.parameters.get(), [&](PyObject* name, PyObject* value) {
          return visitor.item(name, value, true);
        })) {
      return false;
    }
    PyObject* skip = d.skip.get();  // null: no buffers when the module's dicts were read
    if (skip != nullptr) {
      const bool skip_any = !PyAnySet_Check(skip) || PySet_GET_SIZE(skip) > 0;
      if (!for_each_item(d.buffers.get(), [&](PyObject* name, PyObject* value) {
            const int skipped = skip_any ? PySequence_Contains(skip, name) : 0;
            return skipped < 0 ? false : skipped == 1 || visitor.item(name, value, false);
          })) {
        return false;
      }
    }
    const size_t first_child = stack.size();
    if (!for_each_item(d.children.get(), [&](PyObject* name, PyObject* child) {
          if (child == Py_None) {
            return true;
          }
          size_t child_tag = 0;
          if (!visitor.child(name, child, child_tag)) {
            return false;
          }
          stack.push_back({OwnedRef(child), child_tag, depth + 1});
          return true;
        })) {
      return false;
    }
    std::reverse(stack.begin() + static_cast<std::ptrdiff_t>(first_child), stack.end());
  }
  return true;
}

}  // namespace fused_ema
