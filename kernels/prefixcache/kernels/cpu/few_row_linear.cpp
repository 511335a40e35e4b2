// y = x @ W.T (+ bias) for up to 128 rows of x (decode steps, short prefills), float32, AVX-512.
//
// Why it exists: a decode step multiplies a handful of rows by every weight of the model once, so
// it is bound by how fast the weights stream from memory. oneDNN's blocked kernel reaches that
// bound up to 4 rows, but takes clearly longer at 8 rows than at 4, though the memory traffic is the
// same. Streaming panels with software prefetches beats it from 1 row to about 200 (all of a
// model's projections, weights not in cache).
//
// Layout: W [N, K] is packed once into panels of kPanel output columns, [N / kPanel][K][kPanel], so
// a panel is one sequential run of memory. A work item is a panel: for each k, its kPanel weights
// are loaded once and multiplied into every row (up to kRowChunk rows in registers at a time; more
// rows take another pass over the panel, which is then in cache). Each output is summed over k in
// order, so a row's result does not depend on the other rows.
#include "kernels.h"
#include "panel_layout.h"

#include <ATen/Parallel.h>
#include <immintrin.h>

#include <algorithm>

namespace {

using panel_layout::kMaxRows;
using panel_layout::kRowChunk;
constexpr int kPanel = panel_layout::kWidth;
constexpr int kPrefetchAhead = 16;  // k steps (128 bytes each)

template <int kRows>
__attribute__((target("avx512f"))) void panel_rows(const float* x, int64_t x_stride, const float* panel,
                                                   int64_t k_size, const float* bias, float* y, int64_t y_stride,
                                                   int64_t columns) {
  __m512 acc[kRows][2];
  for (int r = 0; r < kRows; ++r) {
    acc[r][0] = bias ? _mm512_loadu_ps(bias) : _mm512_setzero_ps();
    acc[r][1] = bias ? _mm512_loadu_ps(bias + 16) : _mm512_setzero_ps();
  }
  for (int64_t k = 0; k < k_size; ++k) {
    _mm_prefetch(reinterpret_cast<const char*>(panel + (k + kPrefetchAhead) * kPanel), _MM_HINT_T0);
    _mm_prefetch(reinterpret_cast<const char*>(panel + (k + kPrefetchAhead) * kPanel + 16), _MM_HINT_T0);
    const __m512 w0 = _mm512_load_ps(panel + k * kPanel);
    const __m512 w1 = _mm512_load_ps(panel + k * kPanel + 16);
#pragma GCC unroll 8
    for (int r = 0; r < kRows; ++r) {
      const __m512 xr = _mm512_set1_ps(x[r * x_stride + k]);
      acc[r][0] = _mm512_fmadd_ps(xr, w0, acc[r][0]);
      acc[r][1] = _mm512_fmadd_ps(xr, w1, acc[r][1]);
    }
  }
  for (int r = 0; r < kRows; ++r) panel_layout::store_row(y + r * y_stride, acc[r][0], acc[r][1], columns);
}

using PanelRows = void (*)(const float*, int64_t, const float*, int64_t, const float*, float*, int64_t, int64_t);
constexpr PanelRows kPanelRows[kRowChunk] = {panel_rows<1>, panel_rows<2>, panel_rows<3>, panel_rows<4>,
                                             panel_rows<5>, panel_rows<6>, panel_rows<7>, panel_rows<8>};

}  // namespace

