#include "TrainerCheckpoint.hpp"

#include <kmamba/KMamba.hpp>
#include <kmamba/core/Error.hpp>
#include <kmamba/core/ForEachBackend.hpp>
#include <kmamba/models/SafeTensors.hpp>
#include <kmamba/models/StagedDirectory.hpp>
#include <kmamba/models/Trainer.hpp>

#include <algorithm>
#include <cmath>
#include <sstream>

namespace kmamba {
namespace {

void check_batch(const char* function, const TokenBatch& b, std::size_t i) {
  KMAMBA_REQUIRE(b.ids.is_allocated() && b.targets.is_allocated(), function << ": batch " << i << " is empty");
  KMAMBA_REQUIRE(b.ids.extent(0) == b.targets.extent(0) && b.ids.extent(1) == b.targets.extent(1),
                 function << ": batch " << i << " has ids (" << b.ids.extent(0) << ", " << b.ids.extent(1)
                          << ") but targets (" << b.targets.extent(0) << ", " << b.targets.extent(1) << ")");
  KMAMBA_REQUIRE(
      !b.seq_idx.is_allocated() || (b.ids.extent(0) == b.seq_idx.extent(0) && b.ids.extent(1) == b.seq_idx.extent(1)),
      function << ": batch " << i << " has ids (" << b.ids.extent(0) << ", " << b.ids.extent(1) << ") but seq_idx ("
               << b.seq_idx.extent(0) << ", " << b.seq_idx.extent(1) << ")");
}

// to's row `at` ← from's row `row`: ids, targets and, when `to` has them, sequence ids.
void copy_row(const TokenBatch& from, std::int64_t row, const TokenBatch& to, std::int64_t at) {
  for (std::size_t t = 0; t < to.ids.extent(1); ++t) {
    to.ids(at, t) = from.ids(row, t);
    to.targets(at, t) = from.targets(row, t);
    if (to.seq_idx.is_allocated()) to.seq_idx(at, t) = from.seq_idx(row, t);
  }
}

using HostFloats = Kokkos::View<float*, Kokkos::HostSpace, Kokkos::MemoryTraits<Kokkos::Unmanaged>>;

template <class MemorySpace>
std::vector<float> host_floats(const Tensor1<float, MemorySpace>& values) {
  std::vector<float> out(values.extent(0));
  Kokkos::deep_copy(HostFloats(out.data(), out.size()), values);
  return out;
}

}  // namespace

// ---------------------------------------------------------------------------------------------
// TrainConfig

void TrainConfig::validate() const {
  const char* f = "kmamba::TrainConfig";
  KMAMBA_REQUIRE(std::isfinite(lr) && lr >= 0.0, f << ": lr must be a finite number >= 0, got " << lr);
  KMAMBA_REQUIRE(std::isfinite(min_lr) && min_lr >= 0.0 && min_lr <= lr,
                 f << ": min_lr must lie in [0, lr = " << lr << "], got " << min_lr);
  KMAMBA_REQUIRE(warmup_steps >= 0, f << ": warmup_steps must be >= 0, got " << warmup_steps);
  KMAMBA_REQUIRE(total_steps >= 1, f << ": total_steps must be >= 1, got " << total_steps);
  KMAMBA_REQUIRE(std::isfinite(weight_decay) && weight_decay >= 0.0,
                 f << ": weight_decay must be >= 0, got " << weight_decay);
  KMAMBA_REQUIRE(beta1 >= 0.0 && beta1 < 1.0, f << ": beta1 must lie in [0, 1), got " << beta1);
  KMAMBA_REQUIRE(beta2 >= 0.0 && beta2 < 1.0, f << ": beta2 must lie in [0, 1), got " << beta2);
  KMAMBA_REQUIRE(std::isfinite(eps) && eps > 0.0, f << ": eps must be positive, got " << eps);
  KMAMBA_REQUIRE(std::isfinite(grad_clip) && grad_clip >= 0.0,
                 f << ": grad_clip must be >= 0 (0: off), got " << grad_clip);
  KMAMBA_REQUIRE(batch_size >= 1, f << ": batch_size must be >= 1, got " << batch_size);
  KMAMBA_REQUIRE(grad_accum >= 1, f << ": grad_accum must be >= 1, got " << grad_accum);
  KMAMBA_REQUIRE(eval_interval >= 0, f << ": eval_interval must be >= 0 (0: never), got " << eval_interval);
  KMAMBA_REQUIRE(eval_batches >= 1, f << ": eval_batches must be >= 1, got " << eval_batches);
  KMAMBA_REQUIRE(checkpoint_interval >= 0,
                 f << ": checkpoint_interval must be >= 0 (0: at the end only), got " << checkpoint_interval);
  KMAMBA_REQUIRE(
      max_skipped_steps >= 0,
      f << ": max_skipped_steps must be >= 0 (0: stop at the first non-finite step), got " << max_skipped_steps);
}

AdamWConfig TrainConfig::adamw() const { return AdamWConfig{lr, beta1, beta2, eps, weight_decay}; }

// ---------------------------------------------------------------------------------------------
// Trainer

namespace {
const TrainConfig& validated(const TrainConfig& c) {
  c.validate();
  return c;
}
}  // namespace

template <class ExecutionSpace>
Trainer<ExecutionSpace>::Trainer(LanguageModel<ExecutionSpace> model, const TrainConfig& config,
                                 std::shared_ptr<const Dataset> data, const ExecutionSpace& exec)
    : exec_(exec),
      model_(std::move(model)),
      config_(validated(config)),
      data_(std::move(data)),
      optimizer_(model_.parameters().size(), config_.adamw()) {
  if (data_) {
    KMAMBA_REQUIRE(data_->vocab_size() <= model_.config().vocab_size, "kmamba::Trainer: the data's vocabulary ("
                                                                          << data_->vocab_size()
                                                                          << " tokens) exceeds the model's vocab_size "
                                                                          << model_.config().vocab_size);
    KMAMBA_REQUIRE(config_.eval_interval == 0 || data_->has_validation(),
                   "kmamba::Trainer: eval_interval is "
                       << config_.eval_interval
                       << " but the data set has no held-out split (validation fraction 0): set "
                          "eval_interval to 0, or a validation fraction above 0");
  }
}

template <class ExecutionSpace>
const Dataset& Trainer<ExecutionSpace>::dataset(const char* function) const {
  KMAMBA_REQUIRE(data_ != nullptr, function << ": this trainer has no data set; pass batches explicitly");
  return *data_;
}

template <class ExecutionSpace>
int Trainer<ExecutionSpace>::data_rank() const {
#if KMAMBA_ENABLE_MPI
  if (data_parallel_) return data_parallel_->data_rank();
#endif
  return 0;
}

template <class ExecutionSpace>
int Trainer<ExecutionSpace>::data_size() const {
#if KMAMBA_ENABLE_MPI
  if (data_parallel_) return data_parallel_->data_size();
#endif
  return 1;
}

template <class ExecutionSpace>
template <class T>
T Trainer<ExecutionSpace>::sum_over_data(T local) const {
#if KMAMBA_ENABLE_MPI
  if (data_parallel_) return data_parallel_->sum_over_data(local);
#endif
  return local;
}

template <class ExecutionSpace>
std::int64_t Trainer<ExecutionSpace>::step_tokens(std::int64_t local) const {
#if KMAMBA_ENABLE_MPI
  // Local steps weigh each replica's micro-batches by its own tokens: its gradient is its mean.
  if (data_parallel_ && data_parallel_->local_steps()) return data_parallel_->replica_tokens(local);
#endif
  return sum_over_data(local);
}

template <class ExecutionSpace>
bool Trainer<ExecutionSpace>::replicas_identical() const {
#if KMAMBA_ENABLE_MPI
  if (data_parallel_) return data_parallel_->replicas_identical();
#endif
  return true;
}

template <class ExecutionSpace>
double Trainer<ExecutionSpace>::reduce_and_norm() {
  const auto& slab = model_.parameters();
#if KMAMBA_ENABLE_MPI
  if (data_parallel_) {
    data_parallel_->reduce_gradients(exec_, slab);
    return data_parallel_->grad_norm(exec_, slab);
  }
#endif
  return global_norm(exec_, ConstTensor1<float, memory_space>(slab.grads()));
}

template <class ExecutionSpace>
std::string Trainer<ExecutionSpace>::non_finite_report(double loss, double grad_norm) const {
  const auto& slab = model_.parameters();
  const auto params = Kokkos::create_mirror_view_and_copy(Kokkos::HostSpace(), slab.params());
  const auto grads = Kokkos::create_mirror_view_and_copy(Kokkos::HostSpace(), slab.grads());
  std::ostringstream s;
  s << "the loss is " << loss << " and the gradient norm " << grad_norm;
  // Non-finite parameters are the likely cause; non-finite gradients show where it spread.
  for (const bool of_params : {true, false}) {
    const auto& values = of_params ? params : grads;
    std::ostringstream names;
    int listed = 0, more = 0;
    for (const auto& e : slab.entries()) {
      std::size_t bad = 0;
      for (std::size_t i = e.offset; i < e.offset + e.size; ++i) bad += std::isfinite(values(i)) ? 0 : 1;
      if (bad == 0) continue;
      if (listed < 4) {
        names << (listed ? ", " : "") << e.name << " (" << bad << " of " << e.size << " values)";
        ++listed;
      } else {
        ++more;
      }
    }
    if (listed == 0) continue;
    s << "; non-finite " << (of_params ? "parameters" : "gradients") << " in " << names.str();
    if (more > 0) s << " and " << more << " more";
  }
  return s.str();
}

template <class ExecutionSpace>
void Trainer<ExecutionSpace>::optimizer_step(double lr, double grad_scale) {
  const auto& slab = model_.parameters();
#if KMAMBA_ENABLE_MPI
  if (data_parallel_) {
    data_parallel_->step(exec_, slab, lr, grad_scale);
    optimizer_.set_steps_taken(data_parallel_->steps_taken());
    return;
  }
#endif
  optimizer_.step(exec_, slab.params(), ConstTensor1<float, memory_space>(slab.grads()), slab.decay_end(), lr,
                  grad_scale);
}

#if KMAMBA_ENABLE_MPI
template <class ExecutionSpace>
void Trainer<ExecutionSpace>::enable_data_parallel(const ProcessMesh& mesh, const DataParallelConfig& options) {
  const PipelineParallel& stages = model_.pipeline();
  KMAMBA_REQUIRE(stages.stages() == mesh.config().pipeline_parallel_size,
                 "kmamba::Trainer::enable_data_parallel: the model is split into "
                     << stages.stages() << " pipeline stage(s), the mesh has pipeline_parallel_size "
                     << mesh.config().pipeline_parallel_size << "; make the model with the mesh's pipeline axis");
  DataParallelConfig placed = options;
  placed.optimizer_placement = optimizer_.placement();
  auto data_parallel = std::make_unique<DataParallel<ExecutionSpace>>(
      mesh, model_.config(), model_.parameters(), config_.adamw(), placed, model_.sharded_parameters());
  data_parallel->load_moments(exec_, optimizer_, optimizer_.steps_taken());
  data_parallel->attach(model_);  // the last micro-batch's gradients are reduced as its backward runs
  exec_.fence();
  data_parallel_ = std::move(data_parallel);
  optimizer_ = empty_optimizer(optimizer_.steps_taken());  // the data-parallel moments replace these
  if (stages.pipeline != nullptr) pipeline_ = std::make_unique<Pipeline<ExecutionSpace>>(model_);
}
#endif

template <class ExecutionSpace>
AdamW<typename ExecutionSpace::memory_space> Trainer<ExecutionSpace>::empty_optimizer(std::int64_t steps) const {
  AdamW<memory_space> none(0, config_.adamw(), optimizer_.placement());
  none.set_steps_taken(steps);
  return none;
}

template <class ExecutionSpace>
void Trainer<ExecutionSpace>::set_optimizer_placement(OptimizerPlacement placement) {
#if KMAMBA_ENABLE_MPI
  KMAMBA_REQUIRE(!data_parallel_,
                 "kmamba::Trainer::set_optimizer_placement: the optimizer is data parallel already; "
                 "set its placement before enable_data_parallel");
#endif
  if (placement == optimizer_.placement()) return;
  AdamW<memory_space> moved(optimizer_.size(), config_.adamw(), placement);
  moved.load_moments(exec_, 0, optimizer_, 0, optimizer_.size());
  moved.set_steps_taken(optimizer_.steps_taken());
  exec_.fence();
  optimizer_ = std::move(moved);
}

template <class ExecutionSpace>
std::size_t Trainer<ExecutionSpace>::optimizer_device_bytes() const {
  std::size_t bytes = optimizer_.device_bytes();
#if KMAMBA_ENABLE_MPI
  if (data_parallel_) bytes += data_parallel_->optimizer().device_bytes();
#endif
  return bytes;
}

template <class ExecutionSpace>
void Trainer<ExecutionSpace>::set_load_balancing(const LoadBalancing& balancing) {
  balancing.validate();
  balancing_ = balancing;
}

template <class ExecutionSpace>
TokenBatch Trainer<ExecutionSpace>::sequence_segment_of(const TokenBatch& b) const {
  const ModelParallel& parallel = model_.parallel();
  const auto rows = static_cast<std::int64_t>(b.ids.extent(0));
  const int rank = parallel.sequence_rank(), size = parallel.sequence_size();
  // Every sp rank holds the same rows, so each computes the same boundaries.
  const SequenceSegment segment =
      balancing_.sequence_split == SequenceSplit::Balanced
          ? balanced_sequence_segments(real_tokens_per_position(b), size)[static_cast<std::size_t>(rank)]
          : sequence_segment(static_cast<std::int64_t>(b.ids.extent(1)), rank, size);
  TokenBatch out;
  out.ids = Tensor2<std::int64_t, Kokkos::HostSpace>("kmamba::trainer::segment_ids", rows, segment.length);
  out.targets = Tensor2<std::int64_t, Kokkos::HostSpace>("kmamba::trainer::segment_targets", rows, segment.length);
  if (b.seq_idx.is_allocated()) {
    out.seq_idx = Tensor2<std::int64_t, Kokkos::HostSpace>("kmamba::trainer::segment_seq_idx", rows, segment.length);
  }
  for (std::int64_t r = 0; r < rows; ++r) {
    for (std::int64_t t = 0; t < segment.length; ++t) {
      out.ids(r, t) = b.ids(r, segment.begin + t);
      out.targets(r, t) = b.targets(r, segment.begin + t);
      if (b.seq_idx.is_allocated()) out.seq_idx(r, t) = b.seq_idx(r, segment.begin + t);
    }
  }
  return out;
}

template <class ExecutionSpace>
PipelineMicroBatch<typename ExecutionSpace::memory_space> Trainer<ExecutionSpace>::to_device(
    const TokenBatch& b) const {
  PipelineMicroBatch<memory_space> d;
  d.ids = Kokkos::create_mirror_view_and_copy(memory_space(), b.ids);
  d.targets = Kokkos::create_mirror_view_and_copy(memory_space(), b.targets);
  if (b.seq_idx.is_allocated()) d.seq_idx = Kokkos::create_mirror_view_and_copy(memory_space(), b.seq_idx);
  return d;
}

template <class ExecutionSpace>
std::pair<ConstTensor2<std::int64_t, typename ExecutionSpace::memory_space>,
          ConstTensor2<std::int64_t, typename ExecutionSpace::memory_space>>
Trainer<ExecutionSpace>::upload(const TokenBatch& b) {
  const PipelineMicroBatch<memory_space> d = to_device(b);
  model_.set_sequence_ids(d.seq_idx);
  return {d.ids, d.targets};
}

template <class ExecutionSpace>
RowAssignment Trainer<ExecutionSpace>::assign_rows(const std::vector<TokenBatch>& own) const {
  std::vector<std::int64_t> mine;
  for (const TokenBatch& b : own) {
    const std::vector<std::int64_t> rows = real_tokens_per_row(b);
    mine.insert(mine.end(), rows.begin(), rows.end());
  }
  std::vector<std::int64_t> all = mine;
#if KMAMBA_ENABLE_MPI
  if (data_parallel_) {
    using HostCounts = Kokkos::View<std::int64_t*, Kokkos::HostSpace, Kokkos::MemoryTraits<Kokkos::Unmanaged>>;
    all.resize(mine.size() * static_cast<std::size_t>(data_size()));
    data_parallel_->mesh().data().all_gather(Kokkos::DefaultHostExecutionSpace(), HostCounts(mine.data(), mine.size()),
                                             HostCounts(all.data(), all.size()));
  }
#endif
  return balance_rows(all, data_size(), balancing_.data_redistribution_threshold);
}

template <class ExecutionSpace>
std::vector<TokenBatch> Trainer<ExecutionSpace>::micro_batches_of(const Dataset& data,
                                                                  const std::vector<TokenBatch>& own,
                                                                  const std::vector<std::int64_t>& rows) const {
  using HostTokens = Tensor2<std::int64_t, Kokkos::HostSpace>;
  const std::int64_t batch = config_.batch_size, own_begin = data_rank() * config_.grad_accum * batch;
  const std::int64_t own_end = own_begin + config_.grad_accum * batch, seqlen = data.seqlen();
  const bool packed = own.front().seq_idx.is_allocated();
  std::vector<TokenBatch> out;
  for (std::size_t first = 0; first < rows.size(); first += static_cast<std::size_t>(batch)) {
    const auto count = static_cast<std::int64_t>(std::min(rows.size() - first, static_cast<std::size_t>(batch)));
    TokenBatch b;
    b.ids = HostTokens("kmamba::trainer::balanced_ids", count, seqlen);
    b.targets = HostTokens("kmamba::trainer::balanced_targets", count, seqlen);
    if (packed) b.seq_idx = HostTokens("kmamba::trainer::balanced_seq_idx", count, seqlen);
    for (std::int64_t i = 0; i < count; ++i) {
      const std::int64_t row = rows[first + static_cast<std::size_t>(i)];
      if (row >= own_begin && row < own_end) {
        copy_row(own[static_cast<std::size_t>((row - own_begin) / batch)], (row - own_begin) % batch, b, i);
      } else {  // the global batch's row `row` is training sequence data_position·batch + row
        copy_row(data.batch(Split::Train, data_position_ * batch + row, 1), 0, b, i);
      }
    }
    out.push_back(std::move(b));
  }
  return out;
}

template <class ExecutionSpace>
StepResult Trainer<ExecutionSpace>::step() {
  const Dataset& data = dataset("kmamba::Trainer::step");
  std::vector<TokenBatch> micro_batches;
  const std::int64_t first = data_position_ + data_rank() * config_.grad_accum;
  for (std::int64_t i = 0; i < config_.grad_accum; ++i) {
    micro_batches.push_back(data.batch(Split::Train, first + i, config_.batch_size));
  }
  RowAssignment assignment;
  if (balancing_.dynamic_task_allocation) {
    assignment = assign_rows(micro_batches);
    if (assignment.moved) {
      micro_batches = micro_batches_of(data, micro_batches, assignment.rows[static_cast<std::size_t>(data_rank())]);
    }
  }
  StepResult result = step(micro_batches);
  result.rank_tokens = std::move(assignment.tokens);
  result.fixed_share_tokens = std::move(assignment.fixed_share_tokens);
  result.rows_moved = assignment.moved;
  data_position_ += config_.grad_accum * data_size();
  return result;
}

template <class ExecutionSpace>
StepResult Trainer<ExecutionSpace>::step(const std::vector<TokenBatch>& micro_batches) {
  const char* function = "kmamba::Trainer::step";
  KMAMBA_REQUIRE(!micro_batches.empty(), function << ": no micro-batches");
  StepResult result;
  std::int64_t local_total = 0;
  const bool split_sequence = model_.parallel().sequence_size() > 1;
  std::vector<TokenBatch> segments;  // this rank's segment of each micro-batch (sequence parallel)
  for (std::size_t i = 0; i < micro_batches.size(); ++i) {
    check_batch(function, micro_batches[i], i);
    if (split_sequence) segments.push_back(sequence_segment_of(micro_batches[i]));
    const TokenBatch& mine = split_sequence ? segments.back() : micro_batches[i];
    local_total += mine.predicted_tokens();
    result.input_tokens += static_cast<std::int64_t>(mine.ids.extent(0) * mine.ids.extent(1));
  }
  const std::int64_t total = step_tokens(local_total);
  KMAMBA_REQUIRE(total > 0, function << ": the micro-batches hold no predicted tokens (every target is ignore_index)");

  model_.zero_grads(exec_);
  const LossResult sums = accumulate(split_sequence ? segments : micro_batches, total);
  const double loss_sum = sums.loss;
  result.tokens = sums.tokens;
  result.correct = sums.correct;
  // The gradients are reduced before any other collective: a rank whose micro-batches hold no real
  // tokens ran no backward and reduces every bucket here, while the others reduced theirs during
  // their backward, so their collectives line up only if none comes in between.
  result.grad_norm = reduce_and_norm();
  result.tokens = sum_over_data(result.tokens);
  result.correct = sum_over_data(result.correct);
  result.input_tokens = sum_over_data(result.input_tokens);
  result.loss = sum_over_data(loss_sum) / static_cast<double>(result.tokens);
  result.lr = learning_rate(steps_taken(), config_.lr, config_.min_lr, config_.warmup_steps, config_.total_steps);
  if (!std::isfinite(result.loss) || !std::isfinite(result.grad_norm)) {
    result.non_finite = non_finite_report(result.loss, result.grad_norm);
    KMAMBA_REQUIRE(consecutive_skips_ < config_.max_skipped_steps,
                   function << ": step " << steps_taken() + 1 << ": " << result.non_finite << "; "
                            << (config_.max_skipped_steps == 0 ? std::string("max_skipped_steps is 0")
                                                               : std::to_string(consecutive_skips_ + 1) +
                                                                     " non-finite steps in a row, more than "
                                                                     "max_skipped_steps = " +
                                                                     std::to_string(config_.max_skipped_steps))
                            << ": training diverged (try a lower learning rate or gradient clipping)");
    ++consecutive_skips_;
    ++skipped_steps_;
    result.skipped = true;
    result.step = steps_taken();
    return result;
  }
  consecutive_skips_ = 0;
  optimizer_step(result.lr, clip_scale(result.grad_norm, config_.grad_clip));
  exec_.fence();
  result.step = steps_taken();
  return result;
}

template <class ExecutionSpace>
LossResult Trainer<ExecutionSpace>::accumulate(const std::vector<TokenBatch>& runs, std::int64_t total) {
  const bool split_sequence = model_.parallel().sequence_size() > 1;
  const auto weight = [&](const TokenBatch& b) {
    return static_cast<double>(b.predicted_tokens()) / static_cast<double>(total);
  };
  LossResult sums;
#if KMAMBA_ENABLE_MPI
  if (pipeline_) {  // every stage runs every micro-batch, in the 1F1B order
    std::vector<PipelineMicroBatch<memory_space>> batches;
    for (const TokenBatch& b : runs) {
      batches.push_back(to_device(b));
      batches.back().weight = weight(b);
    }
    sums = pipeline_->loss_and_backward(exec_, batches);
    sums.loss *= static_cast<double>(sums.tokens);
    return sums;
  }
  std::size_t last = runs.size();  // the last micro-batch that runs: its backward reduces the gradients
  for (std::size_t i = 0; i < runs.size(); ++i) {
    if (split_sequence || runs[i].predicted_tokens() > 0) last = i;
  }
#endif
  for (std::size_t i = 0; i < runs.size(); ++i) {
    const TokenBatch& b = runs[i];
    const std::int64_t tokens = b.predicted_tokens();
    if (tokens == 0 && !split_sequence) continue;  // the segments of a sequence run together
#if KMAMBA_ENABLE_MPI
    if (data_parallel_ && i == last) data_parallel_->begin_reduction(model_.parameters());
#endif
    const auto [ids, targets] = upload(b);
    const LossResult r = model_.loss_and_backward(exec_, ids, targets, weight(b));
    KMAMBA_ASSERT(r.tokens == tokens,
                  "the model predicted " << r.tokens << " tokens of a batch with " << tokens << " targets");
    sums.loss += r.loss * static_cast<double>(r.tokens);
    sums.tokens += r.tokens;
    sums.correct += r.correct;
  }
  model_.set_sequence_ids({});  // the model's later calls (generation, saving) see whole rows
  return sums;
}

template <class ExecutionSpace>
LossResult Trainer<ExecutionSpace>::held_out_loss(const TokenBatch& b) {
#if KMAMBA_ENABLE_MPI
  if (pipeline_) return pipeline_->loss(exec_, to_device(b));
#endif
  const auto [ids, targets] = upload(b);
  return model_.loss(exec_, ids, targets);
}

template <class ExecutionSpace>
LossResult Trainer<ExecutionSpace>::evaluate() {
  const Dataset& data = dataset("kmamba::Trainer::evaluate");
  // A loss over training batches is no held-out loss: without a held-out split there is none.
  KMAMBA_REQUIRE(data.has_validation(),
                 "kmamba::Trainer::evaluate: the data set has no held-out split "
                 "(validation fraction 0), so there is no held-out loss to compute");
  std::vector<TokenBatch> batches;
  for (std::int64_t i = 0; i < config_.eval_batches; ++i) {
    batches.push_back(data.batch(Split::Validation, i, config_.batch_size));
  }
  return evaluate(batches);
}

template <class ExecutionSpace>
LossResult Trainer<ExecutionSpace>::evaluate(const std::vector<TokenBatch>& batches) {
  const char* function = "kmamba::Trainer::evaluate";
  KMAMBA_REQUIRE(!batches.empty(), function << ": no batches");
  LossResult total;
  double loss_sum = 0.0;
  const Communicator* const sequence = model_.parallel().sequence_size() > 1 ? model_.parallel().sequence : nullptr;
  for (std::size_t i = 0; i < batches.size(); ++i) {
    check_batch(function, batches[i], i);
    const TokenBatch b = sequence != nullptr ? sequence_segment_of(batches[i]) : batches[i];
    if (b.predicted_tokens() == 0 && sequence == nullptr) continue;
    const LossResult r = held_out_loss(b);
    if (r.tokens > 0) loss_sum += r.loss * static_cast<double>(r.tokens);
    total.tokens += r.tokens;
    total.correct += r.correct;
  }
  model_.set_sequence_ids({});
  if (sequence != nullptr) {  // the segments' sums make the sequences'
    loss_sum = sequence->all_reduce_value(loss_sum);
    total.tokens = sequence->all_reduce_value(total.tokens);
    total.correct = sequence->all_reduce_value(total.correct);
  }
  KMAMBA_REQUIRE(total.tokens > 0, function << ": the batches hold no predicted tokens");
  total.loss = loss_sum / static_cast<double>(total.tokens);
  return total;
}

template <class ExecutionSpace>
void Trainer<ExecutionSpace>::save_checkpoint(const std::string& dir) const {
  // A checkpoint holds one model and one set of moments: the replicas must be one state.
  KMAMBA_REQUIRE(replicas_identical(), "kmamba::Trainer::save_checkpoint: at step "
                                           << steps_taken()
                                           << " the data-parallel replicas differ (local steps since the last "
                                              "averaging, gradient_sync_frequency); save after a step whose count "
                                              "is a multiple of the frequency");
#if KMAMBA_ENABLE_MPI
  if (data_parallel_) {
    // Gathered in device memory (and over tp in gather_values) before world rank 0 writes them.
    const std::size_t n = model_.parameters().size();
    Tensor1<float, memory_space> m_slab("kmamba::trainer::exp_avg", n), v_slab("kmamba::trainer::exp_avg_sq", n);
    data_parallel_->gather_moments(exec_, m_slab, v_slab);
    exec_.fence();
    // A tensor-parallel or pipelined model is written unsplit: parameters and moments gathered
    // over tp and pp.
    std::unique_ptr<LanguageModel<ExecutionSpace>> full;
    if (model_.parallel().tensor_size() > 1 || model_.pipeline().stages() > 1) {
      full = std::make_unique<LanguageModel<ExecutionSpace>>(model_.config());
      gather_parameters(exec_, model_, *full);
      const std::size_t n = full->parameters().size();
      Tensor1<float, memory_space> m_full("kmamba::trainer::exp_avg_unsplit", n);
      Tensor1<float, memory_space> v_full("kmamba::trainer::exp_avg_sq_unsplit", n);
      gather_values(exec_, model_, ConstTensor1<float, memory_space>(m_slab), *full, m_full);
      gather_values(exec_, model_, ConstTensor1<float, memory_space>(v_slab), *full, v_full);
      m_slab = m_full;
      v_slab = v_full;
    }
    // World rank 0 writes; the files exist on every rank's return.
    run_on_rank0(
        data_parallel_->mesh().world(),
        [&] { write_checkpoint(dir, full ? *full : model_, host_floats(m_slab), host_floats(v_slab)); },
        "kmamba::Trainer::save_checkpoint: world rank 0 failed to write '" + dir + "'");
    return;
  }
#endif
  // Straight from where the moments live: an offloaded optimizer's never pass through the device.
  const std::size_t n = optimizer_.size();
  std::vector<float> m(n), v(n);
  optimizer_.store_moments(exec_, 0, HostFloats(m.data(), n), HostFloats(v.data(), n));
  exec_.fence();
  write_checkpoint(dir, model_, m, v);
}

template <class ExecutionSpace>
void Trainer<ExecutionSpace>::write_checkpoint(const std::string& dir, const LanguageModel<ExecutionSpace>& model,
                                               const std::vector<float>& m, const std::vector<float>& v) const {
  StagedDirectory staged(dir);
  model.save(staged.path());
  const auto& slab = model.parameters();
  impl::TrainingState state;
  state.steps = steps_taken();
  state.data_position = data_position_;
  state.skipped_steps = skipped_steps_;
  state.config = config_;
  state.dataset = data_ ? data_->fingerprint() : impl::no_dataset;
  state.parameter_checksum = impl::parameter_checksum(slab.params());
  impl::write_training_state(staged.path() + "/" + impl::training_state_file, impl::moment_tensors(slab), m.data(),
                             v.data(), state);
  tokenizer_files_.write(staged.path());
  staged.commit();
}

template <class ExecutionSpace>
void Trainer<ExecutionSpace>::resume(const std::string& dir) {
  StagedDirectory::recover(dir);
  const SafeTensorsReader file = impl::open_training_state(dir);
  LanguageModel<ExecutionSpace> loaded = LanguageModel<ExecutionSpace>::load(dir);
  impl::check_checkpoint_matches(file, dir, loaded.config().to_hf_json(), model_.config().to_hf_json(),
                                 impl::parameter_checksum(loaded.parameters().params()), data_.get());
  const auto& slab = loaded.parameters();
  std::vector<float> m(slab.size()), v(slab.size());
  const impl::TrainingState state = impl::read_training_state(file, impl::moment_tensors(slab), m, v);
  const TrainConfig& saved = state.config;
  const std::int64_t sequences = state.data_position * saved.batch_size;
  KMAMBA_REQUIRE(sequences % config_.batch_size == 0,
                 "kmamba::Trainer::resume: '" << dir << "' consumed " << sequences
                                              << " training sequences in batches of " << saved.batch_size
                                              << "; batch_size " << config_.batch_size
                                              << " does not divide that (resume with a batch size that does)");
  TokenizerFiles tokenizer = tokenizer_files_.empty() ? TokenizerFiles::from_directory(dir) : tokenizer_files_;

  using ConstHostFloats = Kokkos::View<const float*, Kokkos::HostSpace, Kokkos::MemoryTraits<Kokkos::Unmanaged>>;
  const ModelParallel parallel = model_.parallel();
  const PipelineParallel stages = model_.pipeline();
  const bool checkpointing = model_.activation_checkpointing();
  const MatmulPrecision precision = model_.matmul_precision();  // runtime options, not in the checkpoint
  // The moments of this rank's (local) slab, where this trainer keeps them.
  AdamW<memory_space> moments(model_.parameters().size(), config_.adamw(), optimizer_placement());
  if (parallel.tensor_size() > 1 || parallel.sequence_size() > 1 || stages.stages() > 1) {
    // A split model takes its part of the unsplit checkpoint.
    LanguageModel<ExecutionSpace> local(loaded.config(), parallel, stages);
    scatter_parameters(exec_, loaded, local);
    Tensor1<float, memory_space> m_full("kmamba::trainer::exp_avg_unsplit", m.size());
    Tensor1<float, memory_space> v_full("kmamba::trainer::exp_avg_sq_unsplit", v.size());
    Kokkos::deep_copy(m_full, ConstHostFloats(m.data(), m.size()));
    Kokkos::deep_copy(v_full, ConstHostFloats(v.data(), v.size()));
    const std::size_t n = local.parameters().size();
    Tensor1<float, memory_space> m_local("kmamba::trainer::exp_avg_local", n);
    Tensor1<float, memory_space> v_local("kmamba::trainer::exp_avg_sq_local", n);
    scatter_values(exec_, loaded, ConstTensor1<float, memory_space>(m_full), local, m_local);
    scatter_values(exec_, loaded, ConstTensor1<float, memory_space>(v_full), local, v_local);
    moments.load_moments(exec_, 0, m_local, v_local);
    model_ = std::move(local);
  } else {
    KMAMBA_ASSERT(slab.size() == moments.size(), "equal model configs gave different parameter counts");
    model_ = std::move(loaded);
    moments.load_moments(exec_, 0, ConstHostFloats(m.data(), m.size()), ConstHostFloats(v.data(), v.size()));
  }
  exec_.fence();
  model_.set_activation_checkpointing(checkpointing);
  model_.set_matmul_precision(precision);
  data_position_ = sequences / config_.batch_size;
  skipped_steps_ = state.skipped_steps;
  consecutive_skips_ = 0;
  tokenizer_files_ = std::move(tokenizer);
#if KMAMBA_ENABLE_MPI
  if (data_parallel_) {
    data_parallel_->load_moments(exec_, moments, state.steps);
    exec_.fence();
    optimizer_ = empty_optimizer(state.steps);
    return;
  }
#endif
  moments.set_steps_taken(state.steps);
  optimizer_ = std::move(moments);
}

#define KMAMBA_INSTANTIATE_TRAINER(Space) template class Trainer<Space>;
KMAMBA_FOR_EACH_BACKEND(KMAMBA_INSTANTIATE_TRAINER)
#undef KMAMBA_INSTANTIATE_TRAINER

}  // namespace kmamba
