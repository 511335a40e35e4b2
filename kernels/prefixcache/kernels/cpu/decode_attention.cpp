// Attention of decodes (one new query per sequence) over their paged keys and values, float32, AVX-512.
//
// Why it exists: torch's SDPA needs each decode's keys and values gathered into contiguous tensors
// first (or kept staged between steps), which copies every position it then reads. This kernel reads
// them through the block tables in place, once.
//
// Work: one item per (decode, key/value head, split of at most kSplit positions); long sequences are
// split so that a few decodes still keep every thread busy. An item scores its positions for all the
// query heads sharing the key/value head (GQA), takes their softmax in base 2 and sums the values;
// the splits of a (decode, head) are then merged by their maxima and sums. Splits fall at fixed
// positions, so a sequence's result does not depend on the rest of the batch.
#include "kernels.h"
#include "vector_math.h"

#include <ATen/Parallel.h>
#include <immintrin.h>

#include <algorithm>
#include <cmath>
#include <limits>
#include <vector>

namespace {

constexpr int kSplit = 512;  // positions per work item at most
constexpr int kMaxGroup = 16;  // query heads per key/value head
constexpr int kPrefetchAhead = 16;  // positions
constexpr float kLog2e = 1.4426950408889634f;

struct Problem {
  const float* query;  // rows `query_row_stride` apart, [.., num_q_heads, head_dim] each
  int64_t query_row_stride;
  const int64_t* token_rows;  // [num_decodes]: each decode's row in query and out
  const float* key_cache;     // [num_blocks, block_size, num_kv_heads, head_dim], contiguous
  const float* value_cache;
  const int64_t* block_tables;  // [num_decodes, table_width]
  int64_t table_width;
  const int64_t* seq_lens;  // [num_decodes]
  float* out;               // rows like query's, contiguous [.., num_q_heads, head_dim]
  int num_decodes, num_q_heads, num_kv_heads, block_size;
  float scale;
};

// One split's softmax statistics for each of the group's heads (its weighted values are kept beside).
struct Partial {
  float max[kMaxGroup];
  float sum[kMaxGroup];
};

// Asks for one head's key (or value) row a few positions ahead: blocks lie anywhere in the cache, and
// a position's head is one short run of every row, so the hardware prefetchers do not see it coming.
template <int kHeadDim>
inline void prefetch_head(const float* row) {
  for (int i = 0; i < kHeadDim; i += 16) _mm_prefetch(reinterpret_cast<const char*>(row + i), _MM_HINT_T0);
}

// kGroup: the query heads per key/value head, or 0 to read it from the problem. Known at compile
// time, the loops over the group unroll and the value accumulators stay in registers (held in an
// array indexed at run time, they went through memory on every multiply-add).
template <int kHeadDim, int kGroup>
__attribute__((target("avx512f"))) void attend_split(const Problem& pb, int decode, int kv_head, int start,
                                                     int end, Partial& partial, float* values_out) {
  constexpr int kVecs = kHeadDim / 16;
  constexpr int kGroupCapacity = kGroup ? kGroup : kMaxGroup;
  const int group = kGroup ? kGroup : pb.num_q_heads / pb.num_kv_heads;
  const int count = end - start;
  const int64_t position_stride = static_cast<int64_t>(pb.num_kv_heads) * kHeadDim;
  const int64_t* table = pb.block_tables + decode * pb.table_width;

  __m512 query[kGroupCapacity][kVecs];
  const float* query_row = pb.query + pb.token_rows[decode] * pb.query_row_stride + kv_head * group * kHeadDim;
  const __m512 query_scale = _mm512_set1_ps(pb.scale * kLog2e);  // scores in base 2
  for (int g = 0; g < group; ++g)
    for (int c = 0; c < kVecs; ++c)
      query[g][c] = _mm512_mul_ps(_mm512_loadu_ps(query_row + g * kHeadDim + c * 16), query_scale);

  std::vector<int64_t> offsets(count);  // of each position's key (and value) in its cache
  for (int j = 0; j < count; ++j) {
    const int position = start + j;
    const int64_t slot = table[position / pb.block_size] * pb.block_size + position % pb.block_size;
    offsets[j] = slot * position_stride + kv_head * kHeadDim;
  }
  const int padded = (count + 15) / 16 * 16;
  std::vector<float> scores(static_cast<size_t>(group) * padded, -std::numeric_limits<float>::infinity());
  for (int j = 0; j < count; ++j) {
    if (j + kPrefetchAhead < count) prefetch_head<kHeadDim>(pb.key_cache + offsets[j + kPrefetchAhead]);
    __m512 key[kVecs];
    for (int c = 0; c < kVecs; ++c) key[c] = _mm512_loadu_ps(pb.key_cache + offsets[j] + c * 16);
    for (int g = 0; g < group; ++g) {
      __m512 dot = _mm512_mul_ps(query[g][0], key[0]);
      for (int c = 1; c < kVecs; ++c) dot = _mm512_fmadd_ps(query[g][c], key[c], dot);
      scores[g * padded + j] = _mm512_reduce_add_ps(dot);
    }
  }
  for (int g = 0; g < group; ++g) {
    float* s = scores.data() + g * padded;
    __m512 max = _mm512_loadu_ps(s);
    for (int j = 16; j < padded; j += 16) max = _mm512_max_ps(max, _mm512_loadu_ps(s + j));
    const float row_max = _mm512_reduce_max_ps(max);
    const __m512 shift = _mm512_set1_ps(row_max);
    __m512 sum = _mm512_setzero_ps();
    for (int j = 0; j < padded; j += 16) {
      const __m512 p = exp2_nonpositive(_mm512_sub_ps(_mm512_loadu_ps(s + j), shift));
      _mm512_storeu_ps(s + j, p);
      sum = _mm512_add_ps(sum, p);
    }
    partial.max[g] = row_max;
    partial.sum[g] = _mm512_reduce_add_ps(sum);
  }

  __m512 acc[kGroupCapacity][kVecs];
  for (int g = 0; g < group; ++g)
    for (int c = 0; c < kVecs; ++c) acc[g][c] = _mm512_setzero_ps();
  for (int j = 0; j < count; ++j) {
    if (j + kPrefetchAhead < count) prefetch_head<kHeadDim>(pb.value_cache + offsets[j + kPrefetchAhead]);
    const float* value = pb.value_cache + offsets[j];
    __m512 v[kVecs];
    for (int c = 0; c < kVecs; ++c) v[c] = _mm512_loadu_ps(value + c * 16);
    for (int g = 0; g < group; ++g) {
      const __m512 p = _mm512_set1_ps(scores[g * padded + j]);
      for (int c = 0; c < kVecs; ++c) acc[g][c] = _mm512_fmadd_ps(p, v[c], acc[g][c]);
    }
  }
  for (int g = 0; g < group; ++g)
    for (int c = 0; c < kVecs; ++c) _mm512_storeu_ps(values_out + g * kHeadDim + c * 16, acc[g][c]);
}

using SplitFunction = void (*)(const Problem&, int, int, int, int, Partial&, float*);

// The common group sizes get their own compiled split; larger ones share the general one.
template <int kHeadDim>
SplitFunction split_for_group(int group) {
  switch (group) {
    case 1: return attend_split<kHeadDim, 1>;
    case 2: return attend_split<kHeadDim, 2>;
    case 3: return attend_split<kHeadDim, 3>;
    case 4: return attend_split<kHeadDim, 4>;
    case 6: return attend_split<kHeadDim, 6>;
    case 8: return attend_split<kHeadDim, 8>;
    default: return attend_split<kHeadDim, 0>;
  }
}

template <int kHeadDim>
void attend_all(const Problem& pb) {
  const int group = pb.num_q_heads / pb.num_kv_heads;
  const SplitFunction attend_split_of_group = split_for_group<kHeadDim>(group);
  std::vector<int64_t> first_item(pb.num_decodes + 1, 0);  // items of decode d: per head, its splits
  for (int d = 0; d < pb.num_decodes; ++d) {
    const int64_t splits = (pb.seq_lens[d] + kSplit - 1) / kSplit;
    first_item[d + 1] = first_item[d] + splits * pb.num_kv_heads;
  }
  const int64_t num_items = first_item[pb.num_decodes];
  std::vector<Partial> partials(num_items);
  std::vector<float> values(static_cast<size_t>(num_items) * group * kHeadDim);
  at::parallel_for(0, num_items, 1, [&](int64_t begin, int64_t end) {
    int d = static_cast<int>(std::upper_bound(first_item.begin(), first_item.end(), begin) - first_item.begin()) - 1;
    for (int64_t item = begin; item < end; ++item) {
      while (item >= first_item[d + 1]) ++d;
      const int64_t splits = (pb.seq_lens[d] + kSplit - 1) / kSplit;
      const int64_t local = item - first_item[d];
      const int kv_head = static_cast<int>(local / splits), split = static_cast<int>(local % splits);
      const int start = split * kSplit, stop = std::min<int64_t>(start + kSplit, pb.seq_lens[d]);
      attend_split_of_group(pb, d, kv_head, start, stop, partials[item],
                             values.data() + item * group * kHeadDim);
    }
  });
  // Merge each (decode, head)'s splits: weights 2^(max_k - max), normalised by the weighted sums.
  for (int d = 0; d < pb.num_decodes; ++d) {
    const int64_t splits = (pb.seq_lens[d] + kSplit - 1) / kSplit;
    float* out_row = pb.out + pb.token_rows[d] * static_cast<int64_t>(pb.num_q_heads) * kHeadDim;
    for (int h = 0; h < pb.num_kv_heads; ++h) {
      const int64_t first = first_item[d] + h * splits;
      for (int g = 0; g < group; ++g) {
        float max = -std::numeric_limits<float>::infinity();
        for (int64_t k = 0; k < splits; ++k) max = std::max(max, partials[first + k].max[g]);
        float total = 0.f;
        float* dst = out_row + (h * group + g) * kHeadDim;
        std::fill_n(dst, kHeadDim, 0.f);
        for (int64_t k = 0; k < splits; ++k) {
          const float weight = std::exp2(partials[first + k].max[g] - max);
          total += partials[first + k].sum[g] * weight;
          const float* src = values.data() + ((first + k) * group + g) * kHeadDim;
          for (int i = 0; i < kHeadDim; ++i) dst[i] += src[i] * weight;
        }
        const float inverse = 1.f / total;
        for (int i = 0; i < kHeadDim; ++i) dst[i] *= inverse;
      }
    }
  }
}

}  // namespace

