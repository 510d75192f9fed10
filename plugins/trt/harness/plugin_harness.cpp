// Drives a K3 TensorRT plugin the way TensorRT's runtime does, without TensorRT: loads
// libk3_trt_plugins.so, finds the creator through getCreators(), creates the plugin from
// PluginFields in the runtime phase, re-creates it from its getFieldsToSerialize() (what
// plan deserialisation does), asks the build interface for the workspace, then calls
// onShapeChange and enqueue with the caller's device buffers. C ABI for ctypes
// (tests/gpu/test_trt_plugins.py). Build: nvcc -shared -Xcompiler -fPIC -I$TENSORRT_INCLUDE_DIR
#include <NvInferRuntime.h>
#include <cuda_runtime.h>
#include <dlfcn.h>

#include <cstdio>
#include <cstring>
#include <string>
#include <vector>

using namespace nvinfer1;

namespace {

class StderrLogger : public ILogger {
 public:
  void log(Severity severity, const char* msg) noexcept override {
    if (severity <= Severity::kWARNING) std::fprintf(stderr, "[k3 plugin] %s\n", msg);
  }
};

class Finder : public ILoggerFinder {
 public:
  ILogger* findLogger() override { return &logger_; }

 private:
  StderrLogger logger_;
};

Finder g_finder;

int fail(char* err, int errlen, const std::string& msg) {
  std::snprintf(err, errlen, "%s", msg.c_str());
  return -1;
}

PluginTensorDesc make_desc(int type, int nbdims, const int64_t* dims) {
  PluginTensorDesc d{};
  d.type = static_cast<DataType>(type);
  d.format = TensorFormat::kLINEAR;
  d.scale = 1.f;
  d.dims.nbDims = nbdims;
  for (int k = 0; k < nbdims; ++k) d.dims.d[k] = dims[k];
  return d;
}

}  // namespace

