// The continuous-valued sequence model: input projection, the residual backbone (Backbone.hpp),
// linear head, mean squared error and the backward through all of them; recurrent inference
// (prefill and step) over the backbone's recurrent state; checkpoints.
#include <kmamba/models/SequenceModel.hpp>

#include "Backbone.hpp"
#include "Elementwise.hpp"

#include <kmamba/backends/Gemm.hpp>
#include <kmamba/core/Error.hpp>
#include <kmamba/core/Files.hpp>
#include <kmamba/core/ForEachBackend.hpp>
#include <kmamba/core/Json.hpp>
#include <kmamba/core/Random.hpp>
#include <kmamba/core/RmsNorm.hpp>
#include <kmamba/core/Shape.hpp>
#include <kmamba/models/SafeTensors.hpp>

#include <Kokkos_Core.hpp>

#include <cerrno>
#include <cmath>
#include <cstdio>
#include <cstring>
#include <set>
#include <sstream>
#include <sys/stat.h>
#include <utility>

namespace kmamba {

namespace impl {
namespace seq {

constexpr const char* input_weight = "input_proj.weight";
constexpr const char* input_bias = "input_proj.bias";
constexpr const char* head_weight = "output_head.weight";
constexpr const char* head_bias = "output_head.bias";
constexpr const char* format = "kmamba-sequence-model";

/// y(r, c) += bias(c).
template <class MemorySpace>
struct AddBias {
  Tensor2<float, MemorySpace> y;          // (rows, channels)
  ConstTensor1<float, MemorySpace> bias;  // (channels)
  KOKKOS_INLINE_FUNCTION void operator()(const int r, const int c) const { y(r, c) += bias(c); }
};

/// Σ (y − t)² over flat views (double accumulation).
template <class MemorySpace>
struct SquaredError {
  ConstTensor1<float, MemorySpace> y, t;
  KOKKOS_INLINE_FUNCTION void operator()(const std::size_t i, double& acc) const {
    const double d = static_cast<double>(y(i)) - static_cast<double>(t(i));
    acc += d * d;
  }
};

/// dy(i) = scale · 2 (y(i) − t(i)), written over y.
template <class MemorySpace>
struct SquaredErrorGrad {
  Tensor1<float, MemorySpace> y;
  ConstTensor1<float, MemorySpace> t;
  float scale;
  KOKKOS_INLINE_FUNCTION void operator()(const std::size_t i) const { y(i) = scale * 2.0f * (y(i) - t(i)); }
};

bool is_directory(const std::string& path) {
  struct stat st;
  return ::stat(path.c_str(), &st) == 0 && S_ISDIR(st.st_mode);
}

void make_directories(const std::string& dir) {
  std::size_t pos = 0;
  while (pos != std::string::npos) {
    pos = dir.find('/', pos + 1);
    const std::string partial = dir.substr(0, pos);
    if (partial.empty() || is_directory(partial)) continue;
    KMAMBA_REQUIRE(
        ::mkdir(partial.c_str(), 0755) == 0 || errno == EEXIST,
        "kmamba::SequenceModel::save: cannot create directory '" << partial << "': " << std::strerror(errno));
  }
}

// Throws unless tensor `name` of `file` has the shape `expected` that config.json's `sizes` give.
void check_end(const SafeTensorsReader& file, const char* name, const std::vector<std::int64_t>& expected,
               const std::string& sizes, const std::string& config_path) {
  constexpr const char* function = "kmamba::SequenceModel::load";
  KMAMBA_REQUIRE(file.contains(name), function << ": '" << file.path() << "' has no tensor '" << name << "'");
  const std::vector<std::int64_t>& shape = file.info(name).shape;
  KMAMBA_REQUIRE(shape == expected, function << ": '" << config_path << "' gives " << sizes << ", but '" << name
                                             << "' of '" << file.path() << "' has shape " << Shape(shape).to_string()
                                             << ", not " << Shape(expected).to_string());
}

// The sizes config.json states against the tensors of model.safetensors, before anything sized by
// them is allocated: an input_size of 2e9 or a num_hidden_layers of 20000 beside a small
// checkpoint is an error naming the field, not gigabytes of memory.
void check_sizes_against_file(const SequenceModelConfig& c, const SafeTensorsReader& file,
                              const std::string& config_path) {
  const std::int64_t dm = c.backbone.d_model;
  const std::string hidden = "hidden_size " + std::to_string(dm);
  check_end(file, input_weight, {dm, c.input_size}, hidden + " and input_size " + std::to_string(c.input_size),
            config_path);
  check_end(file, head_weight, {c.output_size, dm}, "output_size " + std::to_string(c.output_size) + " and " + hidden,
            config_path);
  check_layers_against_file(c.backbone, file, config_path, "kmamba::SequenceModel::load");
}

}  // namespace seq
}  // namespace impl

// ---------------------------------------------------------------------------------------------
// SequenceModelConfig

void SequenceModelConfig::validate() const {
  KMAMBA_REQUIRE(input_size >= 1, "kmamba::SequenceModelConfig: input_size must be >= 1, got " << input_size);
  KMAMBA_REQUIRE(output_size >= 1, "kmamba::SequenceModelConfig: output_size must be >= 1, got " << output_size);
  backbone.validate();
}

std::string SequenceModelConfig::to_json() const {
  nlohmann::json j;
  j["format"] = impl::seq::format;
  j["input_size"] = input_size;
  j["output_size"] = output_size;
  // to_hf_json writes an infinite bound as Python's bare Infinity (transformers' config.json).
  j["backbone"] = parse_json(spell_python_infinities(backbone.to_hf_json()), "kmamba::SequenceModelConfig: backbone");
  return j.dump(2);
}

SequenceModelConfig SequenceModelConfig::from_json(const std::string& json_text, const std::string& source) {
  const nlohmann::json root = parse_json(json_text, "kmamba::SequenceModelConfig: '" + source + "'");
  KMAMBA_REQUIRE(root.is_object() && root.contains("format") && root["format"] == impl::seq::format,
                 "kmamba::SequenceModelConfig: '" << source << "' is not a kmamba sequence model config (expected "
                                                  << "\"format\": \"" << impl::seq::format << "\")");
  for (const char* key : {"input_size", "output_size"}) {
    KMAMBA_REQUIRE(root.contains(key) && root[key].is_number_integer(),
                   "kmamba::SequenceModelConfig: '" << source << "': \"" << key << "\" must be an integer");
  }
  KMAMBA_REQUIRE(root.contains("backbone") && root["backbone"].is_object(),
                 "kmamba::SequenceModelConfig: '" << source << "' has no \"backbone\" object");
  SequenceModelConfig c;
  c.input_size = root["input_size"].get<int>();
  c.output_size = root["output_size"].get<int>();
  c.backbone = ModelConfig::from_json(root["backbone"].dump(), source + " (backbone)");
  c.validate();
  return c;
}

// ---------------------------------------------------------------------------------------------
// SequenceModel::State

template <class ExecutionSpace>
struct SequenceModel<ExecutionSpace>::State {
  using Mem = memory_space;
  using Range = Kokkos::RangePolicy<ExecutionSpace, Kokkos::IndexType<std::size_t>>;
  SequenceModelConfig config;
  Slab slab;
  impl::Backbone<ExecutionSpace> backbone;

