// Python wording of C++ error messages: the library's messages name the CLI's flags ("--tp 3:
// ...", "--wire-dtype: ..."), which a Python caller never typed. The binding boundary rewrites
// each flag into the argument the caller did pass ("rollout tp=3: ...", "wire_dtype: ..."), so
// the CLI's messages stay as they are.
#include <cctype>
#include <string>
#include <string_view>

#include "common.h"

namespace shardsync::py_bind {

namespace {

bool IsNameChar(char c) {
  return std::islower(static_cast<unsigned char>(c)) || std::isdigit(static_cast<unsigned char>(c));
}

// The Python argument a CLI flag corresponds to.
std::string ArgumentName(const std::string& flag) {
  if (flag == "bucket-mb") return "bucket_bytes";
  if (flag == "gpus-per-node-list") return "node_gpus";
  std::string out = flag;
  for (char& c : out) {
    if (c == '-') c = '_';
  }
  return out;
}

bool IsRolloutField(const std::string& flag) {
  return flag == "dp" || flag == "tp" || flag == "pp" || flag == "ep";
}

}  // namespace

std::string PythonWording(std::string_view msg, Wording wording) {
  std::string out;
  out.reserve(msg.size() + 16);
  size_t i = 0;
  while (i < msg.size()) {
    const bool at_flag = msg.compare(i, 2, "--") == 0 && i + 2 < msg.size() &&
                         std::islower(static_cast<unsigned char>(msg[i + 2])) &&
                         (i == 0 || !(std::isalnum(static_cast<unsigned char>(msg[i - 1])) ||
                                      msg[i - 1] == '-' || msg[i - 1] == '_'));
    if (!at_flag) {
      out += msg[i++];
      continue;
    }
    size_t j = i + 2;
    while (j < msg.size() && (IsNameChar(msg[j]) ||
                              (msg[j] == '-' && j + 1 < msg.size() && IsNameChar(msg[j + 1])))) {
      ++j;
    }
    const std::string flag(msg.substr(i + 2, j - i - 2));
    std::string name = ArgumentName(flag);
    if (IsRolloutField(flag)) {
      // "--tp 3" -> "tp=3": the spelling of the rollout spec and of keyword arguments.
      size_t k = j;
      if (k + 1 < msg.size() && msg[k] == ' ' &&
          std::isdigit(static_cast<unsigned char>(msg[k + 1]))) {
        ++k;
        while (k < msg.size() && std::isdigit(static_cast<unsigned char>(msg[k]))) ++k;
        name += "=" + std::string(msg.substr(j + 1, k - j - 1));
        j = k;
      }
      if (wording == Wording::kRollout) name = "rollout " + name;
    }
    out += name;
    i = j;
  }
  return out;
}

}  // namespace shardsync::py_bind
