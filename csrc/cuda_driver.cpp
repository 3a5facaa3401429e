// CUDA backend: the driver's VMM API, resolved with dlopen("libcuda.so.1") on first use so the
// extension imports on machines without a GPU. All calls run on the device's primary context,
// the one torch uses, so our addresses are valid in torch's kernels and CUDA graphs.
#include <dlfcn.h>

#include <stdexcept>
#include <string>

#include "cuda_api.h"
#include "driver.h"

namespace dynoff {
namespace {

using namespace cu;

struct Api {
  CUresult (*cuInit)(unsigned int);
  CUresult (*cuGetErrorName)(CUresult, const char**);
  CUresult (*cuGetErrorString)(CUresult, const char**);
  CUresult (*cuDeviceGet)(CUdevice*, int);
  CUresult (*cuDevicePrimaryCtxRetain)(CUcontext*, CUdevice);
  CUresult (*cuDevicePrimaryCtxRelease)(CUdevice);
  CUresult (*cuCtxGetCurrent)(CUcontext*);
  CUresult (*cuCtxSetCurrent)(CUcontext);
  CUresult (*cuCtxSynchronize)();
  CUresult (*cuMemGetAllocationGranularity)(std::size_t*, const CUmemAllocationProp*, int);
  CUresult (*cuMemAddressReserve)(CUdeviceptr*, std::size_t, std::size_t, CUdeviceptr,
                                  unsigned long long);
  CUresult (*cuMemAddressFree)(CUdeviceptr, std::size_t);
  CUresult (*cuMemCreate)(CUmemGenericAllocationHandle*, std::size_t, const CUmemAllocationProp*,
                          unsigned long long);
  CUresult (*cuMemRelease)(CUmemGenericAllocationHandle);
  CUresult (*cuMemMap)(CUdeviceptr, std::size_t, std::size_t, CUmemGenericAllocationHandle,
                       unsigned long long);
  CUresult (*cuMemUnmap)(CUdeviceptr, std::size_t);
  CUresult (*cuMemSetAccess)(CUdeviceptr, std::size_t, const CUmemAccessDesc*, std::size_t);
};

template <typename Fn>
void resolve(void* lib, const char* symbol, Fn& fn) {
  void* addr = dlsym(lib, symbol);
  if (addr == nullptr) DYNOFF_FAIL(std::string("libcuda.so.1 has no symbol ") + symbol);
  fn = reinterpret_cast<Fn>(addr);
}

const Api& api() {
  static const Api loaded = [] {
    void* lib = dlopen("libcuda.so.1", RTLD_NOW | RTLD_LOCAL);
    if (lib == nullptr) {
      const char* why = dlerror();
      DYNOFF_FAIL(std::string("cannot load the CUDA driver (libcuda.so.1): ") +
                  (why != nullptr ? why : "unknown error") +
                  "; use backend='host' on machines without a GPU");
    }
    Api a{};
    resolve(lib, "cuInit", a.cuInit);
    resolve(lib, "cuGetErrorName", a.cuGetErrorName);
    resolve(lib, "cuGetErrorString", a.cuGetErrorString);
    resolve(lib, "cuDeviceGet", a.cuDeviceGet);
    resolve(lib, "cuDevicePrimaryCtxRetain", a.cuDevicePrimaryCtxRetain);
    resolve(lib, "cuDevicePrimaryCtxRelease_v2", a.cuDevicePrimaryCtxRelease);
    resolve(lib, "cuCtxGetCurrent", a.cuCtxGetCurrent);
    resolve(lib, "cuCtxSetCurrent", a.cuCtxSetCurrent);
    resolve(lib, "cuCtxSynchronize", a.cuCtxSynchronize);
    resolve(lib, "cuMemGetAllocationGranularity", a.cuMemGetAllocationGranularity);
    resolve(lib, "cuMemAddressReserve", a.cuMemAddressReserve);
    resolve(lib, "cuMemAddressFree", a.cuMemAddressFree);
    resolve(lib, "cuMemCreate", a.cuMemCreate);
    resolve(lib, "cuMemRelease", a.cuMemRelease);
    resolve(lib, "cuMemMap", a.cuMemMap);
    resolve(lib, "cuMemUnmap", a.cuMemUnmap);
    resolve(lib, "cuMemSetAccess", a.cuMemSetAccess);
    return a;
  }();
  return loaded;
}

void check(CUresult rc, const char* call, const char* file, int line) {
  if (rc == CUDA_SUCCESS) return;
  const char* name = nullptr;
  const char* text = nullptr;
  api().cuGetErrorName(rc, &name);
  api().cuGetErrorString(rc, &text);
  throw_driver_error(std::string(call) + " failed: " + (name != nullptr ? name : "?") + " (" +
                         (text != nullptr ? text : "no description") + ")",
                     file, line);
}
#define CU_CHECK(call) check((call), #call, __FILE__, __LINE__)

class CudaDriver final : public Driver {
 public:
  CudaDriver(int device, std::size_t page_size) : ordinal_(device) {
    CU_CHECK(api().cuInit(0));
    CU_CHECK(api().cuDeviceGet(&device_, ordinal_));
    CU_CHECK(api().cuDevicePrimaryCtxRetain(&context_, device_));
    prop_.type = CU_MEM_ALLOCATION_TYPE_PINNED;
    prop_.requestedHandleTypes = CU_MEM_HANDLE_TYPE_NONE;
    prop_.location = {CU_MEM_LOCATION_TYPE_DEVICE, device_};
    use_context();
    CU_CHECK(api().cuMemGetAllocationGranularity(&granularity_, &prop_,
                                                  CU_MEM_ALLOC_GRANULARITY_MINIMUM));
    // A page is one physical handle. The driver charges per mapping, not per byte, so larger
    // pages make a level change cheaper; it must be whole granules.
    page_size_ = page_size == 0 ? granularity_ : page_size;
    if (page_size_ % granularity_ != 0) {
      api().cuDevicePrimaryCtxRelease(device_);
      throw std::invalid_argument("page_size " + std::to_string(page_size) +
                                  " is not a multiple of the CUDA allocation granularity " +
                                  std::to_string(granularity_));
    }
  }
  ~CudaDriver() override { api().cuDevicePrimaryCtxRelease(device_); }

