// pybind11 bindings: dynoff._vmm. The Python API over it is allocator/ (dynoff.allocator).
#include <pybind11/pybind11.h>
#include <pybind11/stl.h>

#include <memory>
#include <string>

#include "arena.h"

namespace py = pybind11;
using dynoff::Arena;

namespace {

// A reserved range handed to Python. It keeps its arena alive and releases the range (unmapping
// whatever is mapped there) when the last reference goes, e.g. the last tensor viewing it.
class RangeHandle {
 public:
  RangeHandle(std::shared_ptr<Arena> arena, std::int64_t id) : arena_(std::move(arena)), id_(id) {}
  ~RangeHandle() { arena_->release(id_); }
  RangeHandle(const RangeHandle&) = delete;
  RangeHandle& operator=(const RangeHandle&) = delete;

  std::int64_t id() const { return id_; }
  std::uintptr_t ptr() const { return arena_->range_ptr(id_); }
  std::size_t num_pages() const { return arena_->range_pages(id_); }
  std::size_t nbytes() const { return num_pages() * arena_->page_size(); }
  std::vector<std::int64_t> mapping() const { return arena_->mapping(id_); }
  const std::shared_ptr<Arena>& arena() const { return arena_; }

 private:
  std::shared_ptr<Arena> arena_;
  std::int64_t id_;
};

std::shared_ptr<Arena> make_arena(const std::string& backend, int device, std::size_t page_size,
                                  bool coalesce) {
  if (backend == "cuda") {
    return std::make_shared<Arena>(dynoff::make_cuda_driver(device, page_size), coalesce);
  }
  if (backend == "host") return std::make_shared<Arena>(dynoff::make_host_driver(page_size), coalesce);
  throw std::invalid_argument("unknown backend '" + backend + "'; expected 'cuda' or 'host'");
}

py::dict stats_dict(const dynoff::CallStats& s) {
  static const char* names[] = {"map", "unmap", "set_access", "synchronize"};
  py::dict out;
  for (int k = 0; k < static_cast<int>(dynoff::Call::kCount); ++k) {
    out[py::str(std::string(names[k]) + "_calls")] = s.calls[static_cast<std::size_t>(k)];
    out[py::str(std::string(names[k]) + "_us")] =
        static_cast<double>(s.nanos[static_cast<std::size_t>(k)]) / 1e3;
  }
  out["batches"] = s.batches;
  out["slots_changed"] = s.slots_changed;
  out["rollbacks"] = s.rollbacks;
  out["leaked_reservations"] = s.leaked_reservations;
  return out;
}

}  // namespace

PYBIND11_MODULE(_vmm, m) {
  m.doc() = "VMM arena: physical pages, reserved ranges, transactional remapping (cuda | host).";
  m.attr("ZERO_PAGE") = dynoff::kZeroPage;
  // HACK(pybind11-3.1 register_exception): its once-per-interpreter exception storage crashed
  // (SIGSEGV on the first throw) under the GPU image's Python 3.12; plain module-owned
  // exception types and one translator avoid that storage.
  static PyObject* driver_error =
      PyErr_NewException("dynoff.allocator._vmm.VmmDriverError", PyExc_RuntimeError, nullptr);
  static PyObject* pool_exhausted =
      PyErr_NewException("dynoff.allocator._vmm.PagePoolExhausted", PyExc_MemoryError, nullptr);
  m.attr("VmmDriverError") = py::handle(driver_error);
  m.attr("PagePoolExhausted") = py::handle(pool_exhausted);
  py::register_exception_translator([](std::exception_ptr p) {
    try {
      if (p) std::rethrow_exception(p);
    } catch (const dynoff::DriverError& e) {
      PyErr_SetString(driver_error, e.what());
    } catch (const dynoff::PoolExhausted& e) {
      PyErr_SetString(pool_exhausted, e.what());
    }
  });

  py::class_<RangeHandle, std::shared_ptr<RangeHandle>>(m, "Range", py::buffer_protocol())
      .def_property_readonly("id", &RangeHandle::id)
      .def_property_readonly("ptr", &RangeHandle::ptr)
      .def_property_readonly("num_pages", &RangeHandle::num_pages)
      .def_property_readonly("nbytes", &RangeHandle::nbytes)
      .def("mapping", &RangeHandle::mapping,
           "Pool page id behind each page of the range (ZERO_PAGE where unmapped).")
      .def_buffer([](RangeHandle& r) -> py::buffer_info {
        if (r.arena()->driver().name() != "host") {
          throw std::invalid_argument("only host ranges expose a CPU buffer");
        }
        return py::buffer_info(reinterpret_cast<void*>(r.ptr()), 1, "B", 1,
                               {static_cast<py::ssize_t>(r.nbytes())}, {1}, false);
      });

  py::class_<Arena, std::shared_ptr<Arena>>(m, "Arena")
      .def(py::init(&make_arena), py::arg("backend"), py::arg("device") = 0,
           py::arg("page_size") = 0, py::arg("coalesce") = true)
      .def_property_readonly("backend", [](const Arena& a) { return a.driver().name(); })
      .def_property_readonly("device", [](const Arena& a) { return a.driver().device(); })
      .def_property_readonly("page_size", &Arena::page_size)
      .def_property("coalesce", &Arena::coalesce, &Arena::set_coalesce)
      .def_property("trace", &Arena::trace, &Arena::set_trace)
      .def("create_pages", &Arena::create_pages, py::arg("count"),
           py::call_guard<py::gil_scoped_release>())
      .def("trim_pages", &Arena::trim_pages, py::arg("count"))
      .def("allocate_pages", &Arena::allocate_pages, py::arg("count"))
      .def("free_pages", &Arena::free_pages, py::arg("pages"))
      .def_property_readonly("num_pages", &Arena::num_pages)
      .def_property_readonly("num_free_pages", &Arena::num_free_pages)
      .def("map_count", &Arena::map_count, py::arg("page"))
      .def_property_readonly("num_ranges", &Arena::num_ranges)
      .def(
          "reserve",
          [](const std::shared_ptr<Arena>& self, std::size_t num_pages) {
            std::int64_t id = 0;
            {
              py::gil_scoped_release release;
              id = self->reserve(num_pages);
            }
            return std::make_shared<RangeHandle>(self, id);
          },
          py::arg("num_pages"))
      .def(
          "apply",
          [](Arena& self, const std::vector<std::tuple<std::shared_ptr<RangeHandle>, std::int64_t,
                                                       std::int64_t>>& ops,
             bool synchronize) {
            std::vector<dynoff::MapOp> batch;
            batch.reserve(ops.size());
            for (const auto& [range, offset, page] : ops) {
              if (range->arena().get() != &self) {
                throw std::invalid_argument("op on a range of another arena");
              }
              batch.push_back(dynoff::MapOp{range->id(), offset, page});
            }
            py::gil_scoped_release release;
            self.apply(batch, synchronize);
          },
          py::arg("ops"), py::arg("synchronize") = false)
      .def("synchronize", &Arena::synchronize, py::call_guard<py::gil_scoped_release>())
      .def("stats", [](const Arena& a) { return stats_dict(a.stats()); })
      .def("reset_stats", &Arena::reset_stats)
      .def("_inject_failure", &Arena::inject_failure, py::arg("after"), py::arg("count") = 1);
}
