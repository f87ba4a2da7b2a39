// The native fast path: whole collectives of a same-host group on the shared-memory engine's C
// interface (csrc/shm/engine.h), called on the torch caller's thread with no GIL and no Python.
// Headers follow the ring's layout (adapter/backends/ring/header.py), so a mismatch between ranks
// is detected and worded as the Python path words it.
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
  std::array<int64_t, 7> reduce{};  // the ring's code of each jl_op
};

class NativeEngine {
 public:
  NativeEngine(const jl_api* api, jl_ctx* ctx, int64_t timeout_ns, const HeaderCodes& codes)
      : api_(api), ctx_(ctx), timeout_ns_(timeout_ns), codes_(codes) {}

  // The engine's codes for a tensor and a reduction; -1 when the native path does not take them
  // (the Python group then runs the op, with its own checks and messages).
  static int dtype_of(const at::Tensor& tensor);
  static int op_of(const c10d::ReduceOp& op, int dtype);

  // In place on a dense CPU tensor; JL_OK or the engine's code, with *status filled. header
  // receives the JL_HEADER_BYTES this rank published (for the error message).
  int all_reduce(at::Tensor& tensor, int dtype, int op, unsigned char* header, jl_status* status);

 private:
  void make_header(unsigned char* out, uint8_t op, int dtype, uint64_t nbytes, int64_t extra);

  const jl_api* api_;
  jl_ctx* ctx_;
  int64_t timeout_ns_;
  HeaderCodes codes_;
  uint64_t seq_ = 0;  // this group's native collectives so far: the same count on every rank
};

}  // namespace jacklring

#endif
