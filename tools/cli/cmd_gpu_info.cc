// `shardsync gpu-info [--json]`: whether this build and machine can run device sessions: the CUDA
// devices (name, SMs, memory, HBM peak, PCI bus id) and the NCCL library the nccl transport loads.
#include <cstdio>
#include <nlohmann/json.hpp>
#include <string>

#include "command.h"
#include "shardsync/gpu.h"

namespace shardsync::cli {
namespace {

nlohmann::json Probe() {
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
  return j;
}

void PrintText(const nlohmann::json& j) {
  if (j["available"].get<bool>()) {
    std::printf("CUDA: %zu device(s)\n", j["devices"].size());
  } else {
    std::printf("CUDA: not available (%s)\n", j["reason"].get<std::string>().c_str());
  }
  for (const auto& d : j["devices"]) {
    std::printf("  GPU %d: %s, %d SMs, %.1f GiB, HBM peak %.0f GB/s, PCI %s\n",
                d["index"].get<int>(), d["name"].get<std::string>().c_str(), d["sms"].get<int>(),
                static_cast<double>(d["bytes"].get<int64_t>()) / (1 << 30),
                d["hbm_peak_gbps"].get<double>(), d["pci"].get<std::string>().c_str());
  }
  const auto& nccl = j["nccl"];
  std::printf("NCCL: %s\n", nccl.is_number() ? std::to_string(nccl.get<int>()).c_str()
                                             : nccl.get<std::string>().c_str());
}

Registration reg({"gpu-info", [](CLI::App& app) {
                    auto* sub =
                        app.add_subcommand("gpu-info", "CUDA devices and the NCCL library in use");
                    auto json = std::make_shared<bool>(false);
                    sub->add_flag("--json", *json,
                                  "Print {available, reason, devices, nccl} as JSON");
                    return [json] {
                      const nlohmann::json j = Probe();
                      if (*json) {
                        std::printf("%s\n", j.dump(2).c_str());
                      } else {
                        PrintText(j);
                      }
                      return kExitOk;
                    };
                  }});

}  // namespace
}  // namespace shardsync::cli
