#include "sync/launch_mac.h"

#include <openssl/crypto.h>
#include <openssl/evp.h>
#include <openssl/hmac.h>

namespace shardsync::sync_internal {

std::string LaunchMac(std::string_view secret, std::string_view message) {
  if (secret.empty()) return "";
  unsigned char md[EVP_MAX_MD_SIZE];
  unsigned int len = 0;
  if (HMAC(EVP_sha256(), secret.data(), static_cast<int>(secret.size()),
           reinterpret_cast<const unsigned char*>(message.data()), message.size(), md,
           &len) == nullptr) {
    return "";  // never verifies: LaunchMacEquals refuses an empty proof
  }
  static constexpr char kHex[] = "0123456789abcdef";
  std::string out;
  out.reserve(2 * len);
  for (unsigned int i = 0; i < len; ++i) {
    out.push_back(kHex[md[i] >> 4]);
    out.push_back(kHex[md[i] & 15]);
  }
  return out;
}

bool LaunchMacEquals(std::string_view a, std::string_view b) {
  return !a.empty() && a.size() == b.size() && CRYPTO_memcmp(a.data(), b.data(), a.size()) == 0;
}

}  // namespace shardsync::sync_internal
