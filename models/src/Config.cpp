#include <kmamba/core/Conv1dWidth.hpp>
#include <kmamba/core/Error.hpp>
#include <kmamba/core/Files.hpp>
#include <kmamba/core/Json.hpp>
#include <kmamba/models/Config.hpp>

#include <algorithm>
#include <cmath>
#include <limits>

namespace kmamba {
namespace {

using json = nlohmann::json;

// A config.json is a few kB; a file beyond this is not one.
constexpr std::uint64_t max_config_bytes = 16u << 20;

// Typed access to optional fields, with errors that name the file and the field.
class Fields {
 public:
  Fields(const json& object, std::string source) : object_(object), source_(std::move(source)) {}

  bool has(const char* key) const { return object_.contains(key) && !object_[key].is_null(); }

  // A field without a default: the architecture's sizes, which no default can guess.
  int required_integer(const char* key) const {
    KMAMBA_REQUIRE(has(key), where(key) << " is missing (it sets the model's size and has no default)");
    return integer(key, 0);
  }

  int integer(const char* key, int fallback) const {
    if (!has(key)) return fallback;
    const json& v = object_[key];
    KMAMBA_REQUIRE(v.is_number_integer() || (v.is_number_float() && std::floor(v.get<double>()) == v.get<double>()),
                   where(key) << " is " << quote_json(v) << ", expected an integer");
    const double d = v.get<double>();
    KMAMBA_REQUIRE(std::fabs(d) < 2147483647.0, where(key) << " is " << quote_json(v) << ", out of range");
    return static_cast<int>(d);
  }

  double number(const char* key, double fallback) const {
    if (!has(key)) return fallback;
    return as_number(object_[key], key);
  }

  bool boolean(const char* key, bool fallback) const {
    if (!has(key)) return fallback;
    KMAMBA_REQUIRE(object_[key].is_boolean(), where(key)
                                                  << " is " << quote_json(object_[key]) << ", expected true or false");
    return object_[key].get<bool>();
  }

  std::string string(const char* key, const std::string& fallback) const {
    if (!has(key)) return fallback;
    KMAMBA_REQUIRE(object_[key].is_string(), where(key) << " is " << quote_json(object_[key]) << ", expected a string");
    return object_[key].get<std::string>();
  }

  // [lo, hi] pair (time_step_limit / dt_limit); infinity may be written Infinity (Python's json),
  // {"__float__": "Infinity"} (transformers 5) or as the strings "Infinity" and "inf".
  void pair(const char* key, double& lo, double& hi) const {
    if (!has(key)) return;
    const json& v = object_[key];
    KMAMBA_REQUIRE(v.is_array() && v.size() == 2, where(key) << " is " << quote_json(v) << ", expected [min, max]");
    lo = as_number(v[0], key);
    hi = as_number(v[1], key);
  }

  const json& raw(const char* key) const { return object_[key]; }
  std::string where(const char* key) const { return "config '" + source_ + "': field '" + key + "'"; }

 private:
  double as_number(const json& v, const char* key) const {
    if (v.is_number()) return v.get<double>();
    std::string text;
    if (v.is_string()) text = v.get<std::string>();
    if (v.is_object() && v.contains("__float__") && v["__float__"].is_string())
      text = v["__float__"].get<std::string>();
    if (text == "Infinity" || text == "inf" || text == "+inf") return std::numeric_limits<double>::infinity();
    if (text == "-Infinity" || text == "-inf") return -std::numeric_limits<double>::infinity();
    KMAMBA_USER_ERROR(where(key) << " is " << quote_json(v) << ", expected a number");
  }

