// DelegatedWork: every query takes the GIL and asks the Python Work (delegated_work.h).
#include "delegated_work.h"

#include <torch/csrc/jit/python/pybind_utils.h>

#include <utility>

namespace py = pybind11;

namespace jacklring {

DelegatedWork::DelegatedWork(int rank, c10d::OpType op, py::object work)
    : c10d::Work(rank, op), work_(std::move(work)) {}

DelegatedWork::~DelegatedWork() {
  // torch may drop the last reference on any thread, without the GIL; after the interpreter
  // has finalized there is nothing left to release (taking the GIL then would hang).
  if (Py_IsInitialized() && !_Py_IsFinalizing()) {
    py::gil_scoped_acquire gil;
    work_ = py::object();
  } else {
    work_.release();
  }
}

bool DelegatedWork::isCompleted() {
  py::gil_scoped_acquire gil;
  return work_.attr("is_completed")().cast<bool>();
}

bool DelegatedWork::isSuccess() const {
  py::gil_scoped_acquire gil;
  return work_.attr("is_success")().cast<bool>();
}

std::exception_ptr DelegatedWork::exception() const {
  py::gil_scoped_acquire gil;
  py::object error = work_.attr("exception")();
  if (error.is_none()) {
    return nullptr;
  }
  // The very exception object wait() raised (docs/torch.md: exception() is that error): an
  // error_already_set over it, which torch's binding raises back as that object.
  PyErr_SetObject(reinterpret_cast<PyObject*>(Py_TYPE(error.ptr())), error.ptr());
  return std::make_exception_ptr(py::error_already_set());
}

int DelegatedWork::sourceRank() const {
  py::gil_scoped_acquire gil;
  return work_.attr("source_rank")().cast<int>();
}

std::vector<at::Tensor> DelegatedWork::result() {
  py::gil_scoped_acquire gil;
  return work_.attr("result")().cast<std::vector<at::Tensor>>();
}

bool DelegatedWork::wait(std::chrono::milliseconds timeout) {
  py::gil_scoped_acquire gil;
  // torch's kNoTimeout (0) means "wait forever": the Python Work reads 0 the same way.
  return work_.attr("wait")(static_cast<double>(timeout.count()) / 1000.0).cast<bool>();
}

c10::intrusive_ptr<c10::ivalue::Future> DelegatedWork::getFuture() {
  py::gil_scoped_acquire gil;
  py::object future = work_.attr("get_future")();
  return future.cast<std::shared_ptr<torch::jit::PythonFutureWrapper>>()->fut;
}

}  // namespace jacklring
