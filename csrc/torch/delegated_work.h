// The Work of an operation the Python process group ran (or queued): a C++ Work that keeps the
// Python JacklringWork alive as long as torch's C++ holds it, and answers every query from it.
// Errors are the Python Work's own exceptions (pybind11 carries them back to Python callers
// unchanged), so messages and exception types are those of the Python group.
#ifndef JACKLRING_TORCH_DELEGATED_WORK_H
#define JACKLRING_TORCH_DELEGATED_WORK_H

#include <pybind11/pybind11.h>
#include <torch/csrc/distributed/c10d/Work.hpp>

#include <vector>

namespace jacklring {

// Hidden, as pybind11's own types are: it holds a py::object.
class __attribute__((visibility("hidden"))) DelegatedWork : public c10d::Work {
 public:
  DelegatedWork(int rank, c10d::OpType op, pybind11::object work);
  ~DelegatedWork() override;

  bool isCompleted() override;
  bool isSuccess() const override;
  std::exception_ptr exception() const override;
  int sourceRank() const override;
  std::vector<at::Tensor> result() override;
  void synchronize() override {}
  bool wait(std::chrono::milliseconds timeout) override;
  c10::intrusive_ptr<c10::ivalue::Future> getFuture() override;

 private:
  pybind11::object work_;  // the JacklringWork; touched only with the GIL held
};

}  // namespace jacklring

#endif
