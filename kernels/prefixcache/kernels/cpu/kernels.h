// The native CPU kernels' entry points (bound to Python in module.cpp). Each needs AVX-512: callers
// check `supported()` first.
#pragma once

#include <ATen/ATen.h>

bool supported();

// Checks shared by the attention kernels: float32 CPU tensors, caches [num_blocks, block_size,
// num_kv_heads, head_dim] contiguous and alike, query [.., num_q_heads, head_dim] (rows may be strided)
// with num_q_heads a multiple of num_kv_heads, head_dim 64 or 128, `out` contiguous in the query's shape.
void check_attention_arguments(const at::Tensor& query, const at::Tensor& key_cache, const at::Tensor& value_cache,
                               const at::Tensor& out);

// Every block id that positions [0, seq_len) use lies in the cache (a bad id would read outside it).
void check_block_ids(const int64_t* table, int64_t seq_len, int64_t block_size, int64_t num_blocks);

// Causal attention of a sequence's last `query.size(0)` positions over its paged keys and values,
// written into `out` [query_len, num_q_heads, head_dim] (contiguous).
void prefill_attention(const at::Tensor& query, const at::Tensor& key_cache, const at::Tensor& value_cache,
                       const at::Tensor& block_table, int64_t seq_len, double scale, at::Tensor out);

// rms_norm(hidden) * weight, a new tensor.
at::Tensor rms_norm(const at::Tensor& hidden, const at::Tensor& weight, double eps);

// residual += hidden, then hidden = rms_norm(residual) * weight, both in place.
void add_rms_norm_(at::Tensor hidden, at::Tensor residual, const at::Tensor& weight, double eps);

// Attention of decodes: for each d, the query row token_rows[d] over its seq_lens[d] positions in
// block_tables[d], written into the same row of `out` (contiguous, the query's shape).
void decode_attention(const at::Tensor& query, const at::Tensor& token_rows, const at::Tensor& key_cache,
                      const at::Tensor& value_cache, const at::Tensor& block_tables, const at::Tensor& seq_lens,
                      double scale, at::Tensor out);

// silu(gate) * up for gate_up = [gate | up] along the last axis; a new contiguous tensor.
at::Tensor silu_and_mul(const at::Tensor& gate_up);

// heads [T, H, D] (rows and heads may be strided) rotated in place: x * cos + swap_halves(x) * signed_sin.
void rotate_(at::Tensor heads, const at::Tensor& cos, const at::Tensor& signed_sin);

// weight [N, K] packed for few_row_linear: [ceil(N / 32)][K][32], columns past N zero.
at::Tensor pack_few_row_weight(const at::Tensor& weight);

// weight [N, K] as exact 4-bit, else 8-bit blocks (few_row_blocks.cpp); undefined if neither
// reproduces every weight to the bit, or K is not a multiple of 32.
at::Tensor pack_few_row_blocks(const at::Tensor& weight);

// Whether `packed` came from pack_few_row_blocks.
bool is_block_packed(const at::Tensor& packed);

// few_row_linear's arithmetic on block-packed weights: y [rows, out_features] (contiguous) from x
// (rows x_stride apart) and the bias (padded to whole panels, or null).
void few_row_linear_blocks(const float* x, int64_t x_stride, int64_t rows, const at::Tensor& packed,
                           const float* bias, float* y, int64_t out_features);

// x [rows <= 128 (0 too), K] @ weight.T (+ bias) from either packed form: [rows, out_features].
at::Tensor few_row_linear(const at::Tensor& x, const at::Tensor& packed, int64_t out_features,
                          const c10::optional<at::Tensor>& bias);
