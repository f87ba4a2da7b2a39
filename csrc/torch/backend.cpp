// JacklringBackend: torch's entry points, each handed to the Python group (backend.h).
#include "backend.h"

#include "delegated_work.h"

#include <torch/csrc/utils/pybind.h>

#include <utility>

namespace py = pybind11;

namespace jacklring {

JacklringBackend::JacklringBackend(int rank, int size, py::object delegate)
    : c10d::Backend(rank, size), delegate_(std::move(delegate)) {}

JacklringBackend::~JacklringBackend() {
  // The last reference may go on any thread; after finalization there is nothing to release.
  if (Py_IsInitialized() && !_Py_IsFinalizing()) {
    py::gil_scoped_acquire gil;
    delegate_ = py::object();
  } else {
    delegate_.release();
  }
}

template <typename... Args>
c10::intrusive_ptr<c10d::Work> JacklringBackend::delegated(c10d::OpType op, const char* method, Args&&... args) {
  py::gil_scoped_acquire gil;
  py::object work = delegate_.attr(method)(std::forward<Args>(args)...);
  return c10::make_intrusive<DelegatedWork>(getRank(), op, std::move(work));
}

c10::intrusive_ptr<c10d::Work> JacklringBackend::broadcast(std::vector<at::Tensor>& tensors,
                                                           const c10d::BroadcastOptions& opts) {
  return delegated(c10d::OpType::BROADCAST, "broadcast", tensors, opts);
}

c10::intrusive_ptr<c10d::Work> JacklringBackend::allreduce(std::vector<at::Tensor>& tensors,
                                                           const c10d::AllreduceOptions& opts) {
  return delegated(c10d::OpType::ALLREDUCE, "allreduce", tensors, opts);
}

c10::intrusive_ptr<c10d::Work> JacklringBackend::allreduce_sparse(std::vector<at::Tensor>& tensors,
                                                                  const c10d::AllreduceOptions& opts) {
  return delegated(c10d::OpType::_ALLREDUCE_SPARSE, "allreduce", tensors, opts);
}

c10::intrusive_ptr<c10d::Work> JacklringBackend::allreduce_coalesced(std::vector<at::Tensor>& tensors,
                                                                     const c10d::AllreduceCoalescedOptions& opts) {
  return delegated(c10d::OpType::ALLREDUCE_COALESCED, "allreduce_coalesced", tensors, opts);
}

c10::intrusive_ptr<c10d::Work> JacklringBackend::reduce(std::vector<at::Tensor>& tensors,
                                                        const c10d::ReduceOptions& opts) {
  return delegated(c10d::OpType::REDUCE, "reduce", tensors, opts);
}

c10::intrusive_ptr<c10d::Work> JacklringBackend::allgather(std::vector<std::vector<at::Tensor>>& outputs,
                                                           std::vector<at::Tensor>& inputs,
                                                           const c10d::AllgatherOptions& opts) {
  return delegated(c10d::OpType::ALLGATHER, "allgather", outputs, inputs, opts);
}

c10::intrusive_ptr<c10d::Work> JacklringBackend::_allgather_base(at::Tensor& output, at::Tensor& input,
                                                                 const c10d::AllgatherOptions& opts) {
  return delegated(c10d::OpType::_ALLGATHER_BASE, "all_gather_single", output, input, opts);
}

c10::intrusive_ptr<c10d::Work> JacklringBackend::allgather_coalesced(std::vector<std::vector<at::Tensor>>& outputs,
                                                                     std::vector<at::Tensor>& inputs,
                                                                     const c10d::AllgatherOptions& opts) {
  return delegated(c10d::OpType::ALLGATHER_COALESCED, "allgather_coalesced", outputs, inputs, opts);
}

c10::intrusive_ptr<c10d::Work> JacklringBackend::allgather_into_tensor_coalesced(
    std::vector<at::Tensor>& outputs, std::vector<at::Tensor>& inputs, const c10d::AllgatherOptions& opts) {
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
  return delegated(c10d::OpType::_REDUCE_SCATTER_BASE, "reduce_scatter_single", output, input, opts);
}

c10::intrusive_ptr<c10d::Work> JacklringBackend::reduce_scatter_tensor_coalesced(
    std::vector<at::Tensor>& outputs, std::vector<at::Tensor>& inputs, const c10d::ReduceScatterOptions& opts) {
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
  return delegated(c10d::OpType::BARRIER, "barrier", opts);
}

void JacklringBackend::monitoredBarrier(const c10d::BarrierOptions& opts, bool wait_all_ranks) {
  py::gil_scoped_acquire gil;
  delegate_.attr("monitored_barrier")(opts, wait_all_ranks);
}

void JacklringBackend::shutdown() {
  py::gil_scoped_acquire gil;
  delegate_.attr("shutdown")();
}

void JacklringBackend::abort() {
  py::gil_scoped_acquire gil;
  delegate_.attr("abort")();
}

}  // namespace jacklring
