#include <kmamba/core/Error.hpp>
#include <kmamba/core/Files.hpp>
#include <kmamba/core/Json.hpp>
#include <kmamba/models/Tokenizer.hpp>

#include <algorithm>
#include <array>
#include <atomic>
#include <cstdio>
#include <filesystem>
#include <functional>
#include <limits>
#include <queue>
#include <sstream>
#include <unordered_map>
#include <utility>

namespace kmamba {
namespace {

using json = nlohmann::json;

struct CodePointRange {
  std::uint32_t first;
  std::uint32_t last;
};

#include "UnicodeRanges.inc"

template <std::size_t N>
bool in_ranges(const CodePointRange (&ranges)[N], char32_t c) {
  const CodePointRange* end = ranges + N;
  const CodePointRange* after =
      std::upper_bound(ranges, end, static_cast<std::uint32_t>(c),
                       [](std::uint32_t value, const CodePointRange& r) { return value < r.first; });
  return after != ranges && static_cast<std::uint32_t>(c) <= (after - 1)->last;
}

// \p{L}: general category L (Lu, Ll, Lt, Lm, Lo).
bool is_letter(char32_t c) {
  if (c < 0x80) return (c >= 'a' && c <= 'z') || (c >= 'A' && c <= 'Z');
  return in_ranges(letter_ranges, c);
}

// \p{N}: general category N (Nd, Nl, No).
bool is_number(char32_t c) {
  if (c < 0x80) return c >= '0' && c <= '9';
  return in_ranges(number_ranges, c);
}

// \s: the Unicode White_Space property.
bool is_whitespace(char32_t c) {
  return (c >= 0x09 && c <= 0x0D) || c == 0x20 || c == 0x85 || c == 0xA0 || c == 0x1680 ||
         (c >= 0x2000 && c <= 0x200A) || c == 0x2028 || c == 0x2029 || c == 0x202F || c == 0x205F || c == 0x3000;
}

bool is_word_character(char32_t c) { return is_letter(c) || is_number(c) || c == '_'; }

// ---- UTF-8 ----

enum class Utf8 { Complete, Incomplete, Invalid };

// Classifies the bytes at s[pos..n): Complete (a whole character of `length` bytes, code point
// `cp`), Incomplete (every byte up to n is a valid start of one character), or Invalid (`length`
// bytes form a maximal invalid subsequence, in the sense of Unicode's U+FFFD substitution practice).
Utf8 next_utf8(const std::string& s, std::size_t pos, std::size_t& length, char32_t& cp) {
  const auto byte = [&](std::size_t i) { return static_cast<unsigned char>(s[i]); };
  const unsigned char b0 = byte(pos);
  length = 1;
  if (b0 < 0x80) {
    cp = b0;
    return Utf8::Complete;
  }
  std::size_t need = 0;
  unsigned char lo = 0x80, hi = 0xBF;  // allowed range of the second byte
  if (b0 >= 0xC2 && b0 <= 0xDF) {
    need = 1;
  } else if (b0 >= 0xE0 && b0 <= 0xEF) {
    need = 2;
    if (b0 == 0xE0) lo = 0xA0;
    if (b0 == 0xED) hi = 0x9F;
  } else if (b0 >= 0xF0 && b0 <= 0xF4) {
    need = 3;
    if (b0 == 0xF0) lo = 0x90;
    if (b0 == 0xF4) hi = 0x8F;
  } else {
    return Utf8::Invalid;
  }
  cp = b0 & (0x3F >> need);
  for (std::size_t k = 1; k <= need; ++k) {
    if (pos + k >= s.size()) return Utf8::Incomplete;
    const unsigned char b = byte(pos + k);
    if (b < (k == 1 ? lo : 0x80) || b > (k == 1 ? hi : 0xBF)) {
      length = k;
      return Utf8::Invalid;
    }
    cp = (cp << 6) | (b & 0x3Fu);
  }
  length = need + 1;
  return Utf8::Complete;
}

void append_utf8(std::string& out, char32_t c) {
  if (c < 0x80) {
    out += static_cast<char>(c);
  } else if (c < 0x800) {
    out += static_cast<char>(0xC0 | (c >> 6));
    out += static_cast<char>(0x80 | (c & 0x3F));
  } else if (c < 0x10000) {
    out += static_cast<char>(0xE0 | (c >> 12));
    out += static_cast<char>(0x80 | ((c >> 6) & 0x3F));
    out += static_cast<char>(0x80 | (c & 0x3F));
  } else {
    out += static_cast<char>(0xF0 | (c >> 18));
    out += static_cast<char>(0x80 | ((c >> 12) & 0x3F));
    out += static_cast<char>(0x80 | ((c >> 6) & 0x3F));
    out += static_cast<char>(0x80 | (c & 0x3F));
  }
}

const char* const replacement_character = "\xEF\xBF\xBD";  // U+FFFD

// The code points of valid UTF-8 `s` with the byte offset of each (plus s.size() at the end), or
// `bad` set to the offset of the first invalid byte.
bool decode_utf8(const std::string& s, std::vector<char32_t>& cps, std::vector<std::size_t>& offsets,
                 std::size_t& bad) {
  cps.clear();
  offsets.clear();
  std::size_t pos = 0;
  while (pos < s.size()) {
    std::size_t length = 0;
    char32_t cp = 0;
    if (next_utf8(s, pos, length, cp) != Utf8::Complete) {
      bad = pos;
      return false;
    }
    cps.push_back(cp);
    offsets.push_back(pos);
    pos += length;
  }
  offsets.push_back(s.size());
  return true;
}

// ---- GPT-2 byte-level alphabet ----

// GPT-2's bytes_to_unicode(): printable bytes map to themselves, the others to 256, 257, ...
struct ByteAlphabet {
  std::array<char32_t, 256> to_char{};
  std::array<int, 324> to_byte{};  // -1 where the code point is not in the alphabet

