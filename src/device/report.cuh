// Input errors found by a kernel (non-fatal): the first one since the last report is kept with its details in
// the host-mapped block; the next notify shares it with every rank, Buffer::check() reports it.
#pragma once

#include <cstdint>

#include "runtime/fail_env.hpp"

namespace epx::dev {

__device__ __forceinline__ void report_input_error(NvlControl* self, HostShared* host, int code, int role, int64_t a,
                                                   int64_t b, int64_t c) {
  if (atomicCAS(&self->local_error, 0, code) != 0) return;
  volatile DeviceDiag* d = &host->input;
  d->rank = -1;
  d->role = role;
  d->a = a;
  d->b = b;
  d->c = c;
  __threadfence_system();
  d->code = code;
}

}  // namespace epx::dev
