// fused_ema._C.tensor_walk / walk_signature / walk_matches / take: the check, at every update,
// that a model still holds the tensor objects (and shapes, dtypes, devices) an update plan was
// built for, at a few ns a tensor. tensor_walk reads module instance dicts directly instead of
// going through nn.Module attribute lookup; the other three compare and index without allocating.
#include <Python.h>
#include <torch/csrc/Exceptions.h>
#include <torch/csrc/autograd/python_variable.h>
#include <torch/csrc/utils/object_ptr.h>

#include <algorithm>
#include <cstdint>
#include <cstring>
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

// One walk item's signature: a fixed header, then `ndim` int64 sizes.
struct ItemHeader {
  uintptr_t type;  // 0 for None
  int8_t dtype;
  int8_t layout;
  int8_t device_type;
  int8_t device_index;
  int32_t ndim;
};
static_assert(sizeof(ItemHeader) == 16, "signature layout");

// Header and sizes of one item; false with TypeError set for anything but a tensor or None.
bool describe(PyObject* item, ItemHeader& header, c10::IntArrayRef& sizes) {
  std::memset(&header, 0, sizeof(header));
  if (item == Py_None) {
    sizes = {};
    return true;
  }
  if (!THPVariable_Check(item)) {
    PyErr_Format(PyExc_TypeError, "walk items are tensors or None, not %.200s",
                 Py_TYPE(item)->tp_name);
    return false;
  }
  const at::Tensor& tensor = THPVariable_Unpack(item);
  const c10::Device device = tensor.device();
  sizes = tensor.sizes();
  header.type = reinterpret_cast<uintptr_t>(Py_TYPE(item));
  header.dtype = static_cast<int8_t>(tensor.scalar_type());
  header.layout = static_cast<int8_t>(tensor.layout());
  header.device_type = static_cast<int8_t>(device.type());
  header.device_index = static_cast<int8_t>(device.index());
  header.ndim = static_cast<int32_t>(sizes.size());
  return true;
}

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

PyObject* python_walk_signature(PyObject* /*module*/, PyObject* walk) {
  HANDLE_TH_ERRORS
  if (!check_type(walk, PyList_Check(walk), "a list")) {
    return nullptr;
  }
  std::vector<char> bytes;
  bytes.reserve(static_cast<size_t>(PyList_GET_SIZE(walk)) * (sizeof(ItemHeader) + 16));
  for (Py_ssize_t i = 0; i < PyList_GET_SIZE(walk); ++i) {
    ItemHeader header;
    c10::IntArrayRef sizes;
    if (!describe(PyList_GET_ITEM(walk, i), header, sizes)) {
      return nullptr;
    }
    const char* h = reinterpret_cast<const char*>(&header);
    const char* s = reinterpret_cast<const char*>(sizes.data());
    bytes.insert(bytes.end(), h, h + sizeof(header));
    bytes.insert(bytes.end(), s, s + sizes.size() * sizeof(int64_t));
  }
  return PyBytes_FromStringAndSize(bytes.data(), static_cast<Py_ssize_t>(bytes.size()));
  END_HANDLE_TH_ERRORS
}

PyObject* python_walk_matches(PyObject* /*module*/, PyObject* const* args, Py_ssize_t nargs) {
  HANDLE_TH_ERRORS
  if (nargs != 3) {
    PyErr_Format(PyExc_TypeError, "walk_matches(walk, refs, signature) takes 3 arguments (%zd)",
                 nargs);
    return nullptr;
  }
  PyObject* walk = args[0];
  PyObject* refs = args[1];
  PyObject* signature = args[2];
  if (!check_type(walk, PyList_Check(walk), "a list (walk)") ||
      !check_type(refs, PyTuple_Check(refs), "a tuple (refs)") ||
      !check_type(signature, PyBytes_Check(signature), "bytes (signature)")) {
    return nullptr;
  }
  const Py_ssize_t n = PyList_GET_SIZE(walk);
  if (PyTuple_GET_SIZE(refs) != n) {
    Py_RETURN_FALSE;
  }
  const char* cursor = PyBytes_AS_STRING(signature);
  const char* const end = cursor + PyBytes_GET_SIZE(signature);
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
    ItemHeader header;
    c10::IntArrayRef sizes;
    if (!describe(item, header, sizes)) {
      return nullptr;
    }
    const size_t size_bytes = sizes.size() * sizeof(int64_t);
    if (static_cast<size_t>(end - cursor) < sizeof(header) + size_bytes ||
        std::memcmp(cursor, &header, sizeof(header)) != 0 ||
        (size_bytes > 0 && std::memcmp(cursor + sizeof(header), sizes.data(), size_bytes) != 0)) {
      Py_RETURN_FALSE;
    }
    cursor += sizeof(header) + size_bytes;
  }
  if (cursor != end) {
    Py_RETURN_FALSE;
  }
  Py_RETURN_TRUE;
  END_HANDLE_TH_ERRORS
}

PyObject* python_take(PyObject* /*module*/, PyObject* const* args, Py_ssize_t nargs) {
  if (nargs != 2) {
    PyErr_Format(PyExc_TypeError, "take(walk, indices) takes 2 arguments (%zd)", nargs);
    return nullptr;
  }
  PyObject* walk = args[0];
  PyObject* indices = args[1];
  if (!check_type(walk, PyList_Check(walk), "a list (walk)") ||
      !check_type(indices, PyTuple_Check(indices), "a tuple of ints (indices)")) {
    return nullptr;
  }
  const Py_ssize_t size = PyList_GET_SIZE(walk);
  const Py_ssize_t n = PyTuple_GET_SIZE(indices);
  PyObject* out = PyList_New(n);
  if (out == nullptr) {
    return nullptr;
  }
  for (Py_ssize_t k = 0; k < n; ++k) {
    Py_ssize_t i = PyLong_AsSsize_t(PyTuple_GET_ITEM(indices, k));
    if (i == -1 && PyErr_Occurred()) {
      Py_DECREF(out);
      return nullptr;
    }
    if (i < 0) {
      i += size;  // as walk[i] does
    }
    if (i < 0 || i >= size) {
      Py_DECREF(out);
      PyErr_Format(PyExc_IndexError, "take: index %zd out of range for a walk of %zd items",
                   PyLong_AsSsize_t(PyTuple_GET_ITEM(indices, k)), size);
      return nullptr;
    }
    PyObject* item = PyList_GET_ITEM(walk, i);
    Py_INCREF(item);
    PyList_SET_ITEM(out, k, item);
  }
  return out;
}

}  // namespace fused_ema
