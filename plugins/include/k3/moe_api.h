// C ABI of the SiTU latent-MoE kernels (plugins/c_api/moe.cu): the one declaration that the
// torch bindings (ctypes), the TensorRT plugins and the kernels themselves share.
// Activations bf16, router weight / correction bias fp32, ids int32. Launchers return a
// cudaError_t (cudaErrorInvalidValue for unsupported sizes or a short workspace).
#pragma once

#include <cuda_runtime.h>
#include <stddef.h>
#include <stdint.h>

#include "k3/params.h"

#ifdef __cplusplus
extern "C" {
#endif

// Every launcher is deterministic: the same inputs give the same output bits on every run (the
// combine sums each token's expert slots in slot order; no floating-point atomics).
// Batch-invariant mode (process-wide, default 0): a token's output bits also do not depend on
// the other tokens of the call, because the kernels are then chosen by the sizes alone (the
// tensor-core router logits and the tiled expert GEMMs for every token count, where the
// default takes the router GEMV and the weight-streaming decode GEMMs for small batches).
// Costs decode speed: bench/results/determinism_h200.json. Read at each launch.
void k3_moe_set_batch_invariant(int enabled);
int k3_moe_batch_invariant(void);

// 1 when the kernels are built for these sizes (callers fall back to the reference otherwise):
// latent and inter multiples of 64, num_experts <= 1024, num_local_experts <= 1024,
// top_k <= num_experts, at most 32 expert groups when grouping applies.
int k3_moe_supported(int num_experts, int num_local_experts, int top_k, int num_expert_group, int latent,
                     int inter);

// Device workspace bytes of k3_situ_moe / k3_situ_moe_mxfp4 (256-byte aligned sub-buffers).
size_t k3_moe_workspace_size(int num_tokens, int num_experts, int top_k, int num_local_experts, int latent,
                             int inter);

// Router alone (spec §4.6.1): topk_ids [T, k] (global ids, best biased score first) and
// topk_weights [T, k] fp32. `logits` is caller scratch of T * num_experts floats.
int k3_moe_route(const void* x, const float* router_weight, const float* correction_bias, float* logits,
                 int* topk_ids, float* topk_weights, int num_tokens, int hidden, int num_experts, int top_k,
                 int num_expert_group, int topk_group, int scoring, int renormalize,
                 float routed_scaling_factor, cudaStream_t stream);

// Contract K3SituMoe: x [T, D], z [T, L], router_weight [E, D], correction_bias [E],
// w13 [El, 2I, L] (gate rows then up rows), w2 [El, L, I] -> out [T, L].
int k3_situ_moe(const K3SituMoeParams* p, cudaStream_t stream);

// Contract K3SituMoeMxfp4: as k3_situ_moe with MXFP4 experts (E2M1 pairs, low nibble first,
// one E8M0 scale per 32 inputs): w13_packed [El, 2I, L/2], w13_scale [El, 2I, L/32],
// w2_packed [El, L, I/2], w2_scale [El, L, I/32]; dequantised to bf16 in the GEMMs (W4A16).
int k3_situ_moe_mxfp4(const K3SituMoeMxfp4Params* p, cudaStream_t stream);

#ifdef __cplusplus
}
#endif
