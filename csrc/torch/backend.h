// The "jacklring" c10d::Backend: torch's C++ dispatcher calls it directly. An operation it
// cannot run natively is handed, in issue order, to the Python process group of the same
// ranks (adapter/torch_backend/process_group.py) with the GIL held; its Work is a
// DelegatedWork over the Python one. Native operations (same-host groups on the shared-memory
// engine, native_ops.cpp) run on the calling thread when the caller waits (async_op=False) and
// on the backend's communication thread otherwise. Which path an op takes depends only on what
// every rank agrees on (the op, its dtypes, shapes, reduction and root, the group), never on
// async_op; native and Python ops count on the engine's one sequence counter (jl_next_sequence,
// the number in every header).
#ifndef JACKLRING_TORCH_BACKEND_H
#define JACKLRING_TORCH_BACKEND_H

#include <pybind11/pybind11.h>
#include <torch/csrc/distributed/c10d/Backend.hpp>

#include <atomic>
#include <functional>
#include <memory>
#include <mutex>
#include <string>
#include <vector>

#include "native.h"
#include "native_queue.h"

namespace jacklring {

// Hidden, as pybind11's own types are: it holds a py::object.
class __attribute__((visibility("hidden"))) JacklringBackend : public c10d::Backend {
 public:
  // delegate: the Python JacklringProcessGroup of exactly these ranks (called with the GIL).
  JacklringBackend(int rank, int size, pybind11::object delegate);
  ~JacklringBackend() override;

  const std::string getBackendName() const override { return "jacklring"; }
  pybind11::object delegate() const { return delegate_; }

  // Run synchronous all-reduces natively from now on, on the engine context ctx (keepalive:
  // the Python object that owns it). disable_native() stops it (before the segment closes).
  void enable_native(pybind11::capsule api, pybind11::capsule ctx, pybind11::object keepalive, double timeout_s,
                     const HeaderCodes& codes);
  void disable_native();
  bool native_enabled() const;

  c10::intrusive_ptr<c10d::Work> broadcast(std::vector<at::Tensor>& tensors,
                                           const c10d::BroadcastOptions& opts) override;
  c10::intrusive_ptr<c10d::Work> allreduce(std::vector<at::Tensor>& tensors,
                                           const c10d::AllreduceOptions& opts) override;
  c10::intrusive_ptr<c10d::Work> allreduce_sparse(std::vector<at::Tensor>& tensors,
                                                  const c10d::AllreduceOptions& opts) override;
  c10::intrusive_ptr<c10d::Work> allreduce_coalesced(std::vector<at::Tensor>& tensors,
                                                     const c10d::AllreduceCoalescedOptions& opts) override;
  c10::intrusive_ptr<c10d::Work> reduce(std::vector<at::Tensor>& tensors, const c10d::ReduceOptions& opts) override;
  c10::intrusive_ptr<c10d::Work> allgather(std::vector<std::vector<at::Tensor>>& outputs,
                                           std::vector<at::Tensor>& inputs,
                                           const c10d::AllgatherOptions& opts) override;
  c10::intrusive_ptr<c10d::Work> _allgather_base(at::Tensor& output, at::Tensor& input,
                                                 const c10d::AllgatherOptions& opts) override;
  c10::intrusive_ptr<c10d::Work> allgather_coalesced(std::vector<std::vector<at::Tensor>>& outputs,
                                                     std::vector<at::Tensor>& inputs,
                                                     const c10d::AllgatherOptions& opts) override;
  c10::intrusive_ptr<c10d::Work> allgather_into_tensor_coalesced(std::vector<at::Tensor>& outputs,
                                                                 std::vector<at::Tensor>& inputs,
                                                                 const c10d::AllgatherOptions& opts) override;
  c10::intrusive_ptr<c10d::Work> gather(std::vector<std::vector<at::Tensor>>& outputs,
                                        std::vector<at::Tensor>& inputs, const c10d::GatherOptions& opts) override;
  c10::intrusive_ptr<c10d::Work> scatter(std::vector<at::Tensor>& outputs,
                                         std::vector<std::vector<at::Tensor>>& inputs,
                                         const c10d::ScatterOptions& opts) override;
  c10::intrusive_ptr<c10d::Work> reduce_scatter(std::vector<at::Tensor>& outputs,
                                                std::vector<std::vector<at::Tensor>>& inputs,
                                                const c10d::ReduceScatterOptions& opts) override;
  c10::intrusive_ptr<c10d::Work> _reduce_scatter_base(at::Tensor& output, at::Tensor& input,
                                                      const c10d::ReduceScatterOptions& opts) override;
  c10::intrusive_ptr<c10d::Work> reduce_scatter_tensor_coalesced(std::vector<at::Tensor>& outputs,
                                                                 std::vector<at::Tensor>& inputs,
                                                                 const c10d::ReduceScatterOptions& opts) override;
  c10::intrusive_ptr<c10d::Work> alltoall_base(at::Tensor& output, at::Tensor& input,
                                               std::vector<int64_t>& output_splits,
                                               std::vector<int64_t>& input_splits,
                                               const c10d::AllToAllOptions& opts) override;
  c10::intrusive_ptr<c10d::Work> alltoall(std::vector<at::Tensor>& outputs, std::vector<at::Tensor>& inputs,
                                          const c10d::AllToAllOptions& opts) override;
  c10::intrusive_ptr<c10d::Work> send(std::vector<at::Tensor>& tensors, int dst, int tag) override;
  c10::intrusive_ptr<c10d::Work> recv(std::vector<at::Tensor>& tensors, int src, int tag) override;
  c10::intrusive_ptr<c10d::Work> recvAnysource(std::vector<at::Tensor>& tensors, int tag) override;
  c10::intrusive_ptr<c10d::Work> barrier(const c10d::BarrierOptions& opts) override;
  void monitoredBarrier(const c10d::BarrierOptions& opts, bool wait_all_ranks) override;
  // The group's collectives so far, native and handed over alike (torch's debug checks compare it).
  void setSequenceNumberForGroup() override { sequence_.store(0, std::memory_order_relaxed); }
  uint64_t getSequenceNumberForGroup() override { return sequence_.load(std::memory_order_relaxed); }
  void shutdown() override;
  void abort() override;

