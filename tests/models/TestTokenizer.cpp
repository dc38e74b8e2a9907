// Tokenizers: byte-level, GPT-NeoX-style byte-level BPE from tokenizer.json, streaming decode.
//
// The BPE fixture (tests/data/tiny_bpe_tokenizer.json) and its expected encodings
// (tests/data/tiny_bpe_expected.json) come from scripts/make_bpe_fixture.py, whose encoder is
// independent of kmamba's (Python `regex` for \p{L}/\p{N}, GPT-2's original bpe()).
#include "Checks.hpp"
#include "TestData.hpp"
#include <kmamba/core/Error.hpp>
#include <kmamba/models/Tokenizer.hpp>

#include <gtest/gtest.h>
#include <nlohmann/json.hpp>

#include <algorithm>
#include <cstdint>
#include <cstdio>
#include <filesystem>
#include <fstream>
#include <random>
#include <sstream>
#include <string>
#include <sys/stat.h>
#include <vector>

namespace {

using json = nlohmann::json;
using kmamba::test::expect_user_error;
using Ids = std::vector<std::int64_t>;

const std::string data_dir = kmamba::test::test_data_dir();
const std::string fixture_path = data_dir + "/tiny_bpe_tokenizer.json";

std::string read_file(const std::string& path) {
  std::ifstream in(path, std::ios::binary);
  EXPECT_TRUE(in.good()) << path;
  std::ostringstream text;
  text << in.rdbuf();
  return text.str();
}

json fixture_json() { return json::parse(read_file(fixture_path)); }

const kmamba::BpeTokenizer& fixture() {
  static const kmamba::BpeTokenizer tokenizer = kmamba::BpeTokenizer::from_file(fixture_path);
  return tokenizer;
}

kmamba::BpeTokenizer from(const json& j) { return kmamba::BpeTokenizer::from_json(j.dump(), "variant"); }

Ids concat(std::initializer_list<Ids> parts) {
  Ids out;
  for (const Ids& p : parts) out.insert(out.end(), p.begin(), p.end());
  return out;
}

// An independent strict UTF-8 check: shortest form, no surrogates, nothing above U+10FFFF.
bool valid_utf8(const std::string& s) {
  std::size_t i = 0;
  while (i < s.size()) {
    const auto b = static_cast<unsigned char>(s[i]);
    int extra = 0;
    std::uint32_t cp = 0;
    if (b < 0x80) {
      cp = b;
    } else if ((b & 0xE0) == 0xC0) {
      extra = 1;
      cp = b & 0x1F;
    } else if ((b & 0xF0) == 0xE0) {
      extra = 2;
      cp = b & 0x0F;
    } else if ((b & 0xF8) == 0xF0) {
      extra = 3;
      cp = b & 0x07;
    } else {
      return false;
    }
    if (i + static_cast<std::size_t>(extra) >= s.size() && extra > 0) return false;
    for (int k = 1; k <= extra; ++k) {
      const auto c = static_cast<unsigned char>(s[i + static_cast<std::size_t>(k)]);
      if ((c & 0xC0) != 0x80) return false;
      cp = (cp << 6) | (c & 0x3F);
    }
    const std::uint32_t min_cp[] = {0, 0x80, 0x800, 0x10000};
    if (cp < min_cp[extra] || cp > 0x10FFFF || (cp >= 0xD800 && cp <= 0xDFFF)) return false;
    i += 1 + static_cast<std::size_t>(extra);
  }
  return true;
}

std::string utf8(std::uint32_t cp) {
  std::string out;
  if (cp < 0x80) {
    out += static_cast<char>(cp);
  } else if (cp < 0x800) {
    out += static_cast<char>(0xC0 | (cp >> 6));
    out += static_cast<char>(0x80 | (cp & 0x3F));
  } else if (cp < 0x10000) {
    out += static_cast<char>(0xE0 | (cp >> 12));
    out += static_cast<char>(0x80 | ((cp >> 6) & 0x3F));
    out += static_cast<char>(0x80 | (cp & 0x3F));
  } else {
    out += static_cast<char>(0xF0 | (cp >> 18));
    out += static_cast<char>(0x80 | ((cp >> 12) & 0x3F));
    out += static_cast<char>(0x80 | ((cp >> 6) & 0x3F));
    out += static_cast<char>(0x80 | (cp & 0x3F));
  }
  return out;
}

// Multilingual text with multi-byte characters, emoji (ZWJ sequences, flags, skin tones), CJK,
// scripts and symbols absent from the fixture's training corpus, and odd whitespace.
const std::string corpus =
    "Plain ASCII: the quick brown fox, it's 42 o'clock; they'll've gone.\n"
    "Accents: élève, garçon, naïve, Ærøskøbing, Łódź, İstanbul, Dvořák.\n"
    "Cyrillic: Съешь же ещё этих мягких французских булок. Greek: Ωμέγα.\n"
    "CJK: 東京は日本の首都です。你好，世界！ 한국어 텍스트. Rare: 𠀀𠀁 (U+20000).\n"
    "Thai: สวัสดีครับ Hebrew: שלום עולם Arabic: مرحبا Devanagari: नमस्ते\n"
    "Emoji: 😀😃😄 🎉🚀 ❤️ 👍🏽 👨‍👩‍👧‍👦 🏳️‍🌈 🇫🇷🇯🇵 and 𝄞 "
    "(music) "
    "𝔘𝔫𝔦𝔠𝔬𝔡𝔢.\n"
    "Whitespace:\ttab, nbsp\u00a0here, ideographic\u3000space, line\u2028sep,   runs   \n\n\n"
    "Numbers: ١٢٣ ४५६ Ⅻ ½ ²³ 3.14159e-10 €100 ¥1000\n"
    "Specials inline: <|endoftext|> and <|padding|> stay verbatim.   ";

// ---- ByteTokenizer ----

TEST(ByteTokenizer, RoundTripsUtf8CorpusExactly) {
  const kmamba::ByteTokenizer tokenizer;
  const Ids ids = tokenizer.encode(corpus);
  ASSERT_EQ(ids.size(), corpus.size());
  for (std::size_t i = 0; i < ids.size(); ++i) {
    ASSERT_EQ(ids[i], static_cast<unsigned char>(corpus[i]));
  }
  EXPECT_EQ(tokenizer.decode(ids), corpus);
  EXPECT_EQ(tokenizer.vocab_size(), 256);
  EXPECT_EQ(tokenizer.eos_id(), -1);
  EXPECT_TRUE(tokenizer.special_tokens().empty());
}

TEST(ByteTokenizer, RoundTripsEveryByteIncludingInvalidUtf8) {
  const kmamba::ByteTokenizer tokenizer;
  std::string all;
  for (int b = 255; b >= 0; --b) all += static_cast<char>(b);
  EXPECT_EQ(tokenizer.decode(tokenizer.encode(all)), all);
}

TEST(ByteTokenizer, RejectsIdsOutsideTheBytes) {
  const kmamba::ByteTokenizer tokenizer;
  EXPECT_THROW(tokenizer.token_bytes(256), kmamba::UserError);
  EXPECT_THROW(tokenizer.decode({65, -1}), kmamba::UserError);
}

// ---- BpeTokenizer: the fixture ----

TEST(BpeTokenizer, ReadsTheFixture) {
  const kmamba::BpeTokenizer& tokenizer = fixture();
  EXPECT_EQ(tokenizer.vocab_size(), 2 + 256 + 400 + 2);
  EXPECT_EQ(tokenizer.eos_id(), 0);
  EXPECT_FALSE(tokenizer.add_prefix_space());
  const std::vector<kmamba::SpecialToken> specials = tokenizer.special_tokens();
  ASSERT_EQ(specials.size(), 2u);
  EXPECT_EQ(specials[0].id, 0);
  EXPECT_EQ(specials[0].content, "<|endoftext|>");
  EXPECT_EQ(specials[1].id, 1);
  EXPECT_EQ(specials[1].content, "<|padding|>");
  EXPECT_TRUE(tokenizer.is_special(0));
  EXPECT_FALSE(tokenizer.is_special(658));  // the added run of eight spaces is not special
  EXPECT_EQ(tokenizer.token_bytes(658), std::string(8, ' '));
  // The byte-level alphabet: 'Ġ' is the space, 'Ċ' the newline.
  EXPECT_EQ(tokenizer.token_bytes(tokenizer.token_to_id("\xc4\xa0")), " ");
  EXPECT_EQ(tokenizer.token_bytes(tokenizer.token_to_id("\xc4\x8a")), "\n");
  EXPECT_EQ(tokenizer.token_bytes(tokenizer.token_to_id("\xc4\xa0the")), " the");
  EXPECT_EQ(tokenizer.token_to_id("not a token"), -1);
}

TEST(BpeTokenizer, EncodesKnownStrings) {
  const kmamba::BpeTokenizer& tokenizer = fixture();
  const std::int64_t space_the = tokenizer.token_to_id("\xc4\xa0the");
  ASSERT_GE(space_the, 0);
  EXPECT_EQ(tokenizer.encode(" the"), Ids({space_the}));
  EXPECT_EQ(tokenizer.encode("!"), Ids({tokenizer.token_to_id("!")}));
  EXPECT_EQ(tokenizer.encode("<|endoftext|>"), Ids({0}));
  EXPECT_EQ(tokenizer.encode(std::string(8, ' ')), Ids({658}));
  EXPECT_EQ(tokenizer.encode(std::string(12, ' ')), Ids({658, 659}));
  EXPECT_TRUE(tokenizer.encode("").empty());
  // A contraction is its own split: "'s" then " the".
  EXPECT_EQ(tokenizer.encode("'s the"), concat({tokenizer.encode("'s"), Ids({space_the})}));
}

TEST(BpeTokenizer, MatchesTheIndependentReferenceEncoder) {
  const json expected = json::parse(read_file(data_dir + "/tiny_bpe_expected.json"));
  ASSERT_GE(expected.size(), 20u);
  for (const json& entry : expected) {
    const std::string text = entry["text"].get<std::string>();
    const Ids ids = entry["ids"].get<Ids>();
    EXPECT_EQ(fixture().encode(text), ids) << "text: " << text;
    EXPECT_EQ(fixture().decode(ids), text);
  }
}

TEST(BpeTokenizer, RoundTripsUtf8CorpusExactly) {
  const Ids ids = fixture().encode(corpus);
  EXPECT_LT(ids.size(), corpus.size());  // merges do happen
  EXPECT_EQ(fixture().decode(ids), corpus);
  std::istringstream lines(corpus);
  for (std::string line; std::getline(lines, line);) {
    EXPECT_EQ(fixture().decode(fixture().encode(line)), line);
  }
}

TEST(BpeTokenizer, RoundTripsRandomUnicodeText) {
  std::mt19937 rng(1234);
  // Code points from every plane kmamba's tables know, including unassigned ones; no surrogates.
  std::uniform_int_distribution<std::uint32_t> any(0, 0x10FFFF);
  std::uniform_int_distribution<int> pick(0, 9);
  std::uniform_int_distribution<std::uint32_t> ascii(0x20, 0x7E);
  for (int trial = 0; trial < 200; ++trial) {
    std::string text;
    for (int i = 0; i < 40; ++i) {
      const int kind = pick(rng);
      std::uint32_t cp = kind < 5 ? ascii(rng) : kind < 7 ? U' ' : any(rng);
      if (cp >= 0xD800 && cp <= 0xDFFF) cp = U'?';
      text += utf8(cp);
    }
    ASSERT_EQ(fixture().decode(fixture().encode(text)), text) << "trial " << trial;
  }
}

TEST(BpeTokenizer, EveryTokenDecodesToItsBytes) {
  for (std::int64_t id = 0; id < fixture().vocab_size(); ++id) {
    EXPECT_EQ(fixture().decode({id}), fixture().token_bytes(id));
  }
  EXPECT_THROW(fixture().token_bytes(fixture().vocab_size()), kmamba::UserError);
  EXPECT_THROW(fixture().token_bytes(-1), kmamba::UserError);
}

TEST(BpeTokenizer, SpecialTokensAreMatchedVerbatimAndCanBeSkipped) {
  const kmamba::BpeTokenizer& tokenizer = fixture();
  const Ids ids = tokenizer.encode("ab<|endoftext|>cd<|padding|>");
  EXPECT_EQ(ids, concat({tokenizer.encode("ab"), Ids({0}), tokenizer.encode("cd"), Ids({1})}));
  EXPECT_EQ(tokenizer.decode(ids), "ab<|endoftext|>cd<|padding|>");
  EXPECT_EQ(tokenizer.decode(ids, true), "abcd");
  // A near miss is ordinary text.
  const Ids near = tokenizer.encode("<|endoftext|");
  EXPECT_EQ(std::count(near.begin(), near.end(), 0), 0);
}

TEST(BpeTokenizer, ArrayFormMergesGiveTheSameTokenizer) {
  json j = fixture_json();
  json merges = json::array();
  for (const json& m : j["model"]["merges"]) {
    const std::string text = m.get<std::string>();
    const std::size_t space = text.find(' ');
    merges.push_back(json::array({text.substr(0, space), text.substr(space + 1)}));
  }
  j["model"]["merges"] = merges;
  const kmamba::BpeTokenizer arrays = from(j);
  EXPECT_EQ(arrays.encode(corpus), fixture().encode(corpus));
}

TEST(BpeTokenizer, AddPrefixSpacePrefixesEveryPieceBetweenAddedTokens) {
  json j = fixture_json();
  j["pre_tokenizer"]["add_prefix_space"] = true;
  const kmamba::BpeTokenizer prefixed = from(j);
  EXPECT_TRUE(prefixed.add_prefix_space());
  EXPECT_EQ(prefixed.encode("Hello world"), fixture().encode(" Hello world"));
  EXPECT_EQ(prefixed.encode(" already"), fixture().encode(" already"));
  EXPECT_EQ(prefixed.encode("a<|endoftext|>b"), concat({fixture().encode(" a"), Ids({0}), fixture().encode(" b")}));
  // As in Hugging Face, decoding keeps the space that encoding added.
  EXPECT_EQ(prefixed.decode(prefixed.encode("Hello")), " Hello");
}

TEST(BpeTokenizer, AddedTokenOptionsLstripRstripSingleWord) {
  json j = fixture_json();
  const auto add = [&](std::int64_t id, const std::string& content, const char* option) {
    json token = {{"id", id},        {"content", content}, {"special", true},    {"single_word", false},
                  {"lstrip", false}, {"rstrip", false},    {"normalized", false}};
    token[option] = true;
    j["added_tokens"].push_back(token);
  };
  add(700, "<mask>", "lstrip");
  add(701, "[R]", "rstrip");
  add(702, "cat", "single_word");
  const kmamba::BpeTokenizer tokenizer = from(j);
  EXPECT_EQ(tokenizer.vocab_size(), 703);
  EXPECT_EQ(tokenizer.encode("a  <mask> b"), concat({fixture().encode("a"), Ids({700}), fixture().encode(" b")}));
  EXPECT_EQ(tokenizer.encode("a [R]  b"), concat({fixture().encode("a "), Ids({701}), fixture().encode("b")}));
  EXPECT_EQ(tokenizer.encode("cat concat cats cat"),
            concat({Ids({702}), fixture().encode(" concat cats "), Ids({702})}));
}

TEST(BpeTokenizer, IgnoreMergesTakesWholeWordsFromTheVocabulary) {
  json j = fixture_json();
  j["model"]["vocab"]["\xc4\xa0zyx"] = 660;  // " zyx" as one token, not reachable by merges
  EXPECT_GT(from(j).encode(" zyx").size(), 1u);
  j["model"]["ignore_merges"] = true;
  EXPECT_EQ(from(j).encode(" zyx"), Ids({660}));
}

TEST(BpeTokenizer, RejectsTextThatIsNotUtf8) {
  const auto expect_error = [](const std::string& text, const std::string& fragment) {
    try {
      fixture().encode(text);
      FAIL() << "no error for invalid UTF-8";
    } catch (const kmamba::UserError& e) {
      EXPECT_NE(std::string(e.what()).find("UTF-8"), std::string::npos) << e.what();
      EXPECT_NE(std::string(e.what()).find(fragment), std::string::npos) << e.what();
    }
  };
  expect_error("abc\xff", "byte 3");
  expect_error("ok \xe6\x97", "byte 3");   // truncated character
  expect_error("\xed\xa0\x80", "byte 0");  // surrogate
  expect_error("x\xc0\xaf", "byte 1");     // overlong
}

// ---- BpeTokenizer: malformed tokenizer.json ----

void expect_text_error(const std::string& text, const std::string& fragment) {
  try {
    kmamba::BpeTokenizer::from_json(text, "bad.json");
    FAIL() << "no error (expected one mentioning '" << fragment << "')";
  } catch (const kmamba::UserError& e) {
    EXPECT_NE(std::string(e.what()).find(fragment), std::string::npos) << e.what();
    EXPECT_NE(std::string(e.what()).find("bad.json"), std::string::npos) << e.what();
  }
}

void expect_load_error(const json& j, const std::string& fragment) { expect_text_error(j.dump(), fragment); }

TEST(BpeTokenizer, MalformedFilesNameTheField) {
  expect_text_error("{ not json", "not valid JSON");
  expect_text_error("[1, 2]", "not a JSON object");
  {
    json j = fixture_json();
    j.erase("model");
    expect_load_error(j, "model is missing");
  }
  {
    json j = fixture_json();
    j["model"]["type"] = "Unigram";
    expect_load_error(j, "model.type");
  }
  {
    json j = fixture_json();
    j["model"].erase("vocab");
    expect_load_error(j, "model.vocab is missing");
  }
  {
    json j = fixture_json();
    j["model"]["vocab"]["!"] = -3;
    expect_load_error(j, "model.vocab[\"!\"]");
  }
  {
    json j = fixture_json();
    j["model"]["vocab"]["!"] = "x";
    expect_load_error(j, "model.vocab[\"!\"]");
  }
  {
    json j = fixture_json();
    j["model"]["vocab"]["!"] = 36;  // the id of '"'
    expect_load_error(j, "model.vocab gives id 36");
  }
  {
    json j = fixture_json();
    j["model"].erase("merges");
    expect_load_error(j, "model.merges is missing");
  }
  {
    json j = fixture_json();
    j["model"]["merges"][3] = "nospace";
    expect_load_error(j, "model.merges[3]");
  }
  {
    json j = fixture_json();
    j["model"]["merges"][5] = "\xc4\xa0 unknowntoken";
    expect_load_error(j, "model.merges[5]: the token 'unknowntoken' is not in model.vocab");
  }
  {
    json j = fixture_json();
    j["model"]["merges"][7] = json::array({"a", 3});
    expect_load_error(j, "model.merges[7]");
  }
  {
    json j = fixture_json();
    j["model"]["merges"].push_back("q z");
    expect_load_error(j, "the merged token 'qz' is not in model.vocab");
  }
  {
    json j = fixture_json();
    j["model"]["dropout"] = 0.1;
    expect_load_error(j, "model.dropout");
  }
  {
    json j = fixture_json();
    j["model"]["unk_token"] = "<unk>";
    expect_load_error(j, "model.unk_token");
  }
  {
    json j = fixture_json();
    j["added_tokens"][1].erase("id");
    expect_load_error(j, "added_tokens[1].id");
  }
  {
    json j = fixture_json();
    j["added_tokens"][0]["content"] = "";
    expect_load_error(j, "added_tokens[0].content");
  }
  {
    json j = fixture_json();
    j["added_tokens"][1]["content"] = "<|endoftext|>";
    expect_load_error(j, "added_tokens[1] repeats");
  }
  {
    json j = fixture_json();
    j["added_tokens"][1]["special"] = "yes";
    expect_load_error(j, "added_tokens[1].special");
  }
  {
    json j = fixture_json();
    j["pre_tokenizer"] = {{"type", "Whitespace"}};
    expect_load_error(j, "pre_tokenizer.type");
  }
  {
    json j = fixture_json();
    j["pre_tokenizer"] = nullptr;
    expect_load_error(j, "pre_tokenizer is missing or null");
  }
  {
    json j = fixture_json();
    j["pre_tokenizer"]["add_prefix_space"] = 1;
    expect_load_error(j, "pre_tokenizer.add_prefix_space");
  }
  {
    json j = fixture_json();
    j["normalizer"] = {{"type", "Lowercase"}};
    expect_load_error(j, "normalizer.type");
  }
  {
    json j = fixture_json();
    j["decoder"] = {{"type", "Metaspace"}};
    expect_load_error(j, "decoder.type");
  }
  EXPECT_THROW(kmamba::BpeTokenizer::from_file(data_dir + "/no_such_tokenizer.json"), kmamba::UserError);
}

TEST(BpeTokenizer, AcceptsSequenceWrappersOfSupportedStages) {
  json j = fixture_json();
  j["pre_tokenizer"] = {{"type", "Sequence"}, {"pretokenizers", json::array({j["pre_tokenizer"]})}};
  j["normalizer"] = json::parse(R"({"type": "Sequence", "normalizers": [{"type": "NFC"}]})");
  j["decoder"] = nullptr;
  EXPECT_EQ(from(j).encode(corpus), fixture().encode(corpus));
}

TEST(BpeTokenizer, AByteWithoutATokenIsAnError) {
  json j = fixture_json();
  j["model"]["merges"] = json::array();
  j["model"]["vocab"].erase("!");
  const kmamba::BpeTokenizer tokenizer = from(j);
  EXPECT_EQ(tokenizer.encode("ab").size(), 2u);
  EXPECT_THROW(tokenizer.encode("a!"), kmamba::UserError);
}

// ---- load_tokenizer ----

TEST(LoadTokenizer, PicksTokenizerJsonElseBytes) {
  const std::string dir = ::testing::TempDir() + "kmamba_tokenizer_model";
  ::mkdir(dir.c_str(), 0755);
  std::remove((dir + "/tokenizer.json").c_str());
  EXPECT_EQ(kmamba::load_tokenizer(dir)->vocab_size(), 256);
  {
    std::ofstream out(dir + "/tokenizer.json", std::ios::binary);
    out << read_file(fixture_path);
  }
  const auto tokenizer = kmamba::load_tokenizer(dir);
  EXPECT_EQ(tokenizer->vocab_size(), fixture().vocab_size());
  EXPECT_EQ(tokenizer->encode(corpus), fixture().encode(corpus));
  std::remove((dir + "/tokenizer.json").c_str());
}

void write_text(const std::string& path, const std::string& text) {
  std::ofstream out(path, std::ios::binary);
  out << text;
  ASSERT_TRUE(out.good()) << path;
}

std::string fresh_dir(const std::string& name) {
  const std::string dir = ::testing::TempDir() + "kmamba_tokenizer_" + name;
  std::filesystem::remove_all(dir);
  std::filesystem::create_directories(dir);
  return dir;
}

TEST(LoadTokenizer, WarnsOnceWhenAVocabularyAbove256FallsBackToBytes) {
  const std::string small = fresh_dir("small_model"), large = fresh_dir("large_model"), bad = fresh_dir("bad_model");
  write_text(small + "/config.json", R"({"vocab_size": 256, "d_model": 8})");
  // Python's json (and kmamba's config writer) spells infinity as a bare token.
  write_text(large + "/config.json", R"({"vocab_size": 50280, "d_model": 8, "time_step_limit": [0.0, Infinity]})");
  write_text(bad + "/config.json", "{not json");
  ::testing::internal::CaptureStderr();
  EXPECT_EQ(kmamba::load_tokenizer(small)->vocab_size(), 256);
  EXPECT_EQ(::testing::internal::GetCapturedStderr(), "") << "a byte-level model needs no warning";
  ::testing::internal::CaptureStderr();
  EXPECT_EQ(kmamba::load_tokenizer(large)->vocab_size(), 256);
  EXPECT_EQ(kmamba::load_tokenizer(large)->vocab_size(), 256);
  const std::string warnings = ::testing::internal::GetCapturedStderr();
  EXPECT_NE(warnings.find("kmamba: warning: the model in '" + large +
                          "' has a vocabulary of 50280 tokens but no tokenizer.json: its text is encoded as bytes"),
            std::string::npos)
      << warnings;
  EXPECT_EQ(warnings.find("warning"), warnings.rfind("warning")) << "more than one warning: " << warnings;
  expect_user_error([&] { kmamba::load_tokenizer(bad); }, {"config '" + bad + "/config.json'"});
}

// ---- TokenizerFiles ----

TEST(TokenizerFiles, TravelFromADirectoryOrAFileIntoAnother) {
  const std::string from = fresh_dir("files_from"), to = fresh_dir("files_to"), bare = fresh_dir("files_bare");
  const std::string tokenizer = read_file(fixture_path);
  write_text(from + "/tokenizer.json", tokenizer);
  write_text(from + "/special_tokens_map.json", R"({"eos_token": "<|endoftext|>"})");
  write_text(from + "/tokenizer_config.json", R"({"model_max_length": 2048})");
  write_text(from + "/config.json", R"({"vocab_size": 660})");
  const kmamba::TokenizerFiles files = kmamba::TokenizerFiles::from_directory(from);
  ASSERT_EQ(files.files.size(), 3u);
  EXPECT_EQ(files.files[0].first, "tokenizer.json");
  EXPECT_EQ(files.files[0].second, tokenizer);
  EXPECT_EQ(files.files[1].first, "tokenizer_config.json");
  EXPECT_EQ(files.files[2].first, "special_tokens_map.json");
  files.write(to);
  for (const char* name : {"tokenizer.json", "tokenizer_config.json", "special_tokens_map.json"})
    EXPECT_EQ(read_file(to + "/" + name), read_file(from + "/" + name)) << name;
  EXPECT_FALSE(std::filesystem::exists(to + "/config.json")) << "only the tokenizer travels";
  EXPECT_EQ(kmamba::TokenizerFiles::from_file(to + "/tokenizer.json").files, files.files);

  // A tokenizer.json of another name travels alone, as tokenizer.json; companions alone are none.
  const kmamba::TokenizerFiles single = kmamba::TokenizerFiles::from_file(fixture_path);
  ASSERT_EQ(single.files.size(), 1u);
  EXPECT_EQ(single.files[0].first, "tokenizer.json");
  EXPECT_EQ(single.files[0].second, tokenizer);
  write_text(bare + "/tokenizer_config.json", "{}");
  EXPECT_TRUE(kmamba::TokenizerFiles::from_directory(bare).empty());
  expect_user_error([&] { kmamba::TokenizerFiles::from_file(bare + "/tokenizer.json"); },
                    {"kmamba::TokenizerFiles", bare + "/tokenizer.json"});
}

// ---- StreamingDecoder ----

// Streams `ids` and checks that each chunk is whole valid UTF-8 and that the chunks add up to `text`.
void expect_clean_stream(const kmamba::Tokenizer& tokenizer, const Ids& ids, const std::string& text,
                         bool expect_held_back) {
  kmamba::StreamingDecoder stream(tokenizer);
  std::string out;
  bool held_back = false;
  for (const std::int64_t id : ids) {
    const std::string chunk = stream.push(id);
    ASSERT_TRUE(valid_utf8(chunk)) << "chunk after id " << id << " is not whole UTF-8";
    held_back = held_back || stream.pending_bytes() > 0;
    out += chunk;
    ASSERT_EQ(text.compare(0, out.size(), out), 0) << "the stream diverged from the text";
  }
  out += stream.flush();
  EXPECT_EQ(stream.pending_bytes(), 0u);
  EXPECT_EQ(out, text);
  EXPECT_EQ(held_back, expect_held_back);
}

TEST(StreamingDecoder, BpeNeverEmitsPartialCharacters) {
  const Ids ids = fixture().encode(corpus);
  // The test is only meaningful if some tokens end inside a character.
  std::size_t partial = 0;
  for (const std::int64_t id : ids) partial += valid_utf8(fixture().token_bytes(id)) ? 0 : 1;
  EXPECT_GT(partial, 20u);
  expect_clean_stream(fixture(), ids, corpus, true);
}

TEST(StreamingDecoder, ByteTokenizerHoldsBackUntilTheCharacterIsWhole) {
  const kmamba::ByteTokenizer bytes;
  kmamba::StreamingDecoder stream(bytes);
  const std::string emoji = "\xf0\x9f\x98\x80";  // U+1F600
  EXPECT_EQ(stream.push('a'), "a");
  for (int i = 0; i < 3; ++i) {
    EXPECT_EQ(stream.push(static_cast<unsigned char>(emoji[static_cast<std::size_t>(i)])), "");
    EXPECT_EQ(stream.pending_bytes(), static_cast<std::size_t>(i + 1));
  }
  EXPECT_EQ(stream.push(static_cast<unsigned char>(emoji[3])), emoji);
  EXPECT_EQ(stream.flush(), "");
  expect_clean_stream(bytes, bytes.encode(corpus), corpus, true);
}

TEST(StreamingDecoder, InvalidBytesBecomeReplacementCharacters) {
  const kmamba::ByteTokenizer bytes;
  const std::string fffd = "\xef\xbf\xbd";
  kmamba::StreamingDecoder stream(bytes);
  EXPECT_EQ(stream.push(0xFF), fffd);  // never valid
  EXPECT_EQ(stream.push(0x80), fffd);  // a lone continuation byte
  EXPECT_EQ(stream.push(0xE2), "");
  EXPECT_EQ(stream.push('('), fffd + "(");  // the maximal subpart E2, then the ASCII byte
  EXPECT_EQ(stream.push(0xF0), "");
  EXPECT_EQ(stream.push(0x9F), "");
  EXPECT_EQ(stream.flush(), fffd);   // a truncated character at the end
  EXPECT_EQ(stream.push('z'), "z");  // the decoder is ready for more
}

TEST(StreamingDecoder, SkipsSpecialTokensOnRequest) {
  const Ids ids = fixture().encode("one<|endoftext|>two");
  kmamba::StreamingDecoder keep(fixture());
  kmamba::StreamingDecoder skip(fixture(), true);
  std::string kept, skipped;
  for (const std::int64_t id : ids) {
    kept += keep.push(id);
    skipped += skip.push(id);
  }
  EXPECT_EQ(kept + keep.flush(), "one<|endoftext|>two");
  EXPECT_EQ(skipped + skip.flush(), "onetwo");
}

}  // namespace
