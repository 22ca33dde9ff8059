// Status and Result<T>: the error model of every shardsync API.
//
// A Status is a code plus a message that names the field, rank or tensor at fault. APIs that can
// fail return Status or Result<T>; no exception crosses a public API. Both are [[nodiscard]].
#pragma once

#include <cassert>
#include <string>
#include <string_view>
#include <utility>
#include <variant>

namespace shardsync {

enum class StatusCode : int {
  kOk = 0,
  kInvalidArgument = 1,     // the caller's input is wrong (a field, a size, a name)
  kFailedPrecondition = 2,  // the system is not in a state to do this (poisoned, not connected)
  kNotFound = 3,            // a named thing (tensor, key, file) does not exist
  kDataLoss = 4,            // bytes arrived wrong (checksum mismatch, corrupt file)
  kDeadlineExceeded = 5,    // a wait ran past its timeout
  kUnavailable = 6,         // a peer or service cannot be reached or died
  kInternal = 7,            // a bug or an unexpected library error
  kUnimplemented = 8,       // not supported by this build or transport
  kPermissionDenied = 9,    // wrong token
  kAborted = 10,            // cancelled because another rank failed
  kOutOfRange = 11,         // an index or region outside its bounds
};

// Stable lower-case name of a code ("invalid_argument").
std::string_view StatusCodeName(StatusCode code);

class [[nodiscard]] Status {
 public:
  Status() = default;
  Status(StatusCode code, std::string message) : code_(code), message_(std::move(message)) {}

  static Status Ok() { return Status(); }
  bool ok() const { return code_ == StatusCode::kOk; }
  StatusCode code() const { return code_; }
  const std::string& message() const { return message_; }
  // "invalid_argument: --tp: must be positive, got 0"
  std::string ToString() const;
  // Prefixes the message with context ("rank 3: " + message); no-op on OK.
  Status& Annotate(std::string_view context);
  // Explicitly discards a status (logging paths, best-effort cleanup).
  void IgnoreError() const {}

  friend bool operator==(const Status& a, const Status& b) {
    return a.code_ == b.code_ && a.message_ == b.message_;
  }

 private:
  StatusCode code_ = StatusCode::kOk;
  std::string message_;
};

inline Status OkStatus() { return Status(); }
Status InvalidArgumentError(std::string message);
Status FailedPreconditionError(std::string message);
Status NotFoundError(std::string message);
Status DataLossError(std::string message);
Status DeadlineExceededError(std::string message);
Status UnavailableError(std::string message);
Status InternalError(std::string message);
Status UnimplementedError(std::string message);
Status PermissionDeniedError(std::string message);
Status AbortedError(std::string message);
Status OutOfRangeError(std::string message);

// Result<T> holds a T or a non-OK Status.
template <typename T>
class [[nodiscard]] Result {
 public:
  Result(T value) : v_(std::move(value)) {}        // NOLINT: implicit by design
  Result(Status status) : v_(std::move(status)) {  // NOLINT
    assert(!std::get<Status>(v_).ok() && "Result constructed from an OK status");
    if (std::get<Status>(v_).ok()) v_ = Status(StatusCode::kInternal, "Result from OK status");
  }

  bool ok() const { return std::holds_alternative<T>(v_); }
  Status status() const { return ok() ? Status() : std::get<Status>(v_); }

  T& value() & { return std::get<T>(v_); }
  const T& value() const& { return std::get<T>(v_); }
  T&& value() && { return std::get<T>(std::move(v_)); }
  T& operator*() & { return value(); }
  const T& operator*() const& { return value(); }
  T&& operator*() && { return std::move(*this).value(); }
  T* operator->() { return &value(); }
  const T* operator->() const { return &value(); }
  T value_or(T other) const& { return ok() ? value() : std::move(other); }

 private:
  std::variant<T, Status> v_;
};

namespace internal {
inline Status AsStatus(const Status& s) { return s; }
template <typename T>
Status AsStatus(const Result<T>& r) {
  return r.status();
}
}  // namespace internal

}  // namespace shardsync

#define SS_CONCAT_INNER_(a, b) a##b
#define SS_CONCAT_(a, b) SS_CONCAT_INNER_(a, b)

// Returns early with the error of a Status or Result expression.
#define SS_RETURN_IF_ERROR(expr)                                              \
  do {                                                                        \
    ::shardsync::Status ss_status_ = ::shardsync::internal::AsStatus((expr)); \
    if (!ss_status_.ok()) return ss_status_;                                  \
  } while (0)

// SS_ASSIGN_OR_RETURN(auto x, MakeX()); declares/assigns x or returns the error.
#define SS_ASSIGN_OR_RETURN(lhs, expr) \
  SS_ASSIGN_OR_RETURN_IMPL_(SS_CONCAT_(ss_result_, __LINE__), lhs, expr)
#define SS_ASSIGN_OR_RETURN_IMPL_(tmp, lhs, expr) \
  auto tmp = (expr);                              \
  if (!tmp.ok()) return tmp.status();             \
  lhs = std::move(tmp).value()
