// The epoch barrier in front of every high-throughput operation inside one NVLink domain: the handshake that
// proves every rank finished its previous operation on the buffer, the check that every rank called the same
// operation with the same shape, and the exchange of input errors that makes every rank's data kernel skip after
// an error anywhere.
//
// Every rank writes a message header into every peer's buffer (its input error, if any, and the operation's
// signature), then publishes the operation's epoch in the peer's notify_flag. A rank's epoch for an operation is
// written only from a kernel of that operation, which starts after all of the rank's earlier kernels on the
// stream have finished; so once a rank has seen the epoch from every rank, every rank is done with its previous
// operation: rings are idle and message slots of parity epoch & 1 can be reused (no rank can be two operations
// ahead of another). Every rank computes the same verdict from the same headers.
//
// Two places run it. The notify kernel (notify.cu) runs it with the count exchange, as one block, in front of a
// dispatch with a layout, and alone (barrier only) in front of the low-latency buffer clean. Cached dispatch and
// combine run it inside their data kernel (run_epoch_barrier, start_operation below), so each is one launch: warp
// 0 of block 0 runs the handshake and then releases a start word for every other block of the grid, which
// acquires it before it touches any ring or peer memory. The data kernels already need every block of their grid
// resident at once (a rank's sender and receiver blocks wait on its peers' blocks, which wait on this rank's
// other blocks), so a flag between blocks of one grid adds no assumption.
#pragma once

#include <cstdint>

#include "device/ptx.cuh"
#include "device/report.cuh"
#include "device/transport.cuh"
#include "device/wait.cuh"
#include "layout/fail_state.hpp"
#include "layout/host_shared.hpp"
#include "layout/nvl_layout.hpp"
#include "layout/peer_map.hpp"

