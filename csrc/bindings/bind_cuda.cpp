// Python bindings of the CUDA backend (part of kvasync._core; stub: kvasync/_core.pyi).
//
// Nothing here needs a driver to import: every entry point checks for one and raises
// KVAsyncError ("no CUDA driver found ...") through the BackendError translator.
// Bindings that call the driver for long (benchmarks, map/unmap timing) release the GIL.
#include <pybind11/pybind11.h>
#include <pybind11/stl.h>

#include <algorithm>
#include <chrono>
#include <memory>
#include <optional>
#include <string>
#include <thread>
#include <vector>

#include "backends/cuda_backend.h"
#include "backends/cuda_device_sync.h"
#include "common/errors.h"
#include "common/trace.h"

namespace py = pybind11;
using namespace kvasync;
using namespace kvasync::cuda;

namespace {

// ---- DLPack (the ABI of dlpack.h v0.8, declared here so no header is needed) ----
struct DLDevice {
  int32_t device_type;  // kDLCUDA = 2
  int32_t device_id;
};
struct DLDataType {
  uint8_t code;  // kDLUInt = 1
  uint8_t bits;
  uint16_t lanes;
};
struct DLTensor {
  void* data;
  DLDevice device;
  int32_t ndim;
  DLDataType dtype;
  int64_t* shape;
  int64_t* strides;
  uint64_t byte_offset;
};
struct DLManagedTensor {
  DLTensor dl_tensor;
  void* manager_ctx;
  void (*deleter)(DLManagedTensor*);
};

// Owns what a DLPack view of a range needs: the backend (so the reservation outlives every view)
// and the shape. The deleter may run on any thread, without the GIL: it touches no Python object.
struct RangeView {
  DLManagedTensor managed{};
  std::shared_ptr<Backend> backend;
  int64_t shape[1];
};

void delete_range_view(DLManagedTensor* managed) {
  delete static_cast<RangeView*>(managed->manager_ctx);
}

int cuda_device_of(const Backend& backend) {
  if (std::string(backend.name()) != "cuda") return -1;
  return CudaBackend::device_of_range(backend.range_base(0));
}

py::capsule range_dlpack(std::shared_ptr<Backend> backend, int range) {
  const int device = cuda_device_of(*backend);
  if (device < 0) throw std::invalid_argument("range_dlpack: not a live cuda backend");
  auto* view = new RangeView();
  view->backend = std::move(backend);
  view->shape[0] = view->backend->num_pages() * view->backend->page_size();
  DLTensor& t = view->managed.dl_tensor;
  t.data = reinterpret_cast<void*>(view->backend->range_base(range));
  t.device = {2, device};
  t.ndim = 1;
  t.dtype = {1, 8, 1};
  t.shape = view->shape;
  t.strides = nullptr;
  t.byte_offset = 0;
  view->managed.manager_ctx = view;
  view->managed.deleter = delete_range_view;
  // A consumer renames the capsule to "used_dltensor" and owns it then; otherwise free it here.
  return py::capsule(&view->managed, "dltensor", [](PyObject* capsule) {
    if (PyCapsule_IsValid(capsule, "dltensor")) {
      auto* managed = static_cast<DLManagedTensor*>(PyCapsule_GetPointer(capsule, "dltensor"));
      managed->deleter(managed);
    }
  });
}

double median(std::vector<double> values) {
  std::sort(values.begin(), values.end());
  return values[values.size() / 2];
}

void check(const CudaDriver& driver, CUresult result, const char* what) {
  if (result != CUDA_SUCCESS) throw BackendError(driver.failure(result, what));
}

// The driver's floor for the benchmark (bench/bench_map.py): the bare calls, batched the way
// CudaBackend batches them (map each page, one cuMemSetAccess per run, one cuMemUnmap per run
// when `run_unmap`), timed the same way (steady_clock around the batch). Per page, medians.
py::dict driver_floor(int device, int64_t page_size, int64_t pages, int repeats, bool run_unmap,
                      int64_t reserve_pages) {
  const CudaDriver& driver = CudaDriver::get();
  if (!driver.ok()) throw BackendError(driver.problem);
  std::vector<double> cold, warm, unmap, release;
  {
    py::gil_scoped_release no_gil;
    PrimaryContext context(device);
    ScopedContext current(context);
    const size_t page = static_cast<size_t>(page_size);
    const size_t bytes = page * static_cast<size_t>(pages);
    const int64_t granularity = CudaBackend::device_granularity(device);
    // `reserve_pages` > pages: a reservation as large as an allocator's (does its size matter?)
    AddressReservation range(page * static_cast<size_t>(std::max(pages, reserve_pages)),
                             static_cast<size_t>(granularity));
    CUmemAllocationProp prop{};
    prop.type = CU_MEM_ALLOCATION_TYPE_PINNED;
    prop.location = {CU_MEM_LOCATION_TYPE_DEVICE, device};
    CUmemAccessDesc access{prop.location, CU_MEM_ACCESS_FLAGS_PROT_READWRITE};
    std::vector<CUmemGenericAllocationHandle> handles(pages);
    using clock = std::chrono::steady_clock;
    auto seconds = [](clock::time_point a, clock::time_point b) {
      return std::chrono::duration<double>(b - a).count();
    };
    auto map_all = [&] {
      for (int64_t i = 0; i < pages; ++i) {
        check(driver, driver.cuMemMap(range.base() + i * page, page, 0, handles[i], 0), "cuMemMap");
      }
      check(driver, driver.cuMemSetAccess(range.base(), bytes, &access, 1), "cuMemSetAccess");
    };
    auto unmap_all = [&] {
      if (run_unmap) {
        check(driver, driver.cuMemUnmap(range.base(), bytes), "cuMemUnmap");
      } else {
        for (int64_t i = 0; i < pages; ++i) {
          check(driver, driver.cuMemUnmap(range.base() + i * page, page), "cuMemUnmap");
        }
      }
    };
    for (int rep = 0; rep < repeats; ++rep) {
      auto t0 = clock::now();
      for (int64_t i = 0; i < pages; ++i) {
        check(driver, driver.cuMemCreate(&handles[i], page, &prop, 0), "cuMemCreate");
      }
      map_all();
      auto t1 = clock::now();
      unmap_all();
      auto t2 = clock::now();
      map_all();  // from already-created handles: the handle pool's floor
      auto t3 = clock::now();
      unmap_all();
      auto t4 = clock::now();
      for (int64_t i = 0; i < pages; ++i) check(driver, driver.cuMemRelease(handles[i]), "cuMemRelease");
      auto t5 = clock::now();
      cold.push_back(seconds(t0, t1) / pages);
      warm.push_back(seconds(t2, t3) / pages);
      unmap.push_back((seconds(t1, t2) + seconds(t3, t4)) / (2 * pages));
      release.push_back(seconds(t4, t5) / pages);
    }
  }
  py::dict out;
  out["cold_map"] = median(cold);
  out["pool_map"] = median(warm);
  out["unmap"] = median(unmap);
  out["release"] = median(release);
  return out;
}

// The driver's floor of one page id of the per-layer layout: one handle of `handle_bytes` in
// each of `num_ranges` ranges (each its own reservation, as CudaBackend reserves them), created,
// mapped and given access range by range, as CudaBackend::map does. With `threads` > 1 the ranges
// are split between that many threads, each making its own driver calls (does concurrency pay?).
// Medians of wall-clock seconds per page id: cold (create + map + access), warm (map + access of
// existing handles), unmap.
py::dict driver_floor_ranges(int device, int64_t handle_bytes, int num_ranges, int repeats,
                             int threads, bool creates_first, int64_t reserve_handles) {
  const CudaDriver& driver = CudaDriver::get();
  if (!driver.ok()) throw BackendError(driver.problem);
  if (num_ranges <= 0 || threads <= 0 || repeats <= 0) throw std::invalid_argument("bad sizes");
  std::vector<double> cold, warm, unmap, release;
  {
    py::gil_scoped_release no_gil;
    PrimaryContext context(device);
    ScopedContext current(context);
    const size_t bytes = static_cast<size_t>(handle_bytes);
    const int64_t granularity = CudaBackend::device_granularity(device);
    std::vector<std::unique_ptr<AddressReservation>> ranges;
    for (int r = 0; r < num_ranges; ++r) {
      ranges.push_back(std::make_unique<AddressReservation>(
          bytes * static_cast<size_t>(std::max<int64_t>(1, reserve_handles)),
          static_cast<size_t>(granularity)));
    }
    CUmemAllocationProp prop{};
    prop.type = CU_MEM_ALLOCATION_TYPE_PINNED;
    prop.location = {CU_MEM_LOCATION_TYPE_DEVICE, device};
    CUmemAccessDesc access{prop.location, CU_MEM_ACCESS_FLAGS_PROT_READWRITE};
    std::vector<CUmemGenericAllocationHandle> handles(num_ranges);
    // Runs `step(r)` for every range, split between the threads; returns wall-clock seconds.
    auto across = [&](auto step) {
      const auto start = std::chrono::steady_clock::now();
      if (threads == 1) {
        for (int r = 0; r < num_ranges; ++r) step(r);
      } else {
        std::vector<std::thread> workers;
        for (int t = 0; t < threads; ++t) {
          workers.emplace_back([&, t] {
            context.make_current();
            for (int r = t; r < num_ranges; r += threads) step(r);
          });
        }
        for (auto& worker : workers) worker.join();
      }
      return std::chrono::duration<double>(std::chrono::steady_clock::now() - start).count();
    };
    auto map_one = [&](int r) {
      check(driver, driver.cuMemMap(ranges[r]->base(), bytes, 0, handles[r], 0), "cuMemMap");
      check(driver, driver.cuMemSetAccess(ranges[r]->base(), bytes, &access, 1), "cuMemSetAccess");
    };
    auto unmap_one = [&](int r) {
      check(driver, driver.cuMemUnmap(ranges[r]->base(), bytes), "cuMemUnmap");
    };
    for (int rep = 0; rep < repeats; ++rep) {
      if (creates_first) {  // as CudaBackend::map does: every handle, then range by range
        cold.push_back(across([&](int r) {
          check(driver, driver.cuMemCreate(&handles[r], bytes, &prop, 0), "cuMemCreate");
        }) + across(map_one));
      } else {
        cold.push_back(across([&](int r) {
          check(driver, driver.cuMemCreate(&handles[r], bytes, &prop, 0), "cuMemCreate");
          map_one(r);
        }));
      }
      const double unmap_a = across(unmap_one);
      warm.push_back(across(map_one));
      unmap.push_back((unmap_a + across(unmap_one)) / 2);
      const auto start = std::chrono::steady_clock::now();
      for (int r = 0; r < num_ranges; ++r) check(driver, driver.cuMemRelease(handles[r]), "cuMemRelease");
      release.push_back(
          std::chrono::duration<double>(std::chrono::steady_clock::now() - start).count());
    }
  }
  py::dict out;
  out["cold_map"] = median(cold);
  out["pool_map"] = median(warm);
  out["unmap"] = median(unmap);
  out["release"] = median(release);
  return out;
}

double timed(Backend& backend, bool map, int64_t first, int64_t count) {
  BackendResult result;
  double seconds;
  {
    py::gil_scoped_release no_gil;
    const auto start = std::chrono::steady_clock::now();
    result = map ? backend.map(first, count) : backend.unmap(first, count);
    seconds = std::chrono::duration<double>(std::chrono::steady_clock::now() - start).count();
  }
  if (!result.ok) throw BackendError(result.error);
  return seconds;
}

}  // namespace

