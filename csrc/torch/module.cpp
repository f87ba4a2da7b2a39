// The Python module of jacklring's torch backend: the classes Python makes and registers
// (adapter/torch_backend/native.py loads it from the per-user build cache).
#include <torch/csrc/utils/pybind.h>

#include "backend.h"
#include "floor.h"

namespace py = pybind11;

PYBIND11_MODULE(TORCH_EXTENSION_NAME, m) {
  py::module_::import("torch.distributed");  // c10d's Backend must be registered before ours
  py::class_<jacklring::JacklringBackend, c10d::Backend, c10::intrusive_ptr<jacklring::JacklringBackend>>(
      m, "JacklringBackend")
      .def(py::init<int, int, py::object>(), py::arg("rank"), py::arg("size"), py::arg("delegate"))
      .def_property_readonly("delegate", &jacklring::JacklringBackend::delegate);
  py::class_<jacklring::FloorBackend, c10d::Backend, c10::intrusive_ptr<jacklring::FloorBackend>>(m, "FloorBackend")
      .def(py::init<int, int>(), py::arg("rank"), py::arg("size"));
}
