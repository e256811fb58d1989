// Python bindings of the share ledger (csrc/ledger/ledger.h): kvasync._core.Ledger*, ShareMember.
//
// Every call that takes the ledger lock releases the GIL first (it waits, with a deadline).
// `group` is LedgerAccess::group (Note [Ledger access]): a gid, or -1 for a file of this user's.
#include <pybind11/pybind11.h>
#include <pybind11/stl.h>

#include "ledger/ledger.h"

namespace py = pybind11;
using namespace kvasync;

namespace {

// Text another process wrote: decoded with U+FFFD for bytes that are not UTF-8, so that one bad
// name (an older writer cut it mid-character, or a corrupt byte) cannot break a snapshot.
py::str lenient_text(const std::string& text) {
  PyObject* decoded =
      PyUnicode_DecodeUTF8(text.data(), static_cast<Py_ssize_t>(text.size()), "replace");
  if (decoded == nullptr) throw py::error_already_set();
  return py::reinterpret_steal<py::str>(decoded);
}

py::dict entry_dict(const EntryView& v) {
  py::dict d;
  d["slot"] = v.slot;
  d["pid"] = v.pid;
  d["serial"] = v.serial;
  d["name"] = lenient_text(v.name);
  d["committed_bytes"] = v.committed_bytes;
  d["mapped_bytes"] = v.mapped_bytes;
  d["reserved_bytes"] = v.reserved_bytes;
  d["used_bytes"] = v.used_bytes;
  d["limit_bytes"] = v.limit_bytes;
  d["page_bytes"] = v.page_bytes;
  d["budget_bytes"] = v.budget_bytes;
  d["waiters"] = v.waiters;
  d["blocked"] = v.blocked;
  d["requested_limit"] = v.requested_limit;
  d["demand_bytes"] = v.demand_bytes;
  d["capacity_bytes"] = v.capacity_bytes;
  d["op"] = lenient_text(v.op);
  d["op_age_s"] = v.op_age_s;
  d["pid_namespace"] = v.pid_ns;
  d["foreign"] = v.foreign;
  d["heartbeat_age_s"] = v.heartbeat_age_s;
  return d;
}

}  // namespace

void bind_ledger(py::module_& m) {
  py::class_<ShareMember, std::shared_ptr<ShareMember>>(m, "ShareMember")
      .def(py::init([](const std::string& path, const std::string& name, int64_t budget_bytes,
                       int64_t page_bytes, int64_t group) {
             py::gil_scoped_release release;
             return std::make_shared<ShareMember>(Ledger::open(path, true, LedgerAccess{group}),
                                                  name, budget_bytes, page_bytes);
           }),
           py::arg("path"), py::arg("name"), py::arg("budget_bytes"), py::arg("page_bytes"),
           py::arg("group") = -1)
      .def_property_readonly("owns_entry", &ShareMember::owns_entry)
      .def("leave_for_test", [](ShareMember& member) {
        py::gil_scoped_release release;
        member.stop(1.0);
      });

  m.def("ledger_snapshot",
        [](const std::string& path, double timeout_s, int64_t group) {
          std::vector<EntryView> views;
          {
            py::gil_scoped_release release;
            views = Ledger::open(path, false, LedgerAccess{group})->snapshot(timeout_s);
          }
          py::list out;
          for (const EntryView& v : views) out.append(entry_dict(v));
          return out;
        },
        py::arg("path"), py::arg("timeout_s"), py::arg("group") = -1);

  m.def("ledger_set_limit",
        [](const std::string& path, int32_t pid, int64_t bytes, double timeout_s, int64_t group) {
          py::gil_scoped_release release;
          return Ledger::open(path, false, LedgerAccess{group})->set_limit(pid, bytes, timeout_s);
        },
        py::arg("path"), py::arg("pid"), py::arg("bytes"), py::arg("timeout_s"),
        py::arg("group") = -1);

  m.def("ledger_prune",
        [](const std::string& path, double timeout_s, int64_t group) {
          py::gil_scoped_release release;
          return Ledger::open(path, false, LedgerAccess{group})->prune(timeout_s);
        },
        py::arg("path"), py::arg("timeout_s"), py::arg("group") = -1);

  // Note [Fair share under pressure]: the water-filling the members apply, for tests and tools.
  m.def("share_fair_shares", &share_fair_shares, py::arg("demands"), py::arg("budget"));

  m.def("ledger_hold_lock_for_test",
        [](const std::string& path, double seconds, int64_t group) {
          py::gil_scoped_release release;
          return Ledger::open(path, false, LedgerAccess{group})->hold_lock_for(seconds);
        },
        py::arg("path"), py::arg("seconds"), py::arg("group") = -1);
}
