// Single-producer single-consumer mailbox in POSIX shared memory: the control-message channel of
// the cuda_ipc transport (same node by construction). Chosen over the store (whose Get blocks and
// whose client the transport does not own after Connect) and over a host transport (cuda_ipc then
// works without UCX). Each direction of a peer pair has its own ring, created by the receiver.
#pragma once

#include <atomic>
#include <cstdint>
#include <string>

#include "shardsync/status.h"

namespace shardsync::gpu::internal {

inline constexpr uint32_t kMailboxSlots = 32;
inline constexpr uint64_t kMailboxSlotBytes = 64 << 10;

struct MailboxHeader {
  alignas(64) std::atomic<uint64_t> head;  // messages written (sender)
  alignas(64) std::atomic<uint64_t> tail;  // messages consumed (receiver)
  alignas(64) std::atomic<uint32_t> sender_closed;
  std::atomic<uint32_t> receiver_closed;
  std::atomic<int32_t> sender_pid;
  std::atomic<int32_t> receiver_pid;
};

struct MailboxSlot {
  uint64_t tag;
  uint64_t bytes;
  unsigned char data[kMailboxSlotBytes];
};

class Mailbox {
 public:
  // Receiver side: creates (replacing a stale one) and maps the segment.
  static Result<Mailbox*> Create(const std::string& name);
  // Sender side: maps a segment the receiver created.
  static Result<Mailbox*> Open(const std::string& name);
  ~Mailbox();
  Mailbox(const Mailbox&) = delete;
  Mailbox& operator=(const Mailbox&) = delete;

  // false when the ring is full (try again later).
  bool TrySend(uint64_t tag, const void* data, uint64_t bytes);
  // false when empty; else copies the oldest message into (tag, out) (out sized by the caller via
  // PeekBytes).
  bool Peek(uint64_t* tag, uint64_t* bytes) const;
  const unsigned char* PeekData() const;
  void Pop();
  MailboxHeader* header() { return hdr_; }
  void Unlink();

 private:
  Mailbox(std::string name, void* map, size_t len, bool owner);
  std::string name_;
  void* map_;
  size_t len_;
  bool owner_;
  bool unlinked_ = false;
  MailboxHeader* hdr_;
  MailboxSlot* slots_;
};

}  // namespace shardsync::gpu::internal
