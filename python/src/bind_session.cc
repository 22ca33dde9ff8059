// Verified sync sessions (session.h) with tensors borrowed through DLPack.
#include <pybind11/stl.h>

#include <map>
#include <mutex>
#include <optional>
#include <stdexcept>

#include "common.h"
#include "plan_inputs.h"
#include "shardsync/session.h"
#include "shardsync/store.h"
#include "shardsync/transport.h"
#ifdef SS_PY_HAVE_CUDA
#include "shardsync/gpu.h"
#endif

namespace shardsync::py_bind {

Millis SecondsToMillis(double seconds, const std::string& what);  // bind_store.cc

namespace {

// LoopbackHub is opaque in transport.h; Python holds it through this box.
struct PyLoopbackHub {
  std::shared_ptr<LoopbackHub> hub = NewLoopbackHub();
};

// The delta encoding's figures (session.h DeltaSyncStats), with the density and the fallbacks
// by reason.
py::dict DeltaToPy(const DeltaSyncStats& s) {
  py::dict d;
  d["wire_bytes"] = s.wire_bytes;
  d["full_bytes"] = s.full_bytes;
  d["changed"] = s.changed;
  d["elements"] = s.elements;
  d["density"] =
      s.elements ? static_cast<double>(s.changed) / static_cast<double>(s.elements) : 0.0;
  d["buckets_delta"] = s.buckets_delta;
  d["buckets_full"] = s.buckets_full;
  py::dict fb;
  fb["no_kept_image"] = s.fallback_no_image;
  fb["base_version_differs"] = s.fallback_version;
  fb["base_checksum_differs"] = s.fallback_checksum;
  d["fallbacks"] = fb;
  d["full_by_size"] = s.full_by_size;
  d["full_by_cost"] = s.full_by_cost;
  d["full_by_auto"] = s.full_by_auto;
  d["encode_seconds"] = s.encode_seconds;
  d["decode_seconds"] = s.decode_seconds;
  d["first_fallback"] = s.first_fallback;
  d["held_bytes"] = s.held_bytes;
  return d;
}

py::dict StatsToPy(const RankSyncStats& s) {
  py::dict d;
  d["rank"] = s.rank;
  d["ok"] = s.ok;
  d["error"] = s.error;
  d["send_bytes"] = s.send_bytes;
  d["recv_bytes"] = s.recv_bytes;
  d["seconds"] = s.seconds;
  d["checksums_ok"] = s.checksums_ok;
  d["checksums_total"] = s.checksums_total;
  d["delta"] = DeltaToPy(s.delta);
  return d;
}

py::dict ReportToPy(const SyncReport& r) {
  py::dict d;
  d["version"] = r.version;
  d["bytes"] = r.bytes;
  d["seconds"] = r.seconds;
  d["gbps"] = r.gbps;
  d["slowest_rank"] = r.slowest_rank;
  d["checksums_ok"] = r.checksums_ok;
  d["checksums_total"] = r.checksums_total;
  d["verified"] = r.checksums_total > 0 && r.checksums_ok == r.checksums_total;
  d["local"] = StatsToPy(r.local);
  py::list ranks;
  for (const auto& s : r.ranks) ranks.append(StatsToPy(s));
  d["ranks"] = ranks;
  d["delta"] = DeltaToPy(r.delta);
  return d;
}

// Test-only fault injection from Python: transport_params keys "fault.<field>" wrap the
// transport in the fault-injecting decorator (transport.h FaultConfig). Removed from the params
// the transport itself sees.
std::optional<FaultConfig> FaultFromParams(std::map<std::string, std::string>& params) {
  std::optional<FaultConfig> f;
  for (auto it = params.begin(); it != params.end();) {
    if (it->first.rfind("fault.", 0) != 0) {
      ++it;
      continue;
    }
    if (!f) f.emplace();
    const std::string field = it->first.substr(6);
    int64_t v = 0;
    try {
      size_t used = 0;
      v = std::stoll(it->second, &used);
      if (used != it->second.size()) throw std::invalid_argument("trailing");
    } catch (const std::exception&) {
      ThrowIfError(InvalidArgumentError("transport_params['" + it->first +
                                        "']: expected an integer, got '" + it->second + "'"));
    }
    if (field == "fail_post") {
      f->fail_post = static_cast<int>(v);
    } else if (field == "fail_code") {
      f->fail_code = static_cast<StatusCode>(v);
    } else if (field == "drop_completion") {
      f->drop_completion = static_cast<int>(v);
    } else if (field == "completion_delay_ms") {
      f->completion_delay = Millis(v);
    } else if (field == "corrupt_data_post") {
      f->corrupt_data_post = static_cast<int>(v);
    } else if (field == "corrupt_byte") {
      f->corrupt_byte = static_cast<size_t>(v);
    } else if (field == "die_after_posts") {
      f->die_after_posts = static_cast<int>(v);
    } else {
      ThrowIfError(
          InvalidArgumentError("transport_params['" + it->first + "']: unknown fault field"));
    }
    it = params.erase(it);
  }
  return f;
}

// Session(commit=, staging_memory=, commit_scope=, keep_previous=) as SessionOptions; errors name
// the argument.
void CommitFromPy(const std::string& commit, const std::string& staging, const std::string& scope,
                  const std::string& keep, SessionOptions& o) {
  if (commit == "staged") {
    o.commit = SessionOptions::Commit::kStaged;
  } else if (commit != "inplace") {
    ThrowIfError(
        InvalidArgumentError("commit: expected 'inplace' or 'staged', got '" + commit + "'"));
  }
  if (staging == "device") {
    o.staging = MemKind::kCuda;
  } else if (staging == "host") {
    o.staging = MemKind::kHost;
  } else if (staging != "auto") {
    ThrowIfError(InvalidArgumentError("staging_memory: expected 'auto', 'device' or 'host', got '" +
                                      staging + "'"));
  }
  if (scope == "replica") {
    o.commit_scope = SessionOptions::Scope::kReplica;
  } else if (scope != "job") {
    ThrowIfError(
        InvalidArgumentError("commit_scope: expected 'job' or 'replica', got '" + scope + "'"));
  }
  if (keep == "area") {
    o.keep_previous = SessionOptions::Keep::kArea;
  } else if (keep == "swap") {
    o.keep_previous = SessionOptions::Keep::kSwap;
  } else if (keep == "none") {
    o.keep_previous = SessionOptions::Keep::kNone;
  } else if (keep != "auto") {
    ThrowIfError(InvalidArgumentError(
        "keep_previous: expected 'auto', 'area', 'swap' or 'none', got '" + keep + "'"));
  }
}

py::dict CommitToPy(const CommitReport& c) {
  py::dict d;
  d["version"] = c.version;
  d["bytes"] = c.bytes;
  d["stall_seconds"] = c.stall_seconds;
  d["copy_seconds"] = c.copy_seconds;
  d["keep_previous"] = c.keep_previous;
  return d;
}

class PySession {
 public:
  PySession(PlanInputs inputs, int rank, const std::string& store_address, const std::string& token,
            const std::string& transport, std::optional<PyLoopbackHub> hub,
            const std::string& prefix, double connect_timeout, double sync_timeout,
            std::map<std::string, std::string> transport_params, int device,
            std::optional<std::string> job_id, std::optional<std::string> job_secret,
            const std::string& commit, const std::string& staging_memory,
            const std::string& commit_scope, const std::string& keep_previous)
      : inputs_(std::move(inputs)), rank_(rank), device_(device) {
    SessionOptions opts;
    CommitFromPy(commit, staging_memory, commit_scope, keep_previous, opts);
    opts.prefix = prefix;
    opts.job_id = std::move(job_id);          // None: the environment's launch id
    opts.job_secret = std::move(job_secret);  // None: the environment's launch secret
    opts.connect_timeout = SecondsToMillis(connect_timeout, "connect_timeout");
    opts.sync_timeout = SecondsToMillis(sync_timeout, "sync_timeout");
    TransportOptions topts;
    topts.params = std::move(transport_params);
    if (transport == "loopback") {
      if (!hub) {
        ThrowIfError(InvalidArgumentError(
            "hub: the loopback transport needs a LoopbackHub shared by every rank of the process"));
      }
      topts.loopback_hub = hub->hub;
    }
    if (device_ >= 0) {
      // Device session: every bound tensor lives on `device`, packed and verified there.
#ifdef SS_PY_HAVE_CUDA
      packer_ = gpu::MakeCudaPacker(device_, opts.sync_timeout);
#endif
      if (!packer_) {
        ThrowIfError(UnimplementedError("device " + std::to_string(device_) +
                                        ": this build has no CUDA packer (built without CUDA)"));
      }
      opts.packer = packer_.get();
      topts.params.emplace("device", std::to_string(device_));
    } else if (device_ < -1) {
      ThrowIfError(InvalidArgumentError("device: must be a CUDA index >= 0 or -1 (host), got " +
                                        std::to_string(device_)));
    }
    std::optional<FaultConfig> fault = FaultFromParams(topts.params);
    py::gil_scoped_release nogil;
    store_ = Unwrap(StoreClient::Connect(store_address, token, opts.connect_timeout));
    if (transport == "auto" || device_ >= 0) {
      // Per-pair routing (transport.h): device sessions get cuda_ipc on one GPU / node and nccl
      // across, host sessions shm on one host and ucx across; a named transport is the hint.
      RouteOptions ro;
      ro.hint = transport == "auto" ? "" : transport;
      ro.options = topts;
#ifdef SS_PY_HAVE_CUDA
      if (device_ >= 0) {
        ThrowIfError(gpu::RegisterGpuTransports());
        ro.self = Unwrap(gpu::DevicePeerInfo(rank_, device_));
      }
#endif
      if (device_ < 0) ro.self = LocalPeerInfo(rank_);
      transport_ = Unwrap(NewRoutedTransport(std::move(ro)));
    } else {
      transport_ = Unwrap(CreateTransport(transport, topts));
    }
    if (fault) transport_ = NewFaultTransport(std::move(transport_), *fault);
    session_ = Unwrap(SyncSession::Create(inputs_, rank_, *store_, *transport_, opts));
  }