  ByteAlphabet() {
    to_byte.fill(-1);
    char32_t next = 256;
    for (int b = 0; b < 256; ++b) {
      const bool printable = (b >= '!' && b <= '~') || (b >= 0xA1 && b <= 0xAC) || (b >= 0xAE && b <= 0xFF);
      to_char[b] = printable ? static_cast<char32_t>(b) : next++;
      to_byte[to_char[b]] = b;
    }
  }
};

const ByteAlphabet& byte_alphabet() {
  static const ByteAlphabet alphabet;
  return alphabet;
}

// Bytes -> the string of their alphabet characters (how byte-level vocabularies spell tokens).
std::string to_byte_level(const char* bytes, std::size_t n) {
  std::string out;
  for (std::size_t i = 0; i < n; ++i) append_utf8(out, byte_alphabet().to_char[static_cast<unsigned char>(bytes[i])]);
  return out;
}

// The ByteLevel decoder of Hugging Face: a token whose characters are all in the alphabet stands
// for their bytes; any other token stands for its own UTF-8 text.
std::string from_byte_level(const std::string& token) {
  std::string out;
  std::size_t pos = 0;
  while (pos < token.size()) {
    std::size_t length = 0;
    char32_t cp = 0;
    if (next_utf8(token, pos, length, cp) != Utf8::Complete || cp >= 324 || byte_alphabet().to_byte[cp] < 0) {
      return token;
    }
    out += static_cast<char>(byte_alphabet().to_byte[cp]);
    pos += length;
  }
  return out;
}

// ---- GPT-2 pre-tokenizer ----

// Splits code points into the matches of
//   's|'t|'re|'ve|'m|'ll|'d| ?\p{L}+| ?\p{N}+| ?[^\s\p{L}\p{N}]+|\s+(?!\S)|\s+
// (leftmost-first alternation, as the regex engines of GPT-2 and Hugging Face evaluate it). The
// pattern matches at every position, so the matches tile the input. Returns [begin, end) pairs.
std::vector<std::pair<std::size_t, std::size_t>> gpt2_split(const std::vector<char32_t>& cps) {
  std::vector<std::pair<std::size_t, std::size_t>> out;
  const std::size_t n = cps.size();
  const auto is_other = [](char32_t c) { return !is_whitespace(c) && !is_letter(c) && !is_number(c); };
  // ` ?CLASS+` at i: the end of the match, or i if it does not match.
  const auto optional_space_run = [&](std::size_t i, auto in_class) {
    std::size_t j = i;
    if (cps[j] == U' ' && j + 1 < n && in_class(cps[j + 1])) ++j;
    if (!in_class(cps[j])) return i;
    while (j < n && in_class(cps[j])) ++j;
    return j;
  };
  std::size_t i = 0;
  while (i < n) {
    std::size_t end = i;
    if (cps[i] == U'\'' && i + 1 < n) {
      const char32_t c1 = cps[i + 1];
      const char32_t c2 = i + 2 < n ? cps[i + 2] : 0;
      if (c1 == U's' || c1 == U't' || c1 == U'm' || c1 == U'd') {
        end = i + 2;
      } else if ((c1 == U'r' && c2 == U'e') || (c1 == U'v' && c2 == U'e') || (c1 == U'l' && c2 == U'l')) {
        end = i + 3;
      }
    }
    if (end == i) end = optional_space_run(i, is_letter);
    if (end == i) end = optional_space_run(i, is_number);
    if (end == i) end = optional_space_run(i, is_other);
    if (end == i) {
      // Whitespace: the whole run if it ends the text, else the run but its last character (which
      // then prefixes the next word), else (a single whitespace before a non-space) the run itself.
      std::size_t k = i;
      while (k < n && is_whitespace(cps[k])) ++k;
      end = (k == n || k - 1 == i) ? k : k - 1;
    }
    out.emplace_back(i, end);
    i = end;
  }
  return out;
}

// ---- tokenizer.json reading ----

std::string in_quotes(const std::string& s) { return "'" + s + "'"; }

class JsonSource {
 public:
  explicit JsonSource(std::string source) : prefix_("tokenizer.json " + in_quotes(source) + ": ") {}
  const std::string& prefix() const { return prefix_; }

