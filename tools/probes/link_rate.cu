// Link-rate probe: how fast SMs move rows between all GPUs of one host at once, pushing (load local, store to the
// peer) or pulling (load from the peer, store local), by grid, block size and loads in flight per lane. Every GPU
// moves `rows` rows of `row_bytes` to (or from) each peer at the same time, as the low-latency combine does (each
// rank returns ~3/4 of its 1024 rows of 14336 bytes to 3 peers at the benchmark's defaults). Kernels on all GPUs
// are released together by a host-mapped flag. Rate = bytes to/from peers per GPU / the slowest GPU's time
// (CUDA events), median of 50 after 5 warm-up; copy engines (cudaMemcpyPeerAsync, one stream per peer) as a
// reference. `local` mode: what SMs copy within one GPU, and how that shares an SM with pushes and with copy engines
// on the link (local_kernel, local_bulk_kernel, mix_kernel, push_range_kernel); `ce` mode: device-to-device
// cudaMemcpyAsync within one GPU, alone and beside SMs that push and copy. Not part of the build; one process,
// all local GPUs:
//   nvcc -O2 -std=c++17 -arch=sm_90 -o link_rate tools/probes/link_rate.cu && ./link_rate
#include <cuda_runtime.h>

#include <algorithm>
#include <cstdint>
#include <cstdio>
#include <cstdlib>
#include <string>
#include <vector>

#include "check.hpp"

constexpr int kMaxGpus = 8;

struct Peers {
  int4* src[kMaxGpus];  // the pushing side reads src[self], the pulling side src[peer]
  int4* dst[kMaxGpus];  // dst[g] holds a region per source GPU
  int* flag[kMaxGpus];  // flag[g]: one int per (source GPU, row), for shape_kernel's release mode 3
};

// Waits (bounded, ~2 s) for the host to release all GPUs at once.
__global__ void gate_kernel(volatile int* flag) {
  for (long i = 0; i < 200000000L && *flag == 0; ++i) {
  }
}

// Work item = (peer, row). Warps take items round-robin over the grid; each lane moves `U` int4 per round.
// Destination row of `row` in a peer's region for one source: contiguous (window == rows), or spread over a
// window of `window` rows as the low-latency combine's rows land at [global expert][token] (window = L * M).
__device__ __forceinline__ size_t dst_row(int row, int rows, int window) {
  return window == rows ? size_t(row) : size_t(row) * 97 % size_t(window);
}

// A warp copies one row of row_int4 int4, U loads a lane in flight, then their stores.
template <int U>
__device__ __forceinline__ void copy_row(const int4* s, int4* d, int row_int4, int lane) {
  for (int base = 0; base < row_int4; base += 32 * U) {
    int4 v[U];
#pragma unroll
    for (int u = 0; u < U; ++u)
      if (base + u * 32 + lane < row_int4) v[u] = s[base + u * 32 + lane];
#pragma unroll
    for (int u = 0; u < U; ++u)
      if (base + u * 32 + lane < row_int4) d[base + u * 32 + lane] = v[u];
  }
}

template <int U>
__global__ void move_kernel(Peers p, int self, int ngpus, int rows, int row_int4, int pull, int window) {
  const int lane = threadIdx.x % 32;
  const int warp = (blockIdx.x * blockDim.x + threadIdx.x) / 32;
  const int nwarps = gridDim.x * blockDim.x / 32;
  const int items = (ngpus - 1) * rows;
  for (int item = warp; item < items; item += nwarps) {
    const int pi = item % (ngpus - 1);  // peers interleaved, so every link is busy from the start
    const int row = item / (ngpus - 1);
    const int peer = pi >= self ? pi + 1 : pi;
    const int4* s;
    int4* d;
    if (pull) {  // read the peer's rows meant for me, write my region for that peer
      s = p.src[peer] + (size_t(self) * rows + row) * row_int4;
      d = p.dst[self] + (size_t(peer) * window + dst_row(row, rows, window)) * row_int4;
    } else {  // read my rows meant for the peer, write the peer's region for me
      s = p.src[self] + (size_t(peer) * rows + row) * row_int4;
      d = p.dst[peer] + (size_t(self) * window + dst_row(row, rows, window)) * row_int4;
    }
    copy_row<U>(s, d, row_int4, lane);
  }
}

// The low-latency combine's send shape: parts of 128 int4 (2 KB), rows x peers x parts flattened (peers
// interleaved per row), each warp of the whole grid takes 2 adjacent parts (4 KB) and issues them at once;
// then, by `release`: 0 nothing, 1 lane 0 adds 1 to a per-row counter with a relaxed GPU-scope atomic, 2 the
// same add as acq_rel (the combine's: it waits for the warp's stores to land), 3 as 2 and the warp whose add
// completes its row raises a flag at the peer with a system-scope release store (the combine's signal).
// `with_self`: the rows for this GPU itself are copied too (the combine returns ~1/4 of its rows to itself);
// `src_window` > rows: source rows spread over that many rows per destination, as the combine reads x
// [L][R*M][H] (the first ~14 of every expert's 512 rows at the defaults).
__global__ void shape_kernel(Peers p, int self, int ngpus, int rows, int row_int4, int release, int* counters,
                             int with_self, int src_window, int peer_major) {
  constexpr int kPart = 128;
  const int lane = threadIdx.x % 32;
  const int warp = (blockIdx.x * blockDim.x + threadIdx.x) / 32;
  const int nwarps = gridDim.x * blockDim.x / 32;
  const int parts = (row_int4 + kPart - 1) / kPart;
  const int npeers = with_self ? ngpus : ngpus - 1;
  const int total = npeers * rows * parts;
  for (int f0 = warp * 2; f0 < total; f0 += nwarps * 2) {
    int item_of[2];
    for (int j = 0; j < 2; ++j) {
      const int f = f0 + j;
      item_of[j] = -1;
      if (f >= total) continue;
      const int item = f / parts, part = f % parts;
      // peer_major: runs of one destination (the combine's items go by (expert, source) pair)
      const int pi = peer_major ? item / rows : item % npeers, row = peer_major ? item % rows : item / npeers;
      const int peer = with_self ? pi : (pi >= self ? pi + 1 : pi);
      const int4* s = p.src[self] + (size_t(peer) * src_window + dst_row(row, rows, src_window)) * row_int4;
      int4* d = p.dst[peer] + (size_t(self) * rows + row) * row_int4;
      const int first = part * kPart, last = min(first + kPart, row_int4);
      int4 v[4];
#pragma unroll
      for (int u = 0; u < 4; ++u) {
        const int i = first + u * 32 + lane;
        if (i < last) v[u] = s[i];
      }
#pragma unroll
      for (int u = 0; u < 4; ++u) {
        const int i = first + u * 32 + lane;
        if (i < last) d[i] = v[u];
      }
      item_of[j] = item;
    }
    if (release == 0) continue;
    __syncwarp();
    for (int j = 0; j < 2; ++j) {
      if (lane != 0 || item_of[j] < 0) continue;
      int old;
      if (release == 1)
        asm volatile("atom.relaxed.gpu.global.add.s32 %0, [%1], 1;"
                     : "=r"(old)
                     : "l"(counters + item_of[j])
                     : "memory");
      else
        asm volatile("atom.acq_rel.gpu.global.add.s32 %0, [%1], 1;"
                     : "=r"(old)
                     : "l"(counters + item_of[j])
                     : "memory");
      if (release == 3 && (old + 1) % parts == 0) {  // counters accumulate over the timed iterations
        const int pi = peer_major ? item_of[j] / rows : item_of[j] % npeers;
        const int peer = with_self ? pi : (pi >= self ? pi + 1 : pi);
        int* flag =
            reinterpret_cast<int*>(p.flag[peer]) + self * rows + (peer_major ? item_of[j] % rows : item_of[j] / npeers);
        asm volatile("st.release.sys.global.s32 [%0], %1;" ::"l"(flag), "r"(old + 1) : "memory");
      }
    }
  }
}

