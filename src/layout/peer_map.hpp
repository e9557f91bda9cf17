// How this rank reaches other ranks' memory. Built once when a Buffer is created (runtime/peer_map.cpp), passed to
// every kernel in its parameters, and used only through the calls of device/transport.cuh.
//
// A region has the same layout on every rank. For each rank the map holds that rank's copy of the region as mapped
// here (a peer pointer: CUDA IPC, or the one nvshmem_ptr gives inside a node), or nullptr when that rank is reached
// through NVSHMEM operations on this rank's own symmetric address of the same offset (PE = the rank).
#pragma once

#include <cstdint>

#include "layout/limits.hpp"
#include "layout/nvl_layout.hpp"

namespace epx {

struct RegionMap {
  uint8_t* local;               // this rank's copy (with NVSHMEM: its symmetric address)
  uint8_t* peer[kMaxNvlRanks];  // rank r's copy as mapped here (peer[rank] == local), or nullptr: NVSHMEM, PE r
  int num_nvshmem;              // ranks with peer[r] == nullptr
};

// The network hop of the internode mode: this rank's peers are the ranks of the same local index in every domain,
// always reached through NVSHMEM's generic device API (PE = global rank), so that what runs on one host over
// NVLink is what runs on a cluster. Only the internode kernels use it.
struct NetworkMap {
  uint8_t* local;   // this rank's network region (symmetric: the same address names every peer's copy)
  int domain;       // this rank's domain d
  int num_domains;  // D
  int local_rank;   // g, this rank's index in its domain
  int num_local;    // G
  EPX_HD int pe(int domain_m) const { return domain_m * num_local + local_rank; }
};

struct PeerMap {
  int rank;        // this rank's index in the regions (its rank inside the NVLink domain)
  int num_ranks;   // ranks the regions hold
  RegionMap nvl;   // the NVLink buffer (NvlControl, then the ring data): CUDA IPC, a pointer for every rank
  RegionMap ll;    // the low-latency region: in the NVLink buffer (CUDA IPC) or in NVSHMEM symmetric memory
  NetworkMap net;  // the internode network region (null local in single-domain buffers)
};

// Rank r's NVLink buffer as mapped here, seen as the control block it starts with.
EPX_HD NvlControl* nvl_control(const PeerMap& m, int r) { return reinterpret_cast<NvlControl*>(m.nvl.peer[r]); }
// This rank's own NVLink buffer, the same way.
EPX_HD NvlControl* nvl_self(const PeerMap& m) { return reinterpret_cast<NvlControl*>(m.nvl.local); }

}  // namespace epx
