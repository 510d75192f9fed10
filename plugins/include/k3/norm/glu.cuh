// The dense MLP's and shared experts' gated activation (spec §4.3, ops/common.py `glu` is the
// reference) and the MLA output gate (ops/norm/reference.py `sigmoid_gate`): out = act(gate) *
// up' over bf16 [tokens, inter] views, fp32 math, one bf16 rounding. It sits with the norms as the other element-wise op of a layer that
// torch would run as a chain of small kernels.
#pragma once

#include <math.h>

#include "k3/norm/vec.cuh"
#include "k3/norm_api.h"

namespace k3 {
namespace norm {

template <int VEC>
__global__ void glu_kernel(K3GluParams p) {
  const int t = blockIdx.x;
  const int i = (blockIdx.y * blockDim.x + threadIdx.x) * VEC;
  if (i >= p.inter) return;
  float g[VEC], u[VEC];
  load_bf16<VEC>(static_cast<const __nv_bfloat16*>(p.gate) + t * p.gate_row_stride + i, g);
  load_bf16<VEC>(static_cast<const __nv_bfloat16*>(p.up) + t * p.up_row_stride + i, u);
#pragma unroll
  for (int k = 0; k < VEC; ++k) {
    const float sig = 1.0f / (1.0f + expf(-g[k]));
    if (p.activation == 1) {  // SiTU: beta*tanh(g/beta)*sigmoid(g) * linear_beta*tanh(u/linear_beta)
      const float gate_act = __fmul_rn(__fmul_rn(p.beta, tanhf(g[k] / p.beta)), sig);
      const float up_act = p.linear_beta != 0.0f ? __fmul_rn(p.linear_beta, tanhf(u[k] / p.linear_beta)) : u[k];
      g[k] = __fmul_rn(gate_act, up_act);
    } else if (p.activation == K3_GLU_SIGMOID_GATE) {
      g[k] = __fmul_rn(u[k], sig);
    } else {  // SiLU: g * sigmoid(g) * u
      g[k] = __fmul_rn(g[k] / (1.0f + expf(-g[k])), u[k]);
    }
  }
  store_bf16<VEC>(static_cast<__nv_bfloat16*>(p.out) + static_cast<int64_t>(t) * p.inter + i, g);
}

}  // namespace norm
}  // namespace k3