// Bulk push: per warp, lane 0 bulk-loads a row into the warp's shared buffer (mbarrier), then bulk-stores it to
// the peer (cp.async.bulk, the SM's copy engine) and waits for the store to have read the buffer before reuse.
__device__ __forceinline__ uint32_t smem_u32(const void* p) { return uint32_t(__cvta_generic_to_shared(p)); }

// Push item `item` of a warp loop over (row, peer), peers interleaved: its source row here and its destination
// row in the peer's region for this GPU.
struct PushRow {
  const int4* s;
  int4* d;
};
__device__ __forceinline__ PushRow push_row(const Peers& p, int self, int ngpus, int rows, int row_int4, int item) {
  const int pi = item % (ngpus - 1);
  const int row = item / (ngpus - 1);
  const int peer = pi >= self ? pi + 1 : pi;
  return {p.src[self] + (size_t(peer) * rows + row) * row_int4, p.dst[peer] + (size_t(self) * rows + row) * row_int4};
}

// Lane 0: a warp's mbarrier for bulk loads (one arrival per phase).
__device__ __forceinline__ void init_row_barrier(uint64_t* bar) {
  asm volatile("mbarrier.init.shared::cta.b64 [%0], 1;" ::"r"(smem_u32(bar)) : "memory");
  asm volatile("fence.mbarrier_init.release.cluster;" ::: "memory");
}

// Lane 0 of a warp: one row from s to d through the warp's shared buffer (bulk load into buf with the mbarrier's
// transaction count, then a bulk store), after the previous store from buf has read it. parity: the mbarrier
// phase this use waits for (flip it after each call).
__device__ __forceinline__ void bulk_push_row(unsigned char* buf, uint64_t* bar, uint32_t parity, const int4* s,
                                              int4* d, uint32_t row_bytes) {
  asm volatile("cp.async.bulk.wait_group.read 0;" ::: "memory");  // the previous store has read buf
  asm volatile("mbarrier.arrive.expect_tx.shared::cta.b64 _, [%0], %1;" ::"r"(smem_u32(bar)), "r"(row_bytes)
               : "memory");
  asm volatile(
      "cp.async.bulk.shared::cluster.global.mbarrier::complete_tx::bytes [%0], [%1], %2, [%3];" ::"r"(smem_u32(buf)),
      "l"(s), "r"(row_bytes), "r"(smem_u32(bar))
      : "memory");
  uint32_t done = 0;
  while (!done)
    asm volatile(
        "{\n .reg .pred q;\n mbarrier.try_wait.parity.shared::cta.b64 q, [%1], %2;\n selp.u32 %0, 1, 0, q;\n}\n"
        : "=r"(done)
        : "r"(smem_u32(bar)), "r"(parity)
        : "memory");
  asm volatile("cp.async.bulk.global.shared::cta.bulk_group [%0], [%1], %2;" ::"l"(d), "r"(smem_u32(buf)),
               "r"(row_bytes)
               : "memory");
  asm volatile("cp.async.bulk.commit_group;" ::: "memory");
}

// pull: the warp reads the peer's row meant for this GPU (the bulk load crosses the link) and stores it here.
__global__ void bulk_push_kernel(Peers p, int self, int ngpus, int rows, int row_int4, int pull) {
  extern __shared__ __align__(128) unsigned char smem[];
  __shared__ uint64_t bars[32];
  const int lane = threadIdx.x % 32, wib = threadIdx.x / 32;
  const int warp = (blockIdx.x * blockDim.x + threadIdx.x) / 32;
  const int nwarps = gridDim.x * blockDim.x / 32;
  const uint32_t row_bytes = uint32_t(row_int4) * 16;
  unsigned char* buf = smem + size_t(wib) * row_bytes;
  uint64_t* bar = &bars[wib];
  if (lane == 0) init_row_barrier(bar);
  __syncwarp();
  uint32_t parity = 0;
  const int items = (ngpus - 1) * rows;
  for (int item = warp; item < items; item += nwarps) {
    PushRow r = push_row(p, self, ngpus, rows, row_int4, item);
    if (pull) {
      const int pi = item % (ngpus - 1), row = item / (ngpus - 1), peer = pi >= self ? pi + 1 : pi;
      r = {p.src[peer] + (size_t(self) * rows + row) * row_int4, p.dst[self] + (size_t(peer) * rows + row) * row_int4};
    }
    if (lane == 0) bulk_push_row(buf, bar, parity, r.s, r.d, row_bytes);
    parity ^= 1;
  }
  if (lane == 0) asm volatile("cp.async.bulk.wait_group 0;" ::: "memory");
}

// `local` mode: how fast a few SMs copy rows within one GPU's memory (the dispatch's ring readers and own-token warps
// copy locally). Register copy: each lane moves U int4 a round, as move_kernel.
template <int U>
__global__ void local_kernel(const int4* src, int4* dst, int rows, int row_int4) {
  const int lane = threadIdx.x % 32;
  const int warp = (blockIdx.x * blockDim.x + threadIdx.x) / 32;
  const int nwarps = gridDim.x * blockDim.x / 32;
  for (int row = warp; row < rows; row += nwarps) {
    const int4* s = src + size_t(row) * row_int4;
    int4* d = dst + size_t(row) * row_int4;
    copy_row<U>(s, d, row_int4, lane);
  }
}