  const json& object(const json& parent, const char* key, const std::string& field) const {
    KMAMBA_REQUIRE(parent.contains(key), prefix_ << "the field " << field << " is missing");
    const json& v = parent[key];
    KMAMBA_REQUIRE(v.is_object(), prefix_ << field << " is " << brief(v) << ", expected an object");
    return v;
  }

  bool boolean(const json& parent, const char* key, bool fallback, const std::string& field) const {
    if (!parent.contains(key) || parent[key].is_null()) return fallback;
    KMAMBA_REQUIRE(parent[key].is_boolean(),
                   prefix_ << field << " is " << brief(parent[key]) << ", expected true or false");
    return parent[key].get<bool>();
  }

  // A string field; null or absent gives `fallback`.
  std::string string(const json& parent, const char* key, const std::string& fallback, const std::string& field) const {
    if (!parent.contains(key) || parent[key].is_null()) return fallback;
    KMAMBA_REQUIRE(parent[key].is_string(), prefix_ << field << " is " << brief(parent[key]) << ", expected a string");
    return parent[key].get<std::string>();
  }

  std::int64_t id(const json& v, const std::string& field) const {
    KMAMBA_REQUIRE(v.is_number_integer() && v.get<std::int64_t>() >= 0 &&
                       v.get<std::int64_t>() <= std::numeric_limits<std::int32_t>::max(),
                   prefix_ << field << " is " << brief(v) << ", expected a token id (an integer in [0, 2^31))");
    return v.get<std::int64_t>();
  }

  // The JSON text of `v`, shortened for messages.
  static std::string brief(const json& v) { return quote_json(v); }

 private:
  std::string prefix_;
};

}  // namespace

// ---- Tokenizer ----

std::string Tokenizer::decode(const std::vector<std::int64_t>& ids, bool skip_special) const {
  std::string out;
  for (const std::int64_t id : ids) {
    if (skip_special && is_special(id)) continue;
    out += token_bytes(id);
  }
  return out;
}

// ---- ByteTokenizer ----

ByteTokenizer::ByteTokenizer() {
  bytes_.reserve(256);
  for (int b = 0; b < 256; ++b) bytes_.emplace_back(1, static_cast<char>(b));
}

std::vector<std::int64_t> ByteTokenizer::encode(const std::string& text) const {
  std::vector<std::int64_t> ids(text.size());
  std::transform(text.begin(), text.end(), ids.begin(),
                 [](char c) { return static_cast<std::int64_t>(static_cast<unsigned char>(c)); });
  return ids;
}

const std::string& ByteTokenizer::token_bytes(std::int64_t id) const {
  KMAMBA_REQUIRE(id >= 0 && id < 256, "kmamba::ByteTokenizer: token id " << id << " is outside [0, 256)");
  return bytes_[static_cast<std::size_t>(id)];
}

// ---- BpeTokenizer ----

struct BpeTokenizer::State {
  struct Merge {
    std::int32_t rank;
    std::int64_t merged;
  };
  struct Added {
    std::int64_t id;
    std::string content;
    bool special, single_word, lstrip, rstrip;
  };

  std::string source;
  std::unordered_map<std::string, std::int64_t> vocab;  // byte-level spelling -> id
  std::vector<std::string> id_bytes;                    // the bytes each id stands for
  std::vector<char> id_known;                           // whether an id is a token
  std::vector<char> id_special;
  std::unordered_map<std::uint64_t, Merge> merges;  // (left id, right id) -> rank, result
  std::array<std::int64_t, 256> byte_ids{};         // the token of each single byte, -1 if none
  std::int64_t unk_id = -1;
  bool ignore_merges = false;
  bool add_prefix_space = false;
  bool use_regex = true;
  std::vector<Added> added;                                       // in id order
  std::array<std::vector<std::size_t>, 256> added_by_first_byte;  // indices into `added`, longest first
  std::int64_t eos = -1;

  // The steps of BpeTokenizer::from_json, each reading its part of tokenizer.json. The vocabulary
  // size is one more than the largest id of model.vocab and added_tokens.
  // model: its type and options, vocab (each id's token also into `id_to_token`), merges, unk_token;
  // returns the vocabulary size so far.
  std::int64_t read_model(const JsonSource& src, const json& model,
                          std::unordered_map<std::int64_t, std::string>& id_to_token);
  void read_merges(const JsonSource& src, const json& model);
  // added_tokens, with added_by_first_byte; returns the vocabulary size counting them.
  std::int64_t read_added_tokens(const JsonSource& src, const json& root, std::int64_t size);
  // normalizer, pre_tokenizer and decoder.
  void read_pipeline(const JsonSource& src, const json& root);
  // id_bytes, id_known, id_special and byte_ids.
  void build_id_tables(std::int64_t size, const std::unordered_map<std::int64_t, std::string>& id_to_token);

  static std::uint64_t pair_key(std::int64_t left, std::int64_t right) {
    return (static_cast<std::uint64_t>(left) << 32) | static_cast<std::uint64_t>(right);
  }

