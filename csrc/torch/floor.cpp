// Do-nothing collectives: each returns a finished Work over its output (floor.h).
#include "floor.h"

#include "done_work.h"

namespace jacklring {

c10::intrusive_ptr<c10d::Work> FloorBackend::allreduce(std::vector<at::Tensor>& tensors,
                                                       const c10d::AllreduceOptions& /*opts*/) {
  return c10::make_intrusive<DoneWork>(getRank(), c10d::OpType::ALLREDUCE, tensors);
}

c10::intrusive_ptr<c10d::Work> FloorBackend::broadcast(std::vector<at::Tensor>& tensors,
                                                       const c10d::BroadcastOptions& /*opts*/) {
  return c10::make_intrusive<DoneWork>(getRank(), c10d::OpType::BROADCAST, tensors);
}

c10::intrusive_ptr<c10d::Work> FloorBackend::_allgather_base(at::Tensor& output, at::Tensor& /*input*/,
                                                             const c10d::AllgatherOptions& /*opts*/) {
  return c10::make_intrusive<DoneWork>(getRank(), c10d::OpType::_ALLGATHER_BASE, std::vector<at::Tensor>{output});
}

c10::intrusive_ptr<c10d::Work> FloorBackend::_reduce_scatter_base(at::Tensor& output, at::Tensor& /*input*/,
                                                                  const c10d::ReduceScatterOptions& /*opts*/) {
  return c10::make_intrusive<DoneWork>(getRank(), c10d::OpType::_REDUCE_SCATTER_BASE,
                                       std::vector<at::Tensor>{output});
}

c10::intrusive_ptr<c10d::Work> FloorBackend::barrier(const c10d::BarrierOptions& /*opts*/) {
  return c10::make_intrusive<DoneWork>(getRank(), c10d::OpType::BARRIER, std::vector<at::Tensor>{});
}

}  // namespace jacklring
