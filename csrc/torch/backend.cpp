// JacklringBackend: torch's entry points, each handed to the Python group (backend.h).
#include "backend.h"

#include "delegated_work.h"
#include "done_work.h"

#include <torch/csrc/utils/pybind.h>

#include <utility>

namespace py = pybind11;

namespace jacklring {

JacklringBackend::JacklringBackend(int rank, int size, py::object delegate)
    : c10d::Backend(rank, size), delegate_(std::move(delegate)) {}

JacklringBackend::~JacklringBackend() {
  // The last reference may go on any thread: every Python reference is dropped here with the
  // GIL (members are destroyed after this body, without it); after finalization there is
  // nothing left to release.
  drain_native_queue();  // its tasks use native_
  native_.reset();
  if (Py_IsInitialized() && !_Py_IsFinalizing()) {
    py::gil_scoped_acquire gil;
    delegate_ = py::object();
    keepalive_ = py::object();
  } else {
    delegate_.release();
    keepalive_.release();
  }
}

template <typename... Args>
c10::intrusive_ptr<c10d::Work> JacklringBackend::delegated(c10d::OpType op, const char* method, Args&&... args) {
  sequence_.fetch_add(1, std::memory_order_relaxed);
  py::gil_scoped_acquire gil;
  hand_over();
  py::object work = delegate_.attr(method)(std::forward<Args>(args)...);
  return c10::make_intrusive<DelegatedWork>(getRank(), op, std::move(work));
}

void JacklringBackend::hand_over() {
  // Issue order: what the communication thread still holds goes first, on every rank.
  drain_native_queue();
  delegated_since_idle_.store(true, std::memory_order_relaxed);
}

void JacklringBackend::enable_native(py::capsule api, py::capsule ctx, py::object keepalive, double timeout_s,
                                     const HeaderCodes& codes) {
  const auto* table = static_cast<const jl_api*>(api.get_pointer());
  if (table == nullptr || table->abi_version != JL_ABI_VERSION || table->struct_size < sizeof(jl_api)) {
    throw std::runtime_error("jacklring: the shared-memory engine's C interface is another version than the "
                             "C++ torch backend was built for: rebuild it (python -m adapter.torch_backend.native)");
  }
  std::lock_guard<std::mutex> lock(native_mutex_);
  keepalive_ = std::move(keepalive);
  native_ = std::make_unique<NativeEngine>(table, static_cast<jl_ctx*>(ctx.get_pointer()),
                                           static_cast<int64_t>(timeout_s * 1e9), codes);
}

void JacklringBackend::disable_native() {
  std::unique_ptr<NativeEngine> gone;
  {
    py::gil_scoped_release nogil;  // a native op in flight may need the GIL to report its error
    queue_.drain();
    std::lock_guard<std::mutex> lock(native_mutex_);
    gone = std::move(native_);
  }
  keepalive_ = py::object();
}

bool JacklringBackend::native_enabled() const {
  std::lock_guard<std::mutex> lock(native_mutex_);
  return native_ != nullptr;
}

c10::intrusive_ptr<c10d::Work> JacklringBackend::broadcast(std::vector<at::Tensor>& tensors,
                                                           const c10d::BroadcastOptions& opts) {
  if (auto work = native_broadcast(tensors, opts)) {
    return work;
  }
  return delegated(c10d::OpType::BROADCAST, "broadcast", tensors, opts);
}

c10::intrusive_ptr<c10d::Work> JacklringBackend::allreduce(std::vector<at::Tensor>& tensors,
                                                           const c10d::AllreduceOptions& opts) {
  if (auto work = native_allreduce(tensors, opts.reduceOp, opts.asyncOp, false)) {
    return work;
  }
  return delegated(c10d::OpType::ALLREDUCE, "allreduce", tensors, opts);
}

c10::intrusive_ptr<c10d::Work> JacklringBackend::allreduce_sparse(std::vector<at::Tensor>& tensors,
                                                                  const c10d::AllreduceOptions& opts) {
  return delegated(c10d::OpType::_ALLREDUCE_SPARSE, "allreduce", tensors, opts);
}

c10::intrusive_ptr<c10d::Work> JacklringBackend::allreduce_coalesced(std::vector<at::Tensor>& tensors,
                                                                     const c10d::AllreduceCoalescedOptions& opts) {
  if (auto work = native_allreduce(tensors, opts.reduceOp, opts.asyncOp, true)) {
    return work;
  }
  return delegated(c10d::OpType::ALLREDUCE_COALESCED, "allreduce_coalesced", tensors, opts);
}

c10::intrusive_ptr<c10d::Work> JacklringBackend::reduce(std::vector<at::Tensor>& tensors,
                                                        const c10d::ReduceOptions& opts) {
  return delegated(c10d::OpType::REDUCE, "reduce", tensors, opts);
}

c10::intrusive_ptr<c10d::Work> JacklringBackend::allgather(std::vector<std::vector<at::Tensor>>& outputs,
                                                           std::vector<at::Tensor>& inputs,
                                                           const c10d::AllgatherOptions& opts) {
  if (auto work = native_allgather_list(outputs, inputs, opts.asyncOp)) {
    return work;
  }
  return delegated(c10d::OpType::ALLGATHER, "allgather", outputs, inputs, opts);
}

c10::intrusive_ptr<c10d::Work> JacklringBackend::_allgather_base(at::Tensor& output, at::Tensor& input,
                                                                 const c10d::AllgatherOptions& opts) {
  std::vector<at::Tensor> outs{output}, ins{input};
  if (auto work = native_allgather(outs, ins, opts.asyncOp, false)) {
    return work;
  }
  return delegated(c10d::OpType::_ALLGATHER_BASE, "all_gather_single", output, input, opts);
}

c10::intrusive_ptr<c10d::Work> JacklringBackend::allgather_coalesced(std::vector<std::vector<at::Tensor>>& outputs,
                                                                     std::vector<at::Tensor>& inputs,
                                                                     const c10d::AllgatherOptions& opts) {
  return delegated(c10d::OpType::ALLGATHER_COALESCED, "allgather_coalesced", outputs, inputs, opts);
}

c10::intrusive_ptr<c10d::Work> JacklringBackend::allgather_into_tensor_coalesced(
    std::vector<at::Tensor>& outputs, std::vector<at::Tensor>& inputs, const c10d::AllgatherOptions& opts) {
  if (auto work = native_allgather(outputs, inputs, opts.asyncOp, true)) {
    return work;
  }
  return delegated(c10d::OpType::COALESCED, "all_gather_single_coalesced", outputs, inputs, opts);
}

c10::intrusive_ptr<c10d::Work> JacklringBackend::gather(std::vector<std::vector<at::Tensor>>& outputs,
                                                        std::vector<at::Tensor>& inputs,
                                                        const c10d::GatherOptions& opts) {
  return delegated(c10d::OpType::GATHER, "gather", outputs, inputs, opts);
}

c10::intrusive_ptr<c10d::Work> JacklringBackend::scatter(std::vector<at::Tensor>& outputs,
                                                         std::vector<std::vector<at::Tensor>>& inputs,
                                                         const c10d::ScatterOptions& opts) {
  return delegated(c10d::OpType::SCATTER, "scatter", outputs, inputs, opts);
}

c10::intrusive_ptr<c10d::Work> JacklringBackend::reduce_scatter(std::vector<at::Tensor>& outputs,
                                                                std::vector<std::vector<at::Tensor>>& inputs,
                                                                const c10d::ReduceScatterOptions& opts) {
  return delegated(c10d::OpType::REDUCE_SCATTER, "reduce_scatter", outputs, inputs, opts);
}

c10::intrusive_ptr<c10d::Work> JacklringBackend::_reduce_scatter_base(at::Tensor& output, at::Tensor& input,
                                                                      const c10d::ReduceScatterOptions& opts) {
  std::vector<at::Tensor> outs{output}, ins{input};
  if (auto work = native_reduce_scatter(outs, ins, opts.reduceOp, opts.asyncOp, false)) {
    return work;
  }
  return delegated(c10d::OpType::_REDUCE_SCATTER_BASE, "reduce_scatter_single", output, input, opts);
}

c10::intrusive_ptr<c10d::Work> JacklringBackend::reduce_scatter_tensor_coalesced(
    std::vector<at::Tensor>& outputs, std::vector<at::Tensor>& inputs, const c10d::ReduceScatterOptions& opts) {
  if (auto work = native_reduce_scatter(outputs, inputs, opts.reduceOp, opts.asyncOp, true)) {
    return work;
  }
  return delegated(c10d::OpType::REDUCE_SCATTER_TENSOR_COALESCED, "reduce_scatter_single_coalesced", outputs,
                   inputs, opts);
}

c10::intrusive_ptr<c10d::Work> JacklringBackend::alltoall_base(at::Tensor& output, at::Tensor& input,
                                                               std::vector<int64_t>& output_splits,
                                                               std::vector<int64_t>& input_splits,
                                                               const c10d::AllToAllOptions& opts) {
  return delegated(c10d::OpType::ALLTOALL_BASE, "all_to_all_single", output, input, output_splits, input_splits,
                   opts);
}

c10::intrusive_ptr<c10d::Work> JacklringBackend::alltoall(std::vector<at::Tensor>& outputs,
                                                          std::vector<at::Tensor>& inputs,
                                                          const c10d::AllToAllOptions& opts) {
  return delegated(c10d::OpType::ALLTOALL, "alltoall", outputs, inputs, opts);
}

c10::intrusive_ptr<c10d::Work> JacklringBackend::send(std::vector<at::Tensor>& tensors, int dst, int tag) {
  return delegated(c10d::OpType::SEND, "send", tensors, dst, tag);
}

c10::intrusive_ptr<c10d::Work> JacklringBackend::recv(std::vector<at::Tensor>& tensors, int src, int tag) {
  return delegated(c10d::OpType::RECV, "recv", tensors, src, tag);
}

c10::intrusive_ptr<c10d::Work> JacklringBackend::recvAnysource(std::vector<at::Tensor>& tensors, int tag) {
  return delegated(c10d::OpType::RECVANYSOURCE, "recv_anysource", tensors, tag);
}

c10::intrusive_ptr<c10d::Work> JacklringBackend::barrier(const c10d::BarrierOptions& opts) {
  if (auto work = native_barrier(opts.asyncOp)) {
    return work;
  }
  return delegated(c10d::OpType::BARRIER, "barrier", opts);
}

void JacklringBackend::monitoredBarrier(const c10d::BarrierOptions& opts, bool wait_all_ranks) {
  py::gil_scoped_acquire gil;
  hand_over();
  delegate_.attr("monitored_barrier")(opts, wait_all_ranks);
}

void JacklringBackend::shutdown() {
  py::gil_scoped_acquire gil;
  disable_native();  // before the Python group closes the segment
  delegate_.attr("shutdown")();
}

void JacklringBackend::abort() {
  py::gil_scoped_acquire gil;
  disable_native();
  delegate_.attr("abort")();
}

}  // namespace jacklring
