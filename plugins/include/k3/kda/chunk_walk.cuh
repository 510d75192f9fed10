// chunk_walk_kernel: one CTA per (sequence, head, G·BV value columns) walks the sequence's
// chunks (chunk.cuh has the overview): G groups of 4 warps, group g on value columns
// [g·BV, (g+1)·BV) of the CTA's, sharing one copy of the chunk's operands (G = 2: twice the
// warps on the same operand traffic and the same number of CTAs as one group of 2·BV columns).
// A group's D x BV slice of the fp32 state lives in the accumulator registers of its state
// update; a bf16 copy in shared memory is the operand of the next chunk's products. With two
// stages (NS = 2, long sequences) the operands of chunk c+1 are copied (cp.async) while chunk c
// is computed, one CTA per SM; with one stage (short sequences: the per-CTA start and end
// dominate) two CTAs share an SM and overlap each other's copies instead. Per chunk:
//   P1  U' = U − W·S and O = (Q⊙e^Γ)·S    (warp w of a group: rows 16w..16w+15)
//   P2  O += A_qk·U'                       (same rows; A_qk is causal)
//   P3  S ← e^{Γn}⊙S + (K⊙e^{Γn−Γ})ᵀ·U'    (16 x 16 state tiles spread over a group's warps)
#pragma once

#include "k3/kda/chunk.cuh"

