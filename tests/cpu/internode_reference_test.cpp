// The reference model of the internode (hierarchical) mode, semantics.md section 6: channels, the internode handle and
// the two-level combine order. The handle is checked against a hand-worked example, against a recount written
// differently (per-channel token lists, every prefix summed from its definition) and for consistency across the
// ranks of one dispatch; the combine against the flat combine where the two orders must agree, and against hand
// values where they differ.
#include <gtest/gtest.h>

#include <algorithm>
#include <cstring>
#include <random>
#include <stdexcept>
#include <string>
#include <vector>

#include "epx/reference.hpp"

namespace ref = epx::ref;

namespace {

// Tokens of channel c when T tokens are split over C channels, as the device's ChannelRange splits them:
// [c * per, min((c + 1) * per, T)) with per = ceil(T / C).
std::vector<int> channel_tokens(int T, int C, int c) {
  const int per = (T + C - 1) / C;
  std::vector<int> tokens;
  for (int t = std::min(c * per, T); t < std::min((c + 1) * per, T); ++t) tokens.push_back(t);
  return tokens;
}

// One dispatch: every rank's top-k routing and is_token_in_rank, random but reproducible.
struct Routing {
  int R = 0, G = 0, D = 0;
  std::vector<std::vector<int64_t>> topk;     // per rank, [T, K]
  std::vector<std::vector<uint8_t>> in_rank;  // per rank, [T, R]
  std::vector<std::vector<int>> per_rdma;     // per rank, dispatch_layout's num_tokens_per_rdma_rank
  std::vector<ref::Source> sources;
  bool in(int s, int t, int j) const { return in_rank[s][size_t(t) * R + j] != 0; }
  bool needs(int s, int t, int m) const {
    for (int j = m * G; j < (m + 1) * G; ++j)
      if (in(s, t, j)) return true;
    return false;
  }
  int tokens(int s) const { return sources[s].num_tokens; }
};

// Rank r has tokens[r % tokens.size()] tokens. Each token has K = min(4, E) slots over E = 2R experts: a slot is
// -1 with probability 1/4 and no expert appears twice in a token; one token in ten is routed nowhere.
Routing make_routing(int D, int G, const std::vector<int>& tokens, uint32_t seed) {
  Routing x;
  x.D = D;
  x.G = G;
  x.R = D * G;
  const int E = 2 * x.R, K = std::min(4, E);
  std::mt19937 rng(seed);
  for (int r = 0; r < x.R; ++r) {
    const int T = tokens[r % tokens.size()];
    std::vector<int64_t> idx(size_t(T) * K, -1);
    for (int t = 0; t < T; ++t) {
      if (rng() % 10 == 0) continue;
      for (int k = 0; k < K; ++k) {
        if (rng() % 4 == 0) continue;
        int64_t e;
        do e = int64_t(rng() % E);
        while (std::find(idx.begin() + t * K, idx.begin() + t * K + k, e) != idx.begin() + t * K + k);
        idx[size_t(t) * K + k] = e;
      }
    }
    const ref::Layout layout = ref::dispatch_layout(idx.data(), T, K, E, x.R, G);
    x.topk.push_back(std::move(idx));
    x.in_rank.push_back(layout.is_token_in_rank);
    x.per_rdma.push_back(layout.num_tokens_per_rdma_rank);
  }
  for (int r = 0; r < x.R; ++r)
    x.sources.push_back({int(x.in_rank[r].size()) / x.R, x.in_rank[r].data(), x.topk[r].data(), nullptr});
  return x;
}

struct Case {
  int D, G;
  std::vector<int> tokens;  // per rank, cycled
};

// Token counts include 0, 1, counts below and above the channel counts, and ones that C does not divide.
const std::vector<Case>& cases() {
  static const std::vector<Case> all = {
      {2, 1, {0, 13}},
      {2, 1, {1, 30}},
      {2, 1, {7, 5}},
      {1, 2, {13, 0}},
      {1, 2, {30, 1}},
      {2, 2, {0, 1, 7, 13}},
      {2, 2, {30, 5, 2, 0}},
      {4, 2, {0, 1, 7, 13, 2, 30, 5, 11}},
      {2, 4, {13, 0, 30, 1, 5, 7, 2, 12}},
      {16, 8, {0, 1, 3, 5, 2}},
  };
  return all;
}
const int kChannels[] = {1, 3, 12};

std::string where(const Case& k, int C, int rank) {
  return std::to_string(k.D) + "x" + std::to_string(k.G) + " C=" + std::to_string(C) + " rank " + std::to_string(rank);
}

// The handle of `rank`, recounted from the definitions: per-channel token lists, every "channels <= c" prefix
// summed over those channels, every position counted over the tokens before it.
ref::InternodeHandle recount(const Routing& x, int rank, int C) {
  const int R = x.R, G = x.G, D = x.D, d = rank / G, g = rank % G;
  const auto list = [&](int s, int c) { return channel_tokens(x.tokens(s), C, c); };
  // Tokens of source s in channels [c0, c1) with pred(s, t).
  const auto count = [&](int s, int c0, int c1, auto pred) {
    int n = 0;
    for (int c = c0; c < c1; ++c)
      for (int t : list(s, c)) n += pred(s, t) ? 1 : 0;
    return n;
  };
  ref::InternodeHandle h;
  for (int m = 0; m < D; ++m)
    for (int c = 0; c < C; ++c)
      h.rdma_channel_prefix_matrix.push_back(count(rank, 0, c + 1, [&](int s, int t) { return x.needs(s, t, m); }));
  for (int j = 0; j < R; ++j)
    for (int c = 0; c < C; ++c)
      h.gbl_channel_prefix_matrix.push_back(count(rank, 0, c + 1, [&](int s, int t) { return x.in(s, t, j); }));
  const auto needs_d = [&](int s, int t) { return x.needs(s, t, d); };
  for (int m = 0; m < D; ++m)
    for (int c = 0; c < C; ++c) h.recv_rdma_channel_prefix_matrix.push_back(count(m * G + g, 0, c + 1, needs_d));
  for (int m = 0; m < D; ++m) {
    int n = 0;
    for (int mm = 0; mm <= m; ++mm) n += count(mm * G + g, 0, C, needs_d);
    h.recv_rdma_rank_prefix_sum.push_back(n);
  }
  const auto to_rank = [&](int s, int t) { return x.in(s, t, rank); };
  for (int s = 0; s < R; ++s)
    for (int c = 0; c < C; ++c) {
      int n = count(s, 0, c, to_rank);
      for (int ss = 0; ss < s; ++ss) n += count(ss, 0, C, to_rank);
      h.recv_gbl_channel_prefix_matrix.push_back(n);
    }
  for (int s = 0; s < R; ++s) {
    int n = 0;
    for (int ss = 0; ss <= s; ++ss) n += count(ss, 0, C, to_rank);
    h.recv_gbl_rank_prefix_sum.push_back(n);
  }
  for (int s = 0; s < R; ++s)
    for (int t = 0; t < x.tokens(s); ++t) {
      if (!x.in(s, t, rank)) continue;
      int mask = 0;
      for (int j = 0; j < G; ++j) mask += x.in(s, t, d * G + j) ? (1 << j) : 0;
      h.recv_src_meta.push_back(s / G);
      h.recv_src_meta.push_back(mask);
    }
  // [8], [9]: k is the number of the channel's tokens before t that are in the stream.
  const auto head = [](bool in, int k) { return in ? k : -k - 1; };
  h.send_rdma_head.assign(size_t(x.tokens(rank)) * D, 0);
  for (int c = 0; c < C; ++c) {
    const std::vector<int> l = list(rank, c);
    for (size_t i = 0; i < l.size(); ++i)
      for (int m = 0; m < D; ++m) {
        int k = 0;
        for (size_t p = 0; p < i; ++p) k += x.needs(rank, l[p], m) ? 1 : 0;
        h.send_rdma_head[size_t(l[i]) * D + m] = head(x.needs(rank, l[i], m), k);
      }
  }
  for (int m = 0; m < D; ++m)
    for (int c = 0; c < C; ++c) {
      const int s = m * G + g;
      const std::vector<int> l = list(s, c);
      for (size_t i = 0; i < l.size(); ++i) {
        if (!x.needs(s, l[i], d)) continue;
        for (int j = 0; j < G; ++j) {
          int k = 0;
          for (size_t p = 0; p < i; ++p) k += x.in(s, l[p], d * G + j) ? 1 : 0;
          h.send_nvl_head.push_back(head(x.in(s, l[i], d * G + j), k));
        }
      }
    }
  return h;
}

void expect_same(const ref::InternodeHandle& got, const ref::InternodeHandle& want, const std::string& at) {
  EXPECT_EQ(got.rdma_channel_prefix_matrix, want.rdma_channel_prefix_matrix) << at << " [1]";
  EXPECT_EQ(got.gbl_channel_prefix_matrix, want.gbl_channel_prefix_matrix) << at << " [2]";
  EXPECT_EQ(got.recv_rdma_channel_prefix_matrix, want.recv_rdma_channel_prefix_matrix) << at << " [3]";
  EXPECT_EQ(got.recv_rdma_rank_prefix_sum, want.recv_rdma_rank_prefix_sum) << at << " [4]";
  EXPECT_EQ(got.recv_gbl_channel_prefix_matrix, want.recv_gbl_channel_prefix_matrix) << at << " [5]";
  EXPECT_EQ(got.recv_gbl_rank_prefix_sum, want.recv_gbl_rank_prefix_sum) << at << " [6]";
  EXPECT_EQ(got.recv_src_meta, want.recv_src_meta) << at << " [7]";
  EXPECT_EQ(got.send_rdma_head, want.send_rdma_head) << at << " [8]";
  EXPECT_EQ(got.send_nvl_head, want.send_nvl_head) << at << " [9]";
}

// The handles of all ranks of one dispatch must describe the same traffic.
void check_consistency(const Routing& x, int C, const std::vector<ref::InternodeHandle>& h, const std::string& at) {
  const int R = x.R, G = x.G, D = x.D;
  for (int r = 0; r < R; ++r) {
    const int d = r / G, g = r % G;
    const ref::InternodeHandle& mine = h[r];
    ASSERT_EQ(mine.rdma_channel_prefix_matrix.size(), size_t(D) * C) << at;
    ASSERT_EQ(mine.gbl_channel_prefix_matrix.size(), size_t(R) * C) << at;
    ASSERT_EQ(mine.recv_rdma_channel_prefix_matrix.size(), size_t(D) * C) << at;
    ASSERT_EQ(mine.recv_rdma_rank_prefix_sum.size(), size_t(D)) << at;
    ASSERT_EQ(mine.recv_gbl_channel_prefix_matrix.size(), size_t(R) * C) << at;
    ASSERT_EQ(mine.recv_gbl_rank_prefix_sum.size(), size_t(R)) << at;
    ASSERT_EQ(mine.send_rdma_head.size(), size_t(x.tokens(r)) * D) << at;
    // [1] of the sender (m, g), row d, is [3] here, row m.
    for (int m = 0; m < D; ++m)
      for (int c = 0; c < C; ++c)
        EXPECT_EQ(h[m * G + g].rdma_channel_prefix_matrix[size_t(d) * C + c],
                  mine.recv_rdma_channel_prefix_matrix[size_t(m) * C + c])
            << at << " rank " << r << " m " << m << " c " << c;
    // [2] of every sender s, row r, per channel, is the number of rows [5] and [6] reserve for (s, c) here.
    for (int s = 0; s < R; ++s)
      for (int c = 0; c < C; ++c) {
        const std::vector<int>& sent = h[s].gbl_channel_prefix_matrix;
        const int sent_in_c = sent[size_t(r) * C + c] - (c > 0 ? sent[size_t(r) * C + c - 1] : 0);
        const int begin = mine.recv_gbl_channel_prefix_matrix[size_t(s) * C + c];
        const int end =
            c + 1 < C ? mine.recv_gbl_channel_prefix_matrix[size_t(s) * C + c + 1] : mine.recv_gbl_rank_prefix_sum[s];
        EXPECT_EQ(end - begin, sent_in_c) << at << " rank " << r << " source " << s << " c " << c;
      }
    // [5] is the intranode recv_channel_prefix_matrix: rows of lower sources, then of lower channels.
    const std::vector<int> prefix = ref::rank_prefix_matrix(x.sources);
    for (int s = 0; s < R; ++s) {
      int row = s > 0 ? prefix[size_t(s - 1) * R + r] : 0;
      for (int c = 0; c < C; ++c) {
        EXPECT_EQ(mine.recv_gbl_channel_prefix_matrix[size_t(s) * C + c], row) << at << " rank " << r << " s " << s;
        for (int t : channel_tokens(x.tokens(s), C, c)) row += x.in(s, t, r) ? 1 : 0;
      }
    }
    // [6] ends at the number of recv rows; [7] has one (source domain, mask) pair per recv row.
    const std::vector<ref::RecvRow> rows = ref::recv_rows(x.sources, r);
    EXPECT_EQ(mine.recv_gbl_rank_prefix_sum[R - 1], int(rows.size())) << at << " rank " << r;
    ASSERT_EQ(mine.recv_src_meta.size(), rows.size() * 2) << at << " rank " << r;
    for (size_t n = 0; n < rows.size(); ++n) {
      EXPECT_EQ(mine.recv_src_meta[2 * n], rows[n].src_rank / G) << at << " rank " << r << " row " << n;
      const uint32_t mask = uint32_t(mine.recv_src_meta[2 * n + 1]);
      for (int j = 0; j < 32; ++j)
        EXPECT_EQ((mask >> j) & 1u, j < G && x.in(rows[n].src_rank, rows[n].src_token, d * G + j) ? 1u : 0u)
            << at << " rank " << r << " row " << n << " bit " << j;
      EXPECT_NE(mask & (1u << (r % G)), 0u) << "a recv row goes to this rank";
    }
    // [4] ends at the number of [9] records. Walk the network-received order through the senders' [8]: every
    // record is reached once, and its [9] entries are the positions counted directly.
    const int records = mine.recv_rdma_rank_prefix_sum[D - 1];
    ASSERT_EQ(mine.send_nvl_head.size(), size_t(records) * G) << at << " rank " << r;
    std::vector<int> seen(records, 0);
    for (int m = 0; m < D; ++m) {
      const int s = m * G + g;
      const int* rdma = mine.recv_rdma_channel_prefix_matrix.data() + size_t(m) * C;
      for (int c = 0; c < C; ++c) {
        const std::vector<int> l = channel_tokens(x.tokens(s), C, c);
        for (size_t i = 0; i < l.size(); ++i) {
          const int pos = h[s].send_rdma_head[size_t(l[i]) * D + d];
          EXPECT_EQ(pos >= 0, x.needs(s, l[i], d)) << at << " source " << s << " token " << l[i];
          if (pos < 0) continue;
          const int idx = (m > 0 ? mine.recv_rdma_rank_prefix_sum[m - 1] : 0) + (c > 0 ? rdma[c - 1] : 0) + pos;
          ASSERT_GE(idx, 0);
          ASSERT_LT(idx, records) << at << " rank " << r;
          ++seen[idx];
          for (int j = 0; j < G; ++j) {
            int k = 0;
            for (size_t p = 0; p < i; ++p) k += x.in(s, l[p], d * G + j) ? 1 : 0;
            EXPECT_EQ(mine.send_nvl_head[size_t(idx) * G + j], x.in(s, l[i], d * G + j) ? k : -k - 1)
                << at << " rank " << r << " record " << idx << " j " << j;
          }
        }
      }
    }
    EXPECT_EQ(seen, std::vector<int>(records, 1)) << at << " rank " << r;
  }
}

}  // namespace

