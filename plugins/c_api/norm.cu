// C-ABI launchers of the RMSNorm, AttnRes-mix and GLU kernels (k3/norm_api.h), called by the torch
// binding (k3_trtllm/ops/norm/cuda.py). Return a cudaError_t (0 = success);
// cudaErrorInvalidValue for a call outside the kernels' limits.
#include <cuda_runtime.h>
#include <stdint.h>

#include <algorithm>

#include "k3/norm/attn_res.cuh"
#include "k3/norm/glu.cuh"
#include "k3/norm/rms_norm.cuh"
#include "k3/norm_api.h"

namespace {

// cudaLaunchKernelEx returns this launch's own status; cudaGetLastError after <<<>>> would also
// return an error some earlier runtime call left behind, and blame this kernel for it.
template <typename Kernel, typename... Args>
cudaError_t launch(Kernel kernel, dim3 grid, dim3 block, size_t smem, cudaStream_t stream, const Args&... args) {
  cudaLaunchConfig_t config = {};
  config.gridDim = grid;
  config.blockDim = block;
  config.dynamicSmemBytes = smem;
  config.stream = stream;
  return cudaLaunchKernelEx(&config, kernel, args...);
}

bool aligned(const void* p, int bytes) { return reinterpret_cast<uintptr_t>(p) % bytes == 0; }

// The widest vector (8, 4 or 2 bf16) that every row start of every view allows: the pointers
// and the element strides must be multiples of it, and so must dim.
int vector_width(int dim, const void* const* ptrs, int n_ptrs, const int64_t* strides, int n_strides) {
  for (int vec = 8; vec >= 2; vec /= 2) {
    bool ok = dim % vec == 0;
    for (int i = 0; ok && i < n_ptrs; ++i) ok = ptrs[i] == nullptr || aligned(ptrs[i], 2 * vec);
    for (int i = 0; ok && i < n_strides; ++i) ok = strides[i] % vec == 0;
    if (ok) return vec;
  }
  return 0;
}

// Threads per row: at most max_threads, as few iterations as that allows, whole warps.
int threads_for(int dim, int vec, int max_threads = 256) {
  const int nvec = dim / vec;
  const int iters = (nvec + max_threads - 1) / max_threads;
  const int threads = (nvec + iters - 1) / iters;
  return (threads + 31) / 32 * 32;
}

bool weight_ok(const void* w, int type) {
  return type == K3_NORM_WEIGHT_NONE ? w == nullptr : (type == K3_NORM_WEIGHT_BF16 || type == K3_NORM_WEIGHT_FP32) && w;
}

template <int VEC>
cudaError_t launch_rms_norm(const K3RmsNormParams& p, cudaStream_t stream) {
  const dim3 grid(p.tokens * p.heads), block(threads_for(p.dim, VEC));
  return p.gate != nullptr ? launch(k3::norm::rms_norm_kernel<VEC, true>, grid, block, 0, stream, p)
                           : launch(k3::norm::rms_norm_kernel<VEC, false>, grid, block, 0, stream, p);
}

// Each output token's row is split over a cluster of up to 8 CTAs, each at least a warp of vectors:
// the cluster size, the vectors per thread (ITER) and so the summation order follow from dim and
// num_sources alone, never from the batch. Two vectors per thread for up to 3 sources (more bytes
// in flight per thread: faster at large batches), one for more (fewer registers: more CTAs per SM);
// up to 512 threads per CTA. NS, the sources' compile-time bound: 2, 3, 5, 9 (K3's) or 16.
// From kRowsTokens tokens on, one CTA per token with the cluster's CTAs as groups of its threads
// (the same sums in the same order), where they fit: 512 threads of two vectors, 1024 of one.
constexpr int kRowsTokens = 128;

template <int VEC, int NS, int ITER>
cudaError_t launch_mix_kernel(const K3AttnResMixParams& p, int ranks, int per_cta, cudaStream_t stream) {
  const int threads = ((per_cta + ITER - 1) / ITER + 31) / 32 * 32;
  if (p.out_tokens >= kRowsTokens && ranks * threads <= 1024 / ITER) {
    return launch(k3::norm::attn_res_mix_norm_rows_kernel<VEC, NS, ITER>, dim3(p.out_tokens), dim3(ranks * threads), 0,
                  stream, p, per_cta, ranks);
  }
  // two vectors per thread: up to 128 threads' worth of tokens per CTA once the batch fills the GPU
  const int64_t spread = static_cast<int64_t>(p.out_tokens) * ranks / 256;
  const int tokens = ITER == 1 ? 1 : std::max(1, static_cast<int>(std::min<int64_t>({128 / threads, spread,
                                                                                     k3::norm::kMaxTokens})));
  cudaLaunchAttribute cluster = {};
  cluster.id = cudaLaunchAttributeClusterDimension;
  cluster.val.clusterDim.x = ranks;
  cluster.val.clusterDim.y = cluster.val.clusterDim.z = 1;
  cudaLaunchConfig_t config = {};
  config.gridDim = dim3(static_cast<unsigned>((p.out_tokens + tokens - 1) / tokens) * ranks);
  config.blockDim = dim3(threads, tokens);
  config.stream = stream;
  config.attrs = &cluster;
  config.numAttrs = 1;
  return cudaLaunchKernelEx(&config, k3::norm::attn_res_mix_norm_kernel<VEC, NS, ITER>, p, per_cta);
}

template <int VEC, int ITER>
cudaError_t launch_mix_sources(const K3AttnResMixParams& p, int ranks, int per_cta, cudaStream_t stream) {
  if (p.num_sources <= 2) return launch_mix_kernel<VEC, 2, ITER>(p, ranks, per_cta, stream);
  if (p.num_sources <= 3) return launch_mix_kernel<VEC, 3, ITER>(p, ranks, per_cta, stream);
  if constexpr (ITER == 1 || VEC == 2) {  // two vectors per thread for more sources: 2-wide rows past 8192
    if (p.num_sources <= 5) return launch_mix_kernel<VEC, 5, ITER>(p, ranks, per_cta, stream);
    if (p.num_sources <= 9) return launch_mix_kernel<VEC, 9, ITER>(p, ranks, per_cta, stream);
    return launch_mix_kernel<VEC, 16, ITER>(p, ranks, per_cta, stream);
  }
  return cudaErrorInvalidValue;
}

template <int VEC>
cudaError_t launch_mix(const K3AttnResMixParams& p, cudaStream_t stream) {
  const int nvec = p.dim / VEC;
  const int ranks = std::max(1, std::min(k3::norm::kMaxRanks, nvec / 32));
  const int per_cta = (nvec + ranks - 1) / ranks;
  if ((p.num_sources <= 3 && per_cta >= 64) || per_cta > 512) {
    // K3_ATTN_RES_MAX_DIM keeps per_cta <= 640 (2-wide rows of 10240)
    return per_cta <= 1024 ? launch_mix_sources<VEC, 2>(p, ranks, per_cta, stream) : cudaErrorInvalidValue;
  }
  return launch_mix_sources<VEC, 1>(p, ranks, per_cta, stream);
}

template <int VEC>
cudaError_t launch_glu(const K3GluParams& p, cudaStream_t stream) {
  const int nvec = p.inter / VEC, threads = nvec < 256 ? (nvec + 31) / 32 * 32 : 256;
  const dim3 grid(p.tokens, (nvec + threads - 1) / threads);
  return launch(k3::norm::glu_kernel<VEC>, grid, dim3(threads), 0, stream, p);
}

}  // namespace