void decode_attention(const at::Tensor& query, const at::Tensor& token_rows, const at::Tensor& key_cache,
                      const at::Tensor& value_cache, const at::Tensor& block_tables, const at::Tensor& seq_lens,
                      double scale, at::Tensor out) {
  check_attention_arguments(query, key_cache, value_cache, out);
  const int64_t num_decodes = token_rows.numel();
  for (const at::Tensor* index : {&token_rows, &seq_lens})
    TORCH_CHECK(index->dtype() == at::kLong && index->is_contiguous() && index->device().is_cpu() &&
                    index->numel() == num_decodes, "token_rows and seq_lens: contiguous int64, one per decode");
  TORCH_CHECK(block_tables.dtype() == at::kLong && block_tables.dim() == 2 && block_tables.is_contiguous() &&
                  block_tables.device().is_cpu() && block_tables.size(0) == num_decodes,
              "block_tables: contiguous int64 [num_decodes, width]");
  const int head_dim = query.size(2);
  TORCH_CHECK(query.size(1) / key_cache.size(2) <= kMaxGroup, "at most 16 query heads per kv head");
  const int64_t* rows = token_rows.data_ptr<int64_t>();
  const int64_t* lens = seq_lens.data_ptr<int64_t>();
  for (int64_t d = 0; d < num_decodes; ++d) {
    TORCH_CHECK(rows[d] >= 0 && rows[d] < query.size(0) && lens[d] >= 1 &&
                    (lens[d] + key_cache.size(1) - 1) / key_cache.size(1) <= block_tables.size(1),
                "decode ", d, ": a row outside the batch, or more positions than its table holds");
    check_block_ids(block_tables.data_ptr<int64_t>() + d * block_tables.size(1), lens[d], key_cache.size(1),
                    key_cache.size(0));
  }
  Problem pb{query.data_ptr<float>(), query.stride(0), rows, key_cache.data_ptr<float>(),
             value_cache.data_ptr<float>(), block_tables.data_ptr<int64_t>(), block_tables.size(1), lens,
             out.data_ptr<float>(), static_cast<int>(num_decodes), static_cast<int>(query.size(1)),
             static_cast<int>(key_cache.size(2)), static_cast<int>(key_cache.size(1)), static_cast<float>(scale)};
  if (head_dim == 64)
    attend_all<64>(pb);
  else
    attend_all<128>(pb);
}
