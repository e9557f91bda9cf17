// The namespace of this build's kernel entry points (layout/ll_params.hpp: dispatch_kernel, combine_kernel). Both
// kernel files are compiled twice, once per build; the runtime launches them (runtime/low_latency_launch.cpp).
#pragma once

#if EPX_NVSHMEM_DEVICE
#define EPX_LL_BUILD ll_nvshmem
#else
#define EPX_LL_BUILD ll_peer_pointers
#endif
