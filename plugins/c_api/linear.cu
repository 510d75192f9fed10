// C-ABI launcher of the skinny bf16 linear (k3/linear_api.h), called by k3_trtllm/ops/linear.
#include <cuda_runtime.h>
#include <stdint.h>

#include "k3/linear/skinny.cuh"
#include "k3/linear_api.h"

namespace {

bool aligned16(const void* p) { return reinterpret_cast<uintptr_t>(p) % 16 == 0; }

template <int T>
cudaError_t launch(const K3SkinnyLinearParams& p, cudaStream_t stream) {
  cudaLaunchConfig_t config = {};
  config.gridDim = dim3((p.n + k3::linear::kWarps - 1) / k3::linear::kWarps);
  config.blockDim = dim3(32 * k3::linear::kWarps);
  config.stream = stream;
  // this launch's own status (cudaGetLastError would also return an earlier call's error)
  return cudaLaunchKernelEx(&config, k3::linear::skinny_linear_kernel<T>, p);
}

}  // namespace

extern "C" int k3_skinny_linear(const K3SkinnyLinearParams* params, cudaStream_t stream) {
  if (params == nullptr) return cudaErrorInvalidValue;
  const K3SkinnyLinearParams& p = *params;
  if (p.tokens < 0 || p.tokens > K3_SKINNY_MAX_TOKENS || p.n < 0 || p.k < 8 || p.k % 8 != 0 ||
      (p.out_fp32 != 0 && p.out_fp32 != 1)) {
    return cudaErrorInvalidValue;
  }
  if (p.tokens == 0 || p.n == 0) return cudaSuccess;  // empty tensors have null data pointers
  if (p.x == nullptr || p.weight == nullptr || p.out == nullptr || !aligned16(p.x) || !aligned16(p.weight) ||
      (p.tokens > 1 && (p.x_row_stride < p.k || p.x_row_stride % 8 != 0))) {
    return cudaErrorInvalidValue;
  }
  switch (p.tokens) {
    case 1: return launch<1>(p, stream);
    case 2: return launch<2>(p, stream);
    case 3: return launch<3>(p, stream);
    default: return launch<4>(p, stream);
  }
}
