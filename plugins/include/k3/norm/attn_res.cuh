// AttnRes mix (spec §4.7) fused with the residual add before it and the RMSNorm after it, fp32 math
// (ops/norm/reference.py's attn_res_mix_norm is the reference). Each output token's row is split
// over a thread-block cluster of C CTAs (C fixed by dim alone: a row's bits do not depend on the
// batch); a CTA holds its contiguous slice of every source in registers, so each source is read
// once and every load is issued up front (one round of memory latency per call). The 2 n per-source
// sums (logit dot products and mean squares) and the mix's mean square are each summed in a fixed
// order (per thread, warp butterfly, warps in order, then the cluster's CTAs through distributed
// shared memory), identical in every CTA of the cluster; each CTA forms the softmax itself.
#pragma once

#include <cooperative_groups.h>
#include <math.h>

#include "k3/norm/vec.cuh"
#include "k3/norm_api.h"

namespace k3 {
namespace norm {

template <int VEC>
__device__ __forceinline__ void unpack_bf16(const typename Bytes<VEC>::T& raw, float (&v)[VEC]) {
  const __nv_bfloat16* h = reinterpret_cast<const __nv_bfloat16*>(&raw);
#pragma unroll
  for (int k = 0; k < VEC; ++k) v[k] = __bfloat162float(h[k]);
}

template <int VEC>
__device__ __forceinline__ typename Bytes<VEC>::T pack_bf16(const float (&v)[VEC]) {
  typename Bytes<VEC>::T raw;
  __nv_bfloat16* h = reinterpret_cast<__nv_bfloat16*>(&raw);
#pragma unroll
  for (int k = 0; k < VEC; ++k) h[k] = __float2bfloat16_rn(v[k]);
  return raw;
}

template <int VEC>
__device__ __forceinline__ typename Bytes<VEC>::T load_raw(const void* base, int64_t at) {
  return *reinterpret_cast<const typename Bytes<VEC>::T*>(static_cast<const __nv_bfloat16*>(base) + at);
}

__device__ __forceinline__ float warp_sum(float v) {
#pragma unroll
  for (int o = 16; o > 0; o >>= 1) v += __shfl_xor_sync(0xffffffffu, v, o);
  return v;
}

constexpr int kMaxRanks = 8;   // CTAs per cluster, at most (the portable cluster size)
constexpr int kMaxTokens = 4;  // tokens per CTA, at most

// NS >= num_sources (compile-time, so the slices and sums live in registers); ITER vectors of VEC
// columns per thread and source. The CTA of cluster rank r covers vectors [r per_cta, (r+1) per_cta).
// With two vectors per thread a CTA takes blockDim.y tokens, one per row of threads (each row does
// what a CTA of one token does: the grouping changes no bits; fewer CTAs at large batches); at
// most 16 warps in all. With one vector per thread, one token per CTA (no grouping code).
template <int VEC, int NS, int ITER>
__global__ void __launch_bounds__(512) attn_res_mix_norm_kernel(K3AttnResMixParams p, int per_cta) {
  using Raw = typename Bytes<VEC>::T;
  namespace cg = cooperative_groups;
  const cg::cluster_group cluster = cg::this_cluster();
  __shared__ float partials[16][2 * NS];         // [warp of the CTA]
  __shared__ float cta_sums[kMaxTokens][2 * NS];  // read by the whole cluster
  __shared__ float cta_sq[16];                    // [warp of the CTA], read by the whole cluster
  constexpr bool grouped = ITER == 2;
  const int ranks = cluster.num_blocks(), rank = cluster.block_rank(), y = grouped ? threadIdx.y : 0;
  const int j = grouped ? blockIdx.x / ranks * blockDim.y + y : blockIdx.x / ranks, lane = threadIdx.x & 31;
  const int warps = blockDim.x >> 5, warp = y * warps + (threadIdx.x >> 5), n = p.num_sources, nvec = p.dim / VEC;
  const bool token = !grouped || j < p.out_tokens;  // the last CTA's spare rows of threads only join the barriers
  const int64_t off = token ? static_cast<int64_t>(p.rows != nullptr ? p.rows[j] : j) * p.dim : 0;
  const float inv_dim = 1.0f / p.dim;

  // every load first: the sources, the sub-layer output, the query and the norm weight
  Raw v[ITER][NS - 1], last[ITER];  // sources 0..n-2, then the partial sum (source n-1)
  float q[ITER][VEC], nw[ITER][VEC];
  int col[ITER];
  bool active[ITER];
#pragma unroll
  for (int it = 0; it < ITER; ++it) {
    const int local = it * blockDim.x + threadIdx.x, g = rank * per_cta + local;
    active[it] = token && local < per_cta && g < nvec;
    col[it] = g * VEC;
#pragma unroll
    for (int s = 0; s < NS - 1; ++s) v[it][s] = Raw{};
    last[it] = Raw{};
#pragma unroll
    for (int k = 0; k < VEC; ++k) q[it][k] = nw[it][k] = 0.0f;
    if (active[it]) {
#pragma unroll
      for (int s = 0; s < NS - 1; ++s) {
        if (s < n - 1) v[it][s] = load_raw<VEC>(p.sources[s], off + col[it]);
      }
      last[it] = load_raw<VEC>(p.sources[n - 1], off + col[it]);
      load_f32<VEC>(p.query + col[it], q[it]);
      load_weight<VEC>(p.norm_weight, p.norm_weight_type, col[it], nw[it]);
      if (p.residual != nullptr) {
        float r[VEC];
        unpack_bf16<VEC>(load_raw<VEC>(p.residual, off + col[it]), r);
        if (p.residual2 != nullptr) {
          float r2[VEC];
          unpack_bf16<VEC>(load_raw<VEC>(p.residual2, off + col[it]), r2);
#pragma unroll
          for (int k = 0; k < VEC; ++k) r[k] = round_bf16(r[k] + r2[k]);  // a = bf16(routed + shared), as torch adds
        }
        float x[VEC];
        unpack_bf16<VEC>(last[it], x);
#pragma unroll
        for (int k = 0; k < VEC; ++k) x[k] = x[k] + r[k];
        last[it] = pack_bf16<VEC>(x);  // the bf16 partial sum P + a (bf16 holds it exactly)
        if (p.partial_out != nullptr) {
          *reinterpret_cast<Raw*>(static_cast<__nv_bfloat16*>(p.partial_out) + off + col[it]) = last[it];
        }
      }
    }
  }

  // the 2 n sums: per thread, warp butterfly, warps in order, then the cluster's CTAs in order
  float dot[NS], ss[NS];
#pragma unroll
  for (int s = 0; s < NS; ++s) dot[s] = ss[s] = 0.0f;
#pragma unroll
  for (int it = 0; it < ITER; ++it) {
#pragma unroll
    for (int s = 0; s < NS; ++s) {
      if (s < n - 1 || s == NS - 1) {  // slot NS - 1: the partial sum
        float x[VEC];
        if (s < NS - 1) {
          unpack_bf16<VEC>(v[it][s], x);
        } else {
          unpack_bf16<VEC>(last[it], x);
        }
#pragma unroll
        for (int k = 0; k < VEC; ++k) {
          dot[s] += x[k] * q[it][k];
          ss[s] += x[k] * x[k];
        }
      }
    }
  }
#pragma unroll
  for (int s = 0; s < NS; ++s) {
    if (s < n - 1 || s == NS - 1) {
      dot[s] = warp_sum(dot[s]);
      ss[s] = warp_sum(ss[s]);
    }
  }
  if (lane == 0) {  // in source order: the partial sum's at n - 1
#pragma unroll
    for (int s = 0; s < NS - 1; ++s) {
      partials[warp][s] = dot[s];
      partials[warp][NS + s] = ss[s];
    }
    partials[warp][n - 1] = dot[NS - 1];
    partials[warp][NS + n - 1] = ss[NS - 1];
  }
  __syncthreads();
  if (threadIdx.x < 2 * NS && threadIdx.x % NS < n) {
    float total = 0.0f;
    for (int w = 0; w < warps; ++w) total += partials[y * warps + w][threadIdx.x];
    cta_sums[y][threadIdx.x] = total;
  }
  cluster.sync();
  // every warp of every CTA: lane s < n forms logit s, then the softmax as torch.softmax
  float total = 0.0f;
  if (lane < 2 * NS && lane % NS < n) {
    float part[kMaxRanks];  // every rank's load in flight at once, then the sum in rank order
#pragma unroll
    for (int r = 0; r < kMaxRanks; ++r) {
      part[r] = r < ranks ? *cluster.map_shared_rank(&cta_sums[y][lane], r) : 0.0f;
    }
#pragma unroll
    for (int r = 0; r < kMaxRanks; ++r) {
      if (r < ranks) total += part[r];
    }
  }
  const float lane_ss = __shfl_sync(0xffffffffu, total, (lane + NS) & 31);
  const float logit = lane < n ? total * rsqrtf(lane_ss * inv_dim + p.eps) : -INFINITY;
  float m = logit;
#pragma unroll
  for (int o = 16; o > 0; o >>= 1) m = fmaxf(m, __shfl_xor_sync(0xffffffffu, m, o));
  const float e = lane < n ? expf(logit - m) : 0.0f;
  float sum = 0.0f;
#pragma unroll
  for (int s = 0; s < NS; ++s) {
    const float es = __shfl_sync(0xffffffffu, e, s);
    if (s < n) sum += es;
  }
  const float lane_w = e / sum;
  float weight[NS - 1];
#pragma unroll
  for (int s = 0; s < NS - 1; ++s) weight[s] = __shfl_sync(0xffffffffu, lane_w, s);
  const float last_weight = __shfl_sync(0xffffffffu, lane_w, n - 1);

  // the mix, from the registers, and its mean square
  float mix[ITER][VEC];
  float sq = 0.0f;
#pragma unroll
  for (int it = 0; it < ITER; ++it) {
#pragma unroll
    for (int k = 0; k < VEC; ++k) mix[it][k] = 0.0f;  // the reference's sum() starts from 0 too (0 + -0 = +0)
    // products and sums rounded separately, in source order, as the reference's sum()
#pragma unroll
    for (int s = 0; s < NS - 1; ++s) {
      if (s < n - 1) {
        float x[VEC];
        unpack_bf16<VEC>(v[it][s], x);
#pragma unroll
        for (int k = 0; k < VEC; ++k) mix[it][k] = __fadd_rn(mix[it][k], __fmul_rn(weight[s], x[k]));
      }
    }
    float x[VEC];
    unpack_bf16<VEC>(last[it], x);
#pragma unroll
    for (int k = 0; k < VEC; ++k) mix[it][k] = __fadd_rn(mix[it][k], __fmul_rn(last_weight, x[k]));
#pragma unroll
    for (int k = 0; k < VEC; ++k) {
      if (p.round_mix) mix[it][k] = round_bf16(mix[it][k]);
      sq += mix[it][k] * mix[it][k];
    }
  }
  sq = warp_sum(sq);
  if (lane == 0) cta_sq[warp] = sq;
  cluster.sync();
  float sq_total = 0.0f;
  for (int e2 = lane; e2 < ranks * warps; e2 += 32) {
    sq_total += *cluster.map_shared_rank(&cta_sq[y * warps + e2 % warps], e2 / warps);
  }
  sq_total = warp_sum(sq_total);
  cluster.barrier_arrive();  // this CTA's shared memory is read no more once every CTA has arrived
  const float rs = rsqrtf(sq_total * inv_dim + p.norm_eps);
  __nv_bfloat16* out = static_cast<__nv_bfloat16*>(p.out) + static_cast<int64_t>(j) * p.dim;
#pragma unroll
  for (int it = 0; it < ITER; ++it) {
    if (active[it]) {
      float o[VEC];
#pragma unroll
      for (int k = 0; k < VEC; ++k) o[k] = __fmul_rn(__fmul_rn(mix[it][k], rs), nw[it][k]);
      store_bf16<VEC>(out + col[it], o);
    }
  }
  cluster.barrier_wait();
}

// The same for many tokens, without a cluster: one CTA per token, of `ranks` groups of
// blockDim.x / ranks threads, group r doing what the cluster's CTA of rank r does (the same columns,
// the same vectors per thread), the sums across the groups through shared memory in rank order:
// every sum in the cluster form's order, so a row's bits are the same on either path. 512 threads
// of two vectors or 1024 of one, at most (64 registers: two CTAs per SM of two vectors); the norm
// weight is read last (fewer registers held across the sums).
template <int VEC, int NS, int ITER>
__global__ void __launch_bounds__(ITER == 1 ? 1024 : 512, ITER)
    attn_res_mix_norm_rows_kernel(K3AttnResMixParams p, int per_cta, int ranks) {
  using Raw = typename Bytes<VEC>::T;
  __shared__ float partials[32][2 * NS];         // [warp of the CTA]
  __shared__ float rank_sums[kMaxRanks][2 * NS];  // [rank]
  __shared__ float rank_sq[32];                   // [warp of the CTA] = [rank * warps + warp of the rank]
  const int tpr = blockDim.x / ranks, rank = threadIdx.x / tpr, tid = threadIdx.x - rank * tpr;  // threads per rank
  const int j = blockIdx.x, lane = threadIdx.x & 31, warps = tpr >> 5, n = p.num_sources, nvec = p.dim / VEC;
  const int warp = rank * warps + (tid >> 5);
  const int64_t off = static_cast<int64_t>(p.rows != nullptr ? p.rows[j] : j) * p.dim;
  const float inv_dim = 1.0f / p.dim;

  // every load first: the sources, the sub-layer output and the query
  Raw v[ITER][NS - 1], last[ITER];  // sources 0..n-2, then the partial sum (source n-1)
  float q[ITER][VEC], nw[ITER][VEC];
  int col[ITER];
  bool active[ITER];
#pragma unroll
  for (int it = 0; it < ITER; ++it) {
    const int local = it * tpr + tid, g = rank * per_cta + local;
    active[it] = local < per_cta && g < nvec;
    col[it] = g * VEC;
#pragma unroll
    for (int s = 0; s < NS - 1; ++s) v[it][s] = Raw{};
    last[it] = Raw{};
#pragma unroll
    for (int k = 0; k < VEC; ++k) q[it][k] = nw[it][k] = 0.0f;
    if (active[it]) {
#pragma unroll
      for (int s = 0; s < NS - 1; ++s) {
        if (s < n - 1) v[it][s] = load_raw<VEC>(p.sources[s], off + col[it]);
      }
      last[it] = load_raw<VEC>(p.sources[n - 1], off + col[it]);
      load_f32<VEC>(p.query + col[it], q[it]);
      if (p.residual != nullptr) {
        float r[VEC];
        unpack_bf16<VEC>(load_raw<VEC>(p.residual, off + col[it]), r);
        if (p.residual2 != nullptr) {
          float r2[VEC];
          unpack_bf16<VEC>(load_raw<VEC>(p.residual2, off + col[it]), r2);
#pragma unroll
          for (int k = 0; k < VEC; ++k) r[k] = round_bf16(r[k] + r2[k]);  // a = bf16(routed + shared), as torch adds
        }
        float x[VEC];
        unpack_bf16<VEC>(last[it], x);
#pragma unroll
        for (int k = 0; k < VEC; ++k) x[k] = x[k] + r[k];
        last[it] = pack_bf16<VEC>(x);  // the bf16 partial sum P + a (bf16 holds it exactly)
        if (p.partial_out != nullptr) {
          *reinterpret_cast<Raw*>(static_cast<__nv_bfloat16*>(p.partial_out) + off + col[it]) = last[it];
        }
      }
    }
  }

  // the 2 n sums: per thread, warp butterfly, a rank's warps in order, then the ranks in order
  float dot[NS], ss[NS];
#pragma unroll
  for (int s = 0; s < NS; ++s) dot[s] = ss[s] = 0.0f;
#pragma unroll
  for (int it = 0; it < ITER; ++it) {
#pragma unroll
    for (int s = 0; s < NS; ++s) {
      if (s < n - 1 || s == NS - 1) {  // slot NS - 1: the partial sum
        float x[VEC];
        if (s < NS - 1) {
          unpack_bf16<VEC>(v[it][s], x);
        } else {
          unpack_bf16<VEC>(last[it], x);
        }
#pragma unroll
        for (int k = 0; k < VEC; ++k) {
          dot[s] += x[k] * q[it][k];
          ss[s] += x[k] * x[k];
        }
      }
    }
  }
#pragma unroll
  for (int s = 0; s < NS; ++s) {
    if (s < n - 1 || s == NS - 1) {
      dot[s] = warp_sum(dot[s]);
      ss[s] = warp_sum(ss[s]);
    }
  }
  if (lane == 0) {  // in source order: the partial sum's at n - 1
#pragma unroll
    for (int s = 0; s < NS - 1; ++s) {
      partials[warp][s] = dot[s];
      partials[warp][NS + s] = ss[s];
    }
    partials[warp][n - 1] = dot[NS - 1];
    partials[warp][NS + n - 1] = ss[NS - 1];
  }
  __syncthreads();
  if (tid < 2 * NS && tid % NS < n) {
    float total = 0.0f;
    for (int w = 0; w < warps; ++w) total += partials[rank * warps + w][tid];
    rank_sums[rank][tid] = total;
  }
  __syncthreads();
  // every warp: lane s < n forms logit s, then the softmax as torch.softmax
  float total = 0.0f;
  if (lane < 2 * NS && lane % NS < n) {
    float part[kMaxRanks];  // every rank's load in flight at once, then the sum in rank order
#pragma unroll
    for (int r = 0; r < kMaxRanks; ++r) {
      part[r] = r < ranks ? rank_sums[r][lane] : 0.0f;
    }
#pragma unroll
    for (int r = 0; r < kMaxRanks; ++r) {
      if (r < ranks) total += part[r];
    }
  }
  const float lane_ss = __shfl_sync(0xffffffffu, total, (lane + NS) & 31);
  const float logit = lane < n ? total * rsqrtf(lane_ss * inv_dim + p.eps) : -INFINITY;
  float m = logit;
#pragma unroll
  for (int o = 16; o > 0; o >>= 1) m = fmaxf(m, __shfl_xor_sync(0xffffffffu, m, o));
  const float e = lane < n ? expf(logit - m) : 0.0f;
  float sum = 0.0f;
#pragma unroll
  for (int s = 0; s < NS; ++s) {
    const float es = __shfl_sync(0xffffffffu, e, s);
    if (s < n) sum += es;
  }
  const float lane_w = e / sum;
  float weight[NS - 1];
#pragma unroll
  for (int s = 0; s < NS - 1; ++s) weight[s] = __shfl_sync(0xffffffffu, lane_w, s);
  const float last_weight = __shfl_sync(0xffffffffu, lane_w, n - 1);

  // the mix, from the registers, and its mean square
  float mix[ITER][VEC];
  float sq = 0.0f;
#pragma unroll
  for (int it = 0; it < ITER; ++it) {
#pragma unroll
    for (int k = 0; k < VEC; ++k) mix[it][k] = 0.0f;  // the reference's sum() starts from 0 too (0 + -0 = +0)
    // products and sums rounded separately, in source order, as the reference's sum()
#pragma unroll
    for (int s = 0; s < NS - 1; ++s) {
      if (s < n - 1) {
        float x[VEC];
        unpack_bf16<VEC>(v[it][s], x);
#pragma unroll
        for (int k = 0; k < VEC; ++k) mix[it][k] = __fadd_rn(mix[it][k], __fmul_rn(weight[s], x[k]));
      }
    }
    float x[VEC];
    unpack_bf16<VEC>(last[it], x);
#pragma unroll
    for (int k = 0; k < VEC; ++k) mix[it][k] = __fadd_rn(mix[it][k], __fmul_rn(last_weight, x[k]));
#pragma unroll
    for (int k = 0; k < VEC; ++k) {
      if (p.round_mix) mix[it][k] = round_bf16(mix[it][k]);
      sq += mix[it][k] * mix[it][k];
    }
  }
  sq = warp_sum(sq);
  if (lane == 0) rank_sq[warp] = sq;
  __syncthreads();
  float sq_total = 0.0f;
  for (int e2 = lane; e2 < ranks * warps; e2 += 32) sq_total += rank_sq[e2];
  sq_total = warp_sum(sq_total);
  const float rs = rsqrtf(sq_total * inv_dim + p.norm_eps);
  __nv_bfloat16* out = static_cast<__nv_bfloat16*>(p.out) + static_cast<int64_t>(j) * p.dim;
#pragma unroll
  for (int it = 0; it < ITER; ++it) {
    if (active[it]) {
      load_weight<VEC>(p.norm_weight, p.norm_weight_type, col[it], nw[it]);
      float o[VEC];
#pragma unroll
      for (int k = 0; k < VEC; ++k) o[k] = __fmul_rn(__fmul_rn(mix[it][k], rs), nw[it][k]);
      store_bf16<VEC>(out + col[it], o);
    }
  }
}

}  // namespace norm
}  // namespace k3
