// C ABI of the RMSNorm, AttnRes-mix and GLU kernels (plugins/c_api/norm.cu): the one declaration that
// the torch binding (k3_trtllm/ops/norm/cuda.py, ctypes Structures of the same layout) and the
// kernels share. These are not contract ops: the exported graphs keep the torch reference, so
// the parameters are hand-written structs, passed by pointer.
//
// Every kernel does its math in fp32 and rounds its bf16 output once (spec §4.2); each row is
// reduced in an order fixed by `dim` (and, for the AttnRes mix, the number of sources) alone:
// RMSNorm by one CTA, the mix by a cluster of up to 8 CTAs each holding a slice of the row. So a
// row's bits do not depend on the other rows of the call (batch invariant) or on the run.
#pragma once

#include <cuda_runtime.h>
#include <stdint.h>

#ifdef __cplusplus
extern "C" {
#endif

#define K3_ATTN_RES_MAX_SOURCES 16  // K3: 8 AttnRes blocks + the partial sum
#define K3_ATTN_RES_MAX_DIM 10240   // the mix: at most 640 vectors of a row per CTA of its cluster (norm.cu)

// Weight element types (a norm weight is read in its stored dtype: bf16 -> fp32 is exact).
#define K3_NORM_WEIGHT_NONE 0
#define K3_NORM_WEIGHT_BF16 1
#define K3_NORM_WEIGHT_FP32 2

// y[t, h, :] = bf16(x * rsqrt(mean(x^2) + eps) * weight [* sigmoid(gate)]) over the last dim.
// x and gate are bf16 views [tokens, heads, dim] with a contiguous last dim and the element
// strides given; out is bf16, contiguous [tokens, heads, dim]. weight: [dim] or null.
typedef struct K3RmsNormParams {
  const void* x;
  int64_t x_token_stride;
  int64_t x_head_stride;
  const void* gate;  // null: no gate (plain RMSNorm); else the KDA output gate (spec §4.5.8)
  int64_t gate_token_stride;
  int64_t gate_head_stride;
  const void* weight;
  int weight_type;  // K3_NORM_WEIGHT_*
  void* out;
  int tokens;
  int heads;
  int dim;
  float eps;
} K3RmsNormParams;

// AttnRes mix fused with the RMSNorm that consumes it (spec §4.7, ops/attn_res.py `mix`):
//   a      = residual2 ? bf16(residual + residual2) : residual           (the sub-layer output)
//   p      = residual ? bf16(sources[n-1] + a) : sources[n-1]           (the partial sum)
//   l_s    = (v_s . query) * rsqrt(mean(v_s^2) + eps)   over v_0..v_{n-2} = sources, v_{n-1} = p
//   mix    = sum_s softmax(l)_s * v_s                    (fp32; bf16-rounded if round_mix)
//   out[j] = bf16(mix * rsqrt(mean(mix^2) + norm_eps) * norm_weight)   for token rows[j] (or j)
// sources: bf16 [tokens, dim], contiguous; partial_out (optional, only without rows) receives p.
// residual2 (optional, only with residual): a sub-layer output that is the sum of two products
// (the latent MoE's routed and shared experts), added here instead of by a kernel of its own.
typedef struct K3AttnResMixParams {
  const void* sources[K3_ATTN_RES_MAX_SOURCES];
  int num_sources;
  const void* residual;
  const void* residual2;
  void* partial_out;
  const int* rows;  // int32 [out_tokens] or null (then out_tokens = tokens)
  const float* query;
  float eps;
  const void* norm_weight;
  int norm_weight_type;  // K3_NORM_WEIGHT_*
  float norm_eps;
  int round_mix;
  void* out;
  int out_tokens;
  int dim;
} K3AttnResMixParams;

// The gated activation of the dense MLP / shared experts (spec §4.3) and the MLA output gate
// (spec §4.4): gate and up are bf16 [tokens, inter] views with a contiguous last dim (the two
// halves of the fc product; the MLA gate columns of fused_a's product and the attention output);
// out is bf16, contiguous [tokens, inter].
//   activation 1 (SiTU): beta*tanh(g/beta)*sigmoid(g) * (linear_beta ? linear_beta*tanh(u/linear_beta) : u)
//   activation 0 (SiLU): g*sigmoid(g) * u
//   activation 2 (K3_GLU_SIGMOID_GATE): sigmoid(g) * u
#define K3_GLU_SIGMOID_GATE 2
typedef struct K3GluParams {
  const void* gate;
  const void* up;
  int64_t gate_row_stride;
  int64_t up_row_stride;
  void* out;
  int tokens;
  int inter;
  int activation;
  float beta;
  float linear_beta;
} K3GluParams;

// The kernels take rows of dim % 2 == 0 (vector loads of 2..8 bf16, chosen by the alignment of
// every pointer and stride) and, for the mix, dim <= K3_ATTN_RES_MAX_DIM and at most
// K3_ATTN_RES_MAX_SOURCES sources. Return a cudaError_t (0 = success);
// cudaErrorInvalidValue for a call outside these limits.
int k3_rms_norm(const K3RmsNormParams* params, cudaStream_t stream);
int k3_attn_res_mix_norm(const K3AttnResMixParams* params, cudaStream_t stream);
int k3_glu(const K3GluParams* params, cudaStream_t stream);

#ifdef __cplusplus
}
#endif