// ---- channels and domain masks ------------------------------------------------------------------------------------

TEST(InternodeChannel, MatchesTheDeviceSplit) {
  for (int T = 1; T <= 64; ++T)
    for (int C = 1; C <= 20; ++C) {
      int covered = 0;
      for (int c = 0; c < C; ++c)
        for (int t : channel_tokens(T, C, c)) {
          EXPECT_EQ(ref::channel_of(T, C, t), c) << "T " << T << " C " << C << " t " << t;
          ++covered;
        }
      EXPECT_EQ(covered, T);
    }
  // per = ceil(T / C): T 5, C 3 is {0, 1} {2, 3} {4}; T 4, C 3 is {0, 1} {2, 3} {} (the last channel empty).
  EXPECT_EQ(ref::channel_of(5, 3, 4), 2);
  EXPECT_EQ(ref::channel_of(4, 3, 3), 1);
  EXPECT_EQ(ref::channel_of(1, 12, 0), 0);
  EXPECT_EQ(ref::channel_of(30, 12, 29), 9);  // per 3: channels 10 and 11 are empty
  EXPECT_THROW(ref::channel_of(0, 3, 0), std::invalid_argument);
  EXPECT_THROW(ref::channel_of(4, 0, 0), std::invalid_argument);
  EXPECT_THROW(ref::channel_of(4, 3, 4), std::invalid_argument);
}

