// The few-row linear kernel's compact weights: 4-bit and 8-bit blocks that reproduce every float32
// weight to the bit.
//
// Why: a decode step reads every weight of the model once and is bound by memory. Weights that came
// from a GGUF file's Q4_1 or Q8_0 blocks (the embedded model's) are still those blocks after
// dequantization: each run of 32 weights along a row is d * q + m, with d and m half floats and q a
// 4-bit (Q4_1) or d * q with q an 8-bit integer (Q8_0). Packing them so again moves 5 or 8.5 bits a
// weight instead of 32, and the kernel rebuilds each weight exactly: q * d is exact in float32 (11
// by 8 significant bits at most), so q * d + m is the float32 rounding of the same exact value as at
// dequantization. A weight matrix is packed so only if every block passes that check bit for bit;
// anything else keeps the float32 panels (`few_row_linear.cpp`). The forms looked for are those GGUF's
// quantizers make: a 4-bit block's least value is m (level 0) and its greatest level 15, an 8-bit
// block's largest magnitude level 127, d rounded to a half float either way.
//
// Layout: [ceil(N / 32) panels][K / 32 blocks][block bytes]; a panel's block holds its 32 columns' d
// (and m) as half floats, then for each of its 32 k its 32 columns' q: 16 bytes of 4-bit pairs (low
// nibble column j, high nibble column j + 16) or 32 signed bytes. Up to 8 rows, the kernel rebuilds
// each k's 32 weights in registers and multiplies them straight into the rows' sums; more rows, it
// rebuilds a panel block (32 k x 32 columns) into an L1 buffer once and runs every row over it.
// Either way each output is summed over k in order from the bias, exactly as the float32 panels are:
// the two give the same bits.
#include "kernels.h"
#include "panel_layout.h"

#include <ATen/Parallel.h>
#include <c10/util/Half.h>
#include <immintrin.h>

#include <algorithm>
#include <array>
#include <atomic>
#include <cmath>
#include <cstdint>
#include <cstring>
#include <utility>

namespace {

using panel_layout::kMaxRows;
using panel_layout::kRowChunk;
constexpr int kPanel = panel_layout::kWidth;
constexpr int kBlock = panel_layout::kBlockK;

uint32_t bits(float value) {
  uint32_t out;
  std::memcpy(&out, &value, sizeof out);
  return out;
}

float half_value(uint16_t half) { return static_cast<float>(c10::Half(half, c10::Half::from_bits())); }

// Half floats near `estimate` (it and its neighbours), positive and finite, for a block's scale.
int near_halves(float estimate, uint16_t* out) {
  const uint16_t center = c10::Half(estimate).x;
  int count = 0;
  for (int step : {0, -1, 1, -2, 2}) {
    const int candidate = static_cast<int>(center) + step;
    if (candidate <= 0 || candidate >= 0x7C00) continue;  // zero, negative or not finite
    out[count++] = static_cast<uint16_t>(candidate);
  }
  return count;
}

// A block's 4-bit form, v = q * d + m with q in [0, 15], if one reproduces all 32 values.
bool fit_4bit(const float* v, uint16_t& d_out, uint16_t& m_out, uint8_t* q) {
  const float low = *std::min_element(v, v + kBlock), high = *std::max_element(v, v + kBlock);
  const uint16_t m = c10::Half(low).x;
  if (bits(half_value(m)) != bits(low)) return false;
  uint16_t candidates[5] = {0};
  const int count = high == low ? 1 : near_halves((high - low) / 15.f, candidates);
  for (int c = 0; c < count; ++c) {
    const float d = half_value(candidates[c]);
    bool fits = true;
    for (int i = 0; i < kBlock && fits; ++i) {
      const float level = d == 0.f ? 0.f : std::nearbyint((v[i] - low) / d);
      fits = level >= 0.f && level <= 15.f && bits(std::fma(level, d, low)) == bits(v[i]);
      q[i] = static_cast<uint8_t>(level);
    }
    if (fits) {
      d_out = candidates[c];
      m_out = m;
      return true;
    }
  }
  return false;
}

// A block's 8-bit form, v = q * d with q in [-128, 127], if one reproduces all 32 values.
bool fit_8bit(const float* v, uint16_t& d_out, int8_t* q) {
  float largest = 0.f;
  for (int i = 0; i < kBlock; ++i) largest = std::max(largest, std::fabs(v[i]));
  uint16_t candidates[5] = {0};
  const int count = largest == 0.f ? 1 : near_halves(largest / 127.f, candidates);
  for (int c = 0; c < count; ++c) {
    const float d = half_value(candidates[c]);
    bool fits = true;
    for (int i = 0; i < kBlock && fits; ++i) {
      const float level = d == 0.f ? 0.f : std::nearbyint(v[i] / d);
      fits = level >= -128.f && level <= 127.f && bits(level * d) == bits(v[i]);
      q[i] = static_cast<int8_t>(level);
    }
    if (fits) {
      d_out = candidates[c];
      return true;
    }
  }
  return false;
}

// The two formats: bytes per panel block, how to fit and store one column's block, and how to
// rebuild a panel block's 32 x 32 float32 weights (w[k][column]).
struct FourBit {
  static constexpr int64_t kBytes = 2 * kPanel * 2 + kBlock * kPanel / 2;  // d, m, then 32 k x 16 bytes

