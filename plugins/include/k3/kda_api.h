// C ABI of the KDA kernels (plugins/c_api/kda.cu): the one declaration that the torch
// bindings (ctypes), the TensorRT plugins and the kernels themselves share.
#pragma once

#include <cuda_runtime.h>
#include <stddef.h>

#include "k3/params.h"

#ifdef __cplusplus
extern "C" {
#endif

// Which head_dim / conv widths the kernels are built for (callers fall back otherwise).
int k3_kda_supported(int head_dim, int conv_width);

// Bytes of device workspace k3_kda_prefill needs (> 0: the chunk table and the snapshot verdict
// come first, for both gate forms).
size_t k3_kda_prefill_workspace_bytes(int num_tokens, int num_seqs, int num_heads, int head_dim,
                                      float lower_bound);

// Byte offset of the snapshot verdict word in that workspace: after a k3_kda_prefill with
// num_seqs > 0 (stream order) 0, or 1 when an entry of snapshot_offsets / snapshot_rows broke
// the contract's rules; then the call wrote no snapshot at all.
size_t k3_kda_prefill_snapshot_verdict_offset(int num_seqs);

// Prefill (contract K3KdaPrefill), writing the snapshots at the snapshot points for both gate
// forms. The factorised intra-chunk decay needs |lower_bound| <= 10; the softplus gate
// (lower_bound == 0) runs the exact token recurrence. `p->workspace`:
// k3_kda_prefill_workspace_bytes(...) bytes, 16-byte aligned (null: cudaErrorInvalidValue).
int k3_kda_prefill(const K3KdaParams* p, cudaStream_t stream);

// Decode / speculative verify (contract K3KdaDecode): token recurrence, any number of
// tokens per sequence. Same params as k3_kda_prefill; the workspace may be null.
int k3_kda_decode(const K3KdaParams* p, cudaStream_t stream);

#ifdef __cplusplus
}
#endif