extern "C" int k3_rms_norm(const K3RmsNormParams* params, cudaStream_t stream) {
  if (params == nullptr) return cudaErrorInvalidValue;
  const K3RmsNormParams& p = *params;
  if (p.tokens < 0 || p.heads < 1 || p.dim < 2 || static_cast<int64_t>(p.tokens) * p.heads > INT32_MAX) {
    return cudaErrorInvalidValue;
  }
  // no rows: nothing is read or written, and torch gives an empty tensor a null data pointer
  if (p.tokens == 0) return cudaSuccess;
  if (p.x == nullptr || p.out == nullptr || !weight_ok(p.weight, p.weight_type)) return cudaErrorInvalidValue;
  const void* ptrs[] = {p.x, p.gate, p.out, p.weight_type == K3_NORM_WEIGHT_BF16 ? p.weight : nullptr};
  const int64_t gated[] = {p.x_token_stride, p.x_head_stride, p.gate_token_stride, p.gate_head_stride};
  const int vec = vector_width(p.dim, ptrs, 4, gated, p.gate != nullptr ? 4 : 2);
  switch (vec) {
    case 8: return launch_rms_norm<8>(p, stream);
    case 4: return launch_rms_norm<4>(p, stream);
    case 2: return launch_rms_norm<2>(p, stream);
    default: return cudaErrorInvalidValue;
  }
}

