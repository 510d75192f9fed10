// C-ABI launchers of the RMSNorm, AttnRes-mix and GLU kernels (k3/norm_api.h), called by the torch
// binding (k3_trtllm/ops/norm/cuda.py). Return a cudaError_t (0 = success);
// cudaErrorInvalidValue for a call outside the kernels' limits.
#include <cuda_runtime.h>
#include <stdint.h>

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

// One CTA per token, up to 512 threads (at decode a CTA is the whole call: width shortens its
// sweeps); NS, the sources' compile-time bound, the smallest power of two >= num_sources.
template <int VEC>
cudaError_t launch_mix(const K3AttnResMixParams& p, cudaStream_t stream) {
  const size_t smem = static_cast<size_t>(p.dim) * sizeof(float);
  const dim3 grid(p.out_tokens), block(threads_for(p.dim, VEC, 512));
  if (p.num_sources <= 2) return launch(k3::norm::attn_res_mix_norm_kernel<VEC, 2>, grid, block, smem, stream, p);
  if (p.num_sources <= 4) return launch(k3::norm::attn_res_mix_norm_kernel<VEC, 4>, grid, block, smem, stream, p);
  if (p.num_sources <= 8) return launch(k3::norm::attn_res_mix_norm_kernel<VEC, 8>, grid, block, smem, stream, p);
  return launch(k3::norm::attn_res_mix_norm_kernel<VEC, 16>, grid, block, smem, stream, p);
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
