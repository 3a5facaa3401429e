#include "arena.h"

#include <algorithm>
#include <cstdio>
#include <set>
#include <utility>

namespace dynoff {

void throw_driver_error(const std::string& what, const char* file, int line) {
  // No iostreams here: the GPU image's build links libstdc++ statically into the extension,
  // and its ostream crashed there on first use (std::codecvt, seen under cuda-gdb).
  throw DriverError(what + " [" + file + ":" + std::to_string(line) + "]");
}

namespace {

std::string slot_name(std::int64_t range, std::int64_t offset) {
  return "range " + std::to_string(range) + " page " + std::to_string(offset);
}

}  // namespace

Arena::Arena(std::unique_ptr<Driver> driver, bool coalesce)
    : driver_(std::move(driver)), page_size_(driver_->page_size()), coalesce_(coalesce) {
  zero_handle_ = driver_->create_page();
}

Arena::~Arena() {
  std::lock_guard<std::mutex> lock(mu_);
  try {
    driver_->synchronize();
  } catch (...) {  // tearing down: nothing useful to do with a failure here
  }
  for (auto& [id, range] : ranges_) drop_range(range);
  for (const Page& page : pages_) driver_->release_page(page.handle);
  driver_->release_page(zero_handle_);
}

template <typename Fn>
void Arena::timed(Call call, std::uintptr_t va, std::size_t bytes, Fn&& fn) {
  static const char* names[] = {"map", "unmap", "set_access", "synchronize"};
  if (trace_) {
    std::fprintf(stderr, "[dynoff vmm] %s%s va=%#zx pages=%zu\n", rolling_back_ ? "rollback " : "",
                 names[static_cast<int>(call)], static_cast<std::size_t>(va), bytes / page_size_);
  }
  if (!rolling_back_) maybe_inject();
  const auto start = std::chrono::steady_clock::now();
  fn();
  const auto spent = std::chrono::steady_clock::now() - start;
  const int k = static_cast<int>(call);
  stats_.calls[k] += 1;
  stats_.nanos[k] += static_cast<std::uint64_t>(
      std::chrono::duration_cast<std::chrono::nanoseconds>(spent).count());
}

// ---- physical pages -------------------------------------------------------------------------

void Arena::create_pages(std::size_t count) {
  std::lock_guard<std::mutex> lock(mu_);
  std::vector<Handle> made;
  made.reserve(count);
  try {
    for (std::size_t i = 0; i < count; ++i) made.push_back(driver_->create_page());
  } catch (...) {
    for (Handle h : made) driver_->release_page(h);  // all or nothing
    throw;
  }
  for (Handle h : made) {
    free_list_.push_back(static_cast<std::int64_t>(pages_.size()));
    pages_.push_back(Page{h, false, 0});
  }
}

std::size_t Arena::trim_pages(std::size_t count) {
  std::lock_guard<std::mutex> lock(mu_);
  // Only pages at the end of the id space can go, so ids stay dense.
  std::size_t trimmed = 0;
  while (trimmed < count && !pages_.empty() && !pages_.back().allocated) {
    const auto id = static_cast<std::int64_t>(pages_.size() - 1);
    free_list_.erase(std::remove(free_list_.begin(), free_list_.end(), id), free_list_.end());
    driver_->release_page(pages_.back().handle);
    pages_.pop_back();
    ++trimmed;
  }
  return trimmed;
}

std::vector<std::int64_t> Arena::allocate_pages(std::size_t count) {
  std::lock_guard<std::mutex> lock(mu_);
  if (count > free_list_.size()) {
    throw PoolExhausted("page pool exhausted: asked for " + std::to_string(count) + " pages, " +
                        std::to_string(free_list_.size()) + " of " +
                        std::to_string(pages_.size()) +
                        " are free; create more with create_pages()");
  }
  std::vector<std::int64_t> out(free_list_.end() - static_cast<std::ptrdiff_t>(count),
                                free_list_.end());
  free_list_.resize(free_list_.size() - count);
  std::sort(out.begin(), out.end());
  for (std::int64_t id : out) pages_[static_cast<std::size_t>(id)].allocated = true;
  return out;
}

void Arena::free_pages(const std::vector<std::int64_t>& ids) {
  std::lock_guard<std::mutex> lock(mu_);
  std::set<std::int64_t> seen;
  for (std::int64_t id : ids) {
    if (id < 0 || static_cast<std::size_t>(id) >= pages_.size()) {
      throw std::invalid_argument("free_pages: no page " + std::to_string(id));
    }
    const Page& page = pages_[static_cast<std::size_t>(id)];
    if (!page.allocated || !seen.insert(id).second) {
      throw std::invalid_argument("free_pages: page " + std::to_string(id) + " is not allocated");
    }
    if (page.map_count != 0) {
      throw std::invalid_argument("free_pages: page " + std::to_string(id) + " is still mapped " +
                                  std::to_string(page.map_count) + " time(s); unmap it first");
    }
  }
  for (std::int64_t id : ids) {
    pages_[static_cast<std::size_t>(id)].allocated = false;
    free_list_.push_back(id);
  }
}

std::size_t Arena::num_pages() const {
  std::lock_guard<std::mutex> lock(mu_);
  return pages_.size();
}

std::size_t Arena::num_free_pages() const {
  std::lock_guard<std::mutex> lock(mu_);
  return free_list_.size();
}

std::int64_t Arena::map_count(std::int64_t page) const {
  std::lock_guard<std::mutex> lock(mu_);
  if (page < 0 || static_cast<std::size_t>(page) >= pages_.size()) {
    throw std::invalid_argument("no page " + std::to_string(page));
  }
  return pages_[static_cast<std::size_t>(page)].map_count;
}

// ---- ranges ---------------------------------------------------------------------------------

std::int64_t Arena::reserve(std::size_t num_pages) {
  if (num_pages == 0) throw std::invalid_argument("reserve: a range needs at least one page");
  std::lock_guard<std::mutex> lock(mu_);
  if (broken_) DYNOFF_FAIL("arena is unusable after a failed rollback");
  const std::size_t bytes = num_pages * page_size_;
  const std::uintptr_t va = driver_->reserve(bytes);
  std::size_t mapped = 0;
  try {
    for (; mapped < num_pages; ++mapped) driver_->map(va + mapped * page_size_, zero_handle_);
    driver_->set_access(va, bytes, false);
  } catch (...) {
    free_reservation(va, bytes, unmap_pages(va, mapped, false));
    throw;
  }
  const std::int64_t id = next_range_++;
  ranges_.emplace(id, Range{va, std::vector<std::int64_t>(num_pages, kZeroPage)});
  return id;
}

void Arena::release(std::int64_t id) noexcept {
  std::lock_guard<std::mutex> lock(mu_);
  auto it = ranges_.find(id);
  if (it == ranges_.end()) return;
  Range& range = it->second;
  try {
    driver_->synchronize();  // queued work may still read the range
  } catch (...) {
  }
  drop_range(range);
  for (std::int64_t page : range.slots) {
    if (page != kZeroPage) pages_[static_cast<std::size_t>(page)].map_count -= 1;
  }
  ranges_.erase(it);
}

void Arena::drop_range(const Range& range) noexcept {
  // Every slot is mapped (pool page or zero page): one ranged unmap, else page by page.
  free_reservation(range.va, range.slots.size() * page_size_,
                   unmap_pages(range.va, range.slots.size(), true));
}

bool Arena::unmap_pages(std::uintptr_t va, std::size_t num_pages, bool ranged) noexcept {
  // True when every one of the pages is known unmapped.
  if (ranged && num_pages > 0) {
    try {
      maybe_inject();
      driver_->unmap(va, num_pages * page_size_);
      return true;
    } catch (...) {  // page by page below
    }
  }
  bool unmapped = true;
  for (std::size_t i = 0; i < num_pages; ++i) {
    try {
      maybe_inject();
      driver_->unmap(va + i * page_size_, page_size_);
    } catch (...) {
      unmapped = false;
    }
  }
  return unmapped;
}

void Arena::free_reservation(std::uintptr_t va, std::size_t bytes, bool unmapped) noexcept {
  // A reservation freed over a live mapping hands that address space back to the driver,
  // and the next allocation placed there fails ("resource already mapped") or aliases the
  // page. Better to leave it reserved: address space is plentiful.
  if (unmapped) {
    driver_->free_reservation(va, bytes);
    return;
  }
  stats_.leaked_reservations += 1;
  std::fprintf(stderr,
               "[dynoff vmm] a range at %#zx (%zu bytes) could not be fully unmapped; its "
               "address space stays reserved\n",
               static_cast<std::size_t>(va), bytes);
}

void Arena::maybe_inject() {
  if (fail_after_ < 0) return;
  if (fail_after_ > 0) {
    --fail_after_;
    return;
  }
  if (--fail_count_ <= 0) fail_after_ = -1;
  DYNOFF_FAIL("injected failure (test hook)");
}

const Arena::Range& Arena::range_at(std::int64_t id) const {
  auto it = ranges_.find(id);
  if (it == ranges_.end()) throw std::invalid_argument("no range " + std::to_string(id));
  return it->second;
}

std::uintptr_t Arena::range_ptr(std::int64_t id) const {
  std::lock_guard<std::mutex> lock(mu_);
  return range_at(id).va;
}

std::size_t Arena::range_pages(std::int64_t id) const {
  std::lock_guard<std::mutex> lock(mu_);
  return range_at(id).slots.size();
}

std::vector<std::int64_t> Arena::mapping(std::int64_t id) const {
  std::lock_guard<std::mutex> lock(mu_);
  return range_at(id).slots;
}

std::size_t Arena::num_ranges() const {
  std::lock_guard<std::mutex> lock(mu_);
  return ranges_.size();
}

// ---- batches --------------------------------------------------------------------------------

std::vector<Arena::Change> Arena::validate(const std::vector<MapOp>& ops) const {
  // Replays the ops on a scratch copy of the touched slots; the first bad op throws.
  std::map<std::pair<std::int64_t, std::int64_t>, std::pair<std::int64_t, std::int64_t>> touched;
  for (std::size_t i = 0; i < ops.size(); ++i) {
    const MapOp& op = ops[i];
    const std::string where = "op " + std::to_string(i) + " (" + slot_name(op.range, op.offset) + ")";
    auto rit = ranges_.find(op.range);
    if (rit == ranges_.end()) throw std::invalid_argument(where + ": no such range");
    const auto& slots = rit->second.slots;
    if (op.offset < 0 || static_cast<std::size_t>(op.offset) >= slots.size()) {
      throw std::invalid_argument(where + ": offset out of range [0, " +
                                  std::to_string(slots.size()) + ")");
    }
    const auto key = std::make_pair(op.range, op.offset);
    auto [it, fresh] = touched.try_emplace(key, slots[static_cast<std::size_t>(op.offset)],
                                           slots[static_cast<std::size_t>(op.offset)]);
    (void)fresh;
    std::int64_t& current = it->second.second;
    if (op.page == kZeroPage) {
      if (current == kZeroPage) throw std::invalid_argument(where + ": unmapping an unmapped page");
    } else {
      if (op.page < 0 || static_cast<std::size_t>(op.page) >= pages_.size()) {
        throw std::invalid_argument(where + ": no pool page " + std::to_string(op.page));
      }
      if (!pages_[static_cast<std::size_t>(op.page)].allocated) {
        throw std::invalid_argument(where + ": pool page " + std::to_string(op.page) +
                                    " is free; allocate it first");
      }
      if (current != kZeroPage) {
        throw std::invalid_argument(where + ": mapping over a mapped page (holds pool page " +
                                    std::to_string(current) + "); unmap it first");
      }
    }
    current = op.page;
  }
  std::vector<Change> changes;
  for (const auto& [key, states] : touched) {
    if (states.first != states.second) {
      changes.push_back(Change{key.first, key.second, states.first, states.second, 0});
    }
  }
  return changes;  // sorted by (range, offset): runs of consecutive slots are adjacent
}

Handle Arena::handle_of(std::int64_t page) const {
  return page == kZeroPage ? zero_handle_ : pages_[static_cast<std::size_t>(page)].handle;
}

std::uintptr_t Arena::slot_va(std::int64_t range, std::int64_t offset) const {
  return ranges_.at(range).va + static_cast<std::uintptr_t>(offset) * page_size_;
}

void Arena::map_slot(std::uintptr_t va, std::int64_t page) {
  timed(Call::kMap, va, page_size_, [&] { driver_->map(va, handle_of(page)); });
}

void Arena::apply(const std::vector<MapOp>& ops, bool synchronize) {
  std::lock_guard<std::mutex> lock(mu_);
  if (broken_) DYNOFF_FAIL("arena is unusable after a failed rollback");
  std::vector<Change> changes = validate(ops);
  if (changes.empty()) return;
  if (synchronize) timed(Call::kSynchronize, 0, 0, [&] { driver_->synchronize(); });
  try {
    execute(changes);
  } catch (...) {
    roll_back(changes);
    throw;
  }
  commit(changes);
}

void Arena::execute(std::vector<Change>& changes) {
  std::size_t begin = 0;
  while (begin < changes.size()) {
    std::size_t end = begin + 1;
    while (coalesce_ && end < changes.size() && changes[end].range == changes[begin].range &&
           changes[end].offset == changes[end - 1].offset + 1) {
      ++end;
    }
    execute_run(changes, begin, end);
    begin = end;
  }
}

void Arena::execute_run(std::vector<Change>& changes, std::size_t begin, std::size_t end) {
  // Every slot is always mapped (pool page or zero page), so a run is: unmap, map, set access.
  const std::uintptr_t va = slot_va(changes[begin].range, changes[begin].offset);
  timed(Call::kUnmap, va, (end - begin) * page_size_,
        [&] { driver_->unmap(va, (end - begin) * page_size_); });
  for (std::size_t i = begin; i < end; ++i) changes[i].stage = 1;
  for (std::size_t i = begin; i < end; ++i) {
    map_slot(va + (i - begin) * page_size_, changes[i].new_page);
    changes[i].stage = 2;
  }
  set_access_runs(changes, begin, end);
}

void Arena::set_access_runs(std::vector<Change>& changes, std::size_t begin,
                            std::size_t end) {
  // One call per sub-run of equal access: pool pages read-write, the zero page read-only.
  const std::uintptr_t va = slot_va(changes[begin].range, changes[begin].offset);
  std::size_t i = begin;
  while (i < end) {
    const bool writable = changes[i].new_page != kZeroPage;
    std::size_t j = i + 1;
    while (j < end && (changes[j].new_page != kZeroPage) == writable) ++j;
    const std::uintptr_t at = va + (i - begin) * page_size_;
    timed(Call::kSetAccess, at, (j - i) * page_size_,
          [&] { driver_->set_access(at, (j - i) * page_size_, writable); });
    i = j;
  }
  for (std::size_t k = begin; k < end; ++k) changes[k].stage = 3;
}

void Arena::roll_back(std::vector<Change>& changes) noexcept {
  // Slot by slot (robust over speed): drop whatever the batch mapped, put the old page back.
  rolling_back_ = true;
  stats_.rollbacks += 1;
  try {
    for (Change& c : changes) {
      if (c.stage == 0) continue;
      const std::uintptr_t va = slot_va(c.range, c.offset);
      if (c.stage >= 2) {
        timed(Call::kUnmap, va, page_size_, [&] { driver_->unmap(va, page_size_); });
      }
      map_slot(va, c.old_page);
      timed(Call::kSetAccess, va, page_size_,
            [&] { driver_->set_access(va, page_size_, c.old_page != kZeroPage); });
      c.stage = 0;
    }
  } catch (...) {
    broken_ = true;  // the page tables no longer match the book-keeping: refuse further work
  }
  rolling_back_ = false;
}

void Arena::commit(const std::vector<Change>& changes) {
  for (const Change& c : changes) {
    ranges_.at(c.range).slots[static_cast<std::size_t>(c.offset)] = c.new_page;
    if (c.old_page != kZeroPage) pages_[static_cast<std::size_t>(c.old_page)].map_count -= 1;
    if (c.new_page != kZeroPage) pages_[static_cast<std::size_t>(c.new_page)].map_count += 1;
  }
  stats_.batches += 1;
  stats_.slots_changed += changes.size();
}

void Arena::synchronize() {
  std::lock_guard<std::mutex> lock(mu_);
  timed(Call::kSynchronize, 0, 0, [&] { driver_->synchronize(); });
}

CallStats Arena::stats() const {
  std::lock_guard<std::mutex> lock(mu_);
  return stats_;
}

void Arena::reset_stats() {
  std::lock_guard<std::mutex> lock(mu_);
  stats_ = CallStats{};
}

void Arena::inject_failure(std::int64_t after, std::int64_t count) {
  std::lock_guard<std::mutex> lock(mu_);
  fail_after_ = after;
  fail_count_ = count;
}

}  // namespace dynoff
