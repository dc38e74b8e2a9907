// The timetable of the interleaved 1F1B schedule (InterleavedSchedule.hpp).
#include <kmamba/parallel/InterleavedSchedule.hpp>

#include <algorithm>
#include <map>
#include <tuple>

namespace kmamba {

namespace {

// Unit k of a rank's forward (or backward) order: groups of p micro-batches, each group through the
// chunks in turn (reversed in backward).
VirtualStageUnit unit_in_order(int k, int p, int v, bool backward) {
  const int group = k / (p * v), within = k % (p * v);
  const int chunk = within / p;
  return {backward ? v - 1 - chunk : chunk, group * p + within % p};
}

// The tick at which each unit ran: (forward?, rank, chunk, micro-batch) -> tick.
using Done = std::map<std::tuple<bool, int, int, int>, int>;

bool ran_before(const Done& done, bool forward, int rank, int chunk, int micro_batch, int tick) {
  const auto found = done.find({forward, rank, chunk, micro_batch});
  return found != done.end() && found->second < tick;
}

// Whether rank r's forward of u can run in tick t: its input was produced in an earlier tick.
bool forward_ready(const Done& done, int r, int p, const VirtualStageUnit& u, int t) {
  if (r > 0) return ran_before(done, true, r - 1, u.chunk, u.micro_batch, t);
  return u.chunk == 0 || ran_before(done, true, p - 1, u.chunk - 1, u.micro_batch, t);
}

// Whether rank r's backward of u can run in tick t: its output gradient was produced in an earlier
// tick, or (last virtual stage) its own forward ran, this tick's forward slot included.
bool backward_ready(const Done& done, int r, int p, int v, const VirtualStageUnit& u, int t) {
  if (r == p - 1 && u.chunk == v - 1) return ran_before(done, true, r, u.chunk, u.micro_batch, t + 1);
  if (r < p - 1) return ran_before(done, false, r + 1, u.chunk, u.micro_batch, t);
  return ran_before(done, false, 0, u.chunk + 1, u.micro_batch, t);
}

}  // namespace

void check_interleaved_schedule(int stages, int virtual_stages, int micro_batches) {
  KMAMBA_REQUIRE(
      stages >= 2,
      "kmamba::interleaved schedule: virtual pipeline stages need pipeline_parallel_size >= 2, got " << stages);
  KMAMBA_REQUIRE(virtual_stages >= 2,
                 "kmamba::interleaved schedule: virtual_pipeline_stages must be >= 2 (1 is the plain 1F1B "
                 "schedule), got "
                     << virtual_stages);
  KMAMBA_REQUIRE(micro_batches >= 1 && micro_batches % stages == 0,
                 "kmamba::interleaved schedule: the micro-batches ("
                     << micro_batches << ") must be a positive multiple of pipeline_parallel_size " << stages
                     << " (they pass through the chunks in groups of one per stage)");
}

int interleaved_in_flight(int stage, int stages, int virtual_stages, int micro_batches) {
  return std::min(virtual_stages * micro_batches, 2 * (stages - stage - 1) + (virtual_stages - 1) * stages + 1);
}

std::vector<std::vector<InterleavedTick>> interleaved_timetable(int stages, int virtual_stages, int micro_batches) {
  check_interleaved_schedule(stages, virtual_stages, micro_batches);
  const int p = stages, v = virtual_stages, units = v * micro_batches;
  std::vector<int> forwards(static_cast<std::size_t>(p), 0), backwards(static_cast<std::size_t>(p), 0);
  Done done;
  std::vector<std::vector<InterleavedTick>> ticks;
  while (*std::min_element(backwards.begin(), backwards.end()) < units) {
    const int t = static_cast<int>(ticks.size());
    std::vector<InterleavedTick> tick(static_cast<std::size_t>(p));
    for (int r = 0; r < p; ++r) {  // forward slot: decided on the earlier ticks only, then recorded
      const auto s = static_cast<std::size_t>(r);
      const VirtualStageUnit u = unit_in_order(forwards[s], p, v, false);
      const bool room = forwards[s] - backwards[s] < interleaved_in_flight(r, p, v, micro_batches);
      if (forwards[s] < units && room && forward_ready(done, r, p, u, t)) tick[s].forward = u;
    }
    for (int r = 0; r < p; ++r) {
      const auto s = static_cast<std::size_t>(r);
      if (tick[s].forward.empty()) continue;
      done[{true, r, tick[s].forward.chunk, tick[s].forward.micro_batch}] = t;
      ++forwards[s];
    }
    for (int r = 0; r < p; ++r) {  // backward slot
      const auto s = static_cast<std::size_t>(r);
      const VirtualStageUnit u = unit_in_order(backwards[s], p, v, true);
      if (backwards[s] < units && backward_ready(done, r, p, v, u, t)) tick[s].backward = u;
    }
    bool progress = false;
    for (int r = 0; r < p; ++r) {
      const auto s = static_cast<std::size_t>(r);
      progress = progress || !tick[s].forward.empty() || !tick[s].backward.empty();
      if (tick[s].backward.empty()) continue;
      done[{false, r, tick[s].backward.chunk, tick[s].backward.micro_batch}] = t;
      ++backwards[s];
    }
    KMAMBA_ASSERT(progress, "kmamba::interleaved_timetable: no unit can run at tick " << t);
    ticks.push_back(std::move(tick));
  }
  return ticks;
}

}  // namespace kmamba
