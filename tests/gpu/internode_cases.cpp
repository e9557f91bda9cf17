// GPU tests that only the internode mode has (the high-throughput cases run on internode buffers too): the same
// routing through the intranode path, network-ring wrap-around, a worst-case overflow at one rank, a network ring
// that does not fit, and a rank that never calls.
#include <cstdio>
#include <cstring>
#include <string>

#include "../../tools/harness/high_throughput.hpp"
#include "epx/launcher.hpp"
#include "gpu_test.hpp"
#include "ht_common.hpp"

namespace epx::gpu_test {
namespace {

using harness::HtCase;
using harness::HtSession;

// The buffer options of the internode suite for D x G ranks (the sizes the default configs need at hidden 8192).
BufferOptions internode_options(int num_ranks, int num_nvl_ranks) {
  BufferOptions o = default_buffer_options();
  const InternodeSizes s = internode_size_hints(default_dispatch_config(num_ranks), 8192 * 2, num_ranks, num_nvl_ranks);
  o.num_nvl_bytes = s.nvl_bytes;
  o.num_rdma_bytes = s.rdma_bytes;
  o.num_nvl_ranks = num_nvl_ranks;
  o.force_internode = num_nvl_ranks == num_ranks ? 1 : 0;
  return o;
}

}  // namespace

std::vector<Case> internode_cases() {
  std::vector<Case> cases;
  cases.push_back(Case{"internode: the intranode path gives the same dispatch and flat-combine bits", [](Context& ctx) {
                         HtCase c = base_case({700}, 4096, 41);
                         c.num_biases = 2;
                         c.reduction = EPX_REDUCE_FLAT;
                         BufferOptions o = default_buffer_options();
                         o.num_nvl_bytes = nvl_size_hint(ctx.dispatch_config, 4096 * 2, ctx.num_ranks);
                         o.num_nvl_ranks = ctx.num_ranks;
                         Buffer intranode(ctx.bootstrap, o);
                         if (intranode.internode()) return std::string("the comparison buffer is internode\n");
                         std::string err;
                         HtSession a(ctx.buffer, c, ctx.dispatch_config, ctx.combine_config, ctx.stream);
                         HtSession b(intranode, c, ctx.dispatch_config, ctx.combine_config, ctx.stream);
                         for (HtSession* s : {&a, &b}) {
                           s->layout();
                           s->dispatch();
                           s->set_combine_inputs(17);
                           s->combine();
                         }
                         if (a.received_bytes() != b.received_bytes()) err += "recv_x differs between the two paths\n";
                         if (a.combined_bytes() != b.combined_bytes())
                           err += "flat combined_x differs between the two paths\n";
                         err += a.check_dispatch() + a.check_combine() + b.check_dispatch() + b.check_combine();
                         intranode.destroy();
                         return err;
                       }});
  cases.push_back(
      Case{"internode: one-record chunks and a two-chunk network ring (wrap-around), 2 SMs", [](Context& ctx) {
             Config cfg = ctx.dispatch_config;
             cfg.num_sms = 2;
             cfg.num_max_rdma_send_tokens = 1;
             cfg.num_max_rdma_recv_tokens = 2;
             cfg.num_max_recv_tokens = ctx.num_ranks;  // one NVLink slot per domain at most
             HtCase c = base_case({300}, 2048, 42);
             c.num_biases = 1;
             HtSession s(ctx.buffer, c, cfg, cfg, ctx.stream);
             s.layout();
             s.dispatch();
             std::string err = s.check_dispatch();
             for (int reduction : {EPX_REDUCE_TWO_LEVEL, EPX_REDUCE_FLAT}) {
               s.set_reduction(reduction);
               s.set_combine_inputs(43 + reduction);
               s.combine();
               err += s.check_combine();
             }
             return err;
           }});
  cases.push_back(
      Case{"internode: worst-case overflow is reported by the rank that receives too much",
           [](Context& ctx) { return worst_tokens_overflow(ctx, base_case({200}, 2048, 44), /*every_rank=*/false); }});
  cases.push_back(Case{"internode: a network ring that does not fit is reported before any launch", [](Context& ctx) {
                         Config big = ctx.dispatch_config;
                         big.num_max_rdma_send_tokens = 4096;
                         big.num_max_rdma_recv_tokens = 2 * 4096;
                         return buffer_too_small(ctx, base_case({64}, 7168, 45), big, "num_rdma_bytes",
                                                 "name num_rdma_bytes");
                       }});
  return cases;
}

int run_internode_timeout_suite(int num_ranks, int num_nvl_ranks) {
  constexpr double kBudget = 2.0;
  const LaunchResult r = launch_local(
      num_ranks,
      [&](Bootstrap& bs) -> int {
        cudaSetDevice(bs.rank());
        Buffer buffer(bs, internode_options(num_ranks, num_nvl_ranks));
        buffer.set_timeout(kBudget);
        cudaStream_t stream;
        cudaStreamCreateWithFlags(&stream, cudaStreamNonBlocking);
        HtSession s(buffer, base_case({128}, 2048, 46), default_dispatch_config(num_ranks),
                    default_combine_config(num_ranks), stream);
        return missing_rank_dispatch(bs, buffer, s, stream, kBudget, "hop");  // the message names the hop
      },
      120, 60);
  std::printf("[%s] internode timeout (%d x %d): a missing rank fails every rank's call with a diagnostic\n",
              r.num_failed == 0 ? "PASS" : "FAIL", num_ranks / num_nvl_ranks, num_nvl_ranks);
  if (r.num_failed) std::printf("%s", r.summary.c_str());
  return r.num_failed == 0 ? 0 : 1;
}

BufferOptions internode_suite_options(int num_ranks, int num_nvl_ranks) {
  return internode_options(num_ranks, num_nvl_ranks);
}

}  // namespace epx::gpu_test
