// The interleaved 1F1B schedule with virtual stages (InterleavedSchedule.hpp), run at 1, 2 and 4 ranks.
// I1 the timetable (no communication; p 2 … 8, v 2 … 4, m p, 2p, 3p): every rank runs each unit's
//    forward and backward once, each after what it needs (its input from the previous virtual stage in
//    an earlier tick; its output gradient from the next one in an earlier tick, or, on the last virtual
//    stage, its own forward), with at most interleaved_in_flight units in flight; and in the timing
//    model of the ticks — chunk forwards of t_f, backwards of t_b, a rank waiting in a send_recv for
//    the peer it exchanges a message with — every rank's idle share is (p − 1)/(v·m + p − 1) up to
//    rounding, for t_b/t_f of 1, 2 and 3;
// I2 run over the pipeline communicator (np 2, 4): every forward receives exactly the output of the
//    previous virtual stage for its micro-batch and every backward the input gradient of the next one
//    (values that encode the path), the ranks' chunks chaining through rank p − 1 → rank 0;
// I3 the measured bubble (idle share of each rank's span, from the schedule's own timing) agrees with
//    (p − 1)/(v·m + p − 1) for chunk work of fixed durations;
// I4 errors name the bad input: one stage, one virtual stage, micro-batches not a multiple of p.
#include "Checks.hpp"
#include "DistributedBatches.hpp"

#include <kmamba/parallel/InterleavedSchedule.hpp>
#include <kmamba/parallel/ProcessMesh.hpp>

#include <gtest/gtest.h>
#include <mpi.h>
#include <Kokkos_Core.hpp>

#include <algorithm>
#include <chrono>
#include <cmath>
#include <cstdio>
#include <map>
#include <thread>
#include <tuple>
#include <vector>

