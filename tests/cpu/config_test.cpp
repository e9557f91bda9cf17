// Configs of the high-throughput kernels: the defaults must be valid, validation must name the bad field, and
// nvl_size_hint must leave room for the largest ring records the kernels can write.
#include "runtime/config.hpp"

#include <gmock/gmock.h>
#include <gtest/gtest.h>

#include <algorithm>
#include <functional>
#include <string>
#include <vector>

#include "epx/epx.hpp"
#include "kernels/intranode/sender_groups.hpp"
#include "layout/limits.hpp"
#include "layout/nvl_layout.hpp"
#include "layout/recv_region.hpp"
#include "runtime/dispatch_split.hpp"
#include "test_helpers.hpp"

using ::testing::HasSubstr;

namespace {

using epx_test::invalid_argument_message;

epx::Config valid_config() { return epx::Config{24, 6, 256, 8, 128}; }

}  // namespace

TEST(Config, DefaultsAreValidForOneToEightRanks) {
  for (int r = 1; r <= epx::kMaxNvlRanks; ++r) {
    for (const epx::Config& c : {epx::default_dispatch_config(r), epx::default_combine_config(r)}) {
      EXPECT_NO_THROW(epx::validate_config(c, r)) << r << " ranks";
      EXPECT_GE(c.num_max_recv_tokens, c.num_max_send_tokens) << r << " ranks";
    }
  }
}

TEST(Config, DefaultsAreValidInternodeConfigsUpTo16x8) {
  for (int r = 2; r <= epx::kMaxRanks; r *= 2)
    for (int g = 1; g <= epx::kMaxNvlRanks && g <= r; g *= 2) {
      if (r / g > epx::kMaxDomains) continue;
      for (const epx::Config& c : {epx::default_dispatch_config(r), epx::default_combine_config(r)})
        EXPECT_NO_THROW(epx::validate_internode_config(c, g, r / g)) << r / g << " x " << g;
    }
}

TEST(Config, DefaultsRejectRankCountsTheKernelsCannotRun) {
  for (int r : {0, -1, epx::kMaxRanks + 1}) {
    EXPECT_THAT(invalid_argument_message([&] { epx::default_dispatch_config(r); }), HasSubstr("num_ranks")) << r;
    EXPECT_THAT(invalid_argument_message([&] { epx::default_combine_config(r); }), HasSubstr("num_ranks")) << r;
  }
}

TEST(Config, RejectsBadNumSms) {
  for (int sms : {0, -2, 1, 23}) {
    epx::Config c = valid_config();
    c.num_sms = sms;
    EXPECT_THAT(invalid_argument_message([&] { epx::validate_config(c, 4); }), HasSubstr("num_sms")) << sms;
  }
  epx::Config c = valid_config();
  c.num_sms = 2 * epx::kMaxChannels;  // 128: the largest accepted
  EXPECT_NO_THROW(epx::validate_config(c, 4));
  c.num_sms = 2 * epx::kMaxChannels + 2;
  const std::string msg = invalid_argument_message([&] { epx::validate_config(c, 4); });
  EXPECT_THAT(msg, HasSubstr("num_sms"));
  EXPECT_THAT(msg, HasSubstr("128"));  // says the limit
}

TEST(Config, RejectsBadChunkAndRing) {
  epx::Config c = valid_config();
  c.num_max_send_tokens = 0;
  EXPECT_THAT(invalid_argument_message([&] { epx::validate_config(c, 4); }), HasSubstr("num_max_send_tokens"));
  c = valid_config();
  c.num_max_send_tokens = -3;
  EXPECT_THAT(invalid_argument_message([&] { epx::validate_config(c, 4); }), HasSubstr("num_max_send_tokens"));
  c = valid_config();
  c.num_max_recv_tokens = c.num_max_send_tokens - 1;  // a ring smaller than one chunk can never be filled
  EXPECT_THAT(invalid_argument_message([&] { epx::validate_config(c, 4); }), HasSubstr("num_max_recv_tokens"));
  c.num_max_recv_tokens = c.num_max_send_tokens;  // exactly one chunk is enough
  EXPECT_NO_THROW(epx::validate_config(c, 4));
}

