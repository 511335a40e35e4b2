// Causal flash attention of one sequence's prefill chunk over the paged KV cache, float32, AVX-512.
//
// Why it exists: torch's CPU flash kernel needs contiguous keys and values (a chunk after cached
// context pays a gather, and two calls merged by their log-sum-exp) and reaches about half of this
// CPU's float32 peak on SmolLM2's shapes. This kernel reads the keys and values through the block
// table and keeps both matrix products in registers, which makes it faster than torch's kernel on
// fresh prefills and on chunks after cached context alike (`benchmarks/kernels_cpu.py` compares them).
//
// Work: one item per (key/value head, tile of query tokens). An item's rows are its tokens times the
// query heads sharing that key/value head (GQA), so every key tile copied out of the cache serves all
// of them. Per tile of 64 keys: scores, the online softmax in base 2 (queries are pre-scaled by
// scale * log2 e), then the weighted values. Items are taken from a shared counter, longest first,
// so the causal triangle's uneven items balance over the threads.
//
// A row's result does not depend on how the rows were cut into chunks: it always walks the key tiles
// from position 0 in the same order, and keys after it weigh exactly 0. So a prompt computed cold and
// the same prompt computed after a cache hit get bit-identical attention for every chunk of two
// tokens or more (the serving path runs a one-token chunk as it runs a decode).
#include "kernels.h"
#include "vector_math.h"

#include <ATen/Parallel.h>
#include <immintrin.h>

#include <algorithm>
#include <atomic>
#include <cmath>
#include <limits>
#include <type_traits>
#include <vector>