namespace {

using namespace kmamba::test;
using Timetable = std::vector<std::vector<kmamba::InterleavedTick>>;

// The tick of every unit: (forward?, rank, chunk, micro-batch) -> tick; fails on a unit run twice.
std::map<std::tuple<bool, int, int, int>, int> unit_ticks(const Timetable& ticks) {
  std::map<std::tuple<bool, int, int, int>, int> at;
  for (std::size_t t = 0; t < ticks.size(); ++t) {
    for (std::size_t r = 0; r < ticks[t].size(); ++r) {
      for (const bool forward : {true, false}) {
        const kmamba::VirtualStageUnit& u = forward ? ticks[t][r].forward : ticks[t][r].backward;
        if (u.empty()) continue;
        const bool fresh =
            at.insert({{forward, static_cast<int>(r), u.chunk, u.micro_batch}, static_cast<int>(t)}).second;
        EXPECT_TRUE(fresh) << "unit run twice: rank " << r << " chunk " << u.chunk << " micro-batch " << u.micro_batch;
      }
    }
  }
  return at;
}

void expect_complete_and_ordered(const Timetable& ticks, int p, int v, int m) {
  const auto at = unit_ticks(ticks);
  ASSERT_EQ(at.size(), static_cast<std::size_t>(2 * p * v * m));
  for (int r = 0; r < p; ++r) {
    for (int c = 0; c < v; ++c) {
      for (int mb = 0; mb < m; ++mb) {
        const int s = c * p + r, f = at.at({true, r, c, mb}), b = at.at({false, r, c, mb});
        if (s > 0) {
          EXPECT_LT(at.at({true, (s - 1) % p, (s - 1) / p, mb}), f) << "forward of virtual stage " << s;
        }
        if (s + 1 < p * v) {
          EXPECT_LT(at.at({false, (s + 1) % p, (s + 1) / p, mb}), b) << "backward of virtual stage " << s;
        }
        EXPECT_LE(f, b) << "virtual stage " << s << " micro-batch " << mb;
      }
    }
    int in_flight = 0, most = 0;
    for (const auto& tick : ticks) {
      in_flight += !tick[static_cast<std::size_t>(r)].forward.empty();
      most = std::max(most, in_flight);
      in_flight -= !tick[static_cast<std::size_t>(r)].backward.empty();
    }
    EXPECT_LE(most, kmamba::interleaved_in_flight(r, p, v, m)) << "rank " << r;
  }
}

// Each rank's idle share in the timing model of I1: clocks advance by the work of each slot, and a
// message sent in a shift brings sender and receiver to the later of their two clocks.
std::vector<double> modelled_idle_shares(const Timetable& ticks, int p, int v, double tf, double tb) {
  std::vector<double> clock(static_cast<std::size_t>(p), 0.0), busy(clock);
  for (const auto& tick : ticks) {
    for (const bool forward : {true, false}) {
      for (int r = 0; r < p; ++r) {
        const auto s = static_cast<std::size_t>(r);
        const kmamba::VirtualStageUnit& u = forward ? tick[s].forward : tick[s].backward;
        if (u.empty()) continue;
        clock[s] += forward ? tf : tb;
        busy[s] += forward ? tf : tb;
      }
      std::vector<double> after = clock;
      for (int r = 0; r < p; ++r) {
        const auto s = static_cast<std::size_t>(r);
        const kmamba::VirtualStageUnit& u = forward ? tick[s].forward : tick[s].backward;
        const bool sends = !u.empty() && (forward ? !(r == p - 1 && u.chunk == v - 1) : !(r == 0 && u.chunk == 0));
        if (!sends) continue;
        const auto peer = static_cast<std::size_t>(forward ? (r + 1) % p : (r + p - 1) % p);
        const double met = std::max(clock[s], clock[peer]);
        after[s] = std::max(after[s], met);
        after[peer] = std::max(after[peer], met);
      }
      clock = after;
    }
  }
  const double span = *std::max_element(clock.begin(), clock.end());
  std::vector<double> idle;
  for (const double b : busy) idle.push_back(1.0 - b / span);
  return idle;
}

// I1.
TEST(InterleavedTimetable, RunsEveryUnitInOrderWithTheInterleavedBubble) {
  for (int p = 2; p <= 8; ++p) {
    for (int v = 2; v <= 4; ++v) {
      for (const int m : {p, 2 * p, 3 * p}) {
        SCOPED_TRACE("p " + std::to_string(p) + " v " + std::to_string(v) + " m " + std::to_string(m));
        const Timetable ticks = kmamba::interleaved_timetable(p, v, m);
        expect_complete_and_ordered(ticks, p, v, m);
        for (const double ratio : {1.0, 2.0, 3.0}) {
          for (const double idle : modelled_idle_shares(ticks, p, v, 1.0, ratio)) {
            EXPECT_NEAR(idle, kmamba::interleaved_bubble(p, v, m), 1e-12) << "t_b/t_f " << ratio;
          }
        }
      }
    }
  }
}

/// Chunk work whose activations encode their path: micro-batch mb enters virtual stage s with
/// 1000·mb + s(s + 1)/2 (each stage adds s + 1), and its output gradient there is
/// −1000·mb − Σ_{s' > s} (s' + 1) (each backward subtracts s + 1). One output buffer, reused.
class PathStage : public kmamba::VirtualStageWork<Exec> {
 public:
  PathStage(int rank, int p, int v) : rank_(rank), p_(p), v_(v), buffer_("kmamba::test::path", 8) {}
  std::size_t activation_elements(int) const override { return buffer_.size(); }
  Activation forward(int chunk, int mb, const Activation& input) override {
    const int s = chunk * p_ + rank_;
    const double enters = 1000.0 * mb + s * (s + 1) / 2;
    if (s > 0) check(input, enters, "forward", s, mb);
    EXPECT_TRUE(s > 0 || input.size() == 0);
    ++forwards;
    Kokkos::deep_copy(buffer_, static_cast<float>(enters + s + 1));
    return buffer_;
  }
  Activation backward(int chunk, int mb, const Activation& output_grad) override {
    const int s = chunk * p_ + rank_, last = p_ * v_ - 1;
    const double grad = -1000.0 * mb - ((last + 1) * (last + 2) / 2 - (s + 1) * (s + 2) / 2);
    if (s < last) check(output_grad, grad, "backward", s, mb);
    EXPECT_TRUE(s < last || output_grad.size() == 0);
    ++backwards;
    Kokkos::deep_copy(buffer_, static_cast<float>(grad - (s + 1)));
    return buffer_;
  }
  int forwards = 0, backwards = 0;

