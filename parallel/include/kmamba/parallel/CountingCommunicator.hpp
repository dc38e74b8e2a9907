// The communication audit: a Communicator that forwards every operation to another one and counts
// it, per mesh axis and operation, in a log shared with the communicators split from it. Tests
// use it to check the schedule of a parallel algorithm (which collectives, how many, how large);
// benchmarks switch the log's timing on to also measure each operation: it then fences the
// caller's execution space instance before the operation (so that earlier work is not counted)
// and after it (so that the operation has finished), which serialises communication with compute.
//
//   auto log = std::make_shared<kmamba::CommunicationLog>();
//   kmamba::ProcessMesh mesh(std::make_unique<kmamba::CountingCommunicator>(
//       std::make_unique<kmamba::MpiCommunicator>(MPI_COMM_WORLD), log), config);
//   ...
//   log->tally("dp", "all_reduce").calls
#ifndef KMAMBA_PARALLEL_COUNTINGCOMMUNICATOR_HPP
#define KMAMBA_PARALLEL_COUNTINGCOMMUNICATOR_HPP

#include <kmamba/parallel/Communicator.hpp>

#include <chrono>
#include <cstdint>
#include <map>
#include <memory>
#include <string>
#include <utility>
#include <vector>

namespace kmamba {

/// What a CountingCommunicator and its splits did.
class CommunicationLog {
 public:
  struct Tally {
    std::int64_t calls = 0;
    std::int64_t elements = 0;  ///< Σ of the logical buffer sizes (docs/distributed.md §0's M, in elements)
    std::int64_t bytes = 0;     ///< the same in bytes (elements times the element type's size)
    /// Σ of the bytes this rank sends under the ring algorithms of docs/distributed.md §0 (an
    /// all-reduce 2(n−1)/n · M, a reduce-scatter or all-gather (n−1)/n · M, a broadcast M, a
    /// send_recv its outgoing message): what compressing the values on the wire saves.
    double sent_bytes = 0.0;
    double seconds = 0.0;  ///< Σ of the operations' times while timing() was on
  };
  /// Operations: "all_reduce", "reduce_scatter", "all_gather", "broadcast", "send_recv", "barrier".
  Tally tally(const std::string& axis, const std::string& operation) const {
    const auto it = tallies_.find({axis, operation});
    return it == tallies_.end() ? Tally() : it->second;
  }
  /// Calls of every operation on every axis.
  std::int64_t total_calls() const {
    std::int64_t n = 0;
    for (const auto& entry : tallies_) n += entry.second.calls;
    return n;
  }
  /// Σ of the timed seconds of every operation on every axis.
  double total_seconds() const {
    double s = 0.0;
    for (const auto& entry : tallies_) s += entry.second.seconds;
    return s;
  }
  /// Every (axis, operation) seen, with its tally.
  const std::map<std::pair<std::string, std::string>, Tally>& tallies() const { return tallies_; }
  void record(const std::string& axis, const std::string& operation, std::size_t elements, std::size_t bytes,
              double sent_bytes, double seconds = 0.0, int dest = no_peer, int source = no_peer) {
    Tally& t = tallies_[{axis, operation}];
    ++t.calls;
    t.elements += static_cast<std::int64_t>(elements);
    t.bytes += static_cast<std::int64_t>(bytes);
    t.sent_bytes += sent_bytes;
    t.seconds += seconds;
    if (tracing_) events_.push_back({axis, operation, static_cast<std::int64_t>(elements), dest, source});
  }
  void clear() {
    tallies_.clear();
    events_.clear();
  }

  /// One operation, or a mark of the caller's, in the order this process issued them.
  struct Event {
    std::string axis;       ///< the operation's axis; "" for a mark
    std::string operation;  ///< the operation (as tally's), or the mark's name
    std::int64_t elements;  ///< as Tally::elements
    int dest, source;       ///< send_recv's peers (ranks of the axis; no_peer for none or another operation)
  };
  /// Whether operations (and marks) are appended to events() (off by default). Tests use the
  /// trace to follow the dependencies between ranks (docs/distributed.md §2.1).
  bool tracing() const { return tracing_; }
  void set_tracing(bool on) { tracing_ = on; }
  /// Appends a mark, e.g. the start of a computation, to the trace (while tracing).
  void mark(const std::string& name) {
    if (tracing_) events_.push_back({"", name, 0, no_peer, no_peer});
  }
  const std::vector<Event>& events() const { return events_; }

