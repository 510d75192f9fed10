// enqueue of K3KdaPrefill / K3KdaDecode: the C-ABI launchers of plugins/kernels/kda.cu.
#include <cuda_runtime.h>

#include "k3_plugin.h"

#include "k3/kda_api.h"

namespace k3trt {

namespace {

// Contract order: qkv gate beta conv_weight A_log dt_bias cu_seqlens state_slots has_initial_state
// conv_state recurrent_state -> out conv_state_out recurrent_state_out; fields num_heads head_dim lower_bound.
enum { kQkv, kGate, kBeta, kConvWeight, kALog, kDtBias, kCuSeqlens, kStateSlots, kHasInitial };
enum { kOut, kConvStateOut, kRecurrentStateOut };

size_t kda_prefill_workspace(const Fields& f, const Dims* in, int) {
  return k3_kda_prefill_workspace_bytes(static_cast<int>(in[kQkv].d[0]), static_cast<int>(in[kCuSeqlens].d[0]) - 1,
                                        f.ints[0], f.ints[1], f.floats[2]);
}

template <bool kPrefill>
int launch_kda(const LaunchArgs& a) {
  const int num_tokens = static_cast<int>(a.in_desc[kQkv].dims.d[0]);
  const int num_seqs = static_cast<int>(a.in_desc[kCuSeqlens].dims.d[0]) - 1;
  const int conv_width = static_cast<int>(a.in_desc[kConvWeight].dims.d[1]);
  const int num_heads = a.fields.ints[0], head_dim = a.fields.ints[1];
  const float lower_bound = a.fields.floats[2];
  const void* const* in = a.inputs;
  // Phase from extents, no device-to-host copy: one token per sequence is a decode step,
  // which the token recurrence serves best.
  const bool chunked = kPrefill && num_tokens != num_seqs;
  auto launcher = chunked ? k3_kda_prefill : k3_kda_decode;
  return launcher(in[kQkv], in[kGate], in[kBeta], static_cast<const float*>(in[kConvWeight]),
                  static_cast<const float*>(in[kALog]), static_cast<const float*>(in[kDtBias]),
                  static_cast<const int*>(in[kCuSeqlens]), static_cast<const int*>(in[kStateSlots]),
                  static_cast<const int*>(in[kHasInitial]), a.outputs[kConvStateOut],
                  static_cast<float*>(a.outputs[kRecurrentStateOut]), a.outputs[kOut], a.workspace, num_tokens,
                  num_seqs, num_heads, head_dim, conv_width, lower_bound, a.stream);
}

}  // namespace

const OpKernels kKdaPrefillKernels{kda_prefill_workspace, launch_kda<true>};
const OpKernels kKdaDecodeKernels{nullptr, launch_kda<false>};

}  // namespace k3trt
