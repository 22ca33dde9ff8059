// Status -> exception translation. The classes live in pure Python (shardsync/errors.py) so the
// hierarchy is importable and documented without the native module. Messages keep the C++ text
// with CLI flags reworded as Python arguments (wording.cc).
#include "common.h"

namespace shardsync::py_bind {

void RegisterErrors(py::module_& m) {
  py::register_exception_translator([](std::exception_ptr p) {
    try {
      if (p) std::rethrow_exception(p);
    } catch (const StatusException& e) {
      py::object cls;
      try {
        cls = py::module_::import("shardsync.errors")
                  .attr("error_for_code")(static_cast<int>(e.status.code()));
      } catch (py::error_already_set& imp) {
        // The package is not importable (module used standalone): keep the message.
        PyErr_SetString(PyExc_RuntimeError, e.status.ToString().c_str());
        return;
      }
      PyErr_SetObject(cls.ptr(), py::str(PythonWording(e.status.message(), e.wording)).ptr());
    }
  });
  // Raises the exception of a status code with `message`: lets tests check the mapping of every
  // code end to end through the translator.
  m.def(
      "_raise_status",
      [](int code, const std::string& message) {
        if (code <= 0 || code > static_cast<int>(StatusCode::kOutOfRange)) {
          ThrowIfError(
              InvalidArgumentError("code: must be in [1, 11], got " + std::to_string(code)));
        }
        ThrowIfError(Status(static_cast<StatusCode>(code), message));
      },
      py::arg("code"), py::arg("message"));
  m.def(
      "status_code_name",
      [](int code) { return std::string(StatusCodeName(static_cast<StatusCode>(code))); },
      "The name of a StatusCode value (\"invalid_argument\").");
}

}  // namespace shardsync::py_bind
