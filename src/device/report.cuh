// Input errors found by a kernel (non-fatal): the first one since the last report is kept with its details in
// the host-mapped block; the next notify shares it with every rank, Buffer::check() reports it.
#pragma once

#include <cstdint>

#include "layout/host_shared.hpp"
#include "layout/nvl_layout.hpp"

namespace epx::dev {

// Fills a host-mapped diagnostic record; the code is written last, after a system fence, because the host
// reads the record once code != 0. The caller has claimed the record (one writer).
__device__ __forceinline__ void write_diag(volatile DeviceDiag* d, int code, int rank, int role, int64_t a, int64_t b,
                                           int64_t c) {
  d->rank = rank;
  d->role = role;
  d->a = a;
  d->b = b;
  d->c = c;
  __threadfence_system();
  d->code = code;
}

// The end of a count exchange, one thread: the operation's verdict (code, rank) in this rank's control words, which
// its data kernels read, and in the host's words with the rows this rank receives. No ordering of its own: the
// caller's release of the host's sequence number carries these stores to the host.
__device__ __forceinline__ void write_verdict(NvlControl* self, HostShared* host, int code, int rank, int num_recv) {
  self->op_error = code;
  self->op_error_rank = rank;
  host->op_error = code;
  host->op_error_rank = rank;
  host->num_recv_tokens = num_recv;
}

__device__ __forceinline__ void report_input_error(NvlControl* self, HostShared* host, int code, int role, int64_t a,
                                                   int64_t b, int64_t c) {
  if (atomicCAS(&self->local_error, 0, code) != 0) return;
  write_diag(&host->input, code, -1, role, a, b, c);
}

}  // namespace epx::dev
