// The Work of a native collective queued on the backend's communication thread: completed
// there (its Future too, whose callbacks, DDP's among them, run on that thread as gloo's do).
// wait() honours its timeout; an error is the exception the Python group raises for it (built
// once, by the one conversion place, on the communication thread).
#ifndef JACKLRING_TORCH_NATIVE_WORK_H
#define JACKLRING_TORCH_NATIVE_WORK_H

#include <ATen/core/ivalue.h>
#include <c10/util/Exception.h>
#include <torch/csrc/distributed/c10d/Work.hpp>

#include <string>
#include <utility>
#include <vector>

namespace jacklring {

class NativeWork : public c10d::Work {
 public:
  NativeWork(int rank, c10d::OpType op, std::string what, std::vector<at::Tensor> result)
      : c10d::Work(rank, op),
        what_(std::move(what)),
        result_(std::move(result)),
        future_(c10::make_intrusive<c10::ivalue::Future>(c10::ListType::create(c10::TensorType::get()))) {}

  // Called once, on the communication thread.
  void complete(std::exception_ptr error) {
    // The future first (its callbacks run here), then the Work: once wait() returns, the
    // future is done too (docs/torch.md's Work/Future contract; gloo's order).
    if (error) {
      future_->setError(error);
    } else {
      future_->markCompleted(c10::IValue(result_));
    }
    finish(error);  // the base's completed_/exception_ under its mutex, waiters woken
  }

  bool wait(std::chrono::milliseconds timeout) override {
    std::unique_lock<std::mutex> lock(mutex_);
    if (timeout == kNoTimeout) {
      cv_.wait(lock, [this] { return completed_; });
    } else if (!cv_.wait_for(lock, timeout, [this] { return completed_; })) {
      C10_THROW_ERROR(DistBackendError, "rank " + std::to_string(rank_) + ": Timed out waiting " +
                                            std::to_string(timeout.count()) + "ms for " + what_ +
                                            " to complete (the timeout given to Work.wait)");
    }
    if (exception_) {
      std::rethrow_exception(exception_);
    }
    return true;
  }
  // As the Python group's Works: waits, and raises the op's error.
  std::vector<at::Tensor> result() override {
    wait(kNoTimeout);
    return result_;
  }
  void synchronize() override {}
  c10::intrusive_ptr<c10::ivalue::Future> getFuture() override { return future_; }

 private:
  std::string what_;
  std::vector<at::Tensor> result_;
  c10::intrusive_ptr<c10::ivalue::Future> future_;
};

}  // namespace jacklring

#endif