// Bulk copy, NB rows in flight a warp: lane 0 keeps NB bulk loads into the warp's NB row buffers going; as each
// arrives (its mbarrier), a bulk store sends it on, and once that store has read its buffer the buffer takes the
// load NB rows ahead.
template <int NB>
__global__ void local_bulk_kernel(const int4* src, int4* dst, int rows, int row_int4) {
  extern __shared__ __align__(128) unsigned char smem[];
  __shared__ uint64_t bars[32 * NB];
  const int lane = threadIdx.x % 32, wib = threadIdx.x / 32;
  const int warp = (blockIdx.x * blockDim.x + threadIdx.x) / 32;
  const int nwarps = gridDim.x * blockDim.x / 32;
  const uint32_t row_bytes = uint32_t(row_int4) * 16;
  if (lane != 0) return;
  unsigned char* buf[NB];
  uint64_t* bar[NB];
  for (int q = 0; q < NB; ++q) {
    buf[q] = smem + (size_t(wib) * NB + q) * row_bytes;
    bar[q] = &bars[wib * NB + q];
    init_row_barrier(bar[q]);
  }
  const int n = warp < rows ? (rows - warp + nwarps - 1) / nwarps : 0;  // this warp's rows: warp + k * nwarps
  auto load = [&](int k) {
    const int q = k % NB;
    asm volatile("mbarrier.arrive.expect_tx.shared::cta.b64 _, [%0], %1;" ::"r"(smem_u32(bar[q])), "r"(row_bytes)
                 : "memory");
    asm volatile("cp.async.bulk.shared::cluster.global.mbarrier::complete_tx::bytes [%0], [%1], %2, [%3];" ::"r"(
                     smem_u32(buf[q])),
                 "l"(src + size_t(warp + size_t(k) * nwarps) * row_int4), "r"(row_bytes), "r"(smem_u32(bar[q]))
                 : "memory");
  };
  for (int k = 0; k < n && k < NB; ++k) load(k);
  for (int k = 0; k < n; ++k) {
    const int q = k % NB;
    const uint32_t parity = (k / NB) & 1;
    uint32_t done = 0;
    while (!done)
      asm volatile(
          "{\n .reg .pred q;\n mbarrier.try_wait.parity.shared::cta.b64 q, [%1], %2;\n selp.u32 %0, 1, 0, q;\n}\n"
          : "=r"(done)
          : "r"(smem_u32(bar[q])), "r"(parity)
          : "memory");
    asm volatile("cp.async.bulk.global.shared::cta.bulk_group [%0], [%1], %2;" ::"l"(
                     dst + size_t(warp + size_t(k) * nwarps) * row_int4),
                 "r"(smem_u32(buf[q])), "r"(row_bytes)
                 : "memory");
    asm volatile("cp.async.bulk.commit_group;" ::: "memory");
    if (k + NB < n) {
      asm volatile("cp.async.bulk.wait_group.read 0;" ::: "memory");  // this store has read buf[q]
      load(k + NB);
    }
  }
  asm volatile("cp.async.bulk.wait_group 0;" ::: "memory");
}

// `local` mode, shared or not: the even warps of every block push `push_rows` rows to the peers (move_kernel's rows),
// the odd ones copy `local_rows` rows locally (local_kernel's), both 4 int4 a lane; either count may be 0.
__global__ void mix_kernel(Peers p, int self, int ngpus, int push_rows, const int4* lsrc, int4* ldst, int local_rows,
                           int row_int4) {
  const int lane = threadIdx.x % 32, wib = threadIdx.x / 32;
  const int half = blockDim.x / 64;  // warps a role per block
  const int w = blockIdx.x * half + wib / 2, nw = gridDim.x * half;
  const bool pushes = wib % 2 == 0;
  const int items = pushes ? (ngpus - 1) * push_rows : local_rows;
  for (int item = w; item < items; item += nw) {
    const int4* s;
    int4* d;
    if (pushes) {
      const PushRow r = push_row(p, self, ngpus, push_rows, row_int4, item);
      s = r.s, d = r.d;
    } else {
      s = lsrc + size_t(item) * row_int4, d = ldst + size_t(item) * row_int4;
    }
    copy_row<4>(s, d, row_int4, lane);
  }
}

// `local` mode, copy engines and SMs on the link at once (2 GPUs): every warp of the grid pushes rows [first, first +
// count) of this GPU's rows for the peer (region stride `rows`), 4 int4 a lane, as move_kernel.
__global__ void push_range_kernel(Peers p, int self, int rows, int first, int count, int row_int4) {
  const int lane = threadIdx.x % 32;
  const int warp = (blockIdx.x * blockDim.x + threadIdx.x) / 32, nwarps = gridDim.x * blockDim.x / 32;
  const int peer = 1 - self;
  for (int row = first + warp; row < first + count; row += nwarps) {
    const int4* s = p.src[self] + (size_t(peer) * rows + row) * row_int4;
    int4* d = p.dst[peer] + (size_t(self) * rows + row) * row_int4;
    copy_row<4>(s, d, row_int4, lane);
  }
}

