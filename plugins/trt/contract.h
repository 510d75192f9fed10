// The op contracts (k3_trtllm/ops/contract.py) as constexpr tables: every TensorRT plugin
// takes its names, I/O dtypes, output shapes and PluginFields from here.
#pragma once

#include <cstdint>

namespace k3trt {

// Fixed dtypes are named by the TensorRT type the plugins accept. The contract's "uint8" tensors
// (MXFP4 codes and scales) arrive as kInt8, a view of the same bytes: TensorRT-RTX's ONNX parser
// widens UINT8 weights to INT32 but keeps INT8 ones; the kernels read the pointers as uint8_t.
enum class DType { kAct, kFp32, kInt32, kInt8 };
enum class AttrKind { kInt, kFloat };

constexpr int kMaxInputs = 16;
constexpr int kMaxOutputs = 8;
constexpr int kMaxRank = 4;
constexpr int kMaxAttrs = 12;

struct InputSpec {
  const char* name;
  DType dtype;
  int rank;
};

// One factor of an output dim: dimension `dim` of input `input`.
struct DimRef {
  int input = -1;
  int dim = -1;
};

struct OutputSpec {
  const char* name;
  DType dtype;
  int rank;
  DimRef dims[kMaxRank][2];  // product of one or two input dims per output dim
};

struct AttrSpec {
  const char* name;
  AttrKind kind;
};

struct Contract {
  const char* plugin;
  int nb_inputs;
  InputSpec inputs[kMaxInputs];
  int nb_outputs;
  OutputSpec outputs[kMaxOutputs];
  int nb_attrs;
  AttrSpec attrs[kMaxAttrs];
};

#include "contracts.inc"

}  // namespace k3trt
