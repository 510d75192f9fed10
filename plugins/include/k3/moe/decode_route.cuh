// Routing and permutation of a decode-sized batch in one CTA: warp_select_token per token,
// then per-expert counts, the scan, the M-tile lists and the scatter, all through shared
// memory. One launch where the prefill path runs select, count, schedule and scatter kernels
// and a memset of the counts; at T = 1 those launches and their gaps are a tenth of the op.
#pragma once

#include "pdl.cuh"
#include "permute.cuh"
#include "router.cuh"

namespace k3 {
namespace moe {

constexpr int kDecodeRouteMaxTokens = kGemvMaxTokens;

__host__ __device__ inline bool decode_route_applies(int T, int num_experts, int top_k, int num_expert_group) {
  return T <= kDecodeRouteMaxTokens && warp_select_applies(num_experts, top_k, num_expert_group);
}

// One CTA of kScanThreads threads; T <= kDecodeRouteMaxTokens, num_local_experts <= kScanThreads,
// E <= 32 * kPerLane, top_k <= kWarpSelectMaxK. Row order inside an expert follows shared
// atomics (as scatter_kernel); no output bit depends on it (permute.cuh).
template <int kPerLane>
__global__ void __launch_bounds__(kScanThreads, 1) route_schedule_kernel(const float* __restrict__ logits,
                                                                      const float* __restrict__ bias, RouteParams p,
                                                                      int T, int expert_offset, int num_local_experts,
                                                                      int bm, Schedule s) {
  __shared__ int ids[kDecodeRouteMaxTokens * kWarpSelectMaxK];
  __shared__ float weights[kDecodeRouteMaxTokens * kWarpSelectMaxK];
  __shared__ int counts[kScanThreads], first_row[kScanThreads], fill[kScanThreads];
  __shared__ int warp_sums[32];
  const int tid = threadIdx.x, lane = tid % 32, warp = tid / 32, k = p.top_k, assignments = T * k;
  pdl_launch_dependents();
  counts[tid] = 0;
  fill[tid] = 0;
  pdl_wait();  // the logits
  // Warps past T stay idle. (A warp-uniform trip count, every idle warp repeating token T-1 so
  // that the warp reductions compile without the BRA.DIV / WARPSYNC.COLLECTIVE fallback, was
  // slower at T = 1: 13.5 µs against 10.4, the fallback costs one untaken branch when converged.)
  for (int t = warp; t < T; t += kScanThreads / 32) {
    int id;
    float weight;
    warp_select_token<kPerLane>(logits + (size_t)t * p.num_experts, bias, p, id, weight);
    if (lane < k) {
      ids[t * k + lane] = id;
      weights[t * k + lane] = weight;
    }
  }
  __syncthreads();
  for (int i = tid; i < assignments; i += kScanThreads) {
    const int local = ids[i] - expert_offset;
    if (local >= 0 && local < num_local_experts) atomicAdd(&counts[local], 1);
  }
  __syncthreads();
  first_row[tid] = build_schedule(s, tid < num_local_experts ? counts[tid] : 0, num_local_experts, bm, warp_sums);
  __syncthreads();
  for (int i = tid; i < assignments; i += kScanThreads) {
    const int local = ids[i] - expert_offset;
    if (local < 0 || local >= num_local_experts) {
      s.slot_row[i] = -1;
      continue;
    }
    const int pos = first_row[local] + atomicAdd(&fill[local], 1);
    s.sorted_token[pos] = i / k;
    s.sorted_weight[pos] = weights[i];
    s.slot_row[i] = pos;
  }
}

}  // namespace moe
}  // namespace k3
