#include "ht_common.hpp"

#include <utility>

namespace epx::gpu_test {

using harness::HtCase;
using harness::HtSession;

HtCase base_case(std::vector<int> tokens, int hidden, uint64_t seed) {
  HtCase c;
  c.tokens = std::move(tokens);
  c.hidden = hidden;
  c.routing.num_experts = 64;
  c.routing.num_topk = 8;
  c.routing.empty_slot_prob = 0.1;
  c.routing.seed = seed;
  c.seed = seed;
  return c;
}

std::string dispatch_and_combine(HtSession& s, uint64_t combine_seed) {
  s.layout();
  s.dispatch();
  std::string err = s.check_dispatch();
  s.set_combine_inputs(combine_seed);
  s.combine();
  return err + s.check_combine();
}

std::string wrong_error(const Error& e, Status want, const char* says) {
  if (e.status() != want || std::string(e.what()).find(says) == std::string::npos)
    return std::string("wrong error: ") + e.what() + "\n";
  return std::string();
}

std::string buffer_too_small(Context& ctx, const HtCase& c, const Config& config, const char* says, const char* lacks) {
  HtSession s(ctx.buffer, c, config, config, ctx.stream);
  s.layout();
  try {
    s.dispatch();
  } catch (const Error& e) {
    if (e.status() != Status::kBufferTooSmall) return std::string("wrong status: ") + e.what() + "\n";
    if (std::string(e.what()).find(says) == std::string::npos)
      return std::string("message does not ") + lacks + ": " + e.what() + "\n";
    return std::string();
  }
  return std::string("expected kBufferTooSmall\n");
}

std::string worst_tokens_overflow(Context& ctx, HtCase c, bool every_rank) {
  c.worst_case = true;
  c.worst_tokens_override = 1;
  std::string err;
  {
    HtSession s(ctx.buffer, c, ctx.dispatch_config, ctx.combine_config, ctx.stream);
    s.layout();
    s.dispatch();  // no host wait in worst-case mode
    try {
      ctx.buffer.check(ctx.stream);
      if (every_rank)
        err = "expected check() to report num_worst_tokens\n";
      else if (s.num_recv_tokens() > 1 || s.num_rdma_recv_tokens() > 1)
        err = "expected check() to report num_worst_tokens on this rank\n";
    } catch (const Error& e) {
      err = wrong_error(e, Status::kInvalidArgument, "num_worst_tokens");
    }
  }
  c.worst_tokens_override = 0;
  HtSession s(ctx.buffer, c, ctx.dispatch_config, ctx.combine_config, ctx.stream);
  return err + dispatch_and_combine(s, 3);
}

}  // namespace epx::gpu_test
