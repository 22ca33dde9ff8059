#include "sync/presence.h"

namespace shardsync::sync_internal {
namespace {

constexpr std::string_view kCreated = "created";
constexpr std::string_view kConnecting = "connecting";

}  // namespace

std::string Presence::Scope() const {
  return ctx_.launch.id.empty() ? "plan-" + ctx_.plan.plan_hash : "launch-" + ctx_.launch.id;
}

std::string Presence::RankFolder(int rank) const {
  return ctx_.opt.prefix + "presence/" + Scope() + "/" + std::to_string(rank) + "/";
}

std::string Presence::Key(int rank) const { return RankFolder(rank) + "session"; }

std::vector<std::string> Presence::OthersKeys() const {
  std::vector<std::string> keys;
  for (int r = 0; r < ctx_.world; ++r) {
    if (r != ctx_.rank) keys.push_back(Key(r));
  }
  return keys;
}

void Presence::Announce() { announced_ = ctx_.store.SetEphemeral(Key(ctx_.rank), kCreated).ok(); }

void Presence::Connecting() {
  if (announced_ && !failed_) ctx_.store.SetEphemeral(Key(ctx_.rank), kConnecting).IgnoreError();
}

void Presence::Fail(const std::string& why) {
  if (!announced_ || failed_) return;
  failed_ = true;
  ctx_.store
      .MarkDead(Key(ctx_.rank),
                "sync rank " + std::to_string(ctx_.rank) + " failed before connect: " + why)
      .IgnoreError();
}

void Presence::Leave() {
  if (!announced_) return;
  announced_ = false;
  if (failed_) return;  // the dead key keeps telling late peers why
  // The key's own folder: a DeletePrefix of ".../1" would take rank 10's key too.
  ctx_.store.DeletePrefix(RankFolder(ctx_.rank)).status().IgnoreError();
}

Status Presence::PeerFailed(const Status& s) const {
  for (int r = 0; r < ctx_.world; ++r) {
    if (r == ctx_.rank) continue;
    auto v = ctx_.store.Get(Key(r), Millis(0));
    if (v.ok() || v.status().code() != StatusCode::kUnavailable) continue;
    // The store's message: "store get: key '<key>' is dead: <reason>".
    std::string why = v.status().message();
    const size_t at = why.find("is dead: ");
    if (at != std::string::npos) why = why.substr(at + 9);
    const std::string me =
        "sync rank " + std::to_string(ctx_.rank) + ": sync rank " + std::to_string(r);
    // Aborted, not Unavailable: waits before the claim read Unavailable as "no claim yet".
    if (why.find("failed before connect") != std::string::npos) {
      return AbortedError(me + " cannot join the job: " + why);
    }
    return AbortedError(me + " is gone before it joined the job (" + why + ")");
  }
  return s;
}

Status Presence::ExplainTimeout(Status s) const {
  if (s.code() != StatusCode::kDeadlineExceeded) return s;
  std::string never;
  for (int r = 0; r < ctx_.world; ++r) {
    if (r == ctx_.rank) continue;
    auto v = ctx_.store.Get(Key(r), Millis(0));
    std::string what;
    if (!v.ok()) {
      what = "no Session";
    } else if (*v == kCreated) {
      what = "Session created, connect() not called";
    } else {
      continue;
    }
    never += (never.empty() ? "" : ", ") + std::to_string(r) + " (" + what + ")";
  }
  if (never.empty()) return s;
  return DeadlineExceededError(s.message() + "; sync ranks that never reached connect(): " + never);
}

}  // namespace shardsync::sync_internal
