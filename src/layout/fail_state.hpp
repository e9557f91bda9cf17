// What a kernel needs to fail well (device/wait.cuh): the wait budget, where its diagnostics go and whom to tell.
// Only failure state: how a kernel reaches data in other ranks is the peer map's business (layout/peer_map.hpp).
// Filled by the host when a Buffer is created, passed in kernel parameters.
#pragma once

#include <cstdint>

#include "layout/host_shared.hpp"
#include "layout/nvl_layout.hpp"

namespace epx {

struct FailState {
  HostShared* host;                    // this rank's host-mapped block (device view): diagnostics for the CPU
  NvlControl* self;                    // this rank's control block: its abort word, the first-failure claim
  int32_t* abort_words[kMaxNvlRanks];  // every rank's abort word as mapped here (abort_words[rank] is its own)
  int num_ranks;                       // entries of abort_words
  int rank;                            // this rank, as diagnostics name it
  uint64_t budget_ns;                  // every wait's budget
};

}  // namespace epx
