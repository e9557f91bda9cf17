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
// The notify kernel (notify.cu) runs it, as one block: with the count exchange in front of a dispatch with a layout,
// and alone (barrier only) in front of cached dispatch, combine and the low-latency buffer clean.
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
__device__ __forceinline__ int header_field(int field, const EpochEntry& e, int num_tokens, int signature) {
  if (field == NotifyMsg::kErrorCode) return e.error;
  if (field == NotifyMsg::kErrorRank) return e.error ? e.error_rank : -1;
  if (field == NotifyMsg::kNumTokens) return num_tokens;
  return signature;  // NotifyMsg::kSignature
}

// One thread, once every rank's epoch flag has been acquired (so their headers of this epoch are visible): the
// collective verdict. The first error any rank reported (in rank order), else a signature that differs from this
// rank's (named with its rank; the diagnostic goes to this rank's host), else 0.
struct Verdict {
  int code;
  int rank;
};
__device__ __forceinline__ Verdict collective_verdict(const NvlControl* self, int parity, int num_ranks, int signature,
                                                      const FailState& fail, int me) {
  auto header = [&](int s, int field) { return dev::ld_cg(&self->notify_msg[parity][s][field]); };
  Verdict v{0, -1};
  for (int s = 0; s < num_ranks && v.code == 0; ++s) {
    v.code = header(s, NotifyMsg::kErrorCode);
    v.rank = header(s, NotifyMsg::kErrorRank);
  }
  for (int s = 0; s < num_ranks && v.code == 0; ++s) {
    const int theirs = header(s, NotifyMsg::kSignature);
    if (theirs == signature) continue;
    v.code = kErrShapeMismatch;
    v.rank = s;
    dev::write_diag(&fail.host->input, kErrShapeMismatch, me, kRoleNotify, s, theirs, signature);
  }
  return v;
}

}  // namespace epx