TEST(Config, RejectsRankCountsOutsideOneDomain) {
  for (int r : {0, -1, epx::kMaxNvlRanks + 1, 64})
    EXPECT_THAT(invalid_argument_message([&] { epx::validate_config(valid_config(), r); }), HasSubstr("ranks")) << r;
}

// The ring of one (channel, peer) holds num_max_recv_tokens records; the biggest record any call can need with
// rows of hidden_bytes (bf16 row, or an FP8 row of the same hidden with per-128 scales, at the largest top-k;
// combine rows with weights) must fit for every channel and every ring: one ring per source rank, but at 2 ranks
// only the peer's (own rows never pass through a ring there) and none at 1 rank.
int64_t largest_ring_bytes(const epx::Config& c, int64_t hidden_bytes, int num_ranks) {
  const int hidden = int(hidden_bytes / 2);
  const int fp8_scales = (hidden + epx::kFp8GroupSize - 1) / epx::kFp8GroupSize;
  const int64_t record = std::max({epx::DispatchRecord::make(hidden_bytes, 0, epx::kMaxTopk).bytes,
                                   epx::DispatchRecord::make(hidden, fp8_scales, epx::kMaxTopk).bytes,
                                   epx::CombineRecord::make(hidden, epx::kMaxTopk).bytes});
  const int rings = num_ranks <= 2 ? num_ranks - 1 : num_ranks;
  return int64_t(c.num_sms / 2) * rings * c.num_max_recv_tokens * epx::align_up(record, epx::kAlign);
}

TEST(Config, NvlSizeHintCoversTheLargestRecords) {
  for (int64_t hidden : {128, 2048, 4096, 7168}) {
    for (int r : {1, 2, 4, 8}) {
      const epx::Config c = epx::default_dispatch_config(r);
      const int64_t hint = epx::nvl_size_hint(c, hidden * 2, r);
      EXPECT_GE(hint, largest_ring_bytes(c, hidden * 2, r)) << "hidden " << hidden << ", " << r << " ranks";
      EXPECT_EQ(hint % epx::kAlign, 0) << "hidden " << hidden << ", " << r << " ranks";
    }
  }
}

// Every (channel, source) a kernel may name maps to a slot inside the ring region, distinct sources to distinct
// rings above 2 ranks; at 2 ranks both ranks' buffers hold only the ring their peer writes, so the sources of one
// channel share the channel's ring (each buffer is written by one of them).
TEST(Config, RingSlotsStayInsideTheRingRegion) {
  for (int r : {2, 3, 4, 8}) {
    const epx::RingLayout ring{r, 3, 1000};
    const int channels = 5;
    const uintptr_t base = uintptr_t(1) << 32;  // a buffer address; slot() only computes addresses
    const int64_t begin = epx::RingLayout::data_offset(), end = begin + ring.bytes(channels);
    for (int c = 0; c < channels; ++c)
      for (int src = 0; src < r; ++src)
        for (uint64_t pos : {uint64_t(0), uint64_t(2), uint64_t(3), uint64_t(1) << 40}) {
          const int64_t at =
              int64_t(reinterpret_cast<uintptr_t>(ring.slot(reinterpret_cast<void*>(base), c, src, pos)) - base);
          EXPECT_GE(at, begin) << r << " ranks";
          EXPECT_LE(at + ring.stride(), end) << r << " ranks";
          EXPECT_EQ((at - begin) % ring.stride(), 0);
          const int64_t ring_index = (at - begin) / ring.stride() / ring.capacity;
          EXPECT_EQ(ring_index, r == 2 ? c : int64_t(c) * r + src) << r << " ranks, channel " << c << ", src " << src;
        }
  }
  EXPECT_EQ((epx::RingLayout{1, 3, 1000}.bytes(5)), 0);
  EXPECT_EQ((epx::RingLayout{2, 3, 1000}.bytes(5)), 5 * 3 * epx::align_up(1000, epx::kAlign));
}

