// What the high-throughput case files (high_throughput_cases.cpp, internode_cases.cpp) share: the base case, the
// plain layout -> dispatch -> combine check, the check of an expected error, and the num_worst_tokens overflow case.
#pragma once

#include <cstdint>
#include <string>
#include <vector>

#include "../../tools/harness/high_throughput.hpp"
#include "gpu_test.hpp"

namespace epx::gpu_test {

// Top-8 of 64 experts with 10% empty slots; routing and data from `seed`.
harness::HtCase base_case(std::vector<int> tokens, int hidden, uint64_t seed);

// layout -> dispatch -> combine on s (combine inputs from combine_seed), dispatch and combine checked against the
// reference model; "" when both are right.
std::string dispatch_and_combine(harness::HtSession& s, uint64_t combine_seed);

// "" when e has status `want` and a message that contains `says`, else "wrong error: <message>\n".
std::string wrong_error(const Error& e, Status want, const char* says);

// Case c on `config` (dispatch and combine) must fail its dispatch before any launch with kBufferTooSmall and a
// message that contains `says`; `lacks` names what such a message is missing otherwise ("message does not <lacks>").
std::string buffer_too_small(Context& ctx, const harness::HtCase& c, const Config& config, const char* says,
                             const char* lacks);

// Case c in worst-case mode with num_worst_tokens 1: check() must report num_worst_tokens (kInvalidArgument) on
// every rank (one domain: the data kernels skip on every rank) or, with every_rank false (internode), on each rank
// that receives more than one row (it drops the rows that do not fit). Then c with its own num_worst_tokens on the
// same buffer must be right (combine seed 3).
std::string worst_tokens_overflow(Context& ctx, harness::HtCase c, bool every_rank);

}  // namespace epx::gpu_test
