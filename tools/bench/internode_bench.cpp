#include "internode_bench.hpp"

#include <algorithm>
#include <chrono>
#include <cstdio>
#include <memory>
#include <optional>
#include <stdexcept>
#include <string>
#include <vector>

#include "gen.hpp"
#include "high_throughput.hpp"
#include "ht_bench.hpp"

namespace epx::bench {
namespace {

using harness::HtSession;

// Exit code of a libepx without NVSHMEM (main.cpp).
constexpr int kNotSupported = 4;
// Seed salt of the x the check's cached dispatch moves (not the first dispatch's).
constexpr uint64_t kCachedCheckSalt = 0xcac4;
constexpr int kReductions[] = {EPX_REDUCE_TWO_LEVEL, EPX_REDUCE_FLAT};

Op combine_op(int reduction) { return reduction == EPX_REDUCE_FLAT ? Op::kCombineFlat : Op::kCombineTwoLevel; }
const char* order_name(int reduction) { return reduction == EPX_REDUCE_FLAT ? "flat" : "two-level"; }

// The whole chain on the current configs: layout, dispatch, a cached dispatch of new x on its handle, and combine
// in both orders, each compared with the reference model.
std::string check_session(HtSession& s, uint64_t seed) {
  s.layout();
  std::string msg = s.check_layout();
  s.dispatch();
  msg += s.check_dispatch();
  s.set_x(harness::mix(seed, kCachedCheckSalt));
  s.dispatch_cached();
  if (const std::string m = s.check_dispatch(); !m.empty()) msg += "  cached dispatch:\n" + m;
  s.set_combine_inputs(seed);
  for (int reduction : kReductions) {
    s.set_reduction(reduction);
    s.combine();
    if (const std::string m = s.check_combine(); !m.empty())
      msg += std::string("  combine, ") + order_name(reduction) + " order:\n" + m;
  }
  return msg;
}

// One config: full BF16 dispatch, cached BF16 dispatch and combine in both orders on the handle it left, full
// FP8 dispatch; timed as the intranode bench times them.
void time_config(Bench& b, HtSession& bf16, HtSession& fp8, const Config& dispatch, const Config& combine) {
  bf16.set_configs(dispatch, combine);
  fp8.set_configs(dispatch, combine);
  // Inside the events: the notify kernels, the host's bounded wait for the counts, the data kernels.
  measure(
      b, Op::kDispatchBf16, Impl::kEpx, dispatch, bf16.recv_bytes(), refresh_x(b, bf16), [&] { bf16.dispatch(); },
      bf16.net_bytes_remote());
  // Same routing, new x each time: the handle of the last dispatch above, no count exchange, no host wait.
  measure(
      b, Op::kCachedBf16, Impl::kEpx, dispatch, bf16.recv_bytes(), refresh_x(b, bf16), [&] { bf16.dispatch_cached(); },
      bf16.net_bytes_remote());
  // Expert outputs are regenerated once per config: generating them per iteration would cost ~0.5 s each.
  bf16.set_combine_inputs(harness::mix(b.next_seed++));
  for (int reduction : kReductions) {
    bf16.set_reduction(reduction);
    measure(b, combine_op(reduction), Impl::kEpx, combine, bf16.combine_bytes(), no_prepare, [&] { bf16.combine(); });
  }
  measure(
      b, Op::kDispatchFp8, Impl::kEpx, dispatch, fp8.recv_bytes(), refresh_x(b, fp8), [&] { fp8.dispatch(); },
      fp8.net_bytes_remote());
}

// Sizes for every config the run uses (the check's defaults, each swept dispatch config and its combine config),
// D x G ranks; D = 1 forces the internode kernels. Throws epx::Error for a config the library rejects.
BufferOptions buffer_options(const std::vector<Config>& sweep, int hidden, int num_ranks, int num_nvl_ranks) {
  std::vector<Config> used = {default_dispatch_config(num_ranks), default_combine_config(num_ranks)};
  for (const Config& d : sweep) {
    used.push_back(d);
    used.push_back(internode_combine_config(d, num_ranks));
  }
  BufferOptions bo = default_buffer_options();
  const int64_t row = int64_t(hidden) * 2;  // the BF16 row covers FP8 rows with their scales
  for (const Config& c : used) {
    const InternodeSizes s = internode_size_hints(c, row, num_ranks, num_nvl_ranks);
    bo.num_nvl_bytes = std::max(bo.num_nvl_bytes, s.nvl_bytes);
    bo.num_rdma_bytes = std::max(bo.num_rdma_bytes, s.rdma_bytes);
  }
  bo.num_nvl_ranks = num_nvl_ranks;
  bo.force_internode = num_nvl_ranks == num_ranks ? 1 : 0;
  return bo;
}

// Everything after the Buffer exists. Returns the rank's exit code; throws on errors.
int run_rank(Bench& b, const InternodeOptions& o, int num_domains, const std::vector<Config>& sweep) {
  const auto started = std::chrono::steady_clock::now();
  const int R = b.bs.size(), G = R / num_domains;
  const bool lead = b.bs.rank() == 0;
  if (!b.buffer.internode() || b.buffer.num_nvl_ranks() != G)
    throw std::runtime_error("the Buffer is not the internode one of " + std::to_string(num_domains) + " x " +
                             std::to_string(G) + " ranks asked for (internode " +
                             std::to_string(int(b.buffer.internode())) + ", " +
                             std::to_string(b.buffer.num_nvl_ranks()) + " ranks per domain)");
  RunInfo info = make_run_info("internode", o, R, b.buffer.device());
  info.num_domains = num_domains;
  info.num_nvl_ranks = G;
  const std::unique_ptr<NcclLibrary> nccl = open_run(b, info);

  // 1. Correctness on the default configs, BF16 and FP8, before any timing.
  HtSession bf16 = default_session(b, EPX_BF16), fp8 = default_session(b, EPX_FP8_E4M3);
  if (!check_before_timing(b, bf16, fp8, check_session, info)) return 1;

  // 2. The sweep: each op at its default config, per num_sms.
  const std::vector<Config> configs = runnable_configs(b, sweep);
  for (size_t k = 0; k < configs.size(); ++k) {
    const Config combine = internode_combine_config(configs[k], R);
    if (lead)
      std::fprintf(stderr, "[epx-bench] config %zu/%zu: dispatch %s, combine %s\n", k + 1, configs.size(),
                   describe(configs[k]).c_str(), describe(combine).c_str());
    time_config(b, bf16, fp8, configs[k], combine);
  }

  // 3. NCCL all-to-all of the same rows over all ranks (NCCL knows nothing of the domains), and the report.
  finish_run(b, nccl.get(), bf16, fp8, info, started);
  return 0;
}

}  // namespace

int run_internode(int argc, char** argv) {
  InternodeOptions opt;
  if (const std::optional<int> done =
          parse_or_exit("internode", argc, argv, parse_internode_options, internode_usage, &opt))
    return *done;
  if (!built_with_nvshmem()) {
    std::fprintf(stderr,
                 "epx-bench internode: this libepx was built without NVSHMEM, which the internode kernels need: "
                 "configure with -DEPX_NVSHMEM=ON -DEPX_NVSHMEM_DIR=... (or run EPX_NVSHMEM=1 scripts/setup.sh)\n");
    return kNotSupported;
  }
  int R = 0;
  if (const int rc = choose_ranks(opt, &R); rc != 0) return rc;
  fit_experts(opt, R);
  int D = 0;
  std::vector<std::string> skipped;
  std::vector<Config> sweep;
  BufferOptions bo;
  try {
    D = internode_domains(opt, R);
    sweep = internode_sweep(opt, R, R / D, &skipped);
    for (const std::string& s : skipped) std::fprintf(stderr, "epx-bench: skipping %s\n", s.c_str());
    if (sweep.empty()) throw UsageError{"no valid config in the sweep"};
    bo = buffer_options(sweep, opt.hidden, R, R / D);
  } catch (const UsageError& e) {
    std::fprintf(stderr, "epx-bench internode: %s\n", e.message.c_str());
    return 2;
  } catch (const Error& e) {  // a config or split the library rejects
    std::fprintf(stderr, "epx-bench internode: %s\n", e.what());
    return 2;
  }
  return launch_ranks(R, [&](Bootstrap& bs) {
    return run_rank_process(bs, opt, bo, [&](Bench& b) { return run_rank(b, opt, D, sweep); });
  });
}

}  // namespace epx::bench
