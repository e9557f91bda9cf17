// Command-line options of `epx-bench intranode` and `epx-bench internode`, and the small parsers other
// subcommands can reuse.
#pragma once

#include <cstdint>
#include <optional>
#include <string>
#include <vector>

#include "epx/epx.hpp"

namespace epx::bench {

// Thrown for a bad command line; main prints the message and the usage, and exits 2.
struct UsageError {
  std::string message;
};

// Strict parsers: the whole text must be a number in [lo, hi] ("--name" only appears in the error message).
int parse_int(const std::string& name, const std::string& text, int lo, int hi);
uint64_t parse_u64(const std::string& name, const std::string& text);
// "24,16,32" -> {24, 16, 32}; every item in [lo, hi].
std::vector<int> parse_int_list(const std::string& name, const std::string& text, int lo, int hi);

// Options every high-throughput mode (intranode, internode) has.
struct HtOptions {
  int gpus = 0;  // 0: every visible GPU
  int tokens = 4096;
  int hidden = 7168;
  int topk = 8;
  int experts = 256;
  bool experts_given = false;  // --experts: used as given (else fit_experts rounds 256 down to the rank count)
  std::vector<int> sms;        // empty: the mode's default
  int iters = 30;
  int warmup = 5;
  int refresh_every = 1;  // timed iterations between two refreshes of x (0: once per series)
  std::string json_path;
  bool nccl = true;
  bool worst_case = false;  // dispatch with num_worst_tokens: no host wait for the counts
  bool in_buffer = false;   // intranode: dispatch into the buffer's output region, combine from it (--in-buffer)
  bool two_step = false;    // intranode: notify_dispatch, then dispatch (--two-step), not dispatch_sized
  // intranode, sized dispatch: the guess is the rows a rank receives + guess_offset (--guess-offset; < 0: every call
  // repeats the count exchange), else all ranks' tokens
  std::optional<int> guess_offset;
  uint64_t seed = 1;
};

struct IntranodeOptions : HtOptions {
  std::vector<int> chunks, rings;  // empty: see sweep_configs (with sms)
  bool check_all = false;          // also check the results of every swept config
};

struct InternodeOptions : HtOptions {
  int domains = 0;  // NVLink domains D (0: one per GPU); G = ranks / D GPUs each
};

const char* intranode_usage();
// Throws UsageError. Sets *help when --help was asked for.
IntranodeOptions parse_intranode_options(int argc, char** argv, bool* help);
// Checks that need the rank count (experts per rank, FP8 groups). Throws UsageError.
// Without --experts, the default 256 experts rounded down to a multiple of the rank count (255 at 3 ranks), as the
// low-latency mode does with its 288; an --experts that is not a multiple stays an error (check_experts_split).
void fit_experts(HtOptions& o, int num_ranks);

void validate_intranode_options(const IntranodeOptions& o, int num_ranks);

// Whether dispatches with a layout run as dispatch_sized, as the Python package's do: unless --two-step or --in-buffer.
bool runs_sized(const HtOptions& o);

// The configs to time, in order. With no --sms/--chunks/--ring: sms {16, 24, 32} x chunk {d, 2d} x ring {256}
// (d = the default chunk for num_ranks). With any of them: the lists given, the missing ones at their single
// default value. Combinations the library rejects (ring < chunk, ...) are dropped and named in *skipped.
std::vector<Config> sweep_configs(const IntranodeOptions& o, int num_ranks, std::vector<std::string>* skipped);

const char* internode_usage();
// Throws UsageError. Sets *help when --help was asked for.
InternodeOptions parse_internode_options(int argc, char** argv, bool* help);
// The domain count D for num_ranks GPUs (--domains, or one per GPU). Throws UsageError when D does not divide
// num_ranks, a domain would hold more GPUs than the library allows, or the experts do not split over the ranks.
int internode_domains(const InternodeOptions& o, int num_ranks);

// The internode configs to time: per --sms value (default: the default config's) the default dispatch config
// with that num_sms. Its combine config is internode_combine_config(). Configs the library rejects for D x G
// ranks at this hidden size are dropped and named in *skipped.
std::vector<Config> internode_sweep(const InternodeOptions& o, int num_ranks, int num_nvl_ranks,
                                    std::vector<std::string>* skipped);
// The default combine config at the dispatch config's num_sms (combine runs on the dispatch's channels).
Config internode_combine_config(const Config& dispatch, int num_ranks);

}  // namespace epx::bench
