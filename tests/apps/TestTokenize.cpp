// kmamba-tokenize, run as a program: text, JSONL and folders give exactly the ids BpeTokenizer (or
// ByteTokenizer) gives each document, in input order, each document followed by its
// end-of-document token; the thread count does not change a byte of the output; the output is a
// token file the existing readers take; bad inputs exit with status 2 and a message naming them.
#include "TestData.hpp"
#include <kmamba/models/Data.hpp>
#include <kmamba/models/TokenFile.hpp>
#include <kmamba/models/Tokenizer.hpp>

#include <gtest/gtest.h>
#include <nlohmann/json.hpp>

#include <sys/wait.h>

#include <cstdint>
#include <cstdio>
#include <filesystem>
#include <fstream>
#include <initializer_list>
#include <iterator>
#include <string>
#include <vector>

namespace {

namespace fs = std::filesystem;
using Tokens = std::vector<std::uint32_t>;

const std::string tokenizer_path = kmamba::test::test_data_dir() + "/tiny_bpe_tokenizer.json";

const kmamba::BpeTokenizer& bpe() {
  static const kmamba::BpeTokenizer tokenizer = kmamba::BpeTokenizer::from_file(tokenizer_path);
  return tokenizer;
}

struct Result {
  int status = -1;
  std::string output;  // stdout and stderr
};

std::string quoted(const std::string& s) {
  std::string q = "'";
  for (const char c : s) q += c == '\'' ? std::string("'\\''") : std::string(1, c);
  return q + "'";
}

Result tokenize(std::initializer_list<std::string> args) {
  std::string command = quoted(KMAMBA_TOKENIZE_EXE);
  for (const std::string& a : args) command += " " + quoted(a);
  command += " 2>&1";
  Result r;
  FILE* pipe = ::popen(command.c_str(), "r");
  EXPECT_NE(pipe, nullptr) << command;
  if (pipe == nullptr) return r;
  char buffer[4096];
  for (std::size_t n; (n = std::fread(buffer, 1, sizeof(buffer), pipe)) > 0;) r.output.append(buffer, n);
  const int status = ::pclose(pipe);
  r.status = WIFEXITED(status) ? WEXITSTATUS(status) : -1;
  return r;
}

std::string fresh_dir(const std::string& name) {
  const std::string dir = ::testing::TempDir() + "kmamba_tokenize_" + name;
  fs::remove_all(dir);
  fs::create_directories(dir);
  return dir;
}

void write_file(const std::string& path, const std::string& text) {
  fs::create_directories(fs::path(path).parent_path());
  std::ofstream out(path, std::ios::binary);
  out << text;
  ASSERT_TRUE(out.good()) << path;
}

std::string read_file(const std::string& path) {
  std::ifstream in(path, std::ios::binary);
  return std::string(std::istreambuf_iterator<char>(in), std::istreambuf_iterator<char>());
}

// The tokens of the token file `path`, read by the parser kmamba-train's TokenDataset uses.
Tokens read_tokens(const std::string& path, int& vocab) {
  const std::string bytes = read_file(path);
  return kmamba::parse_token_file(reinterpret_cast<const unsigned char*>(bytes.data()), bytes.size(), path, vocab);
}

// What the file of `documents` must hold: each document's ids, then `eod` (none when negative).
Tokens expected(const kmamba::Tokenizer& tokenizer, const std::vector<std::string>& documents, std::int64_t eod) {
  Tokens tokens;
  for (const std::string& d : documents) {
    for (const std::int64_t id : tokenizer.encode(d)) tokens.push_back(static_cast<std::uint32_t>(id));
    if (eod >= 0) tokens.push_back(static_cast<std::uint32_t>(eod));
  }
  return tokens;
}

const std::vector<std::string> texts = {
    "Hello world", "The quick brown fox jumps over the lazy dog.\nSecond line, caf\xc3\xa9 \xe2\x82\xac 42.",
    "it's, they'll, we're", "  leading spaces, trailing spaces   ", "tabs\tand\nnewlines\n\n"};

TEST(Tokenize, AFolderOfTextAndJsonlGivesEachDocumentsIdsInPathOrder) {
  const std::string dir = fresh_dir("folder"), in = dir + "/corpus";
  write_file(in + "/b/c.jsonl", "{\"text\": \"" + std::string("it's, they'll, we're") + "\", \"id\": 1}\n\n" +
                                    "{\"id\": 2, \"text\": \"Hello world\"}\r\n");
  write_file(in + "/a.txt", texts[1]);
  write_file(in + "/b/d.txt", texts[3]);
  write_file(in + "/z.ndjson", "{\"text\": \"tabs\\tand\\nnewlines\\n\\n\"}\n");
  write_file(in + "/.hidden.txt", "never read");
  write_file(in + "/.git/HEAD", "never read");
  const Result r = tokenize({"--input", in, "--output", dir + "/out.kmtok", "--tokenizer", tokenizer_path});
  ASSERT_EQ(r.status, 0) << r.output;
  EXPECT_NE(r.output.find("5 documents from 4 files"), std::string::npos) << r.output;
  int vocab = 0;
  const Tokens tokens = read_tokens(dir + "/out.kmtok", vocab);
  EXPECT_EQ(vocab, bpe().vocab_size());
  ASSERT_EQ(bpe().eos_id(), 0);
  EXPECT_EQ(tokens, expected(bpe(), {texts[1], "it's, they'll, we're", "Hello world", texts[3], texts[4]}, 0));
}

TEST(Tokenize, ATextFileIsOneDocumentAndAJsonlFileOneALine) {
  const std::string dir = fresh_dir("single");
  write_file(dir + "/book.txt", texts[1]);
  write_file(dir + "/docs.jsonl", "{\"body\": \"Hello world\"}\n{\"body\": \"it's, they'll, we're\"}\n");
  int vocab = 0;
  Result r = tokenize({"--input", dir + "/book.txt", "--output", dir + "/a.kmtok", "--tokenizer", tokenizer_path});
  ASSERT_EQ(r.status, 0) << r.output;
  EXPECT_EQ(read_tokens(dir + "/a.kmtok", vocab), expected(bpe(), {texts[1]}, 0));
  r = tokenize({"--input", dir + "/docs.jsonl", "--output", dir + "/b.kmtok", "--tokenizer", tokenizer_path, "--field",
                "body", "--eod-id", "5"});
  ASSERT_EQ(r.status, 0) << r.output;
  EXPECT_EQ(read_tokens(dir + "/b.kmtok", vocab), expected(bpe(), {"Hello world", "it's, they'll, we're"}, 5));
  // --format text reads a JSONL file as one text document.
  r = tokenize({"--input", dir + "/docs.jsonl", "--output", dir + "/c.kmtok", "--format", "text", "--no-eod"});
  ASSERT_EQ(r.status, 0) << r.output;
  EXPECT_EQ(read_tokens(dir + "/c.kmtok", vocab),
            expected(kmamba::ByteTokenizer(), {read_file(dir + "/docs.jsonl")}, -1));
  EXPECT_EQ(vocab, 256);
}

TEST(Tokenize, BytesEndDocumentsWithTheIdPastTheirVocabulary) {
  const std::string dir = fresh_dir("bytes");
  write_file(dir + "/in/1.txt", texts[0]);
  write_file(dir + "/in/2.txt", texts[1]);
  write_file(dir + "/in/3.txt", "");
  const Result r = tokenize({"--input", dir + "/in", "--output", dir + "/out.kmtok"});
  ASSERT_EQ(r.status, 0) << r.output;
  EXPECT_NE(r.output.find("1 empty documents skipped"), std::string::npos) << r.output;
  int vocab = 0;
  EXPECT_EQ(read_tokens(dir + "/out.kmtok", vocab), expected(kmamba::ByteTokenizer(), {texts[0], texts[1]}, 256));
  EXPECT_EQ(vocab, 257);
}

TEST(Tokenize, TheThreadCountChangesNoByte) {
  const std::string dir = fresh_dir("threads");
  std::string jsonl;
  std::vector<std::string> documents;
  for (int i = 0; i < 3000; ++i) {
    std::string text;
    for (int w = 0; w < 1 + (i * 7919) % 97; ++w)
      text += texts[static_cast<std::size_t>((i + w) % 5)].substr(0, 11) + " ";
    text += std::to_string(i);
    documents.push_back(text);
    jsonl += nlohmann::json{{"text", text}}.dump() + "\n";
  }
  write_file(dir + "/docs.jsonl", jsonl);
  std::string first;
  for (const char* threads : {"1", "2", "7"}) {
    const std::string out = dir + "/out" + threads + ".kmtok";
    const Result r = tokenize({"--input", dir + "/docs.jsonl", "--output", out, "--tokenizer", tokenizer_path,
                               "--threads", threads, "--quiet"});
    ASSERT_EQ(r.status, 0) << r.output;
    if (first.empty()) {
      first = read_file(out);
      int vocab = 0;
      EXPECT_EQ(read_tokens(out, vocab), expected(bpe(), documents, 0));
    } else {
      EXPECT_EQ(read_file(out), first) << threads << " threads";
    }
  }
  // kmamba-train's reader takes the file.
  const kmamba::TokenDataset data = kmamba::TokenDataset::from_file(dir + "/out1.kmtok", {64, 0.1, 0});
  EXPECT_EQ(data.vocab_size(), bpe().vocab_size());
  EXPECT_EQ(data.tokens(), expected(bpe(), documents, 0));
}

TEST(Tokenize, AModelDirectoryGivesItsTokenizerOrBytesWithAWarning) {
  const std::string dir = fresh_dir("model");
  write_file(dir + "/bpe_model/tokenizer.json", read_file(tokenizer_path));
  write_file(dir + "/big_model/config.json", "{\"vocab_size\": 50280, \"d_model\": 8}");
  write_file(dir + "/doc.txt", texts[2]);
  int vocab = 0;
  Result r = tokenize({"--input", dir + "/doc.txt", "--output", dir + "/a.kmtok", "--tokenizer", dir + "/bpe_model"});
  ASSERT_EQ(r.status, 0) << r.output;
  EXPECT_EQ(read_tokens(dir + "/a.kmtok", vocab), expected(bpe(), {texts[2]}, 0));
  EXPECT_EQ(r.output.find("warning"), std::string::npos) << r.output;
  r = tokenize({"--input", dir + "/doc.txt", "--output", dir + "/b.kmtok", "--tokenizer", dir + "/big_model"});
  ASSERT_EQ(r.status, 0) << r.output;
  EXPECT_NE(r.output.find("warning: the model in '" + dir +
                          "/big_model' has a vocabulary of 50280 tokens but no "
                          "tokenizer.json"),
            std::string::npos)
      << r.output;
  EXPECT_EQ(read_tokens(dir + "/b.kmtok", vocab), expected(kmamba::ByteTokenizer(), {texts[2]}, 256));
}

// Runs kmamba-tokenize with `args`, expects exit status 2 with `message` in its output, and the
// output file, when there was one before, left as it was.
void expect_user_error(std::initializer_list<std::string> args, const std::string& message,
                       const std::string& output = "") {
  const std::string before = output.empty() ? std::string() : read_file(output);
  const Result r = tokenize(args);
  EXPECT_EQ(r.status, 2) << r.output;
  EXPECT_NE(r.output.find(message), std::string::npos) << "expected '" << message << "' in:\n" << r.output;
  if (!output.empty()) {
    EXPECT_EQ(read_file(output), before) << output;
  }
}

TEST(Tokenize, BadInputsAreErrorsNamingThem) {
  const std::string dir = fresh_dir("errors"), out = dir + "/out.kmtok";
  write_file(out, "the previous output");
  write_file(dir + "/bad_line.jsonl", "{\"text\": \"fine\"}\n{\"text\": \"fine\"\n");
  write_file(dir + "/no_field.jsonl", "{\"text\": \"fine\"}\n\n{\"txt\": \"fine\"}\n");
  write_file(dir + "/not_text.jsonl", "{\"text\": 42}\n");
  write_file(dir + "/latin1/ok.txt", "fine");
  write_file(dir + "/latin1/cafe.txt", "caf\xe9");
  fs::create_directories(dir + "/empty/.hidden");
  const std::string bpe_option = "--tokenizer=" + tokenizer_path;

  expect_user_error({"--input", dir + "/missing.txt", "--output", out}, "--input: Path does not exist: " + dir, out);
  expect_user_error({"--input", dir + "/bad_line.jsonl", "--output", out},
                    "'" + dir + "/bad_line.jsonl' line 2 is not valid JSON", out);
  expect_user_error({"--input", dir + "/no_field.jsonl", "--output", out},
                    "'" + dir + "/no_field.jsonl' line 3 is not a JSON object with a string field 'text'", out);
  expect_user_error({"--input", dir + "/not_text.jsonl", "--output", out},
                    "'" + dir + "/not_text.jsonl' line 1 is not a JSON object with a string field 'text'", out);
  expect_user_error({"--input", dir + "/latin1", "--output", out, bpe_option},
                    "'" + dir + "/latin1/cafe.txt': kmamba::BpeTokenizer::encode: the text is not valid UTF-8", out);
  expect_user_error({"--input", dir + "/empty", "--output", out}, "the folder '" + dir + "/empty' holds no files", out);
  expect_user_error({"--input", dir + "/latin1", "--output", dir + "/latin1/out.kmtok"}, "lies in the --input folder");
  expect_user_error({"--input", dir + "/latin1/ok.txt", "--output", "/dev/null"}, "'/dev/null' is a device or a FIFO");
  expect_user_error({"--input", dir + "/latin1/ok.txt", "--output", out, "--threads", "0"},
                    "--threads: got '0', expected an integer in [1, 1024]", out);
  expect_user_error({"--input", dir + "/latin1/ok.txt", "--output", out, "--eod-id", "3", "--no-eod"},
                    "--eod-id excludes --no-eod", out);
  expect_user_error({"--input", dir + "/latin1/ok.txt", "--output", out, "--format", "csv"},
                    "--format: got 'csv', expected one of auto, text, jsonl", out);
  expect_user_error({"--input", dir + "/latin1/ok.txt"}, "--output is required");
  EXPECT_FALSE(fs::exists(dir + "/latin1/out.kmtok"));
}

}  // namespace
