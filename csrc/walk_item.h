// One walk item's signature (what an update plan relies on besides the object's identity): its
// Python type, dtype, layout, device and sizes, or a None marker. Shared by the walk check
// (python_walk_check.cpp) and the walk cache (python_walk_cache.cpp).
#pragma once

#include <Python.h>
#include <torch/csrc/autograd/python_variable.h>

#include <cstdint>
#include <cstring>
#include <vector>

namespace fused_ema {

// A fixed header, then `ndim` int64 sizes.
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
inline bool describe_item(PyObject* item, ItemHeader& header, c10::IntArrayRef& sizes) {
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

// Appends the item's signature (header, then sizes) to `out`; false with TypeError set for
// anything but a tensor or None.
inline bool append_signature(PyObject* item, std::vector<char>& out) {
  ItemHeader header;
  c10::IntArrayRef sizes;
  if (!describe_item(item, header, sizes)) {
    return false;
  }
  const char* h = reinterpret_cast<const char*>(&header);
  const char* s = reinterpret_cast<const char*>(sizes.data());
  out.insert(out.end(), h, h + sizeof(header));
  out.insert(out.end(), s, s + sizes.size() * sizeof(int64_t));
  return true;
}

// Whether the item's signature is the one at `cursor` (within `end`); advances `cursor` past it.
// False with an error set only when the item is neither a tensor nor None.
inline bool item_matches(PyObject* item, const char*& cursor, const char* end, bool& error) {
  ItemHeader header;
  c10::IntArrayRef sizes;
  if (!describe_item(item, header, sizes)) {
    error = true;
    return false;
  }
  const size_t size_bytes = sizes.size() * sizeof(int64_t);
  if (static_cast<size_t>(end - cursor) < sizeof(header) + size_bytes ||
      std::memcmp(cursor, &header, sizeof(header)) != 0) {
    return false;
  }
  // Sizes compared one by one: a memcmp of a length known only here is a library call, most of
  // the cost of checking a tiny tensor.
  const char* stored = cursor + sizeof(header);
  for (size_t d = 0; d < sizes.size(); ++d) {
    int64_t size = 0;
    std::memcpy(&size, stored + d * sizeof(int64_t), sizeof(size));
    if (size != sizes[d]) {
      return false;
    }
  }
  cursor += sizeof(header) + size_bytes;
  return true;
}

}  // namespace fused_ema