  std::int64_t size() const { return static_cast<std::int64_t>(id_bytes.size()); }

  std::int64_t lookup(const std::string& token) const {
    for (const Added& a : added) {
      if (a.content == token) return a.id;
    }
    const auto it = vocab.find(token);
    return it == vocab.end() ? -1 : it->second;
  }

  void encode(const std::string& text, std::vector<std::int64_t>& out) const {
    std::vector<char32_t> cps;
    std::vector<std::size_t> offsets;
    std::size_t bad = 0;
    KMAMBA_REQUIRE(decode_utf8(text, cps, offsets, bad),
                   "kmamba::BpeTokenizer::encode: the text is not valid UTF-8 (byte "
                       << bad << " of " << text.size() << ", value 0x" << std::hex
                       << static_cast<int>(static_cast<unsigned char>(text[bad])) << ")");
    std::size_t piece_begin = 0;  // code point index where the text before the next added token starts
    std::size_t c = 0;
    while (c < cps.size()) {
      std::size_t match_end = 0;
      const Added* match = match_added(text, cps, offsets, c, match_end);
      if (match == nullptr) {
        ++c;
        continue;
      }
      std::size_t begin = c;
      if (match->lstrip) {
        while (begin > piece_begin && is_whitespace(cps[begin - 1])) --begin;
      }
      if (match->rstrip) {
        while (match_end < cps.size() && is_whitespace(cps[match_end])) ++match_end;
      }
      encode_piece(text.substr(offsets[piece_begin], offsets[begin] - offsets[piece_begin]), out);
      out.push_back(match->id);
      piece_begin = c = match_end;
    }
    encode_piece(text.substr(offsets[piece_begin]), out);
  }

  // The added token that matches at code point c (the longest that passes its single_word rule),
  // or nullptr; `end` receives the code point index after it.
  const Added* match_added(const std::string& text, const std::vector<char32_t>& cps,
                           const std::vector<std::size_t>& offsets, std::size_t c, std::size_t& end) const {
    const std::size_t at = offsets[c];
    for (const std::size_t index : added_by_first_byte[static_cast<unsigned char>(text[at])]) {
      const Added& a = added[index];
      if (text.compare(at, a.content.size(), a.content) != 0) continue;
      std::size_t e = c;
      while (offsets[e] < at + a.content.size()) ++e;
      if (a.single_word &&
          ((c > 0 && is_word_character(cps[c - 1])) || (e < cps.size() && is_word_character(cps[e])))) {
        continue;
      }
      end = e;
      return &a;
    }
    return nullptr;
  }

  // Text between added tokens: prefix space, GPT-2 split, BPE of each split.
  void encode_piece(std::string piece, std::vector<std::int64_t>& out) const {
    if (piece.empty()) return;
    if (add_prefix_space && piece[0] != ' ') piece.insert(0, 1, ' ');
    if (!use_regex) {
      encode_word(piece.data(), piece.size(), out);
      return;
    }
    std::vector<char32_t> cps;
    std::vector<std::size_t> offsets;
    std::size_t bad = 0;
    decode_utf8(piece, cps, offsets, bad);
    for (const auto& span : gpt2_split(cps)) {
      encode_word(piece.data() + offsets[span.first], offsets[span.second] - offsets[span.first], out);
    }
  }

