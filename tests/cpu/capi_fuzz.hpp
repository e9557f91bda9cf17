// A seeded fuzzer of every entry point of the C ABI (include/epx/epx.h) and of the checks that run without a GPU
// (the argument validation behind the operations, the domain and transport choices, the reference model). Each
// case draws its inputs from its own seed (the run's seed and the case number), so any case replays alone.
// The rules it holds every call to are in capi_fuzz.cpp; epx_cpu_tests runs it (capi_fuzz_test.cpp) and
// scripts/fuzz.sh runs it under AddressSanitizer and UBSan (capi_fuzz_main.cpp).
#pragma once

#include <cstdint>
#include <map>
#include <string>
#include <vector>

namespace epx_fuzz {

struct Options {
  uint64_t seed = 1;
  int64_t cases = 2000;
  int64_t first_case = 0;  // replays cases [first_case, first_case + cases)
  std::string trace_file;  // rewritten with the case's line before each case: what ran last when the process died
};

// What one fuzzed function (an entry point of the C ABI, or a check of the C++ side) was called with and said.
struct Target {
  std::string name;
  int64_t cases = 0;
  std::map<std::string, int64_t> outcomes;  // a status (EPX_ERR_INVALID_ARGUMENT, ...), an exception or a value
};

struct Report {
  std::vector<Target> targets;        // in the order the fuzzer takes them
  std::vector<std::string> failures;  // each: the case, the call and the rule it broke (at most 50 kept)
  int64_t num_failures = 0;
  int64_t cases = 0;
  int64_t last_error_checks = 0;  // C ABI calls after which epx_last_error() was checked
};

Report run(const Options& options);
// "case N (target); replay with ..." of the case running now, for a crash handler (a static buffer).
const char* current_case();
// The table printed after a run: target, cases, outcomes.
std::string format(const Report& report);
// The C ABI functions the fuzzer calls (every function epx.h declares; capi_fuzz_test.cpp checks that).
std::vector<std::string> c_abi_entry_points();

}  // namespace epx_fuzz
