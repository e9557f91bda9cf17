// GPU tests of the high-throughput path (intranode, and internode when the suite's Buffer spans domains) against the
// reference model (semantics.md sections 1-3, 6, 7).
#include <algorithm>
#include <cstring>

#include "../../tools/harness/high_throughput.hpp"
#include "gpu_test.hpp"
#include "ht_common.hpp"

namespace epx::gpu_test {
namespace {

using harness::cuda_check;
using harness::HtCase;
using harness::HtSession;
using harness::Routing;

// layout -> dispatch -> combine, each checked; an internode buffer combines in both orders (two-level, then flat).
std::string run_full(Context& ctx, const HtCase& c) {
  HtSession s(ctx.buffer, c, ctx.dispatch_config, ctx.combine_config, ctx.stream);
  s.layout();
  std::string err = s.check_layout();
  s.dispatch();
  err += s.check_dispatch();
  s.set_combine_inputs(c.seed * 7 + 1);
  s.combine();
  err += s.check_combine();
  if (ctx.buffer.internode()) {
    s.set_reduction(EPX_REDUCE_FLAT);
    s.combine();
    const std::string flat = s.check_combine();
    if (!flat.empty()) err += "flat order:\n" + flat;
  }
  return err;
}

std::vector<int> per_rank(int num_ranks, std::initializer_list<int> first, int rest) {
  std::vector<int> v(first);
  v.resize(num_ranks, rest);
  v.resize(num_ranks);
  return v;
}

// layout -> dispatch, then `n` cached dispatches of new x (seeds x_seed, x_seed + 1, ...), then combine (combine
// inputs from combine_seed); every dispatch and the combine checked.
std::string cached_dispatches(Context& ctx, const HtCase& c, int n, uint64_t x_seed, uint64_t combine_seed) {
  HtSession s(ctx.buffer, c, ctx.dispatch_config, ctx.combine_config, ctx.stream);
  s.layout();
  s.dispatch();
  std::string err = s.check_dispatch();
  for (int i = 0; i < n; ++i) {
    s.set_x(x_seed + i);
    s.dispatch_cached();
    err += s.check_dispatch();
  }
  s.set_combine_inputs(combine_seed);
  s.combine();
  return err + s.check_combine();
}

Case scenario(std::string name, std::function<HtCase(Context&)> make) {
  return Case{std::move(name), [make](Context& ctx) { return run_full(ctx, make(ctx)); }};
}

// Ring dispatches into outputs sized by a guess (Buffer::dispatch_sized): each case runs two dispatches and combines,
// every one checked, and checks on every sized rank whether the first call repeated (a rank's guess too small) as
// the case expects; the second call, with every guess large enough, must not.
std::vector<Case> sized_cases() {
  const auto sized = [](std::string name, bool resized, std::function<HtCase(Context&)> make) {
    return Case{"sized dispatch: " + name, [make, resized](Context& ctx) {
                  HtCase c = make(ctx);
                  c.sized = true;
                  const bool sized_rank = c.sized_offset_of(ctx.rank) != HtCase::kTwoStep;
                  std::string err;
                  {
                    HtSession s(ctx.buffer, c, ctx.dispatch_config, ctx.combine_config, ctx.stream);
                    err = dispatch_and_combine(s, c.seed * 7 + 1);
                    if (sized_rank && s.last_dispatch_resized() != resized)
                      err += resized ? "expected every rank to repeat the dispatch, it did not\n"
                                     : "the dispatch repeated, but every guess was large enough\n";
                  }
                  c.sized_offset = {HtCase::kLargest};
                  c.seed += 1000;
                  HtSession s(ctx.buffer, c, ctx.dispatch_config, ctx.combine_config, ctx.stream);
                  err += dispatch_and_combine(s, c.seed * 7 + 2);
                  if (s.last_dispatch_resized()) err += "the second dispatch repeated with the largest guess\n";
                  return err;
                }};
  };
  std::vector<Case> cases;
  cases.push_back(sized("the guess is exact, bf16 h2048, 10% empty slots", false,
                        [](Context&) { return base_case({600}, 2048, 130); }));
  cases.push_back(sized("64 rows to spare, fp8 h7168, top-8 of 256", false, [](Context&) {
    auto c = base_case({1024}, 7168, 131);
    c.dtype = EPX_FP8_E4M3;
    c.routing.num_experts = 256;
    c.sized_offset = {64};
    return c;
  }));
  cases.push_back(sized("one token on rank 0, none on the others", false,
                        [](Context& ctx) { return base_case(per_rank(ctx.num_ranks, {1}, 0), 4096, 132); }));
  cases.push_back(sized("skewed experts, uneven tokens", false, [](Context& ctx) {
    auto c = base_case(per_rank(ctx.num_ranks, {700, 0, 33}, 250), 2048, 133);
    c.routing.kind = Routing::kSkewed;
    return c;
  }));
  cases.push_back(sized("the last rank receives nothing (a guess of 0 rows)", false, [](Context&) {
    auto c = base_case({256}, 2048, 138);
    c.routing.kind = Routing::kLastIdle;
    return c;
  }));
  cases.push_back(sized("rank 0's guess one row short: every rank repeats", true, [](Context& ctx) {
    auto c = base_case({500}, 2048, 134);
    c.sized_offset = per_rank(ctx.num_ranks, {-1}, 16);
    return c;
  }));
  cases.push_back(sized("the last rank's guess short, the others dispatch in two steps", true, [](Context& ctx) {
    auto c = base_case({300}, 4096, 135);
    c.dtype = EPX_FP8_E4M3;
    c.sized_offset = per_rank(ctx.num_ranks, {}, HtCase::kTwoStep);
    c.sized_offset[ctx.num_ranks - 1] = -40;
    return c;
  }));
  cases.push_back(sized("sized and two-step ranks mixed, every guess enough", false, [](Context& ctx) {
    auto c = base_case({400}, 2048, 136);
    c.sized_offset = per_rank(ctx.num_ranks, {HtCase::kTwoStep}, 0);
    return c;
  }));
  cases.push_back(sized("worst-case mode in one launch, fp8, uneven tokens", false, [](Context& ctx) {
    auto c = base_case(per_rank(ctx.num_ranks, {1, 333, 0}, 57), 4096, 139);
    c.dtype = EPX_FP8_E4M3;
    c.worst_case = true;
    return c;
  }));
  cases.push_back(sized("worst-case mode, one launch on rank 0, two steps on the others", false, [](Context& ctx) {
    auto c = base_case({600}, 2048, 140);
    c.worst_case = true;
    c.sized_offset = per_rank(ctx.num_ranks, {0}, HtCase::kTwoStep);
    return c;
  }));
  cases.push_back(
      Case{"sized dispatch: num_worst_tokens too small in one launch: check() fails every rank", [](Context& ctx) {
             auto c = base_case({200}, 2048, 141);
             c.sized = true;
             return worst_tokens_overflow(ctx, c, /*every_rank=*/true);
           }});
  cases.push_back(Case{"sized dispatch: its handle serves cached dispatches and combine", [](Context& ctx) {
                         auto c = base_case({800}, 7168, 137);
                         c.sized = true;
                         c.sized_offset = {HtCase::kLargest};
                         return cached_dispatches(ctx, c, 2, 3000, 99);
                       }});
  // Back to back, each operation with other channels and ring sizes than the one before: a ring's slots under one
  // config are other slots under the next, so a sender that starts before its start word (2 ranks,
  // kernels/intranode/early_senders.cuh) must know the peer has read every record of every earlier config. Small
  // rings wrap many times in every channel.
  cases.push_back(Case{"sized dispatch: channels and ring sizes change between operations", [](Context& ctx) {
                         auto c = base_case({1500}, 2048, 144);
                         c.sized = true;
                         c.sized_offset = {HtCase::kLargest};
                         HtSession s(ctx.buffer, c, ctx.dispatch_config, ctx.combine_config, ctx.stream);
                         s.layout();
                         const int sms[] = {24, 2, 16, 8, 20, 4};
                         const int rings[] = {4, 64, 9, 256, 16, 33};
                         std::string err;
                         for (int i = 0; i < 12 && err.empty(); ++i) {
                           Config d = ctx.dispatch_config, k = ctx.combine_config;
                           d.num_sms = k.num_sms = sms[i % 6];
                           d.num_max_send_tokens = std::min(d.num_max_send_tokens, rings[i % 6]);
                           d.num_max_recv_tokens = rings[i % 6];
                           k.num_max_send_tokens = std::min(k.num_max_send_tokens, rings[(i + 3) % 6]);
                           k.num_max_recv_tokens = rings[(i + 3) % 6];
                           s.set_configs(d, k);
                           s.set_x(4000 + i);
                           s.dispatch();
                           err += s.check_dispatch();
                           s.set_combine_inputs(5000 + i);
                           s.combine();
                           err += s.check_combine();
                           s.set_x(6000 + i);
                           s.dispatch_cached();
                           err += s.check_dispatch();
                           if (!err.empty()) err = "operation round " + std::to_string(i) + ":\n" + err;
                         }
                         return err;
                       }});
  return cases;
}

// Dispatches into the Buffer's output region (semantics.md section 2): the same checks on the region's views, and a
// combine after each, on the suite's buffer (its num_recv_bytes: 4096 tokens a rank of BF16 h7168, top-8).
std::vector<Case> in_buffer_cases() {
  const auto in_buffer = [](std::string name, std::function<HtCase(Context&)> make) {
    return scenario("in buffer: " + name, [make](Context& ctx) {
      HtCase c = make(ctx);
      c.in_buffer = true;
      return c;
    });
  };
  std::vector<Case> cases;
  cases.push_back(in_buffer("one token per rank, h2048", [](Context&) { return base_case({1}, 2048, 111); }));
  cases.push_back(in_buffer("random bf16 h2048, 20% empty slots", [](Context&) {
    auto c = base_case({256}, 2048, 112);
    c.routing.empty_slot_prob = 0.2;
    return c;
  }));
  cases.push_back(in_buffer("4096 tokens, bf16 h7168, top-8 of 256, two biases", [](Context&) {
    auto c = base_case({4096}, 7168, 113);
    c.routing.num_experts = 256;
    c.routing.empty_slot_prob = 0.02;
    c.num_biases = 2;
    return c;
  }));
  cases.push_back(in_buffer("fp8 h7168 with scales", [](Context&) {
    auto c = base_case({512}, 7168, 114);
    c.dtype = EPX_FP8_E4M3;
    return c;
  }));
  cases.push_back(in_buffer("fp8 h4096, padded scale strides, 160 scales, expert_alignment 128", [](Context&) {
    auto c = base_case({300}, 4096, 115);
    c.dtype = EPX_FP8_E4M3;
    c.num_scales = 160;
    c.scale_layout = harness::ScaleLayout::kPadded;
    c.expert_alignment = 128;
    return c;
  }));
  cases.push_back(in_buffer("rank 0 sends nothing",
                            [](Context& ctx) { return base_case(per_rank(ctx.num_ranks, {0}, 300), 2048, 116); }));
  cases.push_back(in_buffer("last rank receives nothing", [](Context&) {
    auto c = base_case({400}, 2048, 117);
    c.routing.kind = Routing::kLastIdle;
    return c;
  }));
  cases.push_back(in_buffer("skewed expert popularity, uneven tokens", [](Context& ctx) {
    auto c = base_case(per_rank(ctx.num_ranks, {100, 1000, 7, 333}, 50), 4096, 118);
    c.routing.kind = Routing::kSkewed;
    c.routing.num_experts = 256;
    return c;
  }));
  cases.push_back(in_buffer("every token to expert 0", [](Context&) {
    auto c = base_case({500}, 2048, 119);
    c.routing.kind = Routing::kOneExpert;
    return c;
  }));
  cases.push_back(in_buffer("no top-k, no combine weights", [](Context&) {
    auto c = base_case({300}, 2048, 120);
    c.with_topk = false;
    c.combine_weights = false;
    return c;
  }));
  cases.push_back(in_buffer("top-k without weights", [](Context&) {
    auto c = base_case({300}, 2048, 121);
    c.with_weights = false;
    return c;
  }));
  cases.push_back(in_buffer("worst-case mode", [](Context&) {
    auto c = base_case({600}, 2048, 122);
    c.worst_case = true;
    return c;
  }));
  cases.push_back(in_buffer("worst-case mode, fp8, 1 token", [](Context&) {
    auto c = base_case({1}, 4096, 123);
    c.worst_case = true;
    c.dtype = EPX_FP8_E4M3;
    return c;
  }));
  cases.push_back(Case{"in buffer: cached dispatches with new data, then combine", [](Context& ctx) {
                         auto c = base_case({700}, 4096, 124);
                         c.in_buffer = true;
                         return cached_dispatches(ctx, c, 3, 3000, 97);
                       }});
  cases.push_back(Case{"in buffer: a ring dispatch, then cached in-buffer dispatches of its handle", [](Context& ctx) {
                         auto c = base_case({500}, 2048, 125);
                         HtSession ring(ctx.buffer, c, ctx.dispatch_config, ctx.combine_config, ctx.stream);
                         ring.layout();
                         ring.dispatch();
                         std::string err = ring.check_dispatch();
                         c.in_buffer = true;
                         HtSession s(ctx.buffer, c, ctx.dispatch_config, ctx.combine_config, ctx.stream);
                         s.layout();
                         s.dispatch();
                         err += s.check_dispatch();
                         s.set_x(77);
                         s.dispatch_cached();
                         err += s.check_dispatch();
                         s.set_combine_inputs(78);
                         s.combine();
                         err += s.check_combine();
                         ring.set_combine_inputs(79);  // the ring session's handle, after in-buffer dispatches
                         ring.combine();
                         return err + ring.check_combine();
                       }});
  cases.push_back(
      Case{"in buffer: a combine whose x is not the region's is refused before any launch", [](Context& ctx) {
             auto c = base_case({300}, 2048, 128);
             c.in_buffer = true;
             HtSession s(ctx.buffer, c, ctx.dispatch_config, ctx.combine_config, ctx.stream);
             s.layout();
             s.dispatch();
             std::string err = s.check_dispatch();
             harness::DeviceArray<uint16_t> x(size_t(s.num_recv_tokens() + 1) * 2048);
             harness::DeviceArray<uint16_t> out(size_t(300) * 2048);
             CombineArgs a{};
             a.x = x.get();
             a.num_rows = s.num_recv_tokens();
             a.hidden = 2048;
             CombineOutputs o{out.get(), nullptr};
             try {
               ctx.buffer.combine_in_buffer(a, ctx.combine_config, s.handle(), o, ctx.stream);
               err += "expected an error, the combine was launched\n";
             } catch (const Error& e) {
               err += wrong_error(e, Status::kInvalidArgument, "combine_region");
             }
             s.set_combine_inputs(11);
             s.combine();
             return err + s.check_combine();
           }});
  // Rows of hidden 32768 (64 KB): the suite's region holds fewer than the 1000 x R that rank 0 receives when every
  // token goes to expert 0, so every rank's call fails (kBufferTooSmall, a collective error of the notify), and the
  // buffer stays usable.
  cases.push_back(Case{"in buffer: a region too small fails every rank, buffer stays usable", [](Context& ctx) {
                         auto c = base_case({1000}, 32768, 126);
                         c.routing.kind = Routing::kOneExpert;
                         c.in_buffer = true;
                         std::string err;
                         {
                           HtSession s(ctx.buffer, c, ctx.dispatch_config, ctx.combine_config, ctx.stream);
                           s.layout();
                           try {
                             s.dispatch();
                             err = "expected an error, dispatch succeeded\n";
                           } catch (const Error& e) {
                             err = wrong_error(e, Status::kBufferTooSmall, "num_recv_bytes");
                           }
                         }
                         auto ok = base_case({200}, 2048, 127);
                         ok.in_buffer = true;
                         HtSession s(ctx.buffer, ok, ctx.dispatch_config, ctx.combine_config, ctx.stream);
                         return err + dispatch_and_combine(s, 9);
                       }});
  return cases;
}

}  // namespace

std::vector<Case> high_throughput_cases(bool internode) {
  std::vector<Case> cases;
  cases.push_back(scenario("one token per rank, h2048", [](Context&) { return base_case({1}, 2048, 11); }));
  cases.push_back(scenario("random bf16 h2048, 20% empty slots", [](Context&) {
    auto c = base_case({256}, 2048, 12);
    c.routing.empty_slot_prob = 0.2;
    return c;
  }));
  cases.push_back(scenario("random bf16 h4096, one bias", [](Context&) {
    auto c = base_case({512}, 4096, 13);
    c.num_biases = 1;
    return c;
  }));
  cases.push_back(scenario("random bf16 h7168, two biases, 256 experts", [](Context&) {
    auto c = base_case({384}, 7168, 14);
    c.routing.num_experts = 256;
    c.num_biases = 2;
    return c;
  }));
  cases.push_back(scenario("fp8 h7168 with scales", [](Context&) {
    auto c = base_case({512}, 7168, 15);
    c.dtype = EPX_FP8_E4M3;
    return c;
  }));
  cases.push_back(scenario("fp8 h4096, expert_alignment 128", [](Context&) {
    auto c = base_case({300}, 4096, 16);
    c.dtype = EPX_FP8_E4M3;
    c.expert_alignment = 128;
    return c;
  }));
  cases.push_back(scenario("rank 0 sends nothing",
                           [](Context& ctx) { return base_case(per_rank(ctx.num_ranks, {0}, 300), 2048, 17); }));
  cases.push_back(scenario("last rank receives nothing", [](Context&) {
    auto c = base_case({400}, 2048, 18);
    c.routing.kind = Routing::kLastIdle;
    return c;
  }));
  cases.push_back(scenario("skewed expert popularity", [](Context&) {
    auto c = base_case({1024}, 4096, 19);
    c.routing.kind = Routing::kSkewed;
    c.routing.num_experts = 256;
    return c;
  }));
  cases.push_back(scenario("every token to expert 0", [](Context&) {
    auto c = base_case({500}, 2048, 20);
    c.routing.kind = Routing::kOneExpert;
    return c;
  }));
  cases.push_back(scenario("no top-k (routing only), no combine weights", [](Context&) {
    auto c = base_case({300}, 2048, 21);
    c.with_topk = false;
    c.combine_weights = false;
    return c;
  }));
  cases.push_back(scenario("top-k without weights", [](Context&) {
    auto c = base_case({300}, 2048, 22);
    c.with_weights = false;
    return c;
  }));
  cases.push_back(scenario("uneven tokens per rank", [](Context& ctx) {
    return base_case(per_rank(ctx.num_ranks, {100, 1000, 7, 333}, 50), 2048, 23);
  }));
  cases.push_back(scenario("4096 tokens, bf16 h7168, top-8 of 256", [](Context&) {
    auto c = base_case({4096}, 7168, 24);
    c.routing.num_experts = 256;
    c.routing.empty_slot_prob = 0.02;
    return c;
  }));
  cases.push_back(scenario("8192 tokens, fp8 h4096", [](Context&) {
    auto c = base_case({8192}, 4096, 25);
    c.dtype = EPX_FP8_E4M3;
    c.routing.num_experts = 256;
    return c;
  }));
  cases.push_back(scenario("8192 tokens, bf16 h2048", [](Context&) { return base_case({8192}, 2048, 26); }));
  cases.push_back(scenario("worst-case mode (no host wait)", [](Context&) {
    auto c = base_case({600}, 2048, 27);
    c.worst_case = true;
    return c;
  }));
  cases.push_back(scenario("worst-case mode, fp8, 1 token", [](Context&) {
    auto c = base_case({1}, 4096, 28);
    c.worst_case = true;
    c.dtype = EPX_FP8_E4M3;
    return c;
  }));
  // FP8 scales at other strides, read in place; recv_x_scales stays row-major. Every output is checked bit for bit.
  const auto column_major = [](HtCase c) {
    c.dtype = EPX_FP8_E4M3;
    c.scale_layout = harness::ScaleLayout::kColumnMajor;
    return c;
  };
  cases.push_back(scenario("FP8 dispatch with column-major scales",
                           [column_major](Context&) { return column_major(base_case({512}, 7168, 40)); }));
  cases.push_back(
      Case{"FP8 dispatch with column-major scales: cached dispatch with new data", [column_major](Context& ctx) {
             return cached_dispatches(ctx, column_major(base_case({700}, 4096, 41)), 2, 2000, 98);
           }});
  cases.push_back(
      scenario("FP8 dispatch with column-major scales: worst-case mode, uneven tokens", [column_major](Context& ctx) {
        auto c = column_major(base_case(per_rank(ctx.num_ranks, {1, 333, 0}, 57), 2048, 42));
        c.worst_case = true;
        return c;
      }));
  cases.push_back(scenario("FP8 dispatch with padded scale strides (2S + 3, 2), 160 scales per token", [](Context&) {
    auto c = base_case({300}, 4096, 43);
    c.dtype = EPX_FP8_E4M3;
    c.num_scales = 160;  // past the 128 a lane preloads (kernels/intranode/dispatch.cu)
    c.scale_layout = harness::ScaleLayout::kPadded;
    return c;
  }));

  cases.push_back(Case{"cached dispatch with new data, then combine",
                       [](Context& ctx) { return cached_dispatches(ctx, base_case({700}, 4096, 29), 3, 1000, 99); }});

  cases.push_back(Case{"legacy default stream", [](Context& ctx) {
                         auto c = base_case({256}, 2048, 30);
                         HtSession s(ctx.buffer, c, ctx.dispatch_config, ctx.combine_config, nullptr);
                         return dispatch_and_combine(s, 5);
                       }});

  // 300 tokens through one channel with a tiny ring, dispatch and combine on the same config. Internode: the NVLink
  // ring holds at least one slot per domain, and the network ring two chunks of one record.
  const auto small_config_case = [](std::string name, Config config, uint64_t seed, uint64_t combine_seed) {
    return Case{std::move(name), [config, seed, combine_seed](Context& ctx) {
                  auto c = base_case({300}, 2048, seed);
                  Config cfg = config;
                  if (ctx.buffer.internode()) {
                    const int D = ctx.num_ranks / ctx.buffer.num_nvl_ranks();
                    cfg.num_max_recv_tokens = std::max(cfg.num_max_recv_tokens, D);
                    cfg.num_max_rdma_send_tokens = cfg.num_max_send_tokens;
                    cfg.num_max_rdma_recv_tokens = 2 * cfg.num_max_send_tokens;
                  }
                  HtSession s(ctx.buffer, c, cfg, cfg, ctx.stream);
                  return dispatch_and_combine(s, combine_seed);
                }};
  };
  cases.push_back(small_config_case("small configs: 2 SMs, chunk 1, ring 2", Config{2, 1, 2, 1, 2}, 31, 6));
  // A chunk as large as the ring: every chunk's room needs the receiver to free the chunk before it, so the
  // chunked senders' publisher (kernels/chunk_publisher.cuh) must release the tail before it waits for the head.
  cases.push_back(
      small_config_case("small configs: 2 SMs, chunk 2, ring 2 (chunk = ring)", Config{2, 2, 2, 2, 4}, 38, 7));

  cases.push_back(Case{"out-of-range topk_idx fails every rank, buffer stays usable", [](Context& ctx) {
                         const auto c = harness::experts_for(base_case({64}, 2048, 32), ctx.num_ranks);
                         HtSession s(ctx.buffer, c, ctx.dispatch_config, ctx.combine_config, ctx.stream);
                         const int culprit = ctx.num_ranks > 1 ? 1 : 0;
                         if (ctx.rank == culprit) {  // a layout of a corrupted topk_idx: slot [3][2] = E + 5
                           std::vector<int64_t> idx;
                           std::vector<float> w;
                           harness::make_topk(c.routing, ctx.rank, ctx.num_ranks, 64, idx, w);
                           idx[3 * c.routing.num_topk + 2] = c.routing.num_experts + 5;
                           harness::DeviceArray<int64_t> bad;
                           bad.upload(idx, ctx.stream);
                           harness::DeviceArray<int> per_rank(ctx.num_ranks), per_expert(c.routing.num_experts);
                           harness::DeviceArray<uint8_t> in_rank(size_t(64) * ctx.num_ranks);
                           ctx.buffer.get_dispatch_layout(
                               LayoutArgs{bad.get(), 64, c.routing.num_topk, c.routing.num_experts},
                               LayoutOutputs{per_rank.get(), nullptr, per_expert.get(), in_rank.get()}, ctx.stream);
                           cudaStreamSynchronize(ctx.stream);
                         }
                         s.layout();
                         std::string err;
                         try {
                           s.dispatch();
                           err = "expected an error, dispatch succeeded\n";
                         } catch (const Error& e) {
                           const Status want = ctx.rank == culprit ? Status::kInvalidArgument : Status::kRemote;
                           if (e.status() != want)
                             err = std::string("wrong status ") + status_string(e.status()) + ": " + e.what() + "\n";
                           if (ctx.rank == culprit && std::string(e.what()).find("topk_idx[3][2]") == std::string::npos)
                             err += std::string("message does not name the slot: ") + e.what() + "\n";
                         }
                         return err + dispatch_and_combine(s, 8);  // the next operation works
                       }});

  // Inside one domain an overflow and a ring that does not fit are collective errors; internode_cases() has the
  // internode mode's versions.
  if (!internode) {
    cases.push_back(Case{"num_worst_tokens too small: check() fails every rank, buffer stays usable", [](Context& ctx) {
                           return worst_tokens_overflow(ctx, base_case({200}, 2048, 33), /*every_rank=*/true);
                         }});

    cases.push_back(Case{"ranks that disagree on hidden fail together, buffer stays usable", [](Context& ctx) {
                           auto c = base_case({64}, ctx.rank == ctx.num_ranks - 1 ? 4096 : 2048, 36);
                           std::string err;
                           {
                             HtSession s(ctx.buffer, c, ctx.dispatch_config, ctx.combine_config, ctx.stream);
                             s.layout();
                             try {
                               s.dispatch();
                               err = ctx.num_ranks > 1 ? "expected an error, dispatch succeeded\n" : "";
                             } catch (const Error& e) {
                               err = wrong_error(e, Status::kInvalidArgument, "disagree");
                             }
                           }
                           c.hidden = 2048;
                           HtSession s(ctx.buffer, c, ctx.dispatch_config, ctx.combine_config, ctx.stream);
                           return err + dispatch_and_combine(s, 4);
                         }});

    // Cached dispatch and combine check the shape in their data kernel's epoch barrier (no notify in front): one rank
    // with another ring size fails every rank's call (reported by check(), as these calls do not wait), and the
    // buffer stays usable.
    cases.push_back(Case{
        "ranks that disagree on a cached dispatch or a combine fail together, buffer stays usable", [](Context& ctx) {
          HtSession s(ctx.buffer, base_case({64}, 2048, 37), ctx.dispatch_config, ctx.combine_config, ctx.stream);
          std::string err = dispatch_and_combine(s, 10);
          Config d = ctx.dispatch_config, k = ctx.combine_config;
          if (ctx.rank == ctx.num_ranks - 1) {
            d.num_max_recv_tokens = std::max(d.num_max_send_tokens, d.num_max_recv_tokens / 2);
            k.num_max_recv_tokens = std::max(k.num_max_send_tokens, k.num_max_recv_tokens / 2);
            if (d.num_max_recv_tokens == ctx.dispatch_config.num_max_recv_tokens ||
                k.num_max_recv_tokens == ctx.combine_config.num_max_recv_tokens)
              return std::string("the default configs leave no smaller ring to disagree with\n");
          }
          s.set_ring_sizes(d, k);
          const auto expect_disagreement = [&](const char* op, auto call) {
            try {
              call();
              ctx.buffer.check(ctx.stream);
              if (ctx.num_ranks > 1) err += std::string(op) + ": expected an error, it succeeded\n";
            } catch (const Error& e) {
              const std::string wrong = wrong_error(e, Status::kInvalidArgument, "disagree");
              if (!wrong.empty()) err += std::string(op) + ": " + wrong;
            }
          };
          expect_disagreement("cached dispatch", [&] { s.dispatch_cached(); });
          expect_disagreement("combine", [&] { s.combine(); });
          s.set_ring_sizes(ctx.dispatch_config, ctx.combine_config);
          s.set_x(11);
          s.dispatch_cached();
          err += s.check_dispatch();
          s.set_combine_inputs(12);
          s.combine();
          return err + s.check_combine();
        }});

    cases.push_back(Case{"buffer too small is reported before any launch", [](Context& ctx) {
                           Config big = ctx.dispatch_config;
                           big.num_max_recv_tokens = 1 << 20;
                           return buffer_too_small(ctx, base_case({64}, 7168, 34), big, "needs", "say the size needed");
                         }});
  }

  if (!internode) {
    std::vector<Case> in_buffer = in_buffer_cases();
    cases.insert(cases.end(), in_buffer.begin(), in_buffer.end());
    std::vector<Case> sized = sized_cases();
    cases.insert(cases.end(), sized.begin(), sized.end());
  }

  // A dispatch whose host waits for its counts cannot run inside a CUDA graph capture: every rank's call fails at
  // once (nothing is queued, so no rank waits for another), and the buffer stays usable. Two steps, and sized where
  // the suite runs inside one domain.
  cases.push_back(
      Case{"a dispatch that waits for its counts refuses a stream being captured", [](Context& ctx) {
             std::string err;
             for (const bool sized : {false, true}) {
               HtCase c = base_case({64}, 2048, 142);
               c.sized = sized;
               c.sized_offset = {HtCase::kLargest};
               HtSession s(ctx.buffer, c, ctx.dispatch_config, ctx.combine_config, ctx.stream);
               s.layout();
               cuda_check(cudaStreamSynchronize(ctx.stream), "layout before the capture");
               cuda_check(cudaStreamBeginCapture(ctx.stream, cudaStreamCaptureModeRelaxed), "begin capture");
               std::string outcome = "expected kInvalidArgument, the dispatch was queued\n";
               try {
                 s.dispatch();
               } catch (const Error& e) {
                 outcome = wrong_error(e, Status::kInvalidArgument, "captured");
               }
               cudaGraph_t graph = nullptr;
               cuda_check(cudaStreamEndCapture(ctx.stream, &graph), "end capture");
               if (graph != nullptr) cudaGraphDestroy(graph);
               if (!outcome.empty()) err += (sized ? "sized: " : "two steps: ") + outcome;
             }
             HtSession s(ctx.buffer, base_case({64}, 2048, 143), ctx.dispatch_config, ctx.combine_config, ctx.stream);
             return err + dispatch_and_combine(s, 11);
           }});

  cases.push_back(Case{"1000 back-to-back dispatch + combine iterations", [](Context& ctx) {
                         auto c = base_case({96}, 1024, 35);
                         c.num_biases = 1;
                         HtSession s(ctx.buffer, c, ctx.dispatch_config, ctx.combine_config, ctx.stream);
                         s.layout();
                         std::string err;
                         for (int i = 0; i < 1000 && err.empty(); ++i) {
                           s.set_x(5000 + i);
                           s.dispatch();
                           s.set_combine_inputs(9000 + i);
                           s.combine();
                           err += s.check_dispatch();
                           err += s.check_combine();
                           if (!err.empty()) err = "iteration " + std::to_string(i) + ":\n" + err;
                         }
                         return err;
                       }});
  return cases;
}

}  // namespace epx::gpu_test
