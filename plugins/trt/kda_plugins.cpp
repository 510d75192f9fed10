// enqueue of K3KdaPrefill / K3KdaDecode: the C-ABI launchers of plugins/c_api/kda.cu.
#include <cuda_runtime.h>

#include "k3_plugin.h"

#include "k3/kda_api.h"

namespace k3trt {

namespace {

size_t kda_prefill_workspace(const Fields& f, const Dims* in, int) {
  K3KdaParams p{};
  set_sizes(p, in, f);
  return k3_kda_prefill_workspace_bytes(p.num_tokens, p.num_seqs, p.num_heads, p.head_dim, p.lower_bound);
}

template <bool kPrefill>
int launch_kda(const LaunchArgs& a) {
  const K3KdaParams p = launch_params<K3KdaParams>(a);
  // Phase from extents, no device-to-host copy: one token per sequence is a decode step,
  // which the token recurrence serves best. The host's phase (model/step.py is_pure_decode)
  // picks the engine profile but does not reach a plugin; T == B is the engine-side fact
  // (exact either way: a token with no cached context recurs from a zero state).
  const bool chunked = kPrefill && p.num_tokens != p.num_seqs;
  return chunked ? k3_kda_prefill(&p, a.stream) : k3_kda_decode(&p, a.stream);
}

}  // namespace

const OpKernels kKdaPrefillKernels{kda_prefill_workspace, launch_kda<true>};
const OpKernels kKdaDecodeKernels{nullptr, launch_kda<false>};

}  // namespace k3trt
