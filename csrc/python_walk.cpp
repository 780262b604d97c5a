// fused_ema._C.tensor_walk: the model's tensors in walk order (module_walk.h), with a hash of
// every name on the way; walk_matches: whether such a walk holds the very objects (identity only)
// a plan was built for, an update's check whenever the walk cache (python_walk_cache.cpp) cannot
// vouch that the model is unchanged. named_walk: the same walk with every item's full name, for
// building a plan; with every_path, also a module's names under each path to it (state_dict's).
#include <Python.h>

#include <cstdint>
#include <utility>
#include <vector>

#include "module_walk.h"

namespace fused_ema {
namespace {

// Collects the items into a list and folds every parameter, buffer and child name into a hash in
// walk order: renaming a module, which leaves the tensors and their order as they were, still
// changes it.
class ListVisitor {
 public:
  bool ready() const { return list_.get() != nullptr; }

  bool module(PyObject* /*module*/, const ModuleDicts& /*dicts*/, size_t /*tag*/) {
    names_hash_ = (names_hash_ + 1) * kPrime;  // a module boundary
    return true;
  }
  bool item(PyObject* name, PyObject* value, bool /*is_param*/) {
    return PyList_Append(list_.get(), value) == 0 && mix(name);
  }
  bool child(PyObject* name, PyObject* /*child*/, size_t& /*tag*/) { return mix(name); }

  uint64_t names_hash() const { return names_hash_; }

  PyObject* release() { return Py_NewRef(list_.get()); }

 private:
  static constexpr uint64_t kPrime = 0x100000001b3ull;

  bool mix(PyObject* name) {
    const Py_hash_t h = PyObject_Hash(name);  // cached for str
    if (h == -1) {
      return false;
    }
    names_hash_ = (names_hash_ ^ static_cast<uint64_t>(h)) * kPrime;
    return true;
  }

  OwnedRef list_ = OwnedRef::steal(PyList_New(0));
  uint64_t names_hash_ = 0xcbf29ce484222325ull;
};

// Every item as (full name, value, is a parameter), names as named_parameters/state_dict give
// them: the prefix a module is first reached under, in walk order.
class NamedVisitor {
 public:
  NamedVisitor() : list_(OwnedRef::steal(PyList_New(0))) {
    prefixes_.push_back(OwnedRef::steal(PyUnicode_FromString("")));
  }

  bool ready() const { return list_.get() != nullptr && prefixes_[0].get() != nullptr; }

  bool module(PyObject* /*module*/, const ModuleDicts& /*dicts*/, size_t tag) {
    prefix_ = prefixes_[tag].get();
    return true;
  }
  bool item(PyObject* name, PyObject* value, bool is_param) {
    const OwnedRef full = OwnedRef::steal(PyUnicode_FromFormat("%U%S", prefix_, name));
    if (full.get() == nullptr) {
      return false;
    }
    const OwnedRef entry =
        OwnedRef::steal(Py_BuildValue("(OOO)", full.get(), value, is_param ? Py_True : Py_False));
    return entry.get() != nullptr && PyList_Append(list_.get(), entry.get()) == 0;
  }
  bool child(PyObject* name, PyObject* /*child*/, size_t& tag) {
    OwnedRef prefix = OwnedRef::steal(PyUnicode_FromFormat("%U%S.", prefix_, name));
    if (prefix.get() == nullptr) {
      return false;
    }
    tag = prefixes_.size();
    prefixes_.push_back(std::move(prefix));
    return true;
  }

  PyObject* release() { return Py_NewRef(list_.get()); }

 private:
  OwnedRef list_;
  std::vector<OwnedRef> prefixes_;  // by tag
  PyObject* prefix_ = nullptr;      // the module being visited's, borrowed from prefixes_
};

bool check_type(PyObject* obj, bool ok, const char* what) {
  if (!ok) {
    PyErr_Format(PyExc_TypeError, "expected %s, got %.200s", what, Py_TYPE(obj)->tp_name);
  }
  return ok;
}

// The referent of a weakref.ref, compared by address only (never dereferenced).
PyObject* referent(PyObject* ref) {
#if PY_VERSION_HEX >= 0x030D0000
  PyObject* target = nullptr;
  if (PyWeakref_GetRef(ref, &target) < 0) {
    PyErr_Clear();
    return nullptr;
  }
  Py_XDECREF(target);
  return target;
#else
  PyObject* target = PyWeakref_GET_OBJECT(ref);
  return target == Py_None ? nullptr : target;
#endif
}

}  // namespace

PyObject* python_walk_matches(PyObject* /*module*/, PyObject* const* args, Py_ssize_t nargs) {
  if (nargs != 2) {
    PyErr_Format(PyExc_TypeError, "walk_matches(walk, refs) takes 2 arguments (%zd)", nargs);
    return nullptr;
  }
  PyObject* walk = args[0];
  PyObject* refs = args[1];
  if (!check_type(walk, PyList_Check(walk), "a list (walk)") ||
      !check_type(refs, PyTuple_Check(refs), "a tuple (refs)")) {
    return nullptr;
  }
  const Py_ssize_t n = PyList_GET_SIZE(walk);
  if (PyTuple_GET_SIZE(refs) != n) {
    Py_RETURN_FALSE;
  }
  for (Py_ssize_t i = 0; i < n; ++i) {
    PyObject* item = PyList_GET_ITEM(walk, i);
    PyObject* ref = PyTuple_GET_ITEM(refs, i);
    if (ref == Py_None) {
      if (item != Py_None) {
        Py_RETURN_FALSE;
      }
    } else {
      if (!check_type(ref, PyWeakref_CheckRef(ref), "weakref.ref or None (refs item)")) {
        return nullptr;
      }
      if (item == Py_None || referent(ref) != item) {
        Py_RETURN_FALSE;
      }
    }
  }
  Py_RETURN_TRUE;
}

PyObject* python_named_walk(PyObject* /*module*/, PyObject* args) {
  return python_entry([&]() -> PyObject* {
    PyObject* model = nullptr;
    int with_buffers = 1;
    int every_path = 0;
    if (!PyArg_ParseTuple(args, "O|pp:named_walk", &model, &with_buffers, &every_path)) {
      return nullptr;
    }
    NamedVisitor walk;
    if (!walk.ready() || !walk_modules(model, with_buffers != 0, walk, every_path != 0)) {
      return nullptr;
    }
    return walk.release();
  });
}

PyObject* python_tensor_walk(PyObject* /*module*/, PyObject* args, PyObject* kwargs) {
  return python_entry([&]() -> PyObject* {
    static const char* kKeywords[] = {"model", "with_buffers", "names", nullptr};
    PyObject* model = nullptr;
    int with_buffers = 1;
    int names = 0;
    if (!PyArg_ParseTupleAndKeywords(args, kwargs, "O|pp:tensor_walk",
                                     const_cast<char**>(kKeywords), &model, &with_buffers,
                                     &names)) {
      return nullptr;
    }
    ListVisitor walk;
    if (!walk.ready() || !walk_modules(model, with_buffers != 0, walk)) {
      return nullptr;
    }
    PyObject* list = walk.release();
    if (!names) {
      return list;
    }
    // With names=True: (list, hash of every name in walk order), for a cheap rename check.
    return Py_BuildValue("(NK)", list, static_cast<unsigned long long>(walk.names_hash()));
  });
}

}  // namespace fused_ema
