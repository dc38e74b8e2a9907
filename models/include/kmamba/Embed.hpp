// The embedding API: a Mamba sequence model inside a Kokkos (+ MPI) application, on the
// application's own Views, execution-space instances and communicator. Included by
// kmamba/KMamba.hpp, which is all an application needs.
//
//   kmamba::SequenceModelConfig config;          // continuous values in and out (not tokens)
//   config.input_size = config.output_size = 40;
//   config.backbone.d_model = 64;  config.backbone.n_layer = 2;  config.backbone.headdim = 16;
//   kmamba::Model<Exec> model(config, /*seed=*/1);          // or kmamba::Model<Exec>::load(dir)
//   model.enable_data_parallel(MPI_COMM_WORLD);             // optional (builds with MPI)
//   auto r = model.train_step(exec, inputs, targets);       // (batch, seqlen, 40) each: MSE + AdamW
//   model.forward(exec, inputs, outputs);                   // non-blocking on exec
//   auto session = model.session(streams);                  // recurrent state of `streams` streams
//   session.step(exec, x_t, y_t);                           // (streams, 40) → (streams, 40)
//   model.save(dir);
//
// Views: any Kokkos::View of float that `Exec` can access (its memory space, or e.g. CudaUVMSpace
// for Cuda), row-major and contiguous (LayoutRight, or LayoutLeft/LayoutStride whose strides are
// row-major), managed or unmanaged over the application's own pointers. A view of the wrong rank,
// extent, memory space or layout is a kmamba::UserError at the call naming the function, the
// argument and the expected shape. Nothing is copied: the model reads and writes the
// application's memory in place.
#ifndef KMAMBA_EMBED_HPP
#define KMAMBA_EMBED_HPP

#include <kmamba/Config.hpp>
#include <kmamba/core/Error.hpp>
#include <kmamba/core/Shape.hpp>
#include <kmamba/core/Tensor.hpp>
#include <kmamba/models/Distributed.hpp>
#include <kmamba/models/Optimizer.hpp>
#include <kmamba/models/SequenceModel.hpp>

#include <Kokkos_Core.hpp>

#if KMAMBA_ENABLE_MPI
#include <kmamba/parallel/ProcessMesh.hpp>

#include <mpi.h>
#endif

#include <cstdint>
#include <memory>
#include <string>
#include <type_traits>
#include <utility>

namespace kmamba {

/// The optimizer and schedule of Model::train_step.
struct TrainOptions {
  double lr = 1e-3;               ///< peak learning rate
  double min_lr = 1e-4;           ///< floor of the cosine decay (with total_steps > 0)
  std::int64_t warmup_steps = 0;  ///< linear warm-up steps
  std::int64_t total_steps = 0;   ///< end of the cosine decay; 0: constant lr after warm-up
  double weight_decay = 0.0;      ///< decoupled, on the projection and conv weights only
  double beta1 = 0.9, beta2 = 0.95, eps = 1e-8;
  double grad_clip = 1.0;  ///< maximum global gradient norm (0: no clipping)
  int zero_stage = 0;      ///< data parallel: 0 replicates the AdamW moments, 1 shards them

