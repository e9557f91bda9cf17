// Config checks that the operations share (the public helpers are in epx.hpp).
#pragma once

#include "epx/epx.hpp"

namespace epx {

// Throws kInvalidArgument naming the first bad field of an internode config for D domains of G ranks.
void validate_internode_config(const Config& config, int num_nvl_ranks, int num_domains);

}  // namespace epx
