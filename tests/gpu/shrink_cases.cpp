// GPU tests of rank masking in the low-latency mode ("shrink", semantics.md section 9), against the reference model
// under the mask (ref::low_latency_rows_masked, ref::mask_topk_slots), bit for bit:
// - in the suite: a rank masked up front on every rank (both phases, hook, zero-copy + LogFMT, a CUDA graph whose
//   replays read the mask at run time), the mask calls, the check that an unmasked rank needs
//   clean_low_latency_buffer, and full behaviour after it;
// - in their own processes: a rank that stays silent is masked within the shrink budget and later calls work
//   (then it comes back), and the same silent rank without enable_shrink still times out the call.
#include <cuda_runtime.h>

#include <chrono>
#include <cstdio>
#include <cstdlib>
#include <string>
#include <thread>

#include "../../tools/harness/low_latency.hpp"
#include "gpu_test.hpp"
#include "ll_common.hpp"

namespace epx::gpu_test {
namespace {

using harness::DeviceArray;
using harness::LowLatencyCase;
using harness::LowLatencySession;

constexpr double kShrinkBudget = 0.5;  // seconds a wait for one rank lasts before the rank is masked

// The small case's buffer (ll_common), with or without enable_shrink.
BufferOptions shrink_options(int num_ranks, bool shrink) {
  BufferOptions o = small_ll_options(num_ranks);
  o.enable_shrink = shrink ? 1 : 0;
  o.shrink_timeout_s = kShrinkBudget;
  return o;
}

std::string mask_string(const std::vector<int32_t>& m) {
  std::string s = "[";
  for (size_t i = 0; i < m.size(); ++i) s += (i ? " " : "") + std::to_string(m[i]);
  return s + "]";
}

// "" when the buffer's mask is `want`.
std::string check_mask(Buffer& b, cudaStream_t stream, const std::vector<int32_t>& want, const std::string& when) {
  DeviceArray<int32_t> out(size_t(b.num_ranks()));
  out.fill_bytes(0x7b, stream);
  b.low_latency_query_mask_buffer(out.get(), stream);
  const std::vector<int32_t> got = out.download(size_t(b.num_ranks()), stream);
  return got == want ? std::string() : when + ": mask " + mask_string(got) + ", want " + mask_string(want) + "\n";
}

// One checked step of a session: dispatch, then combine (hook: send and receive as two calls).
std::string step(LowLatencySession& s, Buffer& b, cudaStream_t stream, uint64_t seed, bool hook) {
  s.set_step(seed);
  if (hook) {
    s.dispatch(kLowLatencySendPhase);
    s.dispatch(kLowLatencyRecvPhase);
  } else {
    s.dispatch(kLowLatencyBothPhases);
  }
  std::string err = s.check_dispatch();
  s.set_combine_inputs(seed * 3 + 1);
  if (hook) {
    s.combine(kLowLatencySendPhase);
    s.combine(kLowLatencyRecvPhase);
  } else {
    s.combine(kLowLatencyBothPhases);
  }
  err += s.check_combine();
  b.check(stream);
  return err.empty() ? err : "step " + std::to_string(seed) + ":\n" + err;
}

// The last rank masked up front on every rank (itself included: it takes no part, receiving nothing and combining
// zeros), two steps against the model under that mask, then the mask cleaned and full behaviour again.
std::string masked_up_front(Context& ctx, LowLatencyCase c, bool hook) {
  Buffer b(ctx.bootstrap, shrink_options(ctx.num_ranks, true));
  b.set_timeout(ctx.buffer.timeout());
  std::string err;
  const int victim = ctx.num_ranks - 1;
  std::vector<int32_t> none(size_t(ctx.num_ranks), 0), mask = none;
  mask[size_t(victim)] = 1;
  {
    LowLatencySession s(b, c, ctx.stream);
    err += check_mask(b, ctx.stream, none, "after creation");
    b.low_latency_update_mask_buffer(victim, true, ctx.stream);
    err += check_mask(b, ctx.stream, mask, "after update_mask");
    s.set_mask(mask);
    err += step(s, b, ctx.stream, c.seed, hook);
    err += step(s, b, ctx.stream, c.seed + 1, hook);  // later calls skip the rank too
    err += check_mask(b, ctx.stream, mask, "after the masked steps");
    b.low_latency_clean_mask_buffer(ctx.stream);
    err += check_mask(b, ctx.stream, none, "after clean_mask");
    try {  // an unmasked rank's signals may be stale: the next call needs clean_low_latency_buffer
      s.dispatch(kLowLatencyBothPhases);
      err += "a dispatch after clean_mask without clean_low_latency_buffer was accepted\n";
    } catch (const Error& e) {
      if (e.status() != Status::kInvalidArgument) err += std::string("unexpected error: ") + e.what() + "\n";
    }
    b.clean_low_latency_buffer(ctx.stream);
    s.set_mask({});
    err += step(s, b, ctx.stream, c.seed + 2, hook);
    err += step(s, b, ctx.stream, c.seed + 3, hook);
  }
  b.destroy();
  return err;
}

Case up_front_case(std::string name, LowLatencyCase c, bool hook) {
  return Case{std::move(name), [c, hook](Context& ctx) {
                LowLatencyCase cc = c;
                cc.num_experts = cc.num_experts / ctx.num_ranks * ctx.num_ranks;
                return masked_up_front(ctx, cc, hook);
              }};
}

// A graph captured with no rank masked, replayed after masking the last rank on every rank and again after
// cleaning: the kernels read the mask when they run.
std::string graph_reads_mask(Context& ctx) {
  Buffer b(ctx.bootstrap, shrink_options(ctx.num_ranks, true));
  b.set_timeout(ctx.buffer.timeout());
  std::string err;
  const int victim = ctx.num_ranks - 1;
  std::vector<int32_t> mask(size_t(ctx.num_ranks), 0);
  mask[size_t(victim)] = 1;
  {
    LowLatencyCase c = small_ll_case(ctx.num_ranks, 500);
    c.fp8 = false;
    c.expert_identity = true;  // combine reads packed_recv_x: no host work between the calls
    LowLatencySession s(b, c, ctx.stream);
    cudaGraph_t graph = nullptr;
    cudaGraphExec_t exec = nullptr;
    if (const std::string failed = capture_step(s, ctx.stream, &graph, &exec); !failed.empty()) return failed;
    for (int phase = 0; phase < 3 && err.empty(); ++phase) {
      if (phase == 1) b.low_latency_update_mask_buffer(victim, true, ctx.stream);
      if (phase == 2) {
        b.low_latency_clean_mask_buffer(ctx.stream);
        b.clean_low_latency_buffer(ctx.stream);  // the sets restart at 0, as the graph was captured
      }
      s.set_mask(phase == 1 ? mask : std::vector<int32_t>());
      for (int i = 0; i < 4 && err.empty(); ++i) {
        s.set_step(600 + phase * 10 + i);
        const cudaError_t e = cudaGraphLaunch(exec, ctx.stream);
        if (e != cudaSuccess) return std::string("graph launch failed: ") + cudaGetErrorString(e) + "\n";
        s.note_replayed_dispatch();
        err += s.check_dispatch() + s.check_combine();
        if (!err.empty()) err = "phase " + std::to_string(phase) + " replay " + std::to_string(i) + ":\n" + err;
      }
    }
    cudaGraphExecDestroy(exec);
    cudaGraphDestroy(graph);
    b.check(ctx.stream);
  }
  b.destroy();
  return err;
}

}  // namespace

std::vector<Case> shrink_cases() {
  std::vector<Case> cases;
  cases.push_back(up_front_case("ll: shrink, last rank masked up front, fp8", small_ll_case(8, 401), false));
  cases.push_back(up_front_case("ll: shrink, last rank masked up front, hook", small_ll_case(8, 402), true));
  {
    LowLatencyCase c = small_ll_case(8, 403);
    c.zero_copy = true;
    c.logfmt = true;
    c.fp8 = false;
    cases.push_back(up_front_case("ll: shrink, last rank masked up front, zero-copy + logfmt, hook", c, true));
  }
  cases.push_back(Case{"ll: shrink, a CUDA graph's replays read the mask when they run", graph_reads_mask});
  cases.push_back(Case{
      "ll: shrink, mask calls check their arguments", [](Context& ctx) {
        std::string err;
        auto expect_invalid = [&](const char* what, auto&& call) {
          try {
            call();
            err += std::string(what) + ": accepted\n";
          } catch (const Error& e) {
            if (e.status() != Status::kInvalidArgument) err += std::string(what) + ": " + e.what() + "\n";
          }
        };
        // The suite's buffer has no enable_shrink.
        expect_invalid("update_mask without enable_shrink",
                       [&] { ctx.buffer.low_latency_update_mask_buffer(0, true, ctx.stream); });
        expect_invalid("clean_mask without enable_shrink",
                       [&] { ctx.buffer.low_latency_clean_mask_buffer(ctx.stream); });
        Buffer b(ctx.bootstrap, shrink_options(ctx.num_ranks, true));
        expect_invalid("update_mask(-1)", [&] { b.low_latency_update_mask_buffer(-1, true, ctx.stream); });
        expect_invalid("update_mask(R)", [&] { b.low_latency_update_mask_buffer(ctx.num_ranks, true, ctx.stream); });
        expect_invalid("query_mask(NULL)", [&] { b.low_latency_query_mask_buffer(nullptr, ctx.stream); });
        if (b.shrink_timeout() != kShrinkBudget) err += "shrink_timeout() " + std::to_string(b.shrink_timeout()) + "\n";
        b.destroy();
        return err;
      }});
  return cases;
}

// A rank that stops calling: with enable_shrink every other rank's dispatch and combine complete soon after the
// shrink budget with that rank masked (checked against the model under the mask), the next steps too; then the rank
// comes back, every rank cleans the mask and the buffer, and a full step is right. Without enable_shrink the same
// silent rank fails rank 0's call with kTimeout (the hang budget), as before.
int run_shrink_process_suite(int num_ranks) {
  int rc = 0;
  constexpr double kSilence = 6.0;  // seconds the silent rank stays away: longer than the others' masked steps
  rc |= run_in_processes(
      num_ranks, 300,
      "ll: shrink, a silent rank is masked within the shrink budget, later calls work, it comes back (" +
          std::to_string(num_ranks) + " ranks)",
      [&](Bootstrap& bs, cudaStream_t stream) -> int {
        Buffer buffer(bs, shrink_options(num_ranks, true));
        buffer.set_timeout(30);
        const int victim = num_ranks - 1;
        std::string problem;
        {
          LowLatencySession s(buffer, small_ll_case(num_ranks, 700), stream);
          problem += step(s, buffer, stream, 700, false);  // every rank takes part
          bs.barrier();
          std::vector<int32_t> none(size_t(num_ranks), 0), mask = none;
          mask[size_t(victim)] = 1;
          if (bs.rank() != victim) {
            s.set_mask(mask);
            const auto start = std::chrono::steady_clock::now();
            problem += step(s, buffer, stream, 701, false);
            const double first = std::chrono::duration<double>(std::chrono::steady_clock::now() - start).count();
            problem += step(s, buffer, stream, 702, true);
            problem += step(s, buffer, stream, 703, false);
            const double all = std::chrono::duration<double>(std::chrono::steady_clock::now() - start).count();
            std::printf("[rank %d] masked the silent rank %d: first step %.2f s, three steps %.2f s\n", bs.rank(),
                        victim, first, all);
            if (first < kShrinkBudget * 0.9) problem += "the first step did not wait for the silent rank\n";
            if (all > kShrinkBudget + 4) problem += "the masked steps took " + std::to_string(all) + " s\n";
            problem += check_mask(buffer, stream, mask, "after the silent rank");
          } else {
            std::this_thread::sleep_for(std::chrono::duration<double>(kSilence));
            problem += check_mask(buffer, stream, none, "on the silent rank");
          }
          bs.barrier();  // the silent rank is back
          buffer.low_latency_clean_mask_buffer(stream);
          buffer.clean_low_latency_buffer(stream);
          s.set_mask({});
          problem += step(s, buffer, stream, 710, false);
          problem += step(s, buffer, stream, 711, true);
        }
        buffer.destroy();
        if (!problem.empty()) std::printf("[rank %d] FAIL:\n%s", bs.rank(), problem.c_str());
        return problem.empty() ? 0 : 1;
      });

  constexpr double kBudget = 2.0;
  rc |= run_in_processes(
      num_ranks, 120,
      "ll: shrink off, a silent rank still times out the call (" + std::to_string(num_ranks) + " ranks)",
      [&](Bootstrap& bs, cudaStream_t stream) -> int {
        setenv("EPX_LL_SHRINK_TIMEOUT_S", "0.5", 1);  // no effect without enable_shrink
        Buffer buffer(bs, shrink_options(num_ranks, false));
        buffer.set_timeout(kBudget);
        LowLatencySession s(buffer, small_ll_case(num_ranks, 720), stream);
        const std::string problem =
            rank0_times_out(bs, buffer, s, stream, kBudget, [&](const std::string&, double took) {
              return took < kBudget * 0.9 ? std::string(" failed before the hang budget") : std::string();
            });
        buffer.destroy();
        if (!problem.empty()) std::printf("[rank %d] FAIL: %s\n", bs.rank(), problem.c_str());
        return problem.empty() ? 0 : 1;
      });
  return rc;
}

}  // namespace epx::gpu_test
