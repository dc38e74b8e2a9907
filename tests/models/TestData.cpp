#include <kmamba/models/Data.hpp>
#include <kmamba/models/TokenFile.hpp>

#include "Checks.hpp"

#include <gtest/gtest.h>

#include <algorithm>
#include <cstdio>
#include <filesystem>
#include <fstream>
#include <map>
#include <set>
#include <string>
#include <vector>

namespace {

using kmamba::test::user_error;

using kmamba::Split;
using kmamba::TokenBatch;

bool same(const TokenBatch& a, const TokenBatch& b, std::size_t row_a = 0, std::size_t row_b = 0,
          std::size_t rows = 0) {
  if (rows == 0) {
    if (a.ids.extent(0) != b.ids.extent(0)) return false;
    rows = a.ids.extent(0);
  }
  if (a.ids.extent(1) != b.ids.extent(1)) return false;
  for (std::size_t r = 0; r < rows; ++r) {
    for (std::size_t t = 0; t < a.ids.extent(1); ++t) {
      if (a.ids(row_a + r, t) != b.ids(row_b + r, t) || a.targets(row_a + r, t) != b.targets(row_b + r, t))
        return false;
    }
  }
  return true;
}

std::string temp_path(const std::string& name) { return ::testing::TempDir() + "kmamba_test_data_" + name; }

void write_bytes(const std::string& path, const std::vector<unsigned char>& bytes) {
  std::ofstream out(path, std::ios::binary | std::ios::trunc);
  out.write(reinterpret_cast<const char*>(bytes.data()), static_cast<std::streamsize>(bytes.size()));
}

std::vector<unsigned char> read_bytes(const std::string& path) {
  std::ifstream in(path, std::ios::binary);
  return std::vector<unsigned char>((std::istreambuf_iterator<char>(in)), std::istreambuf_iterator<char>());
}

TEST(AssociativeRecall, TargetsAreTheValuesOfTheQueriedKeys) {
  const kmamba::AssociativeRecallConfig config{64, 48, 8, 7};
  const kmamba::AssociativeRecallTask task(config);
  EXPECT_EQ(task.vocab_size(), 64);
  EXPECT_EQ(task.seqlen(), 48);
  const std::int64_t keys_end = task.value_begin();
  for (const Split split : {Split::Train, Split::Validation}) {
    const TokenBatch b = task.batch(split, 3, 16);
    ASSERT_EQ(b.ids.extent(0), 16u);
    ASSERT_EQ(b.ids.extent(1), 48u);
    EXPECT_EQ(b.predicted_tokens(), 16 * 8);
    for (std::size_t r = 0; r < 16; ++r) {
      std::map<std::int64_t, std::int64_t> pairs;
      std::set<std::int64_t> values;
      for (std::size_t p = 0; p < 8; ++p) {
        const std::int64_t k = b.ids(r, 2 * p), v = b.ids(r, 2 * p + 1);
        EXPECT_GE(k, task.key_begin());
        EXPECT_LT(k, keys_end);
        EXPECT_GE(v, keys_end);
        EXPECT_LT(v, 64);
        EXPECT_TRUE(pairs.emplace(k, v).second) << "keys of a sequence are distinct";
        EXPECT_TRUE(values.insert(v).second) << "values of a sequence are distinct";
        EXPECT_EQ(b.targets(r, 2 * p), kmamba::ignore_index);
        EXPECT_EQ(b.targets(r, 2 * p + 1), kmamba::ignore_index);
      }
      std::set<std::int64_t> queried;
      for (std::size_t t = 16; t < 48; ++t) {
        const std::int64_t id = b.ids(r, t), target = b.targets(r, t);
        if (id == kmamba::AssociativeRecallTask::blank_token) {
          EXPECT_EQ(target, kmamba::ignore_index) << "row " << r << " position " << t;
          continue;
        }
        ASSERT_EQ(pairs.count(id), 1u) << "a query is one of the sequence's keys";
        EXPECT_EQ(target, pairs[id]) << "the target of a query is its key's value";
        EXPECT_TRUE(queried.insert(id).second) << "each key is queried once";
      }
      EXPECT_EQ(queried.size(), 8u);
    }
  }
}

TEST(AssociativeRecall, DenseQueriesCycleThroughTheKeys) {
  const kmamba::AssociativeRecallTask task({64, 40, 6, 3, /*num_queries=*/28});
  const TokenBatch b = task.batch(Split::Train, 0, 4);
  EXPECT_EQ(b.predicted_tokens(), 4 * 28);
  for (std::size_t r = 0; r < 4; ++r) {
    std::map<std::int64_t, std::int64_t> pairs, times_queried;
    for (std::size_t p = 0; p < 6; ++p) pairs[b.ids(r, 2 * p)] = b.ids(r, 2 * p + 1);
    for (std::size_t t = 12; t < 40; ++t) {
      if (b.targets(r, t) == kmamba::ignore_index) continue;
      ASSERT_EQ(pairs.count(b.ids(r, t)), 1u);
      EXPECT_EQ(b.targets(r, t), pairs[b.ids(r, t)]);
      ++times_queried[b.ids(r, t)];
    }
    ASSERT_EQ(times_queried.size(), 6u);
    for (const auto& [key, n] : times_queried) {
      EXPECT_TRUE(n == 4 || n == 5) << "28 queries over 6 keys: every key 4 or 5 times, key " << key << " " << n
                                    << " times";
    }
  }
  EXPECT_NE(user_error([] {
              kmamba::AssociativeRecallTask({64, 40, 6, 3, 29});
            }).find("29 queries"),
            std::string::npos);
}

TEST(AssociativeRecall, BatchesAreDeterministicAndSplitsDiffer) {
  const kmamba::AssociativeRecallTask task({128, 64, 8, 1});
  const TokenBatch a = task.batch(5, 8);
  EXPECT_TRUE(same(a, task.batch(5, 8)));
  EXPECT_TRUE(same(a, task.batch(Split::Train, 5, 8)));
  EXPECT_FALSE(same(a, task.batch(6, 8)));
  EXPECT_FALSE(same(a, task.batch(Split::Validation, 5, 8)));
  EXPECT_FALSE(same(a, kmamba::AssociativeRecallTask({128, 64, 8, 2}).batch(5, 8)));
  // Batch i of size k·B holds batches k·i ... k·i + k − 1 of size B.
  const TokenBatch big = task.batch(2, 12);
  for (std::size_t j = 0; j < 3; ++j)
    EXPECT_TRUE(same(big, task.batch(static_cast<std::int64_t>(6 + j), 4), 4 * j, 0, 4));
  // Sequences within a batch differ.
  EXPECT_FALSE(same(a, a, 0, 1, 1));
  EXPECT_NE(task.fingerprint(), kmamba::AssociativeRecallTask({128, 64, 8, 2}).fingerprint());
}

TEST(AssociativeRecall, RejectsInconsistentConfigs) {
  EXPECT_NE(user_error([] { kmamba::AssociativeRecallTask({16, 64, 8, 0}); }).find("vocab_size 16"), std::string::npos);
  EXPECT_NE(user_error([] { kmamba::AssociativeRecallTask({128, 20, 8, 0}); }).find("seqlen 20"), std::string::npos);
  EXPECT_NE(user_error([] { kmamba::AssociativeRecallTask({128, 20, 0, 0}); }).find("num_kv_pairs"), std::string::npos);
  const kmamba::AssociativeRecallTask task({128, 64, 8, 0});
  EXPECT_THROW(task.batch(-1, 4), kmamba::UserError);
  EXPECT_THROW(task.batch(0, 0), kmamba::UserError);
}

TEST(TokenDataset, TextRoundTripsAsBytesWithNextTokenTargets) {
  std::string text;
  for (int i = 0; i < 200; ++i) text += "line " + std::to_string(i) + ": the quick brown fox\n";
  const std::string path = temp_path("text.txt");
  write_bytes(path, std::vector<unsigned char>(text.begin(), text.end()));
  const kmamba::TokenDataset data = kmamba::TokenDataset::from_file(path, {32, 0.1, 3});
  EXPECT_EQ(data.vocab_size(), 256);
  ASSERT_EQ(data.tokens().size(), text.size());
  for (std::size_t i = 0; i < text.size(); ++i) ASSERT_EQ(data.tokens()[i], static_cast<unsigned char>(text[i]));
  const auto held_out = static_cast<std::int64_t>(static_cast<double>(text.size()) * 0.1);
  EXPECT_EQ(data.size(Split::Validation), held_out);
  EXPECT_EQ(data.size(Split::Train), static_cast<std::int64_t>(text.size()) - held_out);
  EXPECT_TRUE(data.has_validation());

  for (const Split split : {Split::Train, Split::Validation}) {
    const TokenBatch b = data.batch(split, 4, 6);
    EXPECT_EQ(b.predicted_tokens(), 6 * 32);
    for (std::size_t r = 0; r < 6; ++r) {
      std::string window;
      for (std::size_t t = 0; t < 32; ++t) {
        window += static_cast<char>(b.ids(r, t));
        if (t + 1 < 32) {
          EXPECT_EQ(b.targets(r, t), b.ids(r, t + 1));
        }
      }
      window += static_cast<char>(b.targets(r, 31));
      const std::size_t at =
          text.find(window, split == Split::Train ? 0 : text.size() - static_cast<std::size_t>(held_out));
      ASSERT_NE(at, std::string::npos) << "a window is a substring of its split";
      if (split == Split::Train) {
        EXPECT_LE(at + window.size(), text.size() - static_cast<std::size_t>(held_out));
      }
    }
    EXPECT_TRUE(same(b, data.batch(split, 4, 6)));
    EXPECT_FALSE(same(b, data.batch(split, 5, 6)));
  }
  const TokenBatch big = data.batch(Split::Train, 1, 6);
  EXPECT_TRUE(same(big, data.batch(Split::Train, 3, 2), 0, 0, 2));
  EXPECT_EQ(kmamba::TokenDataset::from_text(path, {32, 0.1, 3}).fingerprint(), data.fingerprint());
  EXPECT_NE(kmamba::TokenDataset::from_text(path, {32, 0.1, 4}).fingerprint(), data.fingerprint());

  const kmamba::TokenDataset no_validation = kmamba::TokenDataset::from_text(path, {32, 0.0, 3});
  EXPECT_FALSE(no_validation.has_validation());
  EXPECT_THROW(no_validation.batch(Split::Validation, 0, 1), kmamba::UserError);
  std::remove(path.c_str());
}

TEST(TokenDataset, TokenFilesRoundTrip) {
  for (const int vocab : {1000, 70000}) {
    std::vector<std::uint32_t> tokens;
    for (std::uint32_t i = 0; i < 5000; ++i) tokens.push_back((i * 7919u) % static_cast<std::uint32_t>(vocab));
    const std::string path = temp_path("tokens.kmtok");
    kmamba::TokenDataset::write_token_file(path, tokens, vocab);
    EXPECT_EQ(read_bytes(path).size(), 32u + tokens.size() * (vocab <= 65536 ? 2u : 4u));
    const kmamba::TokenDataset data = kmamba::TokenDataset::from_file(path, {64, 0.1, 0});
    EXPECT_EQ(data.vocab_size(), vocab);
    EXPECT_EQ(data.tokens(), tokens);
    EXPECT_EQ(kmamba::TokenDataset::from_token_file(path, {64, 0.1, 0}).tokens(), tokens);
    std::remove(path.c_str());
  }
}

// Packed documents: the same windows as without packing, each token's sequence id counting the
// end-of-document tokens before it in the window, and no target at an end-of-document token.
TEST(TokenDataset, PackedDocumentsKeepTheirBoundaries) {
  const std::uint32_t eod = 9;
  std::vector<std::uint32_t> tokens;
  for (std::uint32_t i = 0; i < 3000; ++i) tokens.push_back(i % (3 + (i / 50) % 7) == 0 ? eod : 1 + i % 8);
  kmamba::TokenDatasetConfig config{40, 0.1, 5};
  const kmamba::TokenDataset plain(tokens, 10, config);
  config.document_end = eod;
  const kmamba::TokenDataset packed(tokens, 10, config);
  EXPECT_NE(plain.fingerprint(), packed.fingerprint());
  for (const Split split : {Split::Train, Split::Validation}) {
    const TokenBatch a = plain.batch(split, 2, 5), b = packed.batch(split, 2, 5);
    EXPECT_FALSE(a.seq_idx.is_allocated());
    ASSERT_TRUE(b.seq_idx.is_allocated());
    ASSERT_EQ(b.seq_idx.extent(0), 5u);
    ASSERT_EQ(b.seq_idx.extent(1), 40u);
    for (std::size_t r = 0; r < 5; ++r) {
      std::int64_t document = 0;
      for (std::size_t t = 0; t < 40; ++t) {
        EXPECT_EQ(b.ids(r, t), a.ids(r, t));
        EXPECT_EQ(b.seq_idx(r, t), document) << r << " " << t;
        const bool end = b.ids(r, t) == eod;
        EXPECT_EQ(b.targets(r, t), end ? kmamba::ignore_index : a.targets(r, t)) << r << " " << t;
        if (end) ++document;
      }
    }
  }
  config.document_end = 10;
  EXPECT_NE(
      user_error([&] { static_cast<void>(kmamba::TokenDataset(tokens, 10, config)); }).find("end-of-document token 10"),
      std::string::npos);
}

TEST(TokenDataset, BadFilesGiveClearErrors) {
  std::vector<std::uint32_t> tokens(1000);
  for (std::uint32_t i = 0; i < tokens.size(); ++i) tokens[i] = i % 50;
  const std::string good = temp_path("good.kmtok"), bad = temp_path("bad.kmtok");
  kmamba::TokenDataset::write_token_file(good, tokens, 50);
  const std::vector<unsigned char> bytes = read_bytes(good);
  const kmamba::TokenDatasetConfig config{16, 0.1, 0};
  auto error_for = [&](std::vector<unsigned char> contents) {
    write_bytes(bad, contents);
    return user_error([&] { kmamba::TokenDataset::from_file(bad, config); });
  };

  std::string e = error_for(std::vector<unsigned char>(bytes.begin(), bytes.end() - 3));
  EXPECT_NE(e.find("truncated"), std::string::npos) << e;
  EXPECT_NE(e.find(bad), std::string::npos) << e;
  e = error_for(std::vector<unsigned char>(bytes.begin(), bytes.begin() + 20));
  EXPECT_NE(e.find("truncated"), std::string::npos) << e;
  std::vector<unsigned char> patched = bytes;
  patched[32 + 2 * 17] = 60;  // token 17 := 60 >= vocabulary 50
  e = error_for(patched);
  EXPECT_NE(e.find("token 17 is 60"), std::string::npos) << e;
  patched = bytes;
  patched[8] = 2;  // version
  EXPECT_NE(error_for(patched).find("version 2"), std::string::npos);
  patched = bytes;
  patched[12] = 3;  // bytes per token
  EXPECT_NE(error_for(patched).find("3 bytes per token"), std::string::npos);
  patched = bytes;
  patched[16] = 0;  // vocabulary size 0
  EXPECT_NE(error_for(patched).find("vocabulary size 0"), std::string::npos);
  patched = bytes;
  patched.push_back(0);  // more bytes than declared
  EXPECT_NE(error_for(patched).find("declares 1000 tokens"), std::string::npos);
  EXPECT_NE(error_for({}).find("is empty"), std::string::npos);

  EXPECT_NE(user_error([&] { kmamba::TokenDataset::from_file(temp_path("missing"), config); }).find("cannot open"),
            std::string::npos);
  EXPECT_NE(user_error([&] {
              kmamba::TokenDataset::from_file(good, {1000, 0.1, 0});
            }).find("too short"),
            std::string::npos);
  EXPECT_NE(user_error([&] {
              kmamba::TokenDataset::from_file(good, {16, 0.99, 0});
            }).find("too short"),
            std::string::npos);
  EXPECT_THROW(kmamba::TokenDataset::from_file(good, {16, 1.0, 0}), kmamba::UserError);
  EXPECT_THROW(kmamba::TokenDataset::from_file(good, {0, 0.1, 0}), kmamba::UserError);
  const std::string plain = temp_path("plain.txt");
  write_bytes(plain, {'h', 'e', 'l', 'l', 'o'});
  EXPECT_NE(user_error([&] { kmamba::TokenDataset::from_token_file(plain, config); }).find("not a token file"),
            std::string::npos);
  std::remove(plain.c_str());
  EXPECT_THROW(kmamba::TokenDataset({1, 2, 50}, 50, config), kmamba::UserError);
  EXPECT_THROW(kmamba::TokenDataset::write_token_file(bad, {1, 2, 50}, 50), kmamba::UserError);
  std::remove(good.c_str());
  std::remove(bad.c_str());
}

TEST(TokenFileWriter, WritesInPiecesTheFileWriteTokenFileWrites) {
  for (const int vocab : {1000, 70000}) {
    // More than the writer's 1 MiB buffer, in pieces of odd sizes.
    std::vector<std::uint32_t> tokens;
    for (std::uint32_t i = 0; i < 400000; ++i) tokens.push_back((i * 7919u) % static_cast<std::uint32_t>(vocab));
    const std::string whole = temp_path("whole.kmtok"), pieces = temp_path("pieces.kmtok");
    std::remove(pieces.c_str());
    kmamba::TokenDataset::write_token_file(whole, tokens, vocab);
    kmamba::TokenFileWriter out(pieces, vocab, "test writer");
    for (std::size_t i = 0; i < tokens.size(); i += 77777) {
      out.append(
          std::vector<std::uint32_t>(tokens.begin() + static_cast<std::ptrdiff_t>(i),
                                     tokens.begin() + static_cast<std::ptrdiff_t>(std::min(i + 77777, tokens.size()))));
    }
    EXPECT_FALSE(std::filesystem::exists(pieces)) << "the file is in place before commit()";
    out.commit();
    EXPECT_EQ(out.count(), tokens.size());
    EXPECT_EQ(read_bytes(pieces), read_bytes(whole));
    EXPECT_EQ(kmamba::TokenDataset::from_file(pieces, {64, 0.1, 0}).tokens(), tokens);
    std::remove(whole.c_str());
    std::remove(pieces.c_str());
  }
}

TEST(TokenFileWriter, BadTokensDevicesAndUncommittedFilesAreHandled) {
  const std::string path = temp_path("writer.kmtok");
  std::remove(path.c_str());
  {
    kmamba::TokenFileWriter out(path, 50, "test writer");
    out.append({1, 2, 3});
    EXPECT_NE(user_error([&] {
                out.append({4, 50, 5});
              })
                  .find("test writer: token 4 is 50, not below the vocabulary "
                        "size 50"),
              std::string::npos);
    EXPECT_EQ(out.count(), 3u) << "a rejected piece is not appended";
  }
  EXPECT_FALSE(std::filesystem::exists(path)) << "an uncommitted writer left its file";
  EXPECT_NE(user_error([&] { kmamba::TokenFileWriter("/dev/null", 50, "test writer"); }).find("a regular file"),
            std::string::npos);
  EXPECT_NE(user_error([&] { kmamba::TokenFileWriter(path, 0, "test writer"); }).find("vocabulary size must be >= 1"),
            std::string::npos);
  kmamba::TokenFileWriter empty(path, 50, "test writer");
  empty.commit();
  EXPECT_EQ(read_bytes(path).size(), 32u);
  EXPECT_THROW(empty.commit(), kmamba::UserError);
  std::remove(path.c_str());
}

}  // namespace
