#include "sync/verdicts.h"

#include <unistd.h>

#include <algorithm>
#include <charconv>
#include <cstdlib>
#include <random>

#include "shardsync/settings.h"

namespace shardsync::sync_internal {

void VerdictExchange::Post(const RankSyncStats& st) {
  posted_ = {ctx_.Key(guard_.VKey("done/") + std::to_string(ctx_.rank)), EncodeVerdict(st)};
  if (board_) board_->Post(ctx_.rank, guard_.version(), posted_.second);
  // The whole text, and for store readers.
  if (!st.ok) ctx_.store.Set(posted_.first, posted_.second).IgnoreError();
}

Result<SyncReport> VerdictExchange::Gather(const RankSyncStats& local) {
  SyncReport rep;
  rep.version = guard_.version();
  rep.local = local;
  std::vector<std::string> keys;
  std::vector<int> others;
  for (int r = 0; r < ctx_.world; ++r) {
    if (r == ctx_.rank) continue;
    if (!board_) keys.push_back(ctx_.Key(guard_.VKey("done/") + std::to_string(r)));
    others.push_back(r);
  }
  auto what = [&](size_t i) {
    return "the sync report of sync rank " + std::to_string(others[i]) + " (version " +
           std::to_string(guard_.version()) + ")";
  };
  // Every other rank's verdict from the board (ours is posted), else in one store round trip.
  SS_ASSIGN_OR_RETURN(
      std::vector<std::string> texts,
      board_ ? BoardVerdicts(others, what)
             : guard_.GetManyUntil(keys, guard_.deadline(), what, /*watch_abort=*/true, &posted_));
  for (int r = 0, next = 0; r < ctx_.world; ++r) {
    RankSyncStats s;
    if (r == ctx_.rank) {
      s = local;
    } else {
      SS_ASSIGN_OR_RETURN(s, DecodeVerdict(texts[next++], r));
    }
    if (!s.ok) {
      return AbortedError("sync rank " + std::to_string(ctx_.rank) + ": version " +
                          std::to_string(guard_.version()) + " failed on sync rank " +
                          std::to_string(r) + ": " + s.error);
    }
    rep.bytes += s.recv_bytes;
    // The senders' figures are what crossed the wire; the receivers add their decode time.
    if (r < ctx_.in.trainer.world())
      rep.delta.Add(s.delta);
    else
      rep.delta.decode_seconds += s.delta.decode_seconds;
    rep.checksums_ok += s.checksums_ok;
    rep.checksums_total += s.checksums_total;
    if (s.seconds > rep.seconds) {
      rep.seconds = s.seconds;
      rep.slowest_rank = r;
    }
    rep.ranks.push_back(std::move(s));
  }
  if (rep.checksums_ok != rep.checksums_total) {
    return DataLossError("version " + std::to_string(guard_.version()) + ": only " +
                         std::to_string(rep.checksums_ok) + " of " +
                         std::to_string(rep.checksums_total) + " checksums verified");
  }
  rep.gbps = rep.seconds > 0 ? rep.bytes / rep.seconds / 1e9 : 0;
  return rep;
}

Result<std::vector<std::string>> VerdictExchange::BoardVerdicts(
    const std::vector<int>& others, const std::function<std::string(size_t)>& what) {
  std::vector<std::string> texts(others.size());
  std::vector<size_t> left(others.size());
  for (size_t i = 0; i < left.size(); ++i) left[i] = i;
  auto idle_since = Clock::now();
  auto next_progress = idle_since + Millis(5);
  while (true) {
    bool progressed = false;
    for (size_t k = 0; k < left.size();) {
      const size_t i = left[k];
      const auto got = board_->Get(others[i], guard_.version(), &texts[i]);
      if (got == VerdictBoard::Lookup::kOverwritten) {
        return AbortedError("sync rank " + std::to_string(ctx_.rank) + ": sync rank " +
                            std::to_string(others[i]) + " moved past version " +
                            std::to_string(guard_.version()) + " before its report was read");
      }
      if (got == VerdictBoard::Lookup::kFound) {
        left.erase(left.begin() + k);
        progressed = true;
      } else {
        ++k;
      }
    }
    if (left.empty()) return texts;
    const auto now = Clock::now();
    if (now > guard_.deadline()) {
      return DeadlineExceededError("sync rank " + std::to_string(ctx_.rank) +
                                   ": timed out waiting for " + what(left[0]));
    }
    if (now >= next_progress) {  // as often as the store path's slices
      next_progress = now + Millis(5);
      guard_.Progress();
    }
    SS_RETURN_IF_ERROR(guard_.CheckAbort());
    SyncGuard::PairBackoff(progressed, idle_since);
  }
}

Result<std::string> VerdictExchange::MapBoard(Clock::time_point deadline, bool want,
                                              std::unique_ptr<VerdictBoard>* mapped) {
  std::unique_ptr<VerdictBoard>& board = *mapped;
  std::string published = "none";
  if (ctx_.rank == 0) {
    if (want) {
      std::random_device rd;
      const uint64_t nonce = (uint64_t{rd()} << 32 | rd()) ^ static_cast<uint64_t>(getpid()) ^
                             static_cast<uint64_t>(Clock::now().time_since_epoch().count());
      auto b = VerdictBoard::Create(VerdictBoardName(nonce), ctx_.world, nonce, ctx_.job_tag);
      if (b.ok()) {
        board = std::move(*b);
        published = std::to_string(nonce);
      } else {
        Trace(ctx_.rank, 0, [&] { return "verdict board: " + b.status().ToString(); });
      }
    }
    SS_RETURN_IF_ERROR(ctx_.store.Set(ctx_.Key("vboard"), published));
  } else {
    SS_ASSIGN_OR_RETURN(auto got,
                        guard_.GetFromRanks({ctx_.Key("vboard")}, {0}, deadline, [](size_t) {
                          return std::string("the verdict board of sync rank 0");
                        }));
    published = std::move(got[0]);
    uint64_t nonce = 0;
    const auto [end, ec] =
        std::from_chars(published.data(), published.data() + published.size(), nonce);
    if (published != "none" && (ec != std::errc() || end != published.data() + published.size())) {
      return DataLossError("verdict board of sync rank 0 is malformed: '" + published + "'");
    }
    if (want && published != "none") {
      auto b = VerdictBoard::Open(VerdictBoardName(nonce), ctx_.world, nonce, ctx_.job_tag);
      if (b.ok()) {
        board = std::move(*b);
      } else {
        Trace(ctx_.rank, 0, [&] { return "verdict board: " + b.status().ToString(); });
      }
    }
  }
  return published;
}

Status VerdictExchange::Open(Clock::time_point deadline) {
  if (ctx_.world < 2) return OkStatus();
  SS_ASSIGN_OR_RETURN(const bool env, BoolKnob("SHARDSYNC_VERDICT_BOARD"));
  const bool want = ctx_.opt.shared_memory_verdicts && env;
  std::unique_ptr<VerdictBoard> board;
  SS_ASSIGN_OR_RETURN(const std::string published, MapBoard(deadline, want, &board));
  if (published == "none") return OkStatus();  // no board for anyone
  // Keyed by the nonce: a rank that read a previous connect's key (a reused prefix) answers
  // under that one, and the others then fail this Connect by its deadline, naming it, instead
  // of waiting on a board it never posts to.
  const std::string base = "vboard/" + published + "/";
  std::vector<std::string> keys;
  std::vector<int> others;
  for (int r = 0; r < ctx_.world; ++r) {
    if (r == ctx_.rank) continue;
    keys.push_back(ctx_.Key(base + std::to_string(r)));
    others.push_back(r);
  }
  const std::pair<std::string, std::string> mine{ctx_.Key(base + std::to_string(ctx_.rank)),
                                                 board ? "1" : "0"};
  auto what = [&](size_t i) {
    return "whether sync rank " + std::to_string(others[i]) + " mapped the verdict board";
  };
  SS_ASSIGN_OR_RETURN(std::vector<std::string> mapped,
                      guard_.GetFromRanks(keys, others, deadline, what, &mine));
  const bool all = board && std::all_of(mapped.begin(), mapped.end(),
                                        [](const std::string& m) { return m == "1"; });
  if (all) {
    board->Unlink();  // every rank has it mapped (a no-op but on rank 0)
    board_ = std::move(board);
  }
  return OkStatus();
}

}  // namespace shardsync::sync_internal