namespace {

constexpr int kKeyTile = 64;      // keys per tile
constexpr int kRowsPerItem = 96;  // query rows (tokens x group) an item aims for
constexpr int kRowVectors = 3;    // rows per register block, in vectors of 16
constexpr int kRowBlock = 16 * kRowVectors;  // rows per full register block
constexpr int kKeyBlock = 8;      // keys (scores) or head dims (values) per register block
constexpr float kLog2e = 1.4426950408889634f;

// Everything below is laid out rows-last ([key or dim][row]), so the softmax runs down the key axis
// with whole vectors of rows: no horizontal reductions, and both products broadcast from the packed
// keys and values, which are plain rows copied out of the cache.

// scores[j][r] = sum_d keys[j][d] * queries_t[d][r] for 8 keys x 16 * kVectors rows.
template <int kHeadDim, int kVectors>
__attribute__((target("avx512f"), noinline)) void score_block(const float* queries_t, int padded_rows,
                                                           const float* keys, float* scores) {
  __m512 acc[kKeyBlock][kVectors];
  for (int j = 0; j < kKeyBlock; ++j)
    for (int v = 0; v < kVectors; ++v) acc[j][v] = _mm512_setzero_ps();
  for (int d = 0; d < kHeadDim; ++d) {
    __m512 q[kVectors];
    for (int v = 0; v < kVectors; ++v) q[v] = _mm512_loadu_ps(queries_t + d * padded_rows + 16 * v);
#pragma GCC unroll 8
    for (int j = 0; j < kKeyBlock; ++j) {
      const __m512 k = _mm512_set1_ps(keys[j * kHeadDim + d]);
      for (int v = 0; v < kVectors; ++v) acc[j][v] = _mm512_fmadd_ps(k, q[v], acc[j][v]);
    }
  }
  for (int j = 0; j < kKeyBlock; ++j)
    for (int v = 0; v < kVectors; ++v) _mm512_storeu_ps(scores + j * padded_rows + 16 * v, acc[j][v]);
}

// out_t[d][r] = out_t[d][r] * rescale[r] + sum_j probs[j][r] * values[j][d] for 8 dims x 16 * kVectors rows.
template <int kHeadDim, int kVectors>
__attribute__((target("avx512f"), noinline)) void value_block(const float* probs, int padded_rows, int num_keys,
                                                           const float* values, const float* rescale,
                                                           float* out_t) {
  __m512 acc[kKeyBlock][kVectors];
  for (int v = 0; v < kVectors; ++v) {
    const __m512 alpha = _mm512_loadu_ps(rescale + 16 * v);
    for (int d = 0; d < kKeyBlock; ++d)
      acc[d][v] = _mm512_mul_ps(_mm512_loadu_ps(out_t + d * padded_rows + 16 * v), alpha);
  }
  for (int j = 0; j < num_keys; ++j) {
    __m512 p[kVectors];
    for (int v = 0; v < kVectors; ++v) p[v] = _mm512_loadu_ps(probs + j * padded_rows + 16 * v);
#pragma GCC unroll 8
    for (int d = 0; d < kKeyBlock; ++d) {
      const __m512 value = _mm512_set1_ps(values[j * kHeadDim + d]);
      for (int v = 0; v < kVectors; ++v) acc[d][v] = _mm512_fmadd_ps(value, p[v], acc[d][v]);
    }
  }
  for (int d = 0; d < kKeyBlock; ++d)
    for (int v = 0; v < kVectors; ++v) _mm512_storeu_ps(out_t + d * padded_rows + 16 * v, acc[d][v]);
}

// Calls block(r, vectors) for each register block of rows, `vectors` a std::integral_constant: full
// blocks of kRowVectors vectors, then one of the one or two left. Rows are padded to a vector only,
// so a short chunk does not compute up to 32 rows of padding.
template <typename Block>
void for_each_row_block(int padded_rows, Block&& block) {
  int r = 0;
  for (; r + kRowBlock <= padded_rows; r += kRowBlock) block(r, std::integral_constant<int, kRowVectors>{});
  if (padded_rows - r == 32) block(r, std::integral_constant<int, 2>{});
  if (padded_rows - r == 16) block(r, std::integral_constant<int, 1>{});
}

struct Problem {
  const float* query;  // [num_tokens, num_q_heads, head_dim], rows `query_row_stride` apart
  int64_t query_row_stride;
  const float* key_cache;  // [num_blocks, block_size, num_kv_heads, head_dim], contiguous
  const float* value_cache;
  const int64_t* block_table;  // the sequence's blocks, in order
  float* out;                  // [num_tokens, num_q_heads, head_dim], contiguous
  int num_tokens, num_q_heads, num_kv_heads, block_size, seq_len;
  float scale;
};

template <int kHeadDim>
__attribute__((target("avx512f"))) void attend_item(const Problem& pb, int kv_head, int first_token,
                                                    int num_item_tokens) {
  const int group = pb.num_q_heads / pb.num_kv_heads;
  const int rows = num_item_tokens * group;  // row r: token first_token + r / group, head r % group
  const int padded_rows = (rows + 15) / 16 * 16;
  const int first_position = pb.seq_len - pb.num_tokens + first_token;  // of the item's first token
  const float infinity = std::numeric_limits<float>::infinity();

  std::vector<float> queries_t(kHeadDim * padded_rows, 0.f), out_t(kHeadDim * padded_rows, 0.f);
  std::vector<float> scores(kKeyTile * padded_rows), row_max(padded_rows, -infinity), row_sum(padded_rows, 0.f);
  std::vector<float> rescale(padded_rows), row_position(padded_rows, infinity);
  alignas(64) float keys[kKeyTile * kHeadDim];
  alignas(64) float values[kKeyTile * kHeadDim];

  const float query_scale = pb.scale * kLog2e;  // scores in base 2
  for (int r = 0; r < rows; ++r) {
    const int token = first_token + r / group;
    const float* query = pb.query + token * pb.query_row_stride + (kv_head * group + r % group) * kHeadDim;
    for (int d = 0; d < kHeadDim; ++d) queries_t[d * padded_rows + r] = query[d] * query_scale;
    row_position[r] = static_cast<float>(first_position + r / group);
  }

  const int64_t position_stride = static_cast<int64_t>(pb.num_kv_heads) * kHeadDim;
  const int end = first_position + num_item_tokens;  // past the last position the item sees
  for (int key_start = 0; key_start < end; key_start += kKeyTile) {
    const int num_keys = std::min(kKeyTile, end - key_start);
    const int padded_keys = (num_keys + kKeyBlock - 1) / kKeyBlock * kKeyBlock;
    for (int j = 0; j < padded_keys; ++j) {
      if (j < num_keys) {
        const int position = key_start + j;
        const int64_t slot = pb.block_table[position / pb.block_size] * pb.block_size + position % pb.block_size;
        const int64_t offset = slot * position_stride + kv_head * kHeadDim;
        std::copy_n(pb.key_cache + offset, kHeadDim, keys + j * kHeadDim);
        std::copy_n(pb.value_cache + offset, kHeadDim, values + j * kHeadDim);
      } else {
        std::fill_n(keys + j * kHeadDim, kHeadDim, 0.f);
      }
    }
    for_each_row_block(padded_rows, [&](int r, auto vectors) {
      for (int j = 0; j < padded_keys; j += kKeyBlock)
        score_block<kHeadDim, decltype(vectors)::value>(queries_t.data() + r, padded_rows, keys + j * kHeadDim,
                                       scores.data() + j * padded_rows + r);
    });

    const bool causal_tile = key_start + num_keys - 1 > first_position;  // some key after some row
    for (int r = 0; r < padded_rows; r += 16) {
      const __m512 position = _mm512_loadu_ps(row_position.data() + r);
      __m512 tile_max = _mm512_set1_ps(-infinity);
      for (int j = 0; j < num_keys; ++j) {
        float* s = scores.data() + j * padded_rows + r;
        __m512 score = _mm512_loadu_ps(s);
        if (causal_tile) {
          const __mmask16 hidden = _mm512_cmp_ps_mask(position, _mm512_set1_ps(key_start + j), _CMP_LT_OQ);
          score = _mm512_mask_mov_ps(score, hidden, _mm512_set1_ps(-infinity));
          _mm512_storeu_ps(s, score);
        }
        tile_max = _mm512_max_ps(tile_max, score);
      }
      const __m512 old_max = _mm512_loadu_ps(row_max.data() + r);
      const __m512 new_max = _mm512_max_ps(old_max, tile_max);
      __m512 sum = _mm512_setzero_ps();
      for (int j = 0; j < num_keys; ++j) {
        float* s = scores.data() + j * padded_rows + r;
        const __m512 p = exp2_nonpositive(_mm512_sub_ps(_mm512_loadu_ps(s), new_max));
        _mm512_storeu_ps(s, p);
        sum = _mm512_add_ps(sum, p);
      }
      const __m512 alpha = exp2_nonpositive(_mm512_sub_ps(old_max, new_max));  // 0 on the first tile
      _mm512_storeu_ps(rescale.data() + r, alpha);
      _mm512_storeu_ps(row_max.data() + r, new_max);
      _mm512_storeu_ps(row_sum.data() + r, _mm512_fmadd_ps(_mm512_loadu_ps(row_sum.data() + r), alpha, sum));
    }
    for_each_row_block(padded_rows, [&](int r, auto vectors) {
      for (int d = 0; d < kHeadDim; d += kKeyBlock)
        value_block<kHeadDim, decltype(vectors)::value>(scores.data() + r, padded_rows, num_keys, values + d, rescale.data() + r,
                                       out_t.data() + d * padded_rows + r);
    });
  }

  for (int r = 0; r < rows; ++r) {
    const float inverse = 1.f / row_sum[r];
    float* out = pb.out + ((first_token + r / group) * pb.num_q_heads + kv_head * group + r % group) * kHeadDim;
    for (int d = 0; d < kHeadDim; ++d) out[d] = out_t[d * padded_rows + r] * inverse;
  }
}

template <int kHeadDim>
void attend_all(const Problem& pb) {
  const int group = pb.num_q_heads / pb.num_kv_heads;
  const int tokens_per_item = std::max(1, kRowsPerItem / group);
  const int num_tiles = (pb.num_tokens + tokens_per_item - 1) / tokens_per_item;
  const int64_t num_items = static_cast<int64_t>(num_tiles) * pb.num_kv_heads;
  std::atomic<int64_t> next{0};
  at::parallel_for(0, at::get_num_threads(), 1, [&](int64_t, int64_t) {
    for (int64_t item = next++; item < num_items; item = next++) {
      const int tile = num_tiles - 1 - static_cast<int>(item / pb.num_kv_heads);  // last tokens see most keys
      const int first_token = tile * tokens_per_item;
      attend_item<kHeadDim>(pb, static_cast<int>(item % pb.num_kv_heads), first_token,
                            std::min(tokens_per_item, pb.num_tokens - first_token));
    }
  });
}

}  // namespace