  /// Throws kmamba::UserError naming the first invalid field.
  void validate() const;
  /// The learning rate of optimizer step `step` (0-based).
  double learning_rate(std::int64_t step) const;
};

/// What one Model::train_step did.
struct TrainStepResult {
  std::int64_t step = 0;   ///< optimizer steps taken, this one included
  double loss = 0.0;       ///< mean squared error over the step's batch (all data-parallel ranks)
  double grad_norm = 0.0;  ///< global gradient norm before clipping
  double lr = 0.0;         ///< learning rate of this step
};

namespace impl {

/// `view`'s data after checking that it is a float view of `expected` shape, in a memory space
/// `ExecutionSpace` can access, row-major and contiguous.
template <class ExecutionSpace, class View>
typename View::value_type* embed_view_data(const char* function, const char* name, const View& view,
                                           const Shape& expected, const char* dims) {
  static_assert(Kokkos::is_view<View>::value, "kmamba: model inputs and outputs are Kokkos::Views");
  static_assert(std::is_same<typename View::non_const_value_type, float>::value,
                "kmamba: model inputs and outputs are Views of float");
  using Space = typename View::memory_space;
  KMAMBA_REQUIRE(static_cast<int>(View::rank) == expected.rank,
                 function << ": " << name << " has rank " << View::rank << " (shape " << shape_of(view).to_string()
                          << ") but a rank-" << expected.rank << " view " << dims << " = " << expected.to_string()
                          << " was expected");
  KMAMBA_REQUIRE((Kokkos::SpaceAccessibility<ExecutionSpace, Space>::accessible),
                 function << ": " << name << " lives in memory space " << Space::name() << ", which execution space "
                          << ExecutionSpace::name() << " cannot access (pass a view in "
                          << ExecutionSpace::memory_space::name() << " or a space it can access)");
  check_shape(function, name, view, expected, dims);
  check_allocated(function, name, view);
  std::size_t stride = 1;
  for (int i = static_cast<int>(View::rank) - 1; i >= 0; --i) {
    const std::size_t extent = view.extent(static_cast<unsigned>(i));
    KMAMBA_REQUIRE(extent <= 1 || view.stride(static_cast<std::size_t>(i)) == stride,
                   function << ": " << name << " (shape " << shape_of(view).to_string()
                            << ") is not row-major and contiguous (use LayoutRight, or copy a strided subview)");
    stride *= extent;
  }
  return view.data();
}

/// The inputs (batch, seqlen, input_size) and targets (batch, seqlen, output_size) of a training
/// or evaluation call, checked as embed_view_data does.
template <class ExecutionSpace, class InputView, class TargetView>
std::pair<ConstTensor3<float, typename ExecutionSpace::memory_space>,
          ConstTensor3<float, typename ExecutionSpace::memory_space>>
embed_training_data(const char* function, const SequenceModelConfig& c, const InputView& inputs,
                    const TargetView& targets) {
  using Data = ConstTensor3<float, typename ExecutionSpace::memory_space>;
  const float* x = embed_view_data<ExecutionSpace>(
      function, "inputs", inputs, Shape{Shape::any, Shape::any, c.input_size}, "(batch, seqlen, input_size)");
  const std::int64_t b = static_cast<std::int64_t>(inputs.extent(0)), l = static_cast<std::int64_t>(inputs.extent(1));
  const float* t = embed_view_data<ExecutionSpace>(function, "targets", targets, Shape{b, l, c.output_size},
                                                   "(batch, seqlen, output_size) with batch, seqlen of inputs");
  return {Data(x, b, l, c.input_size), Data(t, b, l, c.output_size)};
}

}  // namespace impl

template <class ExecutionSpace>
class Session;

/// A SequenceModel with its optimizer, for applications.
template <class ExecutionSpace>
class Model {
 public:
  using execution_space = ExecutionSpace;
  using memory_space = typename ExecutionSpace::memory_space;

  /// A new model, initialised deterministically from `seed` (every rank of a data-parallel run
  /// must pass the same seed, or enable_data_parallel copies rank 0's parameters).
  Model(const SequenceModelConfig& config, std::uint64_t seed, const TrainOptions& options = TrainOptions());
  /// The model saved in `dir` (SequenceModel::save's layout) and fresh optimizer state.
  static Model load(const std::string& dir, const TrainOptions& options = TrainOptions());
  ~Model();
  Model(Model&&) noexcept;
  Model& operator=(Model&&) noexcept;

  /// Writes `dir`/config.json and `dir`/model.safetensors. Data parallel: collective; rank 0
  /// writes and every rank returns once the files exist.
  void save(const std::string& dir) const;

#if KMAMBA_ENABLE_MPI
  /// Trains data parallel over the ranks of `comm` (duplicated; the application keeps it) from now
  /// on: rank 0's parameters are broadcast, each rank's train_step batch is its shard of the
  /// global batch, gradients are averaged over all ranks' values and AdamW (moments sharded with
  /// zero_stage 1) keeps the parameters identical on every rank. Device memory travels through
  /// NCCL (one GPU per rank; CUDA builds with NCCL), host memory through MPI. Collective over `comm`.
  void enable_data_parallel(MPI_Comm comm);
  /// This rank and the number of ranks (0 and 1 without data parallelism).
  int data_rank() const;
  int data_size() const;
#else
  int data_rank() const { return 0; }
  int data_size() const { return 1; }
#endif

