// Token permutation for the grouped GEMMs: count the (token, slot) pairs per local expert,
// prefix-sum them into expert-sorted row ranges and cut those into BM-row tiles, so the
// GEMM grids cover only experts that received tokens (decode touches <= T*k experts).
#pragma once

#include <stdint.h>

namespace k3 {
namespace moe {

struct Schedule {
  int* counts;          // [El] rows per local expert
  int* fill;            // [El] scatter cursors
  int* offsets;         // [El + 1] first sorted row of each expert
  int* tile_expert;     // [max_tiles] local expert of each M tile
  int* tile_row;        // [max_tiles] first sorted row of each M tile
  int* num_tiles;       // [1]
  int* sorted_token;    // [T*k] token of each sorted row
  float* sorted_weight; // [T*k] routing weight of each sorted row
  int* slot_row;        // [T*k] sorted row of assignment (token, slot), -1 where its expert is not local
  // Split-K of the decode GEMVs (decode_gemm.cuh); nullptr: no split
  int* split_count;     // [kSplitCounters + 2] arrivals per (M tile, column block), then the GEMVs' work
                        // counters; zeroed by the schedule kernels
  float* split_part;    // [kSplitItemsMax, kDecodeThreads, <= 16] fp32 partial accumulators per split CTA
};

// Split-K capacity: kSplitItemsMax split items of kSplitAccMax floats per thread (more of fewer
// floats), and at most kSplitCounters (tile, column block) pairs split per GEMV; after those
// counters, one work-item counter per decode GEMV (gate_up, down).
constexpr int kSplitItemsMax = 1024, kSplitCounters = 1022, kSplitAccMax = 16, kDecodeWorkCounters = 2;

// Upper bound on the M tiles: every expert's partial tile plus the full ones.
__host__ __device__ inline int max_m_tiles(int assignments, int num_local_experts, int bm) {
  return assignments / bm + (num_local_experts < assignments ? num_local_experts : assignments);
}

__global__ void count_kernel(const int* __restrict__ topk_ids, int assignments, int expert_offset,
                             int num_local_experts, int* __restrict__ counts) {
  const int i = blockIdx.x * blockDim.x + threadIdx.x;
  if (i >= assignments) return;
  const int local = topk_ids[i] - expert_offset;
  if (local >= 0 && local < num_local_experts) atomicAdd(&counts[local], 1);
}

constexpr int kScanThreads = 1024;

// Exclusive block scan of one value per thread (blockDim.x == kScanThreads); `total` gets the
// sum. Every warp scans the 32 warp sums itself (no warp-0-only branch: shuffles under a
// divergent branch compile to WARPSYNC.COLLECTIVE loops, microseconds in a one-CTA kernel).
__device__ int block_exclusive_scan(int v, int* warp_sums, int& total) {
  const int lane = threadIdx.x % 32, warp = threadIdx.x / 32;
  int inc = v;
#pragma unroll
  for (int off = 1; off < 32; off *= 2) {
    const int o = __shfl_up_sync(0xffffffffu, inc, off);
    if (lane >= off) inc += o;
  }
  if (lane == 31) warp_sums[warp] = inc;
  __syncthreads();
  const int w = warp_sums[lane];
  int winc = w;
#pragma unroll
  for (int off = 1; off < 32; off *= 2) {
    const int o = __shfl_up_sync(0xffffffffu, winc, off);
    if (lane >= off) winc += o;
  }
  const int before = __shfl_sync(0xffffffffu, winc - w, warp);
  total = __shfl_sync(0xffffffffu, winc, 31);
  __syncthreads();  // warp_sums is reused by the next scan
  return before + inc - v;
}

// Offsets and M-tile lists from the per-expert row counts: thread e (of kScanThreads) brings
// expert e's count n (0 past num_local_experts) and gets the expert's first sorted row.
__device__ int build_schedule(const Schedule& s, int n, int num_local_experts, int bm, int* warp_sums) {
  const int e = threadIdx.x;
  const int tiles = (n + bm - 1) / bm;
  int total_rows, total_tiles;
  const int row0 = block_exclusive_scan(n, warp_sums, total_rows);
  const int tile0 = block_exclusive_scan(tiles, warp_sums, total_tiles);
  if (e < num_local_experts) {
    s.offsets[e] = row0;
    for (int j = 0; j < tiles; ++j) {
      s.tile_expert[tile0 + j] = e;
      s.tile_row[tile0 + j] = row0 + j * bm;
    }
  }
  if (e == 0) {
    s.offsets[num_local_experts] = total_rows;
    *s.num_tiles = total_tiles;
  }
  return row0;
}

// The split-K arrival counters start at zero in every forward (each split pair's last CTA also
// resets its own): the workspace comes uninitialised from the caller.
__device__ __forceinline__ void zero_split_counters(const Schedule& s) {
  static_assert(kSplitCounters + kDecodeWorkCounters <= kScanThreads, "one counter per thread of the schedule CTA");
  if (s.split_count != nullptr && threadIdx.x < kSplitCounters + kDecodeWorkCounters) s.split_count[threadIdx.x] = 0;
}

// One CTA of kScanThreads threads; num_local_experts <= kScanThreads.
__global__ void __launch_bounds__(kScanThreads) schedule_kernel(Schedule s, int num_local_experts, int bm) {
  __shared__ int warp_sums[32];
  const int e = threadIdx.x;
  build_schedule(s, e < num_local_experts ? s.counts[e] : 0, num_local_experts, bm, warp_sums);
  if (e < num_local_experts) s.fill[e] = 0;
  zero_split_counters(s);
}

// Row order inside an expert depends on atomic timing; no output bit does: a row's GEMM
// results do not depend on the other rows of its tile or on its place there (every MMA output
// element is its own dot product), and the combine finds a token's rows through slot_row and
// sums them in slot order.
__global__ void scatter_kernel(const int* __restrict__ topk_ids, const float* __restrict__ topk_weights,
                               int assignments, int top_k, int expert_offset, int num_local_experts, Schedule s) {
  const int i = blockIdx.x * blockDim.x + threadIdx.x;
  if (i >= assignments) return;
  const int local = topk_ids[i] - expert_offset;
  if (local < 0 || local >= num_local_experts) {
    s.slot_row[i] = -1;
    return;
  }
  const int pos = s.offsets[local] + atomicAdd(&s.fill[local], 1);
  s.sorted_token[pos] = i / top_k;
  s.sorted_weight[pos] = topk_weights[i];
  s.slot_row[i] = pos;
}

}  // namespace moe
}  // namespace k3