  ~PySession() { Close(); }

  void Close() {
    std::vector<TensorRef> bound;
    {
      // A sync may be running on another thread with the GIL released; wait for it without
      // holding the GIL, or it could never return.
      std::optional<py::gil_scoped_release> nogil;
      if (Py_IsInitialized() && PyGILState_Check()) nogil.emplace();
      std::lock_guard<std::mutex> lock(mu_);
      session_.reset();
      transport_.reset();
      store_.reset();
      bound.swap(bound_);
      dest_ranges_.clear();
    }
    bound.clear();  // releases the producers (their deleters take the GIL)
  }

  SyncSession& session() {
    if (!session_) ThrowIfError(FailedPreconditionError("session: closed"));
    return *session_;
  }

  void BindSource(const std::string& hf_name, py::handle tensor, py::handle region_obj,
                  std::optional<int> chunk) {
    SyncSession& s = session();
    if (!s.is_trainer()) {
      ThrowIfError(
          FailedPreconditionError("rank " + std::to_string(rank_) +
                                  " is an engine rank: bind_destination, not bind_source"));
    }
    if (chunk || inputs_.trainer.kind == TrainerSpec::Kind::kMegatron) {
      BindLocal(s, hf_name, tensor, region_obj, chunk.value_or(0));
      return;
    }
    TensorRef t = BorrowTensor(tensor, "source '" + hf_name + "'");
    Region region;
    if (region_obj.is_none()) {
      const HfTensor* hf = FindHf(hf_name);
      int trainer_rank = Unwrap(DescribeSyncRank(inputs_, rank_)).trainer_rank;
      region = TrainerHeldRegion(inputs_.trainer, trainer_rank, hf->shape);
    } else {
      region = RegionFromPy(region_obj, "region of source '" + hf_name + "'");
    }
    if (region.extents() != t.shape) {
      ThrowIfError(InvalidArgumentError("source '" + hf_name + "': tensor shape " +
                                        ShapeToString(t.shape) +
                                        " does not match the held region " + region.ToString() +
                                        " (extents " + ShapeToString(region.extents()) + ")"));
    }
    CheckDevice(t, "source '" + hf_name + "'");
    SourceBinding b;
    b.hf_name = hf_name;
    b.data = t.data;
    b.dtype = t.dtype;
    b.region = region;
    b.mem = t.cuda ? MemKind::kCuda : MemKind::kHost;
    b.device = t.device;
    ThrowIfError(s.BindSource(b));
    bound_.push_back(std::move(t));
  }

