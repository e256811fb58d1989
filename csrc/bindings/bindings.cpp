// Python bindings of the C++ core: kvasync._core (stub: kvasync/_core.pyi).
//
// Every binding that can wait releases the GIL (close). The others hold the pool's mutex for
// bookkeeping only. lock order: GIL -> PagePool::mutex_. Errors cross as kvasync._errors classes.
#include <pybind11/pybind11.h>
#include <pybind11/stl.h>
#include <pybind11/numpy.h>

#include <chrono>
#include <thread>

#include "common/errors.h"
#include "backends/fault_backend.h"
#include "backends/host_backend.h"
#include "pool/limit_policy.h"
#include "pool/page_pool.h"

namespace py = pybind11;
using namespace kvasync;

void bind_cuda(py::module_& m);  // bind_cuda.cpp
void bind_ledger(py::module_& m);  // bind_ledger.cpp
void bind_group(py::module_& m);  // bind_group.cpp

namespace {

// The Python-facing owner of a pool: closing on destruction keeps a forgotten allocator from
// leaving its mapper thread running.
class PoolHandle {
 public:
  explicit PoolHandle(std::shared_ptr<PagePool> pool) : pool_(std::move(pool)) {}
  ~PoolHandle() {
    py::gil_scoped_release release;
    pool_->close(1.0);
  }
  PagePool& operator*() { return *pool_; }
  PagePool* operator->() { return pool_.get(); }

 private:
  std::shared_ptr<PagePool> pool_;
};

py::list to_list(const std::vector<int64_t>& blocks) {
  py::list out(blocks.size());
  for (size_t i = 0; i < blocks.size(); ++i) {
    out[i] = py::reinterpret_steal<py::object>(PyLong_FromLongLong(blocks[i]));
  }
  return out;
}

// Block ids from a Python list of ints (the hot path: read directly) or any sequence of
// integers (tuple, 1-D tensor, numpy array): a clear TypeError/ValueError otherwise.
std::vector<int64_t> to_block_ids(py::handle blocks) {
  PyObject* list = blocks.ptr();
  if (PyList_CheckExact(list)) {
    const Py_ssize_t n = PyList_GET_SIZE(list);
    std::vector<int64_t> out(static_cast<size_t>(n));
    bool exact = true;
    for (Py_ssize_t i = 0; i < n && exact; ++i) {
      PyObject* item = PyList_GET_ITEM(list, i);
      exact = PyLong_CheckExact(item);
      if (exact) out[static_cast<size_t>(i)] = PyLong_AsLongLong(item);
      if (exact && out[static_cast<size_t>(i)] == -1 && PyErr_Occurred()) {
        PyErr_Clear();
        throw py::value_error("free: block id out of range of int64");
      }
    }
    if (exact) return out;
  }
  py::object seq = py::reinterpret_steal<py::object>(
      PySequence_Fast(list, "free: block ids must be a sequence of ints"));
  if (!seq) throw py::error_already_set();
  const Py_ssize_t n = PySequence_Fast_GET_SIZE(seq.ptr());
  std::vector<int64_t> out(static_cast<size_t>(n));
  for (Py_ssize_t i = 0; i < n; ++i) {
    PyObject* item = PySequence_Fast_GET_ITEM(seq.ptr(), i);
    py::object index = py::reinterpret_steal<py::object>(
        PyBool_Check(item) ? nullptr : PyNumber_Index(item));  // True is not block 1
    if (!index) {
      PyErr_Clear();
      throw py::type_error(std::string("free: block ids must be ints, got ") +
                           Py_TYPE(item)->tp_name);
    }
    const long long value = PyLong_AsLongLong(index.ptr());
    if (value == -1 && PyErr_Occurred()) {
      PyErr_Clear();
      throw py::value_error("free: block id out of range of int64");
    }
    out[static_cast<size_t>(i)] = value;
  }
  return out;
}

py::dict stats_dict(const PoolStats& s) {
  py::dict d;
  d["num_blocks"] = s.num_blocks;
  d["used_blocks"] = s.used_blocks;
  d["free_blocks"] = s.free_blocks;
  d["mapped_pages"] = s.mapped_pages;
  d["reserve_pages"] = s.reserve_pages;
  d["mapping_pages"] = s.mapping_pages;
  d["unmapping_pages"] = s.unmapping_pages;
  d["unmapped_pages"] = s.unmapped_pages;
  d["waiters"] = s.waiters;
  d["queued_jobs"] = s.queued_jobs;
  d["mapper_batches"] = s.mapper_batches;
  d["maps_done"] = s.maps_done;
  d["unmaps_done"] = s.unmaps_done;
  d["map_errors"] = s.map_errors;
  d["dropped_jobs"] = s.dropped_jobs;
  d["timeouts"] = s.timeouts;
  d["limit_pages"] = s.limit_pages;
  d["limit_blocks"] = s.limit_blocks;
  d["unusable_blocks"] = s.unusable_blocks;
  d["mapper_op"] = s.mapper_op.empty() ? py::object(py::none()) : py::object(py::str(s.mapper_op));
  d["mapper_op_age_s"] = s.mapper_op_age_s;
  d["last_error"] = s.last_error;
  return d;
}

void register_errors() {
  // Python's own classes, so that `except kvasync.OutOfBlocks` catches what C++ raises.
  // Leaked on purpose: a static py::object would be released after the interpreter is gone.
  static py::handle errors = py::module_::import("kvasync._errors").release();
  py::register_exception_translator([](std::exception_ptr p) {
    try {
      if (p) std::rethrow_exception(p);
    } catch (const OutOfBlocksError& e) {
      PyErr_SetString(errors.attr("OutOfBlocks").ptr(), e.what());
    } catch (const AllocatorClosedError& e) {
      PyErr_SetString(errors.attr("AllocatorClosed").ptr(), e.what());
    } catch (const BackendError& e) {
      PyErr_SetString(errors.attr("KVAsyncError").ptr(), e.what());
    }
  });
}

}  // namespace