extern "C" int k3h_run(const char* lib_path, const char* plugin_name, int nb_fields, const char* const* field_names,
                       const int* field_is_float, const double* field_values, int nb_in, const int* in_types,
                       const int* in_nbdims, const int64_t* in_dims, const void* const* in_ptrs, int nb_out,
                       const int* out_types, const int* out_nbdims, const int64_t* out_dims, void* const* out_ptrs,
                       void* stream, int64_t* workspace_bytes_out, char* err, int errlen) {
  void* lib = dlopen(lib_path, RTLD_NOW | RTLD_LOCAL);
  if (lib == nullptr) return fail(err, errlen, std::string("dlopen: ") + dlerror());
  using GetCreators = IPluginCreatorInterface* const* (*)(int32_t&);
  using SetLoggerFinder = void (*)(ILoggerFinder*);
  auto get_creators = reinterpret_cast<GetCreators>(dlsym(lib, "getCreators"));
  auto set_finder = reinterpret_cast<SetLoggerFinder>(dlsym(lib, "setLoggerFinder"));
  if (get_creators == nullptr || set_finder == nullptr) return fail(err, errlen, "missing getCreators/setLoggerFinder");
  set_finder(&g_finder);
  int32_t n = 0;
  IPluginCreatorInterface* const* creators = get_creators(n);
  IPluginCreatorV3One* creator = nullptr;
  for (int i = 0; i < n; ++i) {
    auto* c = static_cast<IPluginCreatorV3One*>(creators[i]);
    if (std::strcmp(creators[i]->getInterfaceInfo().kind, "PLUGIN CREATOR_V3ONE") == 0 &&
        std::strcmp(c->getPluginName(), plugin_name) == 0 && std::strcmp(c->getPluginNamespace(), "k3") == 0 &&
        std::strcmp(c->getPluginVersion(), "1") == 0)
      creator = c;
  }
  if (creator == nullptr) return fail(err, errlen, std::string("no creator for ") + plugin_name);

  // PluginFields as the ONNX parser makes them: INT32 / FLOAT32, one value each.
  std::vector<int32_t> ints(nb_fields);
  std::vector<float> floats(nb_fields);
  std::vector<PluginField> fields;
  for (int f = 0; f < nb_fields; ++f) {
    if (field_is_float[f]) {
      floats[f] = static_cast<float>(field_values[f]);
      fields.emplace_back(field_names[f], &floats[f], PluginFieldType::kFLOAT32, 1);
    } else {
      ints[f] = static_cast<int32_t>(field_values[f]);
      fields.emplace_back(field_names[f], &ints[f], PluginFieldType::kINT32, 1);
    }
  }
  PluginFieldCollection fc{static_cast<int32_t>(fields.size()), fields.data()};
  IPluginV3* built = creator->createPlugin(plugin_name, &fc, TensorRTPhase::kBUILD);
  if (built == nullptr) return fail(err, errlen, "createPlugin (build phase) returned null");
  auto* build = static_cast<IPluginV3OneBuild*>(built->getCapabilityInterface(PluginCapabilityType::kBUILD));
  auto* core = static_cast<IPluginV3OneCore*>(built->getCapabilityInterface(PluginCapabilityType::kCORE));
  if (std::strcmp(core->getPluginName(), plugin_name) != 0) return fail(err, errlen, "core name mismatch");
  if (build->getNbOutputs() != nb_out) return fail(err, errlen, "getNbOutputs differs from the contract");

  std::vector<PluginTensorDesc> in_desc, out_desc;
  std::vector<DynamicPluginTensorDesc> in_dyn, out_dyn;
  std::vector<DataType> in_dt;
  for (int i = 0, off = 0; i < nb_in; off += in_nbdims[i], ++i) {
    in_desc.push_back(make_desc(in_types[i], in_nbdims[i], in_dims + off));
    in_dt.push_back(in_desc.back().type);
    DynamicPluginTensorDesc d{};
    d.desc = in_desc.back();
    d.min = d.opt = d.max = in_desc.back().dims;
    in_dyn.push_back(d);
  }
  for (int o = 0, off = 0; o < nb_out; off += out_nbdims[o], ++o) {
    out_desc.push_back(make_desc(out_types[o], out_nbdims[o], out_dims + off));
    DynamicPluginTensorDesc d{};
    d.desc = out_desc.back();
    d.min = d.opt = d.max = out_desc.back().dims;
    out_dyn.push_back(d);
  }
  std::vector<DataType> out_dt(nb_out);
  if (build->getOutputDataTypes(out_dt.data(), nb_out, in_dt.data(), nb_in) != 0)
    return fail(err, errlen, "getOutputDataTypes failed");
  for (int o = 0; o < nb_out; ++o)
    if (out_dt[o] != out_desc[o].type) return fail(err, errlen, "output " + std::to_string(o) + " dtype differs");
  std::vector<DynamicPluginTensorDesc> all(in_dyn);
  all.insert(all.end(), out_dyn.begin(), out_dyn.end());
  for (int p = 0; p < nb_in + nb_out; ++p)
    if (!build->supportsFormatCombination(p, all.data(), nb_in, nb_out))
      return fail(err, errlen, "supportsFormatCombination rejects I/O " + std::to_string(p));
  if (build->configurePlugin(in_dyn.data(), nb_in, out_dyn.data(), nb_out) != 0)
    return fail(err, errlen, "configurePlugin failed");
  const size_t ws_bytes = build->getWorkspaceSize(in_dyn.data(), nb_in, out_dyn.data(), nb_out);
  *workspace_bytes_out = static_cast<int64_t>(ws_bytes);

  // Deserialisation: a fresh plugin from the serialised fields, runtime phase.
  IPluginV3* runtime_plugin =
      creator->createPlugin(plugin_name, static_cast<IPluginV3OneRuntime*>(
                                             built->getCapabilityInterface(PluginCapabilityType::kRUNTIME))
                                             ->getFieldsToSerialize(),
                            TensorRTPhase::kRUNTIME);
  if (runtime_plugin == nullptr) return fail(err, errlen, "createPlugin (runtime phase) returned null");
  IPluginV3* context_plugin = static_cast<IPluginV3OneRuntime*>(
      runtime_plugin->getCapabilityInterface(PluginCapabilityType::kRUNTIME))->attachToContext(nullptr);
  auto* runtime = static_cast<IPluginV3OneRuntime*>(context_plugin->getCapabilityInterface(PluginCapabilityType::kRUNTIME));
  if (runtime->onShapeChange(in_desc.data(), nb_in, out_desc.data(), nb_out) != 0)
    return fail(err, errlen, "onShapeChange failed");
  void* workspace = nullptr;
  if (ws_bytes > 0 && cudaMalloc(&workspace, ws_bytes) != cudaSuccess) return fail(err, errlen, "cudaMalloc");
  const int rc = runtime->enqueue(in_desc.data(), out_desc.data(), in_ptrs, out_ptrs, workspace,
                                  static_cast<cudaStream_t>(stream));
  const cudaError_t sync = cudaStreamSynchronize(static_cast<cudaStream_t>(stream));
  if (workspace != nullptr) cudaFree(workspace);
  delete context_plugin;
  delete runtime_plugin;
  delete built;
  if (rc != 0) return fail(err, errlen, "enqueue returned " + std::to_string(rc));
  if (sync != cudaSuccess) return fail(err, errlen, std::string("CUDA: ") + cudaGetErrorString(sync));
  return 0;
}
