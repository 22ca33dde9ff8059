#include "shardsync/safetensors.h"

#include <gmock/gmock.h>
#include <gtest/gtest.h>

#include <sys/stat.h>
#include <unistd.h>
#include <chrono>

#include <cstring>
#include <filesystem>
#include <fstream>
#include <string>

namespace shardsync {
namespace {

namespace fs = std::filesystem;
using ::testing::HasSubstr;

// Builds a file from a header text and data bytes, exactly as written by hand.
std::vector<uint8_t> Raw(const std::string& header, const std::vector<uint8_t>& data,
                         uint64_t header_len_override = ~uint64_t{0}) {
  const uint64_t n = header_len_override != ~uint64_t{0} ? header_len_override : header.size();
  std::vector<uint8_t> out(8 + header.size() + data.size());
  for (int i = 0; i < 8; ++i) out[i] = static_cast<uint8_t>(n >> (8 * i));
  std::copy(header.begin(), header.end(), out.begin() + 8);
  std::copy(data.begin(), data.end(), out.begin() + 8 + header.size());
  return out;
}

class TempDir {
 public:
  TempDir() {
    char tmpl[] = "/tmp/ss_io_test_XXXXXX";
    path_ = ::mkdtemp(tmpl);
  }
  ~TempDir() {
    std::error_code ec;
    fs::remove_all(path_, ec);
  }
  std::string operator/(const std::string& f) const { return path_ + "/" + f; }
  const std::string& path() const { return path_; }