  // A local parameter (Megatron: its name inside model chunk `chunk`; FSDP-like: the HF name),
  // the whole tensor: its shape is the local shape.
  void BindLocal(SyncSession& s, const std::string& name, py::handle tensor, py::handle region_obj,
                 int chunk) {
    const std::string what = "source '" + name + "' (chunk " + std::to_string(chunk) + ")";
    if (!region_obj.is_none()) {
      ThrowIfError(InvalidArgumentError(
          what + ": a local parameter is bound whole (region must be None; " +
          inputs_.trainer.ToString() + " ranks hold local parameters, plan.trainer_params(rank))"));
    }
    TensorRef t = BorrowTensor(tensor, what);
    CheckDevice(t, what);
    SourceBinding b;
    b.local = name;
    b.chunk = chunk;
    b.data = t.data;
    b.dtype = t.dtype;
    b.region = Region::Full(t.shape);
    b.mem = t.cuda ? MemKind::kCuda : MemKind::kHost;
    b.device = t.device;
    ThrowIfError(s.BindSource(b));
    bound_.push_back(std::move(t));
  }

  void BindDest(const std::string& name, py::handle tensor) {
    SyncSession& s = session();
    if (s.is_trainer()) {
      ThrowIfError(
          FailedPreconditionError("rank " + std::to_string(rank_) +
                                  " is a trainer rank: bind_source, not bind_destination"));
    }
    TensorRef t = BorrowTensor(tensor, "destination '" + name + "'", /*writable=*/true);
    CheckDevice(t, "destination '" + name + "'");
    CheckNoOverlap(t, name);
    DestBinding b;
    b.name = name;
    b.data = t.data;
    b.dtype = t.dtype;
    b.shape = t.shape;
    // Block-FP8 weights may come as their bytes (uint8: torch < 2.1 and numpy have no float8,
    // and engines keep `param.view(torch.uint8)` views): e4m3 is what the shard map says.
    if (b.dtype == DType::kU8) {
      for (const EngineParam& p : s.ExpectedParams()) {
        if (p.name == name && p.dtype == DType::kF8E4M3) b.dtype = DType::kF8E4M3;
      }
    }
    b.mem = t.cuda ? MemKind::kCuda : MemKind::kHost;
    b.device = t.device;
    ThrowIfError(s.BindDest(b));
    if (t.nbytes > 0) {
      const auto start = reinterpret_cast<uintptr_t>(t.data);
      dest_ranges_[{t.cuda ? t.device : -1, start}] = {start + static_cast<uintptr_t>(t.nbytes),
                                                       name};
    }
    bound_.push_back(std::move(t));
  }

