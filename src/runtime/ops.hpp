// The operations of each mode, behind the public Buffer methods (runtime/buffer_ops.cpp, which checks the buffer
// is usable and picks the mode). One file per mode: runtime/intranode_ops.cpp, runtime/internode_ops.cpp,
// runtime/low_latency_ops.cpp.
#pragma once

#include "runtime/buffer_impl.hpp"

namespace epx {

// Mode-neutral (runtime/intranode_ops.cpp).
void get_dispatch_layout(Buffer::Impl& b, const LayoutArgs& a, const LayoutOutputs& o, cudaStream_t stream,
                         const char* op);
// The collective barrier kernel (the notify kernel without the count exchange): every rank's earlier operations on
// its stream are done, and every rank agrees on the operation's signature.
void launch_barrier(Buffer::Impl& b, int signature, cudaStream_t stream, const char* op);

namespace intranode {
DispatchCounts notify_dispatch(Buffer::Impl& b, const DispatchArgs& a, const Config& c, DispatchHandle& h,
                               cudaStream_t stream, const char* op);
void dispatch(Buffer::Impl& b, const DispatchArgs& a, const Config& c, const DispatchHandle& h,
              const DispatchOutputs& o, cudaStream_t stream, const char* op);
void dispatch_cached(Buffer::Impl& b, const DispatchArgs& a, const Config& c, const DispatchHandle& h,
                     const DispatchOutputs& o, cudaStream_t stream, const char* op);
void combine(Buffer::Impl& b, const CombineArgs& a, const Config& c, const DispatchHandle& h, const CombineOutputs& o,
             cudaStream_t stream, const char* op);
}  // namespace intranode

namespace internode {
DispatchCounts notify_dispatch(Buffer::Impl& b, const DispatchArgs& a, const Config& c, DispatchHandle& h,
                               cudaStream_t stream, const char* op);
void dispatch(Buffer::Impl& b, const DispatchArgs& a, const Config& c, const DispatchHandle& h,
              const DispatchOutputs& o, cudaStream_t stream, const char* op);
void dispatch_cached(Buffer::Impl& b, const DispatchArgs& a, const Config& c, const DispatchHandle& h,
                     const DispatchOutputs& o, cudaStream_t stream, const char* op);
void combine(Buffer::Impl& b, const CombineArgs& a, const Config& c, const DispatchHandle& h, const CombineOutputs& o,
             cudaStream_t stream, const char* op);
}  // namespace internode

namespace low_latency {
void clean(Buffer::Impl& b, cudaStream_t stream, const char* op);
void dispatch(Buffer::Impl& b, const LowLatencyDispatchArgs& a, const LowLatencyDispatchOutputs& o, int phases,
              LowLatencyHandle& h, cudaStream_t stream, const char* op);
int combine(Buffer::Impl& b, const LowLatencyCombineArgs& a, const LowLatencyHandle& h, void* combined_x, int phases,
            int buffer_set, cudaStream_t stream, const char* op);
void* next_combine_buffer(Buffer::Impl& b, const LowLatencyHandle& h, const char* op);
// Rank masking (runtime/low_latency_mask.cpp).
void update_mask(Buffer::Impl& b, int rank, bool mask, cudaStream_t stream, const char* op);
void query_mask(Buffer::Impl& b, int32_t* out, cudaStream_t stream, const char* op);
void clean_mask(Buffer::Impl& b, cudaStream_t stream, const char* op);
}  // namespace low_latency

}  // namespace epx
