// The delta encoding's figures of a sync as `demo --json` and `bench --json` print them: the
// job-wide sums of session.h DeltaSyncStats, laid out as Python's report["delta"] dict.
#pragma once

#include <nlohmann/json.hpp>

#include "shardsync/session.h"

namespace shardsync::cli {

inline nlohmann::json DeltaReportJson(const DeltaSyncStats& d) {
  return {{"wire_bytes", d.wire_bytes},
          {"full_bytes", d.full_bytes},
          {"density", d.elements ? static_cast<double>(d.changed) / d.elements : 0.0},
          {"changed", d.changed},
          {"elements", d.elements},
          {"buckets_delta", d.buckets_delta},
          {"buckets_full", d.buckets_full},
          {"fallbacks",
           {{"no_kept_image", d.fallback_no_image},
            {"base_version_differs", d.fallback_version},
            {"base_checksum_differs", d.fallback_checksum}}},
          {"full_by_size", d.full_by_size},
          {"full_by_cost", d.full_by_cost},
          {"full_by_auto", d.full_by_auto},
          {"encode_seconds", d.encode_seconds},
          {"decode_seconds", d.decode_seconds}};
}

}  // namespace shardsync::cli
