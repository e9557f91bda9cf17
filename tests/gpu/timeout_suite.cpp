// A rank that does not show up: its peers' waits must fail within the budget with a diagnostic, and every
// other rank must fail soon after (abort flag) instead of hanging. Runs in its own processes because a
// device-side trap loses the CUDA context.
#include <chrono>
#include <cstdio>
#include <string>
#include <thread>

#include "../../tools/harness/high_throughput.hpp"
#include "epx/launcher.hpp"
#include "gpu_test.hpp"

namespace epx::gpu_test {

int missing_rank_dispatch(Bootstrap& bs, Buffer& buffer, harness::HtSession& s, cudaStream_t stream, double budget,
                          const std::string& rank0_names) {
  s.layout();
  cudaStreamSynchronize(stream);
  bs.barrier();
  std::string problem;
  const auto start = std::chrono::steady_clock::now();
  try {
    if (bs.rank() != 0) std::this_thread::sleep_for(std::chrono::duration<double>(2 * budget));
    s.dispatch();
    buffer.check(stream);
    problem = "no error";
  } catch (const Error& e) {
    const std::string what = e.what();
    const double took = std::chrono::duration<double>(std::chrono::steady_clock::now() - start).count();
    std::printf("[rank %d] failed after %.1f s as expected: %s\n", bs.rank(), took, what.c_str());
    if (bs.rank() == 0) {
      if (e.status() != Status::kTimeout) problem = "rank 0: want kTimeout";
      if (what.find("timed out") == std::string::npos || what.find(rank0_names) == std::string::npos)
        problem += " rank 0: the message does not say \"timed out\" and \"" + rank0_names + "\"";
      if (took > budget + 10) problem += " rank 0: took too long";
    } else if (e.status() != Status::kRemote && e.status() != Status::kTimeout) {
      problem = "want kRemote or kTimeout";
    }
  }
  buffer.destroy();
  if (!problem.empty()) std::printf("[rank %d] FAIL: %s\n", bs.rank(), problem.c_str());
  return problem.empty() ? 0 : 1;
}

int run_timeout_suite(int num_ranks) {
  constexpr double kBudget = 2.0;
  const LaunchResult r = launch_local(
      num_ranks,
      [&](Bootstrap& bs) -> int {
        cudaSetDevice(bs.rank());
        BufferOptions o = default_buffer_options();
        o.num_nvl_bytes = nvl_size_hint(default_dispatch_config(num_ranks), 2048 * 2, num_ranks);
        Buffer buffer(bs, o);
        buffer.set_timeout(kBudget);
        cudaStream_t stream;
        cudaStreamCreateWithFlags(&stream, cudaStreamNonBlocking);
        harness::HtCase c;
        c.tokens = {128};
        c.hidden = 2048;
        c.routing.num_experts = 32;
        harness::HtSession s(buffer, c, default_dispatch_config(num_ranks), default_combine_config(num_ranks), stream);
        return missing_rank_dispatch(bs, buffer, s, stream, kBudget, "rank 0");  // who timed out
      },
      120, 60);
  std::printf("[%s] timeout: a missing rank fails every rank's call with a diagnostic (%d ranks)\n",
              r.num_failed == 0 ? "PASS" : "FAIL", num_ranks);
  if (r.num_failed) std::printf("%s", r.summary.c_str());
  return r.num_failed == 0 ? 0 : 1;
}

}  // namespace epx::gpu_test