  static bool pack_column(const float* v, int column, uint8_t* block) {
    uint16_t d, m;
    uint8_t q[kBlock];
    if (!fit_4bit(v, d, m, q)) return false;
    auto* halves = reinterpret_cast<uint16_t*>(block);
    halves[column] = d;
    halves[kPanel + column] = m;
    const int shift = column < 16 ? 0 : 4;
    for (int k = 0; k < kBlock; ++k) block[4 * kPanel + k * 16 + column % 16] |= static_cast<uint8_t>(q[k] << shift);
    return true;
  }

  struct Scales {
    __m512 d0, d1, m0, m1;
  };

  __attribute__((target("avx512f"))) static Scales scales(const uint8_t* block) {
    const auto* halves = reinterpret_cast<const __m256i*>(block);
    return {_mm512_cvtph_ps(_mm256_load_si256(halves)), _mm512_cvtph_ps(_mm256_load_si256(halves + 1)),
            _mm512_cvtph_ps(_mm256_load_si256(halves + 2)), _mm512_cvtph_ps(_mm256_load_si256(halves + 3))};
  }

  // The block's weights at k: columns 0-15 in w0, 16-31 in w1.
  __attribute__((target("avx512f"))) static void weights(const uint8_t* block, const Scales& s, int k, __m512& w0,
                                                         __m512& w1) {
    const __m512i pairs =
        _mm512_cvtepu8_epi32(_mm_load_si128(reinterpret_cast<const __m128i*>(block + 4 * kPanel + k * 16)));
    w0 = _mm512_fmadd_ps(_mm512_cvtepi32_ps(_mm512_and_si512(pairs, _mm512_set1_epi32(0xF))), s.d0, s.m0);
    w1 = _mm512_fmadd_ps(_mm512_cvtepi32_ps(_mm512_srli_epi32(pairs, 4)), s.d1, s.m1);
  }
};

struct EightBit {
  static constexpr int64_t kBytes = kPanel * 2 + kBlock * kPanel;  // d, then 32 k x 32 bytes

  static bool pack_column(const float* v, int column, uint8_t* block) {
    uint16_t d;
    int8_t q[kBlock];
    if (!fit_8bit(v, d, q)) return false;
    reinterpret_cast<uint16_t*>(block)[column] = d;
    for (int k = 0; k < kBlock; ++k) block[2 * kPanel + k * kPanel + column] = static_cast<uint8_t>(q[k]);
    return true;
  }

  struct Scales {
    __m512 d0, d1;
  };

