// NativeEngine: torch tensors to the engine's calls (native.h).
#include "native.h"

#include <cstring>
#include <ctime>

namespace jacklring {

int NativeEngine::dtype_of(const at::Tensor& tensor) {
  switch (tensor.scalar_type()) {
    case at::kChar: return JL_INT8;
    case at::kShort: return JL_INT16;
    case at::kInt: return JL_INT32;
    case at::kLong: return JL_INT64;
    case at::kByte: return JL_UINT8;
    case at::kHalf: return JL_FLOAT16;
    case at::kBFloat16: return JL_BFLOAT16;
    case at::kFloat: return JL_FLOAT32;
    case at::kDouble: return JL_FLOAT64;
    default: return -1;  // bool, complex, unsigned wider types: the Python group's rules apply
  }
}

int NativeEngine::op_of(const c10d::ReduceOp& op, int dtype) {
  const bool integer = dtype >= JL_INT8 && dtype <= JL_UINT64;
  switch (op.op_) {
    case c10d::ReduceOp::SUM: return JL_SUM;
    case c10d::ReduceOp::PRODUCT: return JL_PROD;
    case c10d::ReduceOp::MAX: return JL_MAX;
    case c10d::ReduceOp::MIN: return JL_MIN;
    case c10d::ReduceOp::BAND: return integer ? JL_BAND : -1;
    case c10d::ReduceOp::BOR: return integer ? JL_BOR : -1;
    case c10d::ReduceOp::BXOR: return integer ? JL_BXOR : -1;
    default: return -1;  // AVG, PREMUL_SUM: the Python group's
  }
}

void NativeEngine::make_header(unsigned char* out, uint8_t op, int dtype, uint64_t nbytes, int64_t extra) {
  // "<HBBIQq": magic, op, dtype code, sequence, byte count, extra (little-endian, as x86/arm64 store).
  const uint16_t magic = codes_.magic;
  const uint8_t code = static_cast<uint8_t>(dtype);
  const uint32_t seq = static_cast<uint32_t>(seq_);
  std::memcpy(out, &magic, 2);
  std::memcpy(out + 2, &op, 1);
  std::memcpy(out + 3, &code, 1);
  std::memcpy(out + 4, &seq, 4);
  std::memcpy(out + 8, &nbytes, 8);
  std::memcpy(out + 16, &extra, 8);
}

int NativeEngine::all_reduce(at::Tensor& tensor, int dtype, int op, unsigned char* header, jl_status* status) {
  // A strided tensor goes through a dense copy (the same on every rank, so routing never
  // depends on a tensor's layout).
  at::Tensor dense = tensor.is_contiguous() ? tensor : tensor.contiguous();
  const size_t count = static_cast<size_t>(dense.numel());
  ++seq_;
  make_header(header, codes_.all_reduce, dtype, count * dense.element_size(), codes_.reduce[op]);
  struct timespec now;
  clock_gettime(CLOCK_MONOTONIC, &now);
  const int64_t deadline = static_cast<int64_t>(now.tv_sec) * 1000000000LL + now.tv_nsec + timeout_ns_;
  void* data = dense.data_ptr();
  const int code = api_->all_reduce(ctx_, data, data, count, dtype, op, header, deadline, status);
  if (code == JL_OK && !dense.is_same(tensor)) {
    tensor.copy_(dense);
  }
  return code;
}

}  // namespace jacklring
