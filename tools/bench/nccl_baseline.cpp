#include "nccl_baseline.hpp"

#include <dlfcn.h>
#include <glob.h>

#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <stdexcept>

#if __has_include(<nccl.h>)
#include <nccl.h>
#define EPX_BENCH_HAVE_NCCL_H 1
#else
#define EPX_BENCH_HAVE_NCCL_H 0
#endif

namespace epx::bench {
namespace {

// Where pip and distributions put libnccl.so.2 when it is not on the loader's path.
const char* const kFixedPaths[] = {
    "/usr/local/cuda/lib64/libnccl.so.2",
    "/usr/local/cuda/lib/libnccl.so.2",
};
const char* const kGlobPatterns[] = {
    "/opt/torch/.venv/lib/python3*/site-packages/nvidia/nccl/lib/libnccl.so.2",
    "/usr/local/lib/python3*/dist-packages/nvidia/nccl/lib/libnccl.so.2",
    "/usr/local/lib/python3*/site-packages/nvidia/nccl/lib/libnccl.so.2",
    "/usr/lib/python3/dist-packages/nvidia/nccl/lib/libnccl.so.2",
};

std::vector<std::string> candidate_paths() {
  std::vector<std::string> out;
  if (const char* env = std::getenv("EPX_NCCL_LIB"); env != nullptr && *env != '\0') out.push_back(env);
  out.push_back("libnccl.so.2");
  for (const char* p : kFixedPaths) out.push_back(p);
  for (const char* pattern : kGlobPatterns) {
    glob_t g{};
    if (glob(pattern, 0, nullptr, &g) == 0)
      for (size_t i = 0; i < g.gl_pathc; ++i) out.push_back(g.gl_pathv[i]);
    globfree(&g);
  }
  return out;
}

}  // namespace

#if EPX_BENCH_HAVE_NCCL_H

// Entry points with nccl.h's own signatures (decltype of the declarations: nothing is linked).
struct NcclLibrary::Api {
  decltype(&::ncclGetUniqueId) get_unique_id = nullptr;
  decltype(&::ncclCommInitRank) comm_init_rank = nullptr;
  decltype(&::ncclCommDestroy) comm_destroy = nullptr;
  decltype(&::ncclGroupStart) group_start = nullptr;
  decltype(&::ncclGroupEnd) group_end = nullptr;
  decltype(&::ncclSend) send = nullptr;
  decltype(&::ncclRecv) recv = nullptr;
  decltype(&::ncclGetErrorString) error_string = nullptr;
  decltype(&::ncclGetVersion) get_version = nullptr;  // optional: only for the report header
};

namespace {

// Resolves one required symbol; false (and a note in *missing) when absent.
template <typename Fn>
bool resolve(void* handle, const char* name, Fn* out, std::string* missing) {
  *out = reinterpret_cast<Fn>(dlsym(handle, name));
  if (*out == nullptr) *missing += std::string(missing->empty() ? "" : ", ") + name;
  return *out != nullptr;
}

void check_nccl(const NcclLibrary::Api& api, ncclResult_t r, const char* what) {
  if (r != ncclSuccess) throw std::runtime_error(std::string("NCCL ") + what + ": " + api.error_string(r));
}

}  // namespace

std::unique_ptr<NcclLibrary> NcclLibrary::load(std::string* why) {
  why->clear();
  for (const std::string& path : candidate_paths()) {
    void* h = dlopen(path.c_str(), RTLD_NOW | RTLD_LOCAL);
    if (h == nullptr) {
      const char* e = dlerror();
      *why += "  " + path + ": " + (e ? e : "dlopen failed") + "\n";
      continue;
    }
    auto api = std::make_unique<Api>();
    std::string missing;
    bool ok = true;
    ok &= resolve(h, "ncclGetUniqueId", &api->get_unique_id, &missing);
    ok &= resolve(h, "ncclCommInitRank", &api->comm_init_rank, &missing);
    ok &= resolve(h, "ncclCommDestroy", &api->comm_destroy, &missing);
    ok &= resolve(h, "ncclGroupStart", &api->group_start, &missing);
    ok &= resolve(h, "ncclGroupEnd", &api->group_end, &missing);
    ok &= resolve(h, "ncclSend", &api->send, &missing);
    ok &= resolve(h, "ncclRecv", &api->recv, &missing);
    ok &= resolve(h, "ncclGetErrorString", &api->error_string, &missing);
    if (!ok) {
      *why += "  " + path + ": missing " + missing + "\n";
      dlclose(h);
      continue;
    }
    api->get_version = reinterpret_cast<decltype(api->get_version)>(dlsym(h, "ncclGetVersion"));
    // Report the file actually opened ("libnccl.so.2" says little about which NCCL that was).
    Dl_info info{};
    const bool named = dladdr(reinterpret_cast<void*>(api->get_unique_id), &info) != 0 && info.dli_fname != nullptr;
    return std::unique_ptr<NcclLibrary>(new NcclLibrary(h, named ? info.dli_fname : path, std::move(api)));
  }
  return nullptr;
}

std::string NcclLibrary::version() const {
  int v = 0;
  if (api_->get_version == nullptr || api_->get_version(&v) != ncclSuccess || v <= 0) return "";
  // NCCL >= 2.9 encodes major * 10000 + minor * 100 + patch.
  return std::to_string(v / 10000) + "." + std::to_string(v / 100 % 100) + "." + std::to_string(v % 100);
}

NcclComm::NcclComm(const NcclLibrary& lib, Bootstrap& bs) : lib_(lib), rank_(bs.rank()), size_(bs.size()) {
  const NcclLibrary::Api& api = lib.api();
  // Rank 0 makes the id; everyone learns it, and whether making it worked, from one all-gather.
  struct IdMessage {
    int ok;
    ncclUniqueId id;
  };
  IdMessage mine{};
  std::string error;
  if (rank_ == 0) {
    const ncclResult_t r = api.get_unique_id(&mine.id);
    mine.ok = r == ncclSuccess;
    if (!mine.ok) error = std::string("ncclGetUniqueId: ") + api.error_string(r);
  }
  std::vector<IdMessage> all(size_);
  bs.all_gather(&mine, all.data(), sizeof(IdMessage));
  if (!all[0].ok) throw std::runtime_error(rank_ == 0 ? error : "ncclGetUniqueId failed on rank 0");

  ncclComm_t comm = nullptr;
  const ncclResult_t r = api.comm_init_rank(&comm, size_, all[0].id, rank_);
  const int ok = r == ncclSuccess;
  std::vector<int> oks(size_);
  bs.all_gather(&ok, oks.data(), sizeof(int));
  for (int j = 0; j < size_; ++j) {
    if (oks[j]) continue;
    if (ok) api.comm_destroy(comm);
    throw std::runtime_error(ok ? "ncclCommInitRank failed on rank " + std::to_string(j)
                                : std::string("ncclCommInitRank: ") + api.error_string(r));
  }
  comm_ = comm;
}

NcclComm::~NcclComm() {
  if (comm_ != nullptr) lib_.api().comm_destroy(static_cast<ncclComm_t>(comm_));
}

void NcclComm::all_to_all(const void* send, const std::vector<size_t>& send_bytes, void* recv,
                          const std::vector<size_t>& recv_bytes, cudaStream_t stream) {
  const NcclLibrary::Api& api = lib_.api();
  auto comm = static_cast<ncclComm_t>(comm_);
  const auto* s = static_cast<const uint8_t*>(send);
  auto* d = static_cast<uint8_t*>(recv);
  check_nccl(api, api.group_start(), "ncclGroupStart");
  // One group: NCCL schedules all 2R transfers together (a send to self is a local copy).
  for (int j = 0; j < size_; ++j) {
    check_nccl(api, api.send(s, send_bytes[j], ncclUint8, j, comm, stream), "ncclSend");
    check_nccl(api, api.recv(d, recv_bytes[j], ncclUint8, j, comm, stream), "ncclRecv");
    s += send_bytes[j];
    d += recv_bytes[j];
  }
  check_nccl(api, api.group_end(), "ncclGroupEnd");
}

#else  // no nccl.h at build time: the baseline reports itself unavailable

struct NcclLibrary::Api {};

std::unique_ptr<NcclLibrary> NcclLibrary::load(std::string* why) {
  *why = "  epx-bench was built without nccl.h\n";
  return nullptr;
}
std::string NcclLibrary::version() const { return ""; }
NcclComm::NcclComm(const NcclLibrary& lib, Bootstrap& bs) : lib_(lib), rank_(bs.rank()), size_(bs.size()) {
  throw std::runtime_error("epx-bench was built without nccl.h");
}
NcclComm::~NcclComm() = default;
void NcclComm::all_to_all(const void*, const std::vector<size_t>&, void*, const std::vector<size_t>&, cudaStream_t) {}

#endif

NcclLibrary::NcclLibrary(void* handle, std::string path, std::unique_ptr<Api> api)
    : handle_(handle), path_(std::move(path)), api_(std::move(api)) {}

// The library stays loaded until the process exits: NCCL registers exit-time handlers and may keep helper
// threads, which must not find their code unmapped.
NcclLibrary::~NcclLibrary() = default;

}  // namespace epx::bench
