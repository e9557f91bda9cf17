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
  NvlControl* self;                    // this rank's control block: the first-failure claim, input errors
  int32_t* abort_word;                 // the word every wait of this rank polls (a failing rank raises it)
  int32_t* abort_words[kMaxNvlRanks];  // the domain's ranks' abort words as mapped here (peer pointers)
  int num_ranks;                       // entries of abort_words
  // Internode buffers: every rank's abort word is at this symmetric address (NetControl::abort) and a failing
  // kernel raises it in all num_pes ranks through NVSHMEM (kernels compiled with EPX_NVSHMEM_DEVICE); null else.
  int32_t* net_abort;
  int num_pes;
  int rank;            // this rank, as diagnostics name it
  uint64_t budget_ns;  // every wait's budget
};

// Rank masking of the low-latency mode (enable_shrink; semantics.md section 9, kernels/low_latency/shrink.cuh). With
// words null (a buffer without enable_shrink) every rank takes part and every wait fails with FailState's budget.
struct RankMask {
  int32_t* words;      // [num_ranks] this rank's mask (NvlControl::ll_mask): nonzero = left out; null: shrink off
  uint64_t budget_ns;  // a wait for one rank that lasts this long masks that rank instead of failing
};

}  // namespace epx
