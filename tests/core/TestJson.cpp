// kmamba/core/Json.hpp: the bounded reader of untrusted JSON.
#include <kmamba/core/Error.hpp>
#include <kmamba/core/Json.hpp>

#include <gtest/gtest.h>

#include <string>
#include <vector>

namespace {

std::string parse_error(const std::string& text, const kmamba::JsonLimits& limits = {}) {
  try {
    kmamba::parse_json(text, "test.json", limits);
  } catch (const kmamba::UserError& e) {
    return e.what();
  }
  return "no error";
}

TEST(Json, LimitsDepthWithoutRecursion) {
  EXPECT_EQ(kmamba::parse_json(std::string(64, '[') + std::string(64, ']'), "test.json").dump(),
            std::string(64, '[') + std::string(64, ']'));
  EXPECT_EQ(parse_error(std::string(65, '[') + std::string(65, ']')),
            "test.json nests arrays and objects deeper than 64 levels");
  // Far beyond any stack: refused by the iterative first pass.
  const std::string deep = std::string(1000000, '[') + std::string(1000000, ']');
  EXPECT_EQ(parse_error(deep), "test.json nests arrays and objects deeper than 64 levels");
  EXPECT_EQ(parse_error(R"({"a": {"b": [1]}})", kmamba::JsonLimits{2, 1000}),
            "test.json nests arrays and objects deeper than 2 levels");
}

TEST(Json, LimitsSize) {
  EXPECT_EQ(parse_error("[1, 2, 3]", kmamba::JsonLimits{64, 8}),
            "test.json holds 9 bytes of JSON, more than the 8 accepted");
}

TEST(Json, RefusesDuplicateKeysAtEveryLevel) {
  EXPECT_EQ(parse_error(R"({"a": 1, "a": 2})"), "test.json names the key \"a\" twice in one object");
  EXPECT_EQ(parse_error(R"({"x": [{"b": 1, "b": 1}]})"), "test.json names the key \"b\" twice in one object");
  // The same key in different objects is fine.
  EXPECT_EQ(kmamba::parse_json(R"({"a": {"a": 1}, "b": {"a": 2}})", "test.json")["b"]["a"], 2);
  EXPECT_NE(parse_error("{").find("test.json is not valid JSON: "), std::string::npos);
}

TEST(Json, QuotesValuesCutShort) {
  EXPECT_EQ(kmamba::quote_json(nlohmann::json::parse(R"({"a": [1, 2]})")), R"({"a":[1,2]})");
  const nlohmann::json long_array = nlohmann::json(std::vector<int>(40000, 1));
  const std::string quoted = kmamba::quote_json(long_array, 20);
  EXPECT_EQ(quoted.size(), 20u);
  EXPECT_EQ(quoted.substr(17), "...");
  nlohmann::json deep = 0;
  for (int i = 0; i < 100000; ++i) deep = nlohmann::json::array({std::move(deep)});
  EXPECT_EQ(kmamba::quote_json(deep, 10), "[[[[[[[...");
}

}  // namespace