  const json& object_;
  std::string source_;
};

int dt_rank_field(const Fields& f, const char* key) {
  if (!f.has(key)) return 0;
  const json& v = f.raw(key);
  if (v.is_string()) {
    KMAMBA_REQUIRE(v.get<std::string>() == "auto",
                   f.where(key) << " is " << quote_json(v) << ", expected an integer or \"auto\"");
    return 0;
  }
  return f.integer(key, 0);
}

// The keys of the dt initialisation fields in one config.json layout: dt_min, dt_max,
// dt_init_floor, dt_scale and the scheme ("random" or "constant").
struct DtInitKeys {
  const char *min, *max, *floor, *scale, *scheme;
};

void read_dt_init(const Fields& f, ModelConfig& c, const DtInitKeys& keys) {
  c.dt_min = f.number(keys.min, 1e-3);
  c.dt_max = f.number(keys.max, 0.1);
  c.dt_init_floor = f.number(keys.floor, 1e-4);
  c.dt_scale = f.number(keys.scale, 1.0);
  const std::string scheme = f.string(keys.scheme, "random");
  KMAMBA_REQUIRE(scheme == "random" || scheme == "constant",
                 f.where(keys.scheme) << " is \"" << scheme << "\", expected \"random\" or \"constant\"");
  c.dt_init_random = scheme == "random";
}

// time_step_limit's infinite bound is written as Python's json writes it, the bare token Infinity:
// transformers 4 reads it (and writes it), transformers 5 reads it, while the {"__float__":
// "Infinity"} object transformers 5 writes reaches transformers 4's torch.clamp as a dict. JSON
// values cannot hold the token, so the array is written with markers that to_hf_json replaces.
constexpr const char* plus_infinity_marker = "kmamba:+Infinity";
constexpr const char* minus_infinity_marker = "kmamba:-Infinity";

json python_number(double value) {
  if (std::isinf(value)) return value > 0 ? plus_infinity_marker : minus_infinity_marker;
  return value;
}

std::string replace_all(std::string text, const std::string& from, const std::string& to) {
  for (std::size_t at = text.find(from); at != std::string::npos; at = text.find(from, at + to.size())) {
    text.replace(at, from.size(), to);
  }
  return text;
}

std::string dump_with_python_infinities(const json& j) {
  const std::string text = replace_all(j.dump(2), json(plus_infinity_marker).dump(), "Infinity");
  return replace_all(text, json(minus_infinity_marker).dump(), "-Infinity") + "\n";
}

void read_hf(const Fields& f, ModelConfig& c, bool mamba2) {
  // Defaults are those of transformers' MambaConfig / Mamba2Config (save_pretrained may omit them);
  // save_pretrained always writes the sizes, so a file without them is not one of its files.
  c.mixer = mamba2 ? MixerKind::Mamba2 : MixerKind::Mamba1;
  c.d_model = f.required_integer("hidden_size");
  c.n_layer = f.required_integer("num_hidden_layers");
  c.vocab_size = f.required_integer("vocab_size");
  c.pad_vocab_size_multiple = 1;
  // kmamba writes the real vocabulary beside the padded one transformers needs (the embedding rows).
  if (f.has("unpadded_vocab_size")) {
    const int padded = c.vocab_size;
    c.vocab_size = f.integer("unpadded_vocab_size", padded);
    c.pad_vocab_size_multiple = f.integer("pad_vocab_size_multiple", 1);
    KMAMBA_REQUIRE(c.vocab_size > 0 && c.pad_vocab_size_multiple > 0 && c.padded_vocab_size() == padded,
                   f.where("unpadded_vocab_size")
                       << " = " << c.vocab_size << " padded to a multiple of " << c.pad_vocab_size_multiple
                       << " does not give vocab_size = " << padded);
  }
  c.tie_embeddings = f.boolean("tie_word_embeddings", !mamba2);
  c.rms_norm = f.boolean("rms_norm", true);
  c.residual_in_fp32 = f.boolean("residual_in_fp32", true);
  c.norm_epsilon = f.number("layer_norm_epsilon", 1e-5);
  c.pad_token_id = f.integer("pad_token_id", mamba2 ? 1 : 0);
  c.bos_token_id = f.integer("bos_token_id", 0);
  c.eos_token_id = f.integer("eos_token_id", mamba2 ? 2 : 0);
  c.initializer_range = f.number("initializer_range", 0.1);
  c.rescale_prenorm_residual = f.boolean("rescale_prenorm_residual", false);
  c.d_state = f.integer("state_size", mamba2 ? 128 : 16);
  c.d_conv = f.integer("conv_kernel", 4);
  c.expand = f.integer("expand", 2);
  c.dt_rank = dt_rank_field(f, "time_step_rank");
  c.conv_bias = f.boolean("use_conv_bias", true);
  c.bias = f.boolean("use_bias", !mamba2);
  read_dt_init(f, c, {"time_step_min", "time_step_max", "time_step_floor", "time_step_scale", "time_step_init_scheme"});
  const std::string act = f.string("hidden_act", "silu");
  KMAMBA_REQUIRE(act == "silu", f.where("hidden_act") << " is \"" << act << "\"; kmamba supports \"silu\" only");
  if (mamba2) {
    c.headdim = f.integer("head_dim", 64);
    c.nheads = f.integer("num_heads", 128);
    c.ngroups = f.integer("n_groups", 8);
    c.chunk_size = f.integer("chunk_size", 256);
    c.norm_before_gate = f.boolean("norm_before_gate", false);
    f.pair("time_step_limit", c.dt_limit_min, c.dt_limit_max);
  } else if (f.has("intermediate_size")) {
    const long long d_inner = static_cast<long long>(c.expand) * c.d_model;
    KMAMBA_REQUIRE(f.integer("intermediate_size", 0) == d_inner, f.where("intermediate_size")
                                                                     << " is " << f.integer("intermediate_size", 0)
                                                                     << " but expand * hidden_size = " << d_inner);
  }
}

void read_mamba_ssm(const Fields& f, ModelConfig& c, const std::string& source) {
  c.d_model = f.required_integer("d_model");
  c.n_layer = f.required_integer("n_layer");
  c.vocab_size = f.required_integer("vocab_size");
  c.pad_vocab_size_multiple = f.integer("pad_vocab_size_multiple", 8);
  c.tie_embeddings = f.boolean("tie_embeddings", true);
  c.rms_norm = f.boolean("rms_norm", true);
  c.residual_in_fp32 = f.boolean("residual_in_fp32", true);
  c.d_intermediate = f.integer("d_intermediate", 0);
  c.norm_epsilon = f.number("norm_epsilon", 1e-5);
  c.rescale_prenorm_residual = true;
  c.initializer_range = 0.02;  // mamba_ssm's _init_weights: embedding ~ N(0, 0.02)
  if (f.has("attn_layer_idx")) {
    KMAMBA_REQUIRE(f.raw("attn_layer_idx").is_array() && f.raw("attn_layer_idx").empty(),
                   f.where("attn_layer_idx") << " lists attention layers; hybrid attention models are not supported");
  }
  json ssm = json::object();
  if (f.has("ssm_cfg")) {
    KMAMBA_REQUIRE(f.raw("ssm_cfg").is_object(), f.where("ssm_cfg") << " is not an object");
    ssm = f.raw("ssm_cfg");
  }
  const Fields s(ssm, source + " ssm_cfg");
  const std::string layer = s.string("layer", "Mamba1");
  if (layer == "Mamba1") {
    c.mixer = MixerKind::Mamba1;
  } else if (layer == "Mamba2") {
    c.mixer = MixerKind::Mamba2;
  } else if (layer == "Mamba3") {
    c.mixer = MixerKind::Mamba3;
  } else {
    KMAMBA_USER_ERROR(s.where("layer") << " is \"" << layer << "\", expected Mamba1, Mamba2 or Mamba3");
  }
  const bool m1 = c.mixer == MixerKind::Mamba1;
  c.d_state = s.integer("d_state", m1 ? 16 : 128);
  c.d_conv = s.integer("d_conv", 4);
  c.expand = s.integer("expand", 2);
  c.dt_rank = dt_rank_field(s, "dt_rank");
  c.headdim = s.integer("headdim", 64);
  c.ngroups = s.integer("ngroups", 1);
  c.chunk_size = s.integer("chunk_size", c.mixer == MixerKind::Mamba3 ? 64 : 256);
  c.conv_bias = s.boolean("conv_bias", true);
  c.bias = s.boolean("bias", false);
  c.norm_before_gate = s.boolean("norm_before_gate", false);
  read_dt_init(s, c, {"dt_min", "dt_max", "dt_init_floor", "dt_scale", "dt_init"});
  s.pair("dt_limit", c.dt_limit_min, c.dt_limit_max);
  KMAMBA_REQUIRE(s.boolean("rmsnorm", true), s.where("rmsnorm") << " is false; kmamba supports the gated RMSNorm only");
  KMAMBA_REQUIRE(!s.boolean("D_has_hdim", false), s.where("D_has_hdim") << " is true; not supported");
  c.rope_fraction = s.number("rope_fraction", 0.5);
  c.A_floor = s.number("A_floor", 1e-4);
  c.is_mimo = s.boolean("is_mimo", false);
  c.mimo_rank = s.integer("mimo_rank", 4);
  c.is_outproj_norm = s.boolean("is_outproj_norm", false);
}

}  // namespace

const char* mixer_name(MixerKind kind) {
  switch (kind) {
    case MixerKind::Mamba1:
      return "Mamba1";
    case MixerKind::Mamba2:
      return "Mamba2";
    case MixerKind::Mamba3:
      return "Mamba3";
  }
  return "unknown";
}

int ModelConfig::padded_vocab_size() const {
  const long long m = pad_vocab_size_multiple > 0 ? pad_vocab_size_multiple : 1;
  const long long padded = (static_cast<long long>(vocab_size) + m - 1) / m * m;  // validate() checks it fits
  return static_cast<int>(std::min<long long>(padded, std::numeric_limits<int>::max()));
}

void ModelConfig::validate() const {
  const auto positive = [](const char* name, long long v) {
    KMAMBA_REQUIRE(v > 0, "kmamba::ModelConfig: " << name << " must be positive, got " << v);
  };
  positive("d_model", d_model);
  positive("n_layer", n_layer);
  positive("vocab_size", vocab_size);
  positive("pad_vocab_size_multiple", pad_vocab_size_multiple);
  positive("d_state", d_state);
  positive("expand", expand);
  positive("headdim", headdim);
  positive("ngroups", ngroups);
  positive("chunk_size", chunk_size);
  // Sizes derived from the fields are ints: they must not overflow (a hostile config.json).
  constexpr long long int_max = std::numeric_limits<int>::max();
  KMAMBA_REQUIRE(d_model <= int_max - 15, "kmamba::ModelConfig: d_model " << d_model << " is too large");
  const long long d_inner_wide = static_cast<long long>(expand) * d_model;
  KMAMBA_REQUIRE(d_inner_wide <= int_max,
                 "kmamba::ModelConfig: d_inner = expand * d_model = " << expand << " * " << d_model << " is too large");
  KMAMBA_REQUIRE(static_cast<long long>(vocab_size) + pad_vocab_size_multiple - 1 <= int_max,
                 "kmamba::ModelConfig: vocab_size " << vocab_size << " padded to a multiple of "
                                                    << pad_vocab_size_multiple << " is too large");
  KMAMBA_REQUIRE(nheads <= 0 || static_cast<long long>(nheads) * headdim <= int_max,
                 "kmamba::ModelConfig: num_heads * headdim = " << nheads << " * " << headdim << " is too large");
  KMAMBA_REQUIRE(rms_norm, "kmamba::ModelConfig: rms_norm is false; kmamba supports RMSNorm models only");
  KMAMBA_REQUIRE(d_intermediate == 0, "kmamba::ModelConfig: d_intermediate is "
                                          << d_intermediate << "; the GatedMLP blocks are not supported");
  KMAMBA_REQUIRE(norm_epsilon > 0.0, "kmamba::ModelConfig: norm_epsilon must be positive, got " << norm_epsilon);
  KMAMBA_REQUIRE(dt_min > 0.0 && dt_min <= dt_max,
                 "kmamba::ModelConfig: need 0 < dt_min <= dt_max, got dt_min=" << dt_min << " dt_max=" << dt_max);
  KMAMBA_REQUIRE(
      dt_limit_min >= 0.0 && dt_limit_min < dt_limit_max,
      "kmamba::ModelConfig: need 0 <= dt_limit min < max, got [" << dt_limit_min << ", " << dt_limit_max << "]");
  if (mixer != MixerKind::Mamba3) {
    positive("d_conv", d_conv);
    KMAMBA_REQUIRE(d_conv <= conv1d_max_width, "kmamba::ModelConfig: d_conv (conv_kernel) is "
                                                   << d_conv << "; the causal conv takes at most " << conv1d_max_width
                                                   << " taps");
  }
  if (mixer == MixerKind::Mamba1) {
    positive("dt_rank", resolved_dt_rank());
    KMAMBA_REQUIRE(d_inner() % ngroups == 0,
                   "kmamba::ModelConfig: d_inner " << d_inner() << " is not divisible by ngroups " << ngroups);
    return;
  }
  KMAMBA_REQUIRE(d_inner() % headdim == 0, "kmamba::ModelConfig: d_inner = expand * d_model = "
                                               << d_inner() << " is not divisible by headdim " << headdim);
  KMAMBA_REQUIRE(static_cast<long long>(num_heads()) * headdim == d_inner(),
                 "kmamba::ModelConfig: num_heads " << num_heads() << " * headdim " << headdim << " = "
                                                   << num_heads() * headdim << " but d_inner = " << d_inner());
  KMAMBA_REQUIRE(num_heads() % ngroups == 0,
                 "kmamba::ModelConfig: num_heads " << num_heads() << " is not divisible by ngroups " << ngroups);
  if (mixer == MixerKind::Mamba3) {
    KMAMBA_REQUIRE(rope_fraction == 0.5 || rope_fraction == 1.0,
                   "kmamba::ModelConfig: rope_fraction must be 0.5 or 1.0, got " << rope_fraction);
    KMAMBA_REQUIRE(A_floor > 0.0, "kmamba::ModelConfig: A_floor must be positive, got " << A_floor);
    KMAMBA_REQUIRE(std::isfinite(bc_bias_init),
                   "kmamba::ModelConfig: bc_bias_init must be finite, got " << bc_bias_init);
    if (is_mimo) positive("mimo_rank", mimo_rank);
  }
}

ModelConfig ModelConfig::from_json(const std::string& json_text, const std::string& source) {
  const json root = parse_json(spell_python_infinities(json_text), "config '" + source + "'");
  KMAMBA_REQUIRE(root.is_object(), "config '" << source << "' is not a JSON object");
  const Fields f(root, source);
  ModelConfig c;
  const std::string model_type = f.string("model_type", "");
  if (model_type == "mamba") {
    read_hf(f, c, false);
  } else if (model_type == "mamba2") {
    read_hf(f, c, true);
  } else if (model_type.empty() && f.has("d_model")) {
    read_mamba_ssm(f, c, source);
  } else if (model_type == "mamba3" || model_type == "kmamba") {
    read_mamba_ssm(f, c, source);
  } else {
    KMAMBA_USER_ERROR(
        "config '" << source << "': model_type \"" << model_type
                   << "\" is not a Mamba model (expected \"mamba\", \"mamba2\", or a mamba_ssm config with d_model)");
  }
  try {
    c.validate();
  } catch (const UserError& e) {
    KMAMBA_USER_ERROR("config '" << source << "': " << e.what());
  }
  return c;
}

ModelConfig ModelConfig::load(const std::string& path) {
  return from_json(read_input_file(path, max_config_bytes, "config"), path);
}

std::string ModelConfig::to_hf_json() const {
  json j;
  const bool m2 = mixer == MixerKind::Mamba2;
  if (mixer == MixerKind::Mamba3) {
    // No transformers class exists for Mamba-3: write the mamba_ssm layout, which from_json reads.
    j["model_type"] = "mamba3";
    j["d_model"] = d_model;
    j["n_layer"] = n_layer;
    j["vocab_size"] = vocab_size;
    j["pad_vocab_size_multiple"] = pad_vocab_size_multiple;
    j["tie_embeddings"] = tie_embeddings;
    j["rms_norm"] = rms_norm;
    j["residual_in_fp32"] = residual_in_fp32;
    j["norm_epsilon"] = norm_epsilon;
    j["ssm_cfg"] = {{"layer", "Mamba3"},
                    {"d_state", d_state},
                    {"expand", expand},
                    {"headdim", headdim},
                    {"ngroups", ngroups},
                    {"chunk_size", chunk_size},
                    {"dt_min", dt_min},
                    {"dt_max", dt_max},
                    {"dt_init_floor", dt_init_floor},
                    {"rope_fraction", rope_fraction},
                    {"A_floor", A_floor},
                    {"is_mimo", is_mimo},
                    {"mimo_rank", mimo_rank},
                    {"is_outproj_norm", is_outproj_norm}};
    return j.dump(2) + "\n";
  }
  j["architectures"] = json::array({m2 ? "Mamba2ForCausalLM" : "MambaForCausalLM"});
  j["model_type"] = m2 ? "mamba2" : "mamba";
  j["hidden_size"] = d_model;
  j["num_hidden_layers"] = n_layer;
  j["vocab_size"] = padded_vocab_size();
  if (padded_vocab_size() != vocab_size) {
    j["unpadded_vocab_size"] = vocab_size;
    j["pad_vocab_size_multiple"] = pad_vocab_size_multiple;
  }
  j["tie_word_embeddings"] = tie_embeddings;
  j["residual_in_fp32"] = residual_in_fp32;
  j["layer_norm_epsilon"] = norm_epsilon;
  j["pad_token_id"] = pad_token_id;
  j["bos_token_id"] = bos_token_id;
  j["eos_token_id"] = eos_token_id;
  j["initializer_range"] = initializer_range;
  // An initialisation setting, which transformers 5 also applies after loading a checkpoint: its
  // _init_weights divides out_proj.weight by sqrt(num_hidden_layers) in place, past the guard that
  // keeps loaded tensors. The weights saved here are initialised already, so the file says false.
  j["rescale_prenorm_residual"] = false;
  j["state_size"] = d_state;
  j["conv_kernel"] = d_conv;
  j["expand"] = expand;
  j["time_step_rank"] = resolved_dt_rank();
  j["use_conv_bias"] = conv_bias;
  j["use_bias"] = bias;
  j["time_step_min"] = dt_min;
  j["time_step_max"] = dt_max;
  j["time_step_floor"] = dt_init_floor;
  j["hidden_act"] = "silu";
  if (m2) {
    j["head_dim"] = headdim;
    j["num_heads"] = num_heads();
    j["n_groups"] = ngroups;
    j["chunk_size"] = chunk_size;
    j["rms_norm"] = rms_norm;
    j["norm_before_gate"] = norm_before_gate;
    j["time_step_limit"] = json::array({python_number(dt_limit_min), python_number(dt_limit_max)});
  } else {
    j["intermediate_size"] = d_inner();
    j["time_step_scale"] = dt_scale;
    j["time_step_init_scheme"] = dt_init_random ? "random" : "constant";
  }
  return dump_with_python_infinities(j);
}

void ModelConfig::save(const std::string& path) const {
  write_output_file(path, to_hf_json(), "kmamba::ModelConfig::save");
}

}  // namespace kmamba