void bind_cuda(py::module_& m) {
  py::class_<CudaBackend, Backend, std::shared_ptr<CudaBackend>>(m, "CudaBackend")
      .def(py::init<int, int, int64_t, int64_t, int64_t, double>(), py::arg("device"),
           py::arg("num_ranges"), py::arg("num_pages"), py::arg("page_size"),
           py::arg("spare_pages"), py::arg("gpu_utilization"),
           py::call_guard<py::gil_scoped_release>())
      .def_property_readonly("device", &CudaBackend::device)
      .def_property_readonly("granularity", &CudaBackend::granularity)
      .def("release_spare", &CudaBackend::release_spare, py::call_guard<py::gil_scoped_release>())
      .def_property("sync_before_unmap", &CudaBackend::sync_before_unmap,
                    &CudaBackend::set_sync_before_unmap)
      .def_property(
          "unmap_sync_timeout", &CudaBackend::unmap_sync_timeout,
          [](CudaBackend& backend, double seconds) {
            // A deadline of now + seconds must fit steady_clock's nanoseconds (Note [Bounded
            // device sync]): a day is far past any GPU step.
            if (!(seconds > 0.0 && seconds <= 86400.0)) {
              throw py::value_error("unmap_sync_timeout must be in (0, 86400] seconds, got " +
                                    std::to_string(seconds));
            }
            backend.set_unmap_sync_timeout(seconds);
          },
          "seconds an unmap waits for this process's device work when sync_before_unmap is set")
      .def("settle", &CudaBackend::settle, py::arg("timeout_s"),
           py::call_guard<py::gil_scoped_release>())
      .def("handle_stats", [](const CudaBackend& backend) {
        const HandlePoolStats s = backend.handle_stats();
        py::dict d;
        d["spare_pages"] = s.spare_pages;
        d["spare_capacity"] = s.spare_capacity;
        d["created"] = s.created;
        d["released"] = s.released;
        d["taken_from_pool"] = s.taken_from_pool;
        d["created_on_map"] = s.created_on_map;
        d["memory_info_reads"] = s.memory_info_reads;
        d["offset_mapping"] = s.offset_mapping;
        d["run_unmap"] = s.run_unmap;
        return d;
      });

  m.def("cuda_problem",
        [](int device) -> std::optional<std::string> {
          std::string problem = device_problem(device);
          if (problem.empty()) return std::nullopt;
          return problem;
        },
        py::arg("device"), "Why the cuda backend cannot be used on `device`, or None.");
  m.def("cuda_granularity", &CudaBackend::device_granularity, py::arg("device"));
  // Note [Graph capture beside the mapper]: the gate that keeps device syncs out of a capture.
  m.def("cuda_graph_capture_begin",
        [](double timeout_s) {
          if (!(timeout_s > 0.0 && timeout_s <= 86400.0)) {
            throw py::value_error("timeout_s must be in (0, 86400] seconds, got " +
                                  std::to_string(timeout_s));
          }
          py::gil_scoped_release no_gil;
          const auto deadline = std::chrono::steady_clock::now() +
                                std::chrono::duration_cast<std::chrono::steady_clock::duration>(
                                    std::chrono::duration<double>(timeout_s));
          return begin_graph_capture(deadline);
        },
        py::arg("timeout_s"),
        "Close the sync gate for a CUDA graph capture; False if a device sync was still running "
        "at the timeout (the gate is then left open).");
  m.def("cuda_graph_capture_end", &end_graph_capture, "Open the sync gate after a capture.");
  m.def("cuda_graph_captures", &graph_captures_in_progress,
        "How many graph captures the sync gate is closed for now.");
  m.def("cuda_device_of",
        [](const std::shared_ptr<Backend>& backend) -> std::optional<int> {
          const int device = cuda_device_of(*backend);
          if (device < 0) return std::nullopt;
          return device;
        },
        py::arg("backend"));
  m.def("cuda_record_fence", &CudaBackend::record_fence, py::arg("device"), py::arg("stream"),
        py::arg("after_event"));
  m.def("cuda_range_dlpack", &range_dlpack, py::arg("backend"), py::arg("range"));
  m.def("cuda_driver_floor", &driver_floor, py::arg("device"), py::arg("page_size"),
        py::arg("pages"), py::arg("repeats"), py::arg("run_unmap"), py::arg("reserve_pages") = 0);
  m.def("cuda_driver_floor_ranges", &driver_floor_ranges, py::arg("device"),
        py::arg("handle_bytes"), py::arg("num_ranges"), py::arg("repeats"), py::arg("threads"),
        py::arg("creates_first") = false, py::arg("reserve_handles") = 1);
  m.def("trace_points", [] {
    py::dict out;
    for (int p = 0; p < trace::kNumPoints; ++p) {
      out[trace::kNames[p]] = trace::points[p].load(std::memory_order_relaxed);
    }
    return out;
  }, "The CLOCK_MONOTONIC nanoseconds at which the latest request passed each point (trace.h).");
  m.def("backend_time_map",
        [](const std::shared_ptr<Backend>& b, int64_t first, int64_t count) {
          return timed(*b, true, first, count);
        },
        py::arg("backend"), py::arg("first"), py::arg("count"));
  m.def("backend_time_unmap",
        [](const std::shared_ptr<Backend>& b, int64_t first, int64_t count) {
          return timed(*b, false, first, count);
        },
        py::arg("backend"), py::arg("first"), py::arg("count"));
}
