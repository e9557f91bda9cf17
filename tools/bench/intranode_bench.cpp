#include "intranode_bench.hpp"

#include <algorithm>
#include <chrono>
#include <cstdio>
#include <memory>
#include <optional>
#include <string>
#include <vector>

#include "gen.hpp"
#include "high_throughput.hpp"
#include "ht_bench.hpp"

namespace epx::bench {
namespace {

using harness::HtSession;

// The whole chain on the current config: layout, dispatch, combine, each compared with the reference model.
std::string check_session(HtSession& s, uint64_t combine_seed) {
  s.layout();
  std::string msg = s.check_layout();
  s.dispatch();
  msg += s.check_dispatch();
  s.set_combine_inputs(combine_seed);
  s.combine();
  msg += s.check_combine();
  return msg;
}

// One config: full BF16 dispatch, cached BF16 dispatch and combine on the handle it left, full FP8 dispatch.
void time_config(Bench& b, HtSession& bf16, HtSession& fp8, const Config& cfg) {
  bf16.set_configs(cfg, cfg);  // combine needs the dispatch's num_sms: one config for both
  fp8.set_configs(cfg, cfg);
  // Inside the events: notify kernel, the host's bounded wait for the counts, the data kernel.
  measure(b, Op::kDispatchBf16, Impl::kEpx, cfg, bf16.recv_bytes(), refresh_x(b, bf16), [&] { bf16.dispatch(); });
  // Same routing, new x each time: the handle of the last dispatch above, no count exchange, no host wait.
  measure(b, Op::kCachedBf16, Impl::kEpx, cfg, bf16.recv_bytes(), refresh_x(b, bf16), [&] { bf16.dispatch_cached(); });
  // Expert outputs are regenerated once per config: generating them per iteration would cost ~0.5 s each.
  bf16.set_combine_inputs(harness::mix(b.next_seed++));
  measure(b, Op::kCombineBf16, Impl::kEpx, cfg, bf16.combine_bytes(), no_prepare, [&] { bf16.combine(); });
  measure(b, Op::kDispatchFp8, Impl::kEpx, cfg, fp8.recv_bytes(), refresh_x(b, fp8), [&] { fp8.dispatch(); });
}

// --check-all: the outputs the config's last timed iterations left, against the reference model.
std::string check_after_timing(const HtSession& bf16, const HtSession& fp8) {
  return bf16.check_dispatch() + bf16.check_combine() + fp8.check_dispatch();
}

int64_t buffer_bytes(const std::vector<Config>& sweep, int hidden, int num_ranks) {
  const int64_t row = int64_t(hidden) * 2;  // the BF16 row covers FP8 rows with their scales
  int64_t bytes = std::max(nvl_size_hint(default_dispatch_config(num_ranks), row, num_ranks),
                           nvl_size_hint(default_combine_config(num_ranks), row, num_ranks));
  for (const Config& c : sweep) bytes = std::max(bytes, nvl_size_hint(c, row, num_ranks));
  return bytes;
}

// Everything after the Buffer exists. Returns the rank's exit code; throws on errors.
int run_rank(Bench& b, const IntranodeOptions& o, const std::vector<Config>& sweep) {
  const auto started = std::chrono::steady_clock::now();
  const int R = b.bs.size();
  const bool lead = b.bs.rank() == 0;
  RunInfo info = make_run_info("intranode", o, R, b.buffer.device());
  const std::unique_ptr<NcclLibrary> nccl = open_run(b, info);

  // 1. Correctness on the default configs, BF16 and FP8, before any timing.
  HtSession bf16 = default_session(b, EPX_BF16), fp8 = default_session(b, EPX_FP8_E4M3);
  if (!check_before_timing(b, bf16, fp8, check_session, info)) return 1;

  // 2. The sweep.
  std::string failures;
  const std::vector<Config> configs = runnable_configs(b, sweep);
  for (size_t k = 0; k < configs.size(); ++k) {
    if (lead)
      std::fprintf(stderr, "[epx-bench] config %zu/%zu: %s\n", k + 1, configs.size(), describe(configs[k]).c_str());
    time_config(b, bf16, fp8, configs[k]);
    if (o.check_all && !all_passed(b.bs, guarded([&] { return check_after_timing(bf16, fp8); }), &failures)) {
      if (lead) say("check vs reference model after timing " + describe(configs[k]) + ": FAIL\n" + failures);
      return 1;
    }
  }
  if (o.check_all && lead) say("check vs reference model after every config: PASS\n");

  // 3. NCCL all-to-all of the same rows, and the report.
  finish_run(b, nccl.get(), bf16, fp8, info, started);
  return 0;
}

}  // namespace

int run_intranode(int argc, char** argv) {
  IntranodeOptions opt;
  if (const std::optional<int> done =
          parse_or_exit("intranode", argc, argv, parse_intranode_options, intranode_usage, &opt))
    return *done;
  int R = 0;
  if (const int rc = choose_ranks(opt, &R); rc != 0) return rc;
  fit_experts(opt, R);
  std::vector<std::string> skipped;
  std::vector<Config> sweep;
  try {
    validate_intranode_options(opt, R);
    sweep = sweep_configs(opt, R, &skipped);
  } catch (const UsageError& e) {
    std::fprintf(stderr, "epx-bench intranode: %s\n", e.message.c_str());
    return 2;
  }
  for (const std::string& s : skipped) std::fprintf(stderr, "epx-bench: skipping %s\n", s.c_str());
  if (sweep.empty()) {
    std::fprintf(stderr, "epx-bench intranode: no valid config in the sweep\n");
    return 2;
  }
  return launch_ranks(R, [&](Bootstrap& bs) {
    BufferOptions bo = default_buffer_options();
    bo.num_nvl_bytes = buffer_bytes(sweep, opt.hidden, R);
    // --in-buffer: every rank's tokens fit (BF16 rows cover FP8 rows with their scales).
    if (opt.in_buffer) bo.num_recv_bytes = recv_region_size_hint(opt.tokens * R, opt.hidden, EPX_BF16, 0, opt.topk);
    return run_rank_process(bs, opt, bo, [&](Bench& b) { return run_rank(b, opt, sweep); });
  });
}

}  // namespace epx::bench
