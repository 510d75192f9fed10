// Routing and permutation of a decode-sized batch in one CTA: warp_select_token per token,
// then per-expert counts, the scan, the M-tile lists and the scatter, all through shared
// memory. One launch where the prefill path runs select, count, schedule and scatter kernels
// and a memset of the counts; at T = 1 those launches and their gaps are a tenth of the op.
#pragma once

#include <type_traits>

#include "pdl.cuh"
#include "permute.cuh"
#include "router.cuh"

namespace k3 {
namespace moe {

constexpr int kDecodeRouteMaxTokens = kGemvMaxTokens;

__host__ __device__ inline bool decode_route_applies(int T, int num_experts, int top_k, int num_expert_group) {
  return T <= kDecodeRouteMaxTokens && warp_select_applies(num_experts, top_k, num_expert_group);
}

// Few tokens (T <= kGroupSelectMaxTokens) with sigmoid scores: G = 32 / T warps per token, so
// the selection is not one warp's k serial rounds over E / 32 experts per lane (at T = 1 that
// left 31 of 32 warps idle: ~10 µs). Warp j of a token's group ranks its slice of P·32 experts
// (k rounds over P keys per lane), writing its best min(k, P·32) in order to shared memory; then
// one warp merges the G ordered lists (lane l holds list l's head; k rounds of two warp
// reductions). The order is the one of warp_select_token (larger biased score, then lower id)
// and the weights use the same expressions and summation order, so ids and weights are the
// same bits as the one-warp path. (Softmax scores keep the one-warp path: their row sum would
// run in another order.)
constexpr int kGroupSelectMaxTokens = 16;

__host__ __device__ inline bool group_select_applies(int T, int scoring) {
  return T <= kGroupSelectMaxTokens && scoring == 0;
}

// Phase 1 for warp j of a token's group: experts e0 + lane + 32 i, i < P (those < E).
template <int P>
__device__ __forceinline__ void group_select_slice(const float* __restrict__ row, const float* __restrict__ bias,
                                                   int E, int k, int e0, uint32_t* keys_out, int* ids_out) {
  const int lane = threadIdx.x % 32;
  uint32_t key[P];
#pragma unroll
  for (int i = 0; i < P; ++i) {
    const int e = e0 + lane + 32 * i;
    key[i] = e < E ? select_key(1.f / (1.f + expf(-row[e])) + bias[e]) : 0u;
  }
  const int n = k < 32 * P ? k : 32 * P;
  for (int r = 0; r < n; ++r) {
    uint32_t m = key[0];
#pragma unroll
    for (int i = 1; i < P; ++i) m = max(m, key[i]);
    const uint32_t top = __reduce_max_sync(0xffffffffu, m);
    uint32_t candidate = 0xffffffffu;
#pragma unroll
    for (int i = P - 1; i >= 0; --i)
      if (key[i] == top) candidate = e0 + lane + 32 * i;
    const int best = (int)__reduce_min_sync(0xffffffffu, candidate);
#pragma unroll
    for (int i = 0; i < P; ++i)
      if (e0 + lane + 32 * i == best) key[i] = 0u;
    if (lane == 0) {
      keys_out[r] = top;
      ids_out[r] = best;
    }
  }
  for (int r = n + lane; r < k; r += 32) {  // a short slice: entries below every real one
    keys_out[r] = 0u;
    ids_out[r] = 0x7fffffff;
  }
}

template <typename F>
__device__ __forceinline__ void with_slice_width(int P, F f) {
  if (P <= 1) {
    f(std::integral_constant<int, 1>{});
  } else if (P <= 2) {
    f(std::integral_constant<int, 2>{});
  } else if (P <= 4) {
    f(std::integral_constant<int, 4>{});
  } else if (P <= 8) {
    f(std::integral_constant<int, 8>{});
  } else {
    f(std::integral_constant<int, 16>{});
  }
}

// Phase 2, one warp per token: the token's top k from its group's G ordered lists of k entries.
// Lane r < k returns slot r's id and final weight (warp_select_token's arithmetic).
__device__ __forceinline__ void group_select_merge(const float* __restrict__ row, const RouteParams& p,
                                                   const uint32_t* keys, const int* ids, int G, int& id_out,
                                                   float& weight_out) {
  const int lane = threadIdx.x % 32, k = p.top_k;
  int pos = 0;
  uint32_t head = lane < G ? keys[lane * k] : 0u;
  int head_id = lane < G ? ids[lane * k] : 0x7fffffff;
  int chosen_id = 0;
  for (int r = 0; r < k; ++r) {
    const uint32_t top = __reduce_max_sync(0xffffffffu, head);
    const int best = (int)__reduce_min_sync(0xffffffffu, head == top ? (uint32_t)head_id : 0xffffffffu);
    if (lane == r) chosen_id = best;
    if (lane < G && head == top && head_id == best) {
      ++pos;
      head = pos < k ? keys[lane * k + pos] : 0u;
      head_id = pos < k ? ids[lane * k + pos] : 0x7fffffff;
    }
  }
  const float chosen_weight = lane < k ? 1.f / (1.f + expf(-row[chosen_id])) : 0.f;
  float weight_sum = 0.f;
  for (int r = 0; r < k; ++r) weight_sum += __shfl_sync(0xffffffffu, chosen_weight, r);
  id_out = chosen_id;
  weight_out = (p.renormalize ? chosen_weight / weight_sum : chosen_weight) * p.routed_scaling_factor;
}

// More tokens than that (T > kGroupSelectMaxTokens, sigmoid scores): the single CTA would give
// each token one warp, whose k serial rounds over E / 32 keys per lane (28 at E = 896, past the
// register budget of a 1024-thread CTA) took 46 us at T = 32 on the H200 (ncu, session 18). So a
// kernel of T CTAs selects first, kSelectGroupWarps warps per token with the group select above
// (the same ids and weight bits), into the workspace's ids / weights [T, k], and
// route_schedule_kernel reads them instead of selecting. The other routing paths (more tokens,
// prefill) select with it too for sigmoid scores up to kGroupSelectMaxRows tokens (moe.cu
// launch_select), counting each token's local experts into x.counts when that is given (as
// router_select_warp_kernel does).
constexpr int kSelectGroupWarps = 8;

__host__ __device__ inline bool select_kernel_applies(int T, int scoring) {
  return T > kGroupSelectMaxTokens && scoring == 0;
}

// grid T, kSelectGroupWarps * 32 threads: token blockIdx.x's top k of its logits row.
__global__ void __launch_bounds__(kSelectGroupWarps * 32) route_select_group_kernel(const float* __restrict__ logits,
                                                                                 const float* __restrict__ bias,
                                                                                 RouteParams p, int* __restrict__ ids,
                                                                                 float* __restrict__ weights,
                                                                                 SelectExtras x) {
  __shared__ uint32_t cand_keys[kSelectGroupWarps * kWarpSelectMaxK];
  __shared__ int cand_ids[kSelectGroupWarps * kWarpSelectMaxK];
  const int t = blockIdx.x, warp = threadIdx.x / 32, lane = threadIdx.x % 32, k = p.top_k;
  pdl_launch_dependents();
  pdl_wait();  // the logits
  const float* row = logits + (size_t)t * p.num_experts;
  const int P = (p.num_experts + 32 * kSelectGroupWarps - 1) / (32 * kSelectGroupWarps);
  with_slice_width(P, [&](auto width) {
    constexpr int W = decltype(width)::value;
    group_select_slice<W>(row, bias, p.num_experts, k, warp * 32 * W, cand_keys + warp * k, cand_ids + warp * k);
  });
  __syncthreads();
  if (warp == 0) {
    int id;
    float weight;
    group_select_merge(row, p, cand_keys, cand_ids, kSelectGroupWarps, id, weight);
    if (lane < k) {
      ids[(size_t)t * k + lane] = id;
      weights[(size_t)t * k + lane] = weight;
      const int local = id - x.expert_offset;
      if (x.counts != nullptr && local >= 0 && local < x.num_local_experts) atomicAdd(&x.counts[local], 1);
    }
  }
}

// One CTA of kScanThreads threads; T <= kDecodeRouteMaxTokens, num_local_experts <= kScanThreads,
// E <= 32 * kPerLane, top_k <= kWarpSelectMaxK. selected_ids / selected_weights: the selection
// route_select_group_kernel made ([T, k]), or nullptr to select here. Row order inside an expert
// follows shared atomics (as scatter_kernel); no output bit depends on it (permute.cuh).
template <int kPerLane>
__global__ void __launch_bounds__(kScanThreads, 1) route_schedule_kernel(const float* __restrict__ logits,
                                                                      const float* __restrict__ bias, RouteParams p,
                                                                      int T, int expert_offset, int num_local_experts,
                                                                      int bm, Schedule s,
                                                                      const int* __restrict__ selected_ids,
                                                                      const float* __restrict__ selected_weights) {
  __shared__ int ids[kDecodeRouteMaxTokens * kWarpSelectMaxK];
  __shared__ float weights[kDecodeRouteMaxTokens * kWarpSelectMaxK];
  __shared__ int counts[kScanThreads], first_row[kScanThreads], fill[kScanThreads];
  __shared__ int warp_sums[32];
  __shared__ uint32_t cand_keys[kScanThreads / 32 * kWarpSelectMaxK];  // group_select: each warp's ordered list
  __shared__ int cand_ids[kScanThreads / 32 * kWarpSelectMaxK];
  const int tid = threadIdx.x, lane = tid % 32, warp = tid / 32, k = p.top_k, assignments = T * k;
  pdl_launch_dependents();
  counts[tid] = 0;
  fill[tid] = 0;
  pdl_wait();  // the logits, or the selection
  zero_split_counters(s);
  if (selected_ids != nullptr) {
    for (int i = tid; i < assignments; i += kScanThreads) {
      ids[i] = selected_ids[i];
      weights[i] = selected_weights[i];
    }
  } else if (group_select_applies(T, p.scoring)) {
    // Warps past T stay idle. (A warp-uniform trip count, every idle warp repeating token T-1 so
    // that the warp reductions compile without the BRA.DIV / WARPSYNC.COLLECTIVE fallback, was
    // slower at T = 1: 13.5 µs against 10.4, the fallback costs one untaken branch when converged.)
    constexpr int kWarps = kScanThreads / 32;
    const int G = kWarps / T, t = warp / G, j = warp % G;
    const int P = (p.num_experts + 32 * G - 1) / (32 * G);  // experts per lane of a slice
    const float* row = logits + (size_t)t * p.num_experts;
    if (t < T) {
      with_slice_width(P, [&](auto width) {
        constexpr int W = decltype(width)::value;
        group_select_slice<W>(row, bias, p.num_experts, k, j * 32 * W, cand_keys + warp * k, cand_ids + warp * k);
      });
    }
    __syncthreads();
    if (warp < T) {
      int id;
      float weight;
      group_select_merge(logits + (size_t)warp * p.num_experts, p, cand_keys + warp * G * k, cand_ids + warp * G * k,
                         G, id, weight);
      if (lane < k) {
        ids[warp * k + lane] = id;
        weights[warp * k + lane] = weight;
      }
    }
  } else {
    for (int t = warp; t < T; t += kScanThreads / 32) {
      int id;
      float weight;
      warp_select_token<kPerLane>(logits + (size_t)t * p.num_experts, bias, p, id, weight);
      if (lane < k) {
        ids[t * k + lane] = id;
        weights[t * k + lane] = weight;
      }
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