TEST(InternodeDomainMask, BitJIsRankMTimesGPlusJ) {
  const std::vector<uint8_t> in = {0, 1, 0, 1, 1, 0, 0, 1,   // t0
                                   0, 0, 0, 0, 0, 0, 1, 0};  // t1
  const ref::Source src{2, in.data(), nullptr, nullptr};
  EXPECT_EQ(ref::domain_mask(src, 8, 4, 0, 0), 0xau);
  EXPECT_EQ(ref::domain_mask(src, 8, 4, 0, 1), 0x9u);
  EXPECT_EQ(ref::domain_mask(src, 8, 4, 1, 0), 0x0u);
  EXPECT_EQ(ref::domain_mask(src, 8, 4, 1, 1), 0x4u);
  EXPECT_EQ(ref::domain_mask(src, 8, 2, 0, 3), 0x2u);  // ranks 6, 7
  EXPECT_EQ(ref::domain_mask(src, 8, 1, 0, 4), 0x1u);  // one GPU per domain
}

// ---- the internode handle ------------------------------------------------------------------------------------------

namespace {

// D 2, G 2, C 2. Rank 3 has no tokens.
//   source 0 (T 3; channels {t0, t1} {t2}): t0 -> ranks {1, 2}, t1 -> {3}, t2 -> {0, 1}
//   source 1 (T 1; channels {t0} {}):       t0 -> {0, 2, 3}
//   source 2 (T 4; channels {t0, t1} {t2, t3}): t0 -> {}, t1 -> {0, 3}, t2 -> {2}, t3 -> {1, 2}
struct HandDispatch {
  std::vector<uint8_t> in0 = {0, 1, 1, 0, 0, 0, 0, 1, 1, 1, 0, 0};
  std::vector<uint8_t> in1 = {1, 0, 1, 1};
  std::vector<uint8_t> in2 = {0, 0, 0, 0, 1, 0, 0, 1, 0, 0, 1, 0, 0, 1, 1, 0};
  std::vector<ref::Source> sources() const {
    return {{3, in0.data(), nullptr, nullptr},
            {1, in1.data(), nullptr, nullptr},
            {4, in2.data(), nullptr, nullptr},
            {0, nullptr, nullptr, nullptr}};
  }
};

}  // namespace

