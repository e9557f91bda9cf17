// Device versions of the row generators: same payload functions as the host ones (gen_rows.hpp).
#include <cuda_runtime.h>

#include <stdexcept>
#include <string>

#include "gen.hpp"
#include "gen_rows.hpp"

namespace epx::harness {
namespace {

constexpr int kThreads = 256;

// One block per token; bases are per row, elements per thread.
__global__ void bf16_rows_kernel(uint64_t seed, int rank, int hidden, uint16_t* out) {
  const int t = blockIdx.x;
  const uint64_t base = rows::bf16_row_base(seed, rank, t);
  for (int h = threadIdx.x; h < hidden; h += blockDim.x) out[int64_t(t) * hidden + h] = rows::bf16_element(base, h);
}

__global__ void fp8_rows_kernel(uint64_t seed, int rank, int hidden, uint8_t* out) {
  const int t = blockIdx.x;
  const uint64_t base = rows::fp8_row_base(seed, rank, t);
  for (int h = threadIdx.x; h < hidden; h += blockDim.x) out[int64_t(t) * hidden + h] = rows::fp8_element(base, h);
}

__global__ void scales_kernel(uint64_t seed, int rank, int num_scales, int64_t stride_token, int64_t stride_group,
                              float* out) {
  const int t = blockIdx.x;
  const uint64_t base = rows::scale_row_base(seed, rank, t);
  for (int i = threadIdx.x; i < num_scales; i += blockDim.x)
    out[t * stride_token + i * stride_group] = rows::scale_element(base, i);
}

void check_launch(const char* what) {
  const cudaError_t e = cudaGetLastError();
  if (e != cudaSuccess) throw std::runtime_error(std::string(what) + ": " + cudaGetErrorString(e));
}

}  // namespace

void fill_bf16_rows_device(uint64_t seed, int rank, int num_tokens, int hidden, uint16_t* rows, cudaStream_t stream) {
  if (num_tokens == 0) return;
  bf16_rows_kernel<<<num_tokens, kThreads, 0, stream>>>(seed, rank, hidden, rows);
  check_launch("fill_bf16_rows_device");
}

void fill_fp8_rows_device(uint64_t seed, int rank, int num_tokens, int hidden, uint8_t* rows, cudaStream_t stream) {
  if (num_tokens == 0) return;
  fp8_rows_kernel<<<num_tokens, kThreads, 0, stream>>>(seed, rank, hidden, rows);
  check_launch("fill_fp8_rows_device");
}

void fill_scales_device(uint64_t seed, int rank, int num_tokens, int num_scales, float* scales, int64_t stride_token,
                        int64_t stride_group, cudaStream_t stream) {
  if (num_tokens == 0 || num_scales == 0) return;
  scales_kernel<<<num_tokens, kThreads, 0, stream>>>(seed, rank, num_scales, stride_token, stride_group, scales);
  check_launch("fill_scales_device");
}

}  // namespace epx::harness