  void Connect() {
    SyncSession& s = session();
    std::lock_guard<std::mutex> lock(mu_);
    Status st;
    {
      py::gil_scoped_release nogil;
      st = s.Connect();
    }
    ThrowIfError(st);
  }

  py::dict Sync(uint64_t version) {
    SyncSession& s = session();
    std::lock_guard<std::mutex> lock(mu_);
    Result<SyncReport> r = [&] {
      py::gil_scoped_release nogil;
      return s.Sync(version);
    }();
    return ReportToPy(Unwrap(std::move(r)));
  }

  py::dict Commit(uint64_t version) {
    SyncSession& s = session();
    std::lock_guard<std::mutex> lock(mu_);
    Result<CommitReport> r = [&] {
      py::gil_scoped_release nogil;
      return s.Commit(version);
    }();
    return CommitToPy(Unwrap(std::move(r)));
  }

  void Rollback() {
    SyncSession& s = session();
    std::lock_guard<std::mutex> lock(mu_);
    Status st;
    {
      py::gil_scoped_release nogil;
      st = s.Rollback();
    }
    ThrowIfError(st);
  }

  int rank() const { return rank_; }
  int device() const { return device_; }
  std::string job_id() { return session().job_id(); }
  const PlanInputs& inputs() const { return inputs_; }

