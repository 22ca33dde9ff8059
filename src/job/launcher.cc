// Local launcher: one job on this host, as threads around a loopback hub or as child processes
// (`shardsync run`) around an in-process store. Children get PR_SET_PDEATHSIG so they cannot
// outlive the launcher, and every exit path kills and reaps what is still running. Every child
// gets the launch's id (SHARDSYNC_JOB_ID), and a child that exits early is marked dead in the
// store (MarkSyncRankDead), so the ranks waiting on it fail at once, naming it. Every rank is on
// this host: UCX listens on loopback only and the store binds 127.0.0.1. With emulate_nodes each
// child is a node of its own (SHARDSYNC_HOST_ID, NCCL_HOSTID), for cross-node paths on one machine.
#include <fcntl.h>
#include <signal.h>
#include <sys/prctl.h>
#include <sys/wait.h>
#include <unistd.h>

#include <atomic>
#include <chrono>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <fstream>
#include <sstream>
#include <thread>

#include "job/internal.h"
#include "job/launcher.h"
#include "shardsync/session.h"
#include "shardsync/settings.h"
#include "shardsync/transport.h"

extern char** environ;

namespace shardsync {
namespace {

using Clock = std::chrono::steady_clock;

// 32 hex characters from /dev/urandom: the store token, and (8 bytes) the launch id.
Result<std::string> RandomToken(size_t bytes = 16) {
  unsigned char b[16];
  std::ifstream f("/dev/urandom", std::ios::binary);
  if (bytes > sizeof(b) ||
      !f.read(reinterpret_cast<char*>(b), static_cast<std::streamsize>(bytes))) {
    return InternalError("launcher: cannot read /dev/urandom for the store token");
  }
  std::string s;
  char hex[3];
  for (size_t i = 0; i < bytes; ++i) {
    std::snprintf(hex, sizeof(hex), "%02x", b[i]);
    s += hex;
  }
  return s;
}

std::string Tail(const std::string& path, size_t max_bytes = 2000) {
  std::ifstream f(path, std::ios::binary);
  std::stringstream ss;
  ss << f.rdbuf();
  std::string s = ss.str();
  if (s.size() > max_bytes) s = "..." + s.substr(s.size() - max_bytes);
  while (!s.empty() && (s.back() == '\n' || s.back() == ' ')) s.pop_back();
  return s;
}

Result<LocalJobResult> RunThreads(const LocalJobOptions& o, StoreServer& server,
                                  const std::string& token) {
  // The ranks are this process's threads: one launch, drawn here as `run` draws one per child.
  JobSpec job = o.job;
  SS_ASSIGN_OR_RETURN(job.launch.id, RandomToken(8));
  job.launch.source = "the in-process launcher";
  SS_ASSIGN_OR_RETURN(job.launch.secret, GenerateJobSecret());
  const int world = SyncWorldSize(job.inputs);
  const int total = world * RankSteps(job);
  auto hub = NewLoopbackHub();
  std::atomic<int> done_steps{0};
  std::atomic<int> finished{0};
  std::vector<Result<RankResult>> results(world, Result<RankResult>(InternalError("not run")));
  std::vector<std::thread> threads;
  for (int r = 0; r < world; ++r) {
    threads.emplace_back([&, r] {
      auto run = [&]() -> Result<RankResult> {
        SS_ASSIGN_OR_RETURN(auto store, StoreClient::Connect(server.address(), token, job.timeout));
        auto tx = NewLoopbackTransport(hub);
        return RunRank(job, r, *store, *tx, [&] { ++done_steps; });
      };
      results[r] = run();
      ++finished;
    });
  }
  // Every wait inside a rank is bounded by job.timeout, so threads end on their own.
  while (finished.load() < world) {
    if (o.on_progress) o.on_progress(done_steps.load(), total);
    std::this_thread::sleep_for(std::chrono::milliseconds(100));
  }
  for (auto& t : threads) t.join();
  if (o.on_progress) o.on_progress(done_steps.load(), total);
  LocalJobResult out;
  out.store_address = server.address();
  for (int r = 0; r < world; ++r) {
    if (!results[r].ok()) {
      Status s = results[r].status();
      return s.Annotate("sync rank " + std::to_string(r));
    }
    out.ranks.push_back(std::move(results[r]).value());
  }
  return out;
}

struct Child {
  int rank = 0;
  pid_t pid = -1;
  std::string log;
  bool exited = false;
  int status = 0;
};

void KillAll(std::vector<Child>& children) {
  for (Child& c : children) {
    if (!c.exited && c.pid > 0) kill(c.pid, SIGKILL);
  }
  for (Child& c : children) {
    if (!c.exited && c.pid > 0) {
      waitpid(c.pid, &c.status, 0);
      c.exited = true;
    }
  }
}

std::string DescribeExit(int status) {
  if (WIFEXITED(status)) return "exit code " + std::to_string(WEXITSTATUS(status));
  if (WIFSIGNALED(status)) return "killed by signal " + std::to_string(WTERMSIG(status));
  return "status " + std::to_string(status);
}

// SHARDSYNC_RANK_LOG_DIR keeps every rank's stderr as DIR/rank-<R>.log (GPU debugging); the
// temporary logs go.
void CleanupLogs(const std::vector<Child>& children) {
  auto dir = TextKnob("SHARDSYNC_RANK_LOG_DIR");  // text: no value is malformed
  const std::string keep = dir.ok() ? *dir : "";
  for (const Child& c : children) {
    if (!keep.empty()) {
      // O_NOFOLLOW: a symlink planted at DIR/rank-R.log must not redirect the log into a file
      // of the planter's choosing; such a log is skipped.
      const std::string path = keep + "/rank-" + std::to_string(c.rank) + ".log";
      const int fd =
          open(path.c_str(), O_WRONLY | O_CREAT | O_APPEND | O_NOFOLLOW | O_CLOEXEC, 0600);
      if (fd < 0) {
        std::fprintf(stderr, "launcher: not keeping sync rank %d's log as %s: %s\n", c.rank,
                     path.c_str(), std::strerror(errno));
      } else {
        std::ifstream in(c.log, std::ios::binary);
        char buf[65536];
        while (in.read(buf, sizeof(buf)) || in.gcount() > 0) {
          if (write(fd, buf, static_cast<size_t>(in.gcount())) < 0) break;
        }
        close(fd);
      }
    }
    unlink(c.log.c_str());
  }
}

}  // namespace

std::vector<std::string> job_internal::ChildEnvironment(const std::vector<std::string>& parent,
                                                        const std::string& store, int world,
                                                        const std::string& token,
                                                        const std::string& job_id,
                                                        const std::string& job_secret) {
  std::vector<std::string> env;
  bool net_devices = false;  // the user named UCX's devices: keep them
  for (const std::string& v : parent) {
    if (v.starts_with("SHARDSYNC_STORE=") || v.starts_with("RANK=") ||
        v.starts_with("WORLD_SIZE=") || v.starts_with("SHARDSYNC_TOKEN=") ||
        v.starts_with("SHARDSYNC_JOB_ID=") || v.starts_with("SHARDSYNC_JOB_SECRET=")) {
      continue;
    }
    net_devices |= v.starts_with("SHARDSYNC_UCX_NET_DEVICES=") || v.starts_with("UCX_NET_DEVICES=");
    env.push_back(v);
  }
  env.push_back("SHARDSYNC_STORE=" + store);
  env.push_back("WORLD_SIZE=" + std::to_string(world));
  env.push_back("SHARDSYNC_TOKEN=" + token);
  env.push_back("SHARDSYNC_JOB_ID=" + job_id);
  if (!job_secret.empty()) env.push_back("SHARDSYNC_JOB_SECRET=" + job_secret);
  // Every rank is on this host: UCX's listeners on loopback, out of the network's reach (the
  // store token does not cover them; docs/security.md).
  if (!net_devices) env.push_back("SHARDSYNC_UCX_NET_DEVICES=loopback");
  return env;
}

void job_internal::EmulateNode(std::vector<std::string>& env, const std::string& host, int rank) {
  std::erase_if(env, [](const std::string& v) {
    return v.starts_with("SHARDSYNC_HOST_ID=") || v.starts_with("NCCL_HOSTID=");
  });
  // '/' cannot be in a hostname, so no real host's identity is an emulated node's.
  const std::string node = host + "/node" + std::to_string(rank);
  env.push_back("SHARDSYNC_HOST_ID=" + node);
  env.push_back("NCCL_HOSTID=" + node);
}

Status CheckEmulateNodes(const JobSpec& job, LocalJobOptions::Mode mode) {
  if (mode == LocalJobOptions::Mode::kAuto) {
    mode = job.transport == "loopback" ? LocalJobOptions::Mode::kThreads
                                       : LocalJobOptions::Mode::kProcesses;
  }
  if (mode == LocalJobOptions::Mode::kThreads) {
    return InvalidArgumentError(
        "--emulate-nodes: gives each rank process its own node; threads share one process "
        "(drop --launch threads / --transport loopback)");
  }
  if (job.device != "cuda" && job.transport != "ucx") {
    return InvalidArgumentError(
        "--emulate-nodes: host-memory ranks cross nodes over ucx only; "
        "--transport " +
        job.transport +
        " connects the ranks of one host (use --device cuda, where "
        "pairs between nodes take nccl, or --transport ucx)");
  }
  return OkStatus();
}

namespace {

// Forks `shardsync run` for every sync rank, its stderr and stdout in a temporary log. On failure
// every child already started is killed and its log removed.
Status SpawnRanks(const LocalJobOptions& o, StoreServer& server, const std::string& token,
                  const std::string& job_id, const std::string& job_secret,
                  std::vector<Child>* out) {
  const JobSpec& job = o.job;
  const int world = SyncWorldSize(job.inputs);
  std::vector<Child>& children = *out;
  // argv / envp are built before fork: between fork and exec only async-signal-safe calls.
  std::vector<std::string> base_args = {"shardsync", "run"};
  for (auto& a : JobSpecToArgs(job)) base_args.push_back(a);
  std::vector<std::string> parent;
  for (char** e = environ; *e; ++e) parent.emplace_back(*e);
  const std::vector<std::string> base_env =
      job_internal::ChildEnvironment(parent, server.address(), world, token, job_id, job_secret);
  char host[256] = {};
  gethostname(host, sizeof(host) - 1);
  for (int r = 0; r < world; ++r) {
    std::vector<std::string> args = base_args;
    args.push_back("--role");
    args.push_back(r < job.inputs.trainer.world() ? "trainer" : "engine");
    std::vector<std::string> env = base_env;
    env.push_back("RANK=" + std::to_string(r));
    if (o.emulate_nodes) job_internal::EmulateNode(env, host, r);
    std::vector<char*> argv, envp;
    for (auto& a : args) argv.push_back(a.data());
    argv.push_back(nullptr);
    for (auto& e : env) envp.push_back(e.data());
    envp.push_back(nullptr);
    std::string tmpl = (o.log_dir.empty() ? "/tmp" : o.log_dir) + "/shardsync-rank-XXXXXX";
    int log_fd = mkstemp(tmpl.data());
    if (log_fd < 0) {
      KillAll(children);
      CleanupLogs(children);
      return InternalError(std::string("launcher: mkstemp: ") + std::strerror(errno));
    }
    const pid_t parent = getpid();
    pid_t pid = fork();
    if (pid == 0) {
      prctl(PR_SET_PDEATHSIG, SIGKILL);
      if (getppid() != parent) _exit(127);  // the launcher died before prctl took effect
      int devnull = open("/dev/null", O_RDWR);
      dup2(devnull, 0);
      dup2(log_fd, 1);
      dup2(log_fd, 2);
      execve(o.exe.c_str(), argv.data(), envp.data());
      _exit(127);
    }
    close(log_fd);
    if (pid < 0) {
      KillAll(children);
      CleanupLogs(children);
      return InternalError(std::string("launcher: fork: ") + std::strerror(errno));
    }
    children.push_back({r, pid, tmpl, false, 0});
  }
  return OkStatus();
}

// A child that exited before the job ended is marked dead in the store (MarkSyncRankDead): the
// ranks waiting for its keys fail at once, naming it. Marked again until the job's claim exists
// (ranks inside the job watch the rank's liveness key there).
class DeathNotices {
 public:
  DeathNotices(StoreClient& store, const std::string& prefix, const std::string& job_id)
      : store_(store), prefix_(prefix), job_id_(job_id) {}
  // The rank's own error, when it posted its result before exiting, rides along: the ranks this
  // notice fails then say why, not only that it exited.
  void Exited(const Child& c, const std::string& how) {
    std::string why;
    auto text = store_.Get(prefix_ + "result/" + std::to_string(c.rank), Millis(0));
    if (text.ok()) {
      auto r = RankResultFromJson(*text);
      if (r.ok() && !r->error.empty()) why = ": " + r->error;
    }
    const std::string ended = "(pid " + std::to_string(c.pid) + ") exited (" + how + ")" + why;
    // Ranks still setting up (job_internal::SetupBarrier) wait on its setup key.
    store_
        .MarkDead(job_internal::SetupAliveKey(prefix_, job_id_, c.rank),
                  "sync rank " + std::to_string(c.rank) + " " + ended)
        .IgnoreError();
    pending_.push_back({c.rank, ended});
  }
  void Deliver() {
    for (auto it = pending_.begin(); it != pending_.end();) {
      auto marked = MarkSyncRankDead(store_, prefix_, job_id_, it->first, it->second);
      it = marked.ok() && *marked ? pending_.erase(it) : it + 1;
    }
  }

