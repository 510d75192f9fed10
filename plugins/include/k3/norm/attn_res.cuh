// AttnRes mix (spec §4.7) fused with the residual add before it and the RMSNorm after it: one
// CTA per output token, fp32 math (ops/norm/reference.py's attn_res_mix_norm is the reference).
// Sweep 1 forms the partial sum and every source's logit, sweep 2 the softmax-weighted mix (kept in
// shared memory) and its mean square, sweep 3 the normed bf16 output.
#pragma once

#include <math.h>

#include "k3/norm/vec.cuh"
#include "k3/norm_api.h"

namespace k3 {
namespace norm {

template <int VEC>
__device__ __forceinline__ void load_source(const K3AttnResMixParams& p, int s, int64_t off, int i, float (&v)[VEC]) {
  load_bf16<VEC>(static_cast<const __nv_bfloat16*>(p.sources[s]) + off + i, v);
  if (s == p.num_sources - 1 && p.residual != nullptr) {
    float r[VEC];
    load_bf16<VEC>(static_cast<const __nv_bfloat16*>(p.residual) + off + i, r);
    if (p.residual2 != nullptr) {
      float r2[VEC];
      load_bf16<VEC>(static_cast<const __nv_bfloat16*>(p.residual2) + off + i, r2);
#pragma unroll
      for (int k = 0; k < VEC; ++k) r[k] = round_bf16(r[k] + r2[k]);  // a = bf16(routed + shared), as torch adds
    }
#pragma unroll
    for (int k = 0; k < VEC; ++k) v[k] = round_bf16(v[k] + r[k]);  // the bf16 partial sum P + a
  }
}

// NS >= num_sources (a compile-time bound, so the per-source sums live in registers and every
// source's row is loaded in the same sweep: one round of memory latency per sweep, not n).
template <int VEC, int NS>
__global__ void attn_res_mix_norm_kernel(K3AttnResMixParams p) {
  extern __shared__ float mix[];  // [dim]
  __shared__ float partials[32][2 * NS];
  __shared__ float scratch[32];
  __shared__ float weight[NS];
  const int j = blockIdx.x, lane = threadIdx.x & 31, warp = threadIdx.x >> 5;
  const int64_t off = static_cast<int64_t>(p.rows != nullptr ? p.rows[j] : j) * p.dim;
  const int step = blockDim.x * VEC, n = p.num_sources;
  const float inv_dim = 1.0f / p.dim;
  float dot[NS], ss[NS];
#pragma unroll
  for (int s = 0; s < NS; ++s) dot[s] = ss[s] = 0.0f;
  for (int i = threadIdx.x * VEC; i < p.dim; i += step) {
    float q[VEC];
    load_f32<VEC>(p.query + i, q);
#pragma unroll
    for (int s = 0; s < NS; ++s) {
      if (s < n) {
        float v[VEC];
        load_source<VEC>(p, s, off, i, v);
        if (s == n - 1 && p.partial_out != nullptr) {
          store_bf16<VEC>(static_cast<__nv_bfloat16*>(p.partial_out) + off + i, v);
        }
#pragma unroll
        for (int k = 0; k < VEC; ++k) {
          dot[s] += v[k] * q[k];
          ss[s] += v[k] * v[k];
        }
      }
    }
  }
  // the 2 NS sums over the CTA: warp shuffles, then one thread per sum adds the warps in order
#pragma unroll
  for (int s = 0; s < NS; ++s) {
#pragma unroll
    for (int o = 16; o > 0; o >>= 1) {
      dot[s] += __shfl_xor_sync(0xffffffffu, dot[s], o);
      ss[s] += __shfl_xor_sync(0xffffffffu, ss[s], o);
    }
  }
  if (lane == 0) {
#pragma unroll
    for (int s = 0; s < NS; ++s) {
      partials[warp][s] = dot[s];
      partials[warp][NS + s] = ss[s];
    }
  }
  __syncthreads();
  if (threadIdx.x < 2 * NS) {
    float total = 0.0f;
    for (int w = 0; w < static_cast<int>(blockDim.x >> 5); ++w) total += partials[w][threadIdx.x];
    partials[0][threadIdx.x] = total;  // only this thread reads or writes this column
  }
  __syncthreads();
  if (threadIdx.x == 0) {  // logits, then the softmax over them as torch.softmax: exp(l - max) / sum
    float m = -INFINITY, sum = 0.0f;
    for (int s = 0; s < n; ++s) {
      weight[s] = partials[0][s] * rsqrtf(partials[0][NS + s] * inv_dim + p.eps);
      m = fmaxf(m, weight[s]);
    }
    for (int s = 0; s < n; ++s) {
      weight[s] = expf(weight[s] - m);
      sum += weight[s];
    }
    for (int s = 0; s < n; ++s) weight[s] = weight[s] / sum;
  }
  __syncthreads();
  float sq = 0.0f;
  for (int i = threadIdx.x * VEC; i < p.dim; i += step) {
    float acc[VEC];
#pragma unroll
    for (int k = 0; k < VEC; ++k) acc[k] = 0.0f;  // the reference's sum() starts from 0 too (0 + -0 = +0)
#pragma unroll
    for (int s = 0; s < NS; ++s) {
      if (s < n) {
        float v[VEC];
        load_source<VEC>(p, s, off, i, v);
        const float w = weight[s];
        // products and sums rounded separately, in source order, as the reference's sum()
#pragma unroll
        for (int k = 0; k < VEC; ++k) acc[k] = __fadd_rn(acc[k], __fmul_rn(w, v[k]));
      }
    }
#pragma unroll
    for (int k = 0; k < VEC; ++k) {
      if (p.round_mix) acc[k] = round_bf16(acc[k]);
      mix[i + k] = acc[k];  // read back below by this same thread: no barrier needed
      sq += acc[k] * acc[k];
    }
  }
  const float r = rsqrtf(block_sum(sq, scratch) * inv_dim + p.norm_eps);
  __nv_bfloat16* out = static_cast<__nv_bfloat16*>(p.out) + static_cast<int64_t>(j) * p.dim;
  for (int i = threadIdx.x * VEC; i < p.dim; i += step) {
    float v[VEC], w[VEC];
    load_weight<VEC>(p.norm_weight, p.norm_weight_type, i, w);
#pragma unroll
    for (int k = 0; k < VEC; ++k) v[k] = __fmul_rn(__fmul_rn(mix[i + k], r), w[k]);
    store_bf16<VEC>(out + i, v);
  }
}

}  // namespace norm
}  // namespace k3
