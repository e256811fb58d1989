#include "backends/cuda_driver.h"

#include <dlfcn.h>

namespace kvasync::cuda {
namespace {

template <typename Fn>
bool resolve(void* library, const char* symbol, Fn*& out, std::string& problem) {
  out = reinterpret_cast<Fn*>(dlsym(library, symbol));
  if (out == nullptr && problem.empty()) {
    problem = std::string("no CUDA driver found: libcuda.so.1 has no ") + symbol +
              " (driver too old for CUDA virtual memory)";
  }
  return out != nullptr;
}

}  // namespace

CudaDriver::CudaDriver() {
  // NOTE: never dlclose'd: the driver stays loaded for the life of the process, as with a link.
  void* library = dlopen("libcuda.so.1", RTLD_NOW | RTLD_LOCAL);
  if (library == nullptr) {
    const char* why = dlerror();
    problem = std::string("no CUDA driver found (dlopen libcuda.so.1: ") +
              (why ? why : "not found") + ")";
    return;
  }
  resolve(library, "cuInit", cuInit, problem);
  resolve(library, "cuGetErrorName", cuGetErrorName, problem);
  resolve(library, "cuDeviceGet", cuDeviceGet, problem);
  resolve(library, "cuDeviceGetCount", cuDeviceGetCount, problem);
  resolve(library, "cuDeviceGetAttribute", cuDeviceGetAttribute, problem);
  resolve(library, "cuDevicePrimaryCtxRetain", cuDevicePrimaryCtxRetain, problem);
  resolve(library, "cuDevicePrimaryCtxRelease_v2", cuDevicePrimaryCtxRelease, problem);
  resolve(library, "cuCtxGetCurrent", cuCtxGetCurrent, problem);
  resolve(library, "cuCtxSetCurrent", cuCtxSetCurrent, problem);
  resolve(library, "cuCtxSynchronize", cuCtxSynchronize, problem);
  resolve(library, "cuThreadExchangeStreamCaptureMode", cuThreadExchangeStreamCaptureMode, problem);
  resolve(library, "cuMemGetInfo_v2", cuMemGetInfo, problem);
  resolve(library, "cuMemGetAllocationGranularity", cuMemGetAllocationGranularity, problem);
  resolve(library, "cuMemAddressReserve", cuMemAddressReserve, problem);
  resolve(library, "cuMemAddressFree", cuMemAddressFree, problem);
  resolve(library, "cuMemCreate", cuMemCreate, problem);
  resolve(library, "cuMemRelease", cuMemRelease, problem);
  resolve(library, "cuMemMap", cuMemMap, problem);
  resolve(library, "cuMemUnmap", cuMemUnmap, problem);
  resolve(library, "cuMemSetAccess", cuMemSetAccess, problem);
  resolve(library, "cuEventCreate", cuEventCreate, problem);
  resolve(library, "cuEventRecord", cuEventRecord, problem);
  resolve(library, "cuEventQuery", cuEventQuery, problem);
  resolve(library, "cuEventDestroy_v2", cuEventDestroy, problem);
  resolve(library, "cuStreamCreate", cuStreamCreate, problem);
  resolve(library, "cuStreamWaitEvent", cuStreamWaitEvent, problem);
  resolve(library, "cuStreamDestroy_v2", cuStreamDestroy, problem);
  if (!problem.empty()) return;
  const CUresult init = cuInit(0);
  if (init == CUDA_ERROR_NO_DEVICE) {
    problem = "no CUDA device found (cuInit: CUDA_ERROR_NO_DEVICE)";
  } else if (init != CUDA_SUCCESS) {
    problem = "no usable CUDA driver found (" + failure(init, "cuInit") + ")";
  }
}

const CudaDriver& CudaDriver::get() {
  static const CudaDriver driver;  // thread-safe initialisation (C++11)
  return driver;
}

std::string CudaDriver::error_name(CUresult result) const {
  const char* name = nullptr;
  if (cuGetErrorName != nullptr && cuGetErrorName(result, &name) == CUDA_SUCCESS && name) {
    return name;
  }
  return "CUresult " + std::to_string(result);
}

std::string CudaDriver::failure(CUresult result, const std::string& what) const {
  return error_name(result) + ": " + what + " failed";
}

std::string device_problem(int device) {
  const CudaDriver& driver = CudaDriver::get();
  if (!driver.ok()) return driver.problem;
  int count = 0;
  CUresult result = driver.cuDeviceGetCount(&count);
  if (result != CUDA_SUCCESS) return "no CUDA device found (" + driver.failure(result, "cuDeviceGetCount") + ")";
  if (device < 0 || device >= count) {
    return "no CUDA device " + std::to_string(device) + " (" + std::to_string(count) +
           " device(s) visible)";
  }
  CUdevice handle = 0;
  result = driver.cuDeviceGet(&handle, device);
  if (result != CUDA_SUCCESS) return driver.failure(result, "cuDeviceGet");
  int vmm = 0;
  result = driver.cuDeviceGetAttribute(
      &vmm, CU_DEVICE_ATTRIBUTE_VIRTUAL_MEMORY_MANAGEMENT_SUPPORTED, handle);
  if (result != CUDA_SUCCESS || vmm == 0) {
    return "CUDA device " + std::to_string(device) + " does not support virtual memory management";
  }
  return {};
}

}  // namespace kvasync::cuda
