// A prefill step's flattened numbering back to sequences: prefill_offsets_kernel
// (prefill_expanded.cuh) numbers the keys of all sequences one after the other (key_offsets)
// and their query tiles likewise (tile_offsets); entry b of either table is the first index of
// sequence b, so each table ascends and starts at 0. The expansion GEMM, the fp8 pass
// dequantisation and both flash kernels map an index back with the same search.
#pragma once

#include <cstdint>

namespace k3::mla {

// The last sequence b in [0, num_seqs) with offsets[b] <= x: the one whose run holds x
// (x >= 0 = offsets[0]; binary search over the read-only table).
__device__ __forceinline__ int sequence_of(const int* offsets, int num_seqs, int x) {
  int lo = 0, hi = num_seqs - 1;
  while (lo < hi) {
    const int mid = (lo + hi + 1) >> 1;
    if (__ldg(offsets + mid) <= x) lo = mid; else hi = mid - 1;
  }
  return lo;
}

// The paged-cache slot (block · block_size + row in the block) of flattened key `key`:
// its sequence's position key - key_offsets[b] looked up in that sequence's block table.
__device__ __forceinline__ int64_t key_slot(const int* key_offsets, const int* block_tables, int num_seqs,
                                            int max_blocks, int block_size, int key) {
  const int seq = sequence_of(key_offsets, num_seqs, key);
  const int pos = key - __ldg(key_offsets + seq);
  const int block = __ldg(block_tables + static_cast<int64_t>(seq) * max_blocks + pos / block_size);
  return static_cast<int64_t>(block) * block_size + pos % block_size;
}

}  // namespace k3::mla