  // The ends' buffers of the last forward (batch, seqlen fixed by it).
  std::int64_t batch = 0, seqlen = 0;
  Tensor3<float, Mem> prediction;  // (batch, seqlen, output_size): the head's output (loss, training)
  Tensor2<float, Mem> ones;        // (batch·seqlen, 1): sums rows in the bias gradients

  static const SequenceModelConfig& validated(const SequenceModelConfig& c) {
    c.validate();
    return c;
  }

  explicit State(const SequenceModelConfig& c)
      : config(validated(c)), backbone(config.backbone, ModelParallel(), "kmamba::sequence_model") {
    declare_parameters(config, backbone, slab);
    slab.finalize("kmamba::sequence_model");
  }

  // The parameters' names and shapes, in declaration order; allocates nothing.
  static void declare_parameters(const SequenceModelConfig& config, const impl::Backbone<ExecutionSpace>& backbone,
                                 Slab& slab) {
    const std::int64_t dm = config.backbone.d_model;
    slab.add(impl::seq::input_weight, {dm, config.input_size}, WeightDecay::Yes);
    slab.add(impl::seq::input_bias, {dm}, WeightDecay::No);
    backbone.declare_parameters(slab);
    slab.add(impl::seq::head_weight, {config.output_size, dm}, WeightDecay::Yes);
    slab.add(impl::seq::head_bias, {config.output_size}, WeightDecay::No);
  }

