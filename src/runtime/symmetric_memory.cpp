#include "runtime/symmetric_memory.hpp"

#include <nvshmem.h>
#include <nvshmemx.h>

#include <cstdlib>
#include <mutex>
#include <string>
#include <vector>

#include "epx/epx.hpp"
#include "runtime/errors.hpp"
#include "runtime/transport.hpp"

namespace epx {
namespace {

constexpr const char* kHint = "; EPX_DISABLE_NVSHMEM=1 keeps the low-latency region in the CUDA IPC buffer instead";

std::mutex g_mutex;  // Buffers may be created from several threads of one process
int g_regions = 0;   // live regions: NVSHMEM is initialised while > 0
int g_pe = -1, g_num_pes = 0;

struct RankResult {
  int32_t status;
  int32_t pe;
  int32_t num_pes;
};

// All-gathers every rank's result; returns the first rank whose status is nonzero, or -1.
int first_failure(Bootstrap& bs, const RankResult& mine, std::vector<RankResult>& all) {
  all.assign(size_t(bs.size()), RankResult{});
  bs.all_gather(&mine, all.data(), sizeof(RankResult));
  for (int r = 0; r < bs.size(); ++r)
    if (all[r].status != 0) return r;
  return -1;
}

void initialise(Bootstrap& bs, int64_t first_region_bytes) {
  const int rank = bs.rank(), size = bs.size();
  // Read by NVSHMEM at initialisation; values the user set win.
  setenv("NVSHMEM_SYMMETRIC_SIZE", std::to_string(nvshmem_heap_bytes(first_region_bytes)).c_str(), 0);
  setenv("NVSHMEM_DISABLE_NVLS", "1", 0);  // no NVLink multicast: it can put a shared host out of service

  struct UniqueId {
    int32_t status;
    nvshmemx_uniqueid_t id;
  };
  UniqueId mine{0, NVSHMEMX_UNIQUEID_INITIALIZER};
  if (rank == 0) mine.status = nvshmemx_get_uniqueid(&mine.id);
  std::vector<UniqueId> ids(size_t(size), mine);
  bs.all_gather(&mine, ids.data(), sizeof(UniqueId));
  if (ids[0].status != 0)
    raise(Status::kNotSupported, "NVSHMEM: nvshmemx_get_uniqueid failed on rank 0 with status ", ids[0].status, kHint);

  nvshmemx_init_attr_t attr = NVSHMEMX_INIT_ATTR_INITIALIZER;
  RankResult result{};
  result.status = nvshmemx_set_attr_uniqueid_args(rank, size, &ids[0].id, &attr);
  if (result.status == 0) {
    // nvshmemx_init_attr() calls exit() when initialisation fails; call what it calls instead, so that a
    // failure becomes an error every rank reports. This also sets up the device state of the kernels linked
    // into libepx.so (libnvshmem_device.a's part of the initialisation).
    nvshmemx_init_init_attr_ver_only(attr);
    const nvshmemi_version_t version{NVSHMEM_VENDOR_MAJOR_VERSION, NVSHMEM_VENDOR_MINOR_VERSION,
                                     NVSHMEM_VENDOR_PATCH_VERSION};
    int provided = 0;
    result.status =
        nvshmemi_init_thread(NVSHMEM_THREAD_SERIALIZED, &provided, NVSHMEMX_INIT_WITH_UNIQUEID, &attr, version);
  }
  if (result.status == 0) {
    result.pe = nvshmem_my_pe();
    result.num_pes = nvshmem_n_pes();
  }
  std::vector<RankResult> all;
  const int failed = first_failure(bs, result, all);
  if (failed >= 0)
    // Ranks whose initialisation succeeded stay initialised: finalising is collective, and the failed rank
    // cannot take part. NVSHMEM_DEBUG=INFO says more.
    raise(Status::kNotSupported, "NVSHMEM initialisation failed on rank ", failed, " with status ", all[failed].status,
          " (NVSHMEM_DEBUG=INFO shows why)", kHint);
  for (int r = 0; r < size; ++r) {
    if (all[r].pe == r && all[r].num_pes == size) continue;
    // NVSHMEM was already initialised in this process with another set of ranks (it keeps its first
    // bootstrap across finalize and re-init). Undo our reference and report.
    nvshmem_finalize();
    raise(Status::kNotSupported, "NVSHMEM: rank ", r, " became PE ", all[r].pe, " of ", all[r].num_pes,
          " instead of PE ", r, " of ", size, ": this process initialised NVSHMEM before with other ranks", kHint);
  }
  g_pe = rank;
  g_num_pes = size;
}

}  // namespace

void* symmetric_alloc(Bootstrap& bs, int64_t bytes) {
  std::lock_guard<std::mutex> lock(g_mutex);
  // Every rank holds the same number of regions (creation and destruction are collective), so every rank
  // takes the same branch.
  if (g_regions == 0) {
    initialise(bs, bytes);
  } else if (g_pe != bs.rank() || g_num_pes != bs.size()) {
    raise(Status::kNotSupported, "NVSHMEM is in use by another buffer of this process as PE ", g_pe, " of ", g_num_pes,
          "; a buffer over rank ", bs.rank(), " of ", bs.size(), " cannot share it", kHint);
  }
  void* region = nvshmem_malloc(size_t(bytes));  // collective
  std::vector<RankResult> all;
  const int failed = first_failure(bs, RankResult{region == nullptr ? 1 : 0, 0, 0}, all);
  if (failed < 0) {
    ++g_regions;
    return region;
  }
  // A rank that got memory keeps it (freeing is collective; the failed rank would not join).
  if (g_regions == 0 && region == nullptr) {
    bool none = true;
    for (const RankResult& r : all) none &= r.status != 0;
    if (none) nvshmem_finalize();  // nobody holds anything: leave NVSHMEM as we found it
  }
  const char* size_env = std::getenv("NVSHMEM_SYMMETRIC_SIZE");
  raise(Status::kBufferTooSmall, "NVSHMEM: nvshmem_malloc of ", bytes, " bytes failed on rank ", failed,
        " (the symmetric heap is NVSHMEM_SYMMETRIC_SIZE = ", size_env ? size_env : "?",
        " bytes per GPU, fixed when NVSHMEM was initialised: set it larger for several or larger buffers)", kHint);
}

void symmetric_free(void* region, bool usable) {
  std::lock_guard<std::mutex> lock(g_mutex);
  if (g_regions <= 0) return;
  --g_regions;
  if (!usable) return;
  nvshmem_free(region);  // collective (a barrier over the PEs)
  if (g_regions == 0) {
    nvshmem_finalize();
    g_pe = -1;
    g_num_pes = 0;
  }
}

void* symmetric_peer_pointer(void* region, int rank) { return nvshmem_ptr(region, rank); }

}  // namespace epx
