#include <charconv>
#include <cstdlib>

#include "shardsync/settings.h"
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

// The launch's id alone (LaunchIdFromLookup adds the secret).
Result<LaunchId> LaunchNameFromLookup(
    const std::function<std::optional<std::string>(const std::string&)>& lookup);

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
  SS_ASSIGN_OR_RETURN(env.job_id, LaunchIdFromLookup(lookup));
  return env;
}

Status CheckJobId(std::string_view id, std::string_view what) {
  if (id.size() > kMaxJobIdChars) {
    return InvalidArgumentError(std::string(what) + ": " + std::to_string(id.size()) +
                                " characters, at most " + std::to_string(kMaxJobIdChars));
  }
  for (char c : id) {
    const auto u = static_cast<unsigned char>(c);
    if (u <= 0x20 || u >= 0x7f) {
      return InvalidArgumentError(std::string(what) +
                                  ": only printable ASCII without spaces is accepted");
    }
  }
  return OkStatus();
}

Status CheckJobSecret(std::string_view secret, std::string_view what) {
  if (secret.size() < kMinJobSecretChars || secret.size() > kMaxJobSecretChars) {
    return InvalidArgumentError(std::string(what) + ": " + std::to_string(secret.size()) +
                                " characters, " + std::to_string(kMinJobSecretChars) + " to " +
                                std::to_string(kMaxJobSecretChars) +
                                " required (shardsync.new_launch() or openssl rand -hex 16 "
                                "makes one)");
  }
  return OkStatus();
}

Result<std::string> GenerateJobSecret() { return GenerateStoreToken(); }

Result<LaunchId> LaunchIdFromLookup(
    const std::function<std::optional<std::string>(const std::string&)>& lookup) {
  SS_ASSIGN_OR_RETURN(LaunchId out, LaunchNameFromLookup(lookup));
  if (auto s = lookup("SHARDSYNC_JOB_SECRET"); s && !s->empty()) {
    SS_RETURN_IF_ERROR(CheckJobSecret(*s, "SHARDSYNC_JOB_SECRET"));
    out.secret = *s;
  }
  return out;
}

namespace {

Result<LaunchId> LaunchNameFromLookup(
    const std::function<std::optional<std::string>(const std::string&)>& lookup) {
  LaunchId out;
  auto take = [&](const std::string& id, const std::string& source) -> Status {
    SS_RETURN_IF_ERROR(CheckJobId(id, source));
    out.id = id;
    out.source = source;
    return OkStatus();
  };
  if (auto v = lookup("SHARDSYNC_JOB_ID"); v && !v->empty()) {
    SS_RETURN_IF_ERROR(take(*v, "SHARDSYNC_JOB_ID"));
    return out;
  }
  // torchrun exports its rendezvous id to every worker; without --rdzv-id (or --standalone,
  // which draws a uuid4) it is the literal default "none" (torch/distributed/run.py, `--rdzv_id`
  // default="none"; local_elastic_agent.py sets TORCHELASTIC_RUN_ID; torch 1.13 to 2.x).
  if (auto v = lookup("TORCHELASTIC_RUN_ID"); v && !v->empty() && *v != "none") {
    SS_RETURN_IF_ERROR(take(*v, "TORCHELASTIC_RUN_ID"));
    return out;
  }
  // One srun step is one launch: two steps of one allocation are two jobs.
  if (auto v = lookup("SLURM_JOB_ID"); v && !v->empty()) {
    auto step = lookup("SLURM_STEP_ID");
    if (step && !step->empty()) {
      SS_RETURN_IF_ERROR(take(*v + "." + *step, "SLURM_JOB_ID.SLURM_STEP_ID"));
    } else {
      SS_RETURN_IF_ERROR(take(*v, "SLURM_JOB_ID"));
    }
  } else if (auto r = lookup("RAY_JOB_ID"); r && !r->empty()) {
    // Ray's raylet exports the job id (hex) to each worker it starts (ray-project/ray
    // src/ray/raylet/worker_pool.cc WorkerPool::BuildProcessCommandArgs: env kEnvVarKeyJobId,
    // "RAY_JOB_ID" in src/ray/common/constants.h). One Ray job is one launch.
    SS_RETURN_IF_ERROR(take(*r, "RAY_JOB_ID"));
  }
  return out;
}

}  // namespace

Result<LaunchId> LaunchIdFromEnvironment() { return LaunchIdFromLookup(ProcessEnvironment()); }

Result<LaunchEnv> LaunchEnvFromEnvironment() { return LaunchEnvFromLookup(ProcessEnvironment()); }

}  // namespace shardsync