// query [num_tokens, num_q_heads, head_dim] (rows may be strided), caches [num_blocks, block_size,
// num_kv_heads, head_dim] contiguous, block_table [>= ceil(seq_len / block_size)] int64; the chunk's
// own keys and values are already in the cache. Writes out [num_tokens, num_q_heads, head_dim].
void prefill_attention(const at::Tensor& query, const at::Tensor& key_cache, const at::Tensor& value_cache,
                       const at::Tensor& block_table, int64_t seq_len, double scale, at::Tensor out) {
  check_attention_arguments(query, key_cache, value_cache, out);
  const int head_dim = query.size(2);
  TORCH_CHECK(block_table.dtype() == at::kLong && block_table.is_contiguous() && block_table.device().is_cpu(),
              "block_table: contiguous int64 on the CPU");
  TORCH_CHECK(seq_len >= query.size(0) && block_table.numel() * key_cache.size(1) >= seq_len,
              "seq_len: at least the query's tokens, and no more positions than the block table holds");
  check_block_ids(block_table.data_ptr<int64_t>(), seq_len, key_cache.size(1), key_cache.size(0));
  Problem pb{query.data_ptr<float>(), query.stride(0), key_cache.data_ptr<float>(), value_cache.data_ptr<float>(),
             block_table.data_ptr<int64_t>(), out.data_ptr<float>(), static_cast<int>(query.size(0)),
             static_cast<int>(query.size(1)), static_cast<int>(key_cache.size(2)), static_cast<int>(key_cache.size(1)),
             static_cast<int>(seq_len), static_cast<float>(scale)};
  if (head_dim == 64)
    attend_all<64>(pb);
  else
    attend_all<128>(pb);
}