TEST(InternodeHandle, HandWorkedExample) {
  const HandDispatch x;
  ref::InternodeHandle want;
  // Rank 0 = (0, 0). It receives records from sources 0 and 2 (the g = 0 rank of each domain).
  want.rdma_channel_prefix_matrix = {1, 2,   // domain 0: t0 | t2
                                     2, 2};  // domain 1: t0, t1 | -
  want.gbl_channel_prefix_matrix = {0, 1, 1, 2, 1, 1, 1, 1};
  want.recv_rdma_channel_prefix_matrix = {1, 2,   // source 0: t0 | t2
                                          1, 2};  // source 2: t1 | t3
  want.recv_rdma_rank_prefix_sum = {2, 4};
  want.recv_gbl_channel_prefix_matrix = {0, 0,   // source 0: t2 in channel 1
                                         1, 2,   // source 1: t0
                                         2, 3,   // source 2: t1
                                         3, 3};  // source 3: nothing
  want.recv_gbl_rank_prefix_sum = {1, 2, 3, 3};
  // Rows (source 0, t2) -> ranks 0 and 1; (1, t0) -> rank 0; (2, t1) -> rank 0.
  want.recv_src_meta = {0, 3, 0, 1, 1, 1};
  want.send_rdma_head = {0,  0,    // t0 needs both
                         -2, 1,    // t1: not domain 0, after one token that was
                         0,  -1};  // t2, first of channel 1
  want.send_nvl_head = {-1, 0,     // source 0 t0 -> rank 1
                        0,  0,     // source 0 t2 -> ranks 0, 1
                        0,  -1,    // source 2 t1 -> rank 0
                        -1, 0};    // source 2 t3 -> rank 1
  expect_same(ref::internode_handle(x.sources(), 0, 2, 2), want, "rank 0");

  // Rank 2 = (1, 0).
  want.rdma_channel_prefix_matrix = {1, 2,   // domain 0: t1 | t3
                                     1, 3};  // domain 1: t1 | t2, t3
  want.gbl_channel_prefix_matrix = {1, 1, 0, 1, 0, 2, 1, 1};
  want.recv_rdma_channel_prefix_matrix = {2, 2,   // source 0: t0, t1 | -
                                          1, 3};  // source 2: t1 | t2, t3
  want.recv_rdma_rank_prefix_sum = {2, 5};
  want.recv_gbl_channel_prefix_matrix = {0, 1, 1, 2, 2, 2, 4, 4};
  want.recv_gbl_rank_prefix_sum = {1, 2, 4, 4};
  want.recv_src_meta = {0, 1, 0, 3, 1, 1, 1, 1};
  want.send_rdma_head = {-1, -1, 0, 0, -1, 0, 0, 1};
  want.send_nvl_head = {0,  -1,   // source 0 t0 -> rank 2
                        -2, 0,    // source 0 t1 -> rank 3, after t0 went to rank 2
                        -1, 0,    // source 2 t1 -> rank 3
                        0,  -1,   // source 2 t2 -> rank 2
                        1,  -1};  // source 2 t3 -> rank 2, second of channel 1
  expect_same(ref::internode_handle(x.sources(), 2, 2, 2), want, "rank 2");
}

