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
  // Counted here, as the Python path counts when it starts a collective (its header packs the
  // count before this one).
  const uint64_t seq = api_->next_sequence(ctx_);
  // "<HBBIQq": magic, op, dtype code, sequence, byte count, extra (little-endian, as x86/arm64
  // store). The sequence is 32 bits on the wire, as struct.pack("I") keeps it.
  const uint16_t magic = codes_.magic;
  const uint8_t code = static_cast<uint8_t>(dtype);
  const uint32_t wire_seq = static_cast<uint32_t>(seq);
  std::memcpy(out, &magic, 2);
  std::memcpy(out + 2, &op, 1);
  std::memcpy(out + 3, &code, 1);
  std::memcpy(out + 4, &wire_seq, 4);
  std::memcpy(out + 8, &nbytes, 8);
  std::memcpy(out + 16, &extra, 8);
}

int64_t NativeEngine::deadline() const {
  struct timespec now;
  clock_gettime(CLOCK_MONOTONIC, &now);
  return static_cast<int64_t>(now.tv_sec) * 1000000000LL + now.tv_nsec + timeout_ns_;
}

void NativeEngine::all_reduce(at::Tensor& tensor, int op, NativeOutcome* out) {
  // A strided tensor goes through a dense copy (the same on every rank, so routing never
  // depends on a tensor's layout).
  at::Tensor dense = tensor.is_contiguous() ? tensor : tensor.contiguous();
  const int dtype = dtype_of(dense);
  const size_t count = static_cast<size_t>(dense.numel());
  make_header(out->header, codes_.all_reduce, dtype, count * dense.element_size(), codes_.reduce[op]);
  void* data = dense.data_ptr();
  out->code = api_->all_reduce(ctx_, data, data, count, dtype, op, out->header, deadline(), &out->status);
  if (out->code == JL_OK && !dense.is_same(tensor)) {
    tensor.copy_(dense);
  }
}

void NativeEngine::all_gather(at::Tensor& output, const at::Tensor& input, NativeOutcome* out) {
  at::Tensor dst = output.is_contiguous() ? output : at::empty(output.sizes(), output.options());
  at::Tensor src = input.contiguous();
  const char* s = static_cast<const char*>(src.data_ptr());
  const char* d = static_cast<const char*>(dst.data_ptr());
  const size_t in_bytes = static_cast<size_t>(src.numel()) * src.element_size();
  const size_t out_bytes = static_cast<size_t>(dst.numel()) * dst.element_size();
  if (s < d + out_bytes && d < s + in_bytes) {
    src = src.clone();  // FSDP passes its input as a slice of the output: the engine needs them apart
  }
  const int dtype = dtype_of(src);
  const size_t count = static_cast<size_t>(src.numel());
  make_header(out->header, codes_.all_gather, dtype, in_bytes, 0);
  out->code = api_->all_gather(ctx_, src.data_ptr(), dst.data_ptr(), count, dtype, out->header, deadline(),
                               &out->status);
  if (out->code == JL_OK && !dst.is_same(output)) {
    output.copy_(dst);
  }
}

void NativeEngine::reduce_scatter(at::Tensor& output, const at::Tensor& input, int op, NativeOutcome* out) {
  at::Tensor dst = output.is_contiguous() ? output : at::empty(output.sizes(), output.options());
  at::Tensor src = input.contiguous();
  const int dtype = dtype_of(src);
  const size_t count = static_cast<size_t>(dst.numel());
  make_header(out->header, codes_.reduce_scatter, dtype, static_cast<uint64_t>(src.numel()) * src.element_size(),
              codes_.reduce[op]);
  out->code = api_->reduce_scatter(ctx_, src.data_ptr(), dst.data_ptr(), count, dtype, op, out->header, deadline(),
                                   &out->status);
  if (out->code == JL_OK && !dst.is_same(output)) {
    output.copy_(dst);
  }
}

void NativeEngine::broadcast(at::Tensor& tensor, int32_t root, NativeOutcome* out) {
  at::Tensor dense = tensor.is_contiguous() ? tensor : tensor.contiguous();
  const int dtype = dtype_of(dense);
  const size_t count = static_cast<size_t>(dense.numel());
  make_header(out->header, codes_.broadcast, dtype, count * dense.element_size(), root);
  out->code = api_->broadcast(ctx_, dense.data_ptr(), count, dtype, root, out->header, deadline(), &out->status);
  if (out->code == JL_OK && !dense.is_same(tensor)) {
    tensor.copy_(dense);
  }
}

void NativeEngine::barrier(NativeOutcome* out) {
  make_header(out->header, codes_.barrier, 0, 0, 0);
  out->code = api_->barrier(ctx_, out->header, deadline(), &out->status);
}

}  // namespace jacklring
