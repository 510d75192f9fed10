#include "k3_plugin.h"

#include <cuda_runtime.h>

#include <cstring>

namespace k3trt {

namespace {

DataType fixed_type(DType d) {
  switch (d) {
    case DType::kFp32: return DataType::kFLOAT;
    case DType::kInt32: return DataType::kINT32;
    case DType::kInt8: return DataType::kINT8;
    case DType::kAct: break;
  }
  // The CUDA kernels take bf16 activations and caches.
  return DataType::kBF16;
}

}  // namespace

int64_t volume(const Dims& d) {
  int64_t n = 1;
  for (int i = 0; i < d.nbDims; ++i) n *= d.d[i];
  return n;
}

size_t element_size(DataType t) {
  switch (t) {
    case DataType::kFLOAT: case DataType::kINT32: return 4;
    case DataType::kHALF: case DataType::kBF16: return 2;
    case DataType::kINT64: return 8;
    default: return 1;
  }
}

ContractPlugin::ContractPlugin(const Contract& contract, const OpKernels& kernels, const Fields& fields)
    : contract_(contract), kernels_(kernels), fields_(fields) {}

IPluginCapability* ContractPlugin::getCapabilityInterface(PluginCapabilityType type) noexcept {
  switch (type) {
    case PluginCapabilityType::kCORE: return static_cast<IPluginV3OneCore*>(this);
    case PluginCapabilityType::kBUILD: return static_cast<IPluginV3OneBuild*>(this);
    case PluginCapabilityType::kRUNTIME: return static_cast<IPluginV3OneRuntime*>(this);
  }
  return nullptr;
}

IPluginV3* ContractPlugin::clone() noexcept {
  auto* p = new (std::nothrow) ContractPlugin(contract_, kernels_, fields_);
  if (p != nullptr) p->workspace_bytes_ = workspace_bytes_;
  return p;
}

int32_t ContractPlugin::configurePlugin(const DynamicPluginTensorDesc*, int32_t nb_in,
                                        const DynamicPluginTensorDesc*, int32_t nb_out) noexcept {
  return nb_in == contract_.nb_inputs && nb_out == contract_.nb_outputs ? 0 : -1;
}

int32_t ContractPlugin::getOutputDataTypes(DataType* out_types, int32_t nb_out, const DataType* in_types,
                                           int32_t nb_in) const noexcept {
  if (nb_out != contract_.nb_outputs || nb_in != contract_.nb_inputs) return -1;
  for (int o = 0; o < nb_out; ++o) {
    const DType want = contract_.outputs[o].dtype;
    out_types[o] = fixed_type(want);
    for (int i = 0; i < nb_in; ++i) {
      if (contract_.inputs[i].dtype == want) {
        out_types[o] = in_types[i];
        break;
      }
    }
  }
  return 0;
}

int32_t ContractPlugin::getOutputShapes(const DimsExprs* inputs, int32_t nb_in, const DimsExprs*, int32_t,
                                        DimsExprs* outputs, int32_t nb_out, IExprBuilder& builder) noexcept {
  if (nb_in != contract_.nb_inputs || nb_out != contract_.nb_outputs) return -1;
  for (int i = 0; i < nb_in; ++i) {
    if (inputs[i].nbDims != contract_.inputs[i].rank) {
      log_error(std::string(contract_.plugin) + ": input " + contract_.inputs[i].name + " has the wrong rank");
      return -1;
    }
  }
  for (int o = 0; o < nb_out; ++o) {
    const OutputSpec& spec = contract_.outputs[o];
    outputs[o].nbDims = spec.rank;
    for (int k = 0; k < spec.rank; ++k) {
      const DimRef& a = spec.dims[k][0];
      const DimRef& b = spec.dims[k][1];
      const IDimensionExpr* d = inputs[a.input].d[a.dim];
      if (b.input >= 0) d = builder.operation(DimensionOperation::kPROD, *d, *inputs[b.input].d[b.dim]);
      outputs[o].d[k] = d;
    }
  }
  return 0;
}

bool ContractPlugin::supportsFormatCombination(int32_t pos, const DynamicPluginTensorDesc* in_out, int32_t nb_in,
                                               int32_t) noexcept {
  const PluginTensorDesc& d = in_out[pos].desc;
  const DType want = pos < nb_in ? contract_.inputs[pos].dtype : contract_.outputs[pos - nb_in].dtype;
  return d.format == TensorFormat::kLINEAR && d.type == fixed_type(want);
}

size_t ContractPlugin::getWorkspaceSize(const DynamicPluginTensorDesc* in, int32_t nb_in,
                                        const DynamicPluginTensorDesc*, int32_t) const noexcept {
  if (kernels_.workspace == nullptr || nb_in > kMaxInputs) return 0;
  Dims max_dims[kMaxInputs];
  for (int i = 0; i < nb_in; ++i) max_dims[i] = in[i].max;
  return kernels_.workspace(fields_, max_dims, nb_in);
}

int32_t ContractPlugin::onShapeChange(const PluginTensorDesc* in, int32_t nb_in, const PluginTensorDesc*,
                                      int32_t nb_out) noexcept {
  if (nb_in != contract_.nb_inputs || nb_out != contract_.nb_outputs) return -1;
  Dims dims[kMaxInputs];
  for (int i = 0; i < nb_in; ++i) {
    if (in[i].dims.nbDims != contract_.inputs[i].rank) return -1;
    dims[i] = in[i].dims;
  }
  workspace_bytes_ = kernels_.workspace != nullptr ? kernels_.workspace(fields_, dims, nb_in) : 0;
  return 0;
}

int32_t ContractPlugin::enqueue(const PluginTensorDesc* in_desc, const PluginTensorDesc* out_desc,
                                const void* const* inputs, void* const* outputs, void* workspace,
                                cudaStream_t stream) noexcept {
  // Pool outputs: the runtime binds them to the input pool's address (in place, no copy);
  // anything else gets a copy of the pool first, so the update is correct either way.
  for (int o = 0; o < contract_.nb_outputs; ++o) {
    const char* name = contract_.outputs[o].name;
    for (int i = 0; i < contract_.nb_inputs; ++i) {
      const size_t n = std::strlen(contract_.inputs[i].name);
      if (std::strncmp(name, contract_.inputs[i].name, n) != 0 || std::strcmp(name + n, "_out") != 0) continue;
      if (outputs[o] != inputs[i]) {
        const size_t bytes = volume(in_desc[i].dims) * element_size(in_desc[i].type);
        if (cudaMemcpyAsync(outputs[o], inputs[i], bytes, cudaMemcpyDeviceToDevice, stream) != cudaSuccess) return -1;
      }
    }
  }
  const LaunchArgs args{fields_, contract_.nb_inputs, in_desc, out_desc, inputs, outputs, workspace,
                        workspace_bytes_, stream};
  const int err = kernels_.launch(args);
  if (err != 0) {
    log_error(std::string(contract_.plugin) + ": kernel launch failed with CUDA error " + std::to_string(err));
    return -1;
  }
  return 0;
}

IPluginV3* ContractPlugin::attachToContext(IPluginResourceContext*) noexcept { return clone(); }

const PluginFieldCollection* ContractPlugin::getFieldsToSerialize() noexcept {
  serialized_.clear();
  for (int a = 0; a < contract_.nb_attrs; ++a) {
    const AttrSpec& s = contract_.attrs[a];
    if (s.kind == AttrKind::kInt) {
      serialized_.emplace_back(s.name, &fields_.ints[a], PluginFieldType::kINT32, 1);
    } else {
      serialized_.emplace_back(s.name, &fields_.floats[a], PluginFieldType::kFLOAT32, 1);
    }
  }
  serialized_fc_.nbFields = static_cast<int32_t>(serialized_.size());
  serialized_fc_.fields = serialized_.data();
  return &serialized_fc_;
}

ContractCreator::ContractCreator(const Contract& contract, const OpKernels& kernels)
    : contract_(contract), kernels_(kernels) {
  for (int a = 0; a < contract_.nb_attrs; ++a) {
    const AttrSpec& s = contract_.attrs[a];
    field_names_.emplace_back(s.name, nullptr,
                              s.kind == AttrKind::kInt ? PluginFieldType::kINT32 : PluginFieldType::kFLOAT32, 1);
  }
  field_names_fc_.nbFields = static_cast<int32_t>(field_names_.size());
  field_names_fc_.fields = field_names_.data();
}

IPluginV3* ContractCreator::createPlugin(const char*, const PluginFieldCollection* fc, TensorRTPhase) noexcept {
  Fields fields;
  for (int a = 0; a < contract_.nb_attrs; ++a) {
    const AttrSpec& s = contract_.attrs[a];
    const PluginField* found = nullptr;
    for (int f = 0; fc != nullptr && f < fc->nbFields; ++f) {
      if (fc->fields[f].name != nullptr && std::strcmp(fc->fields[f].name, s.name) == 0) found = &fc->fields[f];
    }
    const PluginFieldType want = s.kind == AttrKind::kInt ? PluginFieldType::kINT32 : PluginFieldType::kFLOAT32;
    if (found == nullptr || found->data == nullptr || found->length < 1 || found->type != want) {
      log_error(std::string(contract_.plugin) + ": plugin field " + s.name + " is missing or not " +
                (s.kind == AttrKind::kInt ? "INT32" : "FLOAT32"));
      return nullptr;
    }
    if (s.kind == AttrKind::kInt) {
      fields.ints[a] = *static_cast<const int32_t*>(found->data);
    } else {
      fields.floats[a] = *static_cast<const float*>(found->data);
    }
  }
  return new (std::nothrow) ContractPlugin(contract_, kernels_, fields);
}

}  // namespace k3trt
