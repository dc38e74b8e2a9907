// The Trainer's checkpoint format (TrainerCheckpoint.hpp) and TrainConfig's JSON form.
#include "TrainerCheckpoint.hpp"

#include <kmamba/KMamba.hpp>
#include <kmamba/core/Error.hpp>
#include <kmamba/core/Json.hpp>

#include <algorithm>
#include <limits>
#include <set>
#include <sstream>
#include <utility>

namespace kmamba {
namespace {

using json = nlohmann::json;

constexpr const char* state_format = "kmamba-training-state";
constexpr const char* exp_avg_prefix = "optimizer.exp_avg.";
constexpr const char* exp_avg_sq_prefix = "optimizer.exp_avg_sq.";
constexpr const char* step_tensor = "trainer.step";
constexpr const char* position_tensor = "trainer.data_position";

// Visits every TrainConfig field with its JSON name (one list for writing, reading and errors).
template <class Config, class Visitor>
void visit_fields(Config& c, Visitor&& v) {
  v("lr", c.lr);
  v("min_lr", c.min_lr);
  v("warmup_steps", c.warmup_steps);
  v("total_steps", c.total_steps);
  v("weight_decay", c.weight_decay);
  v("beta1", c.beta1);
  v("beta2", c.beta2);
  v("eps", c.eps);
  v("grad_clip", c.grad_clip);
  v("batch_size", c.batch_size);
  v("grad_accum", c.grad_accum);
  v("seed", c.seed);
  v("eval_interval", c.eval_interval);
  v("eval_batches", c.eval_batches);
  v("checkpoint_interval", c.checkpoint_interval);
  v("max_skipped_steps", c.max_skipped_steps);
}

struct FieldReader {
  const json& object;
  const std::string& source;
  std::set<std::string>& seen;

  std::string where(const char* key) const { return "kmamba::TrainConfig: " + source + ": \"" + key + "\""; }

