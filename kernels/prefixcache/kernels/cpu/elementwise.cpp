// The decoder's remaining elementwise steps, each one pass over memory instead of several torch ops:
// SwiGLU's silu(gate) * up, and the rotary embedding applied in place. Float32, AVX-512.
//
// silu_and_mul also makes the down projection's input contiguous: gate and up are column halves of
// one projection's output, and a strided input made the matmul copy it first.
#include "kernels.h"
#include "vector_math.h"

#include <ATen/Parallel.h>
#include <immintrin.h>

#include <cmath>

namespace {

__attribute__((target("avx512f"))) void silu_and_mul_row(const float* gate, const float* up, float* out,
                                                         int64_t size) {
  const __m512 one = _mm512_set1_ps(1.f);
  int64_t i = 0;
  for (; i + 16 <= size; i += 16) {
    const __m512 g = _mm512_loadu_ps(gate + i);
    const __m512 silu = _mm512_div_ps(g, _mm512_add_ps(one, exp_ps(_mm512_sub_ps(_mm512_setzero_ps(), g))));
    _mm512_storeu_ps(out + i, _mm512_mul_ps(silu, _mm512_loadu_ps(up + i)));
  }
  for (; i < size; ++i) out[i] = gate[i] / (1.f + std::exp(-gate[i])) * up[i];
}

// One token's heads: x * cos + swap_halves(x) * signed_sin, in torch's order (two products, then
// their sum, no fused multiply-add), so the result is the torch version's to the bit.
__attribute__((target("avx512f"))) void rotate_token(float* heads, int64_t num_heads, int64_t head_stride,
                                                     const float* cos, const float* signed_sin, int64_t head_dim) {
  const int64_t half = head_dim / 2;
  for (int64_t h = 0; h < num_heads; ++h) {
    float* x = heads + h * head_stride;
    int64_t i = 0;
    for (; i + 16 <= half; i += 16) {
      const __m512 first = _mm512_loadu_ps(x + i), second = _mm512_loadu_ps(x + half + i);
      const __m512 new_first = _mm512_add_ps(_mm512_mul_ps(second, _mm512_loadu_ps(signed_sin + i)),
                                             _mm512_mul_ps(first, _mm512_loadu_ps(cos + i)));
      const __m512 new_second = _mm512_add_ps(_mm512_mul_ps(first, _mm512_loadu_ps(signed_sin + half + i)),
                                              _mm512_mul_ps(second, _mm512_loadu_ps(cos + half + i)));
      _mm512_storeu_ps(x + i, new_first);
      _mm512_storeu_ps(x + half + i, new_second);
    }
    for (; i < half; ++i) {
      const float first = x[i], second = x[half + i];
      x[i] = second * signed_sin[i] + first * cos[i];
      x[half + i] = first * signed_sin[half + i] + second * cos[half + i];
    }
  }
}

}  // namespace

at::Tensor silu_and_mul(const at::Tensor& gate_up) {
  TORCH_CHECK(supported(), "this CPU has no AVX-512");
  TORCH_CHECK(gate_up.dtype() == at::kFloat && gate_up.device().is_cpu() && gate_up.dim() == 2 &&
                  gate_up.is_contiguous() && gate_up.size(1) % 2 == 0,
              "gate_up: contiguous float32 [tokens, 2 * intermediate] on the CPU");
  const int64_t rows = gate_up.size(0), size = gate_up.size(1) / 2;
  at::Tensor out = at::empty({rows, size}, gate_up.options());
  const float* in = gate_up.data_ptr<float>();
  float* out_data = out.data_ptr<float>();
  at::parallel_for(0, rows, 4, [&](int64_t begin, int64_t end) {
    for (int64_t row = begin; row < end; ++row)
      silu_and_mul_row(in + row * 2 * size, in + row * 2 * size + size, out_data + row * size, size);
  });
  return out;
}

void rotate_(at::Tensor heads, const at::Tensor& cos, const at::Tensor& signed_sin) {
  TORCH_CHECK(supported(), "this CPU has no AVX-512");
  TORCH_CHECK(heads.dtype() == at::kFloat && heads.device().is_cpu() && heads.dim() == 3 && heads.stride(2) == 1,
              "heads: float32 [T, H, D] on the CPU");
  const int64_t tokens = heads.size(0), num_heads = heads.size(1), head_dim = heads.size(2);
  TORCH_CHECK(head_dim % 2 == 0 && heads.stride(1) >= head_dim && heads.stride(0) >= num_heads * heads.stride(1),
              "heads: an even head_dim, no two heads or tokens overlapping");
  for (const at::Tensor* table : {&cos, &signed_sin})
    TORCH_CHECK(table->dtype() == at::kFloat && table->device().is_cpu() && table->is_contiguous() &&
                    table->numel() == tokens * head_dim, "cos and signed_sin: contiguous float32 [T, 1, D] on the CPU");
  float* data = heads.data_ptr<float>();
  const float* cos_data = cos.data_ptr<float>();
  const float* sin_data = signed_sin.data_ptr<float>();
  const int64_t token_stride = heads.stride(0), head_stride = heads.stride(1);
  at::parallel_for(0, tokens, 16, [&](int64_t begin, int64_t end) {
    for (int64_t t = begin; t < end; ++t)
      rotate_token(data + t * token_stride, num_heads, head_stride, cos_data + t * head_dim, sin_data + t * head_dim,
                   head_dim);
  });
}
