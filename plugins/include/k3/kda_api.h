// C ABI of the KDA kernels (plugins/kernels/kda.cu): the one declaration that the torch
// bindings (ctypes), the TensorRT plugins and the kernels themselves share.
#pragma once

#include <cuda_runtime.h>
#include <stddef.h>

#ifdef __cplusplus
extern "C" {
#endif

// Which head_dim / conv widths the kernels are built for (callers fall back otherwise).
int k3_kda_supported(int head_dim, int conv_width);

// Bytes of device workspace k3_kda_prefill needs (0 when it runs the token recurrence).
size_t k3_kda_prefill_workspace_bytes(int num_tokens, int num_seqs, int num_heads, int head_dim,
                                      float lower_bound);

// Chunked prefill (contract K3KdaPrefill). The factorised intra-chunk decay needs
// |lower_bound| <= 10; the softplus gate (lower_bound == 0) runs the exact token recurrence.
// `workspace`: k3_kda_prefill_workspace_bytes(...) bytes, 16-byte aligned.
int k3_kda_prefill(const void* qkv, const void* gate, const void* beta, const float* conv_weight,
                   const float* A_log, const float* dt_bias, const int* cu_seqlens,
                   const int* state_slots, const int* has_initial_state, void* conv_state,
                   float* recurrent_state, void* out, void* workspace, int num_tokens,
                   int num_seqs, int num_heads, int head_dim, int conv_width, float lower_bound,
                   cudaStream_t stream);

// Decode / speculative verify (contract K3KdaDecode): token recurrence, any number of
// tokens per sequence. Same arguments as k3_kda_prefill; the workspace may be null.
int k3_kda_decode(const void* qkv, const void* gate, const void* beta, const float* conv_weight,
                  const float* A_log, const float* dt_bias, const int* cu_seqlens,
                  const int* state_slots, const int* has_initial_state, void* conv_state,
                  float* recurrent_state, void* out, void* workspace, int num_tokens,
                  int num_seqs, int num_heads, int head_dim, int conv_width, float lower_bound,
                  cudaStream_t stream);

#ifdef __cplusplus
}
#endif
