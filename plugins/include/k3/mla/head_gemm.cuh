// Per-head GEMMs of the absorbed MLA form (spec §4.4.5):
//   q_lat[t,h,:] = q_nope[t,h,:] · W_UK[h]      (A [T,Dn] x B [Dn,R], B n-contiguous)
//   out[t,h,:]   = a_lat[t,h,:] · W_UV[h]^T     (A [T,R]  x B [R,Dv], B stored [Dv][R])
// bf16 operands, fp32 accumulation on tensor cores, bf16 result.
#pragma once

#include "k3/mla/ptx.cuh"

namespace k3::mla {

struct HeadGemmParams {
  const bf16* a;  // row t of head h at a + h*a_head + t*lda
  int64_t lda, a_head;
  const bf16* b;  // head h at b + h*b_head; [K][N] (ldb = N stride) or [N][K] (ldb = K stride)
  int64_t ldb, b_head;
  bf16* c;  // row t of head h at c + h*c_head + t*ldc
  int64_t ldc, c_head;
  int m, n, k;  // n % 8 == 0, k % 32 == 0
};

constexpr int kGemmBM = 64, kGemmBN = 64, kGemmBK = 32, kGemmThreads = 128;

// Grid (ceil(n/64), ceil(m/64), heads); 4 warps of 32x32; two-stage cp.async pipeline.
// kBStoredNK: B is stored [N][K] (k contiguous, W_UV); otherwise [K][N] (W_UK).
template <bool kBStoredNK>
__global__ void __launch_bounds__(kGemmThreads) head_gemm_kernel(const HeadGemmParams p) {
  constexpr int kAStride = kGemmBK + 8;  // 80 B rows: 5 16-byte chunks, conflict-free ldmatrix
  constexpr int kBRows = kBStoredNK ? kGemmBN : kGemmBK;
  constexpr int kBStride = kBStoredNK ? kGemmBK + 8 : kGemmBN + 8;  // 80 B or 144 B rows
  __shared__ __align__(16) bf16 sa[2][kGemmBM * kAStride];
  __shared__ __align__(16) bf16 sb[2][kBRows * kBStride];

  const int head = blockIdx.z;
  const int m0 = blockIdx.y * kGemmBM, n0 = blockIdx.x * kGemmBN;
  const bf16* a = p.a + head * p.a_head;
  const bf16* b = p.b + head * p.b_head;
  const int tid = threadIdx.x, lane = tid & 31, warp = tid >> 5;
  const int wm = (warp >> 1) * 32, wn = (warp & 1) * 32;

  auto load = [&](int k0, int stage) {
#pragma unroll
    for (int i = 0; i < 2; ++i) {  // A: 64 rows x 4 chunks
      const int id = tid + i * kGemmThreads, row = id >> 2, ch = id & 3;
      const bool ok = m0 + row < p.m;
      const bf16* src = ok ? a + (m0 + row) * p.lda + k0 + ch * 8 : a;
      cp_async16(&sa[stage][row * kAStride + ch * 8], src, ok ? 16 : 0);
    }
#pragma unroll
    for (int i = 0; i < 2; ++i) {
      const int id = tid + i * kGemmThreads;
      if constexpr (kBStoredNK) {  // 64 n-rows x 4 k-chunks
        const int row = id >> 2, ch = id & 3;
        const bool ok = n0 + row < p.n;
        const bf16* src = ok ? b + (n0 + row) * p.ldb + k0 + ch * 8 : b;
        cp_async16(&sb[stage][row * kBStride + ch * 8], src, ok ? 16 : 0);
      } else {  // 32 k-rows x 8 n-chunks
        const int row = id >> 3, ch = id & 7;
        const bool ok = n0 + ch * 8 < p.n;
        const bf16* src = ok ? b + (k0 + row) * p.ldb + n0 + ch * 8 : b;
        cp_async16(&sb[stage][row * kBStride + ch * 8], src, ok ? 16 : 0);
      }
    }
    cp_async_commit();
  };

  float acc[2][4][4] = {};
  const int k_tiles = p.k / kGemmBK;
  load(0, 0);
  for (int kt = 0; kt < k_tiles; ++kt) {
    if (kt + 1 < k_tiles) {
      load((kt + 1) * kGemmBK, (kt + 1) & 1);
      cp_async_wait<1>();
    } else {
      cp_async_wait<0>();
    }
    __syncthreads();
    const bf16* ta = sa[kt & 1];
    const bf16* tb = sb[kt & 1];
#pragma unroll
    for (int ks = 0; ks < kGemmBK; ks += 16) {
      uint32_t af[2][4], bfr[2][4];
#pragma unroll
      for (int mi = 0; mi < 2; ++mi)
        ldmatrix_x4(af[mi], ta + (wm + mi * 16 + (lane & 15)) * kAStride + ks + (lane >> 4) * 8);
#pragma unroll
      for (int nj = 0; nj < 2; ++nj) {  // each covers two n8 blocks
        if constexpr (kBStoredNK) {
          ldmatrix_x4(bfr[nj], tb + (wn + nj * 16 + (lane & 7) + ((lane >> 4) << 3)) * kBStride + ks +
                                   ((lane >> 3) & 1) * 8);
        } else {
          ldmatrix_x4_trans(bfr[nj], tb + (ks + (lane & 15)) * kBStride + wn + nj * 16 + (lane >> 4) * 8);
        }
      }
#pragma unroll
      for (int mi = 0; mi < 2; ++mi)
#pragma unroll
        for (int nj = 0; nj < 2; ++nj) {
          mma_bf16(acc[mi][2 * nj], af[mi], bfr[nj][0], bfr[nj][1]);
          mma_bf16(acc[mi][2 * nj + 1], af[mi], bfr[nj][2], bfr[nj][3]);
        }
    }
    __syncthreads();  // the next load overwrites this stage
  }

  bf16* c = p.c + head * p.c_head;
  const int g = lane >> 2, cq = lane & 3;
#pragma unroll
  for (int mi = 0; mi < 2; ++mi)
#pragma unroll
    for (int ni = 0; ni < 4; ++ni) {
      const int col = n0 + wn + ni * 8 + 2 * cq;
      if (col >= p.n) continue;
#pragma unroll
      for (int half = 0; half < 2; ++half) {
        const int row = m0 + wm + mi * 16 + g + half * 8;
        if (row < p.m)
          *reinterpret_cast<uint32_t*>(c + row * p.ldc + col) =
              pack_bf16(acc[mi][ni][2 * half], acc[mi][ni][2 * half + 1]);
      }
    }
}

}  // namespace k3::mla
