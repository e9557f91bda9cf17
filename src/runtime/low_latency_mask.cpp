// Rank masking of the low-latency mode (enable_shrink; semantics.md section 9, kernels/low_latency/shrink.cuh): the
// shrink budget and the three mask calls. The mask is NvlControl::ll_mask in this rank's device memory, so that the
// kernels read it when they run (graph replays included); the calls below are stream-ordered memory operations on it
// and capturable in a CUDA graph.
#include <cmath>
#include <cstdlib>
#include <cstring>

#include "runtime/buffer_impl.hpp"
#include "runtime/cuda_check.hpp"
#include "runtime/ops.hpp"
#include "runtime/shrink.hpp"
#include "runtime/validate.hpp"

namespace epx {

namespace {
constexpr double kMaxShrinkSeconds = 1e7;  // as set_timeout's bound
}  // namespace

double shrink_timeout_seconds(double option_s, const char* env_value) {
  double env_s = 0;
  if (env_value != nullptr && env_value[0] != '\0') {
    char* end = nullptr;
    env_s = std::strtod(env_value, &end);
    if (end == env_value || *end != '\0' || !std::isfinite(env_s) || env_s <= 0 || env_s >= kMaxShrinkSeconds)
      raise(Status::kInvalidArgument, "EPX_LL_SHRINK_TIMEOUT_S must be a number of seconds in (0, 1e7), got '",
            env_value, "'");
  }
  EPX_REQUIRE(!std::isnan(option_s) && option_s < kMaxShrinkSeconds,
              "shrink_timeout_s must be < 1e7 seconds (<= 0: ", "the default), got ", option_s);
  if (option_s > 0) return option_s;
  return env_s > 0 ? env_s : kDefaultShrinkTimeoutSeconds;
}

RankMask Buffer::Impl::rank_mask() const {
  if (!shrink) return RankMask{nullptr, 0};
  return RankMask{control()->ll_mask, uint64_t(shrink_timeout_s * 1e9)};
}

bool Buffer::shrink_enabled() const { return impl_->shrink; }
double Buffer::shrink_timeout() const { return impl_->shrink_timeout_s; }

namespace low_latency {
namespace {

void require_shrink(const Buffer::Impl& b, const char* op) {
  EPX_REQUIRE(b.shrink, op, ": the buffer was created without enable_shrink (rank masking)");
}

// A mask that changes while a call waits to be received would leave that call's signals half-written: the send
// and the receive would disagree on which ranks take part.
void require_no_call_waiting(const Buffer::Impl& b, const char* op) {
  for (int set = 0; set < 2; ++set)
    EPX_REQUIRE(b.ll_waiting[set] == 0, op, ": a low-latency call sent on buffer set ", set,
                " has not been received yet; change the mask between calls");
}

}  // namespace

void update_mask(Buffer::Impl& b, int rank, bool mask, cudaStream_t stream, const char* op) {
  require_shrink(b, op);
  EPX_REQUIRE(rank >= 0 && rank < b.num_ranks, op, ": rank must be in [0, ", b.num_ranks, "), got ", rank);
  require_no_call_waiting(b, op);
  // The word becomes 1 (mask) or 0: zeroed, then its lowest byte set (little-endian), two memsets on the stream.
  int32_t* word = b.control()->ll_mask + rank;
  b.check_launch(cudaMemsetAsync(word, 0, sizeof(int32_t), stream), op);
  if (mask) b.check_launch(cudaMemsetAsync(word, 1, 1, stream), op);
  if (!mask) b.ll_clean_needed = true;
}

void query_mask(Buffer::Impl& b, int32_t* out, cudaStream_t stream, const char* op) {
  require_shrink(b, op);
  EPX_REQUIRE(out != nullptr && reinterpret_cast<uintptr_t>(out) % alignof(int32_t) == 0, op,
              ": mask_status must be a 4-byte aligned device pointer to num_ranks int32");
  b.check_launch(cudaMemcpyAsync(out, b.control()->ll_mask, sizeof(int32_t) * size_t(b.num_ranks),
                                 cudaMemcpyDeviceToDevice, stream),
                 op);
}

void clean_mask(Buffer::Impl& b, cudaStream_t stream, const char* op) {
  require_shrink(b, op);
  require_no_call_waiting(b, op);
  b.check_launch(cudaMemsetAsync(b.control()->ll_mask, 0, sizeof(int32_t) * size_t(b.num_ranks), stream), op);
  b.ll_clean_needed = true;
}

}  // namespace low_latency
}  // namespace epx
