// What the few-row linear kernels share (few_row_linear.cpp, few_row_blocks.cpp): the panel of 32
// output columns both lay their weights out in, and storing one row's sums for a panel.
#pragma once

#include <immintrin.h>

#include <cstdint>

namespace panel_layout {

constexpr int kWidth = 32;      // output columns per panel: two vectors
constexpr int kRowChunk = 8;    // rows kept in registers: 8 x 2 sums
constexpr int kMaxRows = 128;   // what the kernels take (callers use a GEMM beyond)
constexpr int kBlockK = 32;     // k per block in the 4-/8-bit form (GGUF's Q4_1 and Q8_0 block size)

// Stores a row's sums for a panel's first `columns` columns (the last panel of a weight may be partial).
__attribute__((target("avx512f"))) inline void store_row(float* y, __m512 first, __m512 second, int64_t columns) {
  const __mmask16 low = columns >= 16 ? 0xFFFF : static_cast<__mmask16>((1u << columns) - 1);
  const __mmask16 high =
      columns >= 32 ? 0xFFFF : columns <= 16 ? 0 : static_cast<__mmask16>((1u << (columns - 16)) - 1);
  _mm512_mask_storeu_ps(y, low, first);
  _mm512_mask_storeu_ps(y + 16, high, second);
}

}  // namespace panel_layout