TEST(InternodeHandle, MatchesARecountFromTheDefinitions) {
  uint32_t seed = 1;
  for (const Case& k : cases()) {
    const Routing x = make_routing(k.D, k.G, k.tokens, seed++);
    for (int C : kChannels)
      for (int r = 0; r < x.R; ++r)
        expect_same(ref::internode_handle(x.sources, r, k.G, C), recount(x, r, C), where(k, C, r));
  }
}

TEST(InternodeHandle, ConsistentAcrossRanks) {
  uint32_t seed = 1;
  for (const Case& k : cases()) {
    const Routing x = make_routing(k.D, k.G, k.tokens, seed++);
    for (int C : kChannels) {
      std::vector<ref::InternodeHandle> h;
      for (int r = 0; r < x.R; ++r) h.push_back(ref::internode_handle(x.sources, r, k.G, C));
      check_consistency(x, C, h, where(k, C, -1));
    }
  }
}

TEST(InternodeLayout, TokensPerRdmaRankAreTheTokensNeedingEachDomain) {
  uint32_t seed = 1;
  for (const Case& k : cases()) {
    const Routing x = make_routing(k.D, k.G, k.tokens, seed++);
    for (int r = 0; r < x.R; ++r) {
      if (k.D == 1) {  // one domain: no RDMA counts
        EXPECT_TRUE(x.per_rdma[r].empty());
        continue;
      }
      std::vector<int> want(k.D, 0);
      for (int m = 0; m < k.D; ++m)
        for (int t = 0; t < x.tokens(r); ++t) want[m] += x.needs(r, t, m) ? 1 : 0;
      EXPECT_EQ(x.per_rdma[r], want) << where(k, 0, r);
    }
  }
}

