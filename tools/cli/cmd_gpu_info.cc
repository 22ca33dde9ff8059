// `shardsync gpu-info`: whether this build and machine can run device sessions: the CUDA devices
// (name, SMs, memory, HBM peak, PCI bus id) and the NCCL library the nccl transport loads.
#include <cstdio>
#include <nlohmann/json.hpp>

#include "command.h"
#include "shardsync/gpu.h"

namespace shardsync::cli {
namespace {

int Run() {
  std::string why;
  nlohmann::json j;
  j["available"] = gpu::Available(&why);
  j["reason"] = why;
  j["devices"] = nlohmann::json::array();
  if (auto n = gpu::DeviceCount(); n.ok()) {
    for (int d = 0; d < *n; ++d) {
      if (auto i = gpu::QueryDevice(d); i.ok()) {
        j["devices"].push_back({{"index", d},
                                {"name", i->name},
                                {"sms", i->sm_count},
                                {"bytes", i->total_bytes},
                                {"hbm_peak_gbps", i->hbm_peak_gbps},
                                {"pci", i->pci_bus_id}});
      }
    }
  }
  auto v = gpu::NcclVersion();
  j["nccl"] = v.ok() ? nlohmann::json(*v) : nlohmann::json(v.status().ToString());
  std::printf("%s\n", j.dump(2).c_str());
  return kExitOk;
}

Registration reg({"gpu-info", [](CLI::App& app) {
                    app.add_subcommand("gpu-info", "CUDA devices and the NCCL library in use");
                    return [] { return Run(); };
                  }});

}  // namespace
}  // namespace shardsync::cli
