// A Python exception carried through C++ as often as C++ rethrows it: a native op's error is
// stored once (in its Work and its Future) and raised by every wait(), exception() and
// future.wait() after (pybind11's error_already_set may be raised only once). The module
// registers a translator (module.cpp) that raises the very exception object again.
#ifndef JACKLRING_TORCH_PYTHON_ERROR_H
#define JACKLRING_TORCH_PYTHON_ERROR_H

#include <pybind11/pybind11.h>

#include <exception>
#include <memory>
#include <string>
#include <utility>

namespace jacklring {

// Hidden, as pybind11's own types are: it holds a py::object.
class __attribute__((visibility("hidden"))) PythonError : public std::exception {
 public:
  // With the GIL held.
  PythonError(pybind11::object error, std::string what)
      : error_(new pybind11::object(std::move(error)), release), what_(std::move(what)) {}

  const char* what() const noexcept override { return what_.c_str(); }
  // With the GIL held (pybind11 calls its translators so): raise the exception object.
  void restore() const {
    PyErr_SetObject(reinterpret_cast<PyObject*>(Py_TYPE(error_->ptr())), error_->ptr());
  }

 private:
  // The last copy may go on any thread without the GIL (a Work dropped by torch's C++).
  static void release(pybind11::object* error) {
    if (Py_IsInitialized() && !_Py_IsFinalizing()) {
      pybind11::gil_scoped_acquire gil;
      delete error;
    } else {
      error->release();  // the interpreter is gone: nothing to decrement
      delete error;
    }
  }

  std::shared_ptr<pybind11::object> error_;
  std::string what_;
};

}  // namespace jacklring

#endif
