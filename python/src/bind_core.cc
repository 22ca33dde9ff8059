// dtype, Region and tensor-borrowing helpers.
#include <pybind11/stl.h>

#include "common.h"
#include "shardsync/checksum.h"
#include "shardsync/settings.h"

namespace shardsync::py_bind {

py::tuple RegionToPy(const Region& r) { return py::make_tuple(r.offsets(), r.extents()); }

Region RegionFromPy(py::handle obj, const std::string& what) {
  if (py::isinstance<Region>(obj)) return obj.cast<Region>();
  std::vector<int64_t> off, ext;
  try {
    auto t = obj.cast<std::pair<std::vector<int64_t>, std::vector<int64_t>>>();
    off = std::move(t.first);
    ext = std::move(t.second);
  } catch (const py::cast_error&) {
    ThrowIfError(InvalidArgumentError(what + ": expected a Region or (offsets, extents)"));
  }
  if (off.size() != ext.size() || off.size() > static_cast<size_t>(kMaxDims)) {
    ThrowIfError(InvalidArgumentError(
        what + ": offsets and extents must have the same length <= " + std::to_string(kMaxDims)));
  }
  for (size_t i = 0; i < off.size(); ++i) {
    if (off[i] < 0 || ext[i] < 0) {
      ThrowIfError(
          InvalidArgumentError(what + ": negative offset or extent in dim " + std::to_string(i)));
    }
  }
  return Region::Make(off, ext);
}

void RegisterCore(py::module_& m) {
  m.def(
      "parse_dtype",
      [](const std::string& s, const std::string& field) {
        return std::string(DTypeName(Unwrap(ParseDType(s, field))));
      },
      py::arg("name"), py::arg("field") = "dtype",
      "Canonical safetensors name of a dtype spelling (\"bfloat16\" -> \"BF16\"); errors name "
      "`field`.");
  m.def(
      "dtype_size",
      [](const std::string& s, const std::string& field) {
        return DTypeSize(Unwrap(ParseDType(s, field)));
      },
      py::arg("name"), py::arg("field") = "dtype", "Bytes per element of a dtype spelling.");
  m.def(
      "dtype_torch_name",
      [](const std::string& s, const std::string& field) {
        return std::string(DTypeTorchName(Unwrap(ParseDType(s, field))));
      },
      py::arg("name"), py::arg("field") = "dtype",
      "torch's name of a dtype spelling (\"bf16\" -> \"bfloat16\"); errors name `field`.");

  py::class_<Region>(m, "Region",
                     "A box inside a tensor: per-dim offset and extent. `slices()` selects it from "
                     "the full tensor (numpy / torch indexing).")
      .def(py::init([](std::vector<int64_t> offset, std::vector<int64_t> extent) {
             return RegionFromPy(py::make_tuple(offset, extent), "Region");
           }),
           py::arg("offset"), py::arg("extent"))
      .def_static(
          "full", [](const Shape& s) { return Region::Full(s); }, py::arg("shape"))
      .def_property_readonly("ndim", [](const Region& r) { return r.ndim; })
      .def_property_readonly("offset", &Region::offsets)
      .def_property_readonly("extent", &Region::extents)
      .def_property_readonly("numel", &Region::numel)
      .def("__eq__", [](const Region& a, const Region& b) { return a == b; })
      .def("__hash__",
           [](const Region& r) { return py::hash(py::make_tuple(r.offsets(), r.extents())); })
      .def("__repr__", [](const Region& r) { return "Region" + r.ToString(); })
      .def("slices", [](const Region& r) {
        // Python slices selecting the region from a full tensor (numpy / torch indexing).
        py::list out;
        for (int i = 0; i < r.ndim; ++i) {
          out.append(py::slice(r.offset[i], r.offset[i] + r.extent[i], 1));
        }
        return py::tuple(out);
      });

  m.def(
      "tensor_info",
      [](py::handle obj) {
        TensorRef t = BorrowTensor(obj, "tensor");
        py::dict d;
        d["data_ptr"] = reinterpret_cast<uintptr_t>(t.data);
        d["dtype"] = std::string(DTypeName(t.dtype));
        d["shape"] = t.shape;
        d["device"] = t.cuda ? "cuda" : "cpu";
        d["device_index"] = t.device;
        d["nbytes"] = t.nbytes;
        return d;
      },
      py::arg("tensor"),
      "What shardsync sees of a tensor through DLPack: data pointer, dtype, shape, device.");

  m.def(
      "checksum",
      [](py::handle obj) {
        TensorRef t = BorrowTensor(obj, "tensor");
        if (t.cuda) ThrowIfError(UnimplementedError("checksum: host tensors only"));
        uint64_t sum;
        {
          py::gil_scoped_release nogil;
          sum = ChecksumFinish(ChecksumPartial(t.data, static_cast<size_t>(t.nbytes), 0),
                               static_cast<size_t>(t.nbytes));
        }
        return sum;
      },
      py::arg("tensor"), "The shardsync checksum (checksum.h) of a host tensor's bytes.");

  // The knob registry (settings.h): Python reads knobs through it so a malformed value raises
  // InvalidArgumentError naming the knob, as the C++ side and the CLI refuse it.
  m.def(
      "knobs",
      [] {
        py::list out;
        for (const Knob& k : Knobs()) {
          py::dict d;
          d["name"] = k.name;
          d["type"] = std::string(KnobTypeName(k.type));
          d["default"] = k.default_value;
          d["range"] = KnobRange(k);
          d["origin"] = k.origin == KnobOrigin::kShardsync ? "shardsync" : "third-party";
          d["reader"] = k.reader;
          d["meaning"] = k.meaning;
          out.append(d);
        }
        return out;
      },
      "Every registered environment knob (docs/environment.md) as dicts.");
  m.def(
      "read_knob",
      [](const std::string& name) -> py::object {
        std::optional<std::string> v = Unwrap(ReadKnob(name));
        if (!v) return py::none();
        return py::str(*v);
      },
      py::arg("name"),
      "A knob's value from this process's environment, parsed strictly: None when unset or "
      "empty; InvalidArgumentError naming the knob and the value when malformed.");
  m.def(
      "check_knobs", [] { ThrowIfError(CheckKnobs()); },
      "InvalidArgumentError naming the first malformed shardsync knob in the environment.");
}

}  // namespace shardsync::py_bind
