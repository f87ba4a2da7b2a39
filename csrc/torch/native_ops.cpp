// JacklringBackend's native routes (backend.h): which ops run on the shared-memory engine, how
// they are numbered, and where they run (the caller's thread or the communication thread).
#include "backend.h"

#include <torch/csrc/Exceptions.h>
#include <torch/csrc/utils/pybind.h>

#include <map>
#include <utility>

#include "done_work.h"
#include "native_work.h"

namespace py = pybind11;

namespace jacklring {

namespace {

// The Python group's names of the engine's reductions (by jl_op), for error messages.
const char* const kOpNames[] = {"SUM", "PRODUCT", "MAX", "MIN", "BAND", "BOR", "BXOR"};

bool interpreter_alive() { return Py_IsInitialized() && !_Py_IsFinalizing(); }

}  // namespace

void JacklringBackend::drain_native_queue() {
  if (interpreter_alive() && PyGILState_Check()) {
    py::gil_scoped_release nogil;  // a task may need the GIL (its error, a future's callback)
    queue_.drain();
  } else {
    queue_.drain();
  }
}

bool JacklringBackend::native_ready(int32_t* size) const {
  std::lock_guard<std::mutex> lock(native_mutex_);
  if (native_ == nullptr) {
    return false;
  }
  *size = native_->size();
  return true;
}

void JacklringBackend::catch_up_with_python() {
  if (!delegated_since_idle_.load(std::memory_order_relaxed)) {
    return;
  }
  py::gil_scoped_acquire gil;
  delegate_.attr("wait_collectives_idle")();
  delegated_since_idle_.store(false, std::memory_order_relaxed);
}

std::exception_ptr JacklringBackend::failure(const std::string& what, const NativeOutcome& outcome) {
  py::gil_scoped_acquire gil;
  try {
    if (outcome.code == JL_INTERRUPTED && PyErr_Occurred()) {
      throw py::error_already_set();  // a signal handler raised (KeyboardInterrupt): that error
    }
    const jl_status& st = outcome.status;
    py::tuple status = py::make_tuple(st.code, st.peer, st.culprit, st.fd, st.sys_errno, st.step, st.peer_step,
                                      py::bytes(reinterpret_cast<const char*>(st.header), JL_HEADER_BYTES));
    delegate_.attr("native_failure")(what, status,
                                     py::bytes(reinterpret_cast<const char*>(outcome.header), JL_HEADER_BYTES));
    throw std::runtime_error("jacklring: native_failure returned instead of raising");
  } catch (py::error_already_set& error) {
    // torch's python_error keeps the exception object and raises it again each time torch's
    // bindings meet it (wait(), exception(), future.wait()); pybind11's may be raised once only.
    error.restore();
    python_error kept;
    kept.persist();
    return std::make_exception_ptr(std::move(kept));
  } catch (...) {
    return std::current_exception();
  }
}

c10::intrusive_ptr<c10d::Work> JacklringBackend::run_native(c10d::OpType type, std::string what,
                                                            std::vector<at::Tensor> result, bool async,
                                                            NativeRun run) {
  catch_up_with_python();
  sequence_.fetch_add(1, std::memory_order_relaxed);
  // The header's sequence number is taken when the collective runs (the engine's counter), so
  // ops issued from callbacks on the communication thread count in the order they run.
  auto execute = [this, run = std::move(run)](NativeOutcome* outcome) {
    std::lock_guard<std::mutex> lock(native_mutex_);
    if (native_ == nullptr) {
      outcome->code = JL_SELF_BROKEN;  // disabled in between: the group was shut down
      outcome->status.code = JL_SELF_BROKEN;
      outcome->status.peer = -1;
      outcome->status.culprit = -1;
      return;
    }
    run(*native_, outcome);
  };
  // An op issued from a future's callback on the communication thread runs right there (the
  // callback may wait for it, and nothing else could run it meanwhile).
  if (!async || queue_.on_thread()) {
    drain_native_queue();  // issue order: the queued ops of this group go first
    NativeOutcome outcome;
    execute(&outcome);
    if (outcome.code != JL_OK) {
      std::rethrow_exception(failure(what, outcome));
    }
    return c10::make_intrusive<DoneWork>(getRank(), type, std::move(result));
  }
  auto work = c10::make_intrusive<NativeWork>(getRank(), type, what, std::move(result));
  queue_.push([this, work, what = std::move(what), execute = std::move(execute)]() {
    NativeOutcome outcome;
    std::exception_ptr error;
    try {
      execute(&outcome);
      if (outcome.code != JL_OK) {
        error = failure(what, outcome);
      }
    } catch (...) {
      error = std::current_exception();  // a copy-back or an allocation failed
    }
    work->complete(error);
  });
  return work;
}

c10::intrusive_ptr<c10d::Work> JacklringBackend::native_allreduce(std::vector<at::Tensor>& tensors,
                                                                  const c10d::ReduceOp& op, bool async,
                                                                  bool coalesced) {
  int32_t size = 0;
  if (tensors.empty() || (!coalesced && tensors.size() != 1) || !native_ready(&size)) {
    return nullptr;
  }
  // The Python path's grouping (ops.all_reduce_coalesced): one all-reduce per dtype, in the
  // order the dtypes first appear, over the tensors packed end to end (one alone as it is).
  std::vector<std::vector<at::Tensor>> groups;
  std::map<at::ScalarType, size_t> slot;
  int code = -1;
  for (const at::Tensor& t : tensors) {
    if (!NativeEngine::takes(t) || (code = NativeEngine::op_of(op, NativeEngine::dtype_of(t))) < 0) {
      return nullptr;
    }
    auto found = slot.emplace(t.scalar_type(), groups.size());
    if (found.second) {
      groups.emplace_back();
    }
    groups[found.first->second].push_back(t);
  }
  std::string what = std::string(coalesced ? "allreduce_coalesced(" : "allreduce(") + kOpNames[code] + ")";
  const c10d::OpType type = coalesced ? c10d::OpType::ALLREDUCE_COALESCED : c10d::OpType::ALLREDUCE;
  if (groups.size() == 1 && groups[0].size() == 1) {
    at::Tensor t = groups[0][0];
    return run_native(type, std::move(what), tensors, async,
                      [t, code](NativeEngine& e, NativeOutcome* out) mutable {
                        e.all_reduce(t, code, out);
                      });
  }
  return run_native(type, std::move(what), tensors, async,
                    [groups, code](NativeEngine& e, NativeOutcome* out) {
                      for (const auto& group : groups) {
                        if (group.size() == 1) {
                          at::Tensor t = group[0];
                          e.all_reduce(t, code, out);
                        } else {
                          std::vector<at::Tensor> flat_parts;
                          for (const at::Tensor& t : group) {
                            flat_parts.push_back(t.reshape(-1));
                          }
                          at::Tensor flat = at::cat(flat_parts);
                          e.all_reduce(flat, code, out);
                          if (out->code == JL_OK) {
                            int64_t offset = 0;
                            for (const at::Tensor& t : group) {
                              const int64_t n = t.numel();
                              at::Tensor(t).copy_(flat.slice(0, offset, offset + n).view(t.sizes()));
                              offset += n;
                            }
                          }
                        }
                        if (out->code != JL_OK) {
                          return;
                        }
                      }
                    });
}

c10::intrusive_ptr<c10d::Work> JacklringBackend::native_broadcast(std::vector<at::Tensor>& tensors,
                                                                  const c10d::BroadcastOptions& opts) {
  int32_t size = 0;
  if (tensors.size() != 1 || opts.rootTensor != 0 || !NativeEngine::takes(tensors[0]) || !native_ready(&size) ||
      opts.rootRank < 0 || opts.rootRank >= size) {
    return nullptr;
  }
  const auto root = static_cast<int32_t>(opts.rootRank);
  at::Tensor t = tensors[0];
  return run_native(c10d::OpType::BROADCAST, "broadcast(root " + std::to_string(root) + ")", tensors, opts.asyncOp,
                    [t, root](NativeEngine& e, NativeOutcome* out) mutable {
                      e.broadcast(t, root, out);
                    });
}

c10::intrusive_ptr<c10d::Work> JacklringBackend::native_allgather(std::vector<at::Tensor>& outputs,
                                                                  std::vector<at::Tensor>& inputs, bool async,
                                                                  bool coalesced) {
  int32_t size = 0;
  if (outputs.empty() || outputs.size() != inputs.size() || !native_ready(&size)) {
    return nullptr;
  }
  for (size_t i = 0; i < outputs.size(); ++i) {
    const at::Tensor &out = outputs[i], &in = inputs[i];
    if (!NativeEngine::takes(out) || !NativeEngine::takes(in) || out.scalar_type() != in.scalar_type() ||
        out.numel() != size * in.numel()) {
      return nullptr;  // the Python group's checks and messages
    }
  }
  std::vector<at::Tensor> outs = outputs, ins = inputs;
  return run_native(coalesced ? c10d::OpType::COALESCED : c10d::OpType::_ALLGATHER_BASE,
                    coalesced ? "all_gather_into_tensor_coalesced" : "all_gather_into_tensor", outputs, async,
                    [outs, ins](NativeEngine& e, NativeOutcome* out) mutable {
                      for (size_t i = 0; i < outs.size() && out->code == JL_OK; ++i) {
                        e.all_gather(outs[i], ins[i], out);
                      }
                    });
}

c10::intrusive_ptr<c10d::Work> JacklringBackend::native_allgather_list(std::vector<std::vector<at::Tensor>>& outputs,
                                                                       std::vector<at::Tensor>& inputs, bool async) {
  int32_t size = 0;
  if (outputs.size() != 1 || inputs.size() != 1 || !native_ready(&size) ||
      outputs[0].size() != static_cast<size_t>(size) || !NativeEngine::takes(inputs[0])) {
    return nullptr;
  }
  const at::Tensor input = inputs[0];
  for (const at::Tensor& t : outputs[0]) {
    // Even blocks only: the Python path pads uneven ones (ops.all_gather_list).
    if (!NativeEngine::takes(t) || t.scalar_type() != input.scalar_type() || t.numel() != input.numel()) {
      return nullptr;
    }
  }
  std::vector<at::Tensor> outs = outputs[0];
  return run_native(c10d::OpType::ALLGATHER, "allgather", outs, async,
                    [outs, input](NativeEngine& e, NativeOutcome* out) {
                      const int64_t n = input.numel();
                      at::Tensor gathered = at::empty({static_cast<int64_t>(outs.size()) * n}, input.options());
                      e.all_gather(gathered, input, out);
                      for (size_t q = 0; q < outs.size() && out->code == JL_OK; ++q) {
                        const auto start = static_cast<int64_t>(q) * n;
                        at::Tensor(outs[q]).copy_(gathered.slice(0, start, start + n).view(outs[q].sizes()));
                      }
                    });
}

c10::intrusive_ptr<c10d::Work> JacklringBackend::native_reduce_scatter(std::vector<at::Tensor>& outputs,
                                                                       std::vector<at::Tensor>& inputs,
                                                                       const c10d::ReduceOp& op, bool async,
                                                                       bool coalesced) {
  int32_t size = 0;
  if (outputs.empty() || outputs.size() != inputs.size() || !native_ready(&size)) {
    return nullptr;
  }
  int code = -1;
  for (size_t i = 0; i < outputs.size(); ++i) {
    const at::Tensor &out = outputs[i], &in = inputs[i];
    if (!NativeEngine::takes(out) || !NativeEngine::takes(in) || out.scalar_type() != in.scalar_type() ||
        in.numel() != size * out.numel() || (code = NativeEngine::op_of(op, NativeEngine::dtype_of(out))) < 0) {
      return nullptr;
    }
  }
  std::string what = std::string(coalesced ? "reduce_scatter_tensor_coalesced(" : "reduce_scatter_tensor(") +
                     kOpNames[code] + ")";
  std::vector<at::Tensor> outs = outputs, ins = inputs;
  return run_native(coalesced ? c10d::OpType::REDUCE_SCATTER_TENSOR_COALESCED : c10d::OpType::_REDUCE_SCATTER_BASE,
                    std::move(what), outputs, async,
                    [outs, ins, code](NativeEngine& e, NativeOutcome* out) mutable {
                      for (size_t i = 0; i < outs.size() && out->code == JL_OK; ++i) {
                        e.reduce_scatter(outs[i], ins[i], code, out);
                      }
                    });
}

c10::intrusive_ptr<c10d::Work> JacklringBackend::native_barrier(bool async) {
  int32_t size = 0;
  if (!native_ready(&size)) {
    return nullptr;
  }
  return run_native(c10d::OpType::BARRIER, "barrier", {}, async,
                    [](NativeEngine& e, NativeOutcome* out) { e.barrier(out); });
}

}  // namespace jacklring
