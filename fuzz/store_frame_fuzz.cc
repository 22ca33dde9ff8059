// Fuzzes the store's frame parser (the bytes every store connection feeds the server).
// Properties: never crashes; whatever parses re-encodes to the exact input (the format is
// canonical); the header parser agrees with the full parser.
#include <cstddef>
#include <cstdint>
#include <string_view>

#include "store/frame.h"

extern "C" int LLVMFuzzerTestOneInput(const uint8_t* data, size_t size) {
  using namespace shardsync::store_wire;
  std::string_view bytes(reinterpret_cast<const char*>(data), size);
  auto header = ParseFrameHeader(bytes, kMaxHelloPayloadBytes);
  auto frame = ParseFrame(bytes, kMaxHelloPayloadBytes);
  if (frame.ok()) {
    if (!header.ok()) __builtin_trap();
    if (EncodeFrame(*frame) != bytes) __builtin_trap();
  }
  ParseFrame(bytes).status().IgnoreError();
  return 0;
}
