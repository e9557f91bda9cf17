#include "intranode_bench.hpp"

#include <algorithm>
#include <chrono>
#include <cstdio>
#include <memory>
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
  std::unique_ptr<NcclLibrary> nccl = o.nccl ? load_nccl(b.bs, &info.nccl) : nullptr;
  if (lead) print_header(stdout, info);

  // 1. Correctness on the default configs, BF16 and FP8, before any timing.
  const Config dcfg = default_dispatch_config(R), ccfg = default_combine_config(R);
  HtSession bf16(b.buffer, make_case(o, EPX_BF16), dcfg, ccfg, b.stream);
  HtSession fp8(b.buffer, make_case(o, EPX_FP8_E4M3), dcfg, ccfg, b.stream);
  std::string failures;
  const bool ok = all_passed(b.bs, guarded([&] {
                               std::string msg =
                                   check_session(bf16, o.seed);  // in sequence: each runs collective operations
                               msg += check_session(fp8, o.seed);
                               b.buffer.check(b.stream);
                               return msg;
                             }),
                             &failures);
  info.check = ok ? "PASS" : "FAIL";
  if (lead) say(std::string("check vs reference model: ") + (ok ? "PASS\n" : "FAIL\n" + failures));
  if (!ok) return 1;

  // 2. The sweep.
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

  // 3. NCCL all-to-all of the same rows.
  if (nccl) {
    const size_t bf16_row = bf16_row_bytes(o.hidden), fp8_row = fp8_row_bytes(o.hidden);
    nccl_baseline(b, *nccl, bf16,
                  {{Op::kDispatchBf16, bf16_row, false, bf16.recv_bytes()},
                   {Op::kDispatchFp8, fp8_row, false, fp8.recv_bytes()},
                   {Op::kCombineBf16, bf16_row, true, bf16.combine_bytes()}},
                  info);
  }

  // 4. Report.
  report(b, info, started);
  return 0;
}

}  // namespace

int run_intranode(int argc, char** argv) {
  IntranodeOptions opt;
  bool help = false;
  try {
    opt = parse_intranode_options(argc, argv, &help);
  } catch (const UsageError& e) {
    std::fprintf(stderr, "epx-bench intranode: %s\n\n%s", e.message.c_str(), intranode_usage());
    return 2;
  }
  if (help) {
    std::printf("%s", intranode_usage());
    return 0;
  }
  int R = 0;
  if (const int rc = choose_ranks(opt, &R); rc != 0) return rc;
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
    return run_rank_process(bs, opt, bo, [&](Bench& b) { return run_rank(b, opt, sweep); });
  });
}

}  // namespace epx::bench
