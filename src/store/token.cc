// Store tokens: the minimum length every server and client enforces, and fresh random ones.
#include <sys/random.h>

#include <cerrno>

#include "shardsync/store.h"
#include "store/net.h"

namespace shardsync {

Status CheckStoreToken(std::string_view token, std::string_view what) {
  if (token.size() < kMinStoreTokenChars) {
    return InvalidArgumentError(std::string(what) + ": " + std::to_string(token.size()) +
                                " characters, at least " + std::to_string(kMinStoreTokenChars) +
                                " required (generate one: openssl rand -hex 16)");
  }
  return OkStatus();
}

Result<std::string> GenerateStoreToken() {
  unsigned char b[16];
  size_t got = 0;
  while (got < sizeof(b)) {
    const ssize_t n = getrandom(b + got, sizeof(b) - got, 0);
    if (n < 0 && errno == EINTR) continue;
    if (n <= 0) return store_net::ErrnoStatus(StatusCode::kInternal, "getrandom", errno);
    got += static_cast<size_t>(n);
  }
  static constexpr char kHex[] = "0123456789abcdef";
  std::string s;
  for (unsigned char c : b) {
    s.push_back(kHex[c >> 4]);
    s.push_back(kHex[c & 15]);
  }
  return s;
}

}  // namespace shardsync
