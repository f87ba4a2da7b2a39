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
  delegated_since_idle_.store(true, std::memory_order_relaxed);
  sequence_.fetch_add(1, std::memory_order_relaxed);
  py::gil_scoped_acquire gil;
  py::object work = delegate_.attr(method)(std::forward<Args>(args)...);
  return c10::make_intrusive<DelegatedWork>(getRank(), op, std::move(work));
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
    std::lock_guard<std::mutex> lock(native_mutex_);
    gone = std::move(native_);
  }
  keepalive_ = py::object();
}

bool JacklringBackend::native_enabled() const {
  std::lock_guard<std::mutex> lock(native_mutex_);
  return native_ != nullptr;
}

bool JacklringBackend::native_all_reduce(at::Tensor& tensor, const c10d::ReduceOp& op) {
  if (!tensor.device().is_cpu() || tensor.is_sparse()) {
    return false;
  }
  const int dtype = NativeEngine::dtype_of(tensor);
  const int code = dtype < 0 ? -1 : NativeEngine::op_of(op, dtype);
  if (code < 0) {
    return false;
  }
  if (delegated_since_idle_.load(std::memory_order_relaxed)) {
    // An op handed to the Python group may still be queued: it goes first, on every rank.
    py::gil_scoped_acquire gil;
    delegate_.attr("wait_collectives_idle")();
    delegated_since_idle_.store(false, std::memory_order_relaxed);
  }
  unsigned char header[JL_HEADER_BYTES];
  jl_status status{};
  int result;
  {
    std::lock_guard<std::mutex> lock(native_mutex_);
    if (native_ == nullptr) {
      return false;
    }
    result = native_->all_reduce(tensor, dtype, code, header, &status);
  }
  if (result != JL_OK) {
    // The Python group words the status as its own path does and raises it (pybind11 carries
    // that exception to the caller unchanged).
    py::gil_scoped_acquire gil;
    if (result == JL_INTERRUPTED && PyErr_Occurred()) {
      throw py::error_already_set();  // a signal handler raised (KeyboardInterrupt): that error
    }
    py::tuple st = py::make_tuple(status.code, status.peer, status.culprit, status.fd, status.sys_errno,
                                  status.step, status.peer_step,
                                  py::bytes(reinterpret_cast<const char*>(status.header), JL_HEADER_BYTES));
    delegate_.attr("native_failure")("allreduce", code, st,
                                     py::bytes(reinterpret_cast<const char*>(header), JL_HEADER_BYTES));
    throw std::runtime_error("jacklring: native_failure returned instead of raising");
  }
  return true;
}

c10::intrusive_ptr<c10d::Work> JacklringBackend::broadcast(std::vector<at::Tensor>& tensors,
                                                           const c10d::BroadcastOptions& opts) {
  return delegated(c10d::OpType::BROADCAST, "broadcast", tensors, opts);
}

c10::intrusive_ptr<c10d::Work> JacklringBackend::allreduce(std::vector<at::Tensor>& tensors,
                                                           const c10d::AllreduceOptions& opts) {
  // Synchronous calls (async_op=False) run here; asynchronous ones (DDP's bucket all-reduces)
  // go to the Python group's communication thread, so backward keeps overlapping them.
  if (!opts.asyncOp && tensors.size() == 1 && native_all_reduce(tensors[0], opts.reduceOp)) {
    sequence_.fetch_add(1, std::memory_order_relaxed);
    return c10::make_intrusive<DoneWork>(getRank(), c10d::OpType::ALLREDUCE, tensors);
  }
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
  disable_native();  // before the Python group closes the segment
  delegate_.attr("shutdown")();
}

void JacklringBackend::abort() {
  py::gil_scoped_acquire gil;
  disable_native();
  delegate_.attr("abort")();
}

}  // namespace jacklring