 private:
  void check(const Activation& a, double want, const char* what, int s, int mb) const {
    ASSERT_EQ(a.size(), buffer_.size());
    const auto host = Kokkos::create_mirror_view_and_copy(Kokkos::HostSpace(), a);
    for (std::size_t i = 0; i < host.size(); ++i) {
      EXPECT_EQ(host(i), static_cast<float>(want)) << what << " of virtual stage " << s << " micro-batch " << mb;
    }
  }
  int rank_, p_, v_;
  Activation buffer_;
};

kmamba::ProcessMesh pipeline_mesh() {
  kmamba::MeshConfig config;
  config.pipeline_parallel_size = world_size();
  return kmamba::ProcessMesh(MPI_COMM_WORLD, config);
}

// I2.
TEST(InterleavedSchedule, PassesEachMicroBatchThroughEveryVirtualStageInOrder) {
  if (world_size() < 2) GTEST_SKIP() << "one pipeline stage: I4 checks the error it gives";
  const kmamba::ProcessMesh mesh = pipeline_mesh();
  const int p = world_size();
  for (const int v : {2, 3}) {
    for (const int m : {p, 2 * p}) {
      PathStage work(mesh.pipeline().rank(), p, v);
      kmamba::run_interleaved_one_f_one_b(Exec(), mesh.pipeline(), v, m, work);
      EXPECT_EQ(work.forwards, v * m);
      EXPECT_EQ(work.backwards, v * m);
    }
  }
}

/// Chunk work of fixed durations (sleeps), passing activations of a few elements.
class FixedDurationChunks : public kmamba::VirtualStageWork<Exec> {
 public:
  FixedDurationChunks(double forward_seconds, double backward_seconds)
      : forward_(forward_seconds), backward_(backward_seconds), buffer_("kmamba::test::activation", 16) {}
  std::size_t activation_elements(int) const override { return buffer_.size(); }
  Activation forward(int, int, const Activation&) override { return wait(forward_); }
  Activation backward(int, int, const Activation&) override { return wait(backward_); }

 private:
  Activation wait(double seconds) {
    std::this_thread::sleep_for(std::chrono::duration<double>(seconds));
    return buffer_;
  }
  double forward_, backward_;
  Activation buffer_;
};

// I3. Each rank is busy v·m·(t_f + t_b) of a span of (v·m + p − 1)·(t_f + t_b) (I1's model). As in
// TestPipelineParallel.cpp's P3, what a rank's own busy time does not hold is the other ranks' sleep
// overshoots on the critical path and the messages' delivery (milliseconds when a waking rank waits
// for a core of the loaded, oversubscribed host); a delay d per tick raises the idle share by at most
// d/(t_f + t_b), so with ticks of 450 ms the margin 0.05 allows d = 22 ms per tick.
TEST(InterleavedSchedule, MeasuredBubbleAgreesWithTheInterleavedFormula) {
  if (world_size() < 2) GTEST_SKIP() << "one pipeline stage: I4 checks the error it gives";
  const kmamba::ProcessMesh mesh = pipeline_mesh();
  const int p = world_size(), v = 2;
  for (const int m : {p, 2 * p}) {
    constexpr double forward = 0.15, backward = 0.3;
    FixedDurationChunks work(forward, backward);
    const kmamba::PipelineTiming t = kmamba::run_interleaved_one_f_one_b(Exec(), mesh.pipeline(), v, m, work);
    const double want = kmamba::interleaved_bubble(p, v, m);
    EXPECT_NEAR(t.idle_fraction(), want, 0.05) << "rank " << mesh.pipeline().rank() << ", m " << m;
    EXPECT_GE(t.busy_seconds, v * m * (forward + backward)) << "rank " << mesh.pipeline().rank();
    EXPECT_LT(t.busy_seconds, v * m * (forward + backward) + forward) << "rank " << mesh.pipeline().rank();
    const double worst = mesh.world().all_reduce_value(std::abs(t.idle_fraction() - want), kmamba::ReduceOp::Max);
    if (world_rank() == 0) {
      std::printf("[ measured ] p %d v %d m %d: rank 0 idle %.4f of %.3f s, formula %.4f (v 1: %.4f), worst |d| %.4f\n",
                  p, v, m, t.idle_fraction(), t.span_seconds, want, kmamba::one_f_one_b_bubble(p, m), worst);
    }
  }
}

// I4.
TEST(InterleavedSchedule, ErrorsNameTheBadInput) {
  EXPECT_NE(user_error([] {
              kmamba::interleaved_timetable(1, 2, 4);
            }).find("virtual pipeline stages need pipeline_parallel_size >= 2, got 1"),
            std::string::npos);
  EXPECT_NE(user_error([] {
              kmamba::interleaved_timetable(2, 1, 4);
            }).find("virtual_pipeline_stages must be >= 2 (1 is the plain 1F1B schedule), got 1"),
            std::string::npos);
  EXPECT_NE(user_error([] {
              kmamba::interleaved_timetable(4, 2, 6);
            }).find("the micro-batches (6) must be a positive multiple of pipeline_parallel_size 4"),
            std::string::npos);
  if (world_size() != 1) return;
  const kmamba::ProcessMesh mesh = pipeline_mesh();
  FixedDurationChunks work(0.0, 0.0);
  EXPECT_NE(user_error([&] {
              kmamba::run_interleaved_one_f_one_b(Exec(), mesh.pipeline(), 2, 2, work);
            }).find("pipeline_parallel_size >= 2, got 1"),
            std::string::npos);
}

}  // namespace
