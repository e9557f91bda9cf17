// The CPU reference model of the internode (hierarchical) mode (semantics.md section 6). Plain loops, written to be
// obviously right: every array is counted directly from the sources' is_token_in_rank.
#include <cstddef>
#include <functional>
#include <string>

#include "epx/reference.hpp"

namespace epx::ref {
namespace {

void require(bool ok, const std::string& what) {
  if (!ok) throw std::invalid_argument(what);
}

// R = D x G with 1 <= G <= 32 (a domain mask is 32 bits).
void require_domains(int num_ranks, int num_nvl_ranks, const char* op) {
  require(num_ranks >= 1, std::string(op) + ": needs at least one rank");
  require(num_nvl_ranks >= 1 && num_nvl_ranks <= 32, std::string(op) + ": num_nvl_ranks must be in [1, 32]");
  require(num_ranks % num_nvl_ranks == 0, std::string(op) + ": num_nvl_ranks must divide the number of ranks");
}

bool goes_to(const Source& src, int num_ranks, int token, int rank) {
  return src.is_token_in_rank[size_t(token) * num_ranks + rank] != 0;
}

// For every channel, the number of tokens t of `src` in it with in(t).
std::vector<int> channel_counts(const Source& src, int num_channels, const std::function<bool(int)>& in) {
  std::vector<int> counts(num_channels, 0);
  for (int t = 0; t < src.num_tokens; ++t)
    if (in(t)) ++counts[channel_of(src.num_tokens, num_channels, t)];
  return counts;
}

// counts, made inclusive over channels.
std::vector<int> inclusive(std::vector<int> counts) {
  for (size_t c = 1; c < counts.size(); ++c) counts[c] += counts[c - 1];
  return counts;
}

}  // namespace

int channel_of(int num_tokens, int num_channels, int token) {
  require(num_tokens > 0 && num_channels >= 1, "channel_of: needs num_tokens > 0 and num_channels >= 1");
  require(token >= 0 && token < num_tokens, "channel_of: token outside [0, num_tokens)");
  const int64_t per = (int64_t(num_tokens) + num_channels - 1) / num_channels;
  return int(token / per);
}

uint32_t domain_mask(const Source& src, int num_ranks, int num_nvl_ranks, int token, int domain) {
  require_domains(num_ranks, num_nvl_ranks, "domain_mask");
  require(domain >= 0 && domain < num_ranks / num_nvl_ranks, "domain_mask: domain outside [0, D)");
  require(token >= 0 && token < src.num_tokens, "domain_mask: token outside [0, num_tokens)");
  uint32_t mask = 0;
  for (int j = 0; j < num_nvl_ranks; ++j)
    if (goes_to(src, num_ranks, token, domain * num_nvl_ranks + j)) mask |= uint32_t(1) << j;
  return mask;
}

InternodeHandle internode_handle(const std::vector<Source>& sources, int rank, int num_nvl_ranks, int num_channels) {
  const int R = int(sources.size()), G = num_nvl_ranks, C = num_channels;
  require_domains(R, G, "internode_handle");
  require(C >= 1, "internode_handle: num_channels must be at least 1");
  require(rank >= 0 && rank < R, "internode_handle: rank outside [0, R)");
  const int D = R / G, d = rank / G, g = rank % G;
  const Source& own = sources[rank];
  InternodeHandle h;

  // Predicates on the tokens of a source: "needs domain m", "goes to rank j".
  const auto needs = [R, G](const Source& src, int m) {
    return [&src, m, R, G](int t) { return domain_mask(src, R, G, t, m) != 0; };
  };
  const auto sends = [R](const Source& src, int j) { return [&src, j, R](int t) { return goes_to(src, R, t, j); }; };

  // [1] and [2]: what this rank sends, per domain and per rank.
  for (int m = 0; m < D; ++m)
    for (int v : inclusive(channel_counts(own, C, needs(own, m)))) h.rdma_channel_prefix_matrix.push_back(v);
  for (int j = 0; j < R; ++j)
    for (int v : inclusive(channel_counts(own, C, sends(own, j)))) h.gbl_channel_prefix_matrix.push_back(v);

  // [3] and [4]: records arriving from the rank (m, g) of every domain.
  int records = 0;
  for (int m = 0; m < D; ++m) {
    const std::vector<int> row = inclusive(channel_counts(sources[m * G + g], C, needs(sources[m * G + g], d)));
    h.recv_rdma_channel_prefix_matrix.insert(h.recv_rdma_channel_prefix_matrix.end(), row.begin(), row.end());
    records += row[C - 1];
    h.recv_rdma_rank_prefix_sum.push_back(records);
  }

  // [5] and [6]: recv_x rows, source ascending, then channel ascending.
  int rows = 0;
  for (int s = 0; s < R; ++s) {
    for (int n : channel_counts(sources[s], C, sends(sources[s], rank))) {
      h.recv_gbl_channel_prefix_matrix.push_back(rows);
      rows += n;
    }
    h.recv_gbl_rank_prefix_sum.push_back(rows);
  }

  // [7]: per recv_x row, in recv_rows order.
  for (const RecvRow& row : recv_rows(sources, rank)) {
    h.recv_src_meta.push_back(row.src_rank / G);
    h.recv_src_meta.push_back(int32_t(domain_mask(sources[row.src_rank], R, G, row.src_token, d)));
  }

  // [8]: position of each own token in its channel's stream to domain m. next[c * D + m] is the position the
  // stream's next token takes.
  std::vector<int> next(size_t(C) * D, 0);
  for (int t = 0; t < own.num_tokens; ++t) {
    const int c = channel_of(own.num_tokens, C, t);
    for (int m = 0; m < D; ++m) {
      int& k = next[size_t(c) * D + m];
      h.send_rdma_head.push_back(domain_mask(own, R, G, t, m) != 0 ? k++ : -k - 1);
    }
  }

  // [9]: tokens ascending are channels ascending, so walking each source (m, g) in token order gives the
  // network-received order. next[c * G + j] counts the channel's tokens so far that go to rank d * G + j (all of
  // them are records here: a token that goes to a rank of domain d needs domain d).
  for (int m = 0; m < D; ++m) {
    const Source& src = sources[m * G + g];
    next.assign(size_t(C) * G, 0);
    for (int t = 0; t < src.num_tokens; ++t) {
      if (domain_mask(src, R, G, t, d) == 0) continue;
      const int c = channel_of(src.num_tokens, C, t);
      for (int j = 0; j < G; ++j) {
        int& k = next[size_t(c) * G + j];
        h.send_nvl_head.push_back(goes_to(src, R, t, d * G + j) ? k++ : -k - 1);
      }
    }
  }
  return h;
}

Combined combine_two_level(const Source& own, int num_ranks, int num_nvl_ranks, int hidden, int num_topk,
                           const ContributionRow& row, const ContributionWeights& weights, const uint16_t* bias0,
                           const uint16_t* bias1) {
  require_domains(num_ranks, num_nvl_ranks, "combine_two_level");
  require(hidden >= 0 && own.num_tokens >= 0, "combine_two_level: bad sizes");
  const int R = num_ranks, G = num_nvl_ranks, D = R / G;
  Combined out;
  out.x.assign(size_t(own.num_tokens) * hidden, 0);
  if (weights) out.weights.assign(size_t(own.num_tokens) * num_topk, 0.f);
  std::vector<std::vector<uint16_t>> partials;  // P_m of the domains that have the token, m ascending
  std::vector<const uint16_t*> rows, partial_rows;
  for (int t = 0; t < own.num_tokens; ++t) {
    partials.clear();
    for (int m = 0; m < D; ++m) {
      rows.clear();
      for (int j = m * G; j < (m + 1) * G; ++j)
        if (goes_to(own, R, t, j)) rows.push_back(row(j, t));
      if (rows.empty()) continue;
      if (rows.size() == 1) {
        partials.emplace_back(rows[0], rows[0] + hidden);  // the row itself, bit for bit
      } else {
        partials.emplace_back(hidden);
        reduce_bf16_rows(hidden, rows, nullptr, nullptr, partials.back().data());
      }
    }
    partial_rows.clear();
    for (const std::vector<uint16_t>& p : partials) partial_rows.push_back(p.data());
    const size_t off = size_t(t) * hidden;
    reduce_bf16_rows(hidden, partial_rows, bias0 ? bias0 + off : nullptr, bias1 ? bias1 + off : nullptr,
                     out.x.data() + off);
    if (!weights) continue;
    for (int k = 0; k < num_topk; ++k) {
      float acc = 0.f;
      for (int j = 0; j < R; ++j)
        if (goes_to(own, R, t, j)) acc += weights(j, t)[k];
      out.weights[size_t(t) * num_topk + k] = acc;
    }
  }
  return out;
}

}  // namespace epx::ref