at::Tensor pack_few_row_weight(const at::Tensor& weight) {
  TORCH_CHECK(weight.dtype() == at::kFloat && weight.device().is_cpu() && weight.dim() == 2,
              "weight: float32 [out_features, in_features] on the CPU");
  const int64_t n = weight.size(0), k = weight.size(1);
  const int64_t panels = (n + kPanel - 1) / kPanel;
  // Panels start on 64-byte boundaries (the kernel's aligned loads); padded columns are zero.
  at::Tensor packed = at::zeros({panels, k, kPanel}, weight.options());
  TORCH_CHECK(reinterpret_cast<uintptr_t>(packed.data_ptr<float>()) % 64 == 0, "packed weight not 64-byte aligned");
  const at::Tensor source = weight.contiguous();
  const float* w = source.data_ptr<float>();
  float* p = packed.data_ptr<float>();
  at::parallel_for(0, panels, 1, [&](int64_t begin, int64_t end) {
    for (int64_t panel = begin; panel < end; ++panel)
      for (int64_t c = 0; c < std::min<int64_t>(kPanel, n - panel * kPanel); ++c)
        for (int64_t i = 0; i < k; ++i) p[(panel * k + i) * kPanel + c] = w[(panel * kPanel + c) * k + i];
  });
  return packed;
}

at::Tensor few_row_linear(const at::Tensor& x, const at::Tensor& packed, int64_t out_features,
                          const c10::optional<at::Tensor>& bias) {
  TORCH_CHECK(supported(), "this CPU has no AVX-512");
  TORCH_CHECK(x.dtype() == at::kFloat && x.device().is_cpu() && x.dim() == 2 && x.stride(1) == 1,
              "x: float32 [rows, in_features] on the CPU, rows contiguous");
  TORCH_CHECK(x.size(0) <= kMaxRows, "x: at most ", kMaxRows, " rows");
  const bool blocks = is_block_packed(packed);
  const int64_t packed_k = blocks ? packed.size(1) * panel_layout::kBlockK : packed.size(1);
  TORCH_CHECK((blocks || (packed.dtype() == at::kFloat && packed.dim() == 3 && packed.size(2) == kPanel)) &&
                  packed.is_contiguous() && packed_k == x.size(1) &&
                  packed.size(0) == (out_features + kPanel - 1) / kPanel,
              "packed: pack_few_row_weight or pack_few_row_blocks of an [out_features, x.size(1)] weight");
  const float* bias_data = nullptr;
  at::Tensor bias_padded;
  if (bias.has_value() && bias->defined()) {
    TORCH_CHECK(bias->dtype() == at::kFloat && bias->dim() == 1 && bias->size(0) == out_features,
                "bias: float32 [out_features]");
    if (out_features % kPanel == 0 && bias->is_contiguous()) {
      bias_data = bias->data_ptr<float>();
    } else {  // the last panel reads a whole panel's worth of bias
      bias_padded = at::zeros({packed.size(0) * kPanel}, bias->options());
      bias_padded.narrow(0, 0, out_features).copy_(*bias);
      bias_data = bias_padded.data_ptr<float>();
    }
  }
  const int64_t rows = x.size(0), k = x.size(1), panels = packed.size(0);
  at::Tensor y = at::empty({rows, out_features}, x.options());
  if (blocks) {
    few_row_linear_blocks(x.data_ptr<float>(), x.stride(0), rows, packed, bias_data, y.data_ptr<float>(), out_features);
    return y;
  }
  const float* x_data = x.data_ptr<float>();
  const float* p = packed.data_ptr<float>();
  float* y_data = y.data_ptr<float>();
  const int64_t x_stride = x.stride(0);
  at::parallel_for(0, panels, 1, [&](int64_t begin, int64_t end) {
    for (int64_t panel = begin; panel < end; ++panel) {
      const int64_t first_column = panel * kPanel;
      for (int64_t row = 0; row < rows; row += kRowChunk) {
        const int chunk = static_cast<int>(std::min<int64_t>(kRowChunk, rows - row));
        kPanelRows[chunk - 1](x_data + row * x_stride, x_stride, p + panel * k * kPanel, k,
                              bias_data ? bias_data + first_column : nullptr, y_data + row * out_features + first_column,
                              out_features, std::min<int64_t>(kPanel, out_features - first_column));
      }
    }
  });
  return y;
}