namespace k3 {
namespace kda {

constexpr int kWalkThreads = 128;

// Shared memory of the walk kernel, in bf16 elements: NS operand stages, then the state copy
// and U'.
template <int D, int BV, int NS>
struct WalkLayout {
  static constexpr int LB = D + 8, LAB = kChunk + 8, LV = BV + 8;
  static constexpr int QE = 0;
  static constexpr int W = QE + kChunk * LB;
  static constexpr int KD = W + kChunk * LB;
  static constexpr int AQK = KD + kChunk * LB;
  static constexpr int U = AQK + kChunk * LAB;
  static constexpr int DECAY = U + kChunk * LV;  // [D] fp32
  static constexpr int STAGE = DECAY + 2 * D;
  static constexpr int S = NS * STAGE;           // [D][LV]
  static constexpr int UP = S + D * LV;          // [64][LV]
  static constexpr size_t BYTES = (size_t)(UP + kChunk * LV) * 2;
};

// One chunk's operands (BV value columns `vt` of U) into a stage; 16-byte cp.async each, by NT threads.
template <int D, int BV, int NT>
__device__ __forceinline__ void load_stage(__nv_bfloat16* st, const __nv_bfloat16* w, int vt) {
  using Lay = WalkLayout<D, BV, 1>;
  using Work = ChunkWork<D>;
  constexpr int RC = D / 8;  // 16-byte pieces per row
  // Q⊙e^Γ, W, K⊙e^{Γn−Γ}: consecutive [64][D] matrices in both places
  for (int idx = threadIdx.x; idx < 3 * kChunk * RC; idx += NT) {
    const int r = idx / RC, c = (idx % RC) * 8;  // r runs over the 3 x 64 rows
    cp_async16(st + Lay::QE + r * Lay::LB + c, w + Work::QE + r * D + c);
  }
  for (int idx = threadIdx.x; idx < kChunk * (kChunk / 8); idx += NT) {
    const int r = idx / (kChunk / 8), c = (idx % (kChunk / 8)) * 8;
    cp_async16(st + Lay::AQK + r * Lay::LAB + c, w + Work::AQK + r * kChunk + c);
  }
  for (int idx = threadIdx.x; idx < kChunk * (BV / 8); idx += NT) {
    const int r = idx / (BV / 8), c = (idx % (BV / 8)) * 8;
    cp_async16(st + Lay::U + r * Lay::LV + c, w + Work::U + r * D + vt * BV + c);
  }
  for (int idx = threadIdx.x; idx < D / 4; idx += NT)
    cp_async16(st + Lay::DECAY + idx * 8, w + Work::DECAY + idx * 8);
  cp_async_commit();
}

// The CTA's D x BV slice of the fp32 state, from the state-update accumulators, to `dst`
// (row stride D): the final state, or a prefix-cache snapshot at a chunk boundary.
template <int D, int NP, int SU>
__device__ __forceinline__ void store_state(float* dst, const float (&accS)[SU][2][4], int warp) {
  constexpr int TILES = (D / 16) * NP;
#pragma unroll
  for (int i = 0; i < SU; ++i) {
    const int tile = warp + 4 * i;
    if (tile >= TILES) continue;
    const int m0 = 16 * (tile / NP), n0 = 16 * (tile % NP);
#pragma unroll
    for (int nt = 0; nt < 2; ++nt)
#pragma unroll
      for (int half = 0; half < 2; ++half) {
        const int r = m0 + acc_row(2 * half), c = n0 + 8 * nt + acc_col(0);
        *reinterpret_cast<float2*>(dst + r * D + c) =
            make_float2(accS[i][nt][2 * half], accS[i][nt][2 * half + 1]);
      }
  }
}

template <int D, int BV, int NS, int G>
__global__ void __launch_bounds__(kWalkThreads * G, 3 - NS)
    chunk_walk_kernel(Params p, const __nv_bfloat16* work, const int* starts) {
  static_assert(BV == 16 || BV == 32, "value tile of 16 or 32 columns");
  static_assert(NS == 1 || NS == 2, "one or two operand stages");
  static_assert(G == 1 || G == 2, "one or two groups of 4 warps");
  constexpr int NT = kWalkThreads * G, CV = G * BV;  // threads, value columns of the CTA
  using Lay = WalkLayout<D, CV, NS>;
  using Work = ChunkWork<D>;
  constexpr int LB = Lay::LB, LAB = Lay::LAB, LV = Lay::LV;
  constexpr int NVT = D / CV, NP = BV / 16;
  constexpr int TILES = (D / 16) * NP, SU = (TILES + 3) / 4;  // state tiles, per warp
  extern __shared__ __align__(16) unsigned char smem_raw[];
  __nv_bfloat16* smem = reinterpret_cast<__nv_bfloat16*>(smem_raw);
  __nv_bfloat16* sS = smem + Lay::S;
  __nv_bfloat16* sU = smem + Lay::UP;

  const int h = blockIdx.x / NVT, vt = blockIdx.x % NVT, b = blockIdx.y;
  const int H = p.num_heads, P = H * D;
  const int bos = p.cu_seqlens[b], eos = p.cu_seqlens[b + 1];
  if (eos <= bos) return;
  const int slot = p.state_slots[b];
  const bool continues = p.has_initial_state[b] != 0;
  const int warp = threadIdx.x / 32 % 4, cg = threadIdx.x / kWalkThreads * BV;  // group's columns
  const int first = starts[b], chunks = (eos - bos + kChunk - 1) / kChunk;
  const __nv_bfloat16* w0 = work + ((int64_t)first * H + h) * Work::ELEMS;
  if (NS == 2) load_stage<D, CV, NT>(smem, w0, vt);

  float* state = p.recurrent_state + ((int64_t)slot * H + h) * D * D + vt * CV + cg;
  // prefix-cache snapshot points of this sequence, in increasing order: the next one (none when
  // the chunk table found a bad entry in the step)
  const int* snap_at = p.snapshot_offsets + (int64_t)b * p.snapshot_width;
  const bool snapshots = p.snapshot_width > 0 && starts[p.num_seqs + 1] != kSnapshotsBad;
  int snap = 0, snap_tokens = snapshots ? snap_at[0] : -1;
  float accS[SU][2][4];
#pragma unroll
  for (int i = 0; i < SU; ++i) {
    const int tile = warp + 4 * i;
    if (tile >= TILES) continue;
    const int m0 = 16 * (tile / NP), n0 = 16 * (tile % NP);
#pragma unroll
    for (int nt = 0; nt < 2; ++nt)
#pragma unroll
      for (int half = 0; half < 2; ++half) {
        const int r = m0 + acc_row(2 * half), c = n0 + 8 * nt + acc_col(0);
        const float2 x = continues ? *reinterpret_cast<const float2*>(state + r * D + c)
                                   : make_float2(0.f, 0.f);
        accS[i][nt][2 * half] = x.x;
        accS[i][nt][2 * half + 1] = x.y;
        *reinterpret_cast<__nv_bfloat162*>(sS + r * LV + cg + c) = pack_bf16(x.x, x.y);
      }
  }

  for (int chunk = 0; chunk < chunks; ++chunk) {
    if (NS == 1) {
      if (chunk > 0) __syncthreads();  // every warp is done with the stage
      load_stage<D, CV, NT>(smem, w0 + (int64_t)chunk * H * Work::ELEMS, vt);
    }
    cp_async_wait_all();
    __syncthreads();  // stage `chunk` and the state copy visible; the other stage free
    if (NS == 2 && chunk + 1 < chunks)
      load_stage<D, CV, NT>(smem + ((chunk + 1) & 1) * Lay::STAGE,
                        w0 + (int64_t)(chunk + 1) * H * Work::ELEMS, vt);
    const __nv_bfloat16* st = smem + (NS == 2 ? (chunk & 1) * Lay::STAGE : 0);
    const int t0 = bos + chunk * kChunk, n = min(kChunk, eos - t0);

    // P1: W·S and (Q⊙e^Γ)·S for rows 16w..16w+15; U' = U − W·S to shared memory
    float accW[NP][2][4] = {}, accO[NP][2][4] = {};
#pragma unroll
    for (int k0 = 0; k0 < D; k0 += 16) {
      uint32_t aw[4], aq[4];
      load_a(aw, st + Lay::W, LB, 16 * warp, k0);
      load_a(aq, st + Lay::QE, LB, 16 * warp, k0);
#pragma unroll
      for (int np = 0; np < NP; ++np) {
        uint32_t bs[4];
        load_b_kn(bs, sS, LV, k0, cg + 16 * np);
        mma_16x16(accW[np], aw, bs);
        mma_16x16(accO[np], aq, bs);
      }
    }
#pragma unroll
    for (int np = 0; np < NP; ++np)
#pragma unroll
      for (int nt = 0; nt < 2; ++nt)
#pragma unroll
        for (int half = 0; half < 2; ++half) {
          const int r = 16 * warp + acc_row(2 * half), c = 16 * np + 8 * nt + acc_col(0);
          const float2 u = __bfloat1622float2(
              *reinterpret_cast<const __nv_bfloat162*>(st + Lay::U + r * LV + cg + c));
          *reinterpret_cast<__nv_bfloat162*>(sU + r * LV + cg + c) =
              pack_bf16(u.x - accW[np][nt][2 * half], u.y - accW[np][nt][2 * half + 1]);
        }
    __syncthreads();  // U' complete; every warp is done with the state copy

    // P2: O += A_qk·U' (columns up to the diagonal block), then store the chunk's rows
    for (int k0 = 0; k0 <= 16 * warp; k0 += 16) {
      uint32_t aa[4];
      load_a(aa, st + Lay::AQK, LAB, 16 * warp, k0);
#pragma unroll
      for (int np = 0; np < NP; ++np) {
        uint32_t bu[4];
        load_b_kn(bu, sU, LV, k0, cg + 16 * np);
        mma_16x16(accO[np], aa, bu);
      }
    }
#pragma unroll
    for (int np = 0; np < NP; ++np)
#pragma unroll
      for (int nt = 0; nt < 2; ++nt)
#pragma unroll
        for (int half = 0; half < 2; ++half) {
          const int r = 16 * warp + acc_row(2 * half), c = 16 * np + 8 * nt + acc_col(0);
          if (r < n)
            *reinterpret_cast<__nv_bfloat162*>(p.out + (int64_t)(t0 + r) * P + h * D + vt * CV + cg + c) =
                pack_bf16(accO[np][nt][2 * half], accO[np][nt][2 * half + 1]);
        }

    // P3: S ← e^{Γn}⊙S + (K⊙e^{Γn−Γ})ᵀ·U', and its bf16 copy for the next chunk
    const float* decay = reinterpret_cast<const float*>(st + Lay::DECAY);
#pragma unroll
    for (int i = 0; i < SU; ++i) {
      const int tile = warp + 4 * i;
      if (tile >= TILES) continue;
      const int m0 = 16 * (tile / NP), n0 = 16 * (tile % NP);
      const float d0 = decay[m0 + acc_row(0)], d1 = decay[m0 + acc_row(2)];
#pragma unroll
      for (int nt = 0; nt < 2; ++nt) {
        accS[i][nt][0] *= d0;
        accS[i][nt][1] *= d0;
        accS[i][nt][2] *= d1;
        accS[i][nt][3] *= d1;
      }
#pragma unroll
      for (int k0 = 0; k0 < kChunk; k0 += 16) {
        uint32_t ak[4], bu[4];
        load_a_trans(ak, st + Lay::KD, LB, m0, k0);
        load_b_kn(bu, sU, LV, k0, cg + n0);
        mma_16x16(accS[i], ak, bu);
      }
#pragma unroll
      for (int nt = 0; nt < 2; ++nt)
#pragma unroll
        for (int half = 0; half < 2; ++half) {
          const int r = m0 + acc_row(2 * half), c = n0 + 8 * nt + acc_col(0);
          *reinterpret_cast<__nv_bfloat162*>(sS + r * LV + cg + c) =
              pack_bf16(accS[i][nt][2 * half], accS[i][nt][2 * half + 1]);
        }
    }
    // the state after this chunk is the one at a snapshot point asking for it (uniform branch)
    if (snap_tokens == t0 - bos + n) {
      const int dst_row = p.snapshot_rows[(int64_t)b * p.snapshot_width + snap];  // in bounds: checked
      store_state<D, NP, SU>(p.snapshot_recurrent + ((int64_t)dst_row * H + h) * D * D + vt * CV + cg, accS, warp);
      snap_tokens = ++snap < p.snapshot_width ? snap_at[snap] : -1;
    }
  }

  store_state<D, NP, SU>(state, accS, warp);
}

}  // namespace kda
}  // namespace k3
