#include <kmamba/core/Core.hpp>
#include <kmamba/models/SafeTensors.hpp>
#include "Checks.hpp"
#include "TestData.hpp"

#include <gtest/gtest.h>

#include <chrono>
#include <cstdint>
#include <cstdio>
#include <fstream>
#include <limits>
#include <string>
#include <vector>

#include <sys/stat.h>
#include <unistd.h>

namespace {

std::string scratch(const std::string& name) { return ::testing::TempDir() + "kmamba_safetensors_" + name; }

// Writes a raw file: 8-byte length, the given header text, then `data_bytes` bytes of payload.
void write_raw(const std::string& path, const std::string& header, std::size_t data_bytes,
               std::uint64_t declared_length = UINT64_MAX) {
  std::ofstream out(path, std::ios::binary);
  const std::uint64_t length = declared_length == UINT64_MAX ? header.size() : declared_length;
  for (int i = 0; i < 8; ++i) out.put(static_cast<char>((length >> (8 * i)) & 0xff));
  out << header;
  for (std::size_t i = 0; i < data_bytes; ++i) out.put(static_cast<char>(i));
}

// Expects opening `path` to throw a kmamba::UserError mentioning `fragment`.
void expect_reader_error(const std::string& path, const std::string& fragment) {
  SCOPED_TRACE(path);
  kmamba::test::expect_user_error([&] { kmamba::SafeTensorsReader reader(path); }, {fragment});
}

TEST(SafeTensors, RoundTripsEveryWrittenTensor) {
  const std::string path = scratch("roundtrip.safetensors");
  std::vector<float> a(2 * 3 * 4);
  for (std::size_t i = 0; i < a.size(); ++i) a[i] = kmamba::normal_at(11, i);
  const std::vector<std::int64_t> ids = {5, -7, 1ll << 40};
  std::vector<std::uint16_t> half(6);
  for (std::size_t i = 0; i < half.size(); ++i) half[i] = kmamba::float_to_bf16_bits(kmamba::normal_at(12, i));
  kmamba::SafeTensorsWriter writer;
  writer.add_f32("layer.weight", {2, 3, 4}, a);
  writer.add_i64("input_ids", {3}, ids);
  writer.add("half", kmamba::DType::BF16, {2, 3}, half.data());
  writer.add_f32("scalar", {}, {2.5f});
  writer.set_metadata("format", "pt");
  writer.write(path);

  kmamba::SafeTensorsReader reader(path);
  EXPECT_EQ(reader.names(), (std::vector<std::string>{"layer.weight", "input_ids", "half", "scalar"}));
  EXPECT_EQ(reader.metadata().at("format"), "pt");
  EXPECT_EQ(reader.info("layer.weight").shape, (std::vector<std::int64_t>{2, 3, 4}));
  EXPECT_EQ(reader.read_f32("layer.weight"), a);
  EXPECT_EQ(reader.read_i64("input_ids"), ids);
  const std::vector<float> h = reader.read_f32("half");
  for (std::size_t i = 0; i < half.size(); ++i) EXPECT_EQ(h[i], kmamba::bf16_bits_to_float(half[i]));
  EXPECT_EQ(reader.read_f32("scalar"), std::vector<float>{2.5f});
  EXPECT_NO_THROW(reader.check_shape("input_ids", {3}));
  try {
    reader.check_shape("layer.weight", {3, 2, 4});
    FAIL() << "no exception";
  } catch (const kmamba::UserError& e) {
    EXPECT_NE(std::string(e.what()).find("'layer.weight'"), std::string::npos) << e.what();
    EXPECT_NE(std::string(e.what()).find("(2, 3, 4) but (3, 2, 4)"), std::string::npos) << e.what();
  }
  EXPECT_THROW(reader.read_i64("layer.weight"), kmamba::UserError);
  EXPECT_THROW(reader.info("missing"), kmamba::UserError);
}

TEST(SafeTensors, ReadsTheGoldenFiles) {
  kmamba::SafeTensorsReader reader(kmamba::test::golden_dir() + "/ssd_small.safetensors");
  EXPECT_EQ(reader.info("x").shape, (std::vector<std::int64_t>{2, 45, 4, 8}));
  EXPECT_EQ(reader.info("seq_idx").dtype, kmamba::DType::I64);
  EXPECT_EQ(reader.read_f32("x").size(), 2u * 45 * 4 * 8);
  EXPECT_EQ(reader.config_number("chunk_size", 0.0), 16.0);
  EXPECT_TRUE(reader.config_bool("dt_softplus", false));
  EXPECT_EQ(reader.config_numbers("dt_limit", {}), (std::vector<double>{0.0, std::numeric_limits<double>::infinity()}));
  EXPECT_EQ(reader.config_number("absent", 7.0), 7.0);
  EXPECT_THROW(reader.config_bool("chunk_size", false), kmamba::UserError);
  EXPECT_THROW(reader.config_numbers("chunk_size", {}), kmamba::UserError);
}

/// A file whose header (declared `declared_length` bytes long, UINT64_MAX: its own length) is followed
/// by `data_bytes` bytes, and the fragment of the reader's error about it.
struct MalformedFile {
  std::string header;
  std::size_t data_bytes;
  std::uint64_t declared_length;
  std::string error;
};

TEST(SafeTensors, RejectsMalformedFilesWithClearErrors) {
  const std::string p = scratch("bad.safetensors");
  std::ofstream(p, std::ios::binary) << "abc";
  expect_reader_error(p, "shorter than the 8-byte header length");
  const std::vector<MalformedFile> files = {
      {"{}", 0, 1000, "declares a 1000-byte header"},
      {"{\"a\": ", 0, UINT64_MAX, "not valid JSON"},
      {"[1, 2]", 0, UINT64_MAX, "not a JSON object"},
      {R"({"a": {"dtype": "Q7", "shape": [1], "data_offsets": [0, 4]}})", 4, UINT64_MAX, "unsupported dtype 'Q7'"},
      {R"({"a": {"dtype": "F32", "shape": [2], "data_offsets": [0, 8]}})", 4, UINT64_MAX,
       "outside the 4-byte data section"},
      {R"({"a": {"dtype": "F32", "shape": [3], "data_offsets": [0, 8]}})", 8, UINT64_MAX, "which needs 12"},
      {R"({"a": {"dtype": "F32", "shape": [-1], "data_offsets": [0, 4]}})", 4, UINT64_MAX,
       "not a non-negative integer"},
      {R"({"a": {"dtype": "F32", "shape": [4294967296, 4294967296], "data_offsets": [0, 4]}})", 4, UINT64_MAX,
       "larger than the file"},
      {R"({"a": {"dtype": "F32", "shape": [0, 18446744073709551615], "data_offsets": [0, 0]}})", 0, UINT64_MAX,
       "extent beyond 2^63 - 1"},
      {"{\"a\xff\": {\"dtype\": \"F32\", \"shape\": [1], \"data_offsets\": [0, 4]}}", 4, UINT64_MAX, "not valid JSON"},
      {R"({"a": {"dtype": "F32", "shape": [2], "data_offsets": [0, 8]},)"
       R"( "b": {"dtype": "F32", "shape": [2], "data_offsets": [4, 12]}})",
       12, UINT64_MAX, "overlap"},
      {R"({"a": {"dtype": "F32", "shape": [1], "data_offsets": [0, 4]},)"
       R"( "a": {"dtype": "F32", "shape": [1], "data_offsets": [4, 8]}})",
       8, UINT64_MAX, "names the key \"a\" twice"},
      {R"({"a": {"dtype": "F32", "shape": [1]}})", 4, UINT64_MAX, "needs dtype, shape and data_offsets"},
      {R"({"__metadata__": {"k": 3}})", 0, UINT64_MAX, "metadata entry 'k' is not a string"},
  };
  for (const MalformedFile& file : files) {
    write_raw(p, file.header, file.data_bytes, file.declared_length);
    expect_reader_error(p, file.error);
  }
  expect_reader_error(scratch("does_not_exist.safetensors"), "cannot open");
}

TEST(SafeTensors, FailedWriteLeavesThePreviousFile) {
  const std::string path = scratch("atomic.safetensors");
  kmamba::SafeTensorsWriter first;
  first.add_f32("w", {2}, {1.0f, 2.0f});
  first.write(path);
  kmamba::SafeTensorsWriter second;
  second.add_f32("w", {2}, {3.0f, 4.0f});
  EXPECT_THROW(second.write(scratch("no_such_dir/atomic.safetensors")), kmamba::UserError);
  EXPECT_EQ(kmamba::SafeTensorsReader(path).read_f32("w"), (std::vector<float>{1.0f, 2.0f}));
  second.write(path);
  EXPECT_EQ(kmamba::SafeTensorsReader(path).read_f32("w"), (std::vector<float>{3.0f, 4.0f}));
  std::ifstream leftover(path + ".tmp." + std::to_string(::getpid()));
  EXPECT_FALSE(leftover.good()) << "the temporary file was left behind";
  EXPECT_THROW(second.add_f32("w", {2}, {0.0f, 0.0f}), kmamba::UserError);
  EXPECT_THROW(second.add_f32("v", {3}, {0.0f, 0.0f}), kmamba::UserError);
}

TEST(SafeTensors, DeeplyNestedHeaderValuesAreRefusedWithoutRecursion) {
  // Quoting such a value in the error message overflowed the stack (exit 139).
  const std::string p = scratch("deep.safetensors");
  const std::size_t depth = 200000;
  for (const char* field : {"shape", "data_offsets"}) {
    const std::string nested = std::string(depth, '[') + std::string(depth, ']');
    const std::string other = std::string(field) == "shape" ? R"("data_offsets": [0, 0])" : R"("shape": [0])";
    write_raw(p, R"({"a": {"dtype": "F32", )" + other + R"(, ")" + field + "\": " + nested + "}}", 0);
    expect_reader_error(p, "nests arrays and objects deeper than 64 levels");
  }
  // Within the limit, a bad value is quoted cut short.
  write_raw(p,
            R"({"a": {"dtype": "F32", "data_offsets": [0, 0], "shape": [)" + std::string(60, '[') +
                std::string(60, ']') + "]}}",
            0);
  try {
    kmamba::SafeTensorsReader reader(p);
    FAIL() << "a nested shape was accepted";
  } catch (const kmamba::UserError& e) {
    EXPECT_NE(std::string(e.what()).find("shape holds [[[["), std::string::npos) << e.what();
    // The message: the file's name, under 80 characters of its own words and at most 80 of the
    // 120-character value (quote_json_text's limit).
    EXPECT_LT(std::string(e.what()).size(), p.size() + 160u) << e.what();
  }
}