TEST(Config, NvlSizeHintGrowsWithRanksAndHidden) {
  const epx::Config c = valid_config();
  for (int r = 1; r < epx::kMaxNvlRanks; ++r)
    EXPECT_GT(epx::nvl_size_hint(c, 4096 * 2, r + 1), epx::nvl_size_hint(c, 4096 * 2, r)) << r;
  EXPECT_GT(epx::nvl_size_hint(c, 7168 * 2, 4), epx::nvl_size_hint(c, 4096 * 2, 4));
  epx::Config bigger_ring = c;
  bigger_ring.num_max_recv_tokens *= 2;
  EXPECT_GT(epx::nvl_size_hint(bigger_ring, 4096 * 2, 4), epx::nvl_size_hint(c, 4096 * 2, 4));
}

TEST(Config, NvlSizeHintRejectsBadInput) {
  for (int64_t bytes : {int64_t(0), int64_t(-16), int64_t(8), int64_t(24), int64_t(4097)})
    EXPECT_THAT(invalid_argument_message([&] { epx::nvl_size_hint(valid_config(), bytes, 4); }),
                HasSubstr("hidden_bytes"))
        << bytes;
  epx::Config bad = valid_config();
  bad.num_sms = 3;  // the config is validated too
  EXPECT_THAT(invalid_argument_message([&] { epx::nvl_size_hint(bad, 8192, 4); }), HasSubstr("num_sms"));
  EXPECT_THAT(invalid_argument_message([&] { epx::nvl_size_hint(valid_config(), 8192, 9); }), HasSubstr("ranks"));
}

// The dispatch's chunk per tail update (runtime/config.hpp): at the 4-rank default 24, BF16 rows of hidden 7168
// publish every 12 tokens and FP8 rows every 24; the defaults of other rank counts are kept; a config's smaller chunk
// is kept; no chunk goes below two tokens per warp of a peer group unless the config asks for it.
TEST(Config, DispatchSendChunkCapsBytesAboveTwoTokensPerWarp) {
  const int64_t bf16 = epx::DispatchRecord::make(7168 * 2, 0, 8).bytes;
  const int64_t fp8 = epx::DispatchRecord::make(7168, 7168 / 128, 8).bytes;
  EXPECT_EQ(bf16, 14416);
  EXPECT_EQ(fp8, 7472);
  const epx::Config four = epx::default_dispatch_config(4);
  ASSERT_EQ(four.num_max_send_tokens, 24);
  EXPECT_EQ(epx::dispatch_send_chunk(four, bf16, 4), 12);
  EXPECT_EQ(epx::dispatch_send_chunk(four, fp8, 4), 24);
  EXPECT_EQ(epx::dispatch_send_chunk(four, epx::DispatchRecord::make(4096 * 2, 0, 8).bytes, 4), 22);
  for (int r : {1, 2, 3, 5, 6, 7, 8}) {
    const epx::Config d = epx::default_dispatch_config(r);
    for (int64_t bytes : {bf16, fp8}) EXPECT_EQ(epx::dispatch_send_chunk(d, bytes, r), d.num_max_send_tokens) << r;
  }
  epx::Config small = four;
  small.num_max_send_tokens = 2;
  EXPECT_EQ(epx::dispatch_send_chunk(small, bf16, 4), 2);
  small.num_max_send_tokens = 64;  // a wide row: the floor, 2 x (24 / 4) warps
  EXPECT_EQ(epx::dispatch_send_chunk(small, epx::DispatchRecord::make(32768 * 2, 0, 8).bytes, 4), 12);
  EXPECT_EQ(epx::dispatch_send_chunk(small, epx::DispatchRecord::make(2048 * 2, 0, 8).bytes, 4), 44);
}

// The 2-rank combine's coordinated senders (kernels/intranode/sender_groups.hpp): one group, for the peer, of the
// first kCombinePeerWarps warps; no group for this rank (its rows are read in place); the other warps idle. One
// rank alone has no group.
TEST(SenderGroups, CombineHasOnlyThePeersGroup) {
  const epx::SenderGroups g = epx::SenderGroups::combine(2);
  EXPECT_EQ(g.own, 0);
  EXPECT_EQ(g.used(2), epx::SenderGroups::kCombinePeerWarps);
  for (int self = 0; self < 2; ++self) {
    EXPECT_EQ(g.first_warp(1 - self, self), 0) << "self " << self;
    for (int w = 0; w < epx::kSenderWarps; ++w) {
      const epx::SenderGroups::Place at = g.place(w, 2, self);
      if (w < epx::SenderGroups::kCombinePeerWarps) {
        EXPECT_EQ(at.dest, 1 - self) << "self " << self << ", warp " << w;
        EXPECT_EQ(at.index, w) << "self " << self << ", warp " << w;
      } else {
        EXPECT_GE(at.index, at.warps) << "self " << self << ", idle warp " << w;
      }
    }
  }
  const epx::SenderGroups one = epx::SenderGroups::combine(1);
  EXPECT_EQ(one.used(1), 0);
  EXPECT_GE(one.place(0, 1, 0).index, one.place(0, 1, 0).warps);
}

