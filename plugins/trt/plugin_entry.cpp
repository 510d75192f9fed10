// The library's two exported symbols, what IPluginRegistry::loadLibrary and
// `trtexec --dynamicPlugins` look up: getCreators and setLoggerFinder.
#include <NvInferRuntime.h>

#include <mutex>

#include "k3_plugin.h"

namespace k3trt {

namespace {

std::mutex g_logger_mutex;
ILoggerFinder* g_logger_finder = nullptr;

}  // namespace

void log_error(const std::string& msg) {
  std::lock_guard<std::mutex> lock(g_logger_mutex);
  ILogger* logger = g_logger_finder != nullptr ? g_logger_finder->findLogger() : nullptr;
  if (logger != nullptr) logger->log(ILogger::Severity::kERROR, msg.c_str());
}

}  // namespace k3trt

extern "C" {

__attribute__((visibility("default"))) void setLoggerFinder(nvinfer1::ILoggerFinder* finder) {
  std::lock_guard<std::mutex> lock(k3trt::g_logger_mutex);
  k3trt::g_logger_finder = finder;
}

__attribute__((visibility("default"))) nvinfer1::IPluginCreatorInterface* const* getCreators(int32_t& nb_creators) {
  using namespace k3trt;
  static ContractCreator kda_prefill(kKdaPrefill, kKdaPrefillKernels);
  static ContractCreator kda_decode(kKdaDecode, kKdaDecodeKernels);
  static ContractCreator mla_prefill(kMlaPrefill, kMlaPrefillKernels);
  static ContractCreator mla_decode(kMlaDecode, kMlaDecodeKernels);
  static ContractCreator mla_prefill_fp8(kMlaPrefillFp8, kMlaPrefillFp8Kernels);
  static ContractCreator mla_decode_fp8(kMlaDecodeFp8, kMlaDecodeFp8Kernels);
  static ContractCreator situ_moe(kSituMoe, kSituMoeKernels);
  static ContractCreator situ_moe_mxfp4(kSituMoeMxfp4, kSituMoeMxfp4Kernels);
  static nvinfer1::IPluginCreatorInterface* const creators[] = {
      &kda_prefill, &kda_decode, &mla_prefill, &mla_decode, &mla_prefill_fp8, &mla_decode_fp8, &situ_moe,
      &situ_moe_mxfp4};
  nb_creators = static_cast<int32_t>(sizeof(creators) / sizeof(creators[0]));
  return creators;
}

}  // extern "C"