TEST(InternodeArgs, BadShapesThrow) {
  const std::vector<ref::Source> six(6, ref::Source{});
  EXPECT_THROW(ref::internode_handle(six, 0, 4, 1), std::invalid_argument);  // R % G != 0
  EXPECT_THROW(ref::internode_handle(six, 0, 0, 1), std::invalid_argument);  // G < 1
  EXPECT_THROW(ref::internode_handle(six, 0, 2, 0), std::invalid_argument);  // C < 1
  EXPECT_THROW(ref::internode_handle(six, 6, 2, 1), std::invalid_argument);  // rank outside [0, R)
  EXPECT_NO_THROW(ref::internode_handle(six, 5, 2, 1));
  const std::vector<ref::Source> many(66, ref::Source{});
  EXPECT_THROW(ref::internode_handle(many, 0, 33, 1), std::invalid_argument);  // masks are 32 bits
  const ref::Source own{};
  EXPECT_THROW(ref::combine_two_level(own, 6, 4, 8, 1, nullptr, nullptr, nullptr, nullptr), std::invalid_argument);
  EXPECT_THROW(ref::combine_two_level(own, 6, 0, 8, 1, nullptr, nullptr, nullptr, nullptr), std::invalid_argument);
  const uint8_t in[4] = {1, 0, 0, 1};
  EXPECT_THROW(ref::domain_mask({1, in, nullptr, nullptr}, 4, 3, 0, 0), std::invalid_argument);
  EXPECT_THROW(ref::domain_mask({1, in, nullptr, nullptr}, 4, 2, 0, 2), std::invalid_argument);
}

// ---- the two-level combine -----------------------------------------------------------------------------------------

namespace {

// Rows and weights that R ranks send back for T tokens of the combining rank, and its biases.
struct CombineData {
  int R = 0, G = 0, T = 0, H = 0, K = 0;
  std::vector<uint8_t> in_rank;        // [T, R]
  std::vector<uint16_t> rows;          // [R, T, H]
  std::vector<float> weights;          // [R, T, K]
  std::vector<uint16_t> bias0, bias1;  // [T, H]
  ref::Source own() const { return {T, in_rank.data(), nullptr, nullptr}; }
  ref::ContributionRow row_fn() const {
    return [this](int j, int t) -> const uint16_t* {
      if (!in_rank[size_t(t) * R + j]) ADD_FAILURE() << "read the row of a rank that did not receive the token";
      return rows.data() + (size_t(j) * T + t) * H;
    };
  }
  ref::ContributionWeights weight_fn() const {
    return [this](int j, int t) -> const float* {
      if (!in_rank[size_t(t) * R + j]) ADD_FAILURE() << "read the weights of a rank that did not receive the token";
      return weights.data() + (size_t(j) * T + t) * K;
    };
  }
  const uint16_t* b0(int which) const { return which & 1 ? bias0.data() : nullptr; }
  const uint16_t* b1(int which) const { return which & 2 ? bias1.data() : nullptr; }
};

// Finite bf16 values over 2^-15 .. 2^16, both signs, with zeros of both signs: sums of them round often.
uint16_t random_bf16(std::mt19937& rng) {
  const uint32_t v = rng();
  if (v % 16 == 0) return uint16_t((v >> 8) & 0x8000);
  return uint16_t(((v >> 16) & 0x8000) | ((0x70 + (v >> 8) % 32) << 7) | ((v >> 16) & 0x7f));
}

// single: each token is received by at most one rank; otherwise by each rank with probability 1/2.
CombineData random_combine(int D, int G, int T, uint32_t seed, bool single) {
  std::mt19937 rng(seed);
  CombineData c;
  c.R = D * G;
  c.G = G;
  c.T = T;
  c.H = 24;
  c.K = 3;
  c.in_rank.assign(size_t(T) * c.R, 0);
  for (int t = 0; t < T; ++t) {
    if (single) {
      const int j = int(rng() % (c.R + 1));
      if (j < c.R) c.in_rank[size_t(t) * c.R + j] = 1;
    } else {
      for (int j = 0; j < c.R; ++j) c.in_rank[size_t(t) * c.R + j] = rng() % 2;
    }
  }
  for (int i = 0; i < c.R * T * c.H; ++i) c.rows.push_back(random_bf16(rng));
  for (int i = 0; i < c.R * T * c.K; ++i) c.weights.push_back(ref::bf16_to_float(random_bf16(rng)));
  for (int i = 0; i < T * c.H; ++i) c.bias0.push_back(random_bf16(rng));
  for (int i = 0; i < T * c.H; ++i) c.bias1.push_back(random_bf16(rng));
  return c;
}

std::vector<uint32_t> bits(const std::vector<float>& v) {
  std::vector<uint32_t> out(v.size());
  if (!v.empty()) std::memcpy(out.data(), v.data(), v.size() * sizeof(float));
  return out;
}

// Two-level combine and flat combine of c with the biases `which` (bit 0: bias0, bit 1: bias1).
ref::Combined two_level(const CombineData& c, int which, bool weights = true) {
  return ref::combine_two_level(c.own(), c.R, c.G, c.H, c.K, c.row_fn(), weights ? c.weight_fn() : nullptr, c.b0(which),
                                c.b1(which));
}
ref::Combined flat(const CombineData& c, int which, bool weights = true) {
  return ref::combine(c.own(), c.R, c.H, c.K, c.row_fn(), weights ? c.weight_fn() : nullptr, c.b0(which), c.b1(which));
}

}  // namespace

