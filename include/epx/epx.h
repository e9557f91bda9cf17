/*
 * epx: expert-parallel communication for Mixture-of-Experts models.
 *
 * Plain C ABI. Every function returns an epx_status; on failure epx_last_error() returns a message that says
 * what was wrong (thread-local, valid until the next epx call on the same thread). Handles are opaque.
 * Device pointers are raw CUDA device pointers; streams are cudaStream_t passed as void*.
 *
 * The argument structs below are shared with the C++ API (include/epx/epx.hpp): zero-initialise them
 * (`epx_dispatch_args a = {0};` in C, `{}` in C++) and set the fields you use.
 */
#ifndef EPX_EPX_H_
#define EPX_EPX_H_

#include <stddef.h>
#include <stdint.h>

#ifdef __cplusplus
extern "C" {
#endif

#define EPX_VERSION_MAJOR 0
#define EPX_VERSION_MINOR 7

typedef enum epx_status {
  EPX_OK = 0,
  EPX_ERR_INVALID_ARGUMENT = 1, /* bad shape, pointer, alignment, range, config */
  EPX_ERR_BUFFER_TOO_SMALL = 2, /* the message says how many bytes are needed */
  EPX_ERR_CUDA = 3,             /* a CUDA call failed */
  EPX_ERR_TIMEOUT = 4,          /* a wait exceeded its budget; the message names rank, role, channel, positions */
  EPX_ERR_BOOTSTRAP = 5,        /* the all-gather callback failed */
  EPX_ERR_NOT_SUPPORTED = 6,    /* a mode this build or machine does not offer */
  EPX_ERR_FAILED_STATE = 7,     /* an earlier failure left the buffer unusable: destroy it */
  EPX_ERR_INTERNAL = 8,
  EPX_ERR_REMOTE = 9 /* another rank reported an error for this collective call */
} epx_status;

/* Regions of a buffer's memory on this rank (epx_buffer_region). */
#define EPX_REGION_NVL 0  /* the high-throughput ring area: num_nvl_bytes */
#define EPX_REGION_RDMA 1 /* num_rdma_bytes: the low-latency area, or the internode network rings */

/* Reduction orders of combine (epx_combine_args.reduction; semantics.md sections 3, 6, 8). */
#define EPX_REDUCE_DEFAULT 0   /* flat inside one NVLink domain, two-level in an internode buffer */
#define EPX_REDUCE_FLAT 1      /* every rank's row summed at the source in ascending global rank order */
#define EPX_REDUCE_TWO_LEVEL 2 /* internode: per-domain partials rounded to bf16, then summed by domain */
#define EPX_REDUCE_RANK                                                                    \
  3 /* low-latency combine: each expert rank sums its experts' rows first, rounds to bf16, \
       sends one row per (token, rank); the source sums those in ascending rank order.     \
       Needs a dispatch with topk_weights (epx_ll_dispatch_args) */

/* Data types of token rows. */
typedef enum epx_dtype { EPX_BF16 = 0, EPX_FP8_E4M3 = 1 } epx_dtype;

/* "All-gather these bytes": every rank passes `bytes` bytes; recv receives size*bytes, rank-major.
 * Return 0 on success. Called collectively by Buffer creation and destruction. */
typedef int (*epx_allgather_fn)(void* ctx, const void* send, void* recv, size_t bytes);

typedef struct epx_bootstrap {
  int rank;
  int size;
  epx_allgather_fn allgather;
  void* ctx;
} epx_bootstrap;

typedef struct epx_buffer_options {
  int64_t num_nvl_bytes;   /* high-throughput ring buffers (see epx_config_nvl_size_hint) */
  int64_t num_rdma_bytes;  /* low-latency buffers (epx_ll_size_hint), or the internode network rings
                              (epx_config_internode_size_hints) */
  int low_latency_mode;    /* nonzero: the buffer serves low-latency dispatch/combine */
  int num_nvl_ranks;       /* NVLink domain size G; 0: $EPX_NUM_NVL_RANKS if set, else the ranks that share a host */
  double timeout_s;        /* wait budget of every device and host wait; <= 0 means the default, 100 s */
  int device;              /* CUDA device; -1 means the current device */
  int force_internode;     /* nonzero (or $EPX_FORCE_INTERNODE=1): the internode kernels also when every rank is in
                              one domain (tests the NVLink forwarding on one host); needs NVSHMEM */
  int enable_shrink;       /* nonzero: rank masking in the low-latency mode (semantics.md section 9; needs a low-latency
                              region): a wait for one rank that outlasts shrink_timeout_s masks that rank and the call
                              completes without it. The same on every rank */
  double shrink_timeout_s; /* with enable_shrink: that budget in seconds, in (0, 1e7); <= 0 means
                              $EPX_LL_SHRINK_TIMEOUT_S if set, else 1 s. Shorter than timeout_s to take effect */
  int64_t num_recv_bytes;  /* output region of epx_dispatch_in_buffer (epx_recv_region_size_hint); 0: none. The
                              same on every rank */
} epx_buffer_options;

/* Limits of this library (its constants, for bindings and tools that must not repeat them). */
typedef struct epx_limits {
  int max_nvl_ranks;     /* ranks of one NVLink domain */
  int max_ranks;         /* ranks of a Buffer */
  int max_channels;      /* channels of the high-throughput kernels (epx_config_num_channels) */
  int max_topk;          /* top-k slots per token */
  int max_hidden;        /* hidden size */
  int max_local_experts; /* experts per rank (high-throughput mode) */
  int max_experts;       /* experts in total (layout) */
  int fp8_group_size;    /* elements per FP8 scale */
  int ll_max_ranks;      /* low-latency mode: ranks */
  int ll_max_tokens;     /* low-latency mode: num_max_dispatch_tokens_per_rank */
  int ll_max_experts;    /* low-latency mode: experts */
  int ll_max_topk;       /* low-latency mode: top-k slots */
} epx_limits;

/* Tuning of the high-throughput kernels. num_sms blocks, num_sms / 2 channels (epx_config_num_channels). */
typedef struct epx_config {
  int num_sms;             /* even, >= 2 */
  int num_max_send_tokens; /* tokens a sender publishes per tail update (chunk); unused by the senders at 2 ranks or
                              fewer, which publish progress continuously (still validated). The dispatch's senders
                              publish sooner where a chunk's records pass 180 KiB, never below two tokens per warp of a
                              peer group (docs/tuning.md) */
  int num_max_recv_tokens; /* ring capacity per (channel, source rank), in tokens; >= num_max_send_tokens. Internode:
                              the NVLink ring per (channel, forwarder), split into one sub-ring per source domain */
  int num_max_rdma_send_tokens; /* internode: records per network chunk (one put and one signal) */
  int num_max_rdma_recv_tokens; /* internode: network ring capacity per (channel, domain), >= 2 chunks */
} epx_config;

typedef struct epx_layout_args {
  const int64_t* topk_idx; /* [num_tokens, num_topk], -1 = no expert */
  int num_tokens;
  int num_topk;
  int num_experts;
} epx_layout_args;

typedef struct epx_layout_outputs {
  int* num_tokens_per_rank;      /* [R] */
  int* num_tokens_per_rdma_rank; /* [R / G] or NULL (only when ranks span several NVLink domains) */
  int* num_tokens_per_expert;    /* [E] */
  uint8_t* is_token_in_rank;     /* [num_tokens, R] bool */
} epx_layout_outputs;

typedef struct epx_dispatch_args {
  const void* x; /* [num_tokens, hidden] of dtype */
  epx_dtype dtype;
  int num_tokens;
  int hidden;
  const float* x_scales; /* FP8 only: [num_tokens, num_scales] 32-bit words (float32 or packed int32), copied
                            verbatim; 4-byte aligned. The kernels read them in place at the strides below */
  int num_scales;
  /* Element (not byte) strides of x_scales: scale g of token t is x_scales[t * x_scales_stride_token + g *
   * x_scales_stride_group]. Both 0 (a zeroed struct): contiguous row-major, i.e. num_scales and 1. Otherwise
   * both >= 0, the token stride >= 1 when num_tokens > 1 and the group stride >= 1 when num_scales > 1; column-major
   * scales (what grouped GEMMs read) are 1 and num_tokens. Strides may differ between ranks. recv_x_scales is always
   * row-major, [rows, num_scales] contiguous. */
  int64_t x_scales_stride_token;
  int64_t x_scales_stride_group;
  const int64_t* topk_idx;          /* [num_tokens, num_topk] when num_topk > 0 */
  const float* topk_weights;        /* optional [num_tokens, num_topk] (zeros are sent without it) */
  int num_topk;                     /* 0: no top-k. Must be the same on every rank (it shapes the ring records);
                                       a rank without tokens may pass null pointers */
  int num_experts;                  /* needed with topk_idx or num_tokens_per_expert */
  const int* num_tokens_per_rank;   /* [R] from get_dispatch_layout (not needed for cached dispatch) */
  const int* num_tokens_per_expert; /* optional [E] */
  const uint8_t* is_token_in_rank;  /* [num_tokens, R] */
  int expert_alignment;             /* >= 1 (0 is taken as 1) */
  int num_worst_tokens;             /* > 0: outputs sized to this many rows, no host wait */
} epx_dispatch_args;

/* What combine and cached dispatch need. Device arrays are allocated by the caller with the shapes below
 * (C = config.num_sms / 2) and filled by the library. */
typedef struct epx_dispatch_handle {
  int num_ranks;
  int num_channels;
  int num_tokens;
  int num_recv_tokens;             /* rows of recv_x that hold tokens (-1 until known in worst-case mode) */
  int* rank_prefix_matrix;         /* [R, R]: [i][j] = tokens ranks 0..i send to rank j */
  int* channel_prefix_matrix;      /* [R, C]: [j][c] = tokens this rank sends to j in channels 0..c */
  int* recv_channel_prefix_matrix; /* [R, C]: first recv row of the tokens from (source rank, channel) */
  int* recv_src_idx;               /* [N]: source token index of each received row */
  const uint8_t* is_token_in_rank; /* [num_tokens, R] */
  int* send_head;                  /* [num_tokens, R]: stream position of token t towards rank j */
  /* Internode buffers (docs/internode.md; deep_ep's handle elements in brackets). There channel_prefix_matrix is
   * [2] gbl_channel_prefix_matrix and recv_channel_prefix_matrix is [5] recv_gbl_channel_prefix_matrix;
   * rank_prefix_matrix, recv_src_idx and send_head are unused. */
  int num_domains;                      /* D */
  int num_nvl_ranks;                    /* G */
  int num_rdma_recv_tokens;             /* records this rank's network rings receive (-1 until known) */
  int* rdma_channel_prefix_matrix;      /* [D, C] [1] */
  int* recv_rdma_channel_prefix_matrix; /* [D, C] [3] */
  int* recv_rdma_rank_prefix_sum;       /* [D] [4] */
  int* recv_gbl_rank_prefix_sum;        /* [R] [6] */
  int32_t* recv_src_meta;               /* [rows, 2] [7]: source domain, mask of this domain's ranks */
  int* send_rdma_head;                  /* [num_tokens, D] [8] */
  int* send_nvl_head;                   /* [num_rdma_recv_tokens (or num_worst_tokens), G] [9] */
} epx_dispatch_handle;

typedef struct epx_dispatch_outputs {
  void* recv_x;             /* [rows, hidden] of dtype */
  float* recv_x_scales;     /* [rows, num_scales] when FP8 */
  int64_t* recv_topk_idx;   /* optional [rows, num_topk] (num_topk > 0) */
  float* recv_topk_weights; /* optional [rows, num_topk] (num_topk > 0) */
  int num_rows;             /* rows allocated: num_recv_tokens, or num_worst_tokens */
} epx_dispatch_outputs;

/* The outputs of epx_dispatch_in_buffer: views of this rank's output region (epx_buffer_options.num_recv_bytes),
 * the shapes of epx_dispatch_outputs with rows = num_recv_tokens, or num_worst_tokens in worst-case mode. Valid until
 * the next dispatch of any kind on the buffer; a combine leaves them as they are. */
typedef struct epx_recv_region {
  void* recv_x;             /* [rows, hidden] of dtype */
  float* recv_x_scales;     /* [rows, num_scales] when FP8, else NULL */
  int64_t* recv_topk_idx;   /* [rows, num_topk] when num_topk > 0, else NULL */
  float* recv_topk_weights; /* [rows, num_topk] when num_topk > 0 (zeros without topk_weights), else NULL */
  int* recv_src_idx;        /* [rows] */
  int capacity;             /* rows the region holds for this shape */
} epx_recv_region;

typedef struct epx_dispatch_counts {
  int num_recv_tokens;      /* -1 in worst-case mode */
  int num_rdma_recv_tokens; /* internode: records this rank's network rings receive; -1 otherwise */
  int num_local_experts;
  const int* num_recv_tokens_per_expert; /* [num_local_experts], aligned; valid until the next call */
} epx_dispatch_counts;

typedef struct epx_combine_args {
  const void* x; /* bf16 [num_rows, hidden], rows aligned with the dispatch's recv_x */
  int num_rows;
  int hidden;
  const float* topk_weights; /* [num_rows, num_topk] when num_topk > 0 */
  int num_topk;              /* 0: no weights; the same on every rank */
  const void* bias0;         /* optional bf16 [num_tokens, hidden] */
  const void* bias1;         /* optional bf16 [num_tokens, hidden] */
  int reduction;             /* EPX_REDUCE_*: 0 is the default order of the buffer's mode */
} epx_combine_args;

typedef struct epx_combine_outputs {
  void* combined_x;             /* bf16 [num_tokens, hidden] */
  float* combined_topk_weights; /* [num_tokens, num_topk] when num_topk > 0 */
} epx_combine_outputs;

/* ---- low-latency mode (semantics.md sections 4 and 5) ---- */
#define EPX_LL_SEND 1 /* phases: send only (the receive is a second call: the "hook") */
#define EPX_LL_RECV 2 /* receive only */
#define EPX_LL_BOTH 3

typedef struct epx_ll_dispatch_args {
  const void* x;  /* bf16 [num_tokens, hidden] */
  int num_tokens; /* <= num_max_dispatch_tokens_per_rank */
  int hidden;
  const int64_t* topk_idx; /* [num_tokens, num_topk], -1 = no expert */
  int num_topk;
  int num_experts;
  int num_max_dispatch_tokens_per_rank; /* M: the same on every rank */
  int use_fp8;
  int round_scale;                         /* scales rounded up to a power of two */
  int use_ue8m0;                           /* scales as packed 8-bit exponents (needs round_scale) */
  int* cumulative_local_expert_recv_stats; /* optional [num_local_experts], added to */
  const float* topk_weights; /* optional [num_tokens, num_topk]: travel with the tokens, for a combine with
                                EPX_REDUCE_RANK; needs outputs->recv_topk_slots (both or neither) */
} epx_ll_dispatch_args;

typedef struct epx_ll_dispatch_outputs {
  void* packed_recv_x;        /* [L, R*M, hidden] bf16, or e4m3 with use_fp8 */
  void* packed_recv_x_scales; /* fp8: float [L, hidden/128, R*M] (token-minor), or int32 [L, hidden/512, R*M] */
  int* packed_recv_count;     /* [L] */
  int* recv_src_info;         /* [L, R*M] */
  int64_t* recv_layout_range; /* [L, R]: (begin << 32) | count */
  int32_t* recv_topk_slots;   /* with args->topk_weights, else NULL: int32 [R, M, num_topk, 2]; for source rank s,
                                 its token t and slot k whose expert is on this rank: (packed row i * R*M + n, the
                                 weight's float bits), else (-1, 0); only the tokens of s that reached this rank
                                 are written */
} epx_ll_dispatch_outputs;

/* What the receive call and combine need from a low-latency dispatch. */
typedef struct epx_ll_handle {
  int buffer_set;
  int num_tokens;
  int hidden;
  int num_topk;
  int num_experts;
  int num_max_dispatch_tokens_per_rank;
  const int* recv_src_info;
  const int64_t* recv_layout_range;
  const int32_t* recv_topk_slots; /* the dispatch's recv_topk_slots (NULL: it had no topk_weights) */
} epx_ll_handle;

typedef struct epx_ll_combine_args {
  const void* x;             /* bf16 [L, R*M, hidden] expert outputs; ignored with zero_copy */
  int zero_copy;             /* x was written into epx_ll_next_combine_buffer() */
  const int64_t* topk_idx;   /* [num_tokens, num_topk] of the dispatch */
  const float* topk_weights; /* [num_tokens, num_topk] */
  int use_logfmt; /* nonzero: rows travel as LogFMT, ~10 bits a value, decoded before the sum (semantics.md section 9,
                     docs/logfmt.md); needs hidden % 128 == 0. The receive call repeats the send call's */
  int reduction;  /* EPX_REDUCE_DEFAULT / EPX_REDUCE_FLAT (the same: flat), or EPX_REDUCE_RANK (semantics.md section
                     5: needs a handle whose dispatch had topk_weights, which are the weights summed with; not with
                     use_logfmt). The receive call repeats the send call's */
} epx_ll_combine_args;

/* How a buffer's low-latency mode reaches the other ranks (docs/design.md, "Low-latency transports"). Chosen at
 * creation: without NVSHMEM in the build, or with EPX_DISABLE_NVSHMEM=1, the region is part of the CUDA IPC
 * buffer; otherwise it is NVSHMEM symmetric memory, written through peer pointers where nvshmem_ptr gives one and
 * through NVSHMEM puts elsewhere (everywhere but this rank with EPX_LL_FORCE_NVSHMEM=1). */
#define EPX_LL_TRANSPORT_NONE 0     /* the buffer has no low-latency region (num_rdma_bytes == 0) */
#define EPX_LL_TRANSPORT_CUDA_IPC 1 /* the region is in the CUDA IPC buffer */
#define EPX_LL_TRANSPORT_NVSHMEM 2  /* the region is NVSHMEM symmetric memory */

typedef struct epx_ll_transport_info {
  int transport;              /* EPX_LL_TRANSPORT_* */
  int num_peer_pointer_ranks; /* ranks (this one included) written with the kernels' own stores */
  int num_nvshmem_ranks;      /* ranks written through NVSHMEM puts and atomics */
} epx_ll_transport_info;

typedef struct epx_buffer epx_buffer;

const char* epx_last_error(void);
const char* epx_status_string(epx_status status);
int epx_version(void);            /* major * 100 + minor */
int epx_built_with_nvshmem(void); /* nonzero when this libepx has the NVSHMEM transport */

/* Creation and destruction are collective over the bootstrap's ranks. */
epx_status epx_buffer_create(const epx_bootstrap* bootstrap, const epx_buffer_options* options, epx_buffer** out);
epx_status epx_buffer_destroy(epx_buffer* buffer);
epx_status epx_buffer_info(const epx_buffer* buffer, int* rank, int* num_ranks, int* device, int* num_nvl_ranks);
/* Nonzero when the buffer runs the internode (hierarchical) kernels. */
epx_status epx_buffer_is_internode(const epx_buffer* buffer, int* internode);
epx_status epx_buffer_set_timeout(epx_buffer* buffer, double seconds);
epx_status epx_buffer_ll_transport(const epx_buffer* buffer, epx_ll_transport_info* info);
/* Waits for the stream, then reports any error a kernel of this buffer recorded (timeouts, bad input). */
epx_status epx_buffer_check(epx_buffer* buffer, void* stream);
/* Where one region of this rank's memory is: a device pointer and its size in bytes, exactly as large as
 * the buffer was created with (num_nvl_bytes for EPX_REGION_NVL, num_rdma_bytes for EPX_REGION_RDMA); a
 * region the buffer has no bytes for gives NULL and 0. For callers that place their own data in the buffer
 * (as deep_ep's get_local_buffer_tensor does): the memory stays valid until the buffer is destroyed, and
 * the buffer's operations of that mode overwrite it. */
epx_status epx_buffer_region(epx_buffer* buffer, int which, void** ptr, int64_t* bytes);

epx_status epx_get_limits(epx_limits* out);

epx_status epx_default_dispatch_config(int num_ranks, epx_config* out);
epx_status epx_default_combine_config(int num_ranks, epx_config* out);
/* Channels of the high-throughput kernels under a config (the per-channel handle arrays are [R, channels]). */
epx_status epx_config_num_channels(const epx_config* config, int* out);
/* Bytes of num_nvl_bytes that a config needs for rows of hidden_bytes (worst case of scales and top-k), inside one
 * NVLink domain of num_ranks ranks: channels x rings x num_max_recv_tokens records, a ring per source rank per
 * channel (at 2 ranks only the peer's, at 1 rank none: own rows never pass through a ring there). */
epx_status epx_config_nvl_size_hint(const epx_config* config, int64_t hidden_bytes, int num_ranks, int64_t* bytes);
/* The internode mode over num_ranks = D x num_nvl_ranks ranks: num_nvl_bytes (the NVLink sub-rings) and
 * num_rdma_bytes (the network rings) a config needs for rows of hidden_bytes. num_nvl_ranks 0: as many as one
 * domain holds (at most 8). */
epx_status epx_config_internode_size_hints(const epx_config* config, int64_t hidden_bytes, int num_ranks,
                                           int num_nvl_ranks, int64_t* nvl_bytes, int64_t* rdma_bytes);

epx_status epx_get_dispatch_layout(epx_buffer* buffer, const epx_layout_args* args, const epx_layout_outputs* outputs,
                                   void* stream);

/* Step 1 of dispatch: exchanges counts, fills the handle's prefix matrices and, unless num_worst_tokens > 0,
 * waits (bounded) for the counts and returns them. When a peer's epx_dispatch_sized guessed too few rows, every rank
 * repeats the exchange: this call does so by itself. */
epx_status epx_notify_dispatch(epx_buffer* buffer, const epx_dispatch_args* args, const epx_config* config,
                               epx_dispatch_handle* handle, epx_dispatch_counts* counts, void* stream);
/* Both steps at once into outputs the caller sized before the counts are known: outputs->num_rows rows (a guess) in
 * recv_x and the other outputs, handle->recv_src_idx included. The count exchange and the data kernel are queued back
 * to back (one grid, whose last block runs the count exchange, where the device has an SM beside config->num_sms), and
 * the host waits for the counts after both, so the rows start moving without a host round trip. If every rank's rows
 * fit, it fills handle and counts as epx_notify_dispatch does, and the outputs' first counts->num_recv_tokens rows are
 * the received ones (rows past them are left as they were). If any rank's did not, counts->num_recv_tokens is -1, no
 * rank moved data, and this rank repeats the dispatch with epx_notify_dispatch and epx_dispatch; every other rank's
 * call repeats its count exchange by itself. Ranks may mix this call and the two steps, but not worst-case mode with
 * the rest (the ranks' signatures tell them apart: only a waiting host can repeat). With num_worst_tokens > 0 it is
 * worst-case mode in one launch: outputs of at least num_worst_tokens rows, no host wait, counts as
 * epx_notify_dispatch gives them in that mode. One NVLink domain only; collective, like the other dispatches. */
epx_status epx_dispatch_sized(epx_buffer* buffer, const epx_dispatch_args* args, const epx_config* config,
                              epx_dispatch_handle* handle, const epx_dispatch_outputs* outputs,
                              epx_dispatch_counts* counts, void* stream);
/* Step 2: moves the data. handle.recv_src_idx must have handle.num_recv_tokens (or num_worst_tokens) rows. */
epx_status epx_dispatch(epx_buffer* buffer, const epx_dispatch_args* args, const epx_config* config,
                        const epx_dispatch_handle* handle, const epx_dispatch_outputs* outputs, void* stream);
/* Repeats a dispatch's routing for new data: no layout, no count exchange, no host wait. */
epx_status epx_dispatch_cached(epx_buffer* buffer, const epx_dispatch_args* args, const epx_config* config,
                               const epx_dispatch_handle* handle, const epx_dispatch_outputs* outputs, void* stream);
epx_status epx_combine(epx_buffer* buffer, const epx_combine_args* args, const epx_config* config,
                       const epx_dispatch_handle* handle, const epx_combine_outputs* outputs, void* stream);
/* A dispatch whose outputs are this rank's output region (epx_recv_region): every sender writes each row straight to
 * its place in the receiver's region, so no rank copies rows it received, and the host waits for the counts (unless
 * num_worst_tokens > 0) only after the data kernel is queued. One NVLink domain only; the buffer needs
 * num_recv_bytes. cached == 0: the layout arguments of epx_notify_dispatch, and it fills handle and counts as
 * epx_notify_dispatch does (handle->recv_src_idx = region->recv_src_idx). cached != 0: the routing of `handle`, as
 * epx_dispatch_cached (counts untouched, may be NULL). Collective, like the other dispatches. */
epx_status epx_dispatch_in_buffer(epx_buffer* buffer, const epx_dispatch_args* args, const epx_config* config,
                                  epx_dispatch_handle* handle, int cached, epx_dispatch_counts* counts,
                                  epx_recv_region* region, void* stream);
/* Where a combine from the buffer reads this rank's expert outputs: region->recv_x is bf16 [capacity, hidden] and
 * region->recv_topk_weights float [capacity, num_topk] (NULL for num_topk 0) of the output region; the other views
 * are NULL. They start where a BF16 dispatch into the buffer of this hidden size and num_topk put recv_x and
 * recv_topk_weights, so expert outputs written over recv_x in place are already there; after an FP8 dispatch they
 * overlap its outputs (write them once those are read). */
epx_status epx_combine_region(epx_buffer* buffer, int hidden, int num_topk, epx_recv_region* region);
/* A combine whose rows every rank has written into its output region, at the rows of the dispatch whose handle is
 * given: args->x and args->topk_weights must be the views epx_combine_region gives for args->hidden and
 * args->num_topk. The source rank reads every row where it is, through NVLink; no ring. Same results, bit for bit,
 * as epx_combine. Collective. */
epx_status epx_combine_in_buffer(epx_buffer* buffer, const epx_combine_args* args, const epx_config* config,
                                 const epx_dispatch_handle* handle, const epx_combine_outputs* outputs, void* stream);
/* num_recv_bytes for an output region of `rows` rows of this shape: dtype EPX_BF16 or EPX_FP8_E4M3 (as an int, so that
 * any value may be passed and refused), num_scales 0 for BF16 and in [1, hidden] for FP8. */
epx_status epx_recv_region_size_hint(int rows, int hidden, int dtype, int num_scales, int num_topk, int64_t* bytes);

/* num_rdma_bytes a low-latency buffer needs (both buffer sets). */
epx_status epx_ll_size_hint(int num_max_dispatch_tokens_per_rank, int hidden, int num_ranks, int num_experts,
                            int64_t* bytes);
/* Collective: zeroes this rank's low-latency signals, then a barrier. */
epx_status epx_ll_clean(epx_buffer* buffer, void* stream);
/* phases EPX_LL_SEND or EPX_LL_BOTH: fills *handle; EPX_LL_RECV: completes the dispatch described by *handle
 * with the same args and outputs. No host synchronization; capturable in a CUDA graph. */
epx_status epx_ll_dispatch(epx_buffer* buffer, const epx_ll_dispatch_args* args, const epx_ll_dispatch_outputs* outputs,
                           int phases, epx_ll_handle* handle, void* stream);
/* *buffer_set: on EPX_LL_SEND / EPX_LL_BOTH it receives the set used; EPX_LL_RECV passes it back. */
epx_status epx_ll_combine(epx_buffer* buffer, const epx_ll_combine_args* args, const epx_ll_handle* handle,
                          void* combined_x, int phases, int* buffer_set, void* stream);
/* The bf16 [L, R*M, hidden] area the next low-latency call reads zero-copy combine inputs from. */
epx_status epx_ll_next_combine_buffer(epx_buffer* buffer, const epx_ll_handle* handle, void** ptr);

/* Rank masking (buffers created with enable_shrink; semantics.md section 9). This rank's mask of the ranks its
 * low-latency calls leave out, in device memory: the kernels read it when they run (graph replays included) and
 * set a rank's entry when a wait for it outlasts the shrink budget. Stream-ordered, local to this rank (not
 * collective); only while no low-latency call of this buffer is waiting to be received. After a rank is unmasked
 * (mask 0, or epx_ll_clean_mask) every rank must call epx_ll_clean before its next low-latency call (the buffer
 * rejects the call until then). */
epx_status epx_ll_update_mask(epx_buffer* buffer, int rank, int mask, void* stream); /* mask: nonzero masks rank */
/* Copies the mask into out: num_ranks int32 in device memory, 1 where a rank is masked, else 0. */
epx_status epx_ll_query_mask(epx_buffer* buffer, int32_t* out, void* stream);
/* Unmasks every rank. */
epx_status epx_ll_clean_mask(epx_buffer* buffer, void* stream);

#ifdef __cplusplus
}
#endif

#endif /* EPX_EPX_H_ */