PYBIND11_MODULE(_core, m) {
  m.doc() = "kvasync's C++ core: page pool, mapper thread and virtual-memory backends";
  register_errors();
  bind_ledger(m);  // before PagePool, which takes a ShareMember

  py::class_<Backend, std::shared_ptr<Backend>>(m, "Backend")
      .def_property_readonly("name", &Backend::name)
      .def_property_readonly("page_size", &Backend::page_size)
      .def_property_readonly("num_ranges", &Backend::num_ranges)
      .def_property_readonly("num_pages", &Backend::num_pages)
      .def("range_base", &Backend::range_base, py::arg("range"));

  py::class_<HostBackend, Backend, std::shared_ptr<HostBackend>>(m, "HostBackend")
      .def(py::init<int, int64_t, int64_t>(), py::arg("num_ranges"), py::arg("num_pages"),
           py::arg("page_size"));

  py::class_<FaultState, std::shared_ptr<FaultState>>(m, "FaultState")
      .def(py::init<>())
      .def("delay", [](FaultState& f, double s) { f.set_delay(s); },
           py::arg("seconds"))
      .def("hang", [](FaultState& f) { f.hang = true; })
      .def("fail", [](FaultState& f, int64_t count) { f.fail_count = count; }, py::arg("count"))
      .def("release", &FaultState::release)
      .def_property_readonly("hung_maps", [](const FaultState& f) { return f.hung_maps.load(); });

  m.def("with_faults",
        [](std::shared_ptr<Backend> inner, std::shared_ptr<FaultState> faults) -> std::shared_ptr<Backend> {
          return std::make_shared<FaultBackend>(std::move(inner), std::move(faults));
        },
        py::arg("backend"), py::arg("faults"));

  m.def("range_view",
        [](std::shared_ptr<Backend> backend, int range) {
          // A uint8 array over the whole reserved range; the capsule keeps the reservation alive
          // as long as any view of it does.
          auto* keep = new std::shared_ptr<Backend>(backend);
          py::capsule owner(keep, [](void* p) { delete static_cast<std::shared_ptr<Backend>*>(p); });
          int64_t bytes = 0;  // checked: a signed overflow is undefined
          if (__builtin_mul_overflow(backend->num_pages(), backend->page_size(), &bytes)) {
            throw py::value_error("range_view: the range's size overflows 64 bits");
          }
          auto* data = reinterpret_cast<uint8_t*>(backend->range_base(range));
          return py::array_t<uint8_t>({bytes}, {1}, data, owner);
        },
        py::arg("backend"), py::arg("range"));

  py::class_<PoolHandle>(m, "PagePool")
      .def(py::init([](std::shared_ptr<Backend> backend, int64_t num_blocks,
                       int64_t blocks_per_page, int64_t limit_pages, int64_t reserve_low,
                       int64_t reserve_high, double default_timeout_s, int64_t block_bytes,
                       int64_t page_bytes, std::shared_ptr<ShareMember> share, double linger_s) {
             PoolConfig config{num_blocks, blocks_per_page, limit_pages,
                               reserve_low, reserve_high, default_timeout_s};
             config.block_bytes = block_bytes;
             config.page_bytes = page_bytes;
             config.linger_s = linger_s;
             return new PoolHandle(PagePool::create(std::move(backend), config, std::move(share)));
           }),
           py::arg("backend"), py::arg("num_blocks"), py::arg("blocks_per_page"),
           py::arg("limit_pages"), py::arg("reserve_low"), py::arg("reserve_high"),
           py::arg("default_timeout_s"), py::kw_only(), py::arg("block_bytes") = 0,
           py::arg("page_bytes") = 0, py::arg("share") = nullptr, py::arg("linger_s") = 0.0)
      .def("alloc",
           [](PoolHandle& pool, int64_t n, double deadline) -> py::object {
             auto result = pool->alloc(n, deadline);
             if (auto* blocks = std::get_if<std::vector<int64_t>>(&result)) return to_list(*blocks);
             return py::int_(std::get<int64_t>(result));
           },
           py::arg("n"), py::arg("deadline"))
      .def("alloc_nowait",
           [](PoolHandle& pool, int64_t n, bool map_on_miss) -> py::object {
             auto blocks = pool->alloc_nowait(n, map_on_miss);
             if (!blocks) return py::none();
             return to_list(*blocks);
           },
           py::arg("n"), py::arg("map_on_miss") = true)
      .def("available_blocks", [](PoolHandle& pool) { return pool->available_blocks(); })
      .def("set_demand", [](PoolHandle& pool, int64_t blocks) { pool->set_demand(blocks); },
           py::arg("blocks"))
      .def("drain_from_block", [](PoolHandle& pool) { return pool->drain_from_block(); })
      .def("free_blocks_in_order",
           [](PoolHandle& pool, int64_t limit) {
             return to_list(pool->free_blocks_in_order(limit));
           },
           py::arg("limit"))
      .def("take_map_seconds", [](PoolHandle& pool) { return pool->take_map_seconds(); })
      .def("free",
           [](PoolHandle& pool, py::handle blocks, uintptr_t fence) {
             std::vector<int64_t> ids;
             try {
               ids = to_block_ids(blocks);
             } catch (...) {
               if (fence != 0) pool->discard_fence(fence);  // the pool owns it from here on
               throw;
             }
             pool->free(ids, fence);
           },
           py::arg("blocks"), py::arg("fence") = 0)
      .def("cancel",
           [](PoolHandle& pool, int64_t id, bool timed_out) { return pool->cancel(id, timed_out); },
           py::arg("request_id"), py::arg("timed_out"))
      .def("drain",
           [](PoolHandle& pool) {
             std::vector<Completion> records = pool->drain();
             py::list out(records.size());
             for (size_t i = 0; i < records.size(); ++i) {
               Completion& c = records[i];
               out[i] = py::make_tuple(c.request_id, static_cast<int>(c.status), to_list(c.blocks),
                                       c.message);
             }
             return out;
           })
      .def("take_completion",
           [](PoolHandle& pool, int64_t request_id, double max_spin_s) -> py::object {
             std::optional<Completion> record;
             {
               py::gil_scoped_release no_gil;
               record = pool->take_completion(request_id, max_spin_s);
             }
             if (!record) return py::none();
             return py::make_tuple(static_cast<int>(record->status), to_list(record->blocks),
                                   record->message);
           },
           py::arg("request_id"), py::arg("max_spin_s"))
      .def_property_readonly("completion_fd", [](PoolHandle& pool) { return pool->completion_fd(); })
      .def("trim",
           [](PoolHandle& pool, double deadline, bool release_cached) {
             return pool->trim(deadline, release_cached);
           },
           py::arg("deadline"), py::arg("release_cached") = true)
      .def("set_limit_pages",
           [](PoolHandle& pool, int64_t pages, double deadline) {
             return pool->set_limit_pages(pages, deadline);
           },
           py::arg("limit_pages"), py::arg("deadline"))
      .def("close", [](PoolHandle& pool, double timeout) { return pool->close(timeout); },
           py::arg("timeout"), py::call_guard<py::gil_scoped_release>())
      .def("stats", [](PoolHandle& pool) { return stats_dict(pool->stats()); })
      .def("unallocated",
           [](PoolHandle& pool, const std::vector<int64_t>& blocks) {
             std::vector<int64_t> out;
             for (int64_t b : blocks) {
               if (!pool->is_allocated(b)) out.push_back(b);
             }
             return out;
           },
           py::arg("blocks"));

  // Note [Limit policy]: the limits a pool's policy puts in force for a sequence of share ticks
  // (seconds from a fixed start, pressure, fair share, guaranteed minimum, equal share; pages),
  // so tests can check the policy's bounds on a clock of their own.
  m.def("limit_policy_trace",
        [](int64_t limit_pages,
           const std::vector<std::tuple<double, bool, int64_t, int64_t, int64_t>>& ticks) {
          LimitPolicy policy(limit_pages, 0, 0);
          const auto start = LimitPolicy::Clock::time_point{} + std::chrono::hours(1);
          std::vector<int64_t> limits;
          for (const auto& [at_s, pressure, fair, guaranteed, equal] : ticks) {
            const auto now = start + std::chrono::duration_cast<LimitPolicy::Clock::duration>(
                                         std::chrono::duration<double>(at_s));
            policy.set_share(pressure, fair, guaranteed, equal, now);
            limits.push_back(policy.limit());
          }
          return limits;
        },
        py::arg("limit_pages"), py::arg("ticks"));

  // Note [Demand claims]: whether a pool's claim counts after each of a sequence of events
  // (seconds from a fixed start; "claim": a report above what the pool holds and waits for,
  // "report": one that is not, "request": a request that needs pages, "check": none).
  m.attr("CLAIM_HOLD_S") = std::chrono::duration<double>(DemandClaim::kClaimHold).count();
  m.def("demand_claim_trace",
        [](const std::vector<std::tuple<double, std::string>>& events) {
          DemandClaim claim;
          const auto start = DemandClaim::Clock::time_point{} + std::chrono::hours(1);
          std::vector<bool> counts;
          for (const auto& [at_s, event] : events) {
            const auto now = start + std::chrono::duration_cast<DemandClaim::Clock::duration>(
                                         std::chrono::duration<double>(at_s));
            if (event == "claim" || event == "report") {
              claim.reported(event == "claim", now);
            } else if (event == "request") {
              claim.requested(now);
            } else if (event != "check") {
              throw std::invalid_argument("demand_claim_trace: unknown event " + event +
                                          " (claim, report, request or check)");
            }
            counts.push_back(claim.counts(now));
          }
          return counts;
        },
        py::arg("events"));

  m.def("spin_holding_gil",
        [](PoolHandle& pool, int64_t reserve_pages, double timeout_s) {
          // For tests: busy-waits *without* releasing the GIL until the reserve holds
          // `reserve_pages` pages or the timeout passes. Proves the mapper needs no GIL.
          const auto give_up = std::chrono::steady_clock::now() +
                               std::chrono::duration<double>(timeout_s);
          while (std::chrono::steady_clock::now() < give_up) {
            if (pool->stats().reserve_pages >= reserve_pages) return true;
            std::this_thread::yield();
          }
          return false;
        },
        py::arg("pool"), py::arg("reserve_pages"), py::arg("timeout_s"));

  bind_cuda(m);  // after Backend: CudaBackend derives from it
  bind_group(m);  // after Backend: GroupBackend derives from it
}
