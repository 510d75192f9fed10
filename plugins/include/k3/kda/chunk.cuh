// Chunked KDA prefill (spec §4.5.7, C = 64) with the short conv, gate, beta and q/k
// l2-norm fused in (§4.5.2-§4.5.5). Three launches (plus the conv-state update):
//
// chunk_table_kernel: first global chunk index of every sequence (a prefix sum of
//   ceil(len/64)), so that the other kernels find their chunk by a binary search.
// chunk_prepare_kernel (chunk_prepare.cuh), one CTA per (chunk, head), all chunks at once:
//   everything that does not depend on the state, written to the workspace in bf16:
//   Q⊙e^Γ, W = Linv·(β⊙K⊙e^Γ), K⊙e^{Γn−Γ}, U = Linv·(β⊙V), A_qk, and e^{Γn} (fp32),
//   with Linv = (I + A_kk)^{-1}.
// chunk_walk_kernel (chunk_walk.cuh), one CTA per (sequence, head, value tile), walks the
//   chunks with its fp32 state slice in registers:
//   U' = U − W·S,  O = (Q⊙e^Γ)·S + A_qk·U',  S ← e^{Γn}⊙S + (K⊙e^{Γn−Γ})ᵀ·U'.
// Products run on bf16 tensor cores with fp32 accumulation (FLA / vLLM precision, §7.6);
// the state carried from chunk to chunk stays fp32.
#pragma once

#include "k3/kda/mma.cuh"
#include "k3/kda/params.cuh"

namespace k3 {
namespace kda {

constexpr int kChunk = 64;

// Upper bound on the chunks of a varlen batch: Σ ceil(len/64) <= T/64 + B.
__host__ __device__ inline int max_chunks(int num_tokens, int num_seqs) {
  return (num_tokens + kChunk - 1) / kChunk + num_seqs;
}

// Workspace of one (chunk, head), in bf16 elements, row-major and dense.
template <int D>
struct ChunkWork {
  static constexpr int QE = 0;                      // [64][D] Q ⊙ e^Γ
  static constexpr int W = QE + kChunk * D;         // [64][D] Linv·(β ⊙ K ⊙ e^Γ)
  static constexpr int KD = W + kChunk * D;         // [64][D] K ⊙ e^{Γn−Γ}
  static constexpr int U = KD + kChunk * D;         // [64][D] Linv·(β ⊙ V)
  static constexpr int AQK = U + kChunk * D;        // [64][64], read up to the diagonal block
  static constexpr int DECAY = AQK + kChunk * kChunk;  // [D] fp32 e^{Γn}
  static constexpr int ELEMS = DECAY + 2 * D;
  static constexpr size_t BYTES = (size_t)ELEMS * 2;
};

// The chunk table sits in front of the chunk workspaces (256-byte aligned).
__host__ __device__ inline size_t chunk_table_bytes(int num_seqs) {
  return ((size_t)(num_seqs + 1) * sizeof(int) + 255) / 256 * 256;
}

__device__ __forceinline__ int seq_chunks(const int* cu_seqlens, int b) {
  return (cu_seqlens[b + 1] - cu_seqlens[b] + kChunk - 1) / kChunk;
}

// starts[b] = Σ_{s<b} ceil(len_s / 64) for b = 0..B; one CTA of 1024 threads.
constexpr int kTableThreads = 1024;
__global__ void __launch_bounds__(kTableThreads) chunk_table_kernel(const int* cu_seqlens, int num_seqs,
                                                                    int* starts) {
  __shared__ int warp_sums[kTableThreads / 32];
  const int tid = threadIdx.x, lane = tid % 32, warp = tid / 32;
  const int per = (num_seqs + kTableThreads - 1) / kTableThreads;
  const int lo = min(num_seqs, tid * per), hi = min(num_seqs, lo + per);
  int sum = 0;
  for (int b = lo; b < hi; ++b) sum += seq_chunks(cu_seqlens, b);
  int x = sum;  // inclusive scan over the warp
#pragma unroll
  for (int o = 1; o < 32; o <<= 1) {
    const int y = __shfl_up_sync(0xffffffffu, x, o);
    if (lane >= o) x += y;
  }
  if (lane == 31) warp_sums[warp] = x;
  __syncthreads();
  if (warp == 0) {
    int w = warp_sums[lane];
#pragma unroll
    for (int o = 1; o < 32; o <<= 1) {
      const int y = __shfl_up_sync(0xffffffffu, w, o);
      if (lane >= o) w += y;
    }
    warp_sums[lane] = w;
  }
  __syncthreads();
  int run = x - sum + (warp > 0 ? warp_sums[warp - 1] : 0);
  for (int b = lo; b < hi; ++b) {
    starts[b] = run;
    run += seq_chunks(cu_seqlens, b);
  }
  if (tid == kTableThreads - 1) starts[num_seqs] = run;
}

}  // namespace kda
}  // namespace k3