  // Byte-pair encoding of one split: start from one symbol per byte and merge the adjacent pair of
  // lowest rank (leftmost on ties) until no pair has a merge, as Hugging Face's BPE model does.
  void encode_word(const char* bytes, std::size_t n, std::vector<std::int64_t>& out) const {
    if (ignore_merges) {
      const auto it = vocab.find(to_byte_level(bytes, n));
      if (it != vocab.end()) {
        out.push_back(it->second);
        return;
      }
    }
    constexpr std::size_t none = std::numeric_limits<std::size_t>::max();
    struct Symbol {
      std::int64_t id;
      std::size_t prev, next;
      bool alive;
    };
    std::vector<Symbol> symbols(n);
    for (std::size_t i = 0; i < n; ++i) {
      const unsigned char b = static_cast<unsigned char>(bytes[i]);
      std::int64_t id = byte_ids[b];
      if (id < 0) {
        KMAMBA_REQUIRE(unk_id >= 0, "kmamba::BpeTokenizer::encode: byte 0x"
                                        << std::hex << static_cast<int>(b) << " has no token in model.vocab of "
                                        << in_quotes(source) << " and there is no model.unk_token");
        id = unk_id;
      }
      symbols[i] = {id, i == 0 ? none : i - 1, i + 1 == n ? none : i + 1, true};
    }
    using Candidate = std::pair<std::int32_t, std::size_t>;  // (rank, position of the left symbol)
    std::priority_queue<Candidate, std::vector<Candidate>, std::greater<Candidate>> queue;
    const auto push = [&](std::size_t left) {
      if (left == none || symbols[left].next == none) return;
      const auto it = merges.find(pair_key(symbols[left].id, symbols[symbols[left].next].id));
      if (it != merges.end()) queue.emplace(it->second.rank, left);
    };
    for (std::size_t i = 0; i + 1 < n; ++i) push(i);
    while (!queue.empty()) {
      const Candidate top = queue.top();
      queue.pop();
      Symbol& left = symbols[top.second];
      if (!left.alive || left.next == none) continue;
      const auto it = merges.find(pair_key(left.id, symbols[left.next].id));
      if (it == merges.end() || it->second.rank != top.first) continue;  // stale candidate
      Symbol& right = symbols[left.next];
      left.id = it->second.merged;
      right.alive = false;
      left.next = right.next;
      if (left.next != none) symbols[left.next].prev = top.second;
      push(left.prev);
      push(top.second);
    }
    for (const Symbol& s : symbols) {
      if (s.alive) out.push_back(s.id);
    }
  }
};

namespace {

// Accepts the normalizers kmamba can honour: none, or NFC (not applied; see the header).
void check_normalizer(const JsonSource& src, const json& normalizer, const std::string& field) {
  if (normalizer.is_null()) return;
  KMAMBA_REQUIRE(
      normalizer.is_object() && normalizer.contains("type") && normalizer["type"].is_string(),
      src.prefix() << field << " is " << JsonSource::brief(normalizer) << ", expected an object with a \"type\"");
  const std::string type = normalizer["type"].get<std::string>();
  if (type == "NFC") return;
  if (type == "Sequence") {
    KMAMBA_REQUIRE(normalizer.contains("normalizers") && normalizer["normalizers"].is_array(),
                   src.prefix() << field << ".normalizers is missing or not an array");
    for (std::size_t i = 0; i < normalizer["normalizers"].size(); ++i) {
      check_normalizer(src, normalizer["normalizers"][i], field + ".normalizers[" + std::to_string(i) + "]");
    }
    return;
  }
  KMAMBA_USER_ERROR(src.prefix() << field << ".type is " << in_quotes(type)
                                 << ", which kmamba does not support (byte-level BPE tokenizers use none or NFC)");
}

// The ByteLevel pre-tokenizer, alone or as the only member of a Sequence.
const json& byte_level_pre_tokenizer(const JsonSource& src, const json& root) {
  KMAMBA_REQUIRE(root.contains("pre_tokenizer") && root["pre_tokenizer"].is_object(),
                 src.prefix() << "pre_tokenizer is missing or null; kmamba supports byte-level BPE "
                                 "(pre_tokenizer of type \"ByteLevel\")");
  const json& pre = root["pre_tokenizer"];
  const std::string type = src.string(pre, "type", "", "pre_tokenizer.type");
  if (type == "Sequence") {
    KMAMBA_REQUIRE(pre.contains("pretokenizers") && pre["pretokenizers"].is_array() &&
                       pre["pretokenizers"].size() == 1 && pre["pretokenizers"][0].is_object(),
                   src.prefix() << "pre_tokenizer.pretokenizers must hold exactly one ByteLevel pre-tokenizer, got "
                                << JsonSource::brief(pre.value("pretokenizers", json())));
    const std::string inner = src.string(pre["pretokenizers"][0], "type", "", "pre_tokenizer.pretokenizers[0].type");
    KMAMBA_REQUIRE(inner == "ByteLevel", src.prefix() << "pre_tokenizer.pretokenizers[0].type is " << in_quotes(inner)
                                                      << ", kmamba supports \"ByteLevel\"");
    return pre["pretokenizers"][0];
  }
  KMAMBA_REQUIRE(type == "ByteLevel",
                 src.prefix() << "pre_tokenizer.type is " << in_quotes(type) << ", kmamba supports \"ByteLevel\"");
  return pre;
}

// One entry of model.merges: "left right" or ["left", "right"].
std::pair<std::string, std::string> merge_pair(const JsonSource& src, const json& entry, std::size_t index) {
  const std::string field = "model.merges[" + std::to_string(index) + "]";
  if (entry.is_string()) {
    const std::string text = entry.get<std::string>();
    const std::size_t space = text.find(' ');
    KMAMBA_REQUIRE(
        space != std::string::npos && space > 0 && space + 1 < text.size() &&
            text.find(' ', space + 1) == std::string::npos,
        src.prefix() << field << " is " << JsonSource::brief(entry) << ", expected two tokens separated by one space");
    return {text.substr(0, space), text.substr(space + 1)};
  }
  KMAMBA_REQUIRE(entry.is_array() && entry.size() == 2 && entry[0].is_string() && entry[1].is_string(),
                 src.prefix() << field << " is " << JsonSource::brief(entry)
                              << ", expected \"left right\" or [\"left\", \"right\"]");
  return {entry[0].get<std::string>(), entry[1].get<std::string>()};
}

}  // namespace

BpeTokenizer::BpeTokenizer(std::shared_ptr<const State> state) : state_(std::move(state)) {}

BpeTokenizer BpeTokenizer::from_file(const std::string& path, const std::string& eos_token) {
  return from_json(read_input_file(path, JsonLimits().max_bytes, "kmamba::BpeTokenizer"), path, eos_token);
}

BpeTokenizer BpeTokenizer::from_json(const std::string& json_text, const std::string& source,
                                     const std::string& eos_token) {
  const JsonSource src(source);
  const json root = parse_json(json_text, "tokenizer.json " + in_quotes(source));
  KMAMBA_REQUIRE(root.is_object(), src.prefix() << "the top level is not a JSON object");
  auto state = std::make_shared<State>();
  state->source = source;
  std::unordered_map<std::int64_t, std::string> id_to_token;
  std::int64_t size = state->read_model(src, src.object(root, "model", "model"), id_to_token);
  size = state->read_added_tokens(src, root, size);
  state->read_pipeline(src, root);
  state->build_id_tables(size, id_to_token);
  state->eos = state->lookup(eos_token);
  return BpeTokenizer(std::move(state));
}

std::int64_t BpeTokenizer::State::read_model(const JsonSource& src, const json& model,
                                             std::unordered_map<std::int64_t, std::string>& id_to_token) {
  const std::string type = src.string(model, "type", "BPE", "model.type");
  KMAMBA_REQUIRE(type == "BPE", src.prefix() << "model.type is " << in_quotes(type) << ", kmamba supports \"BPE\"");
  KMAMBA_REQUIRE(!model.contains("dropout") || model["dropout"].is_null() ||
                     (model["dropout"].is_number() && model["dropout"].get<double>() == 0.0),
                 src.prefix() << "model.dropout is " << JsonSource::brief(model["dropout"])
                              << "; BPE dropout is not supported (expected null)");
  for (const char* key : {"continuing_subword_prefix", "end_of_word_suffix"}) {
    KMAMBA_REQUIRE(src.string(model, key, "", std::string("model.") + key).empty(),
                   src.prefix() << "model." << key << " is set; byte-level BPE uses none");
  }
  KMAMBA_REQUIRE(!src.boolean(model, "byte_fallback", false, "model.byte_fallback"),
                 src.prefix() << "model.byte_fallback is true; byte-level BPE does not use byte fallback");
  ignore_merges = src.boolean(model, "ignore_merges", false, "model.ignore_merges");

  const json& vocab_json = src.object(model, "vocab", "model.vocab");
  std::int64_t size = 0;
  for (auto it = vocab_json.begin(); it != vocab_json.end(); ++it) {
    const std::int64_t id = src.id(it.value(), "model.vocab[\"" + it.key() + "\"]");
    const auto inserted = id_to_token.emplace(id, it.key());
    KMAMBA_REQUIRE(inserted.second, src.prefix()
                                        << "model.vocab gives id " << id << " to both "
                                        << in_quotes(inserted.first->second) << " and " << in_quotes(it.key()));
    vocab.emplace(it.key(), id);
    size = std::max(size, id + 1);
  }
  read_merges(src, model);

  const std::string unk = src.string(model, "unk_token", "", "model.unk_token");
  if (!unk.empty()) {
    const auto it = vocab.find(unk);
    KMAMBA_REQUIRE(it != vocab.end(), src.prefix() << "model.unk_token " << in_quotes(unk) << " is not in model.vocab");
    unk_id = it->second;
  }
  return size;
}

void BpeTokenizer::State::read_merges(const JsonSource& src, const json& model) {
  KMAMBA_REQUIRE(model.contains("merges"), src.prefix() << "the field model.merges is missing");
  const json& list = model["merges"];
  KMAMBA_REQUIRE(list.is_array(), src.prefix()
                                      << "model.merges is " << JsonSource::brief(list) << ", expected an array");
  KMAMBA_REQUIRE(list.size() < static_cast<std::size_t>(std::numeric_limits<std::int32_t>::max()),
                 src.prefix() << "model.merges has too many entries");
  for (std::size_t i = 0; i < list.size(); ++i) {
    const auto pair = merge_pair(src, list[i], i);
    const auto token_id = [&](const std::string& token, const char* what) {
      const auto it = vocab.find(token);
      KMAMBA_REQUIRE(it != vocab.end(), src.prefix() << "model.merges[" << i << "]: " << what << " " << in_quotes(token)
                                                     << " is not in model.vocab");
      return it->second;
    };
    const std::int64_t left = token_id(pair.first, "the token");
    const std::int64_t right = token_id(pair.second, "the token");
    const std::int64_t merged = token_id(pair.first + pair.second, "the merged token");
    merges.emplace(pair_key(left, right), Merge{static_cast<std::int32_t>(i), merged});
  }
}

std::int64_t BpeTokenizer::State::read_added_tokens(const JsonSource& src, const json& root, std::int64_t size) {
  if (root.contains("added_tokens") && !root["added_tokens"].is_null()) {
    const json& list = root["added_tokens"];
    KMAMBA_REQUIRE(list.is_array(), src.prefix()
                                        << "added_tokens is " << JsonSource::brief(list) << ", expected an array");
    for (std::size_t i = 0; i < list.size(); ++i) {
      const std::string field = "added_tokens[" + std::to_string(i) + "]";
      const json& entry = list[i];
      KMAMBA_REQUIRE(entry.is_object(), src.prefix()
                                            << field << " is " << JsonSource::brief(entry) << ", expected an object");
      KMAMBA_REQUIRE(entry.contains("id"), src.prefix() << "the field " << field << ".id is missing");
      Added token;
      token.id = src.id(entry["id"], field + ".id");
      token.content = src.string(entry, "content", "", field + ".content");
      KMAMBA_REQUIRE(!token.content.empty(), src.prefix() << field << ".content is missing or empty");
      token.special = src.boolean(entry, "special", false, field + ".special");
      token.single_word = src.boolean(entry, "single_word", false, field + ".single_word");
      token.lstrip = src.boolean(entry, "lstrip", false, field + ".lstrip");
      token.rstrip = src.boolean(entry, "rstrip", false, field + ".rstrip");
      for (const Added& other : added) {
        KMAMBA_REQUIRE(other.content != token.content && other.id != token.id,
                       src.prefix() << field << " repeats the " << (other.id == token.id ? "id" : "content")
                                    << " of an earlier added token (id " << other.id << ", " << in_quotes(other.content)
                                    << ")");
      }
      added.push_back(token);
      size = std::max(size, token.id + 1);
    }
  }
  std::sort(added.begin(), added.end(), [](const Added& a, const Added& b) { return a.id < b.id; });
  for (std::size_t i = 0; i < added.size(); ++i) {
    added_by_first_byte[static_cast<unsigned char>(added[i].content[0])].push_back(i);
  }
  for (auto& bucket : added_by_first_byte) {
    std::stable_sort(bucket.begin(), bucket.end(),
                     [&](std::size_t a, std::size_t b) { return added[a].content.size() > added[b].content.size(); });
  }
  return size;
}

void BpeTokenizer::State::read_pipeline(const JsonSource& src, const json& root) {
  check_normalizer(src, root.value("normalizer", json()), "normalizer");
  const json& pre = byte_level_pre_tokenizer(src, root);
  add_prefix_space = src.boolean(pre, "add_prefix_space", true, "pre_tokenizer.add_prefix_space");
  use_regex = src.boolean(pre, "use_regex", true, "pre_tokenizer.use_regex");
  if (root.contains("decoder") && !root["decoder"].is_null()) {
    const json& decoder = root["decoder"];
    KMAMBA_REQUIRE(decoder.is_object(), src.prefix()
                                            << "decoder is " << JsonSource::brief(decoder) << ", expected an object");
    const std::string decoder_type = src.string(decoder, "type", "", "decoder.type");
    KMAMBA_REQUIRE(decoder_type == "ByteLevel",
                   src.prefix() << "decoder.type is " << in_quotes(decoder_type) << ", kmamba supports \"ByteLevel\"");
  }
}

void BpeTokenizer::State::build_id_tables(std::int64_t size,
                                          const std::unordered_map<std::int64_t, std::string>& id_to_token) {
  id_bytes.assign(static_cast<std::size_t>(size), std::string());
  id_known.assign(static_cast<std::size_t>(size), 0);
  id_special.assign(static_cast<std::size_t>(size), 0);
  for (const auto& entry : id_to_token) {
    id_bytes[static_cast<std::size_t>(entry.first)] = from_byte_level(entry.second);
    id_known[static_cast<std::size_t>(entry.first)] = 1;
  }
  for (const Added& token : added) {
    const auto id = static_cast<std::size_t>(token.id);
    id_bytes[id] = from_byte_level(token.content);
    id_known[id] = 1;
    id_special[id] = token.special ? 1 : 0;
  }
  for (int b = 0; b < 256; ++b) {
    const char byte = static_cast<char>(b);
    const auto it = vocab.find(to_byte_level(&byte, 1));
    byte_ids[static_cast<std::size_t>(b)] = it == vocab.end() ? -1 : it->second;
  }
}

std::vector<std::int64_t> BpeTokenizer::encode(const std::string& text) const {
  std::vector<std::int64_t> ids;
  state_->encode(text, ids);
  return ids;
}

std::int64_t BpeTokenizer::vocab_size() const { return state_->size(); }

const std::string& BpeTokenizer::token_bytes(std::int64_t id) const {
  KMAMBA_REQUIRE(id >= 0 && id < state_->size() && state_->id_known[static_cast<std::size_t>(id)],
                 "kmamba::BpeTokenizer: token id " << id << " is not in the vocabulary of " << in_quotes(state_->source)
                                                   << " (size " << state_->size() << ")");
  return state_->id_bytes[static_cast<std::size_t>(id)];
}

bool BpeTokenizer::is_special(std::int64_t id) const {
  return id >= 0 && id < state_->size() && state_->id_special[static_cast<std::size_t>(id)];
}

std::vector<SpecialToken> BpeTokenizer::special_tokens() const {
  std::vector<SpecialToken> out;
  for (const State::Added& token : state_->added) {
    if (token.special) out.push_back({token.id, token.content});
  }
  return out;
}

std::int64_t BpeTokenizer::eos_id() const { return state_->eos; }

std::int64_t BpeTokenizer::token_to_id(const std::string& token) const { return state_->lookup(token); }

bool BpeTokenizer::add_prefix_space() const { return state_->add_prefix_space; }

// ---- load_tokenizer ----

namespace {

bool file_exists(const std::string& path) {
  std::error_code unknown;
  return std::filesystem::exists(path, unknown);
}

// The vocab_size of `model_dir`/config.json, or -1 when there is no config.json or it gives none
// (whether the rest of it is a model the caller can load is the model loader's business).
std::int64_t configured_vocab_size(const std::string& model_dir) {
  const std::string path = model_dir + "/config.json";
  if (!file_exists(path)) return -1;
  const json config =
      parse_json(spell_python_infinities(read_input_file(path, JsonLimits().max_bytes, "kmamba::load_tokenizer")),
                 "kmamba::load_tokenizer: config " + in_quotes(path));
  const auto it = config.is_object() ? config.find("vocab_size") : config.end();
  return it != config.end() && it->is_number_integer() ? it->get<std::int64_t>() : -1;
}

// Every prompt of a run meets the same fallback: one warning per process is enough.
std::atomic<bool> byte_fallback_warned{false};

}  // namespace

std::unique_ptr<Tokenizer> load_tokenizer(const std::string& model_dir) {
  const std::string path = model_dir + "/tokenizer.json";
  if (file_exists(path)) return std::make_unique<BpeTokenizer>(BpeTokenizer::from_file(path));
  const std::int64_t vocab = configured_vocab_size(model_dir);
  if (vocab > 256 && !byte_fallback_warned.exchange(true)) {
    std::fprintf(stderr,
                 "kmamba: warning: the model in '%s' has a vocabulary of %lld tokens but no tokenizer.json: its text "
                 "is encoded as bytes (ids 0-255), which is not the tokenizer it was trained with; put that "
                 "tokenizer.json into the directory or give it to the tool (--tokenizer)\n",
                 model_dir.c_str(), static_cast<long long>(vocab));
  }
  return std::make_unique<ByteTokenizer>();
}

// ---- TokenizerFiles ----

namespace {
constexpr const char* tokenizer_json = "tokenizer.json";
}  // namespace

TokenizerFiles TokenizerFiles::from_directory(const std::string& dir) {
  TokenizerFiles t;
  if (!file_exists(dir + "/" + tokenizer_json)) return t;
  const std::uint64_t max_bytes = JsonLimits().max_bytes;
  const char* what = "kmamba::TokenizerFiles";
  t.files.emplace_back(tokenizer_json, read_input_file(dir + "/" + tokenizer_json, max_bytes, what));
  for (const char* name : companions) {
    const std::string path = dir + "/" + name;
    if (file_exists(path)) t.files.emplace_back(name, read_input_file(path, max_bytes, what));
  }
  return t;
}

TokenizerFiles TokenizerFiles::from_file(const std::string& path) {
  const std::filesystem::path file(path);
  if (file.filename() == tokenizer_json) {
    TokenizerFiles t = from_directory(file.parent_path().empty() ? "." : file.parent_path().string());
    if (!t.empty()) return t;
  }
  TokenizerFiles t;
  t.files.emplace_back(tokenizer_json, read_input_file(path, JsonLimits().max_bytes, "kmamba::TokenizerFiles"));
  return t;
}

void TokenizerFiles::write(const std::string& dir) const {
  for (const auto& file : files) write_output_file(dir + "/" + file.first, file.second, "kmamba::TokenizerFiles");
}

// ---- StreamingDecoder ----

StreamingDecoder::StreamingDecoder(const Tokenizer& tokenizer, bool skip_special)
    : tokenizer_(&tokenizer), skip_special_(skip_special) {}

namespace {

// Moves the whole characters at the front of `pending` to the result; invalid bytes become U+FFFD,
// and so does an incomplete character at the end if `final`.
std::string drain(std::string& pending, bool final) {
  std::string out;
  std::size_t pos = 0;
  while (pos < pending.size()) {
    std::size_t length = 0;
    char32_t cp = 0;
    const Utf8 status = next_utf8(pending, pos, length, cp);
    if (status == Utf8::Complete) {
      out.append(pending, pos, length);
      pos += length;
    } else if (status == Utf8::Invalid) {
      out += replacement_character;
      pos += length;
    } else {
      if (!final) break;
      out += replacement_character;
      pos = pending.size();
    }
  }
  pending.erase(0, pos);
  return out;
}

}  // namespace

std::string StreamingDecoder::push(std::int64_t id) {
  if (skip_special_ && tokenizer_->is_special(id)) return std::string();
  pending_ += tokenizer_->token_bytes(id);
  return drain(pending_, false);
}

std::string StreamingDecoder::flush() { return drain(pending_, true); }

}  // namespace kmamba