// The dispatch's coordinated senders have no group for their own rank (the receiver block copies its tokens):
// every peer's group is contiguous, in rank order skipping self, and idle warps fall outside every group.
TEST(SenderGroups, PeersOnlySkipsSelf) {
  for (int r = 1; r <= epx::kMaxNvlRanks; ++r) {
    const epx::SenderGroups g = epx::SenderGroups::peers_only(r);
    EXPECT_EQ(g.own, 0);
    EXPECT_LE(g.used(r), epx::kSenderWarps);
    for (int self = 0; self < r; ++self) {
      int next = 0;
      for (int peer = 0; peer < r; ++peer) {
        if (peer == self) continue;
        EXPECT_EQ(g.first_warp(peer, self), next) << r << " ranks, self " << self << ", peer " << peer;
        EXPECT_GE(g.warps(peer, self), 1) << r << " ranks, self " << self << ", peer " << peer;
        next += g.warps(peer, self);
      }
      EXPECT_EQ(next, g.used(r));
      for (int w = 0; w < epx::kSenderWarps; ++w) {
        const epx::SenderGroups::Place at = g.place(w, r, self);
        if (w < g.used(r)) {
          EXPECT_NE(at.dest, self) << r << " ranks, self " << self << ", warp " << w;
          EXPECT_TRUE(at.index >= 0 && at.index < at.warps) << r << " ranks, self " << self << ", warp " << w;
        } else {
          EXPECT_GE(at.index, at.warps) << r << " ranks, self " << self << ", idle warp " << w;
        }
      }
    }
  }
  EXPECT_EQ(epx::SenderGroups::peers_only(2).each, epx::kSenderWarps);
}

// The 2-rank dispatch split (runtime/dispatch_split.hpp): the peer's group is the first kSenderWarps - S warps
// (the coordinator publishes its tails only), the rest of the sender warps are outside every group (they copy own
// tokens); other rank counts keep peers_only.
TEST(SenderGroups, DispatchSplitAtTwoRanks) {
  for (const int warps : {epx::kDataWarps, epx::kWideDispatchWarps}) {  // blocks of either geometry
    const int senders = warps - 1;
    for (int s = 0; s <= warps - 2; ++s) {
      const epx::SenderGroups g = epx::SenderGroups::dispatch(2, s, senders);
      EXPECT_EQ(g.own, 0);
      EXPECT_EQ(g.each, senders - s);
      for (int self = 0; self < 2; ++self) {
        EXPECT_EQ(g.first_warp(1 - self, self), 0) << "S " << s << ", self " << self;
        EXPECT_EQ(g.used(2), senders - s);
        for (int w = 0; w < senders - s; ++w) {  // the peer's group: every warp below the own-token ones
          const epx::SenderGroups::Place at = g.place(w, 2, self);
          EXPECT_EQ(at.dest, 1 - self);
          EXPECT_EQ(at.index, w);
          EXPECT_EQ(at.warps, senders - s);
        }
      }
    }
  }
  EXPECT_EQ(epx::SenderGroups::dispatch(2, 6).each, epx::kSenderWarps - 6);  // 24-warp blocks by default
  for (int r = 1; r <= epx::kMaxNvlRanks; ++r) {
    if (r == 2) continue;
    EXPECT_EQ(epx::SenderGroups::dispatch(r, 5).each, epx::SenderGroups::peers_only(r).each) << r << " ranks";
  }
}

