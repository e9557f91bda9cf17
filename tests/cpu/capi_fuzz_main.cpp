// epx_capi_fuzz: the C ABI fuzzer (capi_fuzz.hpp) as a program, for bounded runs under the sanitizers
// (scripts/fuzz.sh). Prints the table of targets, cases and outcomes; exits 1 on any failure.
//   epx_capi_fuzz [--cases N] [--seed S] [--first K] [--trace FILE]
// --trace FILE holds the line of the case running, for a death the program cannot report itself (UBSan's report
// ends the process without calling back; scripts/fuzz.sh prints the file then).
#include <unistd.h>

#include <csignal>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <string>

#include "capi_fuzz.hpp"

// The sanitizers' runtime calls this before it ends the process on an error it found (a weak symbol: absent from
// builds without a sanitizer).
extern "C" void __sanitizer_set_death_callback(void (*callback)(void)) __attribute__((weak));

namespace {

void say_current_case() {
  const char* line = epx_fuzz::current_case();
  [[maybe_unused]] ssize_t n = write(2, line, std::strlen(line));
}

void on_signal(int sig) {
  say_current_case();
  std::signal(sig, SIG_DFL);
  std::raise(sig);
}

int usage() {
  std::fprintf(stderr, "usage: epx_capi_fuzz [--cases N] [--seed S] [--first K] [--trace FILE]\n");
  return 2;
}

}  // namespace

int main(int argc, char** argv) {
  epx_fuzz::Options o;
  for (int i = 1; i < argc; ++i) {
    const std::string a = argv[i];
    const bool has_value = i + 1 < argc;
    if (a == "--cases" && has_value) {
      o.cases = std::strtoll(argv[++i], nullptr, 10);
    } else if (a == "--seed" && has_value) {
      o.seed = std::strtoull(argv[++i], nullptr, 10);
    } else if (a == "--first" && has_value) {
      o.first_case = std::strtoll(argv[++i], nullptr, 10);
    } else if (a == "--trace" && has_value) {
      o.trace_file = argv[++i];
    } else {
      return usage();
    }
  }
  if (o.cases < 0 || o.first_case < 0) return usage();
  if (__sanitizer_set_death_callback != nullptr) __sanitizer_set_death_callback(say_current_case);
  for (int sig : {SIGSEGV, SIGBUS, SIGFPE, SIGILL, SIGABRT}) std::signal(sig, on_signal);

  const epx_fuzz::Report report = epx_fuzz::run(o);
  std::printf("epx_capi_fuzz: seed %llu, cases %lld..%lld\n%s", (unsigned long long)o.seed, (long long)o.first_case,
              (long long)(o.first_case + o.cases - 1), epx_fuzz::format(report).c_str());
  return report.num_failures == 0 ? 0 : 1;
}
