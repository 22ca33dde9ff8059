// `shardsync inspect FILE|DIR`: the tensors of a safetensors checkpoint (header validated).
#include <fmt/format.h>

#include <cstdio>
#include <filesystem>
#include <memory>
#include <nlohmann/json.hpp>

#include "command.h"
#include "shardsync/safetensors.h"

namespace shardsync::cli {
namespace {

struct Args {
  std::string path;
  bool json = false;
};

// Tensor and file names are the file's bytes: control characters (a planted ESC sequence would
// drive the terminal) are shown as \xNN, as is a backslash (so the escaped form is unambiguous).
std::string Printable(std::string_view s) {
  std::string out;
  for (char c : s) {
    const auto u = static_cast<unsigned char>(c);
    if (u < 0x20 || u == 0x7f || c == '\\') {
      out += fmt::format("\\x{:02x}", u);
    } else {
      out.push_back(c);
    }
  }
  return out;
}

int Run(const Args& a) {
  auto ck = SafetensorsCheckpoint::Open(a.path);
  if (!ck.ok()) return ReportInputError(ck.status(), "path");
  struct Row {
    const SafetensorsEntry* e;
    std::string file;
  };
  std::vector<Row> rows;
  uint64_t total = 0;
  for (const auto& f : (*ck)->files()) {
    const std::string file = std::filesystem::path(f->path()).filename().string();
    for (const auto& e : f->header().tensors) rows.push_back({&e, file});
  }
  std::sort(rows.begin(), rows.end(),
            [](const Row& x, const Row& y) { return x.e->name < y.e->name; });
  for (const auto& r : rows) total += r.e->bytes();
  if (a.json) {
    nlohmann::json j;
    j["path"] = a.path;
    j["files"] = nlohmann::json::array();
    for (const auto& f : (*ck)->files()) {
      j["files"].push_back(
          {{"path", f->path()}, {"bytes", f->file_size()}, {"metadata", f->header().metadata}});
    }
    j["tensors"] = nlohmann::json::array();
    for (const auto& r : rows) {
      j["tensors"].push_back({{"name", r.e->name},
                              {"dtype", std::string(DTypeName(r.e->dtype))},
                              {"shape", r.e->shape},
                              {"bytes", r.e->bytes()},
                              {"file", r.file}});
    }
    j["num_tensors"] = rows.size();
    j["total_bytes"] = total;
    std::printf("%s\n", j.dump(2, ' ', false, nlohmann::json::error_handler_t::replace).c_str());
    return kExitOk;
  }
  size_t w = 4;
  for (const auto& r : rows) w = std::max(w, Printable(r.e->name).size());
  const bool multi = (*ck)->files().size() > 1;
  std::printf("%s\n", fmt::format("{:<{}}  {:<7}  {:<22}  {:>14}{}", "name", w, "dtype", "shape",
                                  "bytes", multi ? "  file" : "")
                          .c_str());
  for (const auto& r : rows) {
    std::printf("%s\n", fmt::format("{:<{}}  {:<7}  {:<22}  {:>14}{}", Printable(r.e->name), w,
                                    DTypeName(r.e->dtype), ShapeToString(r.e->shape), r.e->bytes(),
                                    multi ? "  " + Printable(r.file) : "")
                            .c_str());
  }
  std::printf("%zu tensors, %llu bytes (%.2f MiB) in %zu file(s)\n", rows.size(),
              static_cast<unsigned long long>(total), total / 1048576.0, (*ck)->files().size());
  return kExitOk;
}

Registration reg({"inspect", [](CLI::App& app) {
                    auto a = std::make_shared<Args>();
                    auto* sub = app.add_subcommand(
                        "inspect",
                        "List the tensors of a safetensors file or checkpoint directory");
                    sub->add_option("path", a->path,
                                    "a .safetensors FILE, or a DIR with model.safetensors or "
                                    "model.safetensors.index.json")
                        ->required();
                    sub->add_flag("--json", a->json, "machine-readable output");
                    return [a] { return Run(*a); };
                  }});

}  // namespace
}  // namespace shardsync::cli
