// Sequence parallelism scans the segments at the same time (docs/distributed.md §2.1–§2.3), shown on
// the dependencies between the ranks rather than on a clock: every rank traces its communication
// (the CountingCommunicator's events, with their peers) and marks the start of each scan (a Kokkos
// Tools region callback on the forward and backward regions of the SSD, the selective scan and the
// Mamba-3 SISO and MIMO scans). Replaying the traces of all ranks — a message's receiver depends on
// everything its sender did before sending it; a collective joins every rank — gives the longest
// chain of scans that depend on one another: the critical path counted in scans. For a Mamba-2,
// Mamba-1 or Mamba-3 (SISO or MIMO) model trained on sp = world ranks it must equal the scans of one
// rank (each layer's forward and backward scan once); the replay is checked on a synthetic serial
// chain, which it must find c scans long. Counting dependencies is exact on any machine load,
// unlike a wall clock on oversubscribed CI cores.
#include "DistributedBatches.hpp"
#include "ModelConfigs.hpp"

#include <kmamba/models/LanguageModel.hpp>
#include <kmamba/models/ModelParallel.hpp>
#include <kmamba/parallel/CountingCommunicator.hpp>
#include <kmamba/parallel/MpiCommunicator.hpp>
#include <kmamba/parallel/ProcessMesh.hpp>

#include <gtest/gtest.h>
#include <mpi.h>
#include <Kokkos_Core.hpp>

#include <algorithm>
#include <cstdio>
#include <cstring>
#include <deque>
#include <map>
#include <memory>
#include <utility>
#include <vector>

