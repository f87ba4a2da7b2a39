// The Python module of jacklring's torch backend: the classes Python makes and registers
// (adapter/torch_backend/native.py loads it from the per-user build cache).
#include <torch/csrc/utils/pybind.h>

#include <algorithm>
#include <vector>

#include "backend.h"
#include "floor.h"
#include "named_group.h"

namespace py = pybind11;

namespace {

// The Python group behind a NamedProcessGroup: its CPU backend's delegate.
py::object python_group(const py::object& group) {
  py::object cpu = py::module_::import("torch").attr("device")("cpu");
  return group.attr("_get_backend")(cpu).attr("delegate");
}

}  // namespace

PYBIND11_MODULE(TORCH_EXTENSION_NAME, m) {
  py::module_::import("torch.distributed");  // c10d's Backend must be registered before ours
  py::class_<jacklring::JacklringBackend, c10d::Backend, c10::intrusive_ptr<jacklring::JacklringBackend>>(
      m, "JacklringBackend")
      .def(py::init<int, int, py::object>(), py::arg("rank"), py::arg("size"), py::arg("delegate"))
      .def_property_readonly("delegate", &jacklring::JacklringBackend::delegate)
      .def(
          "enable_native",
          [](jacklring::JacklringBackend& self, py::capsule api, py::capsule ctx, py::object keepalive,
             double timeout_s, int magic, std::vector<int> ops, std::vector<int64_t> reduce) {
            jacklring::HeaderCodes codes;
            if (reduce.size() != codes.reduce.size() || ops.size() != 5) {
              throw py::value_error("one ring code per engine reduction and five op codes expected");
            }
            codes.magic = static_cast<uint16_t>(magic);
            codes.all_reduce = static_cast<uint8_t>(ops[0]);
            codes.all_gather = static_cast<uint8_t>(ops[1]);
            codes.reduce_scatter = static_cast<uint8_t>(ops[2]);
            codes.broadcast = static_cast<uint8_t>(ops[3]);
            codes.barrier = static_cast<uint8_t>(ops[4]);
            std::copy(reduce.begin(), reduce.end(), codes.reduce.begin());
            self.enable_native(std::move(api), std::move(ctx), std::move(keepalive), timeout_s, codes);
          },
          py::arg("api"), py::arg("ctx"), py::arg("keepalive"), py::arg("timeout_s"), py::arg("magic"),
          py::arg("ops"), py::arg("reduce"))
      .def("disable_native", &jacklring::JacklringBackend::disable_native)
      .def_property_readonly("native", &jacklring::JacklringBackend::native_enabled);
  py::class_<jacklring::NamedProcessGroup, c10d::ProcessGroup, c10::intrusive_ptr<jacklring::NamedProcessGroup>>(
      m, "NamedProcessGroup")
      .def(py::init<int, int>(), py::arg("rank"), py::arg("size"))
      // What the Python group answers too (code written against either asks it).
      .def("getBackendName", &jacklring::NamedProcessGroup::getBackendName)
      .def("description", [](py::object self) { return python_group(self).attr("description")(); })
      .def("underlying_backend", [](py::object self) { return python_group(self).attr("underlying_backend")(); })
      .def_property_readonly("timeout_s", [](py::object self) { return python_group(self).attr("timeout_s"); });
  py::class_<jacklring::FloorBackend, c10d::Backend, c10::intrusive_ptr<jacklring::FloorBackend>>(m, "FloorBackend")
      .def(py::init<int, int>(), py::arg("rank"), py::arg("size"));
}
