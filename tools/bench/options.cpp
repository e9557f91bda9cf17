#include "options.hpp"

#include <charconv>
#include <climits>
#include <set>
#include <sstream>
#include <tuple>

namespace epx::bench {
namespace {

// Sweep used when no --sms/--chunks/--ring is given: around the default point (24 SMs, the default chunk).
// Kept small: each config costs a few seconds (its x refreshes are generated on the host).
const std::vector<int> kDefaultSweepSms = {16, 24, 32};

std::string describe(const Config& c) {
  std::ostringstream o;
  o << "sms " << c.num_sms << " chunk " << c.num_max_send_tokens << " ring " << c.num_max_recv_tokens;
  return o.str();
}

}  // namespace

int parse_int(const std::string& name, const std::string& text, int lo, int hi) {
  long long v = 0;
  const char* end = text.data() + text.size();
  const auto r = std::from_chars(text.data(), end, v);
  if (text.empty() || r.ec != std::errc() || r.ptr != end)
    throw UsageError{name + " wants an integer, got '" + text + "'"};
  if (v < lo || v > hi)
    throw UsageError{name + " must be in [" + std::to_string(lo) + ", " + std::to_string(hi) + "], got " + text};
  return int(v);
}

uint64_t parse_u64(const std::string& name, const std::string& text) {
  uint64_t v = 0;
  const char* end = text.data() + text.size();
  const auto r = std::from_chars(text.data(), end, v);
  if (text.empty() || r.ec != std::errc() || r.ptr != end)
    throw UsageError{name + " wants a non-negative integer, got '" + text + "'"};
  return v;
}

std::vector<int> parse_int_list(const std::string& name, const std::string& text, int lo, int hi) {
  std::vector<int> out;
  size_t start = 0;
  while (true) {
    const size_t comma = text.find(',', start);
    out.push_back(parse_int(name, text.substr(start, comma - start), lo, hi));
    if (comma == std::string::npos) break;
    start = comma + 1;
  }
  return out;
}

const char* intranode_usage() {
  return "epx-bench intranode [options]: dispatch / combine bandwidth on the GPUs of this machine\n"
         "  --gpus N           ranks, one per GPU (default: every visible GPU; at least 2)\n"
         "  --tokens T         tokens per rank (4096)\n"
         "  --hidden H         hidden size, a multiple of 128 (7168)\n"
         "  --topk K           experts per token (8)\n"
         "  --experts E        experts in total, a multiple of the rank count (256)\n"
         "  --sms LIST         num_sms values to sweep, e.g. 24 or 16,24,32\n"
         "  --chunks LIST      num_max_send_tokens values to sweep\n"
         "  --ring LIST        num_max_recv_tokens values to sweep\n"
         "                     (none of the three: sms 16,24,32 x chunk {dispatch default, combine default,\n"
         "                      2 x combine default} x ring 256; a list left out takes its default values)\n"
         "  --iters N          timed iterations per measurement (30)\n"
         "  --warmup N         untimed iterations first (5)\n"
         "  --refresh-every N  regenerate x every N timed iterations; 0: once per measurement (1)\n"
         "  --json FILE        also write every row as JSON\n"
         "  --no-nccl          skip the NCCL all-to-all baseline\n"
         "  --check-all        check results against the reference model for every swept config, not only\n"
         "                     the default one\n"
         "  --seed S           routing and data seed (1)\n"
         "Uniform random top-k routing. Bandwidth = bytes this rank receives (own included) / median time.\n"
         "The NCCL baseline is loaded at run time from $EPX_NCCL_LIB, libnccl.so.2 or the pip package.\n";
}

IntranodeOptions parse_intranode_options(int argc, char** argv, bool* help) {
  IntranodeOptions o;
  *help = false;
  for (int i = 0; i < argc; ++i) {
    const std::string a = argv[i];
    // Every option but the flags takes one value.
    auto value = [&]() -> std::string {
      if (i + 1 >= argc) throw UsageError{a + " needs a value"};
      return argv[++i];
    };
    if (a == "--help" || a == "-h") {
      *help = true;
      return o;
    } else if (a == "--gpus") {
      o.gpus = parse_int(a, value(), 1, 1024);
      if (o.gpus < 2) throw UsageError{"--gpus 1: the benchmark needs at least 2 GPUs (it measures traffic)"};
    } else if (a == "--tokens") {
      o.tokens = parse_int(a, value(), 1, 1 << 20);
    } else if (a == "--hidden") {
      o.hidden = parse_int(a, value(), epx::limits().fp8_group_size, epx::limits().max_hidden);
    } else if (a == "--topk") {
      o.topk = parse_int(a, value(), 1, epx::limits().max_topk);
    } else if (a == "--experts") {
      o.experts = parse_int(a, value(), 1, 1 << 16);
    } else if (a == "--sms") {
      o.sms = parse_int_list(a, value(), 2, 1024);
    } else if (a == "--chunks") {
      o.chunks = parse_int_list(a, value(), 1, 1 << 20);
    } else if (a == "--ring") {
      o.rings = parse_int_list(a, value(), 1, 1 << 20);
    } else if (a == "--iters") {
      o.iters = parse_int(a, value(), 1, 1000000);
    } else if (a == "--warmup") {
      o.warmup = parse_int(a, value(), 0, 1000000);
    } else if (a == "--refresh-every") {
      o.refresh_every = parse_int(a, value(), 0, INT_MAX);
    } else if (a == "--json") {
      o.json_path = value();
      if (o.json_path.empty()) throw UsageError{"--json needs a file name"};
    } else if (a == "--no-nccl") {
      o.nccl = false;
    } else if (a == "--check-all") {
      o.check_all = true;
    } else if (a == "--seed") {
      o.seed = parse_u64(a, value());
    } else {
      throw UsageError{"unknown option '" + a + "'"};
    }
  }
  // Hidden sizes whose FP8 scales (one per group) cover the row exactly.
  const int fp8_group = epx::limits().fp8_group_size;
  if (o.hidden % fp8_group != 0)
    throw UsageError{"--hidden must be a multiple of " + std::to_string(fp8_group) +
                     " (FP8 rows carry one scale per 128 values), got " + std::to_string(o.hidden)};
  if (o.topk > o.experts)
    throw UsageError{"--topk (" + std::to_string(o.topk) + ") must not exceed --experts (" + std::to_string(o.experts) +
                     "): a token's experts are distinct"};
  return o;
}

void validate_intranode_options(const IntranodeOptions& o, int num_ranks) {
  if (o.experts % num_ranks != 0)
    throw UsageError{"--experts (" + std::to_string(o.experts) + ") must be a multiple of the rank count (" +
                     std::to_string(num_ranks) + ")"};
}

std::vector<Config> sweep_configs(const IntranodeOptions& o, int num_ranks, std::vector<std::string>* skipped) {
  const Config d = default_dispatch_config(num_ranks), dc = default_combine_config(num_ranks);
  const bool any_given = !o.sms.empty() || !o.chunks.empty() || !o.rings.empty();
  std::vector<int> sms = o.sms, chunks = o.chunks, rings = o.rings;
  if (sms.empty()) sms = any_given ? std::vector<int>{d.num_sms} : kDefaultSweepSms;
  // Both ops' default chunks (they differ at some rank counts), so each op is timed at its own default.
  if (chunks.empty())
    chunks = any_given ? std::vector<int>{d.num_max_send_tokens, dc.num_max_send_tokens}
                       : std::vector<int>{d.num_max_send_tokens, dc.num_max_send_tokens, 2 * dc.num_max_send_tokens};
  if (rings.empty()) rings = {d.num_max_recv_tokens};

  std::vector<Config> out;
  std::set<std::tuple<int, int, int>> seen;  // a value listed twice is timed once
  for (int s : sms)
    for (int c : chunks)
      for (int r : rings) {
        const Config cfg{s, c, r};
        if (!seen.insert({s, c, r}).second) continue;
        try {
          validate_config(cfg, num_ranks);
          out.push_back(cfg);
        } catch (const Error& e) {
          skipped->push_back(describe(cfg) + ": " + e.what());
        }
      }
  return out;
}

}  // namespace epx::bench
