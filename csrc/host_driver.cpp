// Host backend: physical pages are page-sized slices of one memfd; a reservation is an
// anonymous PROT_NONE mapping; mapping a page is mmap(MAP_FIXED | MAP_SHARED) of its slice.
// Two virtual addresses that map the same slice share memory, exactly like two CUDA
// mappings of one allocation handle.
#include <fcntl.h>
#include <sys/mman.h>
#include <unistd.h>

#include <cerrno>
#include <cstring>
#include <mutex>
#include <vector>

#include "driver.h"

namespace dynoff {
namespace {

constexpr std::size_t kDefaultHostPageSize = std::size_t{2} << 20;  // 2 MiB, as on CUDA

std::string errno_message(const char* call) {
  return std::string(call) + " failed: " + std::strerror(errno);
}

class HostDriver final : public Driver {
 public:
  explicit HostDriver(std::size_t page_size)
      : page_size_(page_size == 0 ? kDefaultHostPageSize : page_size) {
    const auto system_page = static_cast<std::size_t>(sysconf(_SC_PAGESIZE));
    if (page_size_ % system_page != 0) {
      throw std::invalid_argument("host page size " + std::to_string(page_size_) +
                                  " is not a multiple of the system page size " +
                                  std::to_string(system_page));
    }
    fd_ = memfd_create("dynoff-pages", MFD_CLOEXEC);
    if (fd_ < 0) DYNOFF_FAIL(errno_message("memfd_create"));
  }
  ~HostDriver() override { close(fd_); }

  std::string name() const override { return "host"; }
  int device() const override { return -1; }
  std::size_t page_size() const override { return page_size_; }

  std::uintptr_t reserve(std::size_t bytes) override {
    void* va = mmap(nullptr, bytes, PROT_NONE, MAP_PRIVATE | MAP_ANONYMOUS | MAP_NORESERVE, -1, 0);
    if (va == MAP_FAILED) DYNOFF_FAIL(errno_message("mmap(reserve)"));
    return reinterpret_cast<std::uintptr_t>(va);
  }
  void free_reservation(std::uintptr_t va, std::size_t bytes) noexcept override {
    munmap(reinterpret_cast<void*>(va), bytes);
  }

  Handle create_page() override {
    std::lock_guard<std::mutex> lock(mu_);
    if (!released_.empty()) {
      Handle handle = released_.back();
      released_.pop_back();
      return handle;
    }
    const auto offset = static_cast<off_t>(file_pages_ * page_size_);
    if (ftruncate(fd_, offset + static_cast<off_t>(page_size_)) != 0) {
      DYNOFF_FAIL(errno_message("ftruncate(memfd)"));
    }
    ++file_pages_;
    return static_cast<Handle>(offset);
  }
  void release_page(Handle handle) noexcept override {
    std::lock_guard<std::mutex> lock(mu_);
    // Give the memory back to the kernel; the slice reads as zeros when reused.
    fallocate(fd_, FALLOC_FL_PUNCH_HOLE | FALLOC_FL_KEEP_SIZE, static_cast<off_t>(handle),
              static_cast<off_t>(page_size_));
    released_.push_back(handle);
  }

  void map(std::uintptr_t va, Handle handle) override {
    void* got = mmap(reinterpret_cast<void*>(va), page_size_, PROT_NONE, MAP_FIXED | MAP_SHARED, fd_,
                     static_cast<off_t>(handle));
    if (got == MAP_FAILED) DYNOFF_FAIL(errno_message("mmap(MAP_FIXED|MAP_SHARED)"));
  }
  void unmap(std::uintptr_t va, std::size_t bytes) override {
    // Back to a plain reservation: the range stays ours, nothing else can land there.
    void* got = mmap(reinterpret_cast<void*>(va), bytes, PROT_NONE,
                     MAP_FIXED | MAP_PRIVATE | MAP_ANONYMOUS | MAP_NORESERVE, -1, 0);
    if (got == MAP_FAILED) DYNOFF_FAIL(errno_message("mmap(unmap)"));
  }
  void set_access(std::uintptr_t va, std::size_t bytes, bool writable) override {
    const int prot = writable ? (PROT_READ | PROT_WRITE) : PROT_READ;
    if (mprotect(reinterpret_cast<void*>(va), bytes, prot) != 0) {
      DYNOFF_FAIL(errno_message("mprotect"));
    }
  }
  void synchronize() override {}

 private:
  std::size_t page_size_;
  int fd_ = -1;
  std::mutex mu_;
  std::size_t file_pages_ = 0;
  std::vector<Handle> released_;
};

}  // namespace

std::unique_ptr<Driver> make_host_driver(std::size_t page_size) {
  return std::make_unique<HostDriver>(page_size);
}

}  // namespace dynoff
