// Writes this step's latent rows [c_kv | k_pe] into the paged latent cache (spec §6.1).
#pragma once

#include "k3/mla/ptx.cuh"

namespace k3::mla {

// One block per new token; 16-byte chunks. A negative slot is a padding token (skipped).
// The cache is [num_blocks, block_size, width] contiguous, so slot s starts at s*width.
__global__ void insert_latents_kernel(const bf16* __restrict__ latent, const int* __restrict__ slot_mapping,
                                      bf16* __restrict__ cache, int width) {
  const int token = blockIdx.x;
  const int slot = slot_mapping[token];
  if (slot < 0) return;
  const uint4* src = reinterpret_cast<const uint4*>(latent + static_cast<int64_t>(token) * width);
  uint4* dst = reinterpret_cast<uint4*>(cache + static_cast<int64_t>(slot) * width);
  for (int c = threadIdx.x; c < width / 8; c += blockDim.x) dst[c] = src[c];
}

}  // namespace k3::mla
