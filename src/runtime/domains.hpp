// How a Buffer's ranks form NVLink domains (R = D x G) and whether the internode kernels serve it. Decided once at
// creation, the same on every rank.
#pragma once

#include <string>
#include <vector>

#include "epx/epx.hpp"

namespace epx {

struct DomainChoice {
  int num_nvl_ranks = 1;   // G
  bool internode = false;  // D > 1, or forced
};

// options.num_nvl_ranks (or what internode_size_hints is given): 0 (the default), or at most kMaxNvlRanks and a
// divisor of num_ranks. Throws kInvalidArgument, the message starting with `op`.
void validate_requested_nvl_ranks(int num_ranks, int requested, const char* op);

// Pure (tested on CPU machines): G from the hosts of the ranks in rank order when nothing asks for one: the ranks of
// a host must be consecutive and every host must hold the same number. requested > 0 wins (it must divide R).
// Throws kInvalidArgument saying what is wrong.
DomainChoice choose_domains(const std::vector<std::string>& hosts, int requested, bool force);

// Collective: all-gathers every rank's host name and what it asked for (options.num_nvl_ranks, else
// $EPX_NUM_NVL_RANKS; options.force_internode or $EPX_FORCE_INTERNODE=1), checks that every rank asked the same.
DomainChoice choose_domains(Bootstrap& bs, const BufferOptions& options);

}  // namespace epx