namespace epx {

// What this rank brings to the handshake of its next operation.
struct EpochEntry {
  uint32_t epoch;  // the operation's epoch (this rank's operations so far, this one included)
  int error;       // the input error it reports (0: none): the sticky collective one, else its own
  int error_rank;  // the rank that found it
};

// One thread, first thing in an operation: advances this rank's epoch and takes its error to report. Sticky: a
// collective error stays until every rank's host has reported it (the runtime clears op_error then); an error of
// this rank's own kernels (local_error, the layout kernel's) is reported once.
__device__ __forceinline__ EpochEntry enter_epoch(NvlControl* self, int me) {
  EpochEntry e;
  e.epoch = self->epoch + 1;
  self->epoch = e.epoch;
  e.error = self->op_error ? self->op_error : self->local_error;
  e.error_rank = self->op_error ? self->op_error_rank : me;
  self->local_error = 0;
  return e;
}

// Field `field` (< NotifyMsg::kHeader) of the header this rank sends.
__device__ __forceinline__ int header_field(int field, const EpochEntry& e, int num_tokens, int signature,
                                            int row_bound) {
  if (field == NotifyMsg::kErrorCode) return e.error;
  if (field == NotifyMsg::kErrorRank) return e.error ? e.error_rank : -1;
  if (field == NotifyMsg::kNumTokens) return num_tokens;
  if (field == NotifyMsg::kRowBound) return row_bound;
  return signature;  // NotifyMsg::kSignature
}

// One whole warp, once every rank's epoch flag has been acquired (so their headers of this epoch are visible to the
// warp): the collective verdict, the same in every lane. The first error any rank reported (in rank order), else a
// signature that differs from this rank's (named with its rank; lane 0 sends the diagnostic to this rank's host),
// else 0. Lane s loads rank s's header, all three words at once: one memory latency, not one per word and rank.
struct Verdict {
  int code;
  int rank;
};
__device__ __forceinline__ Verdict collective_verdict(const NvlControl* self, int parity, int num_ranks, int signature,
                                                      const FailState& fail, int me) {
  const int lane = threadIdx.x % 32;
  int code = 0, rank = -1, theirs = signature;
  if (lane < num_ranks) {
    const int32_t* header = self->notify_msg[parity][lane];
    code = dev::ld_cg(&header[NotifyMsg::kErrorCode]);
    rank = dev::ld_cg(&header[NotifyMsg::kErrorRank]);
    theirs = dev::ld_cg(&header[NotifyMsg::kSignature]);
  }
  const uint32_t errors = __ballot_sync(dev::kFullMask, code != 0);
  if (errors != 0) {
    const int s = __ffs(errors) - 1;
    return Verdict{__shfl_sync(dev::kFullMask, code, s), __shfl_sync(dev::kFullMask, rank, s)};
  }
  const uint32_t differ = __ballot_sync(dev::kFullMask, theirs != signature);
  if (differ == 0) return Verdict{0, -1};
  const int s = __ffs(differ) - 1;
  const int s_signature = __shfl_sync(dev::kFullMask, theirs, s);
  if (lane == 0) dev::write_diag(&fail.host->input, kErrShapeMismatch, me, kRoleNotify, s, s_signature, signature);
  return Verdict{kErrShapeMismatch, s};
}

// The start word's values for the data blocks of a grid whose last block runs the notify (kStartGo: write the rows;
// kStartSkip: the operation has a collective error, every block of every rank returns). The epoch barrier releases
// kStartGo alone; its verdict is op_error.
constexpr uint32_t kStartGo = 1;
constexpr uint32_t kStartSkip = 2;

// The epoch barrier of a data kernel (cached dispatch, combine), run by warp 0 of block 0: the handshake, the
// verdict in this rank's op_error (and, for the host, in HostShared), then block b's start word released for every
// other block b of the grid (start_operation). Not inlined: the data roles' registers stay as they were.
static __device__ __noinline__ void run_epoch_barrier(const FailState& fail, const PeerMap& peers, int num_ranks,
                                                      int signature) {
  const int lane = threadIdx.x % 32, R = num_ranks, me = peers.rank;
  NvlControl* self = nvl_self(peers);
  EpochEntry e{};
  if (lane == 0) {
    dev::check_abort(fail, dev::WaitSite{kRoleNotify, -1, -1, 0});  // a peer failed earlier: fail now
    e = enter_epoch(self, me);
  }
  e.epoch = __shfl_sync(dev::kFullMask, e.epoch, 0);
  e.error = __shfl_sync(dev::kFullMask, e.error, 0);
  e.error_rank = __shfl_sync(dev::kFullMask, e.error_rank, 0);
  const int parity = e.epoch & 1;

  // Headers to every rank (this one included), then the epoch flags.
  for (int i = lane; i < R * NotifyMsg::kHeader; i += 32) {
    const int j = i / NotifyMsg::kHeader, field = i % NotifyMsg::kHeader;
    dev::write_word(&nvl_control(peers, j)->notify_msg[parity][me][field], header_field(field, e, 0, signature, 0));
  }
  // Every lane's header stores precede the flag stores through __syncwarp; one release per peer carries them.
  __syncwarp();
  if (lane < R) dev::publish(&nvl_control(peers, lane)->notify_flag[me], e.epoch);  // pairs with wait_equal below
  // Acquire: peer `lane`'s headers to this rank (and everything it did before, its previous operation's kernels
  // included) are visible to this lane, and after the __syncwarp below to every lane.
  if (lane < R)
    dev::wait_equal(&self->notify_flag[lane], e.epoch, fail, dev::WaitSite{kRoleNotify, -1, lane, int64_t(e.epoch)});
  __syncwarp();

  const Verdict v = collective_verdict(self, parity, R, signature, fail, me);
  if (lane == 0) {
    self->op_error = v.code;
    self->op_error_rank = v.rank;
  }
  // Lane 0's op_error and every lane's flag acquires come before each lane's release of the start words
  // (release is cumulative over what the warp observed before __syncwarp).
  __syncwarp();
  for (int b = 1 + lane; b < gridDim.x; b += 32)
    dev::publish(&self->block_start[b], kStartGo);  // pairs with wait_for_start
  // For the host, after the releases (which need not wait for these stores over PCIe). The host reads them once
  // the stream has synchronized (Buffer::check), so no system fence: the notify kernel, which the host polls while
  // it runs, has one.
  if (lane == 0) {
    fail.host->op_error = v.code;
    fail.host->op_error_rank = v.rank;
  }
}

// Thread 0 of block b > 0 of a data kernel that runs the epoch barrier (or of any data block of a grid whose last
// block runs the notify, notify_body.cuh): waits for the release of its start word, then resets it (the next kernel
// sets it again only after this grid has finished, so a set word always belongs to the running grid) and returns what
// it held. The budget is twice the waits': when a rank does not call, the barrier's wait for it reports first and
// names it, and this wait then stops on the abort word. Not inlined, as above.
static __device__ __noinline__ uint32_t wait_for_start(const FailState& fail, NvlControl* self) {
  uint32_t* word = &self->block_start[blockIdx.x];
  const dev::WaitSite site{kRoleDataStart, int(blockIdx.x / 2), -1, blockIdx.x};
  dev::SpinBudget budget;
  uint32_t seen;
  while ((seen = dev::acquire(word)) == 0)  // pairs with run_epoch_barrier's release of the start word
    budget.tick(fail, site, seen, 1, 2);
  dev::write_word(word, 0u);
  return seen;
}

// The first thing every block of a high-throughput data kernel does. With `barrier` (cached dispatch, combine) the
// epoch barrier runs first, in warp 0 of block 0 (run_epoch_barrier); block 0's other warps wait for it at the block
// barrier, every other block for its start word (thread 0, bounded), then at its block barrier; so no block reads a
// ring index or writes a peer before every rank has finished its previous operation. Without (a dispatch with a
// layout) the notify kernel in front of the data kernel ran it. Returns false when the operation has a collective
// error: then every block of every rank returns without touching a ring.
__device__ __forceinline__ bool start_operation(const FailState& fail, const PeerMap& peers, int num_ranks,
                                                bool barrier, int signature) {
  NvlControl* self = nvl_self(peers);
  if (barrier) {
    if (blockIdx.x == 0) {
      if (threadIdx.x < 32) run_epoch_barrier(fail, peers, num_ranks, signature);
    } else if (threadIdx.x == 0) {
      wait_for_start(fail, self);
    }
    __syncthreads();  // block 0: lane 0's op_error store; other blocks: thread 0's acquire of the start word
  }
  return dev::ld_relaxed_sys(&self->op_error) == 0;  // collective: every rank's blocks agree
}

}  // namespace epx
