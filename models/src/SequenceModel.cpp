// The continuous-valued sequence model: input projection, the language model's residual blocks,
// final norm, linear head, mean squared error and the backward through all of them; recurrent
// inference (prefill and step) over the mixers' caches; checkpoints.
#include <kmamba/models/SequenceModel.hpp>

#include <kmamba/Config.hpp>
#include <kmamba/backends/Gemm.hpp>
#include <kmamba/core/Error.hpp>
#include <kmamba/core/Random.hpp>
#include <kmamba/core/RmsNorm.hpp>
#include <kmamba/core/Shape.hpp>
#include <kmamba/models/SafeTensors.hpp>

#include <Kokkos_Core.hpp>

#include <nlohmann/json.hpp>

#include <cerrno>
#include <cmath>
#include <cstdio>
#include <cstring>
#include <fstream>
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
constexpr const char* final_norm = "backbone.norm_f.weight";
constexpr const char* format = "kmamba-sequence-model";

inline std::string layer_prefix(int layer) { return "backbone.layers." + std::to_string(layer) + "."; }

/// acc(i) += x(i) over flat views.
template <class MemorySpace>
struct Accumulate {
  Tensor1<float, MemorySpace> acc;
  ConstTensor1<float, MemorySpace> x;
  KOKKOS_INLINE_FUNCTION void operator()(const std::size_t i) const { acc(i) += x(i); }
};

/// out(i) = a(i) + b(i) over flat views.
template <class MemorySpace>
struct Add {
  Tensor1<float, MemorySpace> out;
  ConstTensor1<float, MemorySpace> a, b;
  KOKKOS_INLINE_FUNCTION void operator()(const std::size_t i) const { out(i) = a(i) + b(i); }
};

/// y(r, c) += bias(c).
template <class MemorySpace>
struct AddBias {
  Tensor2<float, MemorySpace> y;        // (rows, channels)
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

template <class MemorySpace>
Tensor1<float, MemorySpace> flat(const Tensor3<float, MemorySpace>& v) {
  return Tensor1<float, MemorySpace>(v.data(), v.span());
}
template <class MemorySpace>
Tensor1<float, MemorySpace> flat(const Tensor2<float, MemorySpace>& v) {
  return Tensor1<float, MemorySpace>(v.data(), v.span());
}
template <class T, class MemorySpace>
Kokkos::View<T**, Kokkos::LayoutRight, MemorySpace> rows(const Kokkos::View<T***, Kokkos::LayoutRight, MemorySpace>& v) {
  return Kokkos::View<T**, Kokkos::LayoutRight, MemorySpace>(v.data(), v.extent(0) * v.extent(1), v.extent(2));
}

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
    KMAMBA_REQUIRE(::mkdir(partial.c_str(), 0755) == 0 || errno == EEXIST,
                   "kmamba::SequenceModel::save: cannot create directory '" << partial << "': " << std::strerror(errno));
  }
}

void write_text_atomically(const std::string& path, const std::string& text) {
  const std::string temporary = path + ".tmp";
  std::FILE* f = std::fopen(temporary.c_str(), "wb");
  KMAMBA_REQUIRE(f != nullptr, "kmamba::SequenceModel::save: cannot create '" << temporary << "': " << std::strerror(errno));
  bool ok = std::fwrite(text.data(), 1, text.size(), f) == text.size();
  ok = (std::fclose(f) == 0) && ok;
  if (!ok || std::rename(temporary.c_str(), path.c_str()) != 0) {
    std::remove(temporary.c_str());
    KMAMBA_USER_ERROR("kmamba::SequenceModel::save: writing '" << path << "' failed: " << std::strerror(errno));
  }
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
  j["backbone"] = nlohmann::json::parse(backbone.to_hf_json());
  return j.dump(2);
}

