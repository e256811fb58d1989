// The CUDA driver API, loaded at run time.
//
// Note [Loading the driver]
// ~~~~~~~~~~~~~~~~~~~~~~~~~
// Rationale: kvasync must build, import and report "no CUDA driver" on a machine without one, and
// must not link against the CUDA runtime or PyTorch.
// Approach: libcuda.so.1 is dlopen'ed once, on first use, and every function kvasync needs is
// resolved with dlsym under the exact versioned name that cuda.h's macros would pick
// (cuMemGetInfo -> cuMemGetInfo_v2, ...). The few driver types are declared here with the ABI of
// cuda.h (CUDA 11.2 .. 13), so no CUDA header is needed to build.
// Invariants: CudaDriver::get() never throws and never aborts: a missing library, a missing
// symbol or a failing cuInit is reported by `problem()`; every call site checks `ok()` first.
#pragma once

#include <cstddef>
#include <cstdint>
#include <string>

namespace kvasync::cuda {

// ---- Types with cuda.h's ABI -------------------------------------------------------------------
using CUresult = int;
using CUdevice = int;
using CUdeviceptr = unsigned long long;
using CUmemGenericAllocationHandle = unsigned long long;
struct CUctx_st;
using CUcontext = CUctx_st*;
struct CUevent_st;
using CUevent = CUevent_st*;
struct CUstream_st;
using CUstream = CUstream_st*;

constexpr CUresult CUDA_SUCCESS = 0;
constexpr CUresult CUDA_ERROR_INVALID_VALUE = 1;
constexpr CUresult CUDA_ERROR_OUT_OF_MEMORY = 2;
constexpr CUresult CUDA_ERROR_NO_DEVICE = 100;
constexpr CUresult CUDA_ERROR_NOT_READY = 600;
constexpr CUresult CUDA_ERROR_NOT_SUPPORTED = 801;
// cuda.h's CUstreamCaptureMode: what a thread may call while some stream captures a graph.
constexpr int CU_STREAM_CAPTURE_MODE_RELAXED = 2;

constexpr int CU_MEM_ALLOCATION_TYPE_PINNED = 1;
constexpr int CU_MEM_HANDLE_TYPE_NONE = 0;
constexpr int CU_MEM_LOCATION_TYPE_DEVICE = 1;
constexpr int CU_MEM_ACCESS_FLAGS_PROT_READWRITE = 3;
constexpr int CU_MEM_ALLOC_GRANULARITY_MINIMUM = 0;
constexpr unsigned CU_EVENT_DISABLE_TIMING = 2;
constexpr unsigned CU_STREAM_NON_BLOCKING = 1;
constexpr int CU_DEVICE_ATTRIBUTE_VIRTUAL_MEMORY_MANAGEMENT_SUPPORTED = 102;

struct CUmemLocation {
  int type;
  int id;
};
struct CUmemAllocationProp {
  int type;
  int requestedHandleTypes;
  CUmemLocation location;
  void* win32HandleMetaData;
  struct {
    unsigned char compressionType;
    unsigned char gpuDirectRDMACapable;
    unsigned short usage;
    unsigned char reserved[4];
  } allocFlags;
};
struct CUmemAccessDesc {
  CUmemLocation location;
  int flags;
};
static_assert(sizeof(CUmemAllocationProp) == 32, "CUmemAllocationProp must match cuda.h");
static_assert(sizeof(CUmemAccessDesc) == 12, "CUmemAccessDesc must match cuda.h");

// ---- The function table ------------------------------------------------------------------------
struct CudaDriver {
  // Returns the process-wide table (loaded and cuInit'ed on first call; thread-safe).
  static const CudaDriver& get();

  bool ok() const { return problem.empty(); }
  // "CUDA_ERROR_OUT_OF_MEMORY", or "CUresult 123" when the driver has no name for it.
  std::string error_name(CUresult result) const;
  // "<ERROR_NAME>: <what> failed"
  std::string failure(CUresult result, const std::string& what) const;

  std::string problem;  // why the driver cannot be used ("no CUDA driver found: ..."), or empty

  CUresult (*cuInit)(unsigned) = nullptr;
  CUresult (*cuGetErrorName)(CUresult, const char**) = nullptr;
  CUresult (*cuDeviceGet)(CUdevice*, int) = nullptr;
  CUresult (*cuDeviceGetCount)(int*) = nullptr;
  CUresult (*cuDeviceGetAttribute)(int*, int, CUdevice) = nullptr;
  CUresult (*cuDevicePrimaryCtxRetain)(CUcontext*, CUdevice) = nullptr;
  CUresult (*cuDevicePrimaryCtxRelease)(CUdevice) = nullptr;  // _v2
  CUresult (*cuCtxGetCurrent)(CUcontext*) = nullptr;
  CUresult (*cuCtxSetCurrent)(CUcontext) = nullptr;
  CUresult (*cuCtxSynchronize)() = nullptr;
  CUresult (*cuThreadExchangeStreamCaptureMode)(int*) = nullptr;
  CUresult (*cuMemGetInfo)(size_t*, size_t*) = nullptr;  // _v2
  CUresult (*cuMemGetAllocationGranularity)(size_t*, const CUmemAllocationProp*, int) = nullptr;
  CUresult (*cuMemAddressReserve)(CUdeviceptr*, size_t, size_t, CUdeviceptr,
                                  unsigned long long) = nullptr;
  CUresult (*cuMemAddressFree)(CUdeviceptr, size_t) = nullptr;
  CUresult (*cuMemCreate)(CUmemGenericAllocationHandle*, size_t, const CUmemAllocationProp*,
                          unsigned long long) = nullptr;
  CUresult (*cuMemRelease)(CUmemGenericAllocationHandle) = nullptr;
  CUresult (*cuMemMap)(CUdeviceptr, size_t, size_t, CUmemGenericAllocationHandle,
                       unsigned long long) = nullptr;
  CUresult (*cuMemUnmap)(CUdeviceptr, size_t) = nullptr;
  CUresult (*cuMemSetAccess)(CUdeviceptr, size_t, const CUmemAccessDesc*, size_t) = nullptr;
  CUresult (*cuEventCreate)(CUevent*, unsigned) = nullptr;
  CUresult (*cuEventRecord)(CUevent, CUstream) = nullptr;
  CUresult (*cuEventQuery)(CUevent) = nullptr;
  CUresult (*cuEventDestroy)(CUevent) = nullptr;  // _v2
  CUresult (*cuStreamCreate)(CUstream*, unsigned) = nullptr;
  CUresult (*cuStreamWaitEvent)(CUstream, CUevent, unsigned) = nullptr;
  CUresult (*cuStreamDestroy)(CUstream) = nullptr;  // _v2

 private:
  CudaDriver();
};

// Why the cuda backend cannot be used on `device` ("no CUDA driver found: ...", "no CUDA device
// 3: ..."), or empty when it can. Never throws.
std::string device_problem(int device);

}  // namespace kvasync::cuda