namespace {

using namespace kmamba::test;

/// One traced event as the replay reads it.
struct Step {
  enum Kind : int { Scan = 0, Message = 1, Collective = 2 };
  int kind, dest, source;
};

/// The longest chain of scans over the ranks' traces (indexed by rank), or −1 if they cannot be
/// replayed (a receive without its send, or a collective not reached by every rank).
int longest_scan_chain(const std::vector<std::vector<Step>>& traces) {
  const int n = static_cast<int>(traces.size());
  std::vector<std::size_t> at(static_cast<std::size_t>(n), 0);
  std::vector<int> depth(static_cast<std::size_t>(n), 0);
  std::vector<bool> posted(static_cast<std::size_t>(n), false);  // the send half of the current message
  std::map<std::pair<int, int>, std::deque<int>> in_flight;      // (from, to): the senders' depths
  for (bool progress = true; progress;) {
    progress = false;
    for (int r = 0; r < n; ++r) {
      const auto ur = static_cast<std::size_t>(r);
      while (at[ur] < traces[ur].size()) {
        const Step& s = traces[ur][at[ur]];
        if (s.kind == Step::Collective) break;
        if (s.kind == Step::Scan) ++depth[ur];
        if (s.kind == Step::Message) {
          if (!posted[ur] && s.dest != kmamba::no_peer) in_flight[{r, s.dest}].push_back(depth[ur]);
          posted[ur] = true;
          if (s.source != kmamba::no_peer) {
            auto& queue = in_flight[{s.source, r}];
            if (queue.empty()) break;
            depth[ur] = std::max(depth[ur], queue.front());
            queue.pop_front();
          }
          posted[ur] = false;
        }
        ++at[ur];
        progress = true;
      }
    }
    bool all_at_collective = true;
    for (int r = 0; r < n; ++r) {
      const auto ur = static_cast<std::size_t>(r);
      all_at_collective =
          all_at_collective && at[ur] < traces[ur].size() && traces[ur][at[ur]].kind == Step::Collective;
    }
    if (all_at_collective) {
      const int joined = *std::max_element(depth.begin(), depth.end());
      for (int r = 0; r < n; ++r) {
        depth[static_cast<std::size_t>(r)] = joined;
        ++at[static_cast<std::size_t>(r)];
      }
      progress = true;
    }
  }
  for (int r = 0; r < n; ++r) {
    if (at[static_cast<std::size_t>(r)] < traces[static_cast<std::size_t>(r)].size()) return -1;
  }
  return *std::max_element(depth.begin(), depth.end());
}

/// The log the region callback marks scans in (Kokkos Tools callbacks are plain functions).
kmamba::CommunicationLog* scan_log = nullptr;

void mark_scans(const char* name) {
  for (const char* scan :
       {"kmamba::ssd_forward", "kmamba::ssd_backward", "kmamba::selective_scan_forward",
        "kmamba::selective_scan_backward", "kmamba::mamba3_siso_forward", "kmamba::mamba3_siso_backward",
        "kmamba::mamba3_mimo_forward", "kmamba::mamba3_mimo_backward"}) {
    if (std::strcmp(name, scan) == 0) scan_log->mark("scan");
  }
}

/// Every rank's trace of `log` on every rank (the sp axis is the world here, so its ranks are world ranks).
std::vector<std::vector<Step>> gather_traces(const kmamba::CommunicationLog& log) {
  std::vector<int> mine;
  for (const auto& e : log.events()) {
    const int kind = e.axis.empty() ? Step::Scan : e.operation == "send_recv" ? Step::Message : Step::Collective;
    mine.insert(mine.end(), {kind, e.dest, e.source});
  }
  const int n = world_size();
  int count = static_cast<int>(mine.size());
  std::vector<int> counts(static_cast<std::size_t>(n)), offsets(static_cast<std::size_t>(n), 0);
  MPI_Allgather(&count, 1, MPI_INT, counts.data(), 1, MPI_INT, MPI_COMM_WORLD);
  for (int r = 1; r < n; ++r) offsets[static_cast<std::size_t>(r)] = offsets[r - 1u] + counts[r - 1u];
  std::vector<int> all(static_cast<std::size_t>(offsets.back() + counts.back()));
  MPI_Allgatherv(mine.data(), count, MPI_INT, all.data(), counts.data(), offsets.data(), MPI_INT, MPI_COMM_WORLD);
  std::vector<std::vector<Step>> traces(static_cast<std::size_t>(n));
  for (int r = 0; r < n; ++r) {
    for (int i = 0; i < counts[static_cast<std::size_t>(r)]; i += 3) {
      const int* s = all.data() + offsets[static_cast<std::size_t>(r)] + i;
      traces[static_cast<std::size_t>(r)].push_back({s[0], s[1], s[2]});
    }
  }
  return traces;
}

TEST(SequenceConcurrency, ReplayFindsTheSerialChain) {
  // Rank k receives from k − 1, scans, sends to k + 1: c scans in a row.
  constexpr int c = 4;
  std::vector<std::vector<Step>> chain(c);
  for (int k = 0; k < c; ++k) {
    if (k > 0) chain[k].push_back({Step::Message, kmamba::no_peer, k - 1});
    chain[k].push_back({Step::Scan, kmamba::no_peer, kmamba::no_peer});
    if (k + 1 < c) chain[k].push_back({Step::Message, k + 1, kmamba::no_peer});
  }
  EXPECT_EQ(longest_scan_chain(chain), c);
  // A receive nobody sends cannot be replayed.
  EXPECT_EQ(longest_scan_chain({{{Step::Message, kmamba::no_peer, 1}}, {}}), -1);
}

struct ChainLength {
  int scans;    // the scans of this rank
  int longest;  // the longest chain of dependent scans over all ranks
};

/// One training step (loss and backward) of a 2-layer model of `mixer` (Mamba-3: MIMO of rank 2 when
/// `mimo`) on sp = world ranks, traced.
ChainLength trace_one_step(kmamba::MixerKind mixer, bool mimo = false) {
  const Exec exec;
  const int c = world_size();
  kmamba::ModelConfig config = model_config(mixer, {32, 2, 64, 8, 8, 4, mixer == kmamba::MixerKind::Mamba1 ? 1 : 4});
  config.is_mimo = mimo;
  config.mimo_rank = 2;
  config.validate();
  auto log = std::make_shared<kmamba::CommunicationLog>();
  kmamba::MeshConfig mesh_config;
  mesh_config.sequence_parallel_size = c;
  const kmamba::ProcessMesh mesh(
      std::make_unique<kmamba::CountingCommunicator>(std::make_unique<kmamba::MpiCommunicator>(MPI_COMM_WORLD), log),
      mesh_config);
  Model model(config, {&mesh.tensor(), &mesh.sequence()});
  model.initialize(5);
  const TokenRows all = random_token_rows(1, 16 * c, 9);
  const kmamba::SequenceSegment segment = kmamba::sequence_segment(16 * c, mesh.coordinates().sp, c);
  const TokenRows mine = slice(all, 0, 1, segment.begin, segment.length);
  model.zero_grads(exec);

  const auto saved = Kokkos::Tools::Experimental::get_callbacks();
  scan_log = log.get();
  Kokkos::Tools::Experimental::set_push_region_callback(&mark_scans);
  log->set_tracing(true);
  model.loss_and_backward(exec, mine.ids, mine.targets, 1.0);
  exec.fence();
  log->set_tracing(false);
  Kokkos::Tools::Experimental::set_push_region_callback(saved.push_region);
  scan_log = nullptr;

  ChainLength length{0, 0};
  for (const auto& e : log->events()) length.scans += e.axis.empty();
  length.longest = longest_scan_chain(gather_traces(*log));
  if (world_rank() == 0) {
    std::printf("[ measured ] %s%s sp %d: %d scans per rank, longest chain of dependent scans %d\n",
                kmamba::mixer_name(mixer), mimo ? " MIMO" : "", c, length.scans, length.longest);
  }
  return length;
}

TEST(SequenceConcurrency, Mamba2SegmentsAreScannedAtTheSameTime) {
  const ChainLength length = trace_one_step(kmamba::MixerKind::Mamba2);
  EXPECT_EQ(length.scans, 4) << "one forward and one backward scan per layer";
  EXPECT_EQ(length.longest, length.scans) << "a rank waited on another rank's scan";
}

// Mamba-1's selective scans split the same way (docs/distributed.md §2.2).
TEST(SequenceConcurrency, Mamba1SegmentsAreScannedAtTheSameTime) {
  const ChainLength length = trace_one_step(kmamba::MixerKind::Mamba1);
  EXPECT_EQ(length.scans, 4) << "one forward and one backward scan per layer";
  EXPECT_EQ(length.longest, length.scans) << "a rank waited on another rank's scan";
}

// Mamba-3 splits the same way (docs/distributed.md §2.3). Its SISO scan runs on the SSD, so each of
// its scans also marks the SSD's region: 4 regions per layer, none of them waiting on another rank's.
TEST(SequenceConcurrency, Mamba3SisoSegmentsAreScannedAtTheSameTime) {
  const ChainLength length = trace_one_step(kmamba::MixerKind::Mamba3);
  EXPECT_EQ(length.scans, 8) << "one forward and one backward scan per layer, each with its SSD's region";
  EXPECT_EQ(length.longest, length.scans) << "a rank waited on another rank's scan";
}

TEST(SequenceConcurrency, Mamba3MimoSegmentsAreScannedAtTheSameTime) {
  const ChainLength length = trace_one_step(kmamba::MixerKind::Mamba3, true);
  EXPECT_EQ(length.scans, 4) << "one forward and one backward scan per layer";
  EXPECT_EQ(length.longest, length.scans) << "a rank waited on another rank's scan";
}

}  // namespace