  void ensure_buffers(const ExecutionSpace& exec, std::int64_t b, std::int64_t l) {
    if (batch == b && seqlen == l && ones.is_allocated()) return;
    batch = b;
    seqlen = l;
    prediction = Tensor3<float, Mem>();
    ones = allocate_uninitialized<Tensor2<float, Mem>>("kmamba::sequence_model::ones", b * l, 1);
    Kokkos::deep_copy(exec, ones, 1.0f);
  }

  /// The (batch, seqlen, output_size) buffer loss and loss_and_backward predict into.
  void ensure_prediction(const ExecutionSpace& exec, std::int64_t b, std::int64_t l) {
    ensure_buffers(exec, b, l);
    if (!prediction.is_allocated()) {
      prediction =
          allocate_uninitialized<Tensor3<float, Mem>>("kmamba::sequence_model::prediction", b, l, config.output_size);
    }
  }

  /// y = x · Wᵀ + bias over rows.
  void linear(const ExecutionSpace& exec, const ConstTensor2<float, Mem>& x,               // (rows, in)
              const char* weight, const char* bias, const Tensor2<float, Mem>& y) const {  // (rows, out)
    gemm(exec, Transpose::No, Transpose::Yes, 1.0f, x, ConstTensor2<float, Mem>(slab.template param<2>(weight)), 0.0f,
         y);
    Kokkos::parallel_for("kmamba::sequence_model::add_bias",
                         Kokkos::MDRangePolicy<ExecutionSpace, Kokkos::Rank<2>>(
                             exec, {0, 0}, {static_cast<int>(y.extent(0)), static_cast<int>(y.extent(1))}),
                         impl::seq::AddBias<Mem>{y, ConstTensor1<float, Mem>(slab.template param<1>(bias))});
  }

  void check_io(const char* function, const ConstTensor3<float, Mem>& inputs, const char* out_name,
                const ConstTensor3<float, Mem>& outputs) const {
    KMAMBA_REQUIRE(inputs.extent(0) > 0 && inputs.extent(1) > 0,
                   function << ": inputs must be a non-empty (batch, seqlen, input_size) tensor, got shape "
                            << shape_of(inputs).to_string());
    check_shape(function, "inputs", inputs, {Shape::any, Shape::any, config.input_size}, "(batch, seqlen, input_size)");
    check_allocated(function, "inputs", inputs);
    check_shape(
        function, out_name, outputs,
        {static_cast<std::int64_t>(inputs.extent(0)), static_cast<std::int64_t>(inputs.extent(1)), config.output_size},
        "(batch, seqlen, output_size) with batch, seqlen from inputs");
    check_allocated(function, out_name, outputs);
  }

  /// Runs the forward from `inputs` into `outputs`; keeps per-layer activations when `training`.
  void run_forward(const ExecutionSpace& exec, const ConstTensor3<float, Mem>& inputs,
                   const Tensor3<float, Mem>& outputs, bool training) {
    const std::int64_t b = inputs.extent(0), l = inputs.extent(1);
    ensure_buffers(exec, b, l);
    const auto input_end = [&](const Tensor2<float, Mem>& h0) {
      linear(exec, impl::token_rows(inputs), impl::seq::input_weight, impl::seq::input_bias, h0);
    };
    const Tensor3<float, Mem>& normed = backbone.forward(exec, slab, b, l, training, input_end);
    linear(exec, impl::token_rows(ConstTensor3<float, Mem>(normed)), impl::seq::head_weight, impl::seq::head_bias,
           impl::token_rows(outputs));
  }

  RegressionLoss squared_error(const ExecutionSpace& exec, const ConstTensor3<float, Mem>& y,
                               const ConstTensor3<float, Mem>& targets) const {
    double sum = 0.0;
    Kokkos::parallel_reduce("kmamba::sequence_model::squared_error", Range(exec, 0, y.span()),
                            impl::seq::SquaredError<Mem>{ConstTensor1<float, Mem>(y.data(), y.span()),
                                                         ConstTensor1<float, Mem>(targets.data(), targets.span())},
                            sum);
    RegressionLoss r;
    r.values = static_cast<std::int64_t>(y.span());
    r.loss = sum / static_cast<double>(r.values);
    return r;
  }

