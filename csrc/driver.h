// Physical-page drivers behind the VMM arena.
//
// A Driver owns the platform calls and nothing else: reserving virtual ranges, creating
// physical pages, mapping one page at a virtual address, unmapping ranges and setting access.
// Book-keeping (which page is where, validation, transactions) lives in arena.h, so both
// backends share one set of semantics.
//
//   cuda: the CUDA driver's VMM API, loaded with dlopen at run time (no link-time CUDA
//         dependency), on the device's primary context so addresses agree with torch.
//   host: memfd pages mapped with mmap(MAP_FIXED | MAP_SHARED); the same semantics on a CPU,
//         so CPU tests and vLLM's CPU engine exercise real remapping.
//
// Errors: every failure throws DriverError carrying the platform's message and file:line.
#pragma once

#include <cstddef>
#include <cstdint>
#include <memory>
#include <stdexcept>
#include <string>

namespace dynoff {

// A physical page as the platform knows it (a CUmemGenericAllocationHandle, or an offset
// into the host backend's memfd).
using Handle = std::uint64_t;

class DriverError : public std::runtime_error {
 public:
  using std::runtime_error::runtime_error;
};

[[noreturn]] void throw_driver_error(const std::string& what, const char* file, int line);
#define DYNOFF_FAIL(msg) ::dynoff::throw_driver_error((msg), __FILE__, __LINE__)

class Driver {
 public:
  virtual ~Driver() = default;
  virtual std::string name() const = 0;
  virtual int device() const = 0;
  // Page size of this driver in bytes: one physical handle (CUDA: a multiple of the
  // allocation granularity, by default the granularity itself).
  virtual std::size_t page_size() const = 0;

  virtual std::uintptr_t reserve(std::size_t bytes) = 0;
  virtual void free_reservation(std::uintptr_t va, std::size_t bytes) noexcept = 0;

  virtual Handle create_page() = 0;
  virtual void release_page(Handle handle) noexcept = 0;

  // Maps one whole page at va. The mapping starts with no access (as in CUDA).
  virtual void map(std::uintptr_t va, Handle handle) = 0;
  // Unmaps [va, va + bytes), which must cover whole mappings; may span several of them.
  virtual void unmap(std::uintptr_t va, std::size_t bytes) = 0;
  virtual void set_access(std::uintptr_t va, std::size_t bytes, bool writable) = 0;
  // Waits for all work queued on the device (no-op on the host).
  virtual void synchronize() = 0;
};

// `page_size` 0 = the default (CUDA: the allocation granularity; host: 2 MiB).
std::unique_ptr<Driver> make_cuda_driver(int device, std::size_t page_size);
std::unique_ptr<Driver> make_host_driver(std::size_t page_size);

}  // namespace dynoff
