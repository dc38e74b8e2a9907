// DeviceSampler: shape checks and launches; the kernels are in SamplingKernels.hpp.
#include <kmamba/models/DeviceSampler.hpp>

#include "SamplingKernels.hpp"

#include <kmamba/core/Error.hpp>
#include <kmamba/core/ForEachBackend.hpp>
#include <kmamba/core/Profiling.hpp>
#include <kmamba/core/Shape.hpp>
#include <kmamba/core/impl/LightWeightLaunch.hpp>

#include <Kokkos_Core.hpp>

namespace kmamba {

namespace impl {

/// seen(r, tokens(r, j)) = 1 for every entry inside [0, vocab).
template <class Mem>
struct ObserveTokens {
  ConstTensor2<std::int64_t, Mem> tokens;  // (batch, length)
  Tensor2<std::uint8_t, Mem> seen;         // (batch, vocab)
  KOKKOS_INLINE_FUNCTION void operator()(const int r, const int j) const {
    const std::int64_t t = tokens(r, j);
    if (t >= 0 && t < static_cast<std::int64_t>(seen.extent(1))) seen(r, t) = 1;
  }
};

}  // namespace impl

template <class ExecutionSpace>
DeviceSampler<ExecutionSpace>::DeviceSampler(const SamplingConfig& config, int batch, int vocab)
    : config_(config), batch_(batch), vocab_(vocab) {
  config_.validate();
  KMAMBA_REQUIRE(batch >= 1, "kmamba::DeviceSampler: batch must be >= 1, got " << batch);
  KMAMBA_REQUIRE(vocab >= 1 && vocab <= impl::device_sampler_max_vocab,
                 "kmamba::DeviceSampler: vocab must be in [1, 2^21] (the fixed-point weights' range), got " << vocab);
  if (config_.repetition_penalty != 1.0f) {
    seen_ = allocate<Tensor2<std::uint8_t, memory_space>>("kmamba::sampler::seen", batch, vocab);
  }
  error_ = allocate<Tensor1<std::int64_t, memory_space>>("kmamba::sampler::error", 3);
}

template <class ExecutionSpace>
void DeviceSampler<ExecutionSpace>::reset(const ExecutionSpace& exec) {
  if (seen_.is_allocated()) Kokkos::deep_copy(exec, seen_, std::uint8_t(0));
  Kokkos::deep_copy(exec, error_, std::int64_t(0));
}

template <class ExecutionSpace>
void DeviceSampler<ExecutionSpace>::observe(
    const ExecutionSpace& exec, const ConstTensor2<std::int64_t, memory_space>& tokens) {  // (batch, length)
  constexpr const char* function = "kmamba::DeviceSampler::observe";
  KMAMBA_REQUIRE(
      tokens.extent(0) == static_cast<std::size_t>(batch_),
      function << ": tokens must have shape (batch = " << batch_ << ", length), got " << shape_of(tokens).to_string());
  if (!seen_.is_allocated() || tokens.extent(1) == 0) return;
  Kokkos::parallel_for(
      "kmamba::sampler::observe",
      Kokkos::MDRangePolicy<ExecutionSpace, Kokkos::Rank<2>>(
          exec, {0, 0}, {static_cast<std::int64_t>(batch_), static_cast<std::int64_t>(tokens.extent(1))}),
      impl::ObserveTokens<memory_space>{tokens, seen_});
}

template <class ExecutionSpace>
void DeviceSampler<ExecutionSpace>::sample(const ExecutionSpace& exec,
                                           const ConstTensor2<float, memory_space>& logits,        // (batch, >= vocab)
                                           const ConstTensor1<std::int64_t, memory_space>& steps,  // (batch)
                                           const Tensor1<std::int64_t, memory_space>& ids,         // (batch)
                                           std::uint64_t first_sequence) const {
  constexpr const char* function = "kmamba::DeviceSampler::sample";
  check_shape(function, "steps", steps, {batch_}, "(batch)");
  check_allocated(function, "steps", steps);
  check_shape(function, "ids", ids, {batch_}, "(batch)");
  check_allocated(function, "ids", ids);
  run(exec, logits, steps, ids, {}, first_sequence);
}

template <class ExecutionSpace>
void DeviceSampler<ExecutionSpace>::distribution(
    const ExecutionSpace& exec, const ConstTensor2<float, memory_space>& logits,  // (batch, >= vocab)
    const Tensor2<double, memory_space>& probabilities) const {                   // (batch, vocab)
  constexpr const char* function = "kmamba::DeviceSampler::distribution";
  check_shape(function, "probabilities", probabilities, {batch_, vocab_}, "(batch, vocab)");
  check_allocated(function, "probabilities", probabilities);
  run(exec, logits, {}, {}, probabilities, 0);
}

template <class ExecutionSpace>
void DeviceSampler<ExecutionSpace>::run(const ExecutionSpace& exec,
                                        const ConstTensor2<float, memory_space>& logits,        // (batch, >= vocab)
                                        const ConstTensor1<std::int64_t, memory_space>& steps,  // (batch) or empty
                                        const Tensor1<std::int64_t, memory_space>& ids,         // (batch) or empty
                                        const Tensor2<double, memory_space>& probabilities,  // (batch, vocab) or empty
                                        std::uint64_t first_sequence) const {
  const ProfilingRegion region("kmamba::DeviceSampler::sample");
  KMAMBA_REQUIRE(logits.is_allocated() && logits.extent(0) == static_cast<std::size_t>(batch_) &&
                     logits.extent(1) >= static_cast<std::size_t>(vocab_),
                 "kmamba::DeviceSampler: logits must have shape (batch = "
                     << batch_ << ", >= vocab = " << vocab_ << "), got " << shape_of(logits).to_string());
  using Functor = impl::SampleRows<ExecutionSpace>;
  const SamplingConfig& c = config_;
  const Functor functor{logits,
                        seen_,
                        steps,
                        ids,
                        probabilities,
                        error_,
                        vocab_,
                        static_cast<double>(c.temperature),
                        static_cast<double>(c.top_p),
                        static_cast<double>(c.min_p),
                        static_cast<double>(c.repetition_penalty),
                        c.top_k,
                        c.greedy(),
                        c.seed,
                        first_sequence};
  // On a GPU as many threads a row as the kernel allows: one team walks a whole row, and its passes
  // over the row are bound by the loads each thread has in flight. Host teams stay Kokkos' choice:
  // their threads meet at every reduction and barrier, which costs a host more than the loads.
  using Policy = Kokkos::TeamPolicy<ExecutionSpace>;
  const auto scratch = Kokkos::PerTeam(Functor::Shared::shmem_size());
  Policy policy(exec, batch_, Kokkos::AUTO);
  if constexpr (impl::vector_lanes_are_threads<ExecutionSpace>) {
    policy =
        Policy(exec, batch_,
               Policy(exec, batch_, 1).set_scratch_size(0, scratch).team_size_max(functor, Kokkos::ParallelForTag()));
  }
  Kokkos::parallel_for("kmamba::sampler::sample_rows", impl::light_weight(policy.set_scratch_size(0, scratch)),
                       functor);
}

template <class ExecutionSpace>
void DeviceSampler<ExecutionSpace>::check_errors(const char* function) const {
  const auto host = Kokkos::create_mirror_view_and_copy(Kokkos::HostSpace(), error_);
  KMAMBA_REQUIRE(host(0) != impl::sampler_bad_logit, function << ": the logit of token " << host(2) << " of row "
                                                              << host(1) << " is NaN or +inf (not allowed)");
  KMAMBA_REQUIRE(host(0) != impl::sampler_all_masked,
                 function << ": every logit of row " << host(1) << " is -inf (no token can be chosen)");
}

#define KMAMBA_INSTANTIATE_DEVICE_SAMPLER(Space) template class DeviceSampler<Space>;
KMAMBA_FOR_EACH_BACKEND(KMAMBA_INSTANTIATE_DEVICE_SAMPLER)
#undef KMAMBA_INSTANTIATE_DEVICE_SAMPLER

}  // namespace kmamba
