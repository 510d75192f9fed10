// Chunked KDA prefill (spec §4.5.7, C = 64) with the short conv, gate, beta and q/k
// l2-norm fused in (§4.5.2-§4.5.5). Three launches (plus the conv-state update):
//
// chunk_table_kernel: first global chunk index of every sequence (a prefix sum of
//   ceil(len/64)), so that the other kernels find their chunk by a binary search; and the
//   verdict on the step's snapshot points (snapshot_entry_bad below).
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

// The chunk table sits in front of the chunk workspaces (256-byte aligned): starts[0..B], then
// the snapshot verdict word (kSnapshotsBad or 0).
__host__ __device__ inline size_t chunk_table_bytes(int num_seqs) {
  return ((size_t)(num_seqs + 2) * sizeof(int) + 255) / 256 * 256;
}
constexpr int kSnapshotsBad = 1;
__host__ __device__ inline size_t snapshot_verdict_offset(int num_seqs) {
  return (size_t)(num_seqs + 1) * sizeof(int);
}

__device__ __forceinline__ int seq_chunks(const int* cu_seqlens, int b) {
  return (cu_seqlens[b + 1] - cu_seqlens[b] + kChunk - 1) / kChunk;
}

// Whether entry i of sequence b's snapshot points breaks the contract (the reference op's
// rules: -1 entries last; each point in (0, len], a multiple of 64 or len, strictly
// increasing; its row in [0, Ns)). Judged from the entry and its neighbours only, so every
// entry of the step is checked at once. Distinct rows are the caller's (a duplicate row can
// only garble rows the caller named, never write outside the pools).
__device__ __forceinline__ bool snapshot_entry_bad(const Params& p, int b, int i) {
  const int N = p.snapshot_width;
  const int* o = p.snapshot_offsets + (int64_t)b * N;
  const int x = o[i];
  if (x == -1) return i + 1 < N && o[i + 1] != -1;
  const int len = p.cu_seqlens[b + 1] - p.cu_seqlens[b];
  const int prev = i > 0 ? o[i - 1] : 0;  // -1 before a point is caught by that entry
  const int row = p.snapshot_rows[(int64_t)b * N + i];
  return x <= prev || x > len || (x % kChunk != 0 && x != len) || row < 0 || row >= p.snapshot_slots;
}

// starts[b] = Σ_{s<b} ceil(len_s / 64) for b = 0..B, and the snapshot verdict word (after
// starts[B]): kSnapshotsBad when any entry of the step breaks the rules. Then the step takes
// no snapshot at all (the kernels that write them read the word), so a bad point can neither
// write out of bounds nor leave a half-written row; the binding reports the word by name. One
// CTA of 1024 threads.
constexpr int kTableThreads = 1024;
__global__ void __launch_bounds__(kTableThreads) chunk_table_kernel(Params p, int* starts) {
  __shared__ int warp_sums[kTableThreads / 32];
  __shared__ int bad;
  const int num_seqs = p.num_seqs;
  const int* cu_seqlens = p.cu_seqlens;
  const int tid = threadIdx.x, lane = tid % 32, warp = tid / 32;
  if (tid == 0) bad = 0;
  // every entry on its own: one round of independent loads whatever the batch (B x N)
  const int entries = num_seqs * p.snapshot_width;
  bool mine = false;
  for (int e = tid; e < entries; e += kTableThreads)
    mine |= snapshot_entry_bad(p, e / p.snapshot_width, e % p.snapshot_width);
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
  __syncthreads();  // also orders `bad = 0` before the stores below
  if (mine) bad = kSnapshotsBad;
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
  if (tid == kTableThreads - 1) {
    starts[num_seqs] = run;
    starts[num_seqs + 1] = bad;
  }
}

}  // namespace kda
}  // namespace k3
