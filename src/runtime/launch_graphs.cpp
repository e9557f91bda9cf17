#include "runtime/launch_graphs.hpp"

#include <cstring>

namespace epx {

LaunchGraphs::LaunchGraphs(Destroy destroy) : destroy_(destroy) {}

LaunchGraphs::~LaunchGraphs() { clear(); }

bool LaunchGraphs::matches(const Entry& e, const Key& k) const {
  return e.last_use != 0 && e.func == k.func && e.grid == k.grid && e.threads == k.threads && e.smem == k.smem &&
         e.params.size() == k.params_bytes && std::memcmp(e.params.data(), k.params, k.params_bytes) == 0;
}

void LaunchGraphs::free_graph(Entry& e) {
  if (e.exec != nullptr && destroy_ != nullptr) destroy_(e.exec);
  e.exec = nullptr;
}

LaunchGraphs::Found LaunchGraphs::find(const Key& k) {
  if (!on_) return {Step::kPlain, -1};
  int oldest = 0;
  for (int i = 0; i < kEntries; ++i) {
    Entry& e = entries_[i];
    if (matches(e, k)) {
      e.last_use = ++clock_;
      if (e.exec != nullptr) return {Step::kLaunch, i};
      return {builds_ < kMaxBuilds ? Step::kBuild : Step::kPlain, i};
    }
    if (e.last_use < entries_[oldest].last_use) oldest = i;
  }
  Entry& e = entries_[oldest];  // an empty entry (last_use 0) if there is one
  free_graph(e);
  e.func = k.func;
  e.grid = k.grid;
  e.threads = k.threads;
  e.smem = k.smem;
  const auto* bytes = static_cast<const uint8_t*>(k.params);
  e.params.assign(bytes, bytes + k.params_bytes);
  e.last_use = ++clock_;
  return {Step::kPlain, oldest};
}

void LaunchGraphs::built(int entry, Exec exec) {
  ++builds_;
  if (exec == nullptr) return turn_off();
  entries_[entry].exec = exec;
}

void LaunchGraphs::turn_off() {
  on_ = false;
  clear();
}

void LaunchGraphs::clear() {
  for (Entry& e : entries_) {
    free_graph(e);
    e.last_use = 0;
    e.params.clear();
  }
}

}  // namespace epx
