// A Work that is complete when it is made: the result of an operation that ran on the
// calling thread. Its future is made only when someone asks for one (most callers only wait).
#ifndef JACKLRING_TORCH_DONE_WORK_H
#define JACKLRING_TORCH_DONE_WORK_H

#include <torch/csrc/distributed/c10d/Work.hpp>

#include <utility>
#include <vector>

namespace jacklring {

class DoneWork : public c10d::Work {
 public:
  DoneWork(int rank, c10d::OpType op, std::vector<at::Tensor> result)
      : c10d::Work(rank, op), result_(std::move(result)) {}

  bool isCompleted() override { return true; }
  bool isSuccess() const override { return true; }
  bool wait(std::chrono::milliseconds /*timeout*/) override { return true; }
  std::vector<at::Tensor> result() override { return result_; }
  void synchronize() override {}

  c10::intrusive_ptr<c10::ivalue::Future> getFuture() override {
    auto future = c10::make_intrusive<c10::ivalue::Future>(c10::ListType::create(c10::TensorType::get()));
    future->markCompleted(c10::IValue(result_));
    return future;
  }

 private:
  std::vector<at::Tensor> result_;
};

}  // namespace jacklring

#endif
