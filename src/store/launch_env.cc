#include <charconv>
#include <cstdlib>

#include "shardsync/store.h"

namespace shardsync {
namespace {

Result<int> ParseIntVar(const std::string& name, const std::string& v) {
  int out = 0;
  auto [ptr, ec] = std::from_chars(v.data(), v.data() + v.size(), out);
  if (v.empty() || ec != std::errc() || ptr != v.data() + v.size()) {
    return InvalidArgumentError(name + "='" + v + "' is not an integer");
  }
  return out;
}

// First variable of `names` that is set; NotFound naming all of them otherwise.
Result<std::pair<std::string, std::string>> FirstSet(
    const std::function<std::optional<std::string>(const std::string&)>& lookup,
    const std::vector<std::string>& names) {
  for (const std::string& n : names) {
    if (auto v = lookup(n)) return std::make_pair(n, *v);
  }
  std::string all = names[0];
  for (size_t i = 1; i < names.size(); ++i) all += " or " + names[i];
  return InvalidArgumentError(all + " is not set");
}

}  // namespace

Result<LaunchEnv> LaunchEnvFromLookup(
    const std::function<std::optional<std::string>(const std::string&)>& lookup) {
  LaunchEnv env;
  SS_ASSIGN_OR_RETURN(auto store, FirstSet(lookup, {"SHARDSYNC_STORE"}));
  SS_ASSIGN_OR_RETURN(auto hp, ParseHostPort(store.second, "SHARDSYNC_STORE"));
  if (hp.second == 0) return InvalidArgumentError("SHARDSYNC_STORE='" + store.second + "': port 0");
  env.store_address = store.second;
  SS_ASSIGN_OR_RETURN(auto rank, FirstSet(lookup, {"RANK", "SLURM_PROCID"}));
  SS_ASSIGN_OR_RETURN(env.rank, ParseIntVar(rank.first, rank.second));
  SS_ASSIGN_OR_RETURN(auto world, FirstSet(lookup, {"WORLD_SIZE", "SLURM_NTASKS"}));
  SS_ASSIGN_OR_RETURN(env.world_size, ParseIntVar(world.first, world.second));
  if (env.world_size < 1) {
    return InvalidArgumentError(world.first + "=" + world.second + " must be >= 1");
  }
  if (env.rank < 0 || env.rank >= env.world_size) {
    return InvalidArgumentError(rank.first + "=" + rank.second + " is outside [0, " + world.first +
                                "=" + world.second + ")");
  }
  SS_ASSIGN_OR_RETURN(auto token, FirstSet(lookup, {"SHARDSYNC_TOKEN"}));
  if (token.second.empty()) return InvalidArgumentError("SHARDSYNC_TOKEN is empty");
  SS_RETURN_IF_ERROR(CheckStoreToken(token.second, "SHARDSYNC_TOKEN"));
  env.token = token.second;
  return env;
}

Result<LaunchEnv> LaunchEnvFromEnvironment() {
  return LaunchEnvFromLookup([](const std::string& name) -> std::optional<std::string> {
    const char* v = std::getenv(name.c_str());
    if (v == nullptr) return std::nullopt;
    return std::string(v);
  });
}

}  // namespace shardsync
