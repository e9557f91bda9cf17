// The reference model of the LogFMT combine (semantics.md section 9, docs/logfmt.md): the rules of layout/logfmt.hpp
// applied one element at a time, then the flat sum of semantics.md section 5 on the decoded values.
#include "layout/logfmt.hpp"

#include <cstring>
#include <stdexcept>
#include <string>
#include <vector>

#include "epx/reference.hpp"

namespace epx::ref {
namespace {

void require_groups(int hidden) {
  if (hidden <= 0 || hidden % kLogfmtGroup != 0)
    throw std::invalid_argument("LogFMT needs hidden % 128 == 0, got " + std::to_string(hidden));
}

float bits_float(uint32_t u) {
  float f;
  std::memcpy(&f, &u, sizeof f);
  return f;
}

}  // namespace

int64_t logfmt_row_bytes(int hidden) {
  require_groups(hidden);
  return epx::logfmt_row_bytes(hidden);
}

void logfmt_encode_row(const uint16_t* x, int hidden, uint8_t* out) {
  require_groups(hidden);
  std::memset(out, 0, size_t(epx::logfmt_row_bytes(hidden)));
  for (int g = 0; g < hidden / kLogfmtGroup; ++g) {
    const uint16_t* v = x + int64_t(g) * kLogfmtGroup;
    int max_level = kLogfmtNoLevel;
    for (int i = 0; i < kLogfmtGroup; ++i) {
      const int level = logfmt_level(v[i]);
      if (level > max_level) max_level = level;
    }
    const int top = logfmt_top(max_level);
    const uint16_t top16 = uint16_t(int16_t(top));
    uint8_t* header = out + logfmt_top_offset(g);
    header[0] = uint8_t(top16 & 0xff);
    header[1] = uint8_t(top16 >> 8);
    uint8_t* low = out + logfmt_low_offset(g);
    uint8_t* high = out + logfmt_high_offset(g);
    for (int i = 0; i < kLogfmtGroup; ++i) {
      const uint32_t word = logfmt_encode(v[i], logfmt_level(v[i]), top);
      low[i] = uint8_t(word & 0xff);
      high[i / 4] |= uint8_t((word >> 8) << (2 * (i % 4)));
    }
  }
}

void logfmt_decode_row(const uint8_t* in, int hidden, float* out) {
  require_groups(hidden);
  for (int g = 0; g < hidden / kLogfmtGroup; ++g) {
    const uint8_t* header = in + logfmt_top_offset(g);
    const int top = int16_t(uint16_t(header[0] | header[1] << 8));
    const uint8_t* low = in + logfmt_low_offset(g);
    const uint8_t* high = in + logfmt_high_offset(g);
    for (int i = 0; i < kLogfmtGroup; ++i) {
      const uint32_t word = low[i] | uint32_t((high[i / 4] >> (2 * (i % 4))) & 3) << 8;
      out[int64_t(g) * kLogfmtGroup + i] = bits_float(logfmt_decode(word, top));
    }
  }
}

void low_latency_combine_row_logfmt(int hidden, const int64_t* idx, const float* w, int num_topk, int num_experts,
                                    const ExpertRow& row, uint16_t* out) {
  require_groups(hidden);
  std::vector<float> acc(hidden, 0.f), decoded(hidden);
  std::vector<uint8_t> encoded(size_t(epx::logfmt_row_bytes(hidden)));
  for (int k = 0; k < num_topk; ++k) {
    if (idx[k] < 0 || idx[k] >= num_experts) continue;
    logfmt_encode_row(row(idx[k]), hidden, encoded.data());
    logfmt_decode_row(encoded.data(), hidden, decoded.data());
    for (int h = 0; h < hidden; ++h) {
      volatile float product = w[k] * decoded[h];  // rounded to float32 before the add (semantics.md section 5)
      acc[h] = acc[h] + product;
    }
  }
  for (int h = 0; h < hidden; ++h) out[h] = float_to_bf16(acc[h]);
}

}  // namespace epx::ref
