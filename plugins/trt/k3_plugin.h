// One IPluginV3 (OneCore + OneBuild + OneRuntime) and one IPluginCreatorV3One shared by all
// K3 ops: shapes, dtypes and fields come from the op's Contract, the launch from OpKernels.
#pragma once

#include <NvInferRuntime.h>

#include <string>
#include <vector>

#include "contract.h"
#include "k3/params.h"

namespace k3trt {

using namespace nvinfer1;

// Attribute values in contract order (int or float by AttrSpec::kind).
struct Fields {
  int32_t ints[kMaxAttrs] = {};
  float floats[kMaxAttrs] = {};
};

struct LaunchArgs {
  const Fields& fields;
  int nb_inputs;
  const PluginTensorDesc* in_desc;
  const PluginTensorDesc* out_desc;
  const void* const* inputs;
  void* const* outputs;  // pool outputs already hold the input pools (same buffer or copied)
  void* workspace;
  size_t workspace_bytes;
  cudaStream_t stream;
};

struct OpKernels {
  // Workspace bytes for these input dims: called with the profile's largest dims at build
  // time (the amount TensorRT reserves) and with the actual dims in onShapeChange.
  size_t (*workspace)(const Fields&, const Dims* in_dims, int nb_in);
  // cudaError_t of the launch; 0 on success.
  int (*launch)(const LaunchArgs&);
};

void log_error(const std::string& msg);

// The generated index enums and set_sizes / set_tensors of every launcher params struct.
#include "launch_params.inc"

// The params struct of an enqueue: dims and attributes, then the tensors.
template <class Params>
Params launch_params(const LaunchArgs& a) {
  Dims dims[kMaxInputs];
  for (int i = 0; i < a.nb_inputs && i < kMaxInputs; ++i) dims[i] = a.in_desc[i].dims;
  Params p{};
  set_sizes(p, dims, a.fields);
  set_tensors(p, a);
  return p;
}

class ContractPlugin : public IPluginV3, public IPluginV3OneCore, public IPluginV3OneBuild,
                       public IPluginV3OneRuntime {
 public:
  ContractPlugin(const Contract& contract, const OpKernels& kernels, const Fields& fields);

  // IPluginV3
  IPluginCapability* getCapabilityInterface(PluginCapabilityType type) noexcept override;
  IPluginV3* clone() noexcept override;

  // IPluginV3OneCore
  const char* getPluginName() const noexcept override { return contract_.plugin; }
  const char* getPluginVersion() const noexcept override { return kPluginVersion; }
  const char* getPluginNamespace() const noexcept override { return kPluginNamespace; }

  // IPluginV3OneBuild
  int32_t configurePlugin(const DynamicPluginTensorDesc* in, int32_t nb_in, const DynamicPluginTensorDesc* out,
                          int32_t nb_out) noexcept override;
  int32_t getOutputDataTypes(DataType* out_types, int32_t nb_out, const DataType* in_types,
                             int32_t nb_in) const noexcept override;
  int32_t getOutputShapes(const DimsExprs* inputs, int32_t nb_in, const DimsExprs* shape_inputs, int32_t nb_shape,
                          DimsExprs* outputs, int32_t nb_out, IExprBuilder& builder) noexcept override;
  bool supportsFormatCombination(int32_t pos, const DynamicPluginTensorDesc* in_out, int32_t nb_in,
                                 int32_t nb_out) noexcept override;
  int32_t getNbOutputs() const noexcept override { return contract_.nb_outputs; }
  size_t getWorkspaceSize(const DynamicPluginTensorDesc* in, int32_t nb_in, const DynamicPluginTensorDesc* out,
                          int32_t nb_out) const noexcept override;

  // IPluginV3OneRuntime
  int32_t onShapeChange(const PluginTensorDesc* in, int32_t nb_in, const PluginTensorDesc* out,
                        int32_t nb_out) noexcept override;
  int32_t enqueue(const PluginTensorDesc* in_desc, const PluginTensorDesc* out_desc, const void* const* inputs,
                  void* const* outputs, void* workspace, cudaStream_t stream) noexcept override;
  IPluginV3* attachToContext(IPluginResourceContext* context) noexcept override;
  const PluginFieldCollection* getFieldsToSerialize() noexcept override;

 private:
  const Contract& contract_;
  const OpKernels& kernels_;
  Fields fields_;
  size_t workspace_bytes_ = 0;
  std::vector<PluginField> serialized_;
  PluginFieldCollection serialized_fc_{};
};

class ContractCreator : public IPluginCreatorV3One {
 public:
  ContractCreator(const Contract& contract, const OpKernels& kernels);
  IPluginV3* createPlugin(const char* name, const PluginFieldCollection* fc, TensorRTPhase phase) noexcept override;
  const PluginFieldCollection* getFieldNames() noexcept override { return &field_names_fc_; }
  const char* getPluginName() const noexcept override { return contract_.plugin; }
  const char* getPluginVersion() const noexcept override { return kPluginVersion; }
  const char* getPluginNamespace() const noexcept override { return kPluginNamespace; }

 private:
  const Contract& contract_;
  const OpKernels& kernels_;
  std::vector<PluginField> field_names_;
  PluginFieldCollection field_names_fc_{};
};

extern const OpKernels kKdaPrefillKernels;
extern const OpKernels kKdaDecodeKernels;
extern const OpKernels kMlaPrefillKernels;
extern const OpKernels kMlaDecodeKernels;
extern const OpKernels kMlaPrefillFp8Kernels;
extern const OpKernels kMlaDecodeFp8Kernels;
extern const OpKernels kSituMoeKernels;
extern const OpKernels kSituMoeMxfp4Kernels;

// Elements of a tensor described by `d` (all dims known at enqueue time).
int64_t volume(const Dims& d);
size_t element_size(DataType t);

}  // namespace k3trt
