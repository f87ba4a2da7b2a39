// The "torch floor": a c10d::Backend whose collectives do nothing and return a finished Work.
// Built exactly as the jacklring backend, it measures torch's own cost per call (its Python
// wrapper and C++ dispatcher), the least any backend can cost (adapter/bench.py).
#ifndef JACKLRING_TORCH_FLOOR_H
#define JACKLRING_TORCH_FLOOR_H

#include <torch/csrc/distributed/c10d/Backend.hpp>

#include <string>
#include <vector>

namespace jacklring {

class FloorBackend : public c10d::Backend {
 public:
  FloorBackend(int rank, int size) : c10d::Backend(rank, size) {}

  const std::string getBackendName() const override { return "jacklring_floor"; }

  c10::intrusive_ptr<c10d::Work> allreduce(std::vector<at::Tensor>& tensors,
                                           const c10d::AllreduceOptions& opts) override;
  c10::intrusive_ptr<c10d::Work> broadcast(std::vector<at::Tensor>& tensors,
                                           const c10d::BroadcastOptions& opts) override;
  c10::intrusive_ptr<c10d::Work> _allgather_base(at::Tensor& output, at::Tensor& input,
                                                 const c10d::AllgatherOptions& opts) override;
  c10::intrusive_ptr<c10d::Work> _reduce_scatter_base(at::Tensor& output, at::Tensor& input,
                                                      const c10d::ReduceScatterOptions& opts) override;
  c10::intrusive_ptr<c10d::Work> barrier(const c10d::BarrierOptions& opts) override;
};

}  // namespace jacklring

#endif