TEST(InternodeCombine, OneGpuPerDomainIsTheFlatOrder) {
  // Every partial is a single row, passed through: the sum is the flat one, rank by rank.
  uint32_t seed = 100;
  for (int D : {2, 4, 8})
    for (int which = 0; which < 4; ++which) {
      const CombineData c = random_combine(D, 1, 40, seed++, false);
      const ref::Combined a = two_level(c, which), b = flat(c, which);
      EXPECT_EQ(a.x, b.x) << "D " << D << " biases " << which;
      EXPECT_EQ(bits(a.weights), bits(b.weights)) << "D " << D;
    }
}

TEST(InternodeCombine, OneDomainWithTokensOnOneRankIsTheFlatOrder) {
  uint32_t seed = 200;
  for (int G : {2, 4, 8})
    for (int which = 0; which < 4; ++which) {
      const CombineData c = random_combine(1, G, 40, seed++, true);
      EXPECT_EQ(two_level(c, which).x, flat(c, which).x) << "G " << G << " biases " << which;
    }
  // Without biases one domain is also the flat order for any routing: rounding a bf16 value again keeps it.
  for (int G : {2, 4, 8}) {
    const CombineData c = random_combine(1, G, 40, seed++, false);
    EXPECT_EQ(two_level(c, 0).x, flat(c, 0).x) << "G " << G;
  }
}

TEST(InternodeCombine, RandomMatchesAnElementwiseRecount) {
  uint32_t seed = 300;
  int differs = 0;
  for (auto [D, G] : {std::pair{2, 2}, std::pair{4, 2}, std::pair{2, 4}})
    for (int which = 0; which < 4; ++which) {
      const CombineData c = random_combine(D, G, 40, seed++, false);
      const ref::Combined got = two_level(c, which), base = flat(c, which);
      for (int t = 0; t < c.T; ++t)
        for (int h = 0; h < c.H; ++h) {
          float acc = 0.f;
          for (int m = 0; m < D; ++m) {
            std::vector<uint16_t> in_m;
            for (int j = m * G; j < (m + 1) * G; ++j)
              if (c.in_rank[size_t(t) * c.R + j]) in_m.push_back(c.rows[(size_t(j) * c.T + t) * c.H + h]);
            if (in_m.empty()) continue;
            float part = 0.f;
            for (uint16_t v : in_m) part += ref::bf16_to_float(v);
            acc += ref::bf16_to_float(in_m.size() == 1 ? in_m[0] : ref::float_to_bf16(part));
          }
          if (which & 1) acc += ref::bf16_to_float(c.bias0[size_t(t) * c.H + h]);
          if (which & 2) acc += ref::bf16_to_float(c.bias1[size_t(t) * c.H + h]);
          const size_t i = size_t(t) * c.H + h;
          EXPECT_EQ(got.x[i], ref::float_to_bf16(acc)) << D << "x" << G << " t " << t << " h " << h;
          differs += got.x[i] != base.x[i] ? 1 : 0;
        }
      EXPECT_EQ(bits(got.weights), bits(base.weights)) << D << "x" << G;
    }
  EXPECT_GT(differs, 0) << "the data never told the two orders apart";
}

