// The embedding API's Model: construction, checkpoints, the training step (single process or
// data parallel) and evaluation.
#include <kmamba/Embed.hpp>

#include <kmamba/core/Error.hpp>
#include <kmamba/core/ForEachBackend.hpp>

#include <cmath>
#include <utility>

namespace kmamba {

void TrainOptions::validate() const {
  const char* f = "kmamba::TrainOptions";
  KMAMBA_REQUIRE(lr > 0 && std::isfinite(lr), f << ": lr must be positive, got " << lr);
  KMAMBA_REQUIRE(min_lr >= 0 && min_lr <= lr, f << ": min_lr must be in [0, lr], got " << min_lr);
  KMAMBA_REQUIRE(warmup_steps >= 0, f << ": warmup_steps must be >= 0, got " << warmup_steps);
  KMAMBA_REQUIRE(total_steps >= 0, f << ": total_steps must be >= 0, got " << total_steps);
  KMAMBA_REQUIRE(grad_clip >= 0, f << ": grad_clip must be >= 0, got " << grad_clip);
  KMAMBA_REQUIRE(zero_stage == 0 || zero_stage == 1, f << ": zero_stage must be 0 or 1, got " << zero_stage);
  AdamWConfig{lr, beta1, beta2, eps, weight_decay}.validate();
}

double TrainOptions::learning_rate(std::int64_t step) const {
  if (total_steps > 0) return kmamba::learning_rate(step, lr, min_lr, warmup_steps, total_steps);
  if (step < warmup_steps) return lr * static_cast<double>(step + 1) / static_cast<double>(warmup_steps);
  return lr;
}

template <class ExecutionSpace>
Model<ExecutionSpace>::Model(std::unique_ptr<SequenceModel<ExecutionSpace>> model, const TrainOptions& options)
    : model_(std::move(model)), options_(options) {
  options_.validate();
  optimizer_.reset(new AdamW<memory_space>(
      model_->parameters().size(),
      AdamWConfig{options_.lr, options_.beta1, options_.beta2, options_.eps, options_.weight_decay}));
}

template <class ExecutionSpace>
Model<ExecutionSpace>::Model(const SequenceModelConfig& config, std::uint64_t seed, const TrainOptions& options)
    : Model(std::unique_ptr<SequenceModel<ExecutionSpace>>(new SequenceModel<ExecutionSpace>(config)), options) {
  model_->initialize(seed);
}

template <class ExecutionSpace>
Model<ExecutionSpace> Model<ExecutionSpace>::load(const std::string& dir, const TrainOptions& options) {
  return Model(std::unique_ptr<SequenceModel<ExecutionSpace>>(
                   new SequenceModel<ExecutionSpace>(SequenceModel<ExecutionSpace>::load(dir))),
               options);
}

template <class ExecutionSpace>
Model<ExecutionSpace>::~Model() = default;
template <class ExecutionSpace>
Model<ExecutionSpace>::Model(Model&&) noexcept = default;
template <class ExecutionSpace>
Model<ExecutionSpace>& Model<ExecutionSpace>::operator=(Model&&) noexcept = default;

template <class ExecutionSpace>
Session<ExecutionSpace> Model<ExecutionSpace>::session(int streams) const {
  return Session<ExecutionSpace>(model_.get(), model_->make_state(streams));
}

template <class ExecutionSpace>
void Model<ExecutionSpace>::save(const std::string& dir) const {
#if KMAMBA_ENABLE_MPI
  if (mesh_) {
    run_on_rank0(
        mesh_->world(), [&] { model_->save(dir); }, "kmamba::Model::save: rank 0 failed to write '" + dir + "'");
    return;
  }
#endif
  model_->save(dir);
}

#if KMAMBA_ENABLE_MPI
template <class ExecutionSpace>
void Model<ExecutionSpace>::enable_data_parallel(MPI_Comm comm) {
  KMAMBA_REQUIRE(!mesh_, "kmamba::Model::enable_data_parallel: already enabled");
  // Device memory travels through NCCL (one GPU per rank), host memory through MPI.
  std::unique_ptr<ProcessMesh> mesh(new ProcessMesh(comm, MeshConfig(), transport_for<memory_space>()));
  const ExecutionSpace exec;
  mesh->data().broadcast(exec, model_->parameters().params(), 0);
  exec.fence();
  data_parallel_.reset(new DataParallel<ExecutionSpace>(
      *mesh, model_->config().backbone, model_->parameters(),
      AdamWConfig{options_.lr, options_.beta1, options_.beta2, options_.eps, options_.weight_decay},
      DataParallelConfig{options_.zero_stage, 0}));
  mesh_ = std::move(mesh);
}

template <class ExecutionSpace>
int Model<ExecutionSpace>::data_rank() const {
  return data_parallel_ ? data_parallel_->data_rank() : 0;
}

template <class ExecutionSpace>
int Model<ExecutionSpace>::data_size() const {
  return data_parallel_ ? data_parallel_->data_size() : 1;
}
#endif

template <class ExecutionSpace>
TrainStepResult Model<ExecutionSpace>::train_on(
    const ExecutionSpace& exec, const ConstTensor3<float, memory_space>& inputs,  // (batch, seqlen, input_size)
    const ConstTensor3<float, memory_space>& targets) {                           // (batch, seqlen, output_size)
  constexpr const char* function = "kmamba::Model::train_step";
  auto& slab = model_->parameters();
  const std::int64_t local = static_cast<std::int64_t>(targets.span());
  std::int64_t total = local;
#if KMAMBA_ENABLE_MPI
  if (data_parallel_) total = data_parallel_->global_tokens(local);
#endif
  model_->zero_grads(exec);
  const RegressionLoss r =
      model_->loss_and_backward(exec, inputs, targets, static_cast<double>(local) / static_cast<double>(total));
  TrainStepResult result;
  result.loss = r.loss;
#if KMAMBA_ENABLE_MPI
  if (data_parallel_) {
    result.loss = data_parallel_->sum_over_data(r.loss * static_cast<double>(local)) / static_cast<double>(total);
    data_parallel_->reduce_gradients(exec, slab);
    result.grad_norm = data_parallel_->grad_norm(exec, slab);
  } else {
    result.grad_norm = global_norm(exec, ConstTensor1<float, memory_space>(slab.grads()));
  }
#else
  result.grad_norm = global_norm(exec, ConstTensor1<float, memory_space>(slab.grads()));
#endif
  KMAMBA_REQUIRE(std::isfinite(result.loss) && std::isfinite(result.grad_norm),
                 function << ": step " << steps_ + 1 << ": the loss is " << result.loss << " and the gradient norm "
                          << result.grad_norm << "; training diverged (try a lower learning rate or clipping)");
  result.lr = options_.learning_rate(steps_);
  const double scale = clip_scale(result.grad_norm, options_.grad_clip);
#if KMAMBA_ENABLE_MPI
  if (data_parallel_) {
    data_parallel_->step(exec, slab, result.lr, scale);
  } else {
    optimizer_->step(exec, slab.params(), slab.grads(), slab.decay_end(), result.lr, scale);
  }
#else
  optimizer_->step(exec, slab.params(), slab.grads(), slab.decay_end(), result.lr, scale);
#endif
  exec.fence();
  result.step = ++steps_;
  return result;
}

template <class ExecutionSpace>
double Model<ExecutionSpace>::evaluate_on(
    const ExecutionSpace& exec, const ConstTensor3<float, memory_space>& inputs,  // (batch, seqlen, input_size)
    const ConstTensor3<float, memory_space>& targets) {                           // (batch, seqlen, output_size)
  return model_->loss(exec, inputs, targets).loss;
}

#define KMAMBA_INSTANTIATE(Exec) template class Model<Exec>;
KMAMBA_FOR_EACH_BACKEND(KMAMBA_INSTANTIATE)
#undef KMAMBA_INSTANTIATE

}  // namespace kmamba
