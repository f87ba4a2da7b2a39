// The native fast path: whole collectives of a same-host group on the shared-memory engine's C
// interface (csrc/shm/engine.h), with no GIL and no Python. Headers are byte for byte the ones
// the Python path packs for the same call (adapter/backends/ring/header.py, ring/backend.py), so
// a mismatch between ranks is detected and worded as the Python path words it, and a native op
// and a Python op of the same group may meet on the segment.
#ifndef JACKLRING_TORCH_NATIVE_H
#define JACKLRING_TORCH_NATIVE_H

#include <ATen/ATen.h>
#include <torch/csrc/distributed/c10d/Types.hpp>

#include <array>
#include <cstdint>

#include "../shm/engine.h"

namespace jacklring {

// The ring's header constants, handed over by Python (they are defined there once).
struct HeaderCodes {
  uint16_t magic = 0;
  uint8_t all_reduce = 0;
  uint8_t all_gather = 0;
  uint8_t reduce_scatter = 0;
  uint8_t broadcast = 0;
  uint8_t barrier = 0;
  std::array<int64_t, 7> reduce{};  // the ring's code of each jl_op
};

// What one native call reports: the engine's code, its status and this rank's header.
struct NativeOutcome {
  int code = JL_OK;
  jl_status status{};
  unsigned char header[JL_HEADER_BYTES] = {};
};

class NativeEngine {
 public:
  NativeEngine(const jl_api* api, jl_ctx* ctx, int64_t timeout_ns, const HeaderCodes& codes)
      : api_(api), ctx_(ctx), timeout_ns_(timeout_ns), codes_(codes) {}

  // The engine's codes for a tensor and a reduction; -1 when the native path does not take them
  // (the Python group then runs the op, with its own checks and messages).
  static int dtype_of(const at::Tensor& tensor);
  static int op_of(const c10d::ReduceOp& op, int dtype);
  // Whether a tensor may go native at all: dense, on the CPU, of a dtype the engine takes.
  static bool takes(const at::Tensor& tensor) {
    return tensor.device().is_cpu() && tensor.layout() == at::kStrided && dtype_of(tensor) >= 0;
  }
  int32_t size() const { return api_->size(ctx_); }

  // Each runs one collective whose header carries the group's next sequence number, taken from
  // the engine's one counter (jl_next_sequence), which the Python path counts on too. Tensors
  // may be strided: a dense copy goes through the engine and the result is copied back.
  void all_reduce(at::Tensor& tensor, int op, NativeOutcome* out);
  // output: size x input's elements, rank q's input at block q.
  void all_gather(at::Tensor& output, const at::Tensor& input, NativeOutcome* out);
  // input: size x output's elements; output: this rank's block reduced.
  void reduce_scatter(at::Tensor& output, const at::Tensor& input, int op, NativeOutcome* out);
  void broadcast(at::Tensor& tensor, int32_t root, NativeOutcome* out);
  void barrier(NativeOutcome* out);

 private:
  void make_header(unsigned char* out, uint8_t op, int dtype, uint64_t nbytes, int64_t extra);
  int64_t deadline() const;

  const jl_api* api_;
  jl_ctx* ctx_;
  int64_t timeout_ns_;
  HeaderCodes codes_;
};

}  // namespace jacklring

#endif
