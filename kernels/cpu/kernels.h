// The native CPU kernels' entry points (bound to Python in module.cpp). Each needs AVX-512: callers
// check `supported()` first.
#pragma once

#include <ATen/ATen.h>

bool supported();

// Causal attention of a sequence's last `query.size(0)` positions over its paged keys and values,
// written into `out` [query_len, num_q_heads, head_dim] (contiguous).
void prefill_attention(const at::Tensor& query, const at::Tensor& key_cache, const at::Tensor& value_cache,
                       const at::Tensor& block_table, int64_t seq_len, double scale, at::Tensor out);

// rms_norm(hidden) * weight, a new tensor.
at::Tensor rms_norm(const at::Tensor& hidden, const at::Tensor& weight, double eps);

// residual += hidden, then hidden = rms_norm(residual) * weight, both in place.
void add_rms_norm_(at::Tensor hidden, at::Tensor residual, const at::Tensor& weight, double eps);

// silu(gate) * up for gate_up = [gate | up] along the last axis; a new contiguous tensor.
at::Tensor silu_and_mul(const at::Tensor& gate_up);

// heads [T, H, D] (rows and heads may be strided) rotated in place: x * cos + swap_halves(x) * signed_sin.
void rotate_(at::Tensor heads, const at::Tensor& cos, const at::Tensor& signed_sin);
