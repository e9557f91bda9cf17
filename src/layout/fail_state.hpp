// What a kernel needs to fail well (see device/wait.cuh). Filled by the host, passed in kernel parameters.
#pragma once

#include <cstdint>

#include "layout/host_shared.hpp"
#include "layout/nvl_layout.hpp"

namespace epx {

struct FailEnv {
  HostShared* host;                 // this rank's host-mapped block (device view)
  NvlControl* self;                 // this rank's control region
  NvlControl* peers[kMaxNvlRanks];  // every rank's control region as mapped here (peers[rank] == self)
  int rank;
  int num_peers;
  uint64_t budget_ns;
};

}  // namespace epx