// `fence` mode: what a system-scope release costs on an SM whose other warps keep sending. Data warps of a block
// move rows to the peers, by plain stores (mode 0/1, U 4) or by bulk copies through a row buffer per warp (mode
// 2-4); the block's last warp (modes 1, 3, 4), until every data warp is done, times `st.release.sys` (a fence then
// a store to a word of its own GPU) and naps 500 ns. Mode 4: bulk copies plus an 80-byte plain store to the peer
// per row, as a record's metadata would be. stats: releases, their total and their maximum ns.
__global__ void fence_kernel(Peers p, int self, int ngpus, int rows, int row_int4, int mode,
                             unsigned long long* stats) {
  extern __shared__ __align__(128) unsigned char smem[];
  __shared__ uint64_t bars[32];
  __shared__ int s_done;
  const int lane = threadIdx.x % 32, wib = threadIdx.x / 32;
  const int data_warps = blockDim.x / 32 - 1;
  const bool bulk = mode >= 2, fencer = mode == 1 || mode >= 3;
  if (threadIdx.x == 0) s_done = 0;
  __syncthreads();
  if (wib == data_warps) {
    if (lane != 0 || !fencer) return;
    unsigned long long n = 0, sum = 0, mx = 0;
    int* word = p.flag[self] + blockIdx.x;
    while (*reinterpret_cast<volatile int*>(&s_done) < data_warps) {
      unsigned long long t0, t1;
      asm volatile("mov.u64 %0, %%globaltimer;" : "=l"(t0)::"memory");
      asm volatile("st.release.sys.global.s32 [%0], %1;" ::"l"(word), "r"(int(n)) : "memory");
      asm volatile("mov.u64 %0, %%globaltimer;" : "=l"(t1)::"memory");
      ++n;
      sum += t1 - t0;
      mx = max(mx, t1 - t0);
      __nanosleep(500);
    }
    atomicAdd(stats, n);
    atomicAdd(stats + 1, sum);
    atomicMax(stats + 2, mx);
    return;
  }
  const int warp = blockIdx.x * data_warps + wib, nwarps = gridDim.x * data_warps;
  const uint32_t row_bytes = uint32_t(row_int4) * 16;
  unsigned char* buf = smem + size_t(wib) * row_bytes;
  uint64_t* bar = &bars[wib];
  if (bulk && lane == 0) init_row_barrier(bar);
  __syncwarp();
  uint32_t parity = 0;
  const int items = (ngpus - 1) * rows;
  for (int item = warp; item < items; item += nwarps) {
    const PushRow r = push_row(p, self, ngpus, rows, row_int4, item);
    const int4* s = r.s;
    int4* d = r.d;
    if (!bulk) {
      for (int base = 0; base < row_int4; base += 128) {
        int4 v[4];
#pragma unroll
        for (int u = 0; u < 4; ++u)
          if (base + u * 32 + lane < row_int4) v[u] = s[base + u * 32 + lane];
#pragma unroll
        for (int u = 0; u < 4; ++u)
          if (base + u * 32 + lane < row_int4) d[base + u * 32 + lane] = v[u];
      }
      continue;
    }
    if (lane == 0) bulk_push_row(buf, bar, parity, s, d, row_bytes);
    parity ^= 1;
    if (mode == 4 && lane < 5) {  // the same bytes the row carries, so the check below still holds
      const int b = 0x3c + self;
      const int w = b | b << 8 | b << 16 | b << 24;
      d[lane] = int4{w, w, w, w};
    }
  }
  if (bulk && lane == 0) asm volatile("cp.async.bulk.wait_group 0;" ::: "memory");
  __syncwarp();
  if (lane == 0) atomicAdd(&s_done, 1);
}

using Kernel = void (*)(Peers, int, int, int, int, int, int);

