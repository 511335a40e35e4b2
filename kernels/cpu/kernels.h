// The native CPU kernels' entry points (bound to Python in module.cpp). Each needs AVX-512: callers
// check `supported()` first.
#pragma once

#include <ATen/ATen.h>

bool supported();

// Causal attention of a sequence's last `query.size(0)` positions over its paged keys and values.
at::Tensor prefill_attention(const at::Tensor& query, const at::Tensor& key_cache, const at::Tensor& value_cache,
                             const at::Tensor& block_table, int64_t seq_len, double scale);

// rms_norm(hidden) * weight, a new tensor.
at::Tensor rms_norm(const at::Tensor& hidden, const at::Tensor& weight, double eps);

// residual += hidden, then hidden = rms_norm(residual) * weight, both in place.
void add_rms_norm_(at::Tensor hidden, at::Tensor residual, const at::Tensor& weight, double eps);