TEST(DispatchSplit, DefaultsAreInRange) {
  for (const int warps : {epx::kDataWarps, epx::kWideDispatchWarps})
    for (const bool fp8 : {false, true}) {
      const epx::DispatchSplit d = epx::default_dispatch_split(fp8, warps);
      EXPECT_GE(d.self_sender_warps, 0);
      EXPECT_LE(d.self_sender_warps, warps - 2);
      EXPECT_GE(d.ring_receiver_warps, 1);
      EXPECT_LE(d.ring_receiver_warps, warps - 1);
    }
  EXPECT_EQ(epx::default_dispatch_split(false), epx::default_dispatch_split(false, epx::kDataWarps));
}

// The wide 2-rank blocks take rows that are whole copy rounds (32 lanes x 7 vectors): BF16 and FP8 rows of hidden
// 7168 (896 and 448 vectors); not other rank counts, and not rows with a remainder.
TEST(DispatchSplit, WideBlocksOnlyAtTwoRanksForWholeRounds) {
  EXPECT_TRUE(epx::wide_dispatch(2, 7168 * 2 / 16));
  EXPECT_TRUE(epx::wide_dispatch(2, 7168 / 16));
  EXPECT_FALSE(epx::wide_dispatch(2, 4096 * 2 / 16));
  EXPECT_FALSE(epx::wide_dispatch(2, 128 * 2 / 16));
  for (int r : {1, 3, 4, 8}) EXPECT_FALSE(epx::wide_dispatch(r, 7168 * 2 / 16)) << r;
}

TEST(DispatchSplit, ParsesTheVariableOrNamesIt) {
  epx::DispatchSplit d{3, 7};
  EXPECT_FALSE(epx::parse_dispatch_split(nullptr, &d));
  EXPECT_FALSE(epx::parse_dispatch_split("", &d));
  EXPECT_EQ(d, (epx::DispatchSplit{3, 7}));  // untouched
  EXPECT_TRUE(epx::parse_dispatch_split("6,16", &d));
  EXPECT_EQ(d, (epx::DispatchSplit{6, 16}));
  EXPECT_TRUE(epx::parse_dispatch_split("0,1", &d));
  EXPECT_EQ(d, (epx::DispatchSplit{0, 1}));
  EXPECT_TRUE(epx::parse_dispatch_split("22,23", &d));
  EXPECT_EQ(d, (epx::DispatchSplit{22, 23}));
  for (const char* bad : {"6", "6,", "6,16,1", "6 16", "-1,16", "23,16", "6,0", "6,24", "a,b", "6,16x"}) {
    try {
      epx::parse_dispatch_split(bad, &d);
      ADD_FAILURE() << "accepted '" << bad << "'";
    } catch (const epx::Error& e) {
      EXPECT_EQ(e.status(), epx::Status::kInvalidArgument) << bad;
      EXPECT_THAT(e.what(), HasSubstr("EPX_HT_DISPATCH_SPLIT")) << bad;
      EXPECT_THAT(e.what(), HasSubstr(bad)) << bad;
    }
  }
  EXPECT_EQ(d, (epx::DispatchSplit{22, 23}));  // a refused value leaves it as it was
}

// The dispatch into the buffer: at 2 ranks about 192 pushing warps over the grid, the rest of each block own rows,
// always at least one warp of each; at more ranks an equal share per rank.
TEST(InBufferSelfWarps, DefaultsKeepAWarpForEveryGroup) {
  EXPECT_EQ(epx::default_in_buffer_self_warps(2, 24), 16);
  EXPECT_EQ(epx::default_in_buffer_self_warps(2, 16), 12);
  for (int sms = 2; sms <= 132; sms += 2) {
    const int s = epx::default_in_buffer_self_warps(2, sms);
    EXPECT_GE(s, 1) << sms;
    EXPECT_LE(s, epx::kDataWarps - 1) << sms;
  }
  for (int r = 3; r <= epx::kMaxNvlRanks; ++r) {
    const int s = epx::default_in_buffer_self_warps(r, 24);
    EXPECT_GE(s, 1) << r;
    EXPECT_GE((epx::kDataWarps - s) / (r - 1), 1) << r;
  }
}

