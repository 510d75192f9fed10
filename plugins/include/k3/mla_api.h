// C ABI of the MLA kernels (plugins/kernels/mla.cu): the one declaration that the torch
// bindings (ctypes), the TensorRT plugins and the kernels themselves share.
#pragma once

#include <cuda_runtime.h>
#include <stddef.h>

#ifdef __cplusplus
extern "C" {
#endif

// Workspace bytes of k3_mla_prefill / k3_mla_decode for these sizes (same for both).
size_t k3_mla_workspace_size(int num_tokens, int num_heads, int kv_lora_rank, int max_blocks, int block_size);

// Contracts K3MlaDecode / K3MlaPrefill. Argument order: inputs, outputs, sizes,
// attributes, workspace, stream. Both insert the new latents and run the absorbed form.
int k3_mla_decode(const void* q, const void* latent, const void* w_uk, const void* w_uv, const int* cu_seqlens,
                  const int* context_lens, const int* block_tables, const int* slot_mapping, void* latent_cache,
                  void* out, int num_tokens, int num_seqs, int max_blocks, int block_size, int num_heads,
                  int qk_nope_head_dim, int qk_rope_head_dim, int kv_lora_rank, int v_head_dim,
                  float softmax_scale, void* workspace, size_t workspace_bytes, cudaStream_t stream);
int k3_mla_prefill(const void* q, const void* latent, const void* w_uk, const void* w_uv, const int* cu_seqlens,
                   const int* context_lens, const int* block_tables, const int* slot_mapping, void* latent_cache,
                   void* out, int num_tokens, int num_seqs, int max_blocks, int block_size, int num_heads,
                   int qk_nope_head_dim, int qk_rope_head_dim, int kv_lora_rank, int v_head_dim,
                   float softmax_scale, void* workspace, size_t workspace_bytes, cudaStream_t stream);

// The attention part alone (FlashMLA's scope), for benchmarks and callers that do the W_UK /
// W_UV products themselves: a_lat [T,H,R] from q_lat [T,H,R] and q_pe = q[:, :, nope:].
int k3_mla_latent_attention(const void* q_lat, const void* q, const int* cu_seqlens, const int* context_lens,
                            const int* block_tables, const void* latent_cache, void* a_lat, int num_tokens,
                            int num_seqs, int max_blocks, int block_size, int num_heads, int qk_nope_head_dim,
                            int qk_rope_head_dim, int kv_lora_rank, float softmax_scale, void* workspace,
                            size_t workspace_bytes, cudaStream_t stream);

#ifdef __cplusplus
}
#endif
