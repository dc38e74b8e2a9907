#include <kmamba/core/Error.hpp>
#include <kmamba/core/Json.hpp>
#include <kmamba/models/Config.hpp>
#include "Checks.hpp"
#include "TestData.hpp"

#include <gtest/gtest.h>

#include <cmath>
#include <string>
#include <utility>
#include <vector>

namespace {

// Expects parsing `text` as test.json to throw a kmamba::UserError naming the file and `fragment`.
void expect_config_error(const std::string& text, const std::string& fragment) {
  kmamba::test::expect_user_error([&] { kmamba::ModelConfig::from_json(text, "test.json"); }, {fragment, "test.json"});
}

TEST(Config, ReadsTheGoldenMamba2Checkpoint) {
  const auto c = kmamba::ModelConfig::load(kmamba::test::golden_dir() + "/tiny_mamba2/config.json");
  EXPECT_EQ(c.mixer, kmamba::MixerKind::Mamba2);
  EXPECT_EQ(c.d_model, 64);
  EXPECT_EQ(c.n_layer, 2);
  EXPECT_EQ(c.vocab_size, 96);
  EXPECT_EQ(c.padded_vocab_size(), 96);
  EXPECT_EQ(c.num_heads(), 8);
  EXPECT_EQ(c.headdim, 16);
  EXPECT_EQ(c.ngroups, 2);
  EXPECT_EQ(c.d_state, 16);
  EXPECT_EQ(c.chunk_size, 8);
  EXPECT_EQ(c.d_conv, 4);
  EXPECT_TRUE(c.tie_embeddings);
  EXPECT_TRUE(c.conv_bias);
  EXPECT_FALSE(c.bias);
  EXPECT_EQ(c.dt_limit_min, 0.0);
  EXPECT_TRUE(std::isinf(c.dt_limit_max));
  EXPECT_EQ(c.norm_epsilon, 1e-5);
}

TEST(Config, ReadsTheGoldenMamba1Checkpoint) {
  const auto c = kmamba::ModelConfig::load(kmamba::test::golden_dir() + "/tiny_mamba1/config.json");
  EXPECT_EQ(c.mixer, kmamba::MixerKind::Mamba1);
  EXPECT_EQ(c.d_inner(), 128);
  EXPECT_EQ(c.resolved_dt_rank(), 4);
  EXPECT_EQ(c.d_state, 16);
  EXPECT_FALSE(c.bias);
  EXPECT_TRUE(c.dt_init_random);
}

TEST(Config, HuggingFaceLayoutRoundTrips) {
  for (const char* name : {"tiny_mamba1", "tiny_mamba2"}) {
    const auto a = kmamba::ModelConfig::load(kmamba::test::golden_dir() + "/" + name + "/config.json");
    const auto b = kmamba::ModelConfig::from_json(a.to_hf_json(), "round trip");
    EXPECT_EQ(b.to_hf_json(), a.to_hf_json()) << name;
    EXPECT_EQ(b.mixer, a.mixer);
    EXPECT_EQ(b.num_heads(), a.num_heads());
    EXPECT_EQ(b.dt_limit_max, a.dt_limit_max);
  }
}

TEST(Config, ReadsMambaSsmLayoutWithVocabPadding) {
  const auto c = kmamba::ModelConfig::from_json(
      R"({"d_model": 768, "n_layer": 24, "vocab_size": 50277, "ssm_cfg": {"layer": "Mamba2"},
          "rms_norm": true, "residual_in_fp32": true, "fused_add_norm": true,
          "pad_vocab_size_multiple": 16, "tie_embeddings": true, "d_intermediate": 0, "attn_layer_idx": []})",
      "mamba2-130m");
  EXPECT_EQ(c.mixer, kmamba::MixerKind::Mamba2);
  EXPECT_EQ(c.padded_vocab_size(), 50288);
  EXPECT_EQ(c.num_heads(), 24);
  EXPECT_EQ(c.d_state, 128);
  EXPECT_EQ(c.ngroups, 1);
  EXPECT_EQ(c.chunk_size, 256);
  // Written in the HF layout (vocab_size = the embedding rows) and read back: the real vocabulary
  // and the padding survive.
  const auto hf = kmamba::ModelConfig::from_json(c.to_hf_json(), "mamba2-130m as HF");
  EXPECT_EQ(hf.vocab_size, 50277);
  EXPECT_EQ(hf.padded_vocab_size(), 50288);
  EXPECT_EQ(hf.to_hf_json(), c.to_hf_json());
  EXPECT_THROW(
      kmamba::ModelConfig::from_json(
          R"({"model_type": "mamba2", "vocab_size": 50288, "unpadded_vocab_size": 50277, "pad_vocab_size_multiple": 8})",
          "inconsistent padding"),
      kmamba::UserError);
  const auto m1 =
      kmamba::ModelConfig::from_json(R"({"d_model": 768, "n_layer": 24, "vocab_size": 50277})", "mamba-130m");
  EXPECT_EQ(m1.mixer, kmamba::MixerKind::Mamba1);
  EXPECT_EQ(m1.padded_vocab_size(), 50280);
  EXPECT_EQ(m1.resolved_dt_rank(), 48);
  EXPECT_EQ(m1.d_state, 16);
  const auto m3 = kmamba::ModelConfig::from_json(
      R"({"d_model": 32, "n_layer": 2, "vocab_size": 96, "ssm_cfg": {"layer": "Mamba3", "d_state": 16, "headdim": 8}})",
      "m3");
  EXPECT_EQ(m3.mixer, kmamba::MixerKind::Mamba3);
  EXPECT_EQ(m3.num_heads(), 8);
  EXPECT_EQ(m3.chunk_size, 64);
  const auto back = kmamba::ModelConfig::from_json(m3.to_hf_json(), "m3 round trip");
  EXPECT_EQ(back.to_hf_json(), m3.to_hf_json());
  // bc_bias_init is an initialisation setting: config.json (read by mamba_ssm too) does not carry it.
  EXPECT_EQ(m3.bc_bias_init, 1.0);
  auto small_bias = m3;
  small_bias.bc_bias_init = 0.1;
  EXPECT_EQ(small_bias.to_hf_json(), m3.to_hf_json());
  small_bias.bc_bias_init = std::nan("");
  kmamba::test::expect_user_error([&] { small_bias.validate(); }, {"bc_bias_init must be finite"});
}