 private:
  const HfTensor* FindHf(const std::string& name) {
    if (inventory_.empty()) inventory_ = HfTensorInventory(inputs_.model);
    for (const HfTensor& t : inventory_) {
      if (t.name == name) return &t;
    }
    ThrowIfError(
        NotFoundError("source '" + name + "': no such tensor in model " + inputs_.model.name));
    return nullptr;
  }

  // Two destinations sharing bytes would each be written by the sync (and one's checksum break
  // the other's): refused at bind, naming both.
  void CheckNoOverlap(const TensorRef& t, const std::string& name) const {
    if (t.nbytes <= 0) return;
    const int space = t.cuda ? t.device : -1;
    const auto start = reinterpret_cast<uintptr_t>(t.data);
    const uintptr_t end = start + static_cast<uintptr_t>(t.nbytes);
    auto check = [&](std::map<std::pair<int, uintptr_t>, Range>::const_iterator it) {
      if (it == dest_ranges_.end() || it->first.first != space) return;
      if (it->first.second < end && start < it->second.end) {
        ThrowIfError(InvalidArgumentError(
            "destination '" + name + "' shares memory with destination '" + it->second.name +
            "' (bound to overlapping bytes of one buffer); every parameter needs its own"));
      }
    };
    auto next = dest_ranges_.lower_bound({space, start});
    check(next);
    if (next != dest_ranges_.begin()) check(std::prev(next));
  }

  // The host packer reads and writes with the CPU: CUDA tensors bind directly only in a device
  // session (device=N, the CUDA packer); otherwise the Python layer stages them through host
  // memory.
  void CheckDevice(const TensorRef& t, const std::string& what) const {
    if (t.cuda && device_ < 0) {
      ThrowIfError(UnimplementedError(
          what +
          ": CUDA tensors bind directly only in a device session (shardsync.Session(..., "
          "device=N) in a CUDA build); otherwise use staging='host'"));
    }
    if (t.cuda && t.device != device_) {
      ThrowIfError(InvalidArgumentError(what + ": tensor on cuda:" + std::to_string(t.device) +
                                        ", session on cuda:" + std::to_string(device_)));
    }
  }

