#include <torch/extension.h>

#include "kernels.h"

bool supported() { return __builtin_cpu_supports("avx512f"); }

void check_attention_arguments(const at::Tensor& query, const at::Tensor& key_cache, const at::Tensor& value_cache,
                               const at::Tensor& out) {
  TORCH_CHECK(supported(), "this CPU has no AVX-512");
  for (const at::Tensor* tensor : {&query, &key_cache, &value_cache, &out})
    TORCH_CHECK(tensor->dtype() == at::kFloat && tensor->device().is_cpu(), "float32 CPU tensors only");
  TORCH_CHECK(key_cache.dim() == 4 && key_cache.is_contiguous() && value_cache.is_contiguous() &&
                  key_cache.sizes() == value_cache.sizes() && key_cache.size(2) > 0,
              "caches: contiguous and alike, [num_blocks, block_size, num_kv_heads, head_dim]");
  TORCH_CHECK(query.dim() == 3 && query.size(2) == key_cache.size(3) && query.stride(2) == 1 &&
                  query.stride(1) == query.size(2) && query.size(1) % key_cache.size(2) == 0,
              "query: [tokens, a multiple of the cache's kv heads, the cache's head_dim], heads packed");
  TORCH_CHECK(out.is_contiguous() && out.sizes() == query.sizes(), "out: contiguous, the query's shape");
  TORCH_CHECK(query.size(2) == 64 || query.size(2) == 128, "head_dim 64 or 128");
}

void check_block_ids(const int64_t* table, int64_t seq_len, int64_t block_size, int64_t num_blocks) {
  for (int64_t i = 0; i < (seq_len + block_size - 1) / block_size; ++i)
    TORCH_CHECK(table[i] >= 0 && table[i] < num_blocks, "block id ", table[i], " is outside the cache's ", num_blocks,
                " blocks");
}

PYBIND11_MODULE(TORCH_EXTENSION_NAME, m) {
  m.def("supported", &supported, "whether this CPU runs the kernels (AVX-512)");
  m.def("prefill_attention", &prefill_attention, "causal paged prefill attention, float32");
  m.def("decode_attention", &decode_attention, "paged decode attention, float32");
  m.def("rms_norm", &rms_norm, "RMSNorm, float32");
  m.def("add_rms_norm_", &add_rms_norm_, "residual add, then RMSNorm in place, float32");
  m.def("silu_and_mul", &silu_and_mul, "SwiGLU's silu(gate) * up, float32");
  m.def("rotate_", &rotate_, "rotary embedding in place, float32");
  m.def("pack_few_row_weight", &pack_few_row_weight, "a linear weight packed for few_row_linear");
  m.def("pack_few_row_blocks", &pack_few_row_blocks, "a linear weight as exact 4- or 8-bit blocks, or None");
  m.def("few_row_linear", &few_row_linear, "x @ W.T (+ bias) for up to 128 rows, float32");
}
