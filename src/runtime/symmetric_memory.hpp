// NVSHMEM symmetric memory for the low-latency region (builds with EPX_HAVE_NVSHMEM only).
//
// NVSHMEM is initialised once per process, through the Buffer's bootstrap (unique-id init: rank 0 creates the
// id, the all-gather carries it), when the first buffer that needs it is created, and finalised when the last
// such buffer is destroyed. Every function here is collective over the bootstrap's ranks.
#pragma once

#include <cstdint>

namespace epx {

class Bootstrap;

// Initialises NVSHMEM if no live region holds it (PE = bootstrap rank), then allocates `bytes` of symmetric
// memory. Throws an epx::Error that says what failed, on every rank.
void* symmetric_alloc(Bootstrap& bs, int64_t bytes);

// Frees a region of symmetric_alloc and finalises NVSHMEM after the last one. With usable == false (some rank's
// CUDA context is lost) nothing is freed or finalised: NVSHMEM's collectives would wait for that rank forever;
// the process has to restart anyway.
void symmetric_free(void* region, bool usable);

// Rank r's copy of region as a pointer usable here (the same node, P2P-reachable), or nullptr when only NVSHMEM
// operations reach it.
void* symmetric_peer_pointer(void* region, int rank);

}  // namespace epx