  /// dW += dyᵀ · x and dbias += Σ_rows dy for y = x · Wᵀ + bias.
  void linear_backward(const ExecutionSpace& exec, const ConstTensor2<float, Mem>& dy,  // (rows, out)
                       const ConstTensor2<float, Mem>& x,                               // (rows, in)
                       const char* weight, const char* bias) const {
    gemm(exec, Transpose::Yes, Transpose::No, 1.0f, dy, x, 1.0f, Tensor2<float, Mem>(slab.template grad<2>(weight)));
    const Tensor1<float, Mem> db = slab.template grad<1>(bias);
    gemm(exec, Transpose::Yes, Transpose::No, 1.0f, dy, ConstTensor2<float, Mem>(ones), 1.0f,
         Tensor2<float, Mem>(db.data(), db.extent(0), 1));
  }

  /// Backward of the last training forward from d(loss)/d(prediction), held in `prediction`.
  void run_backward(const ExecutionSpace& exec, const ConstTensor3<float, Mem>& inputs) {
    const ConstTensor2<float, Mem> dy = impl::token_rows(ConstTensor3<float, Mem>(prediction));
    // y = normed_f · Wᵀ + b: dW += dyᵀ · normed_f, db += Σ dy, then dnormed_f = dy · W over normed_f.
    const Tensor2<float, Mem> normed = impl::token_rows(backbone.output());
    linear_backward(exec, dy, ConstTensor2<float, Mem>(normed), impl::seq::head_weight, impl::seq::head_bias);
    gemm(exec, Transpose::No, Transpose::No, 1.0f, dy,
         ConstTensor2<float, Mem>(slab.template param<2>(impl::seq::head_weight)), 0.0f, normed);
    const Tensor3<float, Mem>& dh0 = backbone.backward(exec, slab);
    // h_0 = x · W_inᵀ + b_in.
    linear_backward(exec, impl::token_rows(ConstTensor3<float, Mem>(dh0)), impl::token_rows(inputs),
                    impl::seq::input_weight, impl::seq::input_bias);
    backbone.finish_backward(exec);
  }
};

template <class ExecutionSpace>
struct SequenceState<ExecutionSpace>::Impl {
  using Mem = typename ExecutionSpace::memory_space;
  const void* owner = nullptr;  // the SequenceModel::State that made it
  int batch = 0;
  std::int64_t position = 0;
  typename impl::Backbone<ExecutionSpace>::RecurrentState stream;  // the mixers' caches, a step's buffers
};

template <class ExecutionSpace>
SequenceState<ExecutionSpace>::SequenceState(std::unique_ptr<Impl> impl) : impl_(std::move(impl)) {}
template <class ExecutionSpace>
SequenceState<ExecutionSpace>::~SequenceState() = default;
template <class ExecutionSpace>
SequenceState<ExecutionSpace>::SequenceState(SequenceState&&) noexcept = default;
template <class ExecutionSpace>
SequenceState<ExecutionSpace>& SequenceState<ExecutionSpace>::operator=(SequenceState&&) noexcept = default;

template <class ExecutionSpace>
int SequenceState<ExecutionSpace>::batch() const {
  return impl_->batch;
}
template <class ExecutionSpace>
std::int64_t SequenceState<ExecutionSpace>::position() const {
  return impl_->position;
}
template <class ExecutionSpace>
void SequenceState<ExecutionSpace>::reset(const ExecutionSpace& exec) {
  impl_->stream.reset(exec);
  impl_->position = 0;
}

// ---------------------------------------------------------------------------------------------
// SequenceModel

template <class ExecutionSpace>
SequenceModel<ExecutionSpace>::SequenceModel(const SequenceModelConfig& config) : state_(new State(config)) {}
template <class ExecutionSpace>
SequenceModel<ExecutionSpace>::~SequenceModel() = default;
template <class ExecutionSpace>
SequenceModel<ExecutionSpace>::SequenceModel(SequenceModel&&) noexcept = default;
template <class ExecutionSpace>
SequenceModel<ExecutionSpace>& SequenceModel<ExecutionSpace>::operator=(SequenceModel&&) noexcept = default;

template <class ExecutionSpace>
const SequenceModelConfig& SequenceModel<ExecutionSpace>::config() const {
  return state_->config;
}
template <class ExecutionSpace>
typename SequenceModel<ExecutionSpace>::Slab& SequenceModel<ExecutionSpace>::parameters() {
  return state_->slab;
}
template <class ExecutionSpace>
const typename SequenceModel<ExecutionSpace>::Slab& SequenceModel<ExecutionSpace>::parameters() const {
  return state_->slab;
}

template <class ExecutionSpace>
void SequenceModel<ExecutionSpace>::set_activation_checkpointing(bool on) {
  state_->backbone.set_activation_checkpointing(on);
}

template <class ExecutionSpace>
void SequenceModel<ExecutionSpace>::set_sequence_ids(const ConstTensor2<std::int64_t, memory_space>& seq_idx) {
  state_->backbone.set_sequence_ids(seq_idx);
}
template <class ExecutionSpace>
bool SequenceModel<ExecutionSpace>::activation_checkpointing() const {
  return state_->backbone.activation_checkpointing();
}
template <class ExecutionSpace>
void SequenceModel<ExecutionSpace>::set_gradients_ready_hook(GradientsReadyHook hook) {
  state_->backbone.set_gradients_ready_hook(std::move(hook), state_->slab);
}
template <class ExecutionSpace>
std::vector<std::vector<std::pair<std::size_t, std::size_t>>> SequenceModel<ExecutionSpace>::gradients_ready_sequence()
    const {
  return state_->backbone.gradients_ready_sequence(state_->slab);
}

template <class ExecutionSpace>
void SequenceModel<ExecutionSpace>::initialize(std::uint64_t seed) {
  const ExecutionSpace exec;
  State& s = *state_;
  Kokkos::deep_copy(exec, s.slab.params(), 0.0f);
  const std::uint64_t stride = std::uint64_t(1) << 40;
  fill_normal(exec, s.slab.template param<2>(impl::seq::input_weight), seed, 0.0f,
              static_cast<float>(1.0 / std::sqrt(static_cast<double>(s.config.input_size))), 0);
  fill_normal(exec, s.slab.template param<2>(impl::seq::head_weight), seed, 0.0f,
              static_cast<float>(1.0 / std::sqrt(static_cast<double>(s.config.backbone.d_model))), stride);
  s.backbone.initialize(exec, s.slab, seed);
  exec.fence();
}

template <class ExecutionSpace>
void SequenceModel<ExecutionSpace>::zero_grads(const ExecutionSpace& exec) {
  Kokkos::deep_copy(exec, state_->slab.grads(), 0.0f);
}

template <class ExecutionSpace>
void SequenceModel<ExecutionSpace>::forward(
    const ExecutionSpace& exec, const ConstTensor3<float, memory_space>& inputs,  // (batch, seqlen, input_size)
    const Tensor3<float, memory_space>& outputs) {                                // (batch, seqlen, output_size)
  State& s = *state_;
  s.check_io("kmamba::SequenceModel::forward", inputs, "outputs", outputs);
  s.run_forward(exec, inputs, outputs, false);
}

template <class ExecutionSpace>
RegressionLoss SequenceModel<ExecutionSpace>::loss(
    const ExecutionSpace& exec, const ConstTensor3<float, memory_space>& inputs,  // (batch, seqlen, input_size)
    const ConstTensor3<float, memory_space>& targets) {                           // (batch, seqlen, output_size)
  State& s = *state_;
  s.check_io("kmamba::SequenceModel::loss", inputs, "targets", targets);
  s.ensure_prediction(exec, inputs.extent(0), inputs.extent(1));
  s.run_forward(exec, inputs, s.prediction, false);
  return s.squared_error(exec, s.prediction, targets);
}

template <class ExecutionSpace>
RegressionLoss SequenceModel<ExecutionSpace>::loss_and_backward(
    const ExecutionSpace& exec, const ConstTensor3<float, memory_space>& inputs,  // (batch, seqlen, input_size)
    const ConstTensor3<float, memory_space>& targets,                             // (batch, seqlen, output_size)
    double weight, const Tensor3<float, memory_space>& outputs) {                 // (batch, seqlen, output_size)
  constexpr const char* function = "kmamba::SequenceModel::loss_and_backward";
  using Mem = memory_space;
  State& s = *state_;
  s.check_io(function, inputs, "targets", targets);
  if (outputs.is_allocated()) s.check_io(function, inputs, "outputs", outputs);
  s.ensure_prediction(exec, inputs.extent(0), inputs.extent(1));
  s.run_forward(exec, inputs, s.prediction, true);
  if (outputs.is_allocated()) Kokkos::deep_copy(exec, outputs, s.prediction);
  const RegressionLoss result = s.squared_error(exec, s.prediction, targets);
  const float scale = static_cast<float>(weight / static_cast<double>(result.values));
  Kokkos::parallel_for(
      "kmamba::sequence_model::squared_error_grad", typename State::Range(exec, 0, s.prediction.span()),
      impl::seq::SquaredErrorGrad<Mem>{impl::as_flat(s.prediction),
                                       ConstTensor1<float, Mem>(targets.data(), targets.span()), scale});
  s.run_backward(exec, inputs);
  exec.fence();
  return result;
}

template <class ExecutionSpace>
SequenceState<ExecutionSpace> SequenceModel<ExecutionSpace>::make_state(int batch) const {
  KMAMBA_REQUIRE(batch >= 1, "kmamba::SequenceModel::make_state: batch must be at least 1, got " << batch);
  const State& s = *state_;
  std::unique_ptr<typename SequenceState<ExecutionSpace>::Impl> impl(new
                                                                     typename SequenceState<ExecutionSpace>::Impl());
  impl->owner = &s;
  impl->batch = batch;
  impl->stream = s.backbone.make_state(batch, "kmamba::sequence_state");
  return SequenceState<ExecutionSpace>(std::move(impl));
}

namespace {

template <class Impl>
Impl& state_impl(const char* function, const std::unique_ptr<Impl>& impl, const void* model_state) {
  KMAMBA_REQUIRE(impl != nullptr, function << ": the SequenceState was moved from");
  KMAMBA_REQUIRE(impl->owner == model_state, function << ": the SequenceState was made by another SequenceModel");
  return *impl;
}

}  // namespace

template <class ExecutionSpace>
void SequenceModel<ExecutionSpace>::prefill(
    const ExecutionSpace& exec, const ConstTensor3<float, memory_space>& inputs,  // (batch, seqlen, input_size)
    SequenceState<ExecutionSpace>& state,
    const Tensor3<float, memory_space>& outputs) const {  // (batch, seqlen, output_size)
  using Mem = memory_space;
  constexpr const char* function = "kmamba::SequenceModel::prefill";
  const State& s = *state_;
  auto& d = state_impl(function, state.impl_, &s);
  const std::int64_t b = static_cast<std::int64_t>(inputs.extent(0)), l = static_cast<std::int64_t>(inputs.extent(1));
  check_shape(function, "inputs", inputs, {static_cast<std::int64_t>(d.batch), Shape::any, s.config.input_size},
              "(batch of the SequenceState, seqlen, input_size)");
  check_allocated(function, "inputs", inputs);
  if (outputs.is_allocated()) {
    check_shape(function, "outputs", outputs, {b, l, s.config.output_size},
                "(batch, seqlen, output_size) with batch, seqlen from inputs");
  }
  if (l == 0) return;
  const auto segment = s.backbone.prefill(
      exec, s.slab, b, l,
      [&](const Tensor2<float, Mem>& h0) {
        s.linear(exec, impl::token_rows(inputs), impl::seq::input_weight, impl::seq::input_bias, h0);
      },
      d.stream, "kmamba::sequence_state");
  d.position += l;
  if (!outputs.is_allocated()) return;
  const float eps = static_cast<float>(s.config.backbone.norm_epsilon);
  add_rms_norm(exec, impl::token_rows(segment.residual), impl::token_rows(segment.mixed),
               s.slab.template param<1>(impl::Backbone<ExecutionSpace>::final_norm_name), eps,
               impl::token_rows(segment.normed));
  s.linear(exec, impl::token_rows(ConstTensor3<float, Mem>(segment.normed)), impl::seq::head_weight,
           impl::seq::head_bias, impl::token_rows(outputs));
}

template <class ExecutionSpace>
void SequenceModel<ExecutionSpace>::step(const ExecutionSpace& exec,
                                         const ConstTensor2<float, memory_space>& inputs,  // (batch, input_size)
                                         SequenceState<ExecutionSpace>& state,
                                         const Tensor2<float, memory_space>& outputs) const {  // (batch, output_size)
  using Mem = memory_space;
  constexpr const char* function = "kmamba::SequenceModel::step";
  const State& s = *state_;
  auto& d = state_impl(function, state.impl_, &s);
  const std::int64_t batch = d.batch;
  check_shape(function, "inputs", inputs, {batch, s.config.input_size}, "(batch of the SequenceState, input_size)");
  check_shape(function, "outputs", outputs, {batch, s.config.output_size}, "(batch of the SequenceState, output_size)");
  check_allocated(function, "inputs", inputs);
  check_allocated(function, "outputs", outputs);
  s.linear(exec, inputs, impl::seq::input_weight, impl::seq::input_bias, d.stream.residual);
  s.backbone.step(exec, s.slab, d.stream);
  s.linear(exec, ConstTensor2<float, Mem>(d.stream.normed), impl::seq::head_weight, impl::seq::head_bias, outputs);
  d.position += 1;
}

template <class ExecutionSpace>
SequenceModel<ExecutionSpace> SequenceModel<ExecutionSpace>::load(const std::string& dir) {
  constexpr const char* function = "kmamba::SequenceModel::load";
  KMAMBA_REQUIRE(impl::seq::is_directory(dir), function << ": '" << dir
                                                        << "' is not a directory (expected a checkpoint directory "
                                                           "with config.json and model.safetensors)");
  const std::string config_path = dir + "/config.json";
  const SequenceModelConfig config =
      SequenceModelConfig::from_json(read_input_file(config_path, 16u << 20, function), config_path);
  const SafeTensorsReader file(dir + "/model.safetensors");
  impl::seq::check_sizes_against_file(config, file, config_path);
  {
    // Every parameter's shape against the file's header, still before any allocation.
    const impl::Backbone<ExecutionSpace> backbone(config.backbone, ModelParallel(), "kmamba::sequence_model");
    Slab declared;
    State::declare_parameters(config, backbone, declared);
    for (const auto& entry : declared.entries()) {
      KMAMBA_REQUIRE(file.contains(entry.name), function << ": '" << file.path() << "' has no tensor '" << entry.name
                                                         << "' (shape " << Shape(entry.shape).to_string()
                                                         << ") required by config.json");
      file.check_shape(entry.name, entry.shape);
    }
  }
  SequenceModel model(config);
  State& s = *model.state_;
  std::set<std::string> used;
  for (const auto& entry : s.slab.entries()) {
    const std::vector<float> values = file.read_f32(entry.name);
    const Kokkos::View<const float*, Kokkos::HostSpace, Kokkos::MemoryTraits<Kokkos::Unmanaged>> host(values.data(),
                                                                                                      values.size());
    Kokkos::deep_copy(Kokkos::subview(s.slab.params(), std::make_pair(entry.offset, entry.offset + entry.size)), host);
    used.insert(entry.name);
  }
  for (const std::string& name : file.names()) {
    KMAMBA_REQUIRE(used.count(name) != 0,
                   function << ": '" << file.path() << "' has tensor '" << name << "', which config.json does not use");
  }
  return model;
}

template <class ExecutionSpace>
void SequenceModel<ExecutionSpace>::save(const std::string& dir) const {
  impl::seq::make_directories(dir);
  const State& s = *state_;
  SafeTensorsWriter file;
  const auto host = Kokkos::create_mirror_view_and_copy(Kokkos::HostSpace(), s.slab.params());
  for (const auto& entry : s.slab.entries()) file.add(entry.name, DType::F32, entry.shape, host.data() + entry.offset);
  file.set_metadata("format", "pt");
  file.write(dir + "/model.safetensors");
  write_output_file(dir + "/config.json", s.config.to_json(), "kmamba::SequenceModel::save");
}

#define KMAMBA_INSTANTIATE(Exec)      \
  template class SequenceState<Exec>; \
  template class SequenceModel<Exec>;
KMAMBA_FOR_EACH_BACKEND(KMAMBA_INSTANTIATE)
#undef KMAMBA_INSTANTIATE

}  // namespace kmamba
