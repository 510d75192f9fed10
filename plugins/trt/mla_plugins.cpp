// enqueue of K3MlaPrefill / K3MlaDecode and of their fp8-cache twins K3MlaPrefillFp8 /
// K3MlaDecodeFp8: the C-ABI launchers of plugins/c_api/mla.cu.
#include <cuda_runtime.h>

#include "k3_plugin.h"

#include "k3/mla_api.h"

namespace k3trt {

namespace {

// The decode workspace, which the prefill's expanded form fits its key passes into (both
// caches: the workspace does not depend on the cache's dtype).
template <typename Params>
size_t mla_workspace(const Fields& f, const Dims* in, int) {
  Params p{};
  set_sizes(p, in, f);
  return k3_mla_workspace_size(p.num_tokens, p.num_heads, p.kv_lora_rank, p.max_blocks, p.block_size);
}

template <bool kPrefill>
int launch_mla(const LaunchArgs& a) {
  const K3MlaParams p = launch_params<K3MlaParams>(a);
  return kPrefill ? k3_mla_prefill(&p, a.stream) : k3_mla_decode(&p, a.stream);
}

template <bool kPrefill>
int launch_mla_fp8(const LaunchArgs& a) {
  const K3MlaFp8Params p = launch_params<K3MlaFp8Params>(a);
  return kPrefill ? k3_mla_prefill_fp8(&p, a.stream) : k3_mla_decode_fp8(&p, a.stream);
}

}  // namespace

const OpKernels kMlaPrefillKernels{mla_workspace<K3MlaParams>, launch_mla<true>};
const OpKernels kMlaDecodeKernels{mla_workspace<K3MlaParams>, launch_mla<false>};
const OpKernels kMlaPrefillFp8Kernels{mla_workspace<K3MlaFp8Params>, launch_mla_fp8<true>};
const OpKernels kMlaDecodeFp8Kernels{mla_workspace<K3MlaFp8Params>, launch_mla_fp8<false>};

}  // namespace k3trt