TEST(InBufferSelfWarps, ParsesTheVariableOrNamesIt) {
  EXPECT_EQ(epx::parse_in_buffer_self_warps(nullptr), 0);
  EXPECT_EQ(epx::parse_in_buffer_self_warps(""), 0);
  EXPECT_EQ(epx::parse_in_buffer_self_warps("14"), 14);
  EXPECT_EQ(epx::parse_in_buffer_self_warps("1"), 1);
  EXPECT_EQ(epx::parse_in_buffer_self_warps("23"), 23);
  for (const char* bad : {"0", "24", "-3", "14x", "a", " 14", "1,2"}) {
    try {
      epx::parse_in_buffer_self_warps(bad);
      ADD_FAILURE() << "accepted '" << bad << "'";
    } catch (const epx::Error& e) {
      EXPECT_EQ(e.status(), epx::Status::kInvalidArgument) << bad;
      EXPECT_THAT(e.what(), HasSubstr("EPX_HT_IN_BUFFER_SELF_WARPS")) << bad;
    }
  }
}

// The chunked dispatch senders' groups (kernels/sender_groups.hpp, chunked_peer_slot): every rank but self gets
// one group of kDataWarps / (R - 1) warps with indexes 0 .. warps - 1, in rank order; no warp serves self; the
// warps past the groups are idle.
TEST(SenderGroups, ChunkedPeerSlotsCoverEveryPeer) {
  for (int r = 2; r <= epx::kMaxNvlRanks; ++r) {
    for (int self = 0; self < r; ++self) {
      std::vector<int> count(r, 0);
      int last_peer = -1;
      for (int w = 0; w < epx::kDataWarps; ++w) {
        const epx::PeerSlot s = epx::chunked_peer_slot(w, r, self);
        EXPECT_EQ(s.warps, epx::kDataWarps / (r - 1));
        EXPECT_EQ(s.active, w < s.warps * (r - 1)) << r << " ranks, self " << self << ", warp " << w;
        if (!s.active) continue;
        EXPECT_NE(s.peer, self) << r << " ranks, warp " << w;
        EXPECT_TRUE(s.peer >= 0 && s.peer < r) << r << " ranks, self " << self << ", warp " << w;
        EXPECT_GE(s.peer, last_peer) << "groups in rank order";
        EXPECT_EQ(s.index, count[s.peer]) << r << " ranks, self " << self << ", warp " << w;
        last_peer = s.peer;
        ++count[s.peer];
      }
      for (int peer = 0; peer < r; ++peer)
        EXPECT_EQ(count[peer], peer == self ? 0 : epx::kDataWarps / (r - 1)) << r << " ranks, self " << self;
    }
  }
}

// The output region: a region of bytes_for(rows) holds those rows with every array inside it, in order and aligned;
// one byte less than a row's worth holds fewer.
TEST(RecvRegion, HoldsWhatItsHintSays) {
  for (int rows : {0, 1, 7, 4096, 8192})
    for (int64_t x_bytes : {int64_t(16), int64_t(7168), int64_t(14336)})
      for (int scales : {0, 56, 160})
        for (int k : {0, 1, 8, 32}) {
          const int64_t bytes = epx::RecvRegion::bytes_for(rows, x_bytes, scales, k);
          const epx::RecvRegion r = epx::RecvRegion::make(bytes, x_bytes, scales, k);
          EXPECT_GE(r.capacity, rows);
          EXPECT_LE(r.end(), bytes);
          EXPECT_EQ(r.scale_offset % epx::kAlign, 0);
          EXPECT_EQ(r.weight_offset % epx::kAlign, 0);
          EXPECT_LE(int64_t(r.capacity) * x_bytes, r.scale_offset);
          EXPECT_LE(r.scale_offset + int64_t(r.capacity) * scales * 4, r.src_offset);
          EXPECT_LE(r.src_offset + int64_t(r.capacity) * 4, r.topk_offset);
          EXPECT_LE(r.topk_offset + int64_t(r.capacity) * k * 8, r.weight_offset);
          if (rows > 0) {
            EXPECT_LT(epx::RecvRegion::make(bytes - epx::RecvRegion::row_bytes(x_bytes, scales, k), x_bytes, scales, k)
                          .capacity,
                      rows);
          }
        }
  EXPECT_EQ(epx::RecvRegion::make(0, 14336, 0, 8).capacity, 0);
}