// A new model as kmamba-train creates it (tied, rescale_prenorm_residual on, no vocabulary padding).
kmamba::ModelConfig new_model(kmamba::MixerKind mixer) {
  kmamba::ModelConfig c;
  c.mixer = mixer;
  c.d_model = 64;
  c.n_layer = 2;
  c.vocab_size = 64;
  c.d_state = 16;
  c.headdim = 16;
  c.chunk_size = 16;
  c.validate();
  return c;
}

// The keys transformers' MambaConfig / Mamba2Config take, each with the value under which
// transformers computes what kmamba computes for `c` (transformers falls back to its own default,
// often another value, for a key that is absent).
void expect_transformers_reads(const kmamba::ModelConfig& c, const std::string& text) {
  const nlohmann::json j = kmamba::parse_json(kmamba::spell_python_infinities(text), "written config.json");
  const bool m2 = c.mixer == kmamba::MixerKind::Mamba2;
  const std::vector<std::pair<const char*, nlohmann::json>> expected_common = {
      {"model_type", m2 ? "mamba2" : "mamba"},
      {"hidden_size", c.d_model},
      {"num_hidden_layers", c.n_layer},
      {"vocab_size", c.padded_vocab_size()},
      {"state_size", c.d_state},
      {"expand", c.expand},
      {"conv_kernel", c.d_conv},
      {"layer_norm_epsilon", c.norm_epsilon},
      {"use_bias", c.bias},
      {"use_conv_bias", c.conv_bias},
      {"hidden_act", "silu"},
      {"residual_in_fp32", c.residual_in_fp32},
      {"tie_word_embeddings", c.tie_embeddings},
      {"time_step_rank", c.resolved_dt_rank()},
      {"time_step_min", c.dt_min},
      {"time_step_max", c.dt_max},
      {"time_step_floor", c.dt_init_floor},
      {"initializer_range", c.initializer_range},
      {"pad_token_id", c.pad_token_id},
      {"bos_token_id", c.bos_token_id},
      {"eos_token_id", c.eos_token_id},
      // transformers 5 runs _init_weights after loading; true would divide the loaded out_proj.
      {"rescale_prenorm_residual", false}};
  for (const auto& [key, value] : expected_common) {
    ASSERT_TRUE(j.contains(key)) << key;
    EXPECT_EQ(j[key], value) << key;
  }
  if (m2) {
    // intermediate_size = expand * hidden_size in transformers; its heads must tile it exactly.
    EXPECT_EQ(j["num_heads"].get<long long>() * j["head_dim"].get<long long>(), c.d_inner());
    EXPECT_EQ(j["num_heads"], c.num_heads());
    EXPECT_EQ(j["head_dim"], c.headdim);
    EXPECT_EQ(j["n_groups"], c.ngroups);
    EXPECT_EQ(j["chunk_size"], c.chunk_size);
    EXPECT_EQ(j["rms_norm"], true);
    const auto bound = [](double v) {
      return std::isinf(v) ? nlohmann::json{{"__float__", v > 0 ? "Infinity" : "-Infinity"}} : nlohmann::json(v);
    };
    EXPECT_EQ(j["time_step_limit"], nlohmann::json::array({bound(c.dt_limit_min), bound(c.dt_limit_max)}));
    // transformers' gated norm multiplies by silu(gate) before normalising, always.
    EXPECT_FALSE(c.norm_before_gate);
  } else {
    EXPECT_EQ(j["intermediate_size"], c.d_inner());
    EXPECT_EQ(j["time_step_scale"], c.dt_scale);
    EXPECT_EQ(j["time_step_init_scheme"], c.dt_init_random ? "random" : "constant");
  }
}

