// RMSNorm (and the KDA output's gated RMSNorm) over the last dim of a bf16 [tokens, heads, dim]
// view: one CTA per (token, head) row, fp32 math, one bf16 rounding (ops/common.py's rms_norm
// and gated_rms_norm are the reference).
#pragma once

#include "k3/norm/vec.cuh"
#include "k3/norm_api.h"

namespace k3 {
namespace norm {

template <int VEC, bool GATE>
__global__ void rms_norm_kernel(K3RmsNormParams p) {
  __shared__ float scratch[32];
  const int t = blockIdx.x / p.heads, h = blockIdx.x % p.heads;
  const __nv_bfloat16* x = static_cast<const __nv_bfloat16*>(p.x) + t * p.x_token_stride + h * p.x_head_stride;
  const int step = blockDim.x * VEC;
  float ss = 0.0f;
  for (int i = threadIdx.x * VEC; i < p.dim; i += step) {
    float v[VEC];
    load_bf16<VEC>(x + i, v);
#pragma unroll
    for (int k = 0; k < VEC; ++k) ss += v[k] * v[k];
  }
  // torch's mean multiplies the sum by 1/dim; rsqrtf is the CUDA rsqrt torch uses
  const float r = rsqrtf(block_sum(ss, scratch) * (1.0f / p.dim) + p.eps);
  const __nv_bfloat16* g = GATE ? static_cast<const __nv_bfloat16*>(p.gate) + t * p.gate_token_stride +
                                      h * p.gate_head_stride
                                : nullptr;
  __nv_bfloat16* out = static_cast<__nv_bfloat16*>(p.out) + (static_cast<int64_t>(t) * p.heads + h) * p.dim;
  for (int i = threadIdx.x * VEC; i < p.dim; i += step) {
    float v[VEC], w[VEC];
    load_bf16<VEC>(x + i, v);  // the second read hits L1/L2: the row was just read
    load_weight<VEC>(p.weight, p.weight_type, i, w);
#pragma unroll
    for (int k = 0; k < VEC; ++k) v[k] = __fmul_rn(__fmul_rn(v[k], r), w[k]);
    if (GATE) {
      float gv[VEC];
      load_bf16<VEC>(g + i, gv);
#pragma unroll
      for (int k = 0; k < VEC; ++k) v[k] = __fmul_rn(v[k], 1.0f / (1.0f + expf(-gv[k])));
    }
    store_bf16<VEC>(out + i, v);
  }
}

}  // namespace norm
}  // namespace k3
