// Router of the latent MoE (spec §4.6.1): fp32 logits, sigmoid / softmax scores, correction
// bias for selection only, grouped top-k, renormalise, scale. Matches
// k3_trtllm/ops/moe/naive.py::route; ties go to the lower expert id.
#pragma once

#include <cuda_bf16.h>
#include <math.h>
#include <stdint.h>

#include "pdl.cuh"

namespace k3 {
namespace moe {

constexpr int kMaxExperts = 1024;
constexpr int kMaxGroups = 32;

// logits[T, E] = float(x[T, D]) · w[E, D]ᵀ in fp32 on the CUDA cores: each output is one
// sequential fp32 sum over D (the reference's fp32 matmul sums in another order; the
// difference is a few fp32 ulps). 64 x 64 tiles, 256 threads of 4 x 4 outputs. Only for
// D % 8 != 0 now: router_mma.cuh does prefill batches on the tensor cores, as accurately.
constexpr int kLogitTile = 64, kLogitBK = 16;

__global__ void __launch_bounds__(256) router_logits_kernel(const __nv_bfloat16* __restrict__ x,
                                                            const float* __restrict__ w,
                                                            float* __restrict__ logits, int T, int D, int E) {
  __shared__ float xs[kLogitBK][kLogitTile + 4];
  __shared__ float ws[kLogitBK][kLogitTile + 4];
  const int t0 = blockIdx.y * kLogitTile, e0 = blockIdx.x * kLogitTile;
  const int tid = threadIdx.x, tx = tid % 16, ty = tid / 16;
  float acc[4][4] = {};
  for (int k0 = 0; k0 < D; k0 += kLogitBK) {
    for (int i = tid; i < kLogitTile * kLogitBK; i += 256) {
      const int r = i / kLogitBK, k = i % kLogitBK;  // consecutive threads read consecutive k
      const bool kin = k0 + k < D;
      xs[k][r] = (kin && t0 + r < T) ? __bfloat162float(x[(size_t)(t0 + r) * D + k0 + k]) : 0.f;
      ws[k][r] = (kin && e0 + r < E) ? w[(size_t)(e0 + r) * D + k0 + k] : 0.f;
    }
    __syncthreads();
#pragma unroll
    for (int k = 0; k < kLogitBK; ++k) {
      float a[4], b[4];
#pragma unroll
      for (int i = 0; i < 4; ++i) a[i] = xs[k][ty + 16 * i];
#pragma unroll
      for (int j = 0; j < 4; ++j) b[j] = ws[k][tx + 16 * j];
#pragma unroll
      for (int i = 0; i < 4; ++i)
#pragma unroll
        for (int j = 0; j < 4; ++j) acc[i][j] = fmaf(a[i], b[j], acc[i][j]);
    }
    __syncthreads();
  }
#pragma unroll
  for (int i = 0; i < 4; ++i)
#pragma unroll
    for (int j = 0; j < 4; ++j) {
      const int t = t0 + ty + 16 * i, e = e0 + tx + 16 * j;
      if (t < T && e < E) logits[(size_t)t * E + e] = acc[i][j];
    }
}

struct ArgMax {
  float value;
  int index;
};

// The better of two candidates: larger value, then lower index (deterministic ties).
__device__ __forceinline__ ArgMax better(ArgMax a, ArgMax b) {
  return (b.value > a.value || (b.value == a.value && b.index < a.index)) ? b : a;
}

__device__ __forceinline__ ArgMax warp_argmax(ArgMax v) {
#pragma unroll
  for (int off = 16; off > 0; off /= 2) {
    ArgMax o{__shfl_xor_sync(0xffffffffu, v.value, off), __shfl_xor_sync(0xffffffffu, v.index, off)};
    v = better(v, o);
  }
  return v;
}

__device__ __forceinline__ float warp_sum(float v) {
#pragma unroll
  for (int off = 16; off > 0; off /= 2) v += __shfl_xor_sync(0xffffffffu, v, off);
  return v;
}

__device__ __forceinline__ float warp_max(float v) {
#pragma unroll
  for (int off = 16; off > 0; off /= 2) v = fmaxf(v, __shfl_xor_sync(0xffffffffu, v, off));
  return v;
}

// The same logits for a few tokens (decode), where the tiled kernel would give each of a
// handful of CTAs the whole D loop. A CTA owns kGemvExperts expert rows, each split over
// kGemvSplit warps (interleaved 16-byte chunks of the fp32 row), and kTokens tokens; the
// warps' partial sums meet in shared memory in a fixed order (deterministic logits).
// grid (ceil(E / kGemvExperts), ceil(T / kTokens)); D % 4 == 0.
constexpr int kGemvWarps = 8, kGemvSplit = 8, kGemvExperts = kGemvWarps / kGemvSplit, kGemvMaxTokens = 64;

template <int kTokens>
__global__ void __launch_bounds__(32 * kGemvWarps) router_logits_gemv_kernel(const __nv_bfloat16* __restrict__ x,
                                                                           const float* __restrict__ w,
                                                                           float* __restrict__ logits, int T,
                                                                           int D, int E) {
  __shared__ float partial[kGemvWarps][kTokens];
  pdl_launch_dependents();  // the decode chain's select kernel may get resident meanwhile
  const int warp = threadIdx.x / 32, lane = threadIdx.x % 32, part = warp % kGemvSplit;
  const int e = blockIdx.x * kGemvExperts + warp / kGemvSplit, t0 = blockIdx.y * kTokens;
  float acc[kTokens] = {};
  if (e < E) {
    const float* wr = w + (size_t)e * D;
#pragma unroll 4
    for (int k = 4 * (lane + 32 * part); k < D; k += 128 * kGemvSplit) {
      const float4 wv = __ldg(reinterpret_cast<const float4*>(wr + k));
#pragma unroll
      for (int t = 0; t < kTokens; ++t) {
        if (t0 + t < T) {
          const uint2 raw = __ldg(reinterpret_cast<const uint2*>(x + (size_t)(t0 + t) * D + k));
          const float2 a = __bfloat1622float2(*reinterpret_cast<const __nv_bfloat162*>(&raw.x));
          const float2 b = __bfloat1622float2(*reinterpret_cast<const __nv_bfloat162*>(&raw.y));
          acc[t] = fmaf(a.x, wv.x, fmaf(a.y, wv.y, fmaf(b.x, wv.z, fmaf(b.y, wv.w, acc[t]))));
        }
      }
    }
  }
#pragma unroll
  for (int t = 0; t < kTokens; ++t) {
    const float v = warp_sum(acc[t]);
    if (lane == 0) partial[warp][t] = v;
  }
  __syncthreads();
  if (part == 0 && e < E && lane < kTokens && t0 + lane < T) {
    float sum = partial[warp][lane];
#pragma unroll
    for (int p = 1; p < kGemvSplit; ++p) sum += partial[warp + p][lane];
    logits[(size_t)(t0 + lane) * E + e] = sum;
  }
}

constexpr int kSelectThreads = 256;
constexpr int kSelectWarps = kSelectThreads / 32;

// Block-wide arg max over sel[0, n) (all threads call it; result valid in every thread).
__device__ ArgMax block_argmax(const float* sel, int n, ArgMax* scratch) {
  ArgMax best{-INFINITY, 0x7fffffff};
  for (int i = threadIdx.x; i < n; i += kSelectThreads) best = better(best, ArgMax{sel[i], i});
  best = warp_argmax(best);
  if (threadIdx.x % 32 == 0) scratch[threadIdx.x / 32] = best;
  __syncthreads();
  best = scratch[0];
  for (int w = 1; w < kSelectWarps; ++w) best = better(best, scratch[w]);
  __syncthreads();  // scratch is reused by the next call
  return best;
}

__device__ float block_reduce(float v, bool is_max, float* scratch) {
  v = is_max ? warp_max(v) : warp_sum(v);
  if (threadIdx.x % 32 == 0) scratch[threadIdx.x / 32] = v;
  __syncthreads();
  float r = scratch[0];
  for (int w = 1; w < kSelectWarps; ++w) r = is_max ? fmaxf(r, scratch[w]) : r + scratch[w];
  __syncthreads();
  return r;
}

struct RouteParams {
  int num_experts, top_k, num_expert_group, topk_group, scoring, renormalize;
  float routed_scaling_factor;
};

// vLLM's rule (naive.grouping_applies): groups of at least two experts, more than one group.
__host__ __device__ inline bool grouping_applies(int num_experts, int num_expert_group) {
  return num_expert_group > 1 && num_experts > num_expert_group && num_experts % num_expert_group == 0;
}

// One CTA per token.
__global__ void __launch_bounds__(kSelectThreads) router_select_kernel(const float* __restrict__ logits,
                                                                       const float* __restrict__ bias,
                                                                       int* __restrict__ topk_ids,
                                                                       float* __restrict__ topk_weights,
                                                                       RouteParams p) {
  __shared__ float score[kMaxExperts];
  __shared__ float sel[kMaxExperts];
  __shared__ ArgMax scratch[kSelectWarps];
  __shared__ float fscratch[kSelectWarps];
  __shared__ float group_score[kMaxGroups];
  __shared__ int group_kept[kMaxGroups];
  const int E = p.num_experts, t = blockIdx.x;
  const float* row = logits + (size_t)t * E;

  float row_max = 0.f, denom = 1.f;
  if (p.scoring == 1) {  // softmax: exp(l - max) / sum, as torch.softmax
    float m = -INFINITY;
    for (int e = threadIdx.x; e < E; e += kSelectThreads) m = fmaxf(m, row[e]);
    row_max = block_reduce(m, true, fscratch);
    float s = 0.f;
    for (int e = threadIdx.x; e < E; e += kSelectThreads) s += expf(row[e] - row_max);
    denom = block_reduce(s, false, fscratch);
  }
  for (int e = threadIdx.x; e < E; e += kSelectThreads) {
    const float l = row[e];
    const float s = p.scoring == 1 ? expf(l - row_max) / denom : 1.f / (1.f + expf(-l));
    score[e] = s;
    sel[e] = s + bias[e];
  }
  __syncthreads();

  if (grouping_applies(E, p.num_expert_group)) {
    const int G = p.num_expert_group, size = E / G, warp = threadIdx.x / 32, lane = threadIdx.x % 32;
    for (int g = warp; g < G; g += kSelectWarps) {  // group score: sum of its two best biased scores
      const float* s = sel + g * size;
      ArgMax first{-INFINITY, 0x7fffffff};
      for (int i = lane; i < size; i += 32) first = better(first, ArgMax{s[i], i});
      first = warp_argmax(first);
      ArgMax second{-INFINITY, 0x7fffffff};
      for (int i = lane; i < size; i += 32)
        if (i != first.index) second = better(second, ArgMax{s[i], i});
      second = warp_argmax(second);
      if (lane == 0) group_score[g] = first.value + second.value;
    }
    __syncthreads();
    if (threadIdx.x == 0) {
      for (int g = 0; g < G; ++g) group_kept[g] = 0;
      for (int r = 0; r < p.topk_group; ++r) {
        ArgMax best{-INFINITY, 0x7fffffff};
        for (int g = 0; g < G; ++g)
          if (!group_kept[g]) best = better(best, ArgMax{group_score[g], g});
        if (best.index < G) group_kept[best.index] = 1;
      }
    }
    __syncthreads();
    for (int e = threadIdx.x; e < E; e += kSelectThreads)
      if (!group_kept[e / size]) sel[e] = -INFINITY;
    __syncthreads();
  }

  // k rounds of arg max; a chosen expert drops out with NaN (never "better" than anything,
  // so even a masked -inf expert ranks above it). Weights are the unbiased scores.
  float chosen_weight = 0.f, weight_sum = 0.f;
  for (int r = 0; r < p.top_k; ++r) {
    const ArgMax best = block_argmax(sel, E, scratch);
    const float w = score[best.index];
    weight_sum += w;  // sequential in selection order, as torch's sum over the top-k
    if (threadIdx.x == r) chosen_weight = w;
    if (threadIdx.x == 0) {
      topk_ids[(size_t)t * p.top_k + r] = best.index;
      sel[best.index] = NAN;
    }
    __syncthreads();
  }
  if (threadIdx.x < p.top_k) {
    float w = chosen_weight;
    if (p.renormalize) w = w / weight_sum;
    topk_weights[(size_t)t * p.top_k + threadIdx.x] = w * p.routed_scaling_factor;
  }
}


// Ungrouped routing by one warp per token (E <= 32 * kPerLane, top_k <= 32): lane l holds
// experts l, l + 32, ...; each of the k rounds is two warp reductions (redux.sync max of the
// order-preserving keys, then min of the ids holding that key), no barriers. Same scores, tie
// rule (larger biased score, then lower id) and weight arithmetic as router_select_kernel (the
// softmax sum runs in another order: a few ulps). Lane r < top_k returns slot r's global id
// and final weight; `row` is the token's logits.
constexpr int kWarpSelectMaxK = 32;

__host__ __device__ inline bool warp_select_applies(int num_experts, int top_k, int num_expert_group) {
  return !grouping_applies(num_experts, num_expert_group) && top_k <= kWarpSelectMaxK && num_experts <= kMaxExperts;
}

// Larger float -> larger key; key 0 (below every float, -inf included) marks chosen, absent and
// NaN experts. -0 would rank below +0, but a biased score is never -0: the score is >= +0 and
// +0 + (-0) rounds to +0.
__device__ __forceinline__ uint32_t select_key(float v) {
  const uint32_t u = __float_as_uint(v);
  return v != v ? 0u : (u & 0x80000000u) ? ~u : (u | 0x80000000u);
}

template <int kPerLane>
__device__ __forceinline__ void warp_select_token(const float* __restrict__ row, const float* __restrict__ bias,
                                                  const RouteParams& p, int& id_out, float& weight_out) {
  const int lane = threadIdx.x % 32, E = p.num_experts;
  float logit[kPerLane];
#pragma unroll
  for (int j = 0; j < kPerLane; ++j) logit[j] = lane + 32 * j < E ? row[lane + 32 * j] : -INFINITY;
  float row_max = 0.f, denom = 1.f;
  if (p.scoring == 1) {  // softmax: exp(l - max) / sum, as torch.softmax
    float m = -INFINITY;
#pragma unroll
    for (int j = 0; j < kPerLane; ++j) m = fmaxf(m, logit[j]);
    row_max = warp_max(m);
    float s = 0.f;
#pragma unroll
    for (int j = 0; j < kPerLane; ++j)
      if (lane + 32 * j < E) s += expf(logit[j] - row_max);
    denom = warp_sum(s);
  }
  auto score_of = [&](float l) { return p.scoring == 1 ? expf(l - row_max) / denom : 1.f / (1.f + expf(-l)); };
  uint32_t key[kPerLane];
#pragma unroll
  for (int j = 0; j < kPerLane; ++j) {
    const int e = lane + 32 * j;
    key[j] = e < E ? select_key(score_of(logit[j]) + bias[e]) : 0u;
  }
  int chosen_id = 0;
  for (int r = 0; r < p.top_k; ++r) {
    uint32_t m = key[0];
#pragma unroll
    for (int j = 1; j < kPerLane; ++j) m = max(m, key[j]);
    const uint32_t top = __reduce_max_sync(0xffffffffu, m);
    uint32_t candidate = 0xffffffffu;  // this lane's lowest id holding the top key
#pragma unroll
    for (int j = kPerLane - 1; j >= 0; --j)
      if (key[j] == top) candidate = lane + 32 * j;
    const int best = (int)__reduce_min_sync(0xffffffffu, candidate);
#pragma unroll
    for (int j = 0; j < kPerLane; ++j)
      if (lane + 32 * j == best) key[j] = 0u;
    if (lane == r) chosen_id = best;
  }
  // Weights are the unbiased scores; their sum runs sequentially in selection order, as torch's
  // sum over the top-k.
  const float chosen_weight = lane < p.top_k ? score_of(row[chosen_id]) : 0.f;
  float weight_sum = 0.f;
  for (int r = 0; r < p.top_k; ++r) weight_sum += __shfl_sync(0xffffffffu, chosen_weight, r);
  id_out = chosen_id;
  weight_out = (p.renormalize ? chosen_weight / weight_sum : chosen_weight) * p.routed_scaling_factor;
}

constexpr int kWarpSelectWarps = 8;

// What the prefill path folds into the select kernel (optional, nullptr = skip): count the
// token's assignments to local experts [expert_offset, + num_local_experts) into counts
// (zeroed by the logits kernel). Saves the count kernel.
struct SelectExtras {
  int* counts;
  int expert_offset, num_local_experts;
};

// One warp per token; grid ceil(T / kWarpSelectWarps).
template <int kPerLane>
__global__ void __launch_bounds__(32 * kWarpSelectWarps) router_select_warp_kernel(const float* __restrict__ logits,
                                                                                  const float* __restrict__ bias,
                                                                                  int* __restrict__ topk_ids,
                                                                                  float* __restrict__ topk_weights,
                                                                                  RouteParams p, int T,
                                                                                  SelectExtras x) {
  const int t = blockIdx.x * kWarpSelectWarps + threadIdx.x / 32, lane = threadIdx.x % 32;
  if (t >= T) return;  // warp-uniform
  int id;
  float weight;
  warp_select_token<kPerLane>(logits + (size_t)t * p.num_experts, bias, p, id, weight);
  if (lane < p.top_k) {
    topk_ids[(size_t)t * p.top_k + lane] = id;
    topk_weights[(size_t)t * p.top_k + lane] = weight;
    const int local = id - x.expert_offset;
    if (x.counts != nullptr && local >= 0 && local < x.num_local_experts) atomicAdd(&x.counts[local], 1);
  }
}

}  // namespace moe
}  // namespace k3
