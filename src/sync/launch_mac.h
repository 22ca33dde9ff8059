// Proofs of the launch secret (store.h LaunchId::secret): what a rank writes beside its claim of
// the prefix, its slot and the seal, so that a process without the secret cannot take a slot of
// the job, even with the job's id (ids are not secret) or a value copied from the store (every
// proof binds the prefix, the job's nonce and the slot).
#pragma once

#include <string>
#include <string_view>

namespace shardsync::sync_internal {

// HMAC-SHA256 (RFC 2104) of `message` under `secret`, as 64 hex characters. OpenSSL's libcrypto
// computes it: a keyed hash such as XXH3 with a secret is no MAC (xxhash.h promises only that a
// secret makes collisions harder to prepare), and the store holds the proofs where every token
// holder reads them. "" when `secret` is empty.
std::string LaunchMac(std::string_view secret, std::string_view message);
// Constant-time comparison of two proofs (CRYPTO_memcmp); false when the sizes differ or either
// is empty.
bool LaunchMacEquals(std::string_view a, std::string_view b);

}  // namespace shardsync::sync_internal
