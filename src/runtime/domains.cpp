#include "runtime/domains.hpp"

#include <unistd.h>

#include <cstdlib>
#include <cstring>

#include "layout/limits.hpp"
#include "runtime/errors.hpp"
#include "runtime/transport.hpp"

namespace epx {
namespace {

constexpr uint32_t kMagic = 0x65706432;  // "epd2"

struct Request {
  uint32_t magic;
  int32_t num_nvl_ranks;
  int32_t force;
  char hostname[64];
};

int requested_from_env() {
  const char* v = std::getenv("EPX_NUM_NVL_RANKS");
  if (v == nullptr || v[0] == '\0') return 0;
  char* end = nullptr;
  const long n = std::strtol(v, &end, 10);
  if (end == v || *end != '\0' || n < 1 || n > kMaxNvlRanks)
    raise(Status::kInvalidArgument, "EPX_NUM_NVL_RANKS must be an integer in [1, ", kMaxNvlRanks, "], got '", v, "'");
  return int(n);
}

}  // namespace

void validate_requested_nvl_ranks(int num_ranks, int requested, const char* op) {
  EPX_REQUIRE(requested >= 0, op, ": num_nvl_ranks must be >= 0 (0: from $EPX_NUM_NVL_RANKS or the hosts), got ",
              requested);
  if (requested == 0) return;
  EPX_REQUIRE(requested <= kMaxNvlRanks, op, ": an NVLink domain holds at most ", kMaxNvlRanks,
              " ranks, got num_nvl_ranks ", requested);
  EPX_REQUIRE(num_ranks % requested == 0, op, ": num_nvl_ranks (", requested, ") must divide the number of ranks (",
              num_ranks, ")");
}

DomainChoice choose_domains(const std::vector<std::string>& hosts, int requested, bool force) {
  const int R = int(hosts.size());
  EPX_REQUIRE(R >= 1, "no ranks");
  DomainChoice c;
  validate_requested_nvl_ranks(R, requested, "Buffer");
  if (requested > 0) {
    c.num_nvl_ranks = requested;
  } else {
    int g = 1;
    while (g < R && hosts[g] == hosts[0]) ++g;
    for (int r = 0; r < R; ++r) {
      const int first = r / g * g;
      EPX_REQUIRE(R % g == 0 && hosts[r] == hosts[first] && (r % g != 0 || r == 0 || hosts[r] != hosts[r - 1]),
                  "the ranks of one host must be consecutive and every host must hold the same number of them (rank ",
                  r, " is on '", hosts[r],
                  "'); set num_nvl_ranks (or EPX_NUM_NVL_RANKS) to say how ranks form domains");
    }
    EPX_REQUIRE(g <= kMaxNvlRanks, g, " ranks share host '", hosts[0], "' but an NVLink domain holds at most ",
                kMaxNvlRanks, ": set num_nvl_ranks (or EPX_NUM_NVL_RANKS)");
    c.num_nvl_ranks = g;
  }
  c.internode = force || c.num_nvl_ranks < R;
  return c;
}

DomainChoice choose_domains(Bootstrap& bs, const BufferOptions& options) {
  Request mine{};
  mine.magic = kMagic;
  validate_requested_nvl_ranks(bs.size(), options.num_nvl_ranks, "Buffer");  // before the collective
  mine.num_nvl_ranks = options.num_nvl_ranks > 0 ? options.num_nvl_ranks : requested_from_env();
  mine.force =
      options.force_internode != 0 || parse_env_switch("EPX_FORCE_INTERNODE", std::getenv("EPX_FORCE_INTERNODE"));
  gethostname(mine.hostname, sizeof(mine.hostname) - 1);
  std::vector<Request> all(size_t(bs.size()));
  bs.all_gather(&mine, all.data(), sizeof(Request));
  std::vector<std::string> hosts;
  for (int r = 0; r < bs.size(); ++r) {
    const Request& q = all[r];
    EPX_REQUIRE(q.magic == kMagic, "bootstrap all-gather returned garbage for rank ", r,
                " (is every rank creating a Buffer at the same time, with the same library version?)");
    EPX_REQUIRE(q.num_nvl_ranks == mine.num_nvl_ranks && q.force == mine.force,
                "ranks disagree on the NVLink domains: rank ", r, " asked for num_nvl_ranks ", q.num_nvl_ranks,
                q.force ? " (internode forced)" : "", ", rank ", bs.rank(), " for ", mine.num_nvl_ranks,
                mine.force ? " (internode forced)" : "",
                " (options and EPX_NUM_NVL_RANKS / EPX_FORCE_INTERNODE must be "
                "the same on every rank)");
    hosts.emplace_back(q.hostname, strnlen(q.hostname, sizeof(q.hostname)));
  }
  return choose_domains(hosts, mine.num_nvl_ranks, mine.force != 0);
}

}  // namespace epx
