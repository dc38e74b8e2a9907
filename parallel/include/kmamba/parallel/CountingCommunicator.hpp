// The communication audit: a Communicator that forwards every operation to another one and counts
// it, per mesh axis and operation, in a log shared with the communicators split from it. Tests
// use it to check the schedule of a parallel algorithm (which collectives, how many, how large).
//
//   auto log = std::make_shared<kmamba::CommunicationLog>();
//   kmamba::ProcessMesh mesh(std::make_unique<kmamba::CountingCommunicator>(
//       std::make_unique<kmamba::MpiCommunicator>(MPI_COMM_WORLD), log), config);
//   ...
//   log->tally("dp", "all_reduce").calls
#ifndef KMAMBA_PARALLEL_COUNTINGCOMMUNICATOR_HPP
#define KMAMBA_PARALLEL_COUNTINGCOMMUNICATOR_HPP

#include <kmamba/parallel/Communicator.hpp>

#include <cstdint>
#include <map>
#include <memory>
#include <string>
#include <utility>

namespace kmamba {

/// What a CountingCommunicator and its splits did.
class CommunicationLog {
 public:
  struct Tally {
    std::int64_t calls = 0;
    std::int64_t elements = 0;  ///< Σ of the logical buffer sizes (distributed.md §0's M, in elements)
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
  void record(const std::string& axis, const std::string& operation, std::size_t elements) {
    Tally& t = tallies_[{axis, operation}];
    ++t.calls;
    t.elements += static_cast<std::int64_t>(elements);
  }
  void clear() { tallies_.clear(); }

 private:
  std::map<std::pair<std::string, std::string>, Tally> tallies_;
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
    log_->record(axis(), "all_reduce", count);
    inner_->do_all_reduce(send, recv, count, type, op, stream);
  }
  void do_reduce_scatter(const void* send, void* recv, std::size_t recv_count, DataType type, ReduceOp op,
                         const StreamContext& stream) const override {
    log_->record(axis(), "reduce_scatter", recv_count * static_cast<std::size_t>(size()));
    inner_->do_reduce_scatter(send, recv, recv_count, type, op, stream);
  }
  void do_all_gather(const void* send, void* recv, std::size_t send_count, DataType type,
                     const StreamContext& stream) const override {
    log_->record(axis(), "all_gather", send_count * static_cast<std::size_t>(size()));
    inner_->do_all_gather(send, recv, send_count, type, stream);
  }
  void do_broadcast(void* data, std::size_t count, DataType type, int root,
                    const StreamContext& stream) const override {
    log_->record(axis(), "broadcast", count);
    inner_->do_broadcast(data, count, type, root, stream);
  }
  void do_send_recv(const void* send, std::size_t send_count, int dest, void* recv, std::size_t recv_count, int source,
                    DataType type, const StreamContext& stream) const override {
    log_->record(axis(), "send_recv", send_count + recv_count);
    inner_->do_send_recv(send, send_count, dest, recv, recv_count, source, type, stream);
  }
  void do_barrier() const override {
    log_->record(axis(), "barrier", 0);
    inner_->do_barrier();
  }
  bool native_average() const override { return inner_->native_average(); }

 private:
  std::unique_ptr<Communicator> inner_;
  std::shared_ptr<CommunicationLog> log_;
};

}  // namespace kmamba

#endif
