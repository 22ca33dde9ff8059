// Rendezvous store (store.h). Timeouts are seconds (float) on the Python side.
#include <pybind11/stl.h>

#include <cmath>

#include "common.h"
#include "shardsync/store.h"

namespace shardsync::py_bind {

Millis SecondsToMillis(double seconds, const std::string& what) {
  if (!std::isfinite(seconds) || seconds < 0 || seconds > 1e7) {
    ThrowIfError(InvalidArgumentError(
        what + ": must be a finite number of seconds in [0, 1e7], got " + std::to_string(seconds)));
  }
  return Millis(static_cast<int64_t>(std::llround(seconds * 1000.0)));
}

void RegisterStore(py::module_& m) {
  py::class_<StoreServer>(
      m, "StoreServer",
      "The rendezvous store served from a thread of this process; use shardsync.StoreServer.")
      .def_static(
          "start",
          [](const std::string& host, int port, const std::string& token) {
            py::gil_scoped_release nogil;
            return Unwrap(StoreServer::Start(host, port, token));
          },
          py::arg("host") = "127.0.0.1", py::arg("port") = 0, py::arg("token") = "")
      .def_property_readonly("port", &StoreServer::port)
      .def_property_readonly("address", &StoreServer::address)
      .def("stop",
           [](StoreServer& s) {
             py::gil_scoped_release nogil;
             s.Stop();
           })
      .def("__enter__", [](py::object self) { return self; })
      .def("__exit__", [](StoreServer& s, py::args) {
        py::gil_scoped_release nogil;
        s.Stop();
      });

  py::class_<StoreClient>(m, "StoreClient", "A store connection; use shardsync.StoreClient.")
      .def_static(
          "connect",
          [](const std::string& address, const std::string& token, double timeout) {
            Millis t = SecondsToMillis(timeout, "timeout");
            py::gil_scoped_release nogil;
            return Unwrap(StoreClient::Connect(address, token, t));
          },
          py::arg("address"), py::arg("token") = "", py::arg("timeout") = 30.0)
      .def(
          "set",
          [](StoreClient& c, const std::string& key, py::bytes value) {
            std::string v = value;
            py::gil_scoped_release nogil;
            ThrowIfError(c.Set(key, v));
          },
          py::arg("key"), py::arg("value"))
      .def(
          "get",
          [](StoreClient& c, const std::string& key, double timeout) {
            Millis t = SecondsToMillis(timeout, "timeout");
            Result<std::string> r = [&] {
              py::gil_scoped_release nogil;
              return c.Get(key, t);
            }();
            return py::bytes(Unwrap(std::move(r)));
          },
          py::arg("key"), py::arg("timeout") = 30.0)
      .def(
          "add",
          [](StoreClient& c, const std::string& key, int64_t delta) {
            py::gil_scoped_release nogil;
            return Unwrap(c.Add(key, delta));
          },
          py::arg("key"), py::arg("delta") = 1)
      .def(
          "wait",
          [](StoreClient& c, const std::vector<std::string>& keys, double timeout) {
            Millis t = SecondsToMillis(timeout, "timeout");
            py::gil_scoped_release nogil;
            ThrowIfError(c.Wait(keys, t));
          },
          py::arg("keys"), py::arg("timeout") = 30.0)
      .def(
          "barrier",
          [](StoreClient& c, const std::string& name, int world, double timeout) {
            Millis t = SecondsToMillis(timeout, "timeout");
            py::gil_scoped_release nogil;
            ThrowIfError(c.Barrier(name, world, t));
          },
          py::arg("name"), py::arg("world"), py::arg("timeout") = 30.0)
      .def(
          "delete_prefix",
          [](StoreClient& c, const std::string& prefix) {
            py::gil_scoped_release nogil;
            return Unwrap(c.DeletePrefix(prefix));
          },
          py::arg("prefix"))
      .def(
          "set_ephemeral",
          [](StoreClient& c, const std::string& key, py::bytes value) {
            std::string v = value;
            py::gil_scoped_release nogil;
            ThrowIfError(c.SetEphemeral(key, v));
          },
          py::arg("key"), py::arg("value"))
      .def(
          "set_if_absent",
          [](StoreClient& c, const std::string& key, py::bytes value, bool ephemeral) {
            std::string v = value;
            Result<std::string> r = [&] {
              py::gil_scoped_release nogil;
              return c.SetIfAbsent(key, v, ephemeral);
            }();
            return py::bytes(Unwrap(std::move(r)));
          },
          py::arg("key"), py::arg("value"), py::arg("ephemeral") = false)
      .def(
          "mark_dead",
          [](StoreClient& c, const std::string& key, const std::string& reason) {
            py::gil_scoped_release nogil;
            ThrowIfError(c.MarkDead(key, reason));
          },
          py::arg("key"), py::arg("reason"));

  m.def("generate_store_token", [] { return Unwrap(GenerateStoreToken()); });
  m.attr("MIN_STORE_TOKEN_CHARS") = kMinStoreTokenChars;

  m.def(
      "launch_env",
      [] {
        LaunchEnv e = Unwrap(LaunchEnvFromEnvironment());
        py::dict d;
        d["store"] = e.store_address;
        d["rank"] = e.rank;
        d["world_size"] = e.world_size;
        d["token"] = e.token;
        d["job_id"] = e.job_id.id;
        return d;
      },
      "The launch contract from the environment: SHARDSYNC_STORE, RANK (or SLURM_PROCID), "
      "WORLD_SIZE (or SLURM_NTASKS), SHARDSYNC_TOKEN, and the launch id (launch_job_id).");
  m.def(
      "launch_job_id", [] { return Unwrap(LaunchIdFromEnvironment()).id; },
      "This process's launch id: SHARDSYNC_JOB_ID, else TORCHELASTIC_RUN_ID (not torchrun's "
      "default 'none'), else SLURM_JOB_ID.SLURM_STEP_ID, else RAY_JOB_ID; '' when none is set.");
  m.def(
      "launch_job_secret", [] { return Unwrap(LaunchIdFromEnvironment()).secret; },
      "This process's launch secret (SHARDSYNC_JOB_SECRET); '' when none is set.");
  m.def(
      "generate_job_secret", [] { return Unwrap(GenerateJobSecret()); },
      "A fresh launch secret: 32 hex characters from the kernel's CSPRNG.");
}

}  // namespace shardsync::py_bind
