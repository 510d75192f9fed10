// C ABI of the skinny bf16 linear (plugins/c_api/linear.cu): y = x @ weight^T for a handful of
// tokens, the decode steps' dense projections. cuBLAS runs those as a split-K GEMM plus a reduce
// kernel (two launches) when the output is wide and K short (K3's o_proj, latent_up, shared
// down projections at TP8); this is one weight-streaming launch. Not a contract op: the model
// calls it through k3_trtllm/ops/linear (ctypes Structure of the same layout), export keeps
// torch's linear.
//
// One warp per output feature: its lanes stream the weight row in 16-byte pieces, multiply
// them by every token's row and add in fp32, in an order fixed by K alone, then a fixed warp
// butterfly; so a token's output bits depend neither on the other tokens nor on the run.
#pragma once

#include <cuda_runtime.h>
#include <stdint.h>

#ifdef __cplusplus
extern "C" {
#endif

#define K3_SKINNY_MAX_TOKENS 4  // past this the FMA work per weight byte outgrows the weight stream

// x: bf16 [tokens, k], rows x_row_stride elements apart (a multiple of 8 when tokens > 1),
// 16-byte aligned; weight: bf16 [n, k] contiguous, 16-byte aligned; k a multiple of 8;
// out: contiguous [tokens, n], bf16 (out_fp32 0) or fp32 (out_fp32 1).
typedef struct K3SkinnyLinearParams {
  const void* x;
  int64_t x_row_stride;
  const void* weight;
  void* out;
  int tokens;
  int n;
  int k;
  int out_fp32;
} K3SkinnyLinearParams;

// Returns a cudaError_t (0 = success); cudaErrorInvalidValue for a call outside the limits above.
int k3_skinny_linear(const K3SkinnyLinearParams* params, cudaStream_t stream);

#ifdef __cplusplus
}
#endif