 private:
  StoreClient& store_;
  const std::string prefix_, job_id_;
  std::vector<std::pair<int, std::string>> pending_;  // rank, how it ended
};

// Reaps the children until every one exited, reporting progress and injecting the kill fault.
// After a rank fails, the others get their own timeout to report before they are killed. Past the
// job's limit every child is killed and the error names them (their logs removed).
Status Supervise(const LocalJobOptions& o, StoreClient& store, const std::string& job_id,
                 std::vector<Child>& children) {
  const JobSpec& job = o.job;
  const int world = static_cast<int>(children.size());
  const int total = world * RankSteps(job);
  const auto deadline = Clock::now() + o.job_timeout;
  Clock::time_point failure_deadline = Clock::time_point::max();
  int running = world;
  bool killed = false;
  DeathNotices deaths(store, job.prefix, job_id);
  while (running > 0) {
    for (Child& c : children) {
      if (c.exited) continue;
      pid_t w = waitpid(c.pid, &c.status, WNOHANG);
      if (w == c.pid) {
        c.exited = true;
        --running;
        const bool failed = !(WIFEXITED(c.status) && WEXITSTATUS(c.status) == 0);
        if (failed) deaths.Exited(c, DescribeExit(c.status));
        if (failed && failure_deadline == Clock::time_point::max()) {
          failure_deadline = Clock::now() + job.timeout + std::chrono::seconds(5);
        }
      }
    }
    deaths.Deliver();
    if (o.on_progress || o.kill_rank >= 0) {
      auto p = store.Add(job.prefix + "progress", 0);
      if (p.ok() && o.on_progress) o.on_progress(static_cast<int>(*p), total);
      if (p.ok() && o.kill_rank >= 0 && o.kill_rank < world && *p >= o.kill_at_progress &&
          !children[o.kill_rank].exited && !killed) {
        kill(children[o.kill_rank].pid, SIGKILL);
        killed = true;
      }
    }
    const auto now = Clock::now();
    if (now > deadline) {
      KillAll(children);
      std::string still;
      for (Child& c : children) {
        if (WIFSIGNALED(c.status) && WTERMSIG(c.status) == SIGKILL) {
          still += (still.empty() ? "" : ", ") + std::to_string(c.rank);
        }
      }
      CleanupLogs(children);
      return DeadlineExceededError("launcher: the job exceeded its " +
                                   std::to_string(o.job_timeout.count()) +
                                   " ms limit (--job-timeout-s raises it); killed ranks " + still);
    }
    if (now > failure_deadline) {
      // A rank failed and others did not finish in their own timeout: kill them and report
      // every rank (results posted, or how each ended with its log), the root cause included.
      KillAll(children);
      break;
    }
    if (running > 0) std::this_thread::sleep_for(std::chrono::milliseconds(50));
  }
  return OkStatus();
}

// Every rank's posted result; a rank that died before reporting (killed, crashed, or bad
// arguments) gets ok=false saying how it ended, with the tail of its log.
Result<LocalJobResult> CollectResults(const JobSpec& job, StoreServer& server, StoreClient& store,
                                      const std::vector<Child>& children) {
  LocalJobResult out;
  out.store_address = server.address();
  for (const Child& c : children) {
    // Every child has exited: a result it posted is there (its Set completed before it exited).
    auto text = store.Get(job.prefix + "result/" + std::to_string(c.rank), Millis(0));
    if (!text.ok()) {
      RankResult r;
      r.rank = c.rank;
      auto who = DescribeSyncRank(job.inputs, c.rank);
      if (who.ok()) {
        r.is_trainer = who->is_trainer;
        r.replica = who->replica;
        r.tp_rank = who->tp_rank;
        r.pp_rank = who->pp_rank;
        r.trainer_rank = who->trainer_rank;
      }
      r.poisoned = !r.is_trainer;
      const std::string tail = Tail(c.log);
      r.error = "unavailable: sync rank " + std::to_string(c.rank) + " (pid " +
                std::to_string(c.pid) + ") ended with " + DescribeExit(c.status) +
                " without a result" + (tail.empty() ? "" : ": " + tail);
      out.ranks.push_back(std::move(r));
      continue;
    }
    SS_ASSIGN_OR_RETURN(RankResult r, RankResultFromJson(*text));
    out.ranks.push_back(std::move(r));
  }
  return out;
}

Result<LocalJobResult> RunProcesses(const LocalJobOptions& o, StoreServer& server,
                                    const std::string& token) {
  SS_ASSIGN_OR_RETURN(auto store, StoreClient::Connect(server.address(), token, o.job.timeout));
  SS_ASSIGN_OR_RETURN(const std::string job_id, RandomToken(8));
  std::vector<Child> children;
  SS_ASSIGN_OR_RETURN(const std::string job_secret, GenerateJobSecret());
  SS_RETURN_IF_ERROR(SpawnRanks(o, server, token, job_id, job_secret, &children));
  SS_RETURN_IF_ERROR(Supervise(o, *store, job_id, children));
  SS_ASSIGN_OR_RETURN(LocalJobResult out, CollectResults(o.job, server, *store, children));
  CleanupLogs(children);
  return out;
}

}  // namespace

bool LocalJobResult::ok() const {
  if (ranks.empty()) return false;
  for (const RankResult& r : ranks) {
    if (!r.ok) return false;
  }
  return true;
}

namespace {

// An error that only repeats another rank's failure: an abort it posted, its liveness key dead,
// its launch ended.
bool EchoesAnother(const std::string& error) {
  return error.rfind("aborted", 0) == 0 || error.find(" is gone (") != std::string::npos ||
         error.find("ended before this rank joined") != std::string::npos;
}

std::string RankName(const RankResult& r) {
  std::string s = "sync rank " + std::to_string(r.rank);
  if (r.is_trainer && r.trainer_rank >= 0) {
    s += " (trainer " + std::to_string(r.trainer_rank) + ")";
  } else if (!r.is_trainer && r.replica >= 0) {
    s += " (engine replica " + std::to_string(r.replica) + " tp " + std::to_string(r.tp_rank) +
         " pp " + std::to_string(r.pp_rank) + ")";
  }
  return s;
}

}  // namespace

std::string LocalJobResult::FirstError() const {
  // The root cause, not the echo.
  for (const RankResult& r : ranks) {
    if (!r.ok && !EchoesAnother(r.error)) return r.error;
  }
  for (const RankResult& r : ranks) {
    if (!r.ok) return r.error;
  }
  return "";
}

std::string LocalJobResult::FailureReport() const {
  int failed = 0;
  std::string causes, echoes;
  for (const RankResult& r : ranks) {
    if (r.ok) continue;
    ++failed;
    const bool echo = EchoesAnother(r.error);
    (echo ? echoes : causes) +=
        "\n  " + RankName(r) + (echo ? ", after another rank: " : ": ") + r.error;
  }
  if (failed == 0) return "";
  return std::to_string(failed) + " of " + std::to_string(ranks.size()) +
         " sync ranks failed, each with its own last error:" + causes + echoes;
}

Result<LocalJobResult> RunLocalJob(const LocalJobOptions& o) {
  SS_ASSIGN_OR_RETURN(std::string token, RandomToken());
  SS_ASSIGN_OR_RETURN(auto server, StoreServer::Start("127.0.0.1", 0, token));
  LocalJobOptions::Mode mode = o.mode;
  if (mode == LocalJobOptions::Mode::kAuto) {
    mode = o.job.transport == "loopback" ? LocalJobOptions::Mode::kThreads
                                         : LocalJobOptions::Mode::kProcesses;
  }
  if (mode == LocalJobOptions::Mode::kThreads && o.job.transport != "loopback") {
    return InvalidArgumentError("--transport " + o.job.transport +
                                ": the in-process launcher runs the loopback transport only");
  }
  if (mode == LocalJobOptions::Mode::kProcesses && o.job.transport == "loopback") {
    return InvalidArgumentError(
        "--transport loopback: works within one process only; run ranks as threads");
  }
  if (o.emulate_nodes) SS_RETURN_IF_ERROR(CheckEmulateNodes(o.job, mode));
  auto r = mode == LocalJobOptions::Mode::kThreads ? RunThreads(o, *server, token)
                                                   : RunProcesses(o, *server, token);
  server->Stop();
  return r;
}

}  // namespace shardsync
