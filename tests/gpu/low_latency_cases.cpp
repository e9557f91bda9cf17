// GPU tests of the low-latency mode against the reference model (semantics.md sections 4, 5, 7).
#include <cuda_runtime.h>

#include <chrono>
#include <functional>
#include <string>
#include <thread>

#include "../../tools/harness/low_latency.hpp"
#include "gpu_test.hpp"
#include "ll_common.hpp"

namespace epx::gpu_test {
namespace {

using harness::LowLatencyCase;
using harness::LowLatencySession;

LowLatencyCase ll_case(int tokens, int hidden, bool fp8, uint64_t seed) {
  LowLatencyCase c;
  c.tokens = {tokens};
  c.max_tokens = 128;
  c.hidden = hidden;
  c.fp8 = fp8;
  c.num_experts = 288;
  c.num_topk = 8;
  c.empty_slot_prob = 0.05;
  c.seed = seed;
  return c;
}

// A case whose combine sends LogFMT rows (docs/logfmt.md), checked against the reference model's LogFMT combine.
LowLatencyCase logfmt_case(int tokens, int hidden, bool fp8, uint64_t seed) {
  LowLatencyCase c = ll_case(tokens, hidden, fp8, seed);
  c.logfmt = true;
  return c;
}

// A case whose dispatch carries the weights and whose combine sums in the rank-reduced order (EPX_REDUCE_RANK),
// checked against the reference model's rank-reduced combine.
LowLatencyCase rank_case(int tokens, int hidden, bool fp8, uint64_t seed) {
  LowLatencyCase c = ll_case(tokens, hidden, fp8, seed);
  c.rank_reduced = true;
  return c;
}

// The combine orders the multi-step cases run in: flat, LogFMT, rank-reduced.
struct CombineVariant {
  const char* prefix;  // of the case name
  bool logfmt, rank_reduced;
  void apply(LowLatencyCase& c) const {
    c.logfmt = logfmt;
    c.rank_reduced = rank_reduced;
  }
};
constexpr CombineVariant kCombineVariants[] = {
    {"ll: ", false, false}, {"ll: logfmt, ", true, false}, {"ll: rank-reduced, ", false, true}};

// One step: dispatch and combine, each checked; `hook` splits send and receive with host work in between.
std::string run_step(Context& ctx, const LowLatencyCase& c, bool hook) {
  LowLatencySession s(ctx.buffer, c, ctx.stream);
  if (hook) {
    s.dispatch(kLowLatencySendPhase);
    cudaStreamSynchronize(ctx.stream);  // "other work" between the phases
    s.dispatch(kLowLatencyRecvPhase);
  } else {
    s.dispatch(kLowLatencyBothPhases);
  }
  std::string err = s.check_dispatch();
  s.set_combine_inputs(c.seed * 3 + 1);
  if (hook) {
    s.combine(kLowLatencySendPhase);
    cudaStreamSynchronize(ctx.stream);
    s.combine(kLowLatencyRecvPhase);
  } else {
    s.combine(kLowLatencyBothPhases);
  }
  err += s.check_combine();
  ctx.buffer.check(ctx.stream);
  return err;
}

Case step_case(std::string name, LowLatencyCase c, bool hook = false) {
  return Case{std::move(name), [c, hook](Context& ctx) {
                auto cc = c;
                cc.num_experts = cc.num_experts / ctx.num_ranks * ctx.num_ranks;
                return run_step(ctx, cc, hook);
              }};
}

// The variations of a case that the flat list and the combine-order lists below share.
// Hidden 32768 (3 tokens): M 4 and 16 experts keep the buffer small.
LowLatencyCase with_m4_and_16_experts(LowLatencyCase c) {
  c.max_tokens = 4;
  c.num_experts = 16;
  return c;
}
// M 256, one rank with no tokens and one with M.
LowLatencyCase with_uneven_tokens_m256(LowLatencyCase c) {
  c.max_tokens = 256;
  c.tokens = {100, 37, 256, 0, 5, 200, 1, 77};
  return c;
}
LowLatencyCase with_40_percent_empty_slots(LowLatencyCase c) {
  c.empty_slot_prob = 0.4;
  return c;
}
LowLatencyCase with_every_token_to_expert_0(LowLatencyCase c) {
  c.routing = harness::Routing::kOneExpert;
  return c;
}
LowLatencyCase with_zero_copy(LowLatencyCase c) {
  c.zero_copy = true;
  return c;
}

// The flat cases again in another combine order (make: logfmt_case or rank_case), every one bit for bit against
// the reference model. Names start with `stem`; seeds are the flat cases' plus seed_offset. `hiddens`: the
// "<stem> h<N>" cases (96 tokens), FP8 dispatch where N % fp8_every == 0. own(cases), when given, adds the
// order's own cases before the receive-hook ones.
void add_combine_order_cases(std::vector<Case>& cases, const std::string& stem,
                             LowLatencyCase (*make)(int, int, bool, uint64_t), uint64_t seed_offset,
                             std::initializer_list<int> hiddens, int fp8_every,
                             const std::function<void(std::vector<Case>&)>& own = nullptr) {
  const std::string named = stem + ", ";
  const uint64_t o = seed_offset;
  cases.push_back(step_case(named + "128 tokens, h7168, top-8 of 288", make(128, 7168, false, 41 + o)));
  cases.push_back(step_case(named + "fp8 dispatch, 128 tokens, h7168", make(128, 7168, true, 42 + o)));
  for (int h : hiddens)
    cases.push_back(step_case(stem + " h" + std::to_string(h), make(96, h, h % fp8_every == 0, 45 + o + h)));
  cases.push_back(step_case(stem + " h2048, 1 token", make(1, 2048, false, 46 + o)));
  cases.push_back(step_case(stem + " h4096, 64 tokens", make(64, 4096, true, 47 + o)));
  cases.push_back(step_case(stem + " h32768", with_m4_and_16_experts(make(3, 32768, false, 54 + o))));
  cases.push_back(step_case(named + "M=256, uneven tokens (one rank with 0, one with M)",
                            with_uneven_tokens_m256(make(100, 4096, true, 48 + o))));
  cases.push_back(step_case(named + "40% empty slots", with_40_percent_empty_slots(make(128, 2048, true, 49 + o))));
  cases.push_back(
      step_case(named + "every token to expert 0", with_every_token_to_expert_0(make(128, 2048, false, 50 + o))));
  if (own) own(cases);
  cases.push_back(step_case(named + "receive hook", make(128, 7168, false, 51 + o), true));
  cases.push_back(step_case(named + "receive hook, fp8 dispatch", make(128, 7168, true, 52 + o), true));
  const LowLatencyCase zero_copy = with_zero_copy(make(128, 7168, true, 53 + o));
  cases.push_back(step_case(named + "zero-copy combine", zero_copy));
  cases.push_back(step_case(named + "zero-copy combine, receive hook", zero_copy, true));
}

// Six steps of c on one buffer with the combine order `order` (LowLatencyCase::logfmt or ::rank_reduced) on and off
// in turn, seeds from `seed`, the receive hook on steps 0 and 3; stops at the first step that fails. Leaves c as
// the last step ran it.
std::string alternating_steps(Context& ctx, LowLatencyCase& c, bool LowLatencyCase::*order, uint64_t seed) {
  std::string err;
  for (int i = 0; i < 6 && err.empty(); ++i) {
    c.*order = i % 2 == 0;
    c.seed = seed + i;
    err += run_step(ctx, c, i % 3 == 0);
  }
  return err;
}

// Appends to err unless call() is rejected with kInvalidArgument and a message that contains `says`.
template <typename Call>
void expect_rejected(std::string& err, const char* what, const char* says, Call&& call) {
  try {
    call();
    err += std::string(what) + ": not rejected\n";
  } catch (const Error& e) {
    if (e.status() != Status::kInvalidArgument || std::string(e.what()).find(says) == std::string::npos)
      err += std::string(what) + ": wrong error: " + e.what() + "\n";
  }
}

}  // namespace

std::vector<Case> low_latency_cases() {
  std::vector<Case> cases;
  cases.push_back(step_case("ll: bf16, 128 tokens, h7168, top-8 of 288", ll_case(128, 7168, false, 41)));
  cases.push_back(step_case("ll: fp8, 128 tokens, h7168", ll_case(128, 7168, true, 42)));
  {
    auto c = ll_case(128, 7168, true, 43);
    c.round_scale = true;
    cases.push_back(step_case("ll: fp8 round_scale", c));
    c.ue8m0 = true;
    c.seed = 44;
    cases.push_back(step_case("ll: fp8 ue8m0 (packed exponents)", c));
  }
  for (int h : {2048, 4096, 5120, 8192})
    cases.push_back(step_case("ll: fp8 h" + std::to_string(h), ll_case(96, h, true, 45 + h)));
  cases.push_back(step_case("ll: bf16 h2048, 1 token", ll_case(1, 2048, false, 46)));
  cases.push_back(step_case("ll: fp8 h4096, 64 tokens", ll_case(64, 4096, true, 47)));
  {
    // A BF16 record of hidden 32768 is 64 KiB of the send phase's shared memory, past the 48 KiB a kernel gets
    // by default: the launch raises the kernel's limit (once per device; this case runs twice, the second
    // launch on the limit the first one set).
    const auto c = with_m4_and_16_experts(ll_case(3, 32768, false, 54));
    cases.push_back(step_case("ll: bf16 h32768, shared memory past 48 KiB", c));
    cases.push_back(step_case("ll: bf16 h32768 again, shared memory past 48 KiB", c));
  }
  cases.push_back(step_case("ll: M=256, uneven tokens (one rank with 0, one with M)",
                            with_uneven_tokens_m256(ll_case(100, 4096, true, 48))));
  {
    // More tokens than blocks (132 on an H200): blocks of up to three tokens here, of two or one on other ranks, whose
    // writers publish all of a block's tokens after one fence. 16 experts keep the receive area within the suite's
    // buffer.
    auto c = ll_case(300, 7168, false, 55);
    c.max_tokens = 300;
    c.num_experts = 16;
    c.tokens = {300, 140, 133, 300, 0, 1, 299, 200};
    cases.push_back(step_case("ll: bf16, M=300, blocks of up to three tokens, receive hook", c, true));
    c.fp8 = true;
    c.seed = 56;
    cases.push_back(step_case("ll: fp8, M=300, blocks of up to three tokens", c));
  }
  cases.push_back(step_case("ll: 40% empty slots", with_40_percent_empty_slots(ll_case(128, 2048, true, 49))));
  cases.push_back(
      step_case("ll: every token to expert 0", with_every_token_to_expert_0(ll_case(128, 2048, false, 50))));
  // An expert listed twice in each of M tokens gets 2 * M rows from every rank, more than the M a source may
  // send it: every rank reports the input error (the rows beyond M are dropped, nothing is written out of place).
  cases.push_back(
      Case{"ll: an expert listed twice in every token (2M rows for M slots) is an input error", [](Context& ctx) {
             auto c = ll_case(64, 2048, true, 88);
             c.max_tokens = 64;
             c.routing = harness::Routing::kZeroTwice;
             LowLatencySession s(ctx.buffer, c, ctx.stream);
             s.dispatch(kLowLatencyBothPhases);
             try {
               ctx.buffer.check(ctx.stream);
             } catch (const Error& e) {
               const std::string what = e.what();
               if (e.status() != Status::kInvalidArgument || what.find("to expert 0") == std::string::npos)
                 return "wrong error: " + what;
               return std::string();
             }
             return std::string("no error reported");
           }});
  cases.push_back(step_case("ll: receive hook, bf16", ll_case(128, 7168, false, 51), true));
  cases.push_back(step_case(
      "ll: receive hook, fp8 round_scale",
      [] {
        auto c = ll_case(128, 7168, true, 52);
        c.round_scale = true;
        return c;
      }(),
      true));
  cases.push_back(step_case("ll: zero-copy combine", with_zero_copy(ll_case(128, 7168, true, 53))));
  // Few rows: the send cuts them into 32-int4 items, one per warp (small_items), also in a send-only launch (own rows
  // copied) and staged in x itself with zero-copy.
  cases.push_back(step_case("ll: receive hook, bf16, 4 tokens (small send items)", ll_case(4, 7168, false, 56), true));
  cases.push_back(
      step_case("ll: zero-copy combine, 8 tokens (small send items)", with_zero_copy(ll_case(8, 7168, true, 57))));

  // The LogFMT combine (use_logfmt): the flat cases above with LogFMT rows, every one bit for bit against the
  // reference model. Hidden sizes with a partial last work item (1152, 2176: 9 and 17 groups; 640: 5 groups, one
  // partial item; 128: one group) as well as whole ones.
  add_combine_order_cases(cases, "ll: logfmt", logfmt_case, 100, {128, 640, 1152, 2048, 2176, 4096, 5120, 8192}, 1024);
  // LogFMT is chosen per call: LogFMT and BF16 combines alternate on one buffer (their receive slots differ in
  // size), and a receive that does not repeat its send's use_logfmt is rejected without a launch.
  cases.push_back(
      Case{"ll: logfmt and bf16 combines alternating; the receive must repeat use_logfmt", [](Context& ctx) {
             auto c = logfmt_case(64, 2176, true, 155);
             c.num_experts = 64 / ctx.num_ranks * ctx.num_ranks;
             std::string err = alternating_steps(ctx, c, &LowLatencyCase::logfmt, 1550);
             c.logfmt = true;
             LowLatencySession s(ctx.buffer, c, ctx.stream);
             s.dispatch(kLowLatencyBothPhases);
             s.set_combine_inputs(1560);
             s.combine(kLowLatencySendPhase);
             expect_rejected(err, "a BF16 receive of a LogFMT send", "use_logfmt",
                             [&] { s.combine_with_logfmt(kLowLatencyRecvPhase, false); });
             s.combine(kLowLatencyRecvPhase);
             err += s.check_dispatch() + s.check_combine();
             // A hidden size that is no whole number of groups: rejected, nothing launched; BF16 rows still go.
             auto odd = ll_case(16, 2056, false, 157);
             odd.num_experts = c.num_experts;
             LowLatencySession o(ctx.buffer, odd, ctx.stream);
             o.dispatch(kLowLatencyBothPhases);
             o.set_combine_inputs(1570);
             expect_rejected(err, "use_logfmt with hidden 2056", "hidden % 128",
                             [&] { o.combine_with_logfmt(kLowLatencyBothPhases, true); });
             o.combine(kLowLatencyBothPhases);
             err += o.check_dispatch() + o.check_combine();
             ctx.buffer.check(ctx.stream);
             return err;
           }});

  // The rank-reduced combine (EPX_REDUCE_RANK): the flat cases above in the rank-reduced order, every one bit for
  // bit against the reference model (the expert ranks' bf16 partials summed in ascending rank order). Hidden sizes
  // with a partial last work item (1152, 2176, 640; 6400, whose last 64-int4 item at 2 ranks on 132 SMs holds 32
  // int4, so that its second pass has nothing) as well as whole ones; an expert listed twice in a token (its two rows
  // summed at its rank in slot order).
  add_combine_order_cases(
      cases, "ll: rank-reduced", rank_case, 200, {128, 640, 1152, 2176, 4096, 6144, 6400}, 128,
      [](std::vector<Case>& own) {
        auto c = rank_case(16, 2048, false, 255);
        c.max_tokens = 64;  // 2 rows per token of expert 0: 32 of the 64 a source may send it
        c.routing = harness::Routing::kZeroTwice;
        own.push_back(step_case("ll: rank-reduced, expert 0 listed twice in every token", c));
        own.push_back(step_case("ll: rank-reduced, expert 0 listed twice in every token, receive hook", c, true));
        auto top1 = rank_case(128, 7168, false, 256);
        top1.num_topk = 1;  // one row per token: partial = bf16(w * row), then the sum of one
        own.push_back(step_case("ll: rank-reduced, top-1", top1));
        // More than 8 of a token's rows on one rank (at 2 ranks most tokens have 9 or more of their 16 experts on
        // one of them): a partial of many rows.
        auto top16 = rank_case(64, 2176, false, 258);
        top16.num_topk = 16;
        top16.num_experts = 32;
        own.push_back(step_case("ll: rank-reduced, top-16 of 32 (more than 8 rows of a token on a rank)", top16));
        // Few rows: the send cuts them into 32-int4 items (small_items), staged in x itself with zero-copy.
        own.push_back(step_case("ll: rank-reduced, zero-copy combine, 8 tokens (small send items)",
                                with_zero_copy(rank_case(8, 7168, true, 259))));
        // More source tokens than the first-row list holds (R * M > 2048; at 3 or more ranks every case): the send's
        // items go over all rows, in the size its tokens pick (hidden 2048, 132 SMs): 40 and 3 tokens 32-int4 items,
        // 200 one kChunk item per warp, 1100 two.
        auto past_list = rank_case(40, 2048, false, 260);
        past_list.max_tokens = 1100;
        past_list.num_experts = 16;
        past_list.tokens = {200, 1100, 40, 3, 200, 1100, 40, 3};
        own.push_back(step_case("ll: rank-reduced, M=1100 (past the first-row list), uneven tokens", past_list));
        past_list.tokens = {40, 200, 1100, 3, 40, 200, 1100, 3};
        own.push_back(step_case("ll: rank-reduced, M=1100, receive hook", past_list, true));
        // More items than the grid has warps (2 x 512 tokens x 14 items at h7168; 4224 warps on 132 SMs) but R * M
        // within the list: the send lists the first rows. With fewer items (on 132 SMs every other 2-rank case but
        // M=1100) each item's warp finds its token's first row itself.
        auto listed = rank_case(40, 7168, true, 261);
        listed.max_tokens = 512;
        listed.num_experts = 16;
        listed.tokens = {512, 3, 300, 0, 41, 512, 1, 128};
        own.push_back(step_case("ll: rank-reduced, M=512, h7168 (the first-row list), uneven tokens", listed));
        own.push_back(step_case("ll: rank-reduced, M=512, h7168, receive hook", listed, true));
      });
  // The order is chosen per call: flat and rank-reduced combines alternate on one buffer (on handles whose
  // dispatch carried the weights), a receive that does not repeat its send's reduction is rejected, and so are
  // the rank-reduced order on a handle without weights and with use_logfmt, all without a launch.
  cases.push_back(
      Case{"ll: rank-reduced and flat combines alternating; the receive must repeat the reduction", [](Context& ctx) {
             auto c = rank_case(64, 2176, true, 257);
             c.num_experts = 64 / ctx.num_ranks * ctx.num_ranks;
             std::string err = alternating_steps(ctx, c, &LowLatencyCase::rank_reduced, 2570);
             c.rank_reduced = true;
             LowLatencySession s(ctx.buffer, c, ctx.stream);
             s.dispatch(kLowLatencyBothPhases);
             s.set_combine_inputs(2580);
             s.combine(kLowLatencySendPhase);
             expect_rejected(err, "a flat receive of a rank-reduced send", "reduction",
                             [&] { s.combine_with_reduction(kLowLatencyRecvPhase, EPX_REDUCE_FLAT); });
             s.combine(kLowLatencyRecvPhase);
             err += s.check_dispatch() + s.check_combine();
             expect_rejected(err, "rank-reduced with use_logfmt", "use_logfmt",
                             [&] { s.combine_with_logfmt(kLowLatencyBothPhases, true); });
             c.rank_reduced = false;
             LowLatencySession flat(ctx.buffer, c, ctx.stream);  // a dispatch without the weights
             flat.dispatch(kLowLatencyBothPhases);
             flat.set_combine_inputs(2590);
             expect_rejected(err, "rank-reduced on a handle without weights", "topk_weights",
                             [&] { flat.combine_with_reduction(kLowLatencyBothPhases, EPX_REDUCE_RANK); });
             expect_rejected(err, "reduction 2 (two-level)", "reduction must be",
                             [&] { flat.combine_with_reduction(kLowLatencyBothPhases, EPX_REDUCE_TWO_LEVEL); });
             expect_rejected(err, "combined_x over x", "must not overlap",
                             [&] { flat.combine_over_input(kLowLatencyBothPhases); });
             flat.combine(kLowLatencyBothPhases);
             err += flat.check_dispatch() + flat.check_combine();
             ctx.buffer.check(ctx.stream);
             return err;
           }});

  // The same calls on the same tensors, step after step (a decoding loop): from the second step on every launch repeats
  // an earlier one exactly, and from the third it runs through its launch graph (runtime/launch_graphs.hpp). Each step
  // has new routing, x and expert outputs in the same device arrays, so a graph that ran with stale inputs, or did not
  // run, fails the checks.
  for (const CombineVariant v : kCombineVariants)
    cases.push_back(Case{std::string(v.prefix) + "8 steps on the same tensors (launch graphs), 128 tokens, h7168",
                         [v](Context& ctx) {
                           auto c = ll_case(128, 7168, true, 90);
                           v.apply(c);
                           c.num_experts = c.num_experts / ctx.num_ranks * ctx.num_ranks;
                           LowLatencySession s(ctx.buffer, c, ctx.stream);
                           std::string err;
                           for (int i = 0; i < 8 && err.empty(); ++i) {
                             s.set_step(300 + i);
                             s.dispatch(kLowLatencyBothPhases);
                             err += s.check_dispatch();
                             s.set_combine_inputs(3000 + i);
                             s.combine(kLowLatencyBothPhases);
                             err += s.check_combine();
                             if (!err.empty()) err = "step " + std::to_string(i) + ":\n" + err;
                           }
                           ctx.buffer.check(ctx.stream);
                           return err;
                         }});

  for (const CombineVariant v : kCombineVariants)
    cases.push_back(Case{
        std::string(v.prefix) + "1000 steps, double-buffered (dispatch of step i+1 sent before combine i received)",
        [v](Context& ctx) {
          auto c = ll_case(48, 2048, true, 60);
          c.num_experts = 32 / ctx.num_ranks * ctx.num_ranks;
          c.num_topk = 4;
          v.apply(c);
          LowLatencySession a(ctx.buffer, c, ctx.stream);
          c.seed = 61;
          LowLatencySession b(ctx.buffer, c, ctx.stream);
          LowLatencySession* cur = &a;
          LowLatencySession* next = &b;
          cur->dispatch(kLowLatencyBothPhases);
          std::string err = cur->check_dispatch();
          for (int i = 0; i < 1000 && err.empty(); ++i) {
            cur->set_combine_inputs(7000 + i);
            cur->combine(kLowLatencySendPhase);
            next->set_step(9000 + i);
            next->dispatch(kLowLatencySendPhase);  // overlaps the combine still in flight
            cur->combine(kLowLatencyRecvPhase);
            next->dispatch(kLowLatencyRecvPhase);
            err += cur->check_combine();
            err += next->check_dispatch();
            if (!err.empty()) err = "step " + std::to_string(i) + ":\n" + err;
            std::swap(cur, next);
          }
          ctx.buffer.check(ctx.stream);
          return err;
        }});

  // Two micro-batches in flight (the overlap frameworks use): the combine of A lands on A's dispatch set. The
  // last rank starts receiving dispatch A late, so the other ranks' combine A must wait for it instead of
  // writing over records it has not read yet (v0.4 let them: its busy slots only held back the same op). All
  // host work (inputs, checks) is done before the sends or after the receives, so that the other ranks reach
  // combine A well within the late rank's delay. Without the wait this fails (or, with garbage source indices,
  // faults); it cannot pass.
  for (const CombineVariant v : kCombineVariants)
    cases.push_back(
        Case{std::string(v.prefix) + "two micro-batches (dispatch A, dispatch B, combine A, combine B), one rank late",
             [v](Context& ctx) {
               auto c = ll_case(64, 4096, true, 80);
               c.num_experts = 64 / ctx.num_ranks * ctx.num_ranks;
               v.apply(c);
               LowLatencySession a(ctx.buffer, c, ctx.stream);
               c.seed = 81;
               LowLatencySession b(ctx.buffer, c, ctx.stream);
               std::string err;
               for (int i = 0; i < 5 && err.empty(); ++i) {
                 a.set_step(800 + i);
                 b.set_step(900 + i);
                 a.set_combine_inputs(8000 + i);  // host state of set_step only: may come before the dispatch
                 b.set_combine_inputs(9000 + i);
                 a.dispatch(kLowLatencySendPhase);
                 b.dispatch(kLowLatencySendPhase);
                 if (ctx.rank == ctx.num_ranks - 1) {  // the late rank: the others run ahead into combine A meanwhile
                   cudaStreamSynchronize(ctx.stream);
                   std::this_thread::sleep_for(std::chrono::milliseconds(300));
                 }
                 a.dispatch(kLowLatencyRecvPhase);
                 b.dispatch(kLowLatencyRecvPhase);
                 a.combine(kLowLatencySendPhase);
                 b.combine(kLowLatencySendPhase);
                 a.combine(kLowLatencyRecvPhase);
                 b.combine(kLowLatencyRecvPhase);
                 err += a.check_dispatch() + b.check_dispatch() + a.check_combine() + b.check_combine();
                 if (!err.empty()) err = "round " + std::to_string(i) + ":\n" + err;
               }
               ctx.buffer.check(ctx.stream);
               return err;
             }});

  // The host keeps the order the kernels' epochs rely on (docs/semantics.md): a send into a set whose call this
  // rank has not received yet, and a receive with no call of its kind waiting, are input errors that launch
  // nothing; the calls around them still give exact results.
  cases.push_back(
      Case{"ll: call order on a buffer set is checked (send over an unreceived call, receive twice)", [](Context& ctx) {
             auto c = ll_case(32, 2048, true, 85);
             LowLatencySession a(ctx.buffer, c, ctx.stream);
             c.seed = 86;
             LowLatencySession b(ctx.buffer, c, ctx.stream);
             c.seed = 87;
             LowLatencySession extra(ctx.buffer, c, ctx.stream);
             std::string err;
             a.dispatch(kLowLatencySendPhase);  // set 0
             b.dispatch(kLowLatencySendPhase);  // set 1
             expect_rejected(err, "a third send onto set 0 before dispatch A is received", "has not received",
                             [&] { extra.dispatch(kLowLatencySendPhase); });
             // Dispatch A's receive with BF16 named: the records on its set are FP8.
             expect_rejected(err, "dispatch A received as BF16", "use_fp8", [&] { a.receive_with_fp8(false); });
             a.dispatch(kLowLatencyRecvPhase);
             expect_rejected(err, "dispatch A received twice", "waiting to be received",
                             [&] { a.dispatch(kLowLatencyRecvPhase); });
             b.dispatch(kLowLatencyRecvPhase);
             a.set_combine_inputs(8500);
             a.combine(kLowLatencySendPhase);  // set 0 again: dispatch A was received
             a.combine(kLowLatencyRecvPhase);
             expect_rejected(err, "combine A received twice", "waiting to be received",
                             [&] { a.combine(kLowLatencyRecvPhase); });
             err += a.check_dispatch() + b.check_dispatch() + a.check_combine();
             // A stale hook while a newer dispatch waits on its set: B's receive again, with another dispatch on set 1.
             extra.dispatch(kLowLatencySendPhase);  // set 1
             expect_rejected(err, "dispatch B received again while another dispatch waits on its set",
                             "names other tensors", [&] { b.dispatch(kLowLatencyRecvPhase); });
             extra.dispatch(kLowLatencyRecvPhase);
             err += extra.check_dispatch();
             ctx.buffer.check(ctx.stream);
             return err;
           }});

  for (const CombineVariant v : kCombineVariants)
    cases.push_back(
        Case{std::string(v.prefix) + "CUDA graph of dispatch + combine, 100 replays with new data", [v](Context& ctx) {
               auto c = ll_case(64, 4096, false, 70);
               c.expert_identity = true;  // combine reads packed_recv_x: no host work between the two calls
               v.apply(c);
               c.num_experts = 64 / ctx.num_ranks * ctx.num_ranks;
               LowLatencySession s(ctx.buffer, c, ctx.stream);
               s.dispatch(kLowLatencyBothPhases);  // warm-up outside the graph (and keeps sets in step on every rank)
               s.set_combine_inputs(0);
               s.combine(kLowLatencyBothPhases);
               std::string err = s.check_dispatch() + s.check_combine();
               cudaGraph_t graph = nullptr;
               cudaGraphExec_t exec = nullptr;
               if (const std::string failed = capture_step(s, ctx.stream, &graph, &exec); !failed.empty())
                 return failed;
               for (int i = 0; i < 100 && err.empty(); ++i) {
                 s.set_step(100 + i);  // new routing, x and weights in the same device arrays
                 const cudaError_t e = cudaGraphLaunch(exec, ctx.stream);
                 if (e != cudaSuccess) return std::string("graph launch failed: ") + cudaGetErrorString(e) + "\n";
                 s.note_replayed_dispatch();
                 err += s.check_dispatch() + s.check_combine();
                 if (!err.empty()) err = "replay " + std::to_string(i) + ":\n" + err;
               }
               cudaGraphExecDestroy(exec);
               cudaGraphDestroy(graph);
               ctx.buffer.check(ctx.stream);
               return err;
             }});
  return cases;
}

}  // namespace epx::gpu_test
