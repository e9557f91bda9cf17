// The C ABI fuzzer (capi_fuzz.hpp) inside the CPU tests: a fixed seed and a few thousand cases on every CPU test
// run, and a check that it calls every function epx.h declares (a new entry point needs its fuzz target).
#include "capi_fuzz.hpp"

#include <gtest/gtest.h>

#include <algorithm>
#include <fstream>
#include <regex>
#include <set>
#include <sstream>
#include <string>

TEST(CApiFuzz, EveryCallSaysWhatWasWrongAndNothingCrashes) {
  epx_fuzz::Options o;
  o.seed = 30;
  o.cases = 100000;
  const epx_fuzz::Report report = epx_fuzz::run(o);
  EXPECT_EQ(report.num_failures, 0) << epx_fuzz::format(report);
  for (const epx_fuzz::Target& t : report.targets) EXPECT_GT(t.cases, 0) << t.name;
}

TEST(CApiFuzz, CallsEveryFunctionOfTheCAbi) {
  std::ifstream header(EPX_SOURCE_DIR "/include/epx/epx.h");
  ASSERT_TRUE(header.good()) << EPX_SOURCE_DIR "/include/epx/epx.h";
  std::stringstream text;
  text << header.rdbuf();
  // Declarations: a return type, then "epx_name(" (the callback typedef is "(*epx_allgather_fn)").
  const std::string all = text.str();
  const std::regex declaration(R"((?:^|\n)\s*(?:const\s+)?\w+\*?\s+\*?(epx_\w+)\s*\()");
  std::set<std::string> declared;
  for (std::sregex_iterator it(all.begin(), all.end(), declaration), end; it != end; ++it) declared.insert((*it)[1]);
  ASSERT_GT(declared.size(), 20u) << "the declarations of epx.h were not found";
  const std::vector<std::string> fuzzed = epx_fuzz::c_abi_entry_points();
  for (const std::string& name : declared)
    EXPECT_NE(std::find(fuzzed.begin(), fuzzed.end(), name), fuzzed.end())
        << name << " is declared in epx.h but tests/cpu/capi_fuzz.cpp has no target for it";
  for (const std::string& name : fuzzed) EXPECT_EQ(declared.count(name), 1u) << name << " is not in epx.h";
}