SequenceModelConfig SequenceModelConfig::from_json(const std::string& json_text, const std::string& source) {
  nlohmann::json root;
  try {
    root = nlohmann::json::parse(json_text);
  } catch (const nlohmann::json::exception& e) {
    KMAMBA_USER_ERROR("kmamba::SequenceModelConfig: '" << source << "' is not valid JSON: " << e.what());
  }
  KMAMBA_REQUIRE(root.is_object() && root.value("format", std::string()) == impl::seq::format,
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
  std::vector<std::unique_ptr<Mixer<ExecutionSpace>>> mixers;

  // Activations of the last forward (batch, seqlen fixed by it).
  std::int64_t batch = 0, seqlen = 0;
  std::vector<Tensor3<float, Mem>> residuals;  // n_layer × (batch, seqlen, d_model): input of block i's norm
  std::vector<Tensor1<float, Mem>> rstds;      // n_layer × (batch·seqlen)
  Tensor3<float, Mem> final_input;             // (batch, seqlen, d_model): h + residual before norm_f
  Tensor1<float, Mem> final_rstd;              // (batch·seqlen)
  Tensor3<float, Mem> normed;                  // (batch, seqlen, d_model): a norm's output
  Tensor3<float, Mem> mixed;                   // (batch, seqlen, d_model): a mixer's output
  Tensor3<float, Mem> prediction;              // (batch, seqlen, output_size): the head's output (training)
  Tensor2<float, Mem> ones;                    // (batch·seqlen, 1): sums rows in the bias gradients
  Tensor1<float, Mem> norm_grad;               // (d_model): one norm's weight gradient before accumulation

  explicit State(const SequenceModelConfig& c) : config(c) {
    config.validate();
    const ModelConfig& m = config.backbone;
    const std::int64_t dm = m.d_model;
    slab.add(impl::seq::input_weight, {dm, config.input_size}, WeightDecay::Yes);
    slab.add(impl::seq::input_bias, {dm}, WeightDecay::No);
    for (int i = 0; i < m.n_layer; ++i) {
      mixers.push_back(make_mixer<ExecutionSpace>(m, impl::seq::layer_prefix(i) + "mixer."));
      mixers.back()->declare_parameters(slab);
      slab.add(impl::seq::layer_prefix(i) + "norm.weight", {dm}, WeightDecay::No);
    }
    slab.add(impl::seq::final_norm, {dm}, WeightDecay::No);
    slab.add(impl::seq::head_weight, {config.output_size, dm}, WeightDecay::Yes);
    slab.add(impl::seq::head_bias, {config.output_size}, WeightDecay::No);
    slab.finalize("kmamba::sequence_model");
  }

  float eps() const { return static_cast<float>(config.backbone.norm_epsilon); }

  void ensure_buffers(const ExecutionSpace& exec, std::int64_t b, std::int64_t l, bool training) {
    const std::int64_t dm = config.backbone.d_model, n = b * l;
    if (batch != b || seqlen != l || !normed.is_allocated()) {
      batch = b;
      seqlen = l;
      residuals.clear();
      rstds.clear();
      prediction = Tensor3<float, Mem>();
      final_input = allocate_uninitialized<Tensor3<float, Mem>>("kmamba::sequence_model::final_input", b, l, dm);
      final_rstd = allocate_uninitialized<Tensor1<float, Mem>>("kmamba::sequence_model::final_rstd", n);
      normed = allocate_uninitialized<Tensor3<float, Mem>>("kmamba::sequence_model::normed", b, l, dm);
      mixed = allocate_uninitialized<Tensor3<float, Mem>>("kmamba::sequence_model::mixed", b, l, dm);
      norm_grad = allocate<Tensor1<float, Mem>>("kmamba::sequence_model::norm_grad", dm);
      ones = allocate_uninitialized<Tensor2<float, Mem>>("kmamba::sequence_model::ones", n, 1);
      Kokkos::deep_copy(exec, ones, 1.0f);
    }
    // Inference keeps one residual buffer; training one per layer.
    const std::size_t wanted = training ? static_cast<std::size_t>(config.backbone.n_layer) : 1u;
    while (residuals.size() < wanted) {
      const std::string index = std::to_string(residuals.size());
      residuals.push_back(allocate_uninitialized<Tensor3<float, Mem>>("kmamba::sequence_model::residual_" + index, b, l, dm));
      rstds.push_back(allocate_uninitialized<Tensor1<float, Mem>>("kmamba::sequence_model::rstd_" + index, n));
    }
  }

  /// The (batch, seqlen, output_size) buffer loss and loss_and_backward predict into.
  void ensure_prediction(std::int64_t b, std::int64_t l) {
    if (!prediction.is_allocated()) {
      prediction = allocate_uninitialized<Tensor3<float, Mem>>("kmamba::sequence_model::prediction", b, l,
                                                               config.output_size);
    }
  }

  /// y = x · Wᵀ + bias over rows.
  void linear(const ExecutionSpace& exec, const ConstTensor2<float, Mem>& x, const char* weight, const char* bias,
              const Tensor2<float, Mem>& y) const {
    gemm(exec, Transpose::No, Transpose::Yes, 1.0f, x, ConstTensor2<float, Mem>(slab.template param<2>(weight)), 0.0f, y);
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
    check_shape(function, "inputs", inputs, {Shape::any, Shape::any, config.input_size},
                "(batch, seqlen, input_size)");
    check_allocated(function, "inputs", inputs);
    check_shape(function, out_name, outputs,
                {static_cast<std::int64_t>(inputs.extent(0)), static_cast<std::int64_t>(inputs.extent(1)),
                 config.output_size},
                "(batch, seqlen, output_size) with batch, seqlen from inputs");
    check_allocated(function, out_name, outputs);
  }

  /// Runs the forward from `inputs` into `outputs`; keeps per-layer activations when `training`.
  void run_forward(const ExecutionSpace& exec, const ConstTensor3<float, Mem>& inputs,
                   const Tensor3<float, Mem>& outputs, bool training) {
    const std::int64_t b = inputs.extent(0), l = inputs.extent(1);
    ensure_buffers(exec, b, l, training);
    const Range all(exec, 0, static_cast<std::size_t>(b * l * config.backbone.d_model));
    linear(exec, impl::seq::rows(inputs), impl::seq::input_weight, impl::seq::input_bias,
           impl::seq::rows(residuals[0]));
    for (int i = 0; i < config.backbone.n_layer; ++i) {
      const std::size_t slot = training ? static_cast<std::size_t>(i) : 0u;
      const Tensor3<float, Mem>& residual = residuals[slot];
      if (i > 0) {
        const Tensor3<float, Mem>& previous = residuals[training ? slot - 1 : 0u];
        Kokkos::parallel_for("kmamba::sequence_model::residual_add", all,
                             impl::seq::Add<Mem>{impl::seq::flat(residual), impl::seq::flat(mixed),
                                                 impl::seq::flat(previous)});
      }
      rms_norm(exec, impl::seq::rows(residual), slab.template param<1>(impl::seq::layer_prefix(i) + "norm.weight"),
               eps(), impl::seq::rows(normed), rstds[slot]);
      mixers[static_cast<std::size_t>(i)]->forward(exec, slab, normed, mixed, training);
    }
    Kokkos::parallel_for("kmamba::sequence_model::residual_add", all,
                         impl::seq::Add<Mem>{impl::seq::flat(final_input), impl::seq::flat(mixed),
                                             impl::seq::flat(residuals[training ? residuals.size() - 1 : 0u])});
    rms_norm(exec, impl::seq::rows(final_input), slab.template param<1>(impl::seq::final_norm), eps(),
             impl::seq::rows(normed), final_rstd);
    linear(exec, impl::seq::rows(ConstTensor3<float, Mem>(normed)), impl::seq::head_weight, impl::seq::head_bias,
           impl::seq::rows(outputs));
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

  void add_norm_grad(const ExecutionSpace& exec, const std::string& name) const {
    const Tensor1<float, Mem> grad = slab.template grad<1>(name);
    Kokkos::parallel_for("kmamba::sequence_model::accumulate_norm_grad", Range(exec, 0, grad.extent(0)),
                         impl::seq::Accumulate<Mem>{grad, norm_grad});
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
    const Range all(exec, 0, static_cast<std::size_t>(batch * seqlen * config.backbone.d_model));
    const ConstTensor2<float, Mem> dy = impl::seq::rows(ConstTensor3<float, Mem>(prediction));
    // y = normed_f · Wᵀ + b: dW += dyᵀ · normed_f, db += Σ dy, dnormed_f = dy · W.
    linear_backward(exec, dy, impl::seq::rows(ConstTensor3<float, Mem>(normed)), impl::seq::head_weight,
                    impl::seq::head_bias);
    Tensor3<float, Mem> dres = mixed;  // the residual stream's gradient (mixed is free in backward)
    Tensor3<float, Mem> dnormed = normed;
    gemm(exec, Transpose::No, Transpose::No, 1.0f, dy,
         ConstTensor2<float, Mem>(slab.template param<2>(impl::seq::head_weight)), 0.0f, impl::seq::rows(dnormed));
    rms_norm_backward(exec, impl::seq::rows(dnormed), impl::seq::rows(final_input),
                      slab.template param<1>(impl::seq::final_norm), final_rstd, impl::seq::rows(dres), norm_grad);
    add_norm_grad(exec, impl::seq::final_norm);
    for (int i = config.backbone.n_layer - 1; i >= 0; --i) {
      const std::string norm = impl::seq::layer_prefix(i) + "norm.weight";
      const std::size_t layer = static_cast<std::size_t>(i);
      mixers[layer]->backward(exec, slab, dres, dnormed);
      rms_norm_backward(exec, impl::seq::rows(dnormed), impl::seq::rows(residuals[layer]),
                        slab.template param<1>(norm), rstds[layer], impl::seq::rows(final_input), norm_grad);
      add_norm_grad(exec, norm);
      Kokkos::parallel_for("kmamba::sequence_model::accumulate_residual_grad", all,
                           impl::seq::Accumulate<Mem>{impl::seq::flat(dres), impl::seq::flat(final_input)});
    }
    // residual_0 = x · W_inᵀ + b_in.
    linear_backward(exec, impl::seq::rows(ConstTensor3<float, Mem>(dres)), impl::seq::rows(inputs),
                    impl::seq::input_weight, impl::seq::input_bias);
    for (auto& mixer : mixers) mixer->release_activations();
  }
};

template <class ExecutionSpace>
struct SequenceState<ExecutionSpace>::Impl {
  using Mem = typename ExecutionSpace::memory_space;
  const void* owner = nullptr;  // the SequenceModel::State that made it
  int batch = 0;
  std::int64_t position = 0;
  std::vector<std::unique_ptr<MixerCache<ExecutionSpace>>> caches;  // one per layer
  Tensor2<float, Mem> residual;  // (batch, d_model): the residual stream of the current step
  Tensor2<float, Mem> normed;    // (batch, d_model): a norm's output
  Tensor2<float, Mem> mixed;     // (batch, d_model): a mixer's output
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
  for (auto& cache : impl_->caches) cache->reset(exec);
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
void SequenceModel<ExecutionSpace>::initialize(std::uint64_t seed) {
  const ExecutionSpace exec;
  State& s = *state_;
  Kokkos::deep_copy(exec, s.slab.params(), 0.0f);
  const std::uint64_t stride = std::uint64_t(1) << 40;
  fill_normal(exec, s.slab.template param<2>(impl::seq::input_weight), seed, 0.0f,
              static_cast<float>(1.0 / std::sqrt(static_cast<double>(s.config.input_size))), 0);
  fill_normal(exec, s.slab.template param<2>(impl::seq::head_weight), seed, 0.0f,
              static_cast<float>(1.0 / std::sqrt(static_cast<double>(s.config.backbone.d_model))), stride);
  for (int i = 0; i < s.config.backbone.n_layer; ++i) {
    Kokkos::deep_copy(exec, s.slab.template param<1>(impl::seq::layer_prefix(i) + "norm.weight"), 1.0f);
    s.mixers[static_cast<std::size_t>(i)]->initialize(exec, s.slab,
                                                      seed + 0x9E3779B97F4A7C15ull * static_cast<std::uint64_t>(i + 1));
  }
  Kokkos::deep_copy(exec, s.slab.template param<1>(impl::seq::final_norm), 1.0f);
  exec.fence();
}

template <class ExecutionSpace>
void SequenceModel<ExecutionSpace>::zero_grads(const ExecutionSpace& exec) {
  Kokkos::deep_copy(exec, state_->slab.grads(), 0.0f);
}

template <class ExecutionSpace>
void SequenceModel<ExecutionSpace>::forward(const ExecutionSpace& exec,
                                            const ConstTensor3<float, memory_space>& inputs,  // (batch, seqlen, input_size)
                                            const Tensor3<float, memory_space>& outputs) {    // (batch, seqlen, output_size)
  State& s = *state_;
  s.check_io("kmamba::SequenceModel::forward", inputs, "outputs", outputs);
  s.run_forward(exec, inputs, outputs, false);
}

template <class ExecutionSpace>
RegressionLoss SequenceModel<ExecutionSpace>::loss(const ExecutionSpace& exec,
                                                   const ConstTensor3<float, memory_space>& inputs,     // (batch, seqlen, input_size)
                                                   const ConstTensor3<float, memory_space>& targets) {  // (batch, seqlen, output_size)
  State& s = *state_;
  s.check_io("kmamba::SequenceModel::loss", inputs, "targets", targets);
  s.ensure_buffers(exec, inputs.extent(0), inputs.extent(1), false);
  s.ensure_prediction(inputs.extent(0), inputs.extent(1));
  s.run_forward(exec, inputs, s.prediction, false);
  return s.squared_error(exec, s.prediction, targets);
}

template <class ExecutionSpace>
RegressionLoss SequenceModel<ExecutionSpace>::loss_and_backward(
    const ExecutionSpace& exec,
    const ConstTensor3<float, memory_space>& inputs,   // (batch, seqlen, input_size)
    const ConstTensor3<float, memory_space>& targets,  // (batch, seqlen, output_size)
    double weight, const Tensor3<float, memory_space>& outputs) {  // (batch, seqlen, output_size)
  constexpr const char* function = "kmamba::SequenceModel::loss_and_backward";
  using Mem = memory_space;
  State& s = *state_;
  s.check_io(function, inputs, "targets", targets);
  if (outputs.is_allocated()) s.check_io(function, inputs, "outputs", outputs);
  s.ensure_buffers(exec, inputs.extent(0), inputs.extent(1), true);
  s.ensure_prediction(inputs.extent(0), inputs.extent(1));
  s.run_forward(exec, inputs, s.prediction, true);
  if (outputs.is_allocated()) Kokkos::deep_copy(exec, outputs, s.prediction);
  const RegressionLoss result = s.squared_error(exec, s.prediction, targets);
  const float scale = static_cast<float>(weight / static_cast<double>(result.values));
  Kokkos::parallel_for("kmamba::sequence_model::squared_error_grad",
                       typename State::Range(exec, 0, s.prediction.span()),
                       impl::seq::SquaredErrorGrad<Mem>{impl::seq::flat(s.prediction),
                                                        ConstTensor1<float, Mem>(targets.data(), targets.span()), scale});
  s.run_backward(exec, inputs);
  exec.fence();
  return result;
}

template <class ExecutionSpace>
SequenceState<ExecutionSpace> SequenceModel<ExecutionSpace>::make_state(int batch) const {
  using Mem = memory_space;
  KMAMBA_REQUIRE(batch >= 1, "kmamba::SequenceModel::make_state: batch must be at least 1, got " << batch);
  const State& s = *state_;
  std::unique_ptr<typename SequenceState<ExecutionSpace>::Impl> impl(new typename SequenceState<ExecutionSpace>::Impl());
  impl->owner = &s;
  impl->batch = batch;
  for (const auto& mixer : s.mixers) impl->caches.push_back(mixer->make_cache(batch));
  const int dm = s.config.backbone.d_model;
  impl->residual = allocate_uninitialized<Tensor2<float, Mem>>("kmamba::sequence_state::residual", batch, dm);
  impl->normed = allocate_uninitialized<Tensor2<float, Mem>>("kmamba::sequence_state::normed", batch, dm);
  impl->mixed = allocate_uninitialized<Tensor2<float, Mem>>("kmamba::sequence_state::mixed", batch, dm);
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
void SequenceModel<ExecutionSpace>::prefill(const ExecutionSpace& exec,
                                            const ConstTensor3<float, memory_space>& inputs,  // (batch, seqlen, input_size)
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
  const std::int64_t dm = s.config.backbone.d_model;
  const Tensor3<float, Mem> residual =
      allocate_uninitialized<Tensor3<float, Mem>>("kmamba::sequence_state::prefill_residual", b, l, dm);
  const Tensor3<float, Mem> normed =
      allocate_uninitialized<Tensor3<float, Mem>>("kmamba::sequence_state::prefill_normed", b, l, dm);
  const Tensor3<float, Mem> mixed =
      allocate_uninitialized<Tensor3<float, Mem>>("kmamba::sequence_state::prefill_mixed", b, l, dm);
  s.linear(exec, impl::seq::rows(inputs), impl::seq::input_weight, impl::seq::input_bias, impl::seq::rows(residual));
  // Each block's residual add and norm are one kernel (the first block's input is the projection).
  for (int i = 0; i < s.config.backbone.n_layer; ++i) {
    const auto norm_weight = s.slab.template param<1>(impl::seq::layer_prefix(i) + "norm.weight");
    if (i == 0) {
      rms_norm(exec, impl::seq::rows(residual), norm_weight, s.eps(), impl::seq::rows(normed));
    } else {
      add_rms_norm(exec, impl::seq::rows(residual), impl::seq::rows(mixed), norm_weight, s.eps(),
                   impl::seq::rows(normed));
    }
    const std::size_t layer = static_cast<std::size_t>(i);
    s.mixers[layer]->prefill(exec, s.slab, normed, mixed, *d.caches[layer]);
  }
  d.position += l;
  if (!outputs.is_allocated()) return;
  add_rms_norm(exec, impl::seq::rows(residual), impl::seq::rows(mixed), s.slab.template param<1>(impl::seq::final_norm),
               s.eps(), impl::seq::rows(normed));
  s.linear(exec, impl::seq::rows(ConstTensor3<float, Mem>(normed)), impl::seq::head_weight, impl::seq::head_bias,
           impl::seq::rows(outputs));
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
  s.linear(exec, inputs, impl::seq::input_weight, impl::seq::input_bias, d.residual);
  for (int i = 0; i < s.config.backbone.n_layer; ++i) {
    const auto norm_weight = s.slab.template param<1>(impl::seq::layer_prefix(i) + "norm.weight");
    if (i == 0) {
      rms_norm(exec, d.residual, norm_weight, s.eps(), d.normed);
    } else {
      add_rms_norm(exec, d.residual, d.mixed, norm_weight, s.eps(), d.normed);
    }
    const std::size_t layer = static_cast<std::size_t>(i);
    s.mixers[layer]->step(exec, s.slab, d.normed, d.mixed, *d.caches[layer]);
  }
  add_rms_norm(exec, d.residual, d.mixed, s.slab.template param<1>(impl::seq::final_norm), s.eps(), d.normed);
  s.linear(exec, ConstTensor2<float, Mem>(d.normed), impl::seq::head_weight, impl::seq::head_bias, outputs);
  d.position += 1;
}

template <class ExecutionSpace>
SequenceModel<ExecutionSpace> SequenceModel<ExecutionSpace>::load(const std::string& dir) {
  constexpr const char* function = "kmamba::SequenceModel::load";
  KMAMBA_REQUIRE(impl::seq::is_directory(dir), function << ": '" << dir
                                                        << "' is not a directory (expected a checkpoint directory "
                                                           "with config.json and model.safetensors)");
  const std::string config_path = dir + "/config.json";
  std::ifstream in(config_path);
  KMAMBA_REQUIRE(in.good(), function << ": cannot read '" << config_path << "'");
  std::stringstream text;
  text << in.rdbuf();
  SequenceModel model(SequenceModelConfig::from_json(text.str(), config_path));
  const SafeTensorsReader file(dir + "/model.safetensors");
  State& s = *model.state_;
  std::set<std::string> used;
  for (const auto& entry : s.slab.entries()) {
    KMAMBA_REQUIRE(file.contains(entry.name), function << ": '" << file.path() << "' has no tensor '" << entry.name
                                                       << "' (shape " << Shape(entry.shape).to_string()
                                                       << ") required by config.json");
    file.check_shape(entry.name, entry.shape);
    const std::vector<float> values = file.read_f32(entry.name);
    const Kokkos::View<const float*, Kokkos::HostSpace, Kokkos::MemoryTraits<Kokkos::Unmanaged>> host(values.data(),
                                                                                                      values.size());
    Kokkos::deep_copy(Kokkos::subview(s.slab.params(), std::make_pair(entry.offset, entry.offset + entry.size)), host);
    used.insert(entry.name);
  }
  for (const std::string& name : file.names()) {
    KMAMBA_REQUIRE(used.count(name) != 0, function << ": '" << file.path() << "' has tensor '" << name
                                                   << "', which config.json does not use");
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
  impl::seq::write_text_atomically(dir + "/config.json", s.config.to_json());
}

#if KMAMBA_HAS_SERIAL
template class SequenceState<Kokkos::Serial>;
template class SequenceModel<Kokkos::Serial>;
#endif
#if KMAMBA_HAS_OPENMP
template class SequenceState<Kokkos::OpenMP>;
template class SequenceModel<Kokkos::OpenMP>;
#endif
#if KMAMBA_ENABLE_CUDA
template class SequenceState<Kokkos::Cuda>;
template class SequenceModel<Kokkos::Cuda>;
#endif

}  // namespace kmamba
