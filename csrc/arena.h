// The VMM arena: physical pages, reserved ranges, and transactional page-table batches.
//
// Model
//   - The arena owns a pool of physical pages (ids 0..n-1), created off the hot path, and one
//     extra read-only *zero page*.
//   - A range is a reserved virtual address range of whole pages. Every page of a range is
//     always backed: either by a pool page (read-write) or by the zero page (read-only), so a
//     kernel or CUDA graph that reads any address of a range never faults.
//   - A pool page may back several (range, offset) slots at once: that is aliasing.
//   - apply() takes a batch of ops (map a pool page at a slot / unmap a slot) with sequential
//     semantics, validates the whole batch first, then changes the page tables. A batch is
//     transactional: if any driver call fails, everything already changed is put back and the
//     error is raised. Bad input raises std::invalid_argument and changes nothing.
//
// Cost model (CUDA): the driver charges per *mapping* call, not per byte, so apply() works on
// the diff between the old and new state and coalesces unmap and set-access calls over runs of
// consecutive slots (the "coalesce" switch turns that off, for the benchmark's comparison).
#pragma once

#include <array>
#include <chrono>
#include <cstdint>
#include <map>
#include <memory>
#include <mutex>
#include <string>
#include <vector>

#include "driver.h"

namespace dynoff {

class PoolExhausted : public std::runtime_error {
 public:
  using std::runtime_error::runtime_error;
};

constexpr std::int64_t kZeroPage = -1;  // in mapping(): the slot reads the zero page

struct MapOp {
  std::int64_t range;
  std::int64_t offset;  // in pages
  std::int64_t page;    // pool page id to map, or kZeroPage to unmap
};

enum class Call : int { kMap = 0, kUnmap, kSetAccess, kSynchronize, kCount };

struct CallStats {
  std::array<std::uint64_t, static_cast<int>(Call::kCount)> calls{};
  std::array<std::uint64_t, static_cast<int>(Call::kCount)> nanos{};
  std::uint64_t batches = 0;
  std::uint64_t slots_changed = 0;
  std::uint64_t rollbacks = 0;
  // Ranges whose address space stays reserved because a page of it could not be unmapped:
  // freeing it would let a later allocation land on a live mapping.
  std::uint64_t leaked_reservations = 0;
};

class Arena {
 public:
  Arena(std::unique_ptr<Driver> driver, bool coalesce);
  ~Arena();
  Arena(const Arena&) = delete;
  Arena& operator=(const Arena&) = delete;

  const Driver& driver() const { return *driver_; }
  std::size_t page_size() const { return page_size_; }
  bool coalesce() const { return coalesce_; }
  void set_coalesce(bool on) { coalesce_ = on; }
  bool trace() const { return trace_; }
  void set_trace(bool on) { trace_ = on; }  // log every driver call to stderr

  // Physical pages.
  void create_pages(std::size_t count);
  std::size_t trim_pages(std::size_t count);  // destroys up to `count` free pages
  std::vector<std::int64_t> allocate_pages(std::size_t count);
  void free_pages(const std::vector<std::int64_t>& pages);
  std::size_t num_pages() const;
  std::size_t num_free_pages() const;
  std::int64_t map_count(std::int64_t page) const;

  // Ranges.
  std::int64_t reserve(std::size_t num_pages);
  void release(std::int64_t range) noexcept;
  std::uintptr_t range_ptr(std::int64_t range) const;
  std::size_t range_pages(std::int64_t range) const;
  std::vector<std::int64_t> mapping(std::int64_t range) const;
  std::size_t num_ranges() const;

  // Transactional batch. If `synchronize`, waits for queued device work before unmapping.
  void apply(const std::vector<MapOp>& ops, bool synchronize);
  void synchronize();

  CallStats stats() const;
  void reset_stats();
  // Test hook: the `after`-th driver call from now (0 = the next one) fails, and so do the
  // `count` - 1 calls after it. -1 disarms.
  void inject_failure(std::int64_t after, std::int64_t count = 1);

 private:
  struct Page {
    Handle handle;
    bool allocated;
    std::int64_t map_count;
  };
  struct Range {
    std::uintptr_t va;
    std::vector<std::int64_t> slots;  // pool page id or kZeroPage
  };
  struct Change {
    std::int64_t range;
    std::int64_t offset;
    std::int64_t old_page;
    std::int64_t new_page;
    int stage;  // 0 untouched, 1 unmapped, 2 new page mapped, 3 access set
  };

  const Range& range_at(std::int64_t range) const;
  void drop_range(const Range& range) noexcept;
  bool unmap_pages(std::uintptr_t va, std::size_t num_pages, bool ranged) noexcept;
  void free_reservation(std::uintptr_t va, std::size_t bytes, bool unmapped) noexcept;
  void maybe_inject();
  std::vector<Change> validate(const std::vector<MapOp>& ops) const;
  void execute(std::vector<Change>& changes);
  void execute_run(std::vector<Change>& changes, std::size_t begin, std::size_t end);
  void roll_back(std::vector<Change>& changes) noexcept;
  void commit(const std::vector<Change>& changes);
  Handle handle_of(std::int64_t page) const;
  std::uintptr_t slot_va(std::int64_t range, std::int64_t offset) const;
  void map_slot(std::uintptr_t va, std::int64_t page);
  void set_access_runs(std::vector<Change>& changes, std::size_t begin, std::size_t end);

  template <typename Fn>
  void timed(Call call, std::uintptr_t va, std::size_t bytes, Fn&& fn);

  std::unique_ptr<Driver> driver_;
  std::size_t page_size_;
  bool coalesce_;
  mutable std::mutex mu_;
  std::vector<Page> pages_;
  std::vector<std::int64_t> free_list_;
  Handle zero_handle_ = 0;
  std::map<std::int64_t, Range> ranges_;
  std::int64_t next_range_ = 0;
  CallStats stats_;
  std::int64_t fail_after_ = -1;
  std::int64_t fail_count_ = 0;
  bool rolling_back_ = false;
  bool broken_ = false;
  bool trace_ = false;
};

}  // namespace dynoff