TEST(InternodeCombine, HandValuesWhereTheOrdersDiffer) {
  // D 2, G 2, hidden 2. t0 is received by ranks 0, 1 (domain 0) and 2 (domain 1); t1 by 1 (domain 0), 2 and 3.
  CombineData c;
  c.R = 4, c.G = 2, c.T = 2, c.H = 2, c.K = 1;
  c.in_rank = {1, 1, 1, 0, 0, 1, 1, 1};
  c.rows.assign(size_t(c.R) * c.T * c.H, 0);
  const auto set = [&](int j, int t, uint16_t a, uint16_t b) {
    c.rows[(size_t(j) * c.T + t) * c.H] = a;
    c.rows[(size_t(j) * c.T + t) * c.H + 1] = b;
  };
  // t0 column 0: 256, 1 | -256. Flat: 256 + 1 - 256 = 1. Two-level: P0 = bf16(257) = 256 (tie, even), 256 - 256 = 0.
  // t0 column 1: 1, 2^-8 | 2^-8. Flat: 1 + 2^-7 (exact in bf16). Two-level: P0 = bf16(1 + 2^-8) = 1 (tie, even),
  //   then bf16(1 + 2^-8) = 1 again.
  set(0, 0, 0x4380, 0x3f80);
  set(1, 0, 0x3f80, 0x3b80);
  set(2, 0, 0xc380, 0x3b80);
  // t1 column 0: 1 | 1, 2^-8, bias0 2^-7. Flat: 2 + 3 * 2^-8 = 2 + 0.75 * 2^-6: up to 2 + 2^-6.
  //   Two-level: P1 = bf16(1 + 2^-8) = 1, then 2 + 2^-7 = 2 + 0.5 * 2^-6: a tie, to the even 2.
  // t1 column 1: 0.5 | 0.25, 0.25: 1 in both orders (P1 = 0.5 exactly).
  set(1, 1, 0x3f80, 0x3f00);
  set(2, 1, 0x3f80, 0x3e80);
  set(3, 1, 0x3b80, 0x3e80);
  c.bias0 = {0x0000, 0x0000, 0x3c00, 0x0000};
  // Weights k 0. t0: 2^24, 0 | 1: 2^24 + 0 + 1 in both orders = 2^24. t1: 2^24 | 1, 1. The flat order
  //   2^24 + 1 + 1 stays 2^24 (each add a tie to even); summing domain 1 first would give 2^24 + 2.
  c.weights = {16777216.f, 0.f, 0.f, 16777216.f, 1.f, 1.f, 0.f, 1.f};
  const ref::Combined a = two_level(c, 1), b = flat(c, 1);
  EXPECT_EQ(a.x, (std::vector<uint16_t>{0x0000, 0x3f80, 0x4000, 0x3f80}));
  EXPECT_EQ(b.x, (std::vector<uint16_t>{0x3f80, 0x3f81, 0x4001, 0x3f80}));
  EXPECT_EQ(a.weights, (std::vector<float>{16777216.f, 16777216.f}));
  EXPECT_EQ(bits(a.weights), bits(b.weights));
  EXPECT_EQ(ref::bf16_to_float(0x4380), 256.f);
  EXPECT_EQ(ref::bf16_to_float(0xc380), -256.f);
  EXPECT_EQ(ref::bf16_to_float(0x3b80), 1.f / 256);
  EXPECT_EQ(ref::bf16_to_float(0x3c00), 1.f / 128);
  EXPECT_EQ(ref::bf16_to_float(0x4001), 2.f + 1.f / 64);
}

TEST(InternodeCombine, NegativeZeroRowsSumToPositiveZero) {
  // A single -0.0 row is its domain's partial unchanged; the second level starts at +0.0, so the result is +0.0,
  // as in the flat order. D 2, G 2; t0: rank 0; t1: ranks 0, 2 (one per domain); t2: ranks 0, 1; t3: rank 3 with a
  // -0.0 bias0; t4: rank 1 with -0.0 and rank 2 with 0x0001 (a bf16 subnormal), passed through exactly.
  CombineData c;
  c.R = 4, c.G = 2, c.T = 5, c.H = 1, c.K = 1;
  c.in_rank = {1, 0, 0, 0, 1, 0, 1, 0, 1, 1, 0, 0, 0, 0, 0, 1, 0, 1, 1, 0};
  c.rows.assign(size_t(c.R) * c.T, 0x8000);
  c.rows[size_t(2) * c.T + 4] = 0x0001;
  c.weights.assign(size_t(c.R) * c.T, 0.f);
  c.bias0 = {0x0000, 0x0000, 0x0000, 0x8000, 0x0000};
  for (int which : {0, 1}) {
    const ref::Combined a = two_level(c, which, false), b = flat(c, which, false);
    EXPECT_EQ(a.x, (std::vector<uint16_t>{0x0000, 0x0000, 0x0000, 0x0000, 0x0001})) << "biases " << which;
    EXPECT_EQ(a.x, b.x);
    EXPECT_TRUE(a.weights.empty());
  }
}

TEST(InternodeCombine, WeightsAreTheFlatCombines) {
  uint32_t seed = 400;
  for (auto [D, G] : {std::pair{2, 2}, std::pair{4, 2}, std::pair{2, 4}, std::pair{1, 4}}) {
    const CombineData c = random_combine(D, G, 40, seed++, false);
    EXPECT_EQ(bits(two_level(c, 0).weights), bits(flat(c, 0).weights)) << D << "x" << G;
  }
}