TEST(Config, WritesEveryKeyTransformersReadsForNewModels) {
  for (const auto mixer : {kmamba::MixerKind::Mamba1, kmamba::MixerKind::Mamba2}) {
    const kmamba::ModelConfig c = new_model(mixer);
    ASSERT_TRUE(c.rescale_prenorm_residual);  // the initialisation kmamba used
    SCOPED_TRACE(kmamba::mixer_name(mixer));
    expect_transformers_reads(c, c.to_hf_json());
    const auto back = kmamba::ModelConfig::from_json(c.to_hf_json(), "round trip");
    EXPECT_EQ(back.to_hf_json(), c.to_hf_json());
    EXPECT_EQ(back.dt_limit_min, c.dt_limit_min);
    EXPECT_EQ(back.dt_limit_max, c.dt_limit_max);
  }
  for (const char* name : {"tiny_mamba1", "tiny_mamba2"}) {
    SCOPED_TRACE(name);
    const auto c = kmamba::ModelConfig::load(kmamba::test::golden_dir() + "/" + name + "/config.json");
    expect_transformers_reads(c, c.to_hf_json());
  }
}

TEST(Config, AcceptsEveryInfinitySpelling) {
  for (const char* inf : {"Infinity", R"({"__float__": "Infinity"})", R"("inf")", R"("Infinity")"}) {
    const auto c = kmamba::ModelConfig::from_json(
        std::string(R"({"model_type": "mamba2", "hidden_size": 64, "num_heads": 8, "head_dim": 16, "n_groups": 1,
                        "num_hidden_layers": 1, "vocab_size": 10, "time_step_limit": [0.0, )") +
            inf + "]}",
        "inf");
    EXPECT_TRUE(std::isinf(c.dt_limit_max)) << inf;
  }
}

TEST(Config, WritesTimeStepLimitAsBothTransformersLinesReadIt) {
  // Python's json (transformers 4 and 5) reads the bare token; transformers 4 passes the value to
  // torch.clamp, which a {"__float__": ...} object would reach as a dict.
  const kmamba::ModelConfig c = new_model(kmamba::MixerKind::Mamba2);
  const std::string text = c.to_hf_json();
  EXPECT_NE(text.find("\"time_step_limit\": [\n    0.0,\n    Infinity\n  ]"), std::string::npos) << text;
  EXPECT_EQ(text.find("__float__"), std::string::npos) << text;
  EXPECT_EQ(text.find("kmamba:"), std::string::npos) << text;
  auto finite = c;
  finite.dt_limit_min = 0.001;
  finite.dt_limit_max = 0.5;
  const auto back = kmamba::ModelConfig::from_json(finite.to_hf_json(), "finite limits");
  EXPECT_EQ(back.dt_limit_min, 0.001);
  EXPECT_EQ(back.dt_limit_max, 0.5);
  // The token is only replaced outside strings, and -Infinity is read as a number too.
  expect_config_error(
      R"({"model_type": "mamba2", "hidden_act": "Infinity", "hidden_size": 64, "num_hidden_layers": 1, "vocab_size": 10})",
      "field 'hidden_act' is \"Infinity\"");
  expect_config_error(
      R"({"model_type": "mamba2", "hidden_act": "a\"Infinity", "hidden_size": 64, "num_hidden_layers": 1, "vocab_size": 10})",
      R"(field 'hidden_act' is "a"Infinity")");
  expect_config_error(
      R"({"model_type": "mamba2", "hidden_size": 64, "num_hidden_layers": 1, "vocab_size": 10, "num_heads": 8,
          "head_dim": 16, "n_groups": 1, "time_step_limit": [-Infinity, Infinity]})",
      "need 0 <= dt_limit min < max, got [-inf, inf]");
}

