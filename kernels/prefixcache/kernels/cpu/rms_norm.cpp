// Residual add + RMSNorm in one pass over each row, float32, AVX-512.
//
// Why it exists: written with torch ops, a decoder layer's two norms and two residual adds are about
// fifteen kernel launches, each a full pass over the hidden states. At a decode step's few rows the
// launches cost more than the arithmetic; at a prefill's thousand rows the extra passes over memory do.
//
// Same arithmetic as the torch version it replaces, in the same order per element: x * (1 / sqrt(mean
// of squares + eps)), then times the weight; only the sum of squares is added up in another order.
// Every row is computed alike whatever the batch, so a row's result does not depend on its neighbours.
#include "kernels.h"

#include <ATen/Parallel.h>
#include <immintrin.h>

#include <cmath>

namespace {

// out = rms_norm(source) * weight for one row, where source = hidden + residual (stored back into
// residual) when `residual` is given, else hidden. `out` may be `hidden`.
__attribute__((target("avx512f"))) void normalize_row(const float* hidden, float* residual, float* out,
                                                      const float* weight, int64_t size, float eps) {
  __m512 squares = _mm512_setzero_ps();
  int64_t i = 0;
  for (; i + 16 <= size; i += 16) {
    __m512 x = _mm512_loadu_ps(hidden + i);
    if (residual != nullptr) {
      x = _mm512_add_ps(_mm512_loadu_ps(residual + i), x);
      _mm512_storeu_ps(residual + i, x);
    }
    squares = _mm512_fmadd_ps(x, x, squares);
  }
  float sum = _mm512_reduce_add_ps(squares);
  for (; i < size; ++i) {
    const float x = residual != nullptr ? (residual[i] += hidden[i]) : hidden[i];
    sum += x * x;
  }
  const float inverse = 1.f / std::sqrt(sum / static_cast<float>(size) + eps);
  const float* source = residual != nullptr ? residual : hidden;
  const __m512 scale = _mm512_set1_ps(inverse);
  for (i = 0; i + 16 <= size; i += 16) {
    const __m512 normalized = _mm512_mul_ps(_mm512_loadu_ps(source + i), scale);
    _mm512_storeu_ps(out + i, _mm512_mul_ps(normalized, _mm512_loadu_ps(weight + i)));
  }
  for (; i < size; ++i) out[i] = source[i] * inverse * weight[i];
}

void check(const at::Tensor& tensor, const char* name) {
  TORCH_CHECK(tensor.dtype() == at::kFloat && tensor.is_contiguous() && tensor.device().is_cpu(), name,
              ": contiguous float32 on the CPU");
}

void normalize_rows(const at::Tensor& hidden, at::Tensor* residual, at::Tensor& out, const at::Tensor& weight,
                    double eps) {
  TORCH_CHECK(supported(), "this CPU has no AVX-512");
  check(hidden, "hidden");
  check(weight, "weight");
  const int64_t size = hidden.size(-1), rows = hidden.numel() / size;
  TORCH_CHECK(weight.numel() == size, "weight: one value per hidden unit");
  float* residual_data = nullptr;
  if (residual != nullptr) {
    check(*residual, "residual");
    TORCH_CHECK(residual->sizes() == hidden.sizes(), "residual: the shape of hidden");
    residual_data = residual->data_ptr<float>();
  }
  const float* hidden_data = hidden.data_ptr<float>();
  const float* weight_data = weight.data_ptr<float>();
  float* out_data = out.data_ptr<float>();
  at::parallel_for(0, rows, 16, [&](int64_t begin, int64_t end) {
    for (int64_t row = begin; row < end; ++row)
      normalize_row(hidden_data + row * size, residual_data ? residual_data + row * size : nullptr,
                    out_data + row * size, weight_data, size, static_cast<float>(eps));
  });
}

}  // namespace

at::Tensor rms_norm(const at::Tensor& hidden, const at::Tensor& weight, double eps) {
  at::Tensor out = at::empty_like(hidden);
  normalize_rows(hidden, nullptr, out, weight, eps);
  return out;
}

void add_rms_norm_(at::Tensor hidden, at::Tensor residual, const at::Tensor& weight, double eps) {
  normalize_rows(hidden, &residual, hidden, weight, eps);
}