 private:
  std::string path_;
};

void WriteBytes(const std::string& path, const std::vector<uint8_t>& b) {
  std::ofstream(path, std::ios::binary).write(reinterpret_cast<const char*>(b.data()), b.size());
}

TEST(Safetensors, HandBuiltFileWithKnownBytesLoads) {
  // Two tensors: "a" F32 [2] = {1.0, -2.0}; "b" BF16 [1,2] = {0x3f80 (1.0), 0x4040 (3.0)}.
  const std::string header =
      R"({"b":{"dtype":"BF16","shape":[1,2],"data_offsets":[8,12]},)"
      R"("a":{"dtype":"F32","shape":[2],"data_offsets":[0,8]},"__metadata__":{"format":"pt"}})";
  std::vector<uint8_t> data = {0x00, 0x00, 0x80, 0x3f, 0x00, 0x00,
                               0x00, 0xc0, 0x80, 0x3f, 0x40, 0x40};
  TempDir dir;
  WriteBytes(dir / "x.safetensors", Raw(header, data));
  auto f = SafetensorsFile::Open(dir / "x.safetensors");
  ASSERT_TRUE(f.ok()) << f.status().ToString();
  EXPECT_EQ((*f)->header().metadata.at("format"), "pt");
  ASSERT_EQ((*f)->header().tensors.size(), 2u);
  EXPECT_EQ((*f)->header().tensors[0].name, "a");  // sorted by offset
  auto a = (*f)->Get("a");
  ASSERT_TRUE(a.ok());
  EXPECT_EQ(a->dtype, DType::kF32);
  EXPECT_EQ(a->shape, (Shape{2}));
  float av[2];
  std::memcpy(av, a->data.data(), 8);
  EXPECT_EQ(av[0], 1.0f);
  EXPECT_EQ(av[1], -2.0f);
  auto b = (*f)->Get("b");
  ASSERT_TRUE(b.ok());
  EXPECT_EQ(b->shape, (Shape{1, 2}));
  uint16_t bv[2];
  std::memcpy(bv, b->data.data(), 4);
  EXPECT_EQ(BF16ToF32(bv[0]), 1.0f);
  EXPECT_EQ(BF16ToF32(bv[1]), 3.0f);
  auto missing = (*f)->Get("c");
  EXPECT_EQ(missing.status().code(), StatusCode::kNotFound);
  EXPECT_THAT(missing.status().message(), HasSubstr("'c'"));
}

TEST(Safetensors, RoundTripThroughWriter) {
  std::vector<float> w = {1.5f, 2.5f, -3.f, 0.f, 7.f, 8.f};
  std::vector<uint16_t> h = {F32ToBF16(0.25f), F32ToBF16(-4.f)};
  std::vector<TensorToWrite> ts = {
      {"model.w", DType::kF32, {2, 3}, {reinterpret_cast<const uint8_t*>(w.data()), 24}},
      {"model.h", DType::kBF16, {2}, {reinterpret_cast<const uint8_t*>(h.data()), 4}},
      {"empty", DType::kF16, {0, 4}, {}},
  };
  TempDir dir;
  ASSERT_TRUE(WriteSafetensors(dir / "m.safetensors", ts, {{"k", "v"}}).ok());
  auto f = SafetensorsFile::Open(dir / "m.safetensors");
  ASSERT_TRUE(f.ok()) << f.status().ToString();
  EXPECT_EQ((*f)->header().data_start % 8, 0u);  // aligned data section
  EXPECT_EQ((*f)->header().metadata.at("k"), "v");
  for (const auto& t : ts) {
    auto v = (*f)->Get(t.name);
    ASSERT_TRUE(v.ok());
    EXPECT_EQ(v->dtype, t.dtype);
    EXPECT_EQ(v->shape, t.shape);
    ASSERT_EQ(v->data.size(), t.data.size());
    EXPECT_EQ(0, std::memcmp(v->data.data(), t.data.data(), t.data.size()));
  }
  // Re-serializing what was read gives the same bytes (deterministic writer).
  auto again = SerializeSafetensors(ts, {{"k", "v"}});
  ASSERT_TRUE(again.ok());
  std::ifstream in(dir / "m.safetensors", std::ios::binary);
  std::vector<uint8_t> disk((std::istreambuf_iterator<char>(in)), {});
  EXPECT_EQ(disk, *again);
}

TEST(Safetensors, WriterRejectsBadInput) {
  std::vector<uint8_t> four(4);
  auto dup = SerializeSafetensors({{"x", DType::kF32, {1}, four}, {"x", DType::kF32, {1}, four}});
  EXPECT_THAT(dup.status().message(), HasSubstr("duplicate tensor 'x'"));
  auto size = SerializeSafetensors({{"y", DType::kF32, {2}, four}});
  EXPECT_EQ(size.status().code(), StatusCode::kInvalidArgument);
  EXPECT_THAT(size.status().message(), HasSubstr("'y'"));
}

struct CorruptCase {
  const char* what;
  std::vector<uint8_t> bytes;
  StatusCode code;
  const char* needle;  // the message must name this (tensor or field)
};

TEST(Safetensors, EveryCorruptionClassHasItsError) {
  const std::vector<uint8_t> d8(8, 0);
  const std::string ok1 = R"({"t":{"dtype":"F32","shape":[2],"data_offsets":[0,8]}})";
  std::vector<CorruptCase> cases = {
      {"shorter than 8 bytes", {1, 2, 3}, StatusCode::kDataLoss, "shorter"},
      {"header length past the end", Raw(ok1, d8, 1000), StatusCode::kDataLoss, "truncated"},
      {"header length above the limit", Raw(ok1, d8, uint64_t{1} << 40),
       StatusCode::kInvalidArgument, "limit"},
      {"invalid JSON", Raw(R"({"t":{"dtype":)", {}), StatusCode::kInvalidArgument, "JSON"},
      {"not an object", Raw("[1,2]", {}), StatusCode::kInvalidArgument, "object"},
      {"unknown dtype", Raw(R"({"t":{"dtype":"F7","shape":[2],"data_offsets":[0,8]}})", d8),
       StatusCode::kInvalidArgument, "'t': unknown dtype"},
      {"negative shape", Raw(R"({"t":{"dtype":"F32","shape":[-2],"data_offsets":[0,8]}})", d8),
       StatusCode::kInvalidArgument, "'t'"},
      {"fractional shape", Raw(R"({"t":{"dtype":"F32","shape":[1.5],"data_offsets":[0,8]}})", d8),
       StatusCode::kInvalidArgument, "'t'"},
      {"shape overflow",
       Raw(R"({"t":{"dtype":"F32","shape":[4294967296,4294967296],"data_offsets":[0,8]}})", d8),
       StatusCode::kInvalidArgument, "overflow"},
      {"missing data_offsets", Raw(R"({"t":{"dtype":"F32","shape":[2]}})", d8),
       StatusCode::kInvalidArgument, "'t'"},
      {"end before begin", Raw(R"({"t":{"dtype":"F32","shape":[0],"data_offsets":[8,0]}})", d8),
       StatusCode::kInvalidArgument, "'t'"},
      {"size not dtype x numel",
       Raw(R"({"t":{"dtype":"F32","shape":[3],"data_offsets":[0,8]}})", d8),
       StatusCode::kInvalidArgument, "'t'"},
      {"truncated data", Raw(ok1, {0, 0, 0, 0}), StatusCode::kDataLoss, "'t'"},
      {"overlap",
       Raw(R"({"t":{"dtype":"F32","shape":[2],"data_offsets":[0,8]},)"
           R"("u":{"dtype":"F32","shape":[1],"data_offsets":[4,8]}})",
           d8),
       StatusCode::kDataLoss, "overlaps"},
      {"gap", Raw(R"({"t":{"dtype":"F32","shape":[1],"data_offsets":[4,8]}})", d8),
       StatusCode::kDataLoss, "'t': gap"},
      {"trailing bytes", Raw(ok1, std::vector<uint8_t>(12, 0)), StatusCode::kDataLoss, "trailing"},
      {"metadata not strings", Raw(R"({"__metadata__":{"a":1}})", {}), StatusCode::kInvalidArgument,
       "'a'"},
  };
  for (const auto& c : cases) {
    auto r = ParseSafetensorsHeader(c.bytes);
    ASSERT_FALSE(r.ok()) << c.what;
    EXPECT_EQ(r.status().code(), c.code) << c.what << ": " << r.status().ToString();
    EXPECT_THAT(r.status().message(), HasSubstr(c.needle)) << c.what;
  }
  // Sanity: the uncorrupted base case parses.
  EXPECT_TRUE(ParseSafetensorsHeader(Raw(ok1, d8)).ok());
}

TEST(Safetensors, TruncatedFileOnDiskNamesPathAndTensor) {
  std::vector<float> w(16, 1.f);
  auto bytes = SerializeSafetensors(
      {{"big", DType::kF32, {16}, {reinterpret_cast<const uint8_t*>(w.data()), 64}}});
  ASSERT_TRUE(bytes.ok());
  bytes->resize(bytes->size() - 5);
  TempDir dir;
  WriteBytes(dir / "t.safetensors", *bytes);
  auto f = SafetensorsFile::Open(dir / "t.safetensors");
  ASSERT_EQ(f.status().code(), StatusCode::kDataLoss);
  EXPECT_THAT(f.status().message(), HasSubstr("t.safetensors"));
  EXPECT_THAT(f.status().message(), HasSubstr("'big'"));
  EXPECT_EQ(SafetensorsFile::Open(dir / "nope.safetensors").status().code(), StatusCode::kNotFound);
}

TEST(Safetensors, ShardedCheckpointThroughIndex) {
  TempDir dir;
  std::vector<float> a = {1, 2}, b = {3, 4, 5};
  ASSERT_TRUE(WriteSafetensors(dir / "model-00001-of-00002.safetensors",
                               {{"a", DType::kF32, {2}, {reinterpret_cast<uint8_t*>(a.data()), 8}}})
                  .ok());
  ASSERT_TRUE(
      WriteSafetensors(dir / "model-00002-of-00002.safetensors",
                       {{"b", DType::kF32, {3}, {reinterpret_cast<uint8_t*>(b.data()), 12}}})
          .ok());
  {
    std::ofstream idx(dir / "model.safetensors.index.json");
    idx << R"({"metadata":{"total_size":20},"weight_map":{"a":"model-00001-of-00002.safetensors",)"
        << R"("b":"model-00002-of-00002.safetensors"}})";
  }
  auto c = SafetensorsCheckpoint::Open(dir.path());
  ASSERT_TRUE(c.ok()) << c.status().ToString();
  EXPECT_EQ((*c)->names(), (std::vector<std::string>{"a", "b"}));
  auto bv = (*c)->Get("b");
  ASSERT_TRUE(bv.ok());
  EXPECT_EQ(bv->shape, (Shape{3}));
  EXPECT_EQ((*c)->directory(), dir.path());
  EXPECT_EQ((*c)->Get("zz").status().code(), StatusCode::kNotFound);

  // The index names a tensor its file lacks: DataLoss naming it.
  {
    std::ofstream idx(dir / "model.safetensors.index.json");
    idx << R"({"weight_map":{"a":"model-00001-of-00002.safetensors",)"
        << R"("c":"model-00002-of-00002.safetensors"}})";
  }
  auto bad = SafetensorsCheckpoint::Open(dir.path());
  EXPECT_EQ(bad.status().code(), StatusCode::kDataLoss);
  EXPECT_THAT(bad.status().message(), HasSubstr("'c'"));
  // A shard path that escapes the directory is refused.
  {
    std::ofstream idx(dir / "model.safetensors.index.json");
    idx << R"({"weight_map":{"a":"../x.safetensors"}})";
  }
  EXPECT_EQ(SafetensorsCheckpoint::Open(dir.path()).status().code(), StatusCode::kInvalidArgument);
  // Single file path: directory is its parent.
  auto single = SafetensorsCheckpoint::Open(dir / "model-00001-of-00002.safetensors");
  ASSERT_TRUE(single.ok());
  EXPECT_EQ((*single)->directory(), dir.path());
}

// Issue 26: a checkpoint index may name a file that is a symlink to something the user cannot
// otherwise read; errors about it name the file and the byte offset, never its bytes.
// Issue 37: an 80 MB header of nested arrays cost 33 s and 5.95 GB in the JSON parser; deep
// nesting and long arrays are refused by a linear scan first, naming the byte.
TEST(Safetensors, DeeplyNestedOrLongArrayHeadersAreRefusedBeforeParsing) {
  const std::string deep =
      R"({"t": )" + std::string(4 << 20, '[') + std::string(4 << 20, ']') + "}";
  const auto t0 = std::chrono::steady_clock::now();
  auto r = ParseSafetensorsHeader(Raw(deep, {}));
  EXPECT_EQ(r.status().code(), StatusCode::kInvalidArgument);
  EXPECT_NE(r.status().message().find("nests deeper than 8 levels at byte"), std::string::npos)
      << r.status().ToString();
  std::string longer = R"({"t": {"dtype": "F32", "shape": [)";
  for (int i = 0; i < 100000; ++i) longer += "1,";
  longer += R"(1], "data_offsets": [0, 4]}})";
  auto l = ParseSafetensorsHeader(Raw(longer, {}));
  EXPECT_EQ(l.status().code(), StatusCode::kInvalidArgument);
  EXPECT_NE(l.status().message().find("an array of more than 64 items"), std::string::npos);
  EXPECT_LT(std::chrono::duration<double>(std::chrono::steady_clock::now() - t0).count(), 30.0);
  // Strings may hold any brackets: metadata is not nesting.
  const std::string meta =
      R"({"__metadata__": {"k": "[[[[[[[[[[[[[[[[[[[[,,,,"}, "t": {"dtype": "F32", "shape": [1], )"
      R"("data_offsets": [0, 4]}})";
  std::vector<uint8_t> d4(4, 0);
  EXPECT_TRUE(ParseSafetensorsHeader(Raw(meta, d4)).ok());
}

TEST(Safetensors, ErrorsNeverEchoTheFilesBytes) {
  TempDir dir;
  const std::string secret = "SECRET-PASSWORD-hunter2-and-more-secret-bytes\n";
  WriteBytes(dir / "secret.txt", std::vector<uint8_t>(secret.begin(), secret.end()));
  ASSERT_EQ(::symlink((dir / "secret.txt").c_str(), (dir / "model-1.safetensors").c_str()), 0);
  {
    std::ofstream idx(dir / "model.safetensors.index.json");
    idx << R"({"weight_map":{"a":"model-1.safetensors"}})";
  }
  auto c = SafetensorsCheckpoint::Open(dir.path());
  ASSERT_FALSE(c.ok());
  const std::string msg = c.status().message();
  EXPECT_THAT(msg, HasSubstr("model-1.safetensors"));
  EXPECT_THAT(msg, HasSubstr("bytes 0-7"));
  // Neither the text nor the number its first 8 bytes spell.
  EXPECT_EQ(msg.find("SECRET"), std::string::npos) << msg;
  uint64_t as_number = 0;
  std::memcpy(&as_number, secret.data(), 8);
  EXPECT_EQ(msg.find(std::to_string(as_number)), std::string::npos) << msg;

  // A JSON header that fails to parse: the offset, not the bytes nlohmann last read.
  auto bad_json = ParseSafetensorsHeader(Raw(R"({"t": SECRETVALUE})", {}));
  EXPECT_THAT(bad_json.status().message(), HasSubstr("near byte"));
  EXPECT_EQ(bad_json.status().message().find("SECRET"), std::string::npos);
  // A value in the header (a dtype) is not echoed; a name that is not a name is not either.
  auto bad_dtype = ParseSafetensorsHeader(Raw(
      R"({"t":{"dtype":"SECRET","shape":[2],"data_offsets":[0,8]}})", std::vector<uint8_t>(8, 0)));
  EXPECT_EQ(bad_dtype.status().message().find("SECRET"), std::string::npos);
  auto bad_name = ParseSafetensorsHeader(
      Raw("{\"SECRET\\n\":{\"dtype\":\"F7\",\"shape\":[2],\"data_offsets\":[0,8]}}",
          std::vector<uint8_t>(8, 0)));
  EXPECT_THAT(bad_name.status().message(), HasSubstr("<a 7-byte name>"));
  EXPECT_EQ(bad_name.status().message().find("SECRET"), std::string::npos);
}

// Issue 26: a file or symlink planted under the writer's temporary name is never opened or
// followed, and what is written is readable by this user only.
TEST(Safetensors, WriterIgnoresPlantedSymlinksAndWritesPrivateFiles) {
  TempDir dir;
  const std::string target = dir / "victim.txt";
  WriteBytes(target, {'k', 'e', 'e', 'p'});
  const std::string out = dir / "rank-3.safetensors";
  ASSERT_EQ(::symlink(target.c_str(), (out + ".tmp").c_str()), 0);
  std::vector<float> w = {1, 2};
  const std::vector<TensorToWrite> ts = {
      {"w", DType::kF32, {2}, {reinterpret_cast<uint8_t*>(w.data()), 8}}};
  ASSERT_TRUE(WriteSafetensors(out, ts).ok());
  auto read_all = [](const std::string& p) {
    std::ifstream in(p, std::ios::binary);
    return std::string((std::istreambuf_iterator<char>(in)), {});
  };
  EXPECT_EQ(read_all(target), "keep");
  struct stat st {};
  ASSERT_EQ(::lstat(out.c_str(), &st), 0);
  EXPECT_TRUE(S_ISREG(st.st_mode));
  EXPECT_EQ(st.st_mode & 0777, 0600u);
  EXPECT_TRUE(SafetensorsFile::Open(out).ok());
  // A symlink at the final name is replaced, its target left alone.
  ASSERT_EQ(::unlink(out.c_str()), 0);
  ASSERT_EQ(::symlink(target.c_str(), out.c_str()), 0);
  ASSERT_TRUE(WriteSafetensors(out, ts).ok());
  EXPECT_EQ(read_all(target), "keep");
  ASSERT_EQ(::lstat(out.c_str(), &st), 0);
  EXPECT_TRUE(S_ISREG(st.st_mode));
  // No temporary file is left behind (the planted symlink is still there, untouched).
  int files = 0;
  for (const auto& e : fs::directory_iterator(dir.path())) {
    files += e.is_regular_file() && !e.is_symlink() ? 1 : 0;
  }
  EXPECT_EQ(files, 2);  // victim.txt and rank-3.safetensors
  EXPECT_TRUE(fs::is_symlink(out + ".tmp"));
}

TEST(Safetensors, ConvertElements) {
  const float src[3] = {1.f, -0.5f, 3.f};
  uint16_t bf[3];
  ASSERT_TRUE(ConvertElements(DType::kF32, src, DType::kBF16, bf, 3).ok());
  float back[3];
  ASSERT_TRUE(ConvertElements(DType::kBF16, bf, DType::kF32, back, 3).ok());
  EXPECT_EQ(back[1], -0.5f);
  uint16_t hf[3];
  ASSERT_TRUE(ConvertElements(DType::kBF16, bf, DType::kF16, hf, 3).ok());
  EXPECT_EQ(F16ToF32(hf[2]), 3.f);
  int32_t i[3];
  EXPECT_EQ(ConvertElements(DType::kF32, src, DType::kI32, i, 3).code(),
            StatusCode::kUnimplemented);
}

}  // namespace
}  // namespace shardsync