  /// Whether the CountingCommunicators writing here time their operations (off by default).
  bool timing() const { return timing_; }
  void set_timing(bool on) { timing_ = on; }

 private:
  std::map<std::pair<std::string, std::string>, Tally> tallies_;
  std::vector<Event> events_;
  bool timing_ = false;
  bool tracing_ = false;
};

class CountingCommunicator final : public Communicator {
 public:
  /// Wraps `inner` (same rank, size and axis), counting into `log`.
  CountingCommunicator(std::unique_ptr<Communicator> inner, std::shared_ptr<CommunicationLog> log)
      : Communicator(inner->rank(), inner->size(), inner->axis()), inner_(std::move(inner)), log_(std::move(log)) {}

  const char* transport() const override { return inner_->transport(); }
  std::unique_ptr<Communicator> split(int color, int key, const std::string& axis) const override {
    return std::unique_ptr<Communicator>(new CountingCommunicator(inner_->split(color, key, axis), log_));
  }
  const std::shared_ptr<CommunicationLog>& log() const { return log_; }

 protected:
  void do_all_reduce(const void* send, void* recv, std::size_t count, DataType type, ReduceOp op,
                     const StreamContext& stream) const override {
    counted("all_reduce", count, type, 2.0 * ring_fraction() * static_cast<double>(count), &stream,
            [&] { inner_->do_all_reduce(send, recv, count, type, op, stream); });
  }
  void do_reduce_scatter(const void* send, void* recv, std::size_t recv_count, DataType type, ReduceOp op,
                         const StreamContext& stream) const override {
    const std::size_t whole = recv_count * static_cast<std::size_t>(size());
    counted("reduce_scatter", whole, type, ring_fraction() * static_cast<double>(whole), &stream,
            [&] { inner_->do_reduce_scatter(send, recv, recv_count, type, op, stream); });
  }
  void do_all_gather(const void* send, void* recv, std::size_t send_count, DataType type,
                     const StreamContext& stream) const override {
    const std::size_t whole = send_count * static_cast<std::size_t>(size());
    counted("all_gather", whole, type, ring_fraction() * static_cast<double>(whole), &stream,
            [&] { inner_->do_all_gather(send, recv, send_count, type, stream); });
  }
  void do_broadcast(void* data, std::size_t count, DataType type, int root,
                    const StreamContext& stream) const override {
    counted("broadcast", count, type, size() > 1 ? static_cast<double>(count) : 0.0, &stream,
            [&] { inner_->do_broadcast(data, count, type, root, stream); });
  }
  void do_send_recv(const void* send, std::size_t send_count, int dest, void* recv, std::size_t recv_count, int source,
                    DataType type, const StreamContext& stream) const override {
    counted(
        "send_recv", send_count + recv_count, type, static_cast<double>(send_count), &stream,
        [&] { inner_->do_send_recv(send, send_count, dest, recv, recv_count, source, type, stream); }, dest, source);
  }
  void do_barrier() const override {
    counted("barrier", 0, DataType::Float32, 0.0, nullptr, [&] { inner_->do_barrier(); });
  }
  bool native_average() const override { return inner_->native_average(); }

 private:
  // (n − 1)/n: the fraction of a buffer a ring step sequence sends from each of n ranks.
  double ring_fraction() const { return static_cast<double>(size() - 1) / static_cast<double>(size()); }

  // Records the operation (`elements` of `type`, of which this rank sends `sent` elements' worth);
  // with the log's timing on, also its time between a fence of the caller's instance before and
  // one after (stream: null for the barrier, which has none).
  template <class Operation>
  void counted(const char* operation, std::size_t elements, DataType type, double sent, const StreamContext* stream,
               const Operation& run, int dest = no_peer, int source = no_peer) const {
    const std::size_t bytes = elements * data_type_size(type);
    const double sent_bytes = sent * static_cast<double>(data_type_size(type));
    if (!log_->timing()) {
      log_->record(axis(), operation, elements, bytes, sent_bytes, 0.0, dest, source);
      run();
      return;
    }
    if (stream != nullptr && stream->fence) stream->fence();
    const auto start = std::chrono::steady_clock::now();
    run();
    if (stream != nullptr && stream->fence) stream->fence();
    log_->record(axis(), operation, elements, bytes, sent_bytes,
                 std::chrono::duration<double>(std::chrono::steady_clock::now() - start).count(), dest, source);
  }

  std::unique_ptr<Communicator> inner_;
  std::shared_ptr<CommunicationLog> log_;
};

}  // namespace kmamba

#endif