  PlanInputs inputs_;
  int rank_;
  std::vector<HfTensor> inventory_;
  int device_ = -1;
  struct Range {
    uintptr_t end = 0;
    std::string name;
  };
  // Bound destinations by (CUDA device or -1 for host, start address).
  std::map<std::pair<int, uintptr_t>, Range> dest_ranges_;
  std::vector<TensorRef> bound_;    // declared before session_: outlives it
  std::unique_ptr<Packer> packer_;  // likewise
  std::unique_ptr<StoreClient> store_;
  std::unique_ptr<Transport> transport_;
  std::unique_ptr<SyncSession> session_;
  std::mutex mu_;
};

}  // namespace

void RegisterSession(py::module_& m) {
  py::class_<PyLoopbackHub>(m, "LoopbackHub",
                            "Shared by every rank's session in one process (loopback transport).")
      .def(py::init<>());
  // Whether sessions can bind CUDA memory directly (a CUDA build with a device packer); Python
  // stages device tensors through host memory otherwise. Deliberately no CUDA call here: probing
  // devices at import would initialise the driver before a user's fork.
#ifdef SS_PY_HAVE_CUDA
  m.attr("DEVICE_BINDING") = true;
  gpu::RegisterGpuTransports().IgnoreError();  // "cuda_ipc" and "nccl" (no CUDA call made)
#else
  m.attr("DEVICE_BINDING") = false;
#endif
  m.def("transports", &RegisteredTransports, "Registered transport names in priority order.");
  m.attr("MAX_SYNC_VERSION") = kMaxSyncVersion;

  py::class_<PySession>(m, "SyncSession", "One sync rank's session; use shardsync.Session.")
      .def(py::init<PlanInputs, int, const std::string&, const std::string&, const std::string&,
                    std::optional<PyLoopbackHub>, const std::string&, double, double,
                    std::map<std::string, std::string>, int, std::optional<std::string>,
                    std::optional<std::string>, const std::string&, const std::string&,
                    const std::string&, const std::string&>(),
           py::arg("plan"), py::arg("rank"), py::arg("store"), py::arg("token") = "",
           py::arg("transport") = "auto", py::arg("hub") = py::none(), py::arg("prefix") = "ss/",
           py::arg("connect_timeout") = 60.0, py::arg("sync_timeout") = 60.0,
           py::arg("transport_params") = std::map<std::string, std::string>{},
           py::arg("device") = -1, py::arg("job_id") = py::none(),
           py::arg("job_secret") = py::none(), py::arg("commit") = "inplace",
           py::arg("staging_memory") = "auto", py::arg("commit_scope") = "job",
           py::arg("keep_previous") = "auto")
      .def_property_readonly("rank", &PySession::rank)
      .def_property_readonly("job_id", &PySession::job_id)
      .def_property_readonly("device", &PySession::device)
      .def_property_readonly("is_trainer", [](PySession& s) { return s.session().is_trainer(); })
      .def_property_readonly("plan", [](PySession& s) { return s.session().plan(); })
      .def_property_readonly("is_poisoned", [](PySession& s) { return s.session().IsPoisoned(); })
      .def_property_readonly("last_good_version",
                             [](PySession& s) { return s.session().last_good_version(); })
      .def("expected_params", [](PySession& s) { return s.session().ExpectedParams(); })
      .def("expected_sources", [](PySession& s) { return s.session().ExpectedSources(); })
      .def("bind_source", &PySession::BindSource, py::arg("hf_name"), py::arg("tensor"),
           py::arg("region") = py::none(), py::arg("chunk") = py::none())
      .def("bind_destination", &PySession::BindDest, py::arg("name"), py::arg("tensor"))
      .def("connect", &PySession::Connect)
      .def(
          "fail_before_connect",
          [](PySession& s, const std::string& why) { s.session().FailBeforeConnect(why); },
          py::arg("why"),
          "This rank cannot connect: every peer waiting at connect() fails now, naming it and "
          "`why` (SyncSession::FailBeforeConnect).")
      .def(
          "fail_sync",
          [](PySession& s, uint64_t version, const std::string& why) {
            s.session().FailSync(version, why);
          },
          py::arg("version"), py::arg("why"),
          "This rank will not run sync `version`: every peer in or entering it fails now with "
          "AbortedError naming this rank and `why` (SyncSession::FailSync).")
      .def("sync", &PySession::Sync, py::arg("version"))
      .def("commit", &PySession::Commit, py::arg("version"))
      .def("rollback", &PySession::Rollback)
      .def_property_readonly("staging_bytes",
                             [](PySession& s) { return s.session().staging_bytes(); })
      .def_property_readonly("committed_version",
                             [](PySession& s) { return s.session().committed_version(); })
      .def_property_readonly("keep_previous",
                             [](PySession& s) { return s.session().keep_previous(); })
      .def("close", &PySession::Close);
}

}  // namespace shardsync::py_bind