extern "C" int k3_attn_res_mix_norm(const K3AttnResMixParams* params, cudaStream_t stream) {
  if (params == nullptr) return cudaErrorInvalidValue;
  const K3AttnResMixParams& p = *params;
  if (p.num_sources < 1 || p.num_sources > K3_ATTN_RES_MAX_SOURCES || p.dim < 2 || p.dim > K3_ATTN_RES_MAX_DIM ||
      p.out_tokens < 0) {
    return cudaErrorInvalidValue;
  }
  // no output rows (a prefill chunk that samples no token asks for none): nothing to do, and
  // the empty row list and output have null data pointers
  if (p.out_tokens == 0) return cudaSuccess;
  if (p.query == nullptr || p.out == nullptr || !weight_ok(p.norm_weight, p.norm_weight_type) ||
      (p.partial_out != nullptr && (p.residual == nullptr || p.rows != nullptr)) ||
      (p.residual2 != nullptr && p.residual == nullptr)) {
    return cudaErrorInvalidValue;
  }
  for (int s = 0; s < p.num_sources; ++s) {
    if (p.sources[s] == nullptr) return cudaErrorInvalidValue;
  }
  const void* ptrs[K3_ATTN_RES_MAX_SOURCES + 5] = {p.residual, p.residual2, p.partial_out, p.out,
                                                    p.norm_weight_type == K3_NORM_WEIGHT_BF16 ? p.norm_weight : nullptr};
  for (int s = 0; s < p.num_sources; ++s) ptrs[5 + s] = p.sources[s];
  const int vec = vector_width(p.dim, ptrs, 5 + p.num_sources, nullptr, 0);
  switch (vec) {
    case 8: return launch_mix<8>(p, stream);
    case 4: return launch_mix<4>(p, stream);
    case 2: return launch_mix<2>(p, stream);
    default: return cudaErrorInvalidValue;
  }
}

extern "C" int k3_glu(const K3GluParams* params, cudaStream_t stream) {
  if (params == nullptr) return cudaErrorInvalidValue;
  const K3GluParams& p = *params;
  if (p.tokens < 0 || p.inter < 2 || p.activation < 0 || p.activation > K3_GLU_SIGMOID_GATE ||
      (p.activation == 1 && p.beta == 0.0f)) {
    return cudaErrorInvalidValue;
  }
  if (p.tokens == 0) return cudaSuccess;  // empty tensors have null data pointers
  if (p.gate == nullptr || p.up == nullptr || p.out == nullptr) return cudaErrorInvalidValue;
  const void* ptrs[] = {p.gate, p.up, p.out};
  const int64_t strides[] = {p.gate_row_stride, p.up_row_stride};
  switch (vector_width(p.inter, ptrs, 3, strides, 2)) {
    case 8: return launch_glu<8>(p, stream);
    case 4: return launch_glu<4>(p, stream);
    case 2: return launch_glu<2>(p, stream);
    default: return cudaErrorInvalidValue;
  }
}