  std::string name() const override { return "cuda"; }
  int device() const override { return ordinal_; }
  std::size_t page_size() const override { return page_size_; }

  std::uintptr_t reserve(std::size_t bytes) override {
    use_context();
    CUdeviceptr va = 0;
    CU_CHECK(api().cuMemAddressReserve(&va, bytes, granularity_, 0, 0));
    return static_cast<std::uintptr_t>(va);
  }
  void free_reservation(std::uintptr_t va, std::size_t bytes) noexcept override {
    api().cuMemAddressFree(static_cast<CUdeviceptr>(va), bytes);
  }

  Handle create_page() override {
    use_context();
    CUmemGenericAllocationHandle handle = 0;
    CU_CHECK(api().cuMemCreate(&handle, page_size_, &prop_, 0));
    return static_cast<Handle>(handle);
  }
  void release_page(Handle handle) noexcept override { api().cuMemRelease(handle); }

  void map(std::uintptr_t va, Handle handle) override {
    use_context();
    CU_CHECK(api().cuMemMap(static_cast<CUdeviceptr>(va), page_size_, 0, handle, 0));
  }
  void unmap(std::uintptr_t va, std::size_t bytes) override {
    use_context();
    CU_CHECK(api().cuMemUnmap(static_cast<CUdeviceptr>(va), bytes));
  }
  void set_access(std::uintptr_t va, std::size_t bytes, bool writable) override {
    use_context();
    CUmemAccessDesc desc{};
    desc.location = {CU_MEM_LOCATION_TYPE_DEVICE, device_};
    desc.flags = writable ? CU_MEM_ACCESS_FLAGS_PROT_READWRITE : CU_MEM_ACCESS_FLAGS_PROT_READ;
    CU_CHECK(api().cuMemSetAccess(static_cast<CUdeviceptr>(va), bytes, &desc, 1));
  }
  void synchronize() override {
    use_context();
    CU_CHECK(api().cuCtxSynchronize());
  }

 private:
  // Calls may come from threads that never touched CUDA (the GIL is released around batches).
  void use_context() {
    CUcontext current = nullptr;
    CU_CHECK(api().cuCtxGetCurrent(&current));
    if (current != context_) CU_CHECK(api().cuCtxSetCurrent(context_));
  }

  int ordinal_;
  CUdevice device_ = 0;
  CUcontext context_ = nullptr;
  CUmemAllocationProp prop_{};
  std::size_t granularity_ = 0;
  std::size_t page_size_ = 0;
};

}  // namespace

std::unique_ptr<Driver> make_cuda_driver(int device, std::size_t page_size) {
  return std::make_unique<CudaDriver>(device, page_size);
}

}  // namespace dynoff