int main(int argc, char** argv) {
  std::setvbuf(stdout, nullptr, _IOLBF, 0);  // lines show up as they are printed, also through a pipe
  int ngpus = 0;
  CHECK(cudaGetDeviceCount(&ngpus));
  if (ngpus < 2) {
    std::printf("link_rate needs 2 or more GPUs (found %d)\n", ngpus);
    return 0;
  }
  ngpus = std::min(ngpus, kMaxGpus);
  const int row_bytes = argc > 1 ? std::atoi(argv[1]) : 14336;
  const int row_int4 = row_bytes / 16;
  // `./link_rate 14336 scatter`: only SM push, contiguous destination rows against rows spread over a window of
  // kWindow rows per source (the combine's [expert][token] layout at 72 local experts x 128 tokens).
  const bool scatter = argc > 2 && std::string(argv[2]) == "scatter";
  // `./link_rate 14336 shape`: the best plain push against the combine's send shape (shape_kernel) with each
  // of its release modes.
  const bool shape = argc > 2 && std::string(argv[2]) == "shape";
  constexpr int kWindow = 72 * 128;
  std::vector<int> rows_list = {1024 * 3 / 4 / (ngpus - 1) + 1, 1024};
  // `./link_rate 7424 rows 115`: the default sweep for one row count only (e.g. the low-latency dispatch's
  // records: ~115 of 7424 bytes to each peer at the bench defaults), with 128-thread blocks as well (the
  // dispatch's writers: a few warps per SM, one record each).
  const bool rows_mode = argc > 3 && std::string(argv[2]) == "rows";
  if (rows_mode) rows_list = {std::max(1, std::atoi(argv[3]))};
  // `./link_rate 14336 sms`: few SMs (the high-throughput kernels' senders: 6-24 blocks), 1024 rows per peer:
  // the rate one SM can push to the peers, plain stores against bulk copies, pulls, and pushes with pulls at once.
  const bool few_sms = argc > 2 && std::string(argv[2]) == "sms";
  if (few_sms) rows_list = {1024};
  // `./link_rate 14336 fence`: fence_kernel's modes at 12 and 24 blocks, 1024 rows per peer.
  const bool fence = argc > 2 && std::string(argv[2]) == "fence";
  // `./link_rate 14336 local`: local copies only (local_kernel, local_bulk_kernel) of 8192 rows on every GPU at once,
  // by 4-24 blocks: what the dispatch's local copies can reach on the SMs they have.
  // `./link_rate 14336 ce`: copies within one GPU by cudaMemcpyAsync (one copy, or two or four on as many streams),
  // alone and beside SMs that push and copy (mix_kernel).
  const bool ce = argc > 2 && std::string(argv[2]) == "ce";
  const bool local = (argc > 2 && std::string(argv[2]) == "local") || ce;
  if (fence) rows_list = {1024};
  const size_t max_rows = scatter || shape ? kWindow : 1024;
  if (rows_mode && size_t(rows_list[0]) > max_rows) {
    std::printf("link_rate: rows %d is more than the %zu rows per peer its buffers hold\n", rows_list[0], max_rows);
    return 2;
  }
  Peers p{};
  std::vector<cudaStream_t> streams(ngpus * kMaxGpus);
  std::vector<cudaEvent_t> ev0(ngpus), ev1(ngpus);
  int* flag = nullptr;
  CHECK(cudaHostAlloc(&flag, sizeof(int), cudaHostAllocMapped | cudaHostAllocPortable));
  for (int g = 0; g < ngpus; ++g) {
    CHECK(cudaSetDevice(g));
    for (int h = 0; h < ngpus; ++h)
      if (h != g) CHECK(cudaDeviceEnablePeerAccess(h, 0));
    const size_t bytes = size_t(ngpus) * max_rows * row_bytes;
    CHECK(cudaMalloc(&p.src[g], bytes));
    CHECK(cudaMalloc(&p.dst[g], bytes));
    CHECK(cudaMemset(p.src[g], 0x3c + g, bytes));  // not zeros
    CHECK(cudaMalloc(&p.flag[g], size_t(kMaxGpus) * max_rows * sizeof(int)));
    CHECK(cudaMemset(p.flag[g], 0, size_t(kMaxGpus) * max_rows * sizeof(int)));
    for (int s = 0; s < kMaxGpus; ++s)
      CHECK(cudaStreamCreateWithFlags(&streams[g * kMaxGpus + s], cudaStreamNonBlocking));
    CHECK(cudaEventCreate(&ev0[g]));
    CHECK(cudaEventCreate(&ev1[g]));
  }
  int sms = 0;
  CHECK(cudaDeviceGetAttribute(&sms, cudaDevAttrMultiProcessorCount, 0));

  // Runs `launch(g, stream)` on every GPU behind the gate; returns the median over iterations of the slowest GPU.
  auto time_all = [&](auto launch) {
    std::vector<double> v;
    for (int it = 0; it < 55; ++it) {
      *(volatile int*)flag = 0;
      for (int g = 0; g < ngpus; ++g) {
        CHECK(cudaSetDevice(g));
        cudaStream_t s = streams[g * kMaxGpus];
        gate_kernel<<<1, 1, 0, s>>>(flag);
        CHECK(cudaEventRecord(ev0[g], s));
        launch(g, s);
        CHECK(cudaEventRecord(ev1[g], s));
      }
      *(volatile int*)flag = 1;
      double worst = 0;
      for (int g = 0; g < ngpus; ++g) {
        CHECK(cudaSetDevice(g));
        CHECK(cudaEventSynchronize(ev1[g]));
        float ms = 0;
        CHECK(cudaEventElapsedTime(&ms, ev0[g], ev1[g]));
        worst = std::max(worst, double(ms) * 1e3);
      }
      if (it >= 5) v.push_back(worst);
    }
    std::sort(v.begin(), v.end());
    return v[v.size() / 2];
  };

  // Clears every dst before a mode and checks afterwards that the last row from every peer arrived (the memset
  // pattern of src is 0x3c + source GPU), so a mode that moves nothing cannot report a rate.
  auto clear_dst = [&] {
    for (int g = 0; g < ngpus; ++g) {
      CHECK(cudaSetDevice(g));
      CHECK(cudaMemset(p.dst[g], 0, size_t(ngpus) * max_rows * row_bytes));
      CHECK(cudaDeviceSynchronize());
    }
  };
  auto check_dst = [&](int rows, const char* mode, int window = 0) {
    if (window == 0) window = rows;
    std::vector<unsigned char> h(row_bytes);
    for (int g = 0; g < ngpus; ++g)
      for (int s = 0; s < ngpus; ++s) {
        if (s == g) continue;
        CHECK(cudaSetDevice(g));
        CHECK(cudaMemcpy(
            h.data(),
            p.dst[g] + (size_t(s) * window + (window == rows ? rows - 1 : size_t(rows - 1) * 97 % window)) * row_int4,
            row_bytes, cudaMemcpyDeviceToHost));
        for (int i = 0; i < row_bytes; ++i)
          if (h[i] != 0x3c + s) {
            std::printf("MISMATCH mode %s gpu %d from %d byte %d: %d\n", mode, g, s, i, h[i]);
            std::exit(1);
          }
      }
  };
  // SM bulk copies (bulk_push_kernel), one shape: a warp's shared buffer holds one row.
  auto run_bulk = [&](int rows, int blocks, int threads, int pull = 0) {
    const double bytes = double(ngpus - 1) * rows * row_bytes;
    const size_t smem = size_t(threads / 32) * row_bytes;
    for (int g = 0; g < ngpus; ++g) {
      CHECK(cudaSetDevice(g));
      CHECK(cudaFuncSetAttribute(bulk_push_kernel, cudaFuncAttributeMaxDynamicSharedMemorySize, int(smem)));
    }
    clear_dst();
    const double us = time_all([&](int g, cudaStream_t s) {
      bulk_push_kernel<<<blocks, threads, smem, s>>>(p, g, ngpus, rows, row_int4, pull);
      CHECK(cudaGetLastError());
    });
    check_dst(rows, pull ? "bpull" : "bulk");
    std::printf("%-5s %6d %6d %7d %3s | %8.1f %8.1f\n", pull ? "bpull" : "bulk", rows, blocks, threads, "-", us,
                bytes / us * 1e-3);
  };
  std::printf("%d GPUs, rows of %d bytes; rate = bytes to/from the %d peers per GPU / slowest GPU's time\n", ngpus,
              row_bytes, ngpus - 1);
  std::printf("%-5s %6s %6s %7s %3s | %8s %8s\n", "mode", "rows", "blocks", "threads", "U", "us", "GB/s");
  if (shape) {
    std::vector<int*> counters(ngpus);
    for (int g = 0; g < ngpus; ++g) {
      CHECK(cudaSetDevice(g));
      CHECK(cudaMalloc(&counters[g], size_t(kMaxGpus) * max_rows * sizeof(int)));
      CHECK(cudaMemset(counters[g], 0, size_t(kMaxGpus) * max_rows * sizeof(int)));
    }
    const int rows = rows_list[0];
    const double bytes = double(ngpus - 1) * rows * row_bytes;
    for (int rep = 0; rep < 2; ++rep) {
      clear_dst();
      double us = time_all([&](int g, cudaStream_t s) {
        move_kernel<8><<<sms / 2, 512, 0, s>>>(p, g, ngpus, rows, row_int4, 0, rows);
        CHECK(cudaGetLastError());
      });
      check_dst(rows, "push");
      std::printf("%-12s %6d %6d %7d | %8.1f %8.1f\n", "push-U8", rows, sms / 2, 512, us, bytes / us * 1e-3);
      struct Variant {
        const char* name;
        int release, with_self, src_window, peer_major;
      };
      const Variant variants[] = {{"shape", 0, 0, rows, 0},          {"shape+flag", 3, 0, rows, 0},
                                  {"flag+self", 3, 1, rows, 0},      {"flag+self+spread", 3, 1, kWindow / 4, 0},
                                  {"flag+peermajor", 3, 0, rows, 1}, {"flag+self+spread+pm", 3, 1, kWindow / 4, 1}};
      for (const Variant& v : variants) {
        clear_dst();
        us = time_all([&](int g, cudaStream_t s) {
          shape_kernel<<<sms, 1024, 0, s>>>(p, g, ngpus, rows, row_int4, v.release, counters[g], v.with_self,
                                            v.src_window, v.peer_major);
          CHECK(cudaGetLastError());
        });
        check_dst(rows, "shape");
        std::printf("%-20s %6d %6d %7d | %8.1f %8.1f\n", v.name, rows, sms, 1024, us, bytes / us * 1e-3);
      }
    }
    return 0;
  }
  if (local) {
    constexpr int kRows = 8192;  // 117 MB at 14336 bytes, past the L2, as x and the outputs are
    std::vector<int4*> lsrc(ngpus), ldst(ngpus);
    for (int g = 0; g < ngpus; ++g) {
      CHECK(cudaSetDevice(g));
      CHECK(cudaMalloc(&lsrc[g], size_t(kRows) * row_bytes));
      CHECK(cudaMalloc(&ldst[g], size_t(kRows) * row_bytes));
      CHECK(cudaMemset(lsrc[g], 0x5a, size_t(kRows) * row_bytes));
    }
    const double bytes = double(kRows) * row_bytes;  // copied per GPU (read and written once each)
    // The last row's copy of every GPU (of `rows` copied), checked after each mode.
    auto check_local = [&](const char* mode, int rows) {
      std::vector<unsigned char> h(row_bytes);
      for (int g = 0; g < ngpus; ++g) {
        CHECK(cudaSetDevice(g));
        CHECK(cudaMemcpy(h.data(), ldst[g] + size_t(rows - 1) * row_int4, row_bytes, cudaMemcpyDeviceToHost));
        for (int i = 0; i < row_bytes; ++i)
          if (h[i] != 0x5a) {
            std::printf("MISMATCH mode %s gpu %d byte %d: %d\n", mode, g, i, h[i]);
            std::exit(1);
          }
        CHECK(cudaMemset(ldst[g], 0, size_t(kRows) * row_bytes));
        CHECK(cudaDeviceSynchronize());
      }
    };
    if (ce) {
      // Device-to-device cudaMemcpyAsync within one GPU: rows [0, n) of lsrc to ldst in `parts` copies on
      // streams 1..parts, released with the gate; the kernel stream waits for them.
      auto ce_local = [&](int g, cudaStream_t s, int n, int parts) {
        std::vector<cudaEvent_t> done(parts);
        for (int k = 0; k < parts; ++k) {
          cudaStream_t c = streams[g * kMaxGpus + 1 + k];
          CHECK(cudaStreamWaitEvent(c, ev0[g], 0));
          const int a = n * k / parts, b = n * (k + 1) / parts;
          CHECK(cudaMemcpyAsync(ldst[g] + size_t(a) * row_int4, lsrc[g] + size_t(a) * row_int4,
                                size_t(b - a) * row_bytes, cudaMemcpyDeviceToDevice, c));
          CHECK(cudaEventCreateWithFlags(&done[k], cudaEventDisableTiming));
          CHECK(cudaEventRecord(done[k], c));
        }
        return done;
      };
      auto join = [&](cudaStream_t s, std::vector<cudaEvent_t>& done) {
        for (cudaEvent_t e : done) {
          CHECK(cudaStreamWaitEvent(s, e, 0));
          CHECK(cudaEventDestroy(e));
        }
      };
      for (int parts : {1, 2, 4})
        for (int n : {2048, 8192}) {
          const double us = time_all([&](int g, cudaStream_t s) {
            auto done = ce_local(g, s, n, parts);
            join(s, done);
          });
          check_local("ce", n);
          std::printf("ce local: %d rows in %d copies: %.1f us, %.1f GB/s\n", n, parts, us,
                      double(n) * row_bytes / us * 1e-3);
        }
      // Beside SMs: mix_kernel on 16 blocks (1024 rows pushed, 1024 copied locally into ldst's upper half) and the
      // copies of rows [0, 4096).
      for (int parts : {1, 4}) {
        double t[3];
        for (int m = 0; m < 3; ++m) {
          clear_dst();
          t[m] = time_all([&](int g, cudaStream_t s) {
            std::vector<cudaEvent_t> done;
            if (m != 1) done = ce_local(g, s, 4096, parts);
            if (m != 0)
              mix_kernel<<<16, 1024, 0, s>>>(p, g, ngpus, 1024, lsrc[g] + size_t(4096) * row_int4,
                                             ldst[g] + size_t(4096) * row_int4, 1024, row_int4);
            CHECK(cudaGetLastError());
            join(s, done);
          });
          if (m != 1) check_local("ce+mix", 4096);
          if (m != 0) check_dst(1024, "ce+mix");
        }
        std::printf("ce+mix: %d copies of 4096 rows alone %.1f us, mix (16 blocks) alone %.1f us, both %.1f us\n",
                    parts, t[0], t[1], t[2]);
      }
      return 0;
    }
    using LocalKernel = void (*)(const int4*, int4*, int, int);
    const LocalKernel kernels[] = {local_kernel<4>, local_kernel<8>};
    const int us_[] = {4, 8};
    const LocalKernel bulk[] = {local_bulk_kernel<1>, local_bulk_kernel<2>, local_bulk_kernel<3>};
    for (int g = 0; g < ngpus; ++g) {
      CHECK(cudaSetDevice(g));
      for (LocalKernel k : bulk)
        CHECK(cudaFuncSetAttribute(k, cudaFuncAttributeMaxDynamicSharedMemorySize, 226 * 1024));
    }
    for (int blocks : {4, 8, 12, 16, 24}) {
      for (int threads : {512, 768, 1024})
        for (int k = 0; k < 2; ++k) {
          const double us = time_all([&](int g, cudaStream_t s) {
            kernels[k]<<<blocks, threads, 0, s>>>(lsrc[g], ldst[g], kRows, row_int4);
            CHECK(cudaGetLastError());
          });
          check_local("regs", kRows);
          std::printf("%-5s %6d %6d %7d %3d | %8.1f %8.1f\n", "lregs", kRows, blocks, threads, us_[k], us,
                      bytes / us * 1e-3);
        }
      for (int nb = 1; nb <= 3; ++nb)
        for (int threads : {128, 256, 384, 512}) {
          const size_t smem = size_t(threads / 32) * nb * row_bytes;
          if (smem > 226 * 1024) continue;  // and the static mbarriers
          const double us = time_all([&](int g, cudaStream_t s) {
            bulk[nb - 1]<<<blocks, threads, smem, s>>>(lsrc[g], ldst[g], kRows, row_int4);
            CHECK(cudaGetLastError());
          });
          check_local("bulk", kRows);
          std::printf("%-5s %6d %6d %7d %3d | %8.1f %8.1f\n", "lbulk", kRows, blocks, threads, nb, us,
                      bytes / us * 1e-3);
        }
    }
    // Shared or not: half the warps push, half copy locally, each role alone and both at once. If an SM's pushes and
    // local copies drew on one budget, both at once would take about the sum of the two alone.
    for (int blocks : {4, 8})
      for (int rows : {512, 1024}) {
        const double push_bytes = double(ngpus - 1) * rows * row_bytes, local_bytes = double(rows) * row_bytes;
        double t[3];
        for (int m = 0; m < 3; ++m) {
          clear_dst();
          t[m] = time_all([&](int g, cudaStream_t s) {
            mix_kernel<<<blocks, 1024, 0, s>>>(p, g, ngpus, m != 1 ? rows : 0, lsrc[g], ldst[g], m != 0 ? rows : 0,
                                               row_int4);
            CHECK(cudaGetLastError());
          });
          if (m != 1) check_dst(rows, "mix");
          if (m != 0) check_local("mix", rows);
        }
        std::printf(
            "mix: %d blocks, %d rows: push alone %.1f us (%.1f GB/s), local alone %.1f us (%.1f GB/s), both %.1f us "
            "(sum of the two %.1f)\n",
            blocks, rows, t[0], push_bytes / t[0] * 1e-3, t[1], local_bytes / t[1] * 1e-3, t[2], t[0] + t[1]);
      }
    // On GPU g of 2: the copy engine moves the first ce_rows of g's rows for the peer (region stride `rows`) on a
    // second stream, released with the gate, while sm() launches on s; s then waits for the copy too.
    auto with_copy_engine = [&](int g, cudaStream_t s, int rows, int ce_rows, auto sm) {
      const int h = 1 - g;
      cudaStream_t c = streams[g * kMaxGpus + 1];
      CHECK(cudaStreamWaitEvent(c, ev0[g], 0));
      CHECK(cudaMemcpyPeerAsync(p.dst[h] + size_t(g) * rows * row_int4, h, p.src[g] + size_t(h) * rows * row_int4, g,
                                size_t(ce_rows) * row_bytes, c));
      cudaEvent_t done;
      CHECK(cudaEventCreateWithFlags(&done, cudaEventDisableTiming));
      CHECK(cudaEventRecord(done, c));
      sm();
      CHECK(cudaStreamWaitEvent(s, done, 0));
      CHECK(cudaEventDestroy(done));
    };
    // Copy engines on the link while SMs copy locally: one cudaMemcpyPeerAsync of `rows` rows to the peer (a second
    // stream) and local_kernel<4> on `blocks` 1024-thread blocks copying twice as many rows (the 2-rank dispatch's
    // shape: the peer's rows cross the link once and every received row is copied locally once), each alone and
    // both at once. If both at once take about the longer of the two, the link's bytes cost the SMs nothing.
    if (ngpus == 2)
      for (int blocks : {8, 16, 24}) {
        const int rows = 1024;
        double t[3];
        for (int m = 0; m < 3; ++m) {
          clear_dst();
          t[m] = time_all([&](int g, cudaStream_t s) {
            if (m != 1)
              with_copy_engine(g, s, rows, rows, [&] {
                if (m == 2) local_kernel<4><<<blocks, 1024, 0, s>>>(lsrc[g], ldst[g], 2 * rows, row_int4);
              });
            else
              local_kernel<4><<<blocks, 1024, 0, s>>>(lsrc[g], ldst[g], 2 * rows, row_int4);
            CHECK(cudaGetLastError());
          });
          if (m != 1) check_dst(rows, "ce+local");
          if (m != 0) check_local("ce+local", 2 * rows);
        }
        std::printf("ce+local: %d blocks: ce alone %.1f us (%.1f GB/s), local alone (%d rows) %.1f us, both %.1f us\n",
                    blocks, t[0], double(rows) * row_bytes / t[0] * 1e-3, 2 * rows, t[1], t[2]);
      }
    // Copy engines and SM pushes on the link at once: the copy engine moves rows [0, k) of the 1024 for the peer, SMs
    // (blocks x 1024 threads) push rows [k, 1024) meanwhile; k = 0 is SMs alone, k = 1024 the copy engine alone. If the
    // two together beat either alone, the link has room that SM stores do not reach.
    if (ngpus == 2)
      for (int blocks : {8, 16})
        for (int k : {0, 256, 384, 512, 640, 1024}) {
          const int rows = 1024;
          clear_dst();
          const double us = time_all([&](int g, cudaStream_t s) {
            if (k > 0)
              with_copy_engine(g, s, rows, k, [&] {
                if (k < rows) push_range_kernel<<<blocks, 1024, 0, s>>>(p, g, rows, k, rows - k, row_int4);
              });
            else
              push_range_kernel<<<blocks, 1024, 0, s>>>(p, g, rows, 0, rows, row_int4);
            CHECK(cudaGetLastError());
          });
          check_dst(rows, "ce+push");
          std::printf("ce+push: %d blocks, copy engine %4d rows, SMs %4d: %.1f us, %.1f GB/s\n", blocks, k, rows - k,
                      us, double(rows) * row_bytes / us * 1e-3);
        }
    return 0;
  }
  if (fence) {
    const int rows = rows_list[0];
    const double bytes = double(ngpus - 1) * rows * row_bytes;
    std::vector<unsigned long long*> stats(ngpus);  // per GPU: releases, total ns, max ns
    for (int g = 0; g < ngpus; ++g) {
      CHECK(cudaSetDevice(g));
      CHECK(cudaMalloc(&stats[g], 3 * sizeof(unsigned long long)));
    }
    const char* names[] = {"push", "push+fence", "bulk", "bulk+fence", "bulk+meta+fence"};
    std::printf("%-16s %6s %6s %7s | %8s %8s | %8s %9s %9s\n", "fence mode", "rows", "blocks", "threads", "us", "GB/s",
                "releases", "mean ns", "max ns");
    for (int rep = 0; rep < 2; ++rep)
      for (int blocks : {12, 24})
        for (int mode = 0; mode < 5; ++mode)
          for (int data_warps : {12, 23}) {
            if (mode >= 2 && data_warps != 12) continue;  // a row buffer per warp: 12 x 14 KB of shared memory
            const int threads = (data_warps + 1) * 32;
            const size_t smem = mode >= 2 ? size_t(data_warps) * row_bytes : 0;
            for (int g = 0; g < ngpus; ++g) {
              CHECK(cudaSetDevice(g));
              CHECK(cudaFuncSetAttribute(fence_kernel, cudaFuncAttributeMaxDynamicSharedMemorySize, int(smem)));
              CHECK(cudaMemset(stats[g], 0, 3 * sizeof(unsigned long long)));
            }
            clear_dst();
            const double us = time_all([&](int g, cudaStream_t s) {
              fence_kernel<<<blocks, threads, smem, s>>>(p, g, ngpus, rows, row_int4, mode, stats[g]);
              CHECK(cudaGetLastError());
            });
            check_dst(rows, names[mode]);
            unsigned long long n = 0, sum = 0, mx = 0;
            for (int g = 0; g < ngpus; ++g) {
              unsigned long long h[3];
              CHECK(cudaSetDevice(g));
              CHECK(cudaMemcpy(h, stats[g], sizeof(h), cudaMemcpyDeviceToHost));
              n += h[0];
              sum += h[1];
              mx = std::max(mx, h[2]);
            }
            std::printf("%-16s %6d %6d %7d | %8.1f %8.1f | %8llu %9.0f %9llu\n", names[mode], rows, blocks, threads, us,
                        bytes / us * 1e-3, n, n ? double(sum) / n : 0.0, mx);
          }
    return 0;
  }
  if (scatter) {
    const Kernel kernels[] = {move_kernel<4>, move_kernel<8>};
    const int us_[] = {4, 8};
    for (int rows : rows_list) {
      const double bytes = double(ngpus - 1) * rows * row_bytes;
      for (int rep = 0; rep < 2; ++rep)
        for (int window : {rows, kWindow})
          for (int blocks : {sms / 2, sms})
            for (int threads : {512, 1024})
              for (int k = 0; k < 2; ++k) {
                clear_dst();
                const double us = time_all([&](int g, cudaStream_t s) {
                  kernels[k]<<<blocks, threads, 0, s>>>(p, g, ngpus, rows, row_int4, 0, window);
                  CHECK(cudaGetLastError());
                });
                check_dst(rows, "push", window);
                std::printf("%-5s %6d %6d %7d %3d | %8.1f %8.1f\n", window == rows ? "push" : "spush", rows, blocks,
                            threads, us_[k], us, bytes / us * 1e-3);
              }
    }
    return 0;
  }
  if (few_sms) {
    const int rows = rows_list[0];
    const double bytes = double(ngpus - 1) * rows * row_bytes;
    const Kernel kernels[] = {move_kernel<4>, move_kernel<8>};
    const int us_[] = {4, 8};
    // Pushes, then pulls (load from the peer, store here).
    for (int pull : {0, 1})
      for (int blocks : {6, 8, 12, 16, 24, 33})
        for (int threads : {512, 768, 1024})
          for (int k = 0; k < 2; ++k) {
            clear_dst();
            const double us = time_all([&](int g, cudaStream_t s) {
              kernels[k]<<<blocks, threads, 0, s>>>(p, g, ngpus, rows, row_int4, pull, rows);
              CHECK(cudaGetLastError());
            });
            const char* mode = pull ? "pull" : "push";
            check_dst(rows, mode);
            std::printf("%-5s %6d %6d %7d %3d | %8.1f %8.1f\n", mode, rows, blocks, threads, us_[k], us,
                        bytes / us * 1e-3);
          }
    for (int blocks : {6, 12, 16, 24, 33})
      for (int threads : {128, 256, 384}) run_bulk(rows, blocks, threads);
    // Pushes and pulls at once: `blocks` blocks push half of the rows while as many more pull the other half on a
    // second stream (the high-throughput kernels' receiver blocks on the links too, not only their sender blocks).
    for (int blocks : {4, 6, 8, 12})
      for (int threads : {512, 768, 1024})
        for (int k = 0; k < 2; ++k) {
          clear_dst();
          const int half = rows / 2;
          const double us = time_all([&](int g, cudaStream_t s) {
            cudaStream_t t = streams[g * kMaxGpus + 1];
            CHECK(cudaStreamWaitEvent(t, ev0[g], 0));
            kernels[k]<<<blocks, threads, 0, t>>>(p, g, ngpus, half, row_int4, 1, half);
            CHECK(cudaGetLastError());
            cudaEvent_t done;
            CHECK(cudaEventCreateWithFlags(&done, cudaEventDisableTiming));
            CHECK(cudaEventRecord(done, t));
            kernels[k]<<<blocks, threads, 0, s>>>(p, g, ngpus, half, row_int4, 0, half);
            CHECK(cudaGetLastError());
            CHECK(cudaStreamWaitEvent(s, done, 0));
            CHECK(cudaEventDestroy(done));
          });
          check_dst(half, "push+pull");
          std::printf("%-5s %6d %6d %7d %3d | %8.1f %8.1f\n", "mix", rows, 2 * blocks, threads, us_[k], us,
                      bytes / us * 1e-3);
        }
    return 0;
  }
  for (int rows : rows_list) {
    const double bytes = double(ngpus - 1) * rows * row_bytes;
    // Copy engines: one stream per peer, pushing.
    {
      clear_dst();
      const double us = time_all([&](int g, cudaStream_t s) {
        cudaEvent_t fork = ev0[g];
        for (int h = 0, i = 1; h < ngpus; ++h) {
          if (h == g) continue;
          cudaStream_t t = streams[g * kMaxGpus + i++];
          CHECK(cudaStreamWaitEvent(t, fork, 0));
          CHECK(cudaMemcpyPeerAsync(p.dst[h] + size_t(g) * rows * row_int4, h, p.src[g] + size_t(h) * rows * row_int4,
                                    g, size_t(rows) * row_bytes, t));
          cudaEvent_t done;
          CHECK(cudaEventCreateWithFlags(&done, cudaEventDisableTiming));
          CHECK(cudaEventRecord(done, t));
          CHECK(cudaStreamWaitEvent(s, done, 0));
          CHECK(cudaEventDestroy(done));
        }
      });
      check_dst(rows, "ce");
      std::printf("%-5s %6d %6s %7s %3s | %8.1f %8.1f\n", "ce", rows, "-", "-", "-", us, bytes / us * 1e-3);
    }
    for (int pull : {0, 1})
      for (int blocks : {sms / 4, sms / 2, sms})
        for (int threads : {128, 256}) run_bulk(rows, blocks, threads, pull);
    const Kernel kernels[] = {move_kernel<1>, move_kernel<2>, move_kernel<4>, move_kernel<8>};
    const int us_[] = {1, 2, 4, 8};
    for (int pull : {0, 1})
      for (int blocks : {sms / 4, sms / 2, sms})
        for (int threads : {128, 512, 1024})
          for (int k = 0; k < 4; ++k) {
            if (threads == 128 && !rows_mode) continue;
            clear_dst();
            const double us = time_all([&](int g, cudaStream_t s) {
              kernels[k]<<<blocks, threads, 0, s>>>(p, g, ngpus, rows, row_int4, pull, rows);
              CHECK(cudaGetLastError());
            });
            check_dst(rows, pull ? "pull" : "push");
            std::printf("%-5s %6d %6d %7d %3d | %8.1f %8.1f\n", pull ? "pull" : "push", rows, blocks, threads, us_[k],
                        us, bytes / us * 1e-3);
          }
  }
  return 0;
}