TEST(Config, RejectsInconsistentConfigsWithClearErrors) {
  expect_config_error("{", "not valid JSON");
  expect_config_error("[1]", "not a JSON object");
  expect_config_error(R"({"model_type": "llama"})", "model_type \"llama\" is not a Mamba model");
  expect_config_error(R"({"model_type": "mamba", "hidden_size": "big", "num_hidden_layers": 2, "vocab_size": 10})",
                      "field 'hidden_size' is \"big\", expected an integer");
  expect_config_error(
      R"({"model_type": "mamba2", "hidden_size": 64, "num_heads": 7, "head_dim": 16, "n_groups": 1, "num_hidden_layers": 2, "vocab_size": 10})",
      "num_heads 7 * headdim 16 = 112 but d_inner = 128");
  expect_config_error(
      R"({"model_type": "mamba2", "hidden_size": 64, "num_heads": 8, "head_dim": 16, "n_groups": 3, "num_hidden_layers": 2, "vocab_size": 10})",
      "num_heads 8 is not divisible by ngroups 3");
  expect_config_error(R"({"d_model": 64, "n_layer": 2, "vocab_size": 10, "attn_layer_idx": [1]})",
                      "hybrid attention models are not supported");
  expect_config_error(R"({"d_model": 64, "n_layer": 2, "vocab_size": 10, "ssm_cfg": {"layer": "Mamba9"}})",
                      "expected Mamba1, Mamba2 or Mamba3");
  expect_config_error(R"({"model_type": "mamba", "num_hidden_layers": 0, "hidden_size": 64, "vocab_size": 10})",
                      "n_layer must be positive, got 0");
  expect_config_error(
      R"({"model_type": "mamba", "hidden_size": 64, "intermediate_size": 100, "num_hidden_layers": 2, "vocab_size": 10})",
      "intermediate_size' is 100 but expand * hidden_size = 128");
  expect_config_error(
      R"({"model_type": "mamba", "time_step_min": 0.5, "time_step_max": 0.1, "hidden_size": 64, "num_hidden_layers": 2, "vocab_size": 10})",
      "need 0 < dt_min <= dt_max");
  expect_config_error(
      R"({"model_type": "mamba", "hidden_act": "gelu", "hidden_size": 64, "num_hidden_layers": 2, "vocab_size": 10})",
      "supports \"silu\" only");
  // Sizes whose products overflow an int (found by tests/fuzz/FuzzConfig.cpp).
  expect_config_error(R"({"d_model": 2147483640, "ssm_cfg": {"layer": "Mamba2"}, "n_layer": 2, "vocab_size": 10})",
                      "d_model 2147483640 is too large");
  expect_config_error(R"({"d_model": 1073741824, "ssm_cfg": {"layer": "Mamba2"}, "n_layer": 2, "vocab_size": 10})",
                      "expand * d_model = 2 * 1073741824 is too large");
  expect_config_error(
      R"({"model_type": "mamba", "hidden_size": 1073741824, "intermediate_size": 5, "num_hidden_layers": 2, "vocab_size": 10})",
      "but expand * hidden_size = 2147483648");
  expect_config_error(R"({"d_model": 64, "vocab_size": 2147483640, "pad_vocab_size_multiple": 16, "n_layer": 2})",
                      "vocab_size 2147483640 padded to a multiple of 16 is too large");
  expect_config_error(
      R"({"model_type": "mamba2", "hidden_size": 64, "num_heads": 1073741824, "head_dim": 64, "num_hidden_layers": 2, "vocab_size": 10})",
      "num_heads * headdim = 1073741824 * 64 is too large");
  EXPECT_THROW(kmamba::ModelConfig::load("/nonexistent/config.json"), kmamba::UserError);
}

