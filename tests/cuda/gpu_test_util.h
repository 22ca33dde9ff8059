// Shared helpers of the GPU tests.
#pragma once

#include <gtest/gtest.h>

#include <string>

#include "shardsync/gpu.h"

// Skips (visibly, with the reason) where no GPU is usable: CI, or a build without CUDA.
#define SS_REQUIRE_GPU()                               \
  do {                                                 \
    std::string ss_why_;                               \
    if (!::shardsync::gpu::Available(&ss_why_)) {      \
      GTEST_SKIP() << "GPU test skipped: " << ss_why_; \
    }                                                  \
  } while (0)

#define SS_REQUIRE_GPUS(n)                                                               \
  do {                                                                                   \
    SS_REQUIRE_GPU();                                                                    \
    auto ss_n_ = ::shardsync::gpu::DeviceCount();                                        \
    if (!ss_n_.ok() || *ss_n_ < (n)) {                                                   \
      GTEST_SKIP() << "GPU test skipped: needs " << (n) << " GPUs, found "               \
                   << (ss_n_.ok() ? std::to_string(*ss_n_) : ss_n_.status().ToString()); \
    }                                                                                    \
  } while (0)

#define SS_ASSERT_OK(expr)                       \
  do {                                           \
    const ::shardsync::Status ss_s_ = (expr);    \
    ASSERT_TRUE(ss_s_.ok()) << ss_s_.ToString(); \
  } while (0)

#define SS_ASSERT_OK_AND_ASSIGN(lhs, expr) \
  SS_ASSERT_OK_AND_ASSIGN_IMPL_(SS_CONCAT_(ss_t_, __LINE__), lhs, expr)
#define SS_ASSERT_OK_AND_ASSIGN_IMPL_(tmp, lhs, expr) \
  auto tmp = (expr);                                  \
  ASSERT_TRUE(tmp.ok()) << tmp.status().ToString();   \
  lhs = std::move(tmp).value()
