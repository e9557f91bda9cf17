#include "options.hpp"

#include <charconv>
#include <climits>
#include <functional>
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

// An option every high-throughput mode has: parses it into *o (its value through value()) and returns true;
// false for any other option.
bool parse_ht_option(const std::string& a, const std::function<std::string()>& value, HtOptions* o) {
  if (a == "--gpus") {
    o->gpus = parse_int(a, value(), 1, 1024);
    if (o->gpus < 2) throw UsageError{"--gpus 1: the benchmark needs at least 2 GPUs (it measures traffic)"};
  } else if (a == "--tokens") {
    o->tokens = parse_int(a, value(), 1, 1 << 20);
  } else if (a == "--hidden") {
    o->hidden = parse_int(a, value(), epx::limits().fp8_group_size, epx::limits().max_hidden);
  } else if (a == "--topk") {
    o->topk = parse_int(a, value(), 1, epx::limits().max_topk);
  } else if (a == "--experts") {
    o->experts = parse_int(a, value(), 1, 1 << 16);
    o->experts_given = true;
  } else if (a == "--sms") {
    o->sms = parse_int_list(a, value(), 2, 1024);
  } else if (a == "--iters") {
    o->iters = parse_int(a, value(), 1, 1000000);
  } else if (a == "--warmup") {
    o->warmup = parse_int(a, value(), 0, 1000000);
  } else if (a == "--refresh-every") {
    o->refresh_every = parse_int(a, value(), 0, INT_MAX);
  } else if (a == "--json") {
    o->json_path = value();
    if (o->json_path.empty()) throw UsageError{"--json needs a file name"};
  } else if (a == "--no-nccl") {
    o->nccl = false;
  } else if (a == "--worst-case") {
    o->worst_case = true;
  } else if (a == "--seed") {
    o->seed = parse_u64(a, value());
  } else {
    return false;
  }
  return true;
}

// Checks between the options of HtOptions, once all are parsed. Throws UsageError.
void check_ht_options(const HtOptions& o) {
  // Hidden sizes whose FP8 scales (one per group) cover the row exactly.
  const int fp8_group = epx::limits().fp8_group_size;
  if (o.hidden % fp8_group != 0)
    throw UsageError{"--hidden must be a multiple of " + std::to_string(fp8_group) +
                     " (FP8 rows carry one scale per 128 values), got " + std::to_string(o.hidden)};
  if (o.topk > o.experts)
    throw UsageError{"--topk (" + std::to_string(o.topk) + ") must not exceed --experts (" + std::to_string(o.experts) +
                     "): a token's experts are distinct"};
}

void check_experts_split(const HtOptions& o, int num_ranks) {  // after fit_experts
  if (o.experts % num_ranks != 0)
    throw UsageError{"--experts (" + std::to_string(o.experts) + ") must be a multiple of the rank count (" +
                     std::to_string(num_ranks) + ")"};
}

}  // namespace

void fit_experts(HtOptions& o, int num_ranks) {
  if (!o.experts_given && o.experts % num_ranks != 0) o.experts = o.experts / num_ranks * num_ranks;
}

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
         "  --experts E        experts in total, a multiple of the rank count (256, or the largest multiple\n"
         "                     of the rank count below it)\n"
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
         "  --worst-case       dispatch in worst-case mode: num_worst_tokens = the sum of all ranks' tokens, no\n"
         "                     host wait for the counts (outputs padded to that many rows)\n"
         "  --in-buffer        dispatch into the buffer's output region (dispatch_in_buffer: senders write rows\n"
         "                     to their final place at the receiver, the host waits for counts after the launch)\n"
         "                     and combine from it (combine_in_buffer: the source rank reads every row in place)\n"
         "  --two-step         dispatch with a layout as notify_dispatch (the host waits for the counts, unless\n"
         "                     --worst-case), then dispatch; by default dispatch_sized runs both in\n"
         "                     one launch into outputs sized by a guess (the sum of all ranks' tokens), as the\n"
         "                     Python package does there from its second call with a token count on\n"
         "  --guess-offset N   dispatch_sized's guess: the rows each rank receives + N (0: exact; below 0 every\n"
         "                     call's guess is short and every rank repeats the count exchange, the cost of\n"
         "                     a wrong guess); default: the sum of all ranks' tokens\n"
         "  --check-all        check results against the reference model for every swept config, not only\n"
         "                     the default one\n"
         "  --seed S           routing and data seed (1)\n"
         "Uniform random top-k routing. Bandwidth = bytes this rank receives (own included) / median time.\n"
         "The NCCL baseline is loaded at run time from $EPX_NCCL_LIB, libnccl.so.2 or the pip package.\n";
}

// The option loop of a high-throughput mode: --help, the options every such mode has (parse_ht_option), then
// `own(o, a, value)` for the mode's own ones (false: unknown), then check_ht_options.
template <typename Options, typename Own>
Options parse_ht_mode_options(int argc, char** argv, bool* help, Own own) {
  Options o;
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
    }
    if (!parse_ht_option(a, value, &o) && !own(o, a, value)) throw UsageError{"unknown option '" + a + "'"};
  }
  check_ht_options(o);
  return o;
}