TEST(SafeTensors, ManyTensorsParseInLinearTime) {
  // Duplicate detection through nlohmann's parser callback rescanned every tensor at the end of
  // each one: 40 000 tensors took 13 s and 80 000 over 100 s.
  const std::size_t count = 100000;
  std::string header = "{";
  for (std::size_t i = 0; i < count; ++i) {
    header += (i ? ",\"t" : "\"t") + std::to_string(i) + R"(":{"dtype":"F32","shape":[1],"data_offsets":[)" +
              std::to_string(4 * i) + "," + std::to_string(4 * i + 4) + "]}";
  }
  header += "}";
  const std::string p = scratch("many.safetensors");
  write_raw(p, header, 4 * count);
  const auto start = std::chrono::steady_clock::now();
  const kmamba::SafeTensorsReader reader(p);
  const double seconds = std::chrono::duration<double>(std::chrono::steady_clock::now() - start).count();
  EXPECT_EQ(reader.names().size(), count);
  EXPECT_LT(seconds, 20.0) << "parsing " << count << " tensors took " << seconds << " s";
}

TEST(SafeTensors, EmptyTensorsFitAnyFile) {
  // A (2, 0) tensor holds no bytes: it was "larger than the file" when the data section was empty.
  const std::string p = scratch("empty_tensor.safetensors");
  write_raw(p, R"({"x": {"dtype": "F32", "shape": [2, 0], "data_offsets": [0, 0]}})", 0);
  const kmamba::SafeTensorsReader reader(p);
  EXPECT_EQ(reader.info("x").shape, (std::vector<std::int64_t>{2, 0}));
  EXPECT_TRUE(reader.read_f32("x").empty());
  write_raw(p, R"({"x": {"dtype": "F32", "shape": [3, 2], "data_offsets": [0, 0]}})", 0);
  expect_reader_error(p, "shape [3,2] is larger than the file");
}

TEST(SafeTensors, RefusesAFifoInsteadOfHanging) {
  const std::string p = scratch("fifo.safetensors");
  std::remove(p.c_str());
  ASSERT_EQ(::mkfifo(p.c_str(), 0600), 0) << "cannot create a FIFO at " << p;
  expect_reader_error(p, "is a FIFO, expected a regular file");
  std::remove(p.c_str());
}

TEST(SafeTensors, WriterFollowsSymlinksAndNeverReplacesADevice) {
  // kmamba-eval --output: a symbolic link became a regular file, and as root /dev/full was
  // replaced by a regular file (exit 0).
  kmamba::SafeTensorsWriter w;
  w.add_f32("w", {2}, {1.0f, 2.0f});
  const std::string target = scratch("link_target.safetensors"), link = scratch("link.safetensors");
  std::remove(target.c_str());
  std::remove(link.c_str());
  ASSERT_EQ(::symlink(target.c_str(), link.c_str()), 0);
  w.write(link);
  struct stat st;
  ASSERT_EQ(::lstat(link.c_str(), &st), 0);
  EXPECT_TRUE(S_ISLNK(st.st_mode)) << "the symbolic link was replaced";
  EXPECT_EQ(kmamba::SafeTensorsReader(target).read_f32("w"), (std::vector<float>{1.0f, 2.0f}));
  try {
    w.write("/dev/full");
    FAIL() << "writing /dev/full succeeded";
  } catch (const kmamba::UserError& e) {
    EXPECT_NE(std::string(e.what()).find("No space left on device"), std::string::npos) << e.what();
  }
  ASSERT_EQ(::stat("/dev/full", &st), 0);
  EXPECT_TRUE(S_ISCHR(st.st_mode)) << "/dev/full is no longer a device";
}

}  // namespace
