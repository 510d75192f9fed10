// C ABI of the MLA kernels (plugins/c_api/mla.cu): the one declaration that the torch
// bindings (ctypes), the TensorRT plugins and the kernels themselves share.
#pragma once

#include <cuda_runtime.h>
#include <stddef.h>

#include "k3/params.h"

#ifdef __cplusplus
extern "C" {
#endif

// Batch-invariant mode (process-wide, default 0): the absorbed attention splits every
// sequence's keys at fixed multiples of 256 instead of sizing the splits by the batch, and the
// prefill always runs absorbed (the expanded form is chosen by the batch's tokens per sequence
// and passes over the whole batch's keys), so a sequence's output bits do not depend on the
// rest of the batch (up to 256 K keys; beyond, the split doubles with the batch's block-table
// width). Read by every call, workspace sizes too.
void k3_mla_set_batch_invariant(int enabled);

// Workspace bytes of k3_mla_decode, and enough for k3_mla_prefill too (the expanded prefill
// fits its key passes into what it is given, else the prefill runs absorbed).
size_t k3_mla_workspace_size(int num_tokens, int num_heads, int kv_lora_rank, int max_blocks, int block_size);

// Workspace bytes of k3_mla_prefill for the path its dispatch rule picks with unlimited
// workspace: the expanded form's (per-pass K/V buffers capped at 512 MB, plus T*H*(Dv+1)
// fp32 accumulators when the key bound B*max_blocks*block_size needs several passes), or
// k3_mla_workspace_size where the prefill runs absorbed.
size_t k3_mla_prefill_workspace_size(int num_tokens, int num_seqs, int num_heads, int qk_nope_head_dim,
                                     int qk_rope_head_dim, int kv_lora_rank, int v_head_dim, int max_blocks,
                                     int block_size);

// 1 if k3_mla_prefill takes the expanded form with this workspace: supported head dims,
// num_tokens >= 384 * num_seqs (few new tokens over a long context stay absorbed) and
// enough workspace for at least 128 keys per pass; else 0 (absorbed form).
int k3_mla_prefill_uses_expanded(int num_tokens, int num_seqs, int num_heads, int qk_nope_head_dim,
                                 int qk_rope_head_dim, int kv_lora_rank, int v_head_dim, int max_blocks,
                                 int block_size, size_t workspace_bytes);

// Contracts K3MlaDecode / K3MlaPrefill (K3MlaParams, k3/params.h). Both insert the new
// latents; decode runs the absorbed form, prefill the expanded or the absorbed one
// (k3_mla_prefill_uses_expanded).
int k3_mla_decode(const K3MlaParams* p, cudaStream_t stream);
int k3_mla_prefill(const K3MlaParams* p, cudaStream_t stream);

// The expanded prefill whatever the dispatch rule says (tests, benchmarks), with passes of
// key_chunk (p->key_chunk) keys (0: the default cap); 0 workspace bytes if unsupported.
size_t k3_mla_prefill_expanded_workspace_size(int num_tokens, int num_seqs, int num_heads, int qk_nope_head_dim,
                                              int qk_rope_head_dim, int kv_lora_rank, int v_head_dim,
                                              int max_blocks, int block_size, int key_chunk);
int k3_mla_prefill_expanded(const K3MlaParams* p, cudaStream_t stream);

// The attention part alone (FlashMLA's scope), for benchmarks and callers that do the W_UK /
// W_UV products themselves: a_lat [T,H,R] from q_lat [T,H,R] and q_pe = q[:, :, nope:].
int k3_mla_latent_attention(const void* q_lat, const void* q, const int* cu_seqlens, const int* context_lens,
                            const int* block_tables, const void* latent_cache, void* a_lat, int num_tokens,
                            int num_seqs, int max_blocks, int block_size, int num_heads, int qk_nope_head_dim,
                            int qk_rope_head_dim, int kv_lora_rank, float softmax_scale, void* workspace,
                            size_t workspace_bytes, cudaStream_t stream);

// The fp8 latent cache (contracts K3MlaDecodeFp8 / K3MlaPrefillFp8, K3MlaFp8Params; rows of
// R E4M3 codes | R/Q fp32 scales | DR bf16 rope values, k3/mla/fp8_latent.cuh): the launchers
// above with the latents quantised on insert and dequantised on read. Also needs
// scale_group > 0, a multiple of 16 dividing kv_lora_rank, and rows of a multiple of 16 bytes;
// else cudaErrorInvalidValue. Decode workspace: k3_mla_workspace_size; the expanded prefill's
// adds one bf16 row per pass key.
int k3_mla_decode_fp8(const K3MlaFp8Params* p, cudaStream_t stream);
int k3_mla_prefill_fp8(const K3MlaFp8Params* p, cudaStream_t stream);
int k3_mla_prefill_expanded_fp8(const K3MlaFp8Params* p, cudaStream_t stream);
size_t k3_mla_prefill_fp8_workspace_size(int num_tokens, int num_seqs, int num_heads, int qk_nope_head_dim,
                                         int qk_rope_head_dim, int kv_lora_rank, int v_head_dim, int max_blocks,
                                         int block_size);
int k3_mla_prefill_fp8_uses_expanded(int num_tokens, int num_seqs, int num_heads, int qk_nope_head_dim,
                                     int qk_rope_head_dim, int kv_lora_rank, int v_head_dim, int max_blocks,
                                     int block_size, size_t workspace_bytes);
size_t k3_mla_prefill_expanded_fp8_workspace_size(int num_tokens, int num_seqs, int num_heads, int qk_nope_head_dim,
                                                  int qk_rope_head_dim, int kv_lora_rank, int v_head_dim,
                                                  int max_blocks, int block_size, int key_chunk);
int k3_mla_latent_attention_fp8(const void* q_lat, const void* q, const int* cu_seqlens, const int* context_lens,
                                const int* block_tables, const void* latent_cache, void* a_lat, int num_tokens,
                                int num_seqs, int max_blocks, int block_size, int num_heads, int qk_nope_head_dim,
                                int qk_rope_head_dim, int kv_lora_rank, float softmax_scale, int scale_group,
                                void* workspace, size_t workspace_bytes, cudaStream_t stream);

#ifdef __cplusplus
}
#endif