  /// outputs = model(inputs), on `exec` and non-blocking: fence `exec` (or order later work on
  /// it) before reading outputs. (A call with a new batch shape first reallocates the model's
  /// buffers, which may wait for the device.) Forward, train_step and evaluate share the model's activation
  /// buffers, so calls on different instances must not overlap.
  template <class InputView, class OutputView>
  void forward(const ExecutionSpace& exec,
               const InputView& inputs,     // (batch, seqlen, input_size)
               const OutputView& outputs);  // (batch, seqlen, output_size)

  /// One optimizer step on this rank's batch: forward, mean squared error against `targets`,
  /// backward, (data parallel: gradient all-reduce,) clipping and AdamW. Blocking. A non-finite
  /// loss or gradient is a UserError thrown before the parameters change.
  template <class InputView, class TargetView>
  TrainStepResult train_step(const ExecutionSpace& exec,
                             const InputView& inputs,     // (batch, seqlen, input_size)
                             const TargetView& targets);  // (batch, seqlen, output_size)

  /// The mean squared error of the model on this rank's batch. Blocking.
  template <class InputView, class TargetView>
  double evaluate(const ExecutionSpace& exec,
                  const InputView& inputs,     // (batch, seqlen, input_size)
                  const TargetView& targets);  // (batch, seqlen, output_size)

  /// A stepping session of `streams` streams with zero state. It refers to this model, which must
  /// outlive it (moving the Model is fine).
  Session<ExecutionSpace> session(int streams) const;

  const SequenceModelConfig& config() const { return model_->config(); }
  std::int64_t steps_taken() const { return steps_; }
  const TrainOptions& options() const { return options_; }
  SequenceModel<ExecutionSpace>& sequence_model() { return *model_; }
  const SequenceModel<ExecutionSpace>& sequence_model() const { return *model_; }

 private:
  explicit Model(std::unique_ptr<SequenceModel<ExecutionSpace>> model, const TrainOptions& options);
  TrainStepResult train_on(const ExecutionSpace& exec, const ConstTensor3<float, memory_space>& inputs,
                           const ConstTensor3<float, memory_space>& targets);
  double evaluate_on(const ExecutionSpace& exec, const ConstTensor3<float, memory_space>& inputs,
                     const ConstTensor3<float, memory_space>& targets);

  std::unique_ptr<SequenceModel<ExecutionSpace>> model_;
  TrainOptions options_;
  std::unique_ptr<AdamW<memory_space>> optimizer_;
  std::int64_t steps_ = 0;
#if KMAMBA_ENABLE_MPI
  std::unique_ptr<ProcessMesh> mesh_;
  std::unique_ptr<DataParallel<ExecutionSpace>> data_parallel_;
#endif
};

/// The recurrent state of a batch of streams under one Model, advanced one time step at a time
/// (in-situ prediction) or a segment at a time. Sessions are independent of each other and of
/// the model's forward and training buffers. Move-only.
template <class ExecutionSpace>
class Session {
 public:
  using memory_space = typename ExecutionSpace::memory_space;

  /// The number of streams.
  int streams() const { return state_.batch(); }
  /// Time steps fed since creation or the last reset.
  std::int64_t position() const { return state_.position(); }
  /// Every stream starts afresh. Non-blocking on `exec`.
  void reset(const ExecutionSpace& exec) { state_.reset(exec); }

