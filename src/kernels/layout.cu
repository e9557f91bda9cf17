// get_dispatch_layout: per-token destination ranks and per-rank / per-expert counts (semantics.md section 1).
// One thread per token; counts go through shared-memory histograms, then one global atomic per bin per
// block. Out-of-range expert ids are not counted and are reported (first one wins) to the host.
#include <cuda_runtime.h>

#include "device/report.cuh"
#include "layout/intranode_params.hpp"

namespace epx {
namespace {

constexpr int kLayoutThreads = 256;

__global__ void __launch_bounds__(kLayoutThreads) layout_kernel(const __grid_constant__ LayoutParams p) {
  extern __shared__ int smem[];
  int* s_expert = smem;                    // [E]
  int* s_rank = s_expert + p.num_experts;  // [R]
  int* s_rdma = s_rank + p.num_ranks;      // [R / G]
  const int num_rdma = p.num_tokens_per_rdma_rank ? p.num_ranks / p.num_nvl_ranks : 0;
  const int bins = p.num_experts + p.num_ranks + num_rdma;
  for (int i = threadIdx.x; i < bins; i += blockDim.x) smem[i] = 0;
  __syncthreads();

  const int experts_per_rank = p.num_experts / p.num_ranks;
  constexpr int kWords = kMaxRanks / 32;
  for (int t = blockIdx.x * blockDim.x + threadIdx.x; t < p.num_tokens; t += gridDim.x * blockDim.x) {
    uint32_t ranks[kWords] = {};  // bit r: the token goes to rank r
    for (int k = 0; k < p.num_topk; ++k) {
      const int64_t e = p.topk_idx[int64_t(t) * p.num_topk + k];
      if (e == -1) continue;
      if (e < -1 || e >= p.num_experts) {
        dev::report_input_error(p.self, p.host, kErrTopkOutOfRange, kRoleLayout, t, k, e);
        continue;
      }
      atomicAdd(&s_expert[e], 1);
      const int r = int(e / experts_per_rank);
      ranks[r / 32] |= 1u << (r % 32);
    }
    uint32_t domains = 0;  // bit d: the token goes to a rank of domain d
    for (int r = 0; r < p.num_ranks; ++r) {
      const bool in = (ranks[r / 32] >> (r % 32)) & 1u;
      p.is_token_in_rank[int64_t(t) * p.num_ranks + r] = in;
      if (in) {
        atomicAdd(&s_rank[r], 1);
        domains |= 1u << (r / p.num_nvl_ranks);
      }
    }
    for (int d = 0; d < num_rdma; ++d)
      if ((domains >> d) & 1u) atomicAdd(&s_rdma[d], 1);
  }
  __syncthreads();
  for (int i = threadIdx.x; i < p.num_experts; i += blockDim.x)
    if (s_expert[i]) atomicAdd(&p.num_tokens_per_expert[i], s_expert[i]);
  for (int i = threadIdx.x; i < p.num_ranks; i += blockDim.x)
    if (s_rank[i]) atomicAdd(&p.num_tokens_per_rank[i], s_rank[i]);
  for (int i = threadIdx.x; i < num_rdma; i += blockDim.x)
    if (s_rdma[i]) atomicAdd(&p.num_tokens_per_rdma_rank[i], s_rdma[i]);
}

}  // namespace

void launch_layout(const LayoutParams& p, int num_sms, cudaStream_t stream) {
  const int num_rdma = p.num_tokens_per_rdma_rank ? p.num_ranks / p.num_nvl_ranks : 0;
  cudaMemsetAsync(p.num_tokens_per_rank, 0, sizeof(int) * p.num_ranks, stream);
  cudaMemsetAsync(p.num_tokens_per_expert, 0, sizeof(int) * p.num_experts, stream);
  if (num_rdma) cudaMemsetAsync(p.num_tokens_per_rdma_rank, 0, sizeof(int) * num_rdma, stream);
  if (p.num_tokens == 0) return;
  const size_t smem = sizeof(int) * (p.num_experts + p.num_ranks + num_rdma);
  int blocks = ceil_div(p.num_tokens, kLayoutThreads);
  if (blocks > num_sms) blocks = num_sms;
  layout_kernel<<<blocks, kLayoutThreads, smem, stream>>>(p);
}

static_assert(kMaxDomains <= 32, "domain masks are 32-bit");

}  // namespace epx
