// Python bindings of tensor-parallel groups (csrc/group/): kvasync._core.SchedulerGroup,
// GroupBackend, RankMapper. Python face: kvasync/_group.py.
//
// Every call that waits (a rank's join, wait_ready, wait_left, close) releases the GIL: the
// waits are on other processes, which may need nothing from us but must never wait on our GIL.
#include <pybind11/pybind11.h>
#include <pybind11/stl.h>

#include "group/group_backend.h"
#include "group/rank_mapper.h"

namespace py = pybind11;
using namespace kvasync;

namespace {

// The Python-facing owner of a rank's mapper: a forgotten one closes (bounded) when collected,
// so that its thread does not keep mapping for a scheduler nobody serves.
class RankMapperHandle {
 public:
  explicit RankMapperHandle(std::shared_ptr<RankMapper> mapper) : mapper_(std::move(mapper)) {}
  ~RankMapperHandle() {
    py::gil_scoped_release release;
    mapper_->close(1.0);
  }
  RankMapper& operator*() { return *mapper_; }
  RankMapper* operator->() { return mapper_.get(); }

 private:
  std::shared_ptr<RankMapper> mapper_;
};

}  // namespace

void bind_group(py::module_& m) {
  py::class_<SchedulerGroup, std::shared_ptr<SchedulerGroup>>(m, "SchedulerGroup")
      .def(py::init(&SchedulerGroup::create), py::arg("path"), py::arg("name"),
           py::arg("num_ranks"), py::arg("num_ranges"), py::arg("num_pages"),
           py::arg("page_size"))
      .def("wait_ready", &SchedulerGroup::wait_ready, py::arg("timeout"),
           py::call_guard<py::gil_scoped_release>())
      .def("close", &SchedulerGroup::close, py::call_guard<py::gil_scoped_release>())
      .def_property_readonly("closed", &SchedulerGroup::closed)
      .def_property_readonly("name", &SchedulerGroup::name)
      .def_property_readonly("path", &SchedulerGroup::path)
      .def_property_readonly("num_ranks", &SchedulerGroup::num_ranks)
      .def_property_readonly("broken", &SchedulerGroup::broken)
      .def("ranks", [](const SchedulerGroup& group) {
        std::vector<SchedulerGroup::RankView> views;
        {
          py::gil_scoped_release no_gil;  // reads /proc for each rank
          views = group.ranks();
        }
        py::list out;
        for (const auto& v : views) {
          py::dict d;
          d["rank"] = v.rank;
          d["state"] = v.state;
          d["pid"] = v.pid;
          d["mapped_pages"] = v.mapped_pages;
          d["jobs_posted"] = v.jobs_posted;
          d["jobs_done"] = v.jobs_done;
          // Text another process wrote: bytes that are not UTF-8 read as U+FFFD.
          PyObject* note = PyUnicode_DecodeUTF8(v.note.data(),
                                                static_cast<Py_ssize_t>(v.note.size()), "replace");
          if (note == nullptr) throw py::error_already_set();
          d["note"] = py::reinterpret_steal<py::str>(note);
          out.append(d);
        }
        return out;
      });

  py::class_<GroupBackend, Backend, std::shared_ptr<GroupBackend>>(m, "GroupBackend")
      .def(py::init<std::shared_ptr<Backend>, std::shared_ptr<SchedulerGroup>, double, double,
                    bool>(),
           py::arg("local"), py::arg("group"), py::arg("map_timeout"), py::arg("unmap_timeout"),
           py::arg("map_local") = true)
      .def_property_readonly("group", &GroupBackend::group);

  m.def("read_group_geometry",
        [](const std::string& path, const std::string& name, double timeout) {
          GroupGeometry g;
          {
            py::gil_scoped_release no_gil;
            g = read_group_geometry(path, name, timeout);
          }
          py::dict d;
          d["num_ranks"] = g.num_ranks;
          d["num_ranges"] = g.num_ranges;
          d["num_pages"] = g.num_pages;
          d["page_size"] = g.page_size;
          return d;
        },
        py::arg("path"), py::arg("name"), py::arg("timeout"));

  py::class_<RankMapperHandle>(m, "RankMapper")
      .def(py::init([](const std::string& path, const std::string& name, int rank,
                       std::shared_ptr<Backend> backend, double timeout) {
             std::shared_ptr<RankMapper> mapper;
             {
               py::gil_scoped_release no_gil;
               mapper = RankMapper::join(path, name, rank, std::move(backend), timeout);
             }
             return new RankMapperHandle(std::move(mapper));
           }),
           py::arg("path"), py::arg("name"), py::arg("rank"), py::arg("backend"),
           py::arg("timeout"))
      .def("close", [](RankMapperHandle& h, double timeout) { return h->close(timeout); },
           py::arg("timeout"), py::call_guard<py::gil_scoped_release>())
      .def("wait_left", [](RankMapperHandle& h, double timeout) { return h->wait_left(timeout); },
           py::arg("timeout"), py::call_guard<py::gil_scoped_release>())
      .def_property_readonly("left", [](RankMapperHandle& h) { return h->left(); })
      .def_property_readonly("left_reason", [](RankMapperHandle& h) { return h->left_reason(); })
      .def_property_readonly("rank", [](RankMapperHandle& h) { return h->rank(); })
      .def_property_readonly("mapped_pages", [](RankMapperHandle& h) { return h->mapped_pages(); })
      .def_property_readonly("jobs_done", [](RankMapperHandle& h) { return h->jobs_done(); })
      .def("mapped_page_ids", [](RankMapperHandle& h) { return h->mapped_page_ids(); })
      .def("committed_page_ids", [](RankMapperHandle& h) { return h->committed_page_ids(); });
}