  void operator()(const char* key, double& value) const {
    if (!object.contains(key)) return;
    seen.insert(key);
    const json& v = object[key];
    KMAMBA_REQUIRE(v.is_number(), where(key) << " is " << quote_json(v) << ", expected a number");
    value = v.get<double>();
  }
  void operator()(const char* key, std::int64_t& value) const {
    if (!object.contains(key)) return;
    seen.insert(key);
    const json& v = object[key];
    KMAMBA_REQUIRE(v.is_number_integer(), where(key) << " is " << quote_json(v) << ", expected an integer");
    KMAMBA_REQUIRE(!v.is_number_unsigned() ||
                       v.get<std::uint64_t>() <= static_cast<std::uint64_t>(std::numeric_limits<std::int64_t>::max()),
                   where(key) << " is " << quote_json(v) << ", out of range");
    value = v.get<std::int64_t>();
  }
  void operator()(const char* key, std::uint64_t& value) const {
    if (!object.contains(key)) return;
    seen.insert(key);
    const json& v = object[key];
    KMAMBA_REQUIRE(v.is_number_unsigned() || (v.is_number_integer() && v.get<std::int64_t>() >= 0),
                   where(key) << " is " << quote_json(v) << ", expected a non-negative integer");
    value = v.get<std::uint64_t>();
  }
};

// "a, b and c" differ between two config.json texts (which write infinity as Python's json does).
std::string differing_keys(const std::string& a, const std::string& b) {
  const json ja = parse_json(spell_python_infinities(a), "config.json");
  const json jb = parse_json(spell_python_infinities(b), "config.json");
  std::set<std::string> keys;
  for (auto it = ja.begin(); it != ja.end(); ++it) keys.insert(it.key());
  for (auto it = jb.begin(); it != jb.end(); ++it) keys.insert(it.key());
  std::ostringstream s;
  for (const std::string& k : keys) {
    const json va = ja.contains(k) ? ja[k] : json(), vb = jb.contains(k) ? jb[k] : json();
    if (va != vb) s << (s.tellp() > 0 ? ", " : "") << k << " (" << quote_json(va) << " vs " << quote_json(vb) << ")";
  }
  return s.str();
}

std::string metadata(const SafeTensorsReader& file, const std::string& key) {
  const auto it = file.metadata().find(key);
  KMAMBA_REQUIRE(it != file.metadata().end(), "kmamba::Trainer: '" << file.path() << "' has no metadata entry \"" << key
                                                                   << "\" (not a kmamba training state?)");
  return it->second;
}

std::int64_t read_counter(const SafeTensorsReader& file, const std::string& name) {
  file.check_shape(name, {1});
  const std::int64_t value = file.read_i64(name)[0];
  KMAMBA_REQUIRE(value >= 0, "kmamba::Trainer: tensor '" << name << "' of '" << file.path() << "' is " << value
                                                         << ", expected >= 0");
  return value;
}

// The skipped_steps metadata, 0 where it is absent (checkpoints written before steps could be skipped).
std::int64_t read_skipped_steps(const SafeTensorsReader& file) {
  if (file.metadata().count("skipped_steps") == 0) return 0;
  const std::string text = metadata(file, "skipped_steps");
  KMAMBA_REQUIRE(!text.empty() && text.size() < 19 && text.find_first_not_of("0123456789") == std::string::npos,
                 "kmamba::Trainer::resume: '" << file.path() << "' has skipped_steps \"" << text
                                              << "\", expected a non-negative integer");
  return std::stoll(text);
}

}  // namespace

std::string TrainConfig::to_json() const {
  json j = json::object();
  TrainConfig copy = *this;
  visit_fields(copy, [&j](const char* key, const auto& value) { j[key] = value; });
  return j.dump(2);
}

TrainConfig TrainConfig::from_json(const std::string& json_text, const std::string& source) {
  const json j = parse_json(json_text, "kmamba::TrainConfig: " + source);
  KMAMBA_REQUIRE(j.is_object(), "kmamba::TrainConfig: " << source << " must hold a JSON object");
  TrainConfig c;
  std::set<std::string> seen;
  visit_fields(c, FieldReader{j, source, seen});
  for (auto it = j.begin(); it != j.end(); ++it) {
    KMAMBA_REQUIRE(seen.count(it.key()) != 0,
                   "kmamba::TrainConfig: " << source << ": unknown key \"" << it.key() << "\"");
  }
  c.validate();
  return c;
}

TrainConfig TrainConfig::from_checkpoint(const std::string& dir) {
  const SafeTensorsReader state(dir + "/" + impl::training_state_file);
  return from_json(metadata(state, "train_config"), "'" + state.path() + "' (train_config)");
}

namespace impl {

void write_training_state(const std::string& path, const std::vector<MomentTensor>& tensors, const float* exp_avg,
                          const float* exp_avg_sq, const TrainingState& state) {
  SafeTensorsWriter file;
  for (const MomentTensor& t : tensors) {
    file.add(exp_avg_prefix + t.name, DType::F32, t.shape, exp_avg + t.offset);
    file.add(exp_avg_sq_prefix + t.name, DType::F32, t.shape, exp_avg_sq + t.offset);
  }
  file.add_i64(step_tensor, {1}, std::vector<std::int64_t>{state.steps});
  file.add_i64(position_tensor, {1}, std::vector<std::int64_t>{state.data_position});
  file.set_metadata("format", state_format);
  file.set_metadata("format_version", "1");
  file.set_metadata("producer", std::string("kmamba ") + version());
  file.set_metadata("train_config", state.config.to_json());
  file.set_metadata("dataset", state.dataset);
  file.set_metadata("parameter_checksum", state.parameter_checksum);
  file.set_metadata("skipped_steps", std::to_string(state.skipped_steps));
  file.write(path);
}

SafeTensorsReader open_training_state(const std::string& dir) {
  SafeTensorsReader state(dir + "/" + training_state_file);
  KMAMBA_REQUIRE(metadata(state, "format") == state_format,
                 "kmamba::Trainer::resume: '" << state.path() << "' is not a kmamba training state (format \""
                                              << metadata(state, "format") << "\")");
  KMAMBA_REQUIRE(metadata(state, "format_version") == "1", "kmamba::Trainer::resume: '"
                                                               << state.path() << "' has format version "
                                                               << metadata(state, "format_version") << ", expected 1");
  return state;
}

void check_checkpoint_matches(const SafeTensorsReader& file, const std::string& dir, const std::string& saved,
                              const std::string& ours, const std::string& checksum, const Dataset* data) {
  KMAMBA_REQUIRE(ours == saved, "kmamba::Trainer::resume: the model in '"
                                    << dir << "' differs from this run's: " << differing_keys(saved, ours)
                                    << " (checkpoint vs run)");
  KMAMBA_REQUIRE(metadata(file, "parameter_checksum") == checksum,
                 "kmamba::Trainer::resume: model.safetensors in '"
                     << dir
                     << "' was not written together with training_state.safetensors (parameter checksums differ; "
                     << "an interrupted or mixed checkpoint)");
  const std::string saved_data = metadata(file, "dataset");
  if (data != nullptr && saved_data != no_dataset) {
    KMAMBA_REQUIRE(saved_data == data->fingerprint(), "kmamba::Trainer::resume: '"
                                                          << dir << "' was trained on " << saved_data
                                                          << ", this run's data is " << data->fingerprint());
  }
}

TrainingState read_training_state(const SafeTensorsReader& file, const std::vector<MomentTensor>& tensors,
                                  std::vector<float>& exp_avg, std::vector<float>& exp_avg_sq) {
  std::set<std::string> expected = {step_tensor, position_tensor};
  for (const MomentTensor& t : tensors) {
    for (const auto& [prefix, moments] :
         {std::make_pair(exp_avg_prefix, &exp_avg), std::make_pair(exp_avg_sq_prefix, &exp_avg_sq)}) {
      const std::string name = prefix + t.name;
      file.check_shape(name, t.shape);
      KMAMBA_REQUIRE(file.info(name).dtype == DType::F32, "kmamba::Trainer::resume: tensor '"
                                                              << name << "' of '" << file.path() << "' is "
                                                              << dtype_name(file.info(name).dtype) << ", expected F32");
      const std::vector<float> values = file.read_f32(name);
      std::copy(values.begin(), values.end(), moments->begin() + static_cast<std::ptrdiff_t>(t.offset));
      expected.insert(name);
    }
  }
  for (const std::string& name : file.names()) {
    KMAMBA_REQUIRE(expected.count(name) != 0, "kmamba::Trainer::resume: '" << file.path()
                                                                           << "' holds an unexpected tensor '" << name
                                                                           << "' (from another model?)");
  }
  TrainingState state;
  state.steps = read_counter(file, step_tensor);
  state.data_position = read_counter(file, position_tensor);
  state.skipped_steps = read_skipped_steps(file);
  state.config = TrainConfig::from_json(metadata(file, "train_config"), "'" + file.path() + "' (train_config)");
  state.dataset = metadata(file, "dataset");
  state.parameter_checksum = metadata(file, "parameter_checksum");
  return state;
}

}  // namespace impl
}  // namespace kmamba