  /// outputs(s, :) follows inputs(s, :) and stream s's history. Non-blocking on `exec`; allocates
  /// nothing.
  template <class InputView, class OutputView>
  void step(const ExecutionSpace& exec,
            const InputView& inputs,      // (streams, input_size)
            const OutputView& outputs) {  // (streams, output_size)
    constexpr const char* function = "kmamba::Session::step";
    const SequenceModelConfig& c = model_->config();
    const std::int64_t s = streams();
    const float* x = impl::embed_view_data<ExecutionSpace>(function, "inputs", inputs, Shape{s, c.input_size},
                                                           "(streams, input_size)");
    float* y = impl::embed_view_data<ExecutionSpace>(function, "outputs", outputs, Shape{s, c.output_size},
                                                     "(streams, output_size)");
    model_->step(exec, ConstTensor2<float, memory_space>(x, s, c.input_size), state_,
                 Tensor2<float, memory_space>(y, s, c.output_size));
  }

  /// Feeds a segment of seqlen time steps per stream (the chunked forward), e.g. the history
  /// before stepping; `outputs` receives every step's output. Equals seqlen calls of step.
  template <class InputView, class OutputView>
  void prefill(const ExecutionSpace& exec,
               const InputView& inputs,      // (streams, seqlen, input_size)
               const OutputView& outputs) {  // (streams, seqlen, output_size)
    constexpr const char* function = "kmamba::Session::prefill";
    const SequenceModelConfig& c = model_->config();
    const std::int64_t s = streams();
    const float* x = impl::embed_view_data<ExecutionSpace>(
        function, "inputs", inputs, Shape{s, Shape::any, c.input_size}, "(streams, seqlen, input_size)");
    const std::int64_t l = static_cast<std::int64_t>(inputs.extent(1));
    float* y = impl::embed_view_data<ExecutionSpace>(function, "outputs", outputs, Shape{s, l, c.output_size},
                                                     "(streams, seqlen, output_size) with seqlen of inputs");
    model_->prefill(exec, ConstTensor3<float, memory_space>(x, s, l, c.input_size), state_,
                    Tensor3<float, memory_space>(y, s, l, c.output_size));
  }

 private:
  friend class Model<ExecutionSpace>;
  Session(const SequenceModel<ExecutionSpace>* model, SequenceState<ExecutionSpace> state)
      : model_(model), state_(std::move(state)) {}
  const SequenceModel<ExecutionSpace>* model_;
  SequenceState<ExecutionSpace> state_;
};

template <class ExecutionSpace>
template <class InputView, class OutputView>
void Model<ExecutionSpace>::forward(const ExecutionSpace& exec, const InputView& inputs, const OutputView& outputs) {
  constexpr const char* function = "kmamba::Model::forward";
  const SequenceModelConfig& c = config();
  const float* x = impl::embed_view_data<ExecutionSpace>(
      function, "inputs", inputs, Shape{Shape::any, Shape::any, c.input_size}, "(batch, seqlen, input_size)");
  const std::int64_t b = static_cast<std::int64_t>(inputs.extent(0)), l = static_cast<std::int64_t>(inputs.extent(1));
  float* y = impl::embed_view_data<ExecutionSpace>(function, "outputs", outputs, Shape{b, l, c.output_size},
                                                   "(batch, seqlen, output_size) with batch, seqlen of inputs");
  model_->forward(exec, ConstTensor3<float, memory_space>(x, b, l, c.input_size),
                  Tensor3<float, memory_space>(y, b, l, c.output_size));
}

template <class ExecutionSpace>
template <class InputView, class TargetView>
TrainStepResult Model<ExecutionSpace>::train_step(const ExecutionSpace& exec, const InputView& inputs,
                                                  const TargetView& targets) {
  const auto data = impl::embed_training_data<ExecutionSpace>("kmamba::Model::train_step", config(), inputs, targets);
  return train_on(exec, data.first, data.second);
}

template <class ExecutionSpace>
template <class InputView, class TargetView>
double Model<ExecutionSpace>::evaluate(const ExecutionSpace& exec, const InputView& inputs, const TargetView& targets) {
  const auto data = impl::embed_training_data<ExecutionSpace>("kmamba::Model::evaluate", config(), inputs, targets);
  return evaluate_on(exec, data.first, data.second);
}

}  // namespace kmamba

#endif