TEST(Config, RequiresTheSizesThatNoDefaultCanGuess) {
  expect_config_error(R"({"model_type": "mamba", "num_hidden_layers": 2, "vocab_size": 10})",
                      "field 'hidden_size' is missing");
  expect_config_error(R"({"model_type": "mamba2", "hidden_size": 64, "vocab_size": 10})",
                      "field 'num_hidden_layers' is missing");
  expect_config_error(R"({"model_type": "mamba", "hidden_size": 64, "num_hidden_layers": 2})",
                      "field 'vocab_size' is missing");
  expect_config_error(R"({"d_model": 64, "vocab_size": 10})", "field 'n_layer' is missing");
  expect_config_error(R"({"model_type": "mamba3", "n_layer": 2, "vocab_size": 10})", "field 'd_model' is missing");
}

TEST(Config, DeeplyNestedFieldsAreRefusedWithoutRecursion) {
  // A field nested far deeper than any stack allows a recursive walk (it segfaulted dump()ing it).
  const std::size_t depth = 200000;
  const std::string nested = std::string(depth, '[') + std::string(depth, ']');
  expect_config_error(R"({"model_type": "mamba", "hidden_size": )" + nested + "}", "deeper than 64 levels");
  // Within the depth limit the quoted value is cut short, not dumped whole.
  const std::string wide = "[" + std::string(50, '[') + std::string(50, ']') + "]";
  try {
    kmamba::ModelConfig::from_json(R"({"model_type": "mamba", "hidden_size": )" + wide + "}", "test.json");
    FAIL() << "an array was accepted as hidden_size";
  } catch (const kmamba::UserError& e) {
    const std::string what = e.what();
    EXPECT_NE(what.find("field 'hidden_size' is [[[["), std::string::npos) << what;
    EXPECT_NE(what.find("...,"), std::string::npos) << what;
    EXPECT_LT(what.size(), 200u) << what;
  }
}

TEST(Config, RefusesDuplicateKeys) {
  expect_config_error(R"({"model_type": "mamba", "hidden_size": 64, "hidden_size": 32})",
                      "names the key \"hidden_size\" twice");
  expect_config_error(R"({"d_model": 64, "ssm_cfg": {"layer": "Mamba2", "layer": "Mamba1"}})",
                      "names the key \"layer\" twice");
}

}  // namespace
