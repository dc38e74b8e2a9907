#include <kmamba/core/Error.hpp>
#include <kmamba/core/Files.hpp>
#include <kmamba/core/Random.hpp>
#include <kmamba/models/Data.hpp>
#include <kmamba/models/TokenFile.hpp>

#include <algorithm>
#include <cstdio>
#include <limits>
#include <numeric>
#include <sstream>

namespace kmamba {
namespace {

// The random numbers of one sequence: Philox4x32-10 keyed by the seed, counting through blocks of
// four words for (stream, sequence number), so every sequence is independent of every other and
// of the order in which they are generated.
class SequenceRandom {
 public:
  SequenceRandom(std::uint64_t seed, std::uint32_t stream, std::uint64_t sequence)
      : key0_(static_cast<std::uint32_t>(seed)),
        key1_(static_cast<std::uint32_t>(seed >> 32)),
        sequence_(sequence),
        stream_(stream) {}

  std::uint32_t next32() {
    if (used_ == 4) {
      const Kokkos::Array<std::uint32_t, 4> counter = {
          {block_, static_cast<std::uint32_t>(sequence_), static_cast<std::uint32_t>(sequence_ >> 32), stream_}};
      words_ = philox4x32(counter, key0_, key1_);
      ++block_;
      used_ = 0;
    }
    return words_[used_++];
  }

  std::uint64_t next64() {
    const std::uint64_t hi = next32();
    return (hi << 32) | next32();
  }

  // Uniform in [0, n), unbiased (rejects the top partial range of 2^64).
  std::uint64_t below(std::uint64_t n) {
    KMAMBA_ASSERT(n > 0, "SequenceRandom::below: empty range");
    const std::uint64_t limit =
        std::numeric_limits<std::uint64_t>::max() - std::numeric_limits<std::uint64_t>::max() % n;
    std::uint64_t x = next64();
    while (x >= limit) x = next64();
    return x % n;
  }

  // The first `count` entries of a uniformly random permutation of [begin, end).
  std::vector<std::int64_t> distinct(std::int64_t begin, std::int64_t end, std::int64_t count) {
    std::vector<std::int64_t> pool(static_cast<std::size_t>(end - begin));
    std::iota(pool.begin(), pool.end(), begin);
    for (std::int64_t i = 0; i < count; ++i) {
      const auto j =
          static_cast<std::size_t>(i) + static_cast<std::size_t>(below(static_cast<std::uint64_t>(end - begin - i)));
      std::swap(pool[static_cast<std::size_t>(i)], pool[j]);
    }
    pool.resize(static_cast<std::size_t>(count));
    return pool;
  }

