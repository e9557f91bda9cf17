// A rank that does not show up: its peers' waits must fail within the budget with a diagnostic, and every
// other rank must fail soon after (abort flag) instead of hanging. Runs in its own processes because a
// device-side trap loses the CUDA context.
#include <chrono>
#include <cstdio>
#include <string>
#include <thread>
#include <vector>

#include "../../tools/harness/high_throughput.hpp"
#include "epx/launcher.hpp"
#include "gpu_test.hpp"

namespace epx::gpu_test {

// The operations a rank may fail to call: a dispatch with a layout (its notify kernel runs the epoch barrier), the
// same sized (Buffer::dispatch_sized: its data grid's last block runs the notify; at 2 ranks the sender blocks write
// records meanwhile, kernels/intranode/early_senders.cuh) and into the buffer (its last block runs the notify while
// the other blocks wait for their start words), and a cached dispatch and a combine (their data kernels run it:
// kernels/intranode/epoch_barrier.cuh).
enum class MissingOp { kDispatch, kSizedDispatch, kDispatchInBuffer, kCachedDispatch, kCombine };

const char* name_of(MissingOp op) {
  switch (op) {
    case MissingOp::kDispatch:
      return "dispatch";
    case MissingOp::kSizedDispatch:
      return "sized dispatch";
    case MissingOp::kDispatchInBuffer:
      return "dispatch into the buffer";
    case MissingOp::kCachedDispatch:
      return "cached dispatch";
    default:
      return "combine";
  }
}

// Every rank but rank 0 calls `op` only after twice the budget: rank 0's call must fail with kTimeout within the
// budget, with a message that says "timed out" and each of rank0_says; the others fail on the abort word (kRemote) or
// time out themselves.
int missing_rank(Bootstrap& bs, Buffer& buffer, harness::HtSession& s, cudaStream_t stream, double budget, MissingOp op,
                 const std::vector<std::string>& rank0_says) {
  s.layout();
  const bool with_layout =
      op == MissingOp::kDispatch || op == MissingOp::kSizedDispatch || op == MissingOp::kDispatchInBuffer;
  if (!with_layout) {  // a handle first, with every rank present
    s.dispatch();
    s.set_combine_inputs(5);
    buffer.check(stream);
  }
  cudaStreamSynchronize(stream);
  bs.barrier();
  std::string problem;
  const auto start = std::chrono::steady_clock::now();
  try {
    if (bs.rank() != 0) std::this_thread::sleep_for(std::chrono::duration<double>(2 * budget));
    if (with_layout) s.dispatch();
    if (op == MissingOp::kCachedDispatch) s.dispatch_cached();
    if (op == MissingOp::kCombine) s.combine();
    buffer.check(stream);
    problem = "no error";
  } catch (const Error& e) {
    const std::string what = e.what();
    const double took = std::chrono::duration<double>(std::chrono::steady_clock::now() - start).count();
    std::printf("[rank %d] %s failed after %.1f s as expected: %s\n", bs.rank(), name_of(op), took, what.c_str());
    if (bs.rank() == 0) {
      if (e.status() != Status::kTimeout) problem = "rank 0: want kTimeout";
      for (const std::string& says : rank0_says)
        if (what.find("timed out") == std::string::npos || what.find(says) == std::string::npos)
          problem += " rank 0: the message does not say \"timed out\" and \"" + says + "\"";
      if (took > budget + 10) problem += " rank 0: took too long";
    } else if (e.status() != Status::kRemote && e.status() != Status::kTimeout) {
      problem = "want kRemote or kTimeout";
    }
  }
  buffer.destroy();
  if (!problem.empty()) std::printf("[rank %d] FAIL (%s): %s\n", bs.rank(), name_of(op), problem.c_str());
  return problem.empty() ? 0 : 1;
}

int missing_rank_dispatch(Bootstrap& bs, Buffer& buffer, harness::HtSession& s, cudaStream_t stream, double budget,
                          const std::string& rank0_names) {
  return missing_rank(bs, buffer, s, stream, budget, MissingOp::kDispatch, {rank0_names});
}

int run_timeout_suite(int num_ranks) {
  constexpr double kBudget = 2.0;
  int rc = 0;
  for (MissingOp op : {MissingOp::kDispatch, MissingOp::kSizedDispatch, MissingOp::kDispatchInBuffer,
                       MissingOp::kCachedDispatch, MissingOp::kCombine}) {
    const LaunchResult r = launch_local(
        num_ranks,
        [&](Bootstrap& bs) -> int {
          cudaSetDevice(bs.rank());
          BufferOptions o = default_buffer_options();
          o.num_nvl_bytes = nvl_size_hint(default_dispatch_config(num_ranks), 2048 * 2, num_ranks);
          o.num_recv_bytes = recv_region_size_hint(128 * num_ranks, 2048, EPX_BF16, 0, 8);
          Buffer buffer(bs, o);
          buffer.set_timeout(kBudget);
          cudaStream_t stream;
          cudaStreamCreateWithFlags(&stream, cudaStreamNonBlocking);
          harness::HtCase c;
          c.tokens = {128};
          c.hidden = 2048;
          c.routing.num_experts = 8 * num_ranks;  // a multiple of any rank count
          c.in_buffer = op == MissingOp::kDispatchInBuffer;
          c.sized = op == MissingOp::kSizedDispatch;
          c.sized_offset = {harness::HtCase::kLargest};
          harness::HtSession s(buffer, c, default_dispatch_config(num_ranks), default_combine_config(num_ranks),
                               stream);
          // Rank 0's epoch barrier names the rank it waited for.
          return missing_rank(bs, buffer, s, stream, kBudget, op, {"rank 0 notify", "to reach the same operation"});
        },
        120, 60);
    std::printf("[%s] timeout: a rank missing from a %s fails every rank's call with a diagnostic (%d ranks)\n",
                r.num_failed == 0 ? "PASS" : "FAIL", name_of(op), num_ranks);
    if (r.num_failed) std::printf("%s", r.summary.c_str());
    rc |= r.num_failed == 0 ? 0 : 1;
  }
  return rc;
}

}  // namespace epx::gpu_test