IntranodeOptions parse_intranode_options(int argc, char** argv, bool* help) {
  IntranodeOptions o = parse_ht_mode_options<IntranodeOptions>(
      argc, argv, help, [](IntranodeOptions& o, const std::string& a, const std::function<std::string()>& value) {
        if (a == "--chunks")
          o.chunks = parse_int_list(a, value(), 1, 1 << 20);
        else if (a == "--ring")
          o.rings = parse_int_list(a, value(), 1, 1 << 20);
        else if (a == "--check-all")
          o.check_all = true;
        else if (a == "--in-buffer")
          o.in_buffer = true;
        else if (a == "--two-step")
          o.two_step = true;
        else if (a == "--guess-offset") {
          o.guess_offset = parse_int(a, value(), -(1 << 20), 1 << 20);
        } else
          return false;
        return true;
      });
  if (o.guess_offset && (!runs_sized(o) || o.worst_case))
    throw UsageError{
        "--guess-offset sizes the outputs of dispatch_sized, which --two-step, --in-buffer and "
        "--worst-case do not run with a guess"};
  return o;
}

void validate_intranode_options(const IntranodeOptions& o, int num_ranks) { check_experts_split(o, num_ranks); }

bool runs_sized(const HtOptions& o) { return !o.two_step && !o.in_buffer; }

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
        Config cfg = d;  // the network fields are the default config's (unused by the intranode mode)
        cfg.num_sms = s;
        cfg.num_max_send_tokens = c;
        cfg.num_max_recv_tokens = r;
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

const char* internode_usage() {
  return "epx-bench internode [options]: dispatch / combine bandwidth of the internode kernels on the GPUs of this\n"
         "machine, split into D NVLink domains of G = N / D GPUs (the hop between domains is the network one)\n"
         "  --gpus N           ranks, one per GPU (default: every visible GPU; at least 2)\n"
         "  --domains D        NVLink domains, a divisor of N (default N: every GPU its own domain); 1 runs the\n"
         "                     internode kernels inside one domain (forced: the NVLink forwarding alone)\n"
         "  --tokens T         tokens per rank (4096)\n"
         "  --hidden H         hidden size, a multiple of 128 (7168)\n"
         "  --topk K           experts per token (8)\n"
         "  --experts E        experts in total, a multiple of the rank count (256, or the largest multiple\n"
         "                     of the rank count below it)\n"
         "  --sms LIST         num_sms values to time, e.g. 24 or 16,24 (the default config's, 24); chunks and\n"
         "                     rings are the default configs' (dispatch's for dispatch, combine's for combine)\n"
         "  --iters N          timed iterations per measurement (30)\n"
         "  --warmup N         untimed iterations first (5)\n"
         "  --refresh-every N  regenerate x every N timed iterations; 0: once per measurement (1)\n"
         "  --json FILE        also write every row as JSON\n"
         "  --no-nccl          skip the NCCL all-to-all baseline\n"
         "  --worst-case       dispatch in worst-case mode: num_worst_tokens = the sum of all ranks' tokens, no\n"
         "                     host wait for the counts (outputs padded to that many rows)\n"
         "  --seed S           routing and data seed (1)\n"
         "Uniform random top-k routing. First BF16, FP8 and cached dispatch and combine in both orders (two-level,\n"
         "flat) are checked against the reference model, then timed. GB/s = bytes this rank receives (own\n"
         "included) / median time; net GB/s (dispatch rows) = bytes of the rows that crossed the network hop into\n"
         "this rank (sent from another domain) / median time, 0 with one domain. The NCCL baseline is an\n"
         "all-to-all of the same rows over all N ranks, loaded at run time from $EPX_NCCL_LIB, libnccl.so.2 or\n"
         "the pip package. Needs a libepx built with NVSHMEM.\n";
}

InternodeOptions parse_internode_options(int argc, char** argv, bool* help) {
  InternodeOptions o = parse_ht_mode_options<InternodeOptions>(
      argc, argv, help, [](InternodeOptions& o, const std::string& a, const std::function<std::string()>& value) {
        if (a != "--domains") return false;
        o.domains = parse_int(a, value(), 1, epx::limits().max_ranks);
        return true;
      });
  if (!*help && o.gpus > 0) {  // the split is known already: say now what is wrong
    fit_experts(o, o.gpus);
    internode_domains(o, o.gpus);
  }
  return o;
}

int internode_domains(const InternodeOptions& o, int num_ranks) {
  const int D = o.domains > 0 ? o.domains : num_ranks;
  if (num_ranks % D != 0)
    throw UsageError{"--domains " + std::to_string(D) + " does not divide the " + std::to_string(num_ranks) +
                     " ranks into domains of equal size"};
  const int G = num_ranks / D, max_g = epx::limits().max_nvl_ranks;
  if (G > max_g)
    throw UsageError{"--domains " + std::to_string(D) + ": " + std::to_string(G) +
                     " GPUs per domain; a domain has at most " + std::to_string(max_g)};
  check_experts_split(o, num_ranks);
  return D;
}

Config internode_combine_config(const Config& dispatch, int num_ranks) {
  Config c = default_combine_config(num_ranks);
  c.num_sms = dispatch.num_sms;
  return c;
}

std::vector<Config> internode_sweep(const InternodeOptions& o, int num_ranks, int num_nvl_ranks,
                                    std::vector<std::string>* skipped) {
  const Config d = default_dispatch_config(num_ranks);
  const std::vector<int> sms = o.sms.empty() ? std::vector<int>{d.num_sms} : o.sms;
  std::vector<Config> out;
  std::set<int> seen;  // a value listed twice is timed once
  for (int s : sms) {
    if (!seen.insert(s).second) continue;
    Config cfg = d;
    cfg.num_sms = s;
    try {
      const int64_t row = int64_t(o.hidden) * 2;
      internode_size_hints(cfg, row, num_ranks, num_nvl_ranks);  // validates the config for D x G ranks
      internode_size_hints(internode_combine_config(cfg, num_ranks), row, num_ranks, num_nvl_ranks);
      out.push_back(cfg);
    } catch (const Error& e) {
      skipped->push_back(describe(cfg) + ": " + e.what());
    }
  }
  return out;
}

}  // namespace epx::bench
