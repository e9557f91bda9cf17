// Which low-latency transport the suite runs on (so that a pass cannot silently be the other path), and the
// life cycle of low-latency regions: a second buffer beside the first, create / destroy cycles in one process
// (NVSHMEM initialised and finalised each time), and a missing rank on this transport. The last two run in
// their own processes, like the timeout suite.
#include <cuda_runtime.h>

#include <chrono>
#include <cstdio>
#include <string>

#include "../../tools/harness/low_latency.hpp"
#include "gpu_test.hpp"
#include "ll_common.hpp"

namespace epx::gpu_test {
namespace {

using harness::LowLatencyCase;
using harness::LowLatencySession;

std::string run_small_step(Buffer& buffer, cudaStream_t stream, uint64_t seed) {
  LowLatencySession s(buffer, small_ll_case(buffer.num_ranks(), seed), stream);
  s.dispatch(kLowLatencyBothPhases);
  std::string err = s.check_dispatch();
  s.set_combine_inputs(seed + 1);
  s.combine(kLowLatencyBothPhases);
  err += s.check_combine();
  buffer.check(stream);
  return err;
}

bool same(const LowLatencyTransportInfo& a, const LowLatencyTransportInfo& b) {
  return a.transport == b.transport && a.num_peer_pointer_ranks == b.num_peer_pointer_ranks &&
         a.num_nvshmem_ranks == b.num_nvshmem_ranks;
}

}  // namespace

std::string transport_mismatch(const LowLatencyTransportInfo& info, int num_ranks, const std::string& expected) {
  bool ok = true;
  if (expected == "cuda-ipc") {
    ok = info.transport == EPX_LL_TRANSPORT_CUDA_IPC;
  } else if (expected == "nvshmem") {  // symmetric memory, every rank through a peer pointer (one NVLink domain)
    ok = info.transport == EPX_LL_TRANSPORT_NVSHMEM && info.num_nvshmem_ranks == 0;
  } else if (expected == "nvshmem-forced") {  // every other rank through NVSHMEM puts
    ok = info.transport == EPX_LL_TRANSPORT_NVSHMEM && info.num_nvshmem_ranks == num_ranks - 1 &&
         info.num_peer_pointer_ranks == 1;
  }
  return ok ? std::string() : "expected transport " + expected + ", got " + describe_low_latency_transport(info) + "\n";
}

std::vector<Case> low_latency_transport_cases(const LowLatencyTransportInfo& info, const std::string& expected) {
  std::vector<Case> cases;
  const std::string want = expected.empty() ? "" : " (expected " + expected + ")";
  cases.push_back(Case{"ll: transport " + describe_low_latency_transport(info) + want, [expected](Context& ctx) {
                         return transport_mismatch(ctx.buffer.low_latency_transport(), ctx.num_ranks, expected);
                       }});
  cases.push_back(Case{"ll: a second low-latency buffer beside the first (same transport), one step", [](Context& ctx) {
                         Buffer second(ctx.bootstrap, small_ll_options(ctx.num_ranks));
                         std::string err;
                         if (!same(second.low_latency_transport(), ctx.buffer.low_latency_transport()))
                           err = "second buffer: " + describe_low_latency_transport(second.low_latency_transport()) +
                                 ", first: " + describe_low_latency_transport(ctx.buffer.low_latency_transport()) +
                                 "\n";
                         second.set_timeout(ctx.buffer.timeout());
                         err += run_small_step(second, ctx.stream, 90);
                         second.destroy();
                         return err;
                       }});
  return cases;
}

int run_low_latency_process_suites(int num_ranks, const std::string& expected) {
  int rc = 0;
  // Create / destroy cycles: with NVSHMEM every destroy of the last region finalises it and the next create
  // initialises it again.
  constexpr int kCycles = 3;
  rc |= run_in_processes(num_ranks, 300,
                         "ll: " + std::to_string(kCycles) +
                             " create / step / destroy cycles of a low-latency buffer in one process (" +
                             std::to_string(num_ranks) + " ranks)",
                         [&](Bootstrap& bs, cudaStream_t stream) -> int {
                           std::string problem;
                           LowLatencyTransportInfo first{};
                           for (int cycle = 0; cycle < kCycles && problem.empty(); ++cycle) {
                             Buffer buffer(bs, small_ll_options(num_ranks));
                             buffer.set_timeout(20);
                             const LowLatencyTransportInfo info = buffer.low_latency_transport();
                             if (cycle == 0) first = info;
                             if (!same(info, first))
                               problem += "cycle " + std::to_string(cycle) + ": transport changed\n";
                             problem += transport_mismatch(info, num_ranks, expected);
                             problem += run_small_step(buffer, stream, 100 + cycle);
                             buffer.destroy();
                             if (bs.rank() == 0 && cycle == 0)
                               std::printf("  (transport: %s)\n", describe_low_latency_transport(info).c_str());
                           }
                           if (!problem.empty()) std::printf("[rank %d] FAIL:\n%s", bs.rank(), problem.c_str());
                           return problem.empty() ? 0 : 1;
                         });

  // Ranks that do not show up: rank 0's receive wait fails within the budget with a diagnostic; then destroy
  // must return on every rank although rank 0's context is lost (NVSHMEM is left alone then: its collective
  // free would wait for rank 0 forever).
  constexpr double kBudget = 2.0;
  rc |= run_in_processes(
      num_ranks, 120,
      "ll: missing ranks time out a low-latency receive, and destroy still returns (" + std::to_string(num_ranks) +
          " ranks)",
      [&](Bootstrap& bs, cudaStream_t stream) -> int {
        Buffer buffer(bs, small_ll_options(num_ranks));
        buffer.set_timeout(kBudget);
        LowLatencySession s(buffer, small_ll_case(num_ranks, 7), stream);
        std::string problem = rank0_times_out(bs, buffer, s, stream, kBudget, [](const std::string& what, double) {
          return what.find("timed out") == std::string::npos ? std::string(" the message does not say it timed out")
                                                             : std::string();
        });
        const auto destroy_start = std::chrono::steady_clock::now();
        buffer.destroy();
        const double destroy_s =
            std::chrono::duration<double>(std::chrono::steady_clock::now() - destroy_start).count();
        if (destroy_s > 30) problem += " destroy took " + std::to_string(destroy_s) + " s";
        if (!problem.empty()) std::printf("[rank %d] FAIL: %s\n", bs.rank(), problem.c_str());
        return problem.empty() ? 0 : 1;
      });
  return rc;
}

}  // namespace epx::gpu_test
