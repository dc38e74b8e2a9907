#include <kmamba/models/Optimizer.hpp>

namespace kmamba {

const char* to_string(OptimizerPlacement placement) {
  return placement == OptimizerPlacement::Host ? "host" : "device";
}

std::vector<SlabRun> impl::split_runs(const std::vector<SlabRun>& runs, std::size_t group_elements) {
  KMAMBA_REQUIRE(group_elements > 0, "kmamba::impl::split_runs: group_elements must be positive");
  std::vector<SlabRun> groups;
  for (const SlabRun& r : runs) {
    for (std::size_t done = 0; done < r.size; done += group_elements) {
      groups.push_back({r.slab_begin + done, r.moment_offset + done, std::min(group_elements, r.size - done)});
    }
  }
  return groups;
}

double learning_rate(std::int64_t step, double lr, double min_lr, std::int64_t warmup_steps, std::int64_t total_steps) {
  KMAMBA_REQUIRE(step >= 0, "kmamba::learning_rate: step must be >= 0, got " << step);
  if (warmup_steps > 0 && step < warmup_steps)
    return lr * static_cast<double>(step + 1) / static_cast<double>(warmup_steps);
  if (step >= total_steps) return min_lr;
  const double progress = static_cast<double>(step - warmup_steps) /
                          static_cast<double>(std::max<std::int64_t>(1, total_steps - warmup_steps));
  return min_lr + 0.5 * (lr - min_lr) * (1.0 + std::cos(3.14159265358979323846 * progress));
}

}  // namespace kmamba