 private:
  template <typename... Args>
  c10::intrusive_ptr<c10d::Work> delegated(c10d::OpType op, const char* method, Args&&... args);

  // One native call: one or more engine collectives, stopping at the first failure.
  using NativeRun = std::function<void(NativeEngine&, NativeOutcome*)>;
  // Whether native ops may run (the segment is attached); the engine's group size in *size.
  bool native_ready(int32_t* size) const;
  c10::intrusive_ptr<c10d::Work> run_native(c10d::OpType type, std::string what, std::vector<at::Tensor> result,
                                            bool async, NativeRun run);
  // The first native op after ops handed to Python: wait until Python's thread is idle.
  void catch_up_with_python();
  // The exception the Python group raises for a failed native op (the one conversion place).
  std::exception_ptr failure(const std::string& what, const NativeOutcome& outcome);
  void drain_native_queue();
  // Before an op goes to the Python group (GIL held): the communication thread's queue drained.
  void hand_over();
  // The native routes (native_ops.cpp): a Work, or null when the op goes to the Python group.
  c10::intrusive_ptr<c10d::Work> native_allreduce(std::vector<at::Tensor>& tensors, const c10d::ReduceOp& op,
                                                  bool async, bool coalesced);
  c10::intrusive_ptr<c10d::Work> native_broadcast(std::vector<at::Tensor>& tensors, const c10d::BroadcastOptions& opts);
  c10::intrusive_ptr<c10d::Work> native_allgather(std::vector<at::Tensor>& outputs, std::vector<at::Tensor>& inputs,
                                                  bool async, bool coalesced);
  c10::intrusive_ptr<c10d::Work> native_allgather_list(std::vector<std::vector<at::Tensor>>& outputs,
                                                       std::vector<at::Tensor>& inputs, bool async);
  c10::intrusive_ptr<c10d::Work> native_reduce_scatter(std::vector<at::Tensor>& outputs,
                                                       std::vector<at::Tensor>& inputs, const c10d::ReduceOp& op,
                                                       bool async, bool coalesced);
  c10::intrusive_ptr<c10d::Work> native_barrier(bool async);

  pybind11::object delegate_;  // touched only with the GIL held
  pybind11::object keepalive_;  // owns the engine context; GIL held
  // The native path's state; native_mutex_ serialises native collectives with each other and
  // with disable_native (a context runs one collective at a time).
  mutable std::mutex native_mutex_;
  std::unique_ptr<NativeEngine> native_;
  // Set when an operation was handed to the Python group: it may still be queued or running on
  // its communication thread, so the next native op first waits for that thread to be idle
  // (issue order). Relaxed: only the thread issuing this group's ops reads and writes it in a
  // correct program (torch's contract: one issuing order per group).
  std::atomic<bool> delegated_since_idle_{false};
  // Relaxed: a count read for diagnostics, ordered by nothing else.
  std::atomic<uint64_t> sequence_{0};
  // Last, so it is destroyed first: its thread runs tasks that use the members above.
  NativeQueue queue_;
};

}  // namespace jacklring

#endif