  __attribute__((target("avx512f"))) static Scales scales(const uint8_t* block) {
    const auto* halves = reinterpret_cast<const __m256i*>(block);
    return {_mm512_cvtph_ps(_mm256_load_si256(halves)), _mm512_cvtph_ps(_mm256_load_si256(halves + 1))};
  }

  __attribute__((target("avx512f"))) static void weights(const uint8_t* block, const Scales& s, int k, __m512& w0,
                                                         __m512& w1) {
    const uint8_t* q = block + 2 * kPanel + k * kPanel;
    const __m128i low = _mm_load_si128(reinterpret_cast<const __m128i*>(q));
    const __m128i high = _mm_load_si128(reinterpret_cast<const __m128i*>(q + 16));
    w0 = _mm512_mul_ps(_mm512_cvtepi32_ps(_mm512_cvtepi8_epi32(low)), s.d0);
    w1 = _mm512_mul_ps(_mm512_cvtepi32_ps(_mm512_cvtepi8_epi32(high)), s.d1);
  }
};

// A panel block's 32 x 32 float32 weights, w[k][column], into an L1 buffer.
template <class Format>
__attribute__((target("avx512f"))) void rebuild(const uint8_t* block, float* w) {
  const typename Format::Scales scales = Format::scales(block);
  for (int k = 0; k < kBlock; ++k) {
    __m512 w0, w1;
    Format::weights(block, scales, k, w0, w1);
    _mm512_store_ps(w + k * kPanel, w0);
    _mm512_store_ps(w + k * kPanel + 16, w1);
  }
}

// The weight [N, K] in `Format`'s blocks, or an undefined tensor if some block has no exact form.
template <class Format>
at::Tensor pack(const at::Tensor& weight) {
  const int64_t n = weight.size(0), k = weight.size(1);
  const int64_t panels = (n + kPanel - 1) / kPanel, blocks = k / kBlock;
  at::Tensor packed = at::zeros({panels, blocks, Format::kBytes}, weight.options().dtype(at::kByte));
  TORCH_CHECK(reinterpret_cast<uintptr_t>(packed.data_ptr<uint8_t>()) % 64 == 0, "packed weight not 64-byte aligned");
  const at::Tensor source = weight.contiguous();
  const float* w = source.data_ptr<float>();
  uint8_t* p = packed.data_ptr<uint8_t>();
  std::atomic<bool> exact{true};
  at::parallel_for(0, panels, 1, [&](int64_t begin, int64_t end) {
    for (int64_t panel = begin; panel < end && exact; ++panel)
      for (int64_t b = 0; b < blocks && exact; ++b)
        for (int c = 0; c < std::min<int64_t>(kPanel, n - panel * kPanel); ++c)
          if (!Format::pack_column(w + (panel * kPanel + c) * k + b * kBlock, c,
                                   p + (panel * blocks + b) * Format::kBytes)) {
            exact = false;
            break;
          }
  });
  return exact ? packed : at::Tensor();
}

// Asks for the panel block two blocks after `block` (a panel's blocks lie one after another).
template <class Format>
inline void prefetch_two_blocks_on(const uint8_t* block) {
  for (int64_t line = 0; line < Format::kBytes; line += 64)
    _mm_prefetch(reinterpret_cast<const char*>(block + 2 * Format::kBytes + line), _MM_HINT_T0);
}

// Adds rows [0, kRows) of x's block (32 k) times the rebuilt block w into their accumulators.
template <int kRows>
__attribute__((target("avx512f"))) void accumulate(const float* x, int64_t x_stride, const float* w, float* acc) {
  __m512 sum[kRows][2];
  for (int r = 0; r < kRows; ++r) {
    sum[r][0] = _mm512_load_ps(acc + r * kPanel);
    sum[r][1] = _mm512_load_ps(acc + r * kPanel + 16);
  }
  for (int k = 0; k < kBlock; ++k) {
    const __m512 w0 = _mm512_load_ps(w + k * kPanel), w1 = _mm512_load_ps(w + k * kPanel + 16);
#pragma GCC unroll 8
    for (int r = 0; r < kRows; ++r) {
      const __m512 xr = _mm512_set1_ps(x[r * x_stride + k]);
      sum[r][0] = _mm512_fmadd_ps(xr, w0, sum[r][0]);
      sum[r][1] = _mm512_fmadd_ps(xr, w1, sum[r][1]);
    }
  }
  for (int r = 0; r < kRows; ++r) {
    _mm512_store_ps(acc + r * kPanel, sum[r][0]);
    _mm512_store_ps(acc + r * kPanel + 16, sum[r][1]);
  }
}

using Accumulate = void (*)(const float*, int64_t, const float*, float*);
constexpr Accumulate kAccumulate[kRowChunk] = {accumulate<1>, accumulate<2>, accumulate<3>, accumulate<4>,
                                               accumulate<5>, accumulate<6>, accumulate<7>, accumulate<8>};

// Up to 8 rows of kPanels neighbouring panels: the weights are rebuilt in registers and go straight
// into the sums. A single row takes two panels at a time: with one, its two sums' chains of
// dependent multiply-adds, not the arithmetic, would set the pace.
template <class Format, int kRows, int kPanels>
__attribute__((target("avx512f"))) void panels_few_rows(const float* x, int64_t x_stride, const uint8_t* panel,
                                                        int64_t blocks, const float* bias, float* y, int64_t y_stride,
                                                        int64_t columns_left) {
  __m512 sum[kPanels][kRows][2];
  for (int p = 0; p < kPanels; ++p)
    for (int r = 0; r < kRows; ++r) {
      sum[p][r][0] = bias ? _mm512_loadu_ps(bias + p * kPanel) : _mm512_setzero_ps();
      sum[p][r][1] = bias ? _mm512_loadu_ps(bias + p * kPanel + 16) : _mm512_setzero_ps();
    }
  const int64_t panel_bytes = blocks * Format::kBytes;
  for (int64_t b = 0; b < blocks; ++b) {
    const float* xb = x + b * kBlock;
    typename Format::Scales scales[kPanels];
    for (int p = 0; p < kPanels; ++p) {
      const uint8_t* block = panel + p * panel_bytes + b * Format::kBytes;
      prefetch_two_blocks_on<Format>(block);
      scales[p] = Format::scales(block);
    }
    for (int k = 0; k < kBlock; ++k) {
#pragma GCC unroll 2
      for (int p = 0; p < kPanels; ++p) {
        __m512 w0, w1;
        Format::weights(panel + p * panel_bytes + b * Format::kBytes, scales[p], k, w0, w1);
#pragma GCC unroll 8
        for (int r = 0; r < kRows; ++r) {
          const __m512 xr = _mm512_set1_ps(xb[r * x_stride + k]);
          sum[p][r][0] = _mm512_fmadd_ps(xr, w0, sum[p][r][0]);
          sum[p][r][1] = _mm512_fmadd_ps(xr, w1, sum[p][r][1]);
        }
      }
    }
  }
  for (int p = 0; p < kPanels; ++p) {
    const int64_t columns = std::min<int64_t>(kPanel, columns_left - p * kPanel);
    for (int r = 0; r < kRows; ++r)
      panel_layout::store_row(y + p * kPanel + r * y_stride, sum[p][r][0], sum[p][r][1], columns);
  }
}

template <class Format>
__attribute__((target("avx512f"))) void panel_rows(const float* x, int64_t x_stride, int64_t rows, const uint8_t* panel,
                                                   int64_t blocks, const float* bias, float* y, int64_t y_stride,
                                                   int64_t columns) {
  alignas(64) float w[kBlock * kPanel];
  alignas(64) float acc[kMaxRows * kPanel];
  for (int64_t r = 0; r < rows; ++r)
    for (int c = 0; c < kPanel; ++c) acc[r * kPanel + c] = bias ? bias[c] : 0.f;
  for (int64_t b = 0; b < blocks; ++b) {
    const uint8_t* block = panel + b * Format::kBytes;
    prefetch_two_blocks_on<Format>(block);
    rebuild<Format>(block, w);
    for (int64_t row = 0; row < rows; row += kRowChunk) {
      const int chunk = static_cast<int>(std::min<int64_t>(kRowChunk, rows - row));
      kAccumulate[chunk - 1](x + row * x_stride + b * kBlock, x_stride, w, acc + row * kPanel);
    }
  }
  for (int64_t r = 0; r < rows; ++r)
    panel_layout::store_row(y + r * y_stride, _mm512_load_ps(acc + r * kPanel), _mm512_load_ps(acc + r * kPanel + 16),
                            columns);
}

using FewRows = void (*)(const float*, int64_t, const uint8_t*, int64_t, const float*, float*, int64_t, int64_t);

// panels_few_rows for one panel and 1, 2, ... rows, indexed by rows - 1.
template <class Format, size_t... kIndex>
constexpr std::array<FewRows, sizeof...(kIndex)> few_rows_kernels(std::index_sequence<kIndex...>) {
  return {panels_few_rows<Format, static_cast<int>(kIndex) + 1, 1>...};
}

template <class Format>
void run_blocks(const float* x, int64_t x_stride, int64_t rows, const at::Tensor& packed, const float* bias, float* y,
                int64_t out_features) {
  static constexpr auto kFewRows = few_rows_kernels<Format>(std::make_index_sequence<kRowChunk>());
  const int64_t panels = packed.size(0), blocks = packed.size(1);
  const uint8_t* p = packed.data_ptr<uint8_t>();
  const int64_t group = rows == 1 ? 2 : 1;  // panels per work item
  at::parallel_for(0, (panels + group - 1) / group, 1, [&](int64_t begin, int64_t end) {
    for (int64_t item = begin; item < end; ++item) {
      const int64_t first_panel = item * group, first_column = first_panel * kPanel;
      const uint8_t* panel = p + first_panel * blocks * Format::kBytes;
      const float* panel_bias = bias ? bias + first_column : nullptr;
      const int64_t columns_left = out_features - first_column;
      if (rows > kRowChunk)
        panel_rows<Format>(x, x_stride, rows, panel, blocks, panel_bias, y + first_column, out_features,
                           std::min<int64_t>(kPanel, columns_left));
      else if (group == 2 && first_panel + 1 < panels)
        panels_few_rows<Format, 1, 2>(x, x_stride, panel, blocks, panel_bias, y + first_column, out_features,
                                      columns_left);
      else if (rows >= 1)
        kFewRows[rows - 1](x, x_stride, panel, blocks, panel_bias, y + first_column, out_features, columns_left);
    }
  });
}

}  // namespace

at::Tensor pack_few_row_blocks(const at::Tensor& weight) {
  TORCH_CHECK(weight.dtype() == at::kFloat && weight.device().is_cpu() && weight.dim() == 2,
              "weight: float32 [out_features, in_features] on the CPU");
  if (weight.size(1) == 0 || weight.size(1) % kBlock != 0) return at::Tensor();
  at::Tensor packed = pack<FourBit>(weight);
  return packed.defined() ? packed : pack<EightBit>(weight);
}

bool is_block_packed(const at::Tensor& packed) {
  return packed.dtype() == at::kByte && packed.dim() == 3 &&
         (packed.size(2) == FourBit::kBytes || packed.size(2) == EightBit::kBytes);
}

void few_row_linear_blocks(const float* x, int64_t x_stride, int64_t rows, const at::Tensor& packed,
                           const float* bias, float* y, int64_t out_features) {
  (packed.size(2) == FourBit::kBytes ? run_blocks<FourBit> : run_blocks<EightBit>)(x, x_stride, rows, packed, bias, y,
                                                                                   out_features);
}
