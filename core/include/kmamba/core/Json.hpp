// The one JSON reader for untrusted text (config.json, tokenizer.json, safetensors headers and
// their metadata, run files): nlohmann/json behind a first, validating SAX pass.
//
// The SAX pass holds no tree and recurses nowhere, so it bounds what the tree built afterwards can
// be: at most `max_depth` nested arrays and objects (a value nested 100 000 deep would overflow the
// stack of any recursive walk: dump(), comparisons, destructors of older nlohmann versions), at
// most `max_bytes` of text, and no key twice in one object (a later value would silently replace
// the earlier one). Duplicates are found with one hash set per open object, in linear time.
// Values quoted in error messages go through quote_json(), which is cut short and never recurses
// deeper than its length.
//
// Header-only and needs nlohmann/json.hpp on the include path, which only kmamba's own sources,
// tests and apps have: it is not installed.
#ifndef KMAMBA_CORE_JSON_HPP
#define KMAMBA_CORE_JSON_HPP

#include <kmamba/core/Error.hpp>

#include <nlohmann/json.hpp>

#include <cstddef>
#include <cstdint>
#include <string>
#include <unordered_set>
#include <vector>

namespace kmamba {

struct JsonLimits {
  std::size_t max_depth = 64;              ///< nested arrays and objects (real files need fewer than 10)
  std::uint64_t max_bytes = 256ull << 20;  ///< the largest tokenizer.json files are tens of MB
};

namespace impl {

// A string as a JSON literal, cut short; bytes that are not UTF-8 become U+FFFD instead of throwing.
inline std::string quote_json_text(const std::string& text, std::size_t max_chars = 80) {
  const std::string quoted = nlohmann::json(text).dump(-1, ' ', false, nlohmann::json::error_handler_t::replace);
  return quoted.size() <= max_chars ? quoted : quoted.substr(0, max_chars - 3) + "...";
}

// The validating pass: stops at the first violation and keeps its description.
class JsonLimitCheck : public nlohmann::json_sax<nlohmann::json> {
 public:
  explicit JsonLimitCheck(std::size_t max_depth) : max_depth_(max_depth) {}
  const std::string& problem() const { return problem_; }

  bool null() override { return true; }
  bool boolean(bool) override { return true; }
  bool number_integer(number_integer_t) override { return true; }
  bool number_unsigned(number_unsigned_t) override { return true; }
  bool number_float(number_float_t, const string_t&) override { return true; }
  bool string(string_t&) override { return true; }
  bool binary(binary_t&) override { return true; }
  bool start_object(std::size_t) override {
    objects_.emplace_back();
    return enter();
  }
  bool key(string_t& key) override {
    if (objects_.back().insert(key).second) return true;
    problem_ = "names the key " + quote_json_text(key) + " twice in one object";
    return false;
  }
  bool end_object() override {
    objects_.pop_back();
    --depth_;
    return true;
  }
  bool start_array(std::size_t) override { return enter(); }
  bool end_array() override {
    --depth_;
    return true;
  }
  bool parse_error(std::size_t, const std::string&, const nlohmann::detail::exception& e) override {
    problem_ = std::string("is not valid JSON: ") + e.what();
    return false;
  }

 private:
  bool enter() {
    if (++depth_ <= max_depth_) return true;
    problem_ = "nests arrays and objects deeper than " + std::to_string(max_depth_) + " levels";
    return false;
  }

  std::size_t max_depth_;
  std::size_t depth_ = 0;
  std::vector<std::unordered_set<std::string>> objects_;
  std::string problem_;
};

// Appends `value`'s JSON text to `out` until `out` holds `budget` characters; each level of
// nesting adds a character first, so the recursion is no deeper than `budget`.
inline void quote_json_into(const nlohmann::json& value, std::string& out, std::size_t budget) {
  if (out.size() >= budget) return;
  if (!value.is_structured()) {
    out += value.dump(-1, ' ', false, nlohmann::json::error_handler_t::replace);
    return;
  }
  const bool object = value.is_object();
  out += object ? '{' : '[';
  bool first = true;
  for (auto it = value.begin(); it != value.end() && out.size() < budget; ++it) {
    if (!first) out += ',';
    first = false;
    if (object) out += quote_json_text(it.key(), budget) + ':';
    quote_json_into(it.value(), out, budget);
  }
  out += object ? '}' : ']';
}

}  // namespace impl

/// Parses untrusted `text`. Throws kmamba::UserError "<source> is not valid JSON: ...", "<source>
/// nests arrays and objects deeper than N levels", "<source> names the key "k" twice in one
/// object" or "<source> holds N bytes of JSON, more than ...".
inline nlohmann::json parse_json(const std::string& text, const std::string& source, const JsonLimits& limits = {}) {
  KMAMBA_REQUIRE(text.size() <= limits.max_bytes, source << " holds " << text.size() << " bytes of JSON, more than the "
                                                         << limits.max_bytes << " accepted");
  impl::JsonLimitCheck check(limits.max_depth);
  const bool valid = nlohmann::json::sax_parse(text, &check);
  KMAMBA_REQUIRE(valid, source << " " << check.problem());
  try {
    return nlohmann::json::parse(text);
  } catch (const nlohmann::json::exception& e) {
    KMAMBA_USER_ERROR(source << " is not valid JSON: " << e.what());
  }
}

/// `text` with the bare tokens Infinity and -Infinity outside strings spelt {"__float__": "Infinity"}
/// and {"__float__": "-Infinity"}, the form transformers 5 writes. Python's json module writes and
/// reads the bare tokens (transformers 4 writes them in config.json); JSON has no such tokens.
inline std::string spell_python_infinities(const std::string& text) {
  std::string out;
  out.reserve(text.size());
  bool in_string = false;
  for (std::size_t i = 0; i < text.size(); ++i) {
    const char ch = text[i];
    if (in_string) {
      out += ch;
      if (ch == '\\' && i + 1 < text.size()) {
        out += text[++i];
      } else if (ch == '"') {
        in_string = false;
      }
      continue;
    }
    if (ch == '"') in_string = true;
    const bool negative = text.compare(i, 9, "-Infinity") == 0;
    if (negative || text.compare(i, 8, "Infinity") == 0) {
      out += negative ? R"({"__float__": "-Infinity"})" : R"({"__float__": "Infinity"})";
      i += negative ? 8 : 7;
      continue;
    }
    out += ch;
  }
  return out;
}

/// `value` as JSON text for an error message, cut to about `max_chars` characters ("..." marks a cut).
inline std::string quote_json(const nlohmann::json& value, std::size_t max_chars = 60) {
  std::string out;
  impl::quote_json_into(value, out, max_chars);
  if (out.size() > max_chars) out = out.substr(0, max_chars > 3 ? max_chars - 3 : 0) + "...";
  return out;
}

}  // namespace kmamba

#endif