 private:
  std::uint32_t key0_, key1_;
  std::uint64_t sequence_;
  std::uint32_t stream_;
  std::uint32_t block_ = 0;
  Kokkos::Array<std::uint32_t, 4> words_ = {{0, 0, 0, 0}};
  int used_ = 4;
};

// Stream tags: one per (data set kind, split), so no two kinds or splits share random numbers.
std::uint32_t stream_tag(std::uint32_t kind, Split split) {
  return (kind << 1) | (split == Split::Validation ? 1u : 0u);
}

void check_batch_request(const char* function, std::int64_t index, std::int64_t batch_size) {
  KMAMBA_REQUIRE(index >= 0, function << ": batch index must be >= 0, got " << index);
  KMAMBA_REQUIRE(batch_size > 0, function << ": batch size must be positive, got " << batch_size);
}

TokenBatch allocate_batch(std::int64_t batch_size, std::int64_t seqlen) {
  TokenBatch b;
  b.ids = allocate_uninitialized<Tensor2<std::int64_t, Kokkos::HostSpace>>("kmamba::data::ids", batch_size, seqlen);
  b.targets =
      allocate_uninitialized<Tensor2<std::int64_t, Kokkos::HostSpace>>("kmamba::data::targets", batch_size, seqlen);
  return b;
}

std::string hex64(std::uint64_t x) {
  char text[17];
  std::snprintf(text, sizeof(text), "%016llx", static_cast<unsigned long long>(x));
  return text;
}

// The file's bytes; a FIFO or a device is refused rather than read forever.
std::string read_file(const std::string& path) {
  return read_input_file(path, std::numeric_limits<std::uint64_t>::max(), "kmamba::TokenDataset");
}

const unsigned char* bytes_of(const std::string& text) { return reinterpret_cast<const unsigned char*>(text.data()); }

// One token per byte of a text file.
std::vector<std::uint32_t> byte_tokens(const std::string& text) {
  return std::vector<std::uint32_t>(bytes_of(text), bytes_of(text) + text.size());
}

}  // namespace

const char* split_name(Split split) { return split == Split::Train ? "train" : "validation"; }

std::int64_t TokenBatch::predicted_tokens() const {
  std::int64_t n = 0;
  for (std::size_t b = 0; b < targets.extent(0); ++b) {
    for (std::size_t t = 0; t < targets.extent(1); ++t) n += targets(b, t) != ignore_index ? 1 : 0;
  }
  return n;
}

// ---------------------------------------------------------------------------------------------
// Associative recall

void AssociativeRecallConfig::validate() const {
  KMAMBA_REQUIRE(num_kv_pairs >= 1, "kmamba::AssociativeRecallConfig: num_kv_pairs must be >= 1, got " << num_kv_pairs);
  KMAMBA_REQUIRE(vocab_size >= 1 + 2 * num_kv_pairs,
                 "kmamba::AssociativeRecallConfig: vocab_size "
                     << vocab_size << " is too small for " << num_kv_pairs
                     << " distinct keys and values plus the blank (needs >= " << 1 + 2 * num_kv_pairs << ")");
  KMAMBA_REQUIRE(num_queries >= 0,
                 "kmamba::AssociativeRecallConfig: num_queries must be >= 0 (0: one per pair), got " << num_queries);
  KMAMBA_REQUIRE(seqlen >= 2 * static_cast<std::int64_t>(num_kv_pairs) + queries(),
                 "kmamba::AssociativeRecallConfig: seqlen "
                     << seqlen << " cannot hold " << num_kv_pairs << " key-value pairs and " << queries()
                     << " queries (needs >= " << 2 * num_kv_pairs + queries() << ")");
}

AssociativeRecallTask::AssociativeRecallTask(const AssociativeRecallConfig& config) : config_(config) {
  config_.validate();
}

std::int64_t AssociativeRecallTask::value_begin() const { return 1 + (config_.vocab_size - 1) / 2; }

TokenBatch AssociativeRecallTask::batch(std::int64_t index, std::int64_t batch_size) const {
  return batch(Split::Train, index, batch_size);
}

TokenBatch AssociativeRecallTask::batch(Split split, std::int64_t index, std::int64_t batch_size) const {
  check_batch_request("kmamba::AssociativeRecallTask::batch", index, batch_size);
  const std::int64_t seqlen = config_.seqlen, pairs = config_.num_kv_pairs, context = 2 * pairs,
                     queries = config_.queries();
  TokenBatch out = allocate_batch(batch_size, seqlen);
  for (std::int64_t b = 0; b < batch_size; ++b) {
    SequenceRandom random(config_.seed, stream_tag(1, split), static_cast<std::uint64_t>(index * batch_size + b));
    const std::vector<std::int64_t> keys = random.distinct(key_begin(), value_begin(), pairs);
    const std::vector<std::int64_t> values = random.distinct(value_begin(), config_.vocab_size, pairs);
    std::vector<std::int64_t> positions = random.distinct(context, seqlen, queries);
    std::sort(positions.begin(), positions.end());
    std::vector<std::int64_t> order;  // rounds of random permutations of the pairs
    while (static_cast<std::int64_t>(order.size()) < queries) {
      const std::vector<std::int64_t> round = random.distinct(0, pairs, pairs);
      order.insert(order.end(), round.begin(), round.end());
    }
    for (std::int64_t t = 0; t < seqlen; ++t) {
      out.ids(b, t) = blank_token;
      out.targets(b, t) = ignore_index;
    }
    for (std::int64_t p = 0; p < pairs; ++p) {
      out.ids(b, 2 * p) = keys[static_cast<std::size_t>(p)];
      out.ids(b, 2 * p + 1) = values[static_cast<std::size_t>(p)];
    }
    for (std::int64_t q = 0; q < queries; ++q) {
      const auto pair = static_cast<std::size_t>(order[static_cast<std::size_t>(q)]);
      const std::int64_t t = positions[static_cast<std::size_t>(q)];
      out.ids(b, t) = keys[pair];
      out.targets(b, t) = values[pair];
    }
  }
  return out;
}

std::string AssociativeRecallTask::fingerprint() const {
  std::ostringstream s;
  s << "associative_recall(vocab_size=" << config_.vocab_size << ", seqlen=" << config_.seqlen
    << ", num_kv_pairs=" << config_.num_kv_pairs << ", num_queries=" << config_.queries() << ", seed=" << config_.seed
    << ")";
  return s.str();
}

// ---------------------------------------------------------------------------------------------
// Token data sets

TokenDataset::TokenDataset(std::vector<std::uint32_t> tokens, int vocab_size, const TokenDatasetConfig& config,
                           std::string source)
    : tokens_(std::move(tokens)), vocab_size_(vocab_size), config_(config), source_(std::move(source)) {
  KMAMBA_REQUIRE(vocab_size_ >= 1,
                 "kmamba::TokenDataset: " << source_ << ": vocabulary size must be >= 1, got " << vocab_size_);
  KMAMBA_REQUIRE(config_.seqlen >= 1, "kmamba::TokenDataset: seqlen must be >= 1, got " << config_.seqlen);
  KMAMBA_REQUIRE(config_.validation_fraction >= 0.0 && config_.validation_fraction < 1.0,
                 "kmamba::TokenDataset: validation_fraction must lie in [0, 1), got " << config_.validation_fraction);
  KMAMBA_REQUIRE(!tokens_.empty(), "kmamba::TokenDataset: " << source_ << " holds no tokens");
  KMAMBA_REQUIRE(config_.document_end >= -1 && config_.document_end < vocab_size_,
                 "kmamba::TokenDataset: " << source_ << ": the end-of-document token " << config_.document_end
                                          << " is not below the vocabulary size " << vocab_size_
                                          << " (-1: no documents)");
  for (std::size_t i = 0; i < tokens_.size(); ++i) {
    KMAMBA_REQUIRE(tokens_[i] < static_cast<std::uint32_t>(vocab_size_),
                   "kmamba::TokenDataset: " << source_ << ": token " << i << " is " << tokens_[i]
                                            << ", not below the vocabulary size " << vocab_size_);
  }
  const auto n = static_cast<std::int64_t>(tokens_.size());
  const auto held_out = static_cast<std::int64_t>(static_cast<double>(n) * config_.validation_fraction);
  train_size_ = n - held_out;
  const std::int64_t window = config_.seqlen + 1;
  KMAMBA_REQUIRE(train_size_ >= window, "kmamba::TokenDataset: " << source_ << " is too short: its training split has "
                                                                 << train_size_ << " tokens, a window of seqlen "
                                                                 << config_.seqlen << " needs " << window
                                                                 << " (use a shorter seqlen or more data)");
  KMAMBA_REQUIRE(held_out == 0 || held_out >= window,
                 "kmamba::TokenDataset: " << source_ << " is too short: its validation split (the last "
                                          << config_.validation_fraction * 100.0 << "%) has " << held_out
                                          << " tokens, a window of seqlen " << config_.seqlen << " needs " << window
                                          << " (use a shorter seqlen, more data or validation fraction 0)");
}

TokenDataset TokenDataset::from_file(const std::string& path, const TokenDatasetConfig& config) {
  const std::string bytes = read_file(path);
  if (has_token_magic(bytes_of(bytes), bytes.size())) {
    int vocab = 0;
    std::vector<std::uint32_t> tokens = parse_token_file(bytes_of(bytes), bytes.size(), path, vocab);
    return TokenDataset(std::move(tokens), vocab, config, "token file '" + path + "'");
  }
  KMAMBA_REQUIRE(!bytes.empty(), "kmamba::TokenDataset: '" << path << "' is empty");
  return TokenDataset(byte_tokens(bytes), 256, config, "text file '" + path + "'");
}

TokenDataset TokenDataset::from_text(const std::string& path, const TokenDatasetConfig& config) {
  const std::string bytes = read_file(path);
  KMAMBA_REQUIRE(!bytes.empty(), "kmamba::TokenDataset: '" << path << "' is empty");
  return TokenDataset(byte_tokens(bytes), 256, config, "text file '" + path + "'");
}

TokenDataset TokenDataset::from_token_file(const std::string& path, const TokenDatasetConfig& config) {
  int vocab = 0;
  const std::string bytes = read_file(path);
  std::vector<std::uint32_t> tokens = parse_token_file(bytes_of(bytes), bytes.size(), path, vocab);
  return TokenDataset(std::move(tokens), vocab, config, "token file '" + path + "'");
}

void TokenDataset::write_token_file(const std::string& path, const std::vector<std::uint32_t>& tokens, int vocab_size) {
  const std::vector<unsigned char> bytes = encode_token_file(tokens, vocab_size);
  write_output_file(path, bytes.data(), bytes.size(), "kmamba::TokenDataset::write_token_file");
}

std::int64_t TokenDataset::size(Split split) const {
  return split == Split::Train ? train_size_ : static_cast<std::int64_t>(tokens_.size()) - train_size_;
}

TokenBatch TokenDataset::batch(Split split, std::int64_t index, std::int64_t batch_size) const {
  check_batch_request("kmamba::TokenDataset::batch", index, batch_size);
  const std::int64_t n = size(split);
  KMAMBA_REQUIRE(n > 0, "kmamba::TokenDataset::batch: " << source_ << " has no " << split_name(split)
                                                        << " split (validation fraction 0)");
  const std::int64_t begin = split == Split::Train ? 0 : train_size_;
  const std::int64_t seqlen = config_.seqlen;
  const auto starts = static_cast<std::uint64_t>(n - seqlen);  // windows of seqlen + 1 tokens
  const bool packed = config_.document_end >= 0;
  TokenBatch out = allocate_batch(batch_size, seqlen);
  if (packed) {
    out.seq_idx =
        allocate_uninitialized<Tensor2<std::int64_t, Kokkos::HostSpace>>("kmamba::data::seq_idx", batch_size, seqlen);
  }
  for (std::int64_t b = 0; b < batch_size; ++b) {
    SequenceRandom random(config_.seed, stream_tag(2, split), static_cast<std::uint64_t>(index * batch_size + b));
    const std::int64_t start = begin + static_cast<std::int64_t>(random.below(starts));
    std::int64_t document = 0;  // end-of-document tokens before t in the window
    for (std::int64_t t = 0; t < seqlen; ++t) {
      const std::int64_t id = tokens_[static_cast<std::size_t>(start + t)];
      const bool ends_document = packed && id == config_.document_end;
      out.ids(b, t) = id;
      out.targets(b, t) = ends_document ? ignore_index : tokens_[static_cast<std::size_t>(start + t + 1)];
      if (packed) out.seq_idx(b, t) = document;
      if (ends_document) ++document;
    }
  }
  return out;
}

std::string TokenDataset::fingerprint() const {
  std::uint64_t hash = 1469598103934665603ull;  // FNV-1a over the tokens' 32-bit values
  for (const std::uint32_t t : tokens_) {
    for (int i = 0; i < 4; ++i) {
      hash ^= (t >> (8 * i)) & 0xffu;
      hash *= 1099511628211ull;
    }
  }
  std::ostringstream s;
  s << "tokens(count=" << tokens_.size() << ", vocab_size=" << vocab_size_ << ", fnv1a=" << hex64(hash)
    << ", seqlen=" << config_.seqlen << ", validation_fraction=" << config_.validation_fraction
    << ", seed=" << config_.seed;
  if (config_.document_end >= 0) s << ", document_end=" << config_.document_end;
  s << ")";
  return s.str();
}

}  // namespace kmamba
