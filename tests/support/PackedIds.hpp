// Packed sequence ids (seq_idx) for the tests of packed variable-length batches: a fixed pattern
// of document starts per row, the documents of a row, and the ids as a device tensor.
#ifndef KMAMBA_TESTS_SUPPORT_PACKED_IDS_HPP
#define KMAMBA_TESTS_SUPPORT_PACKED_IDS_HPP

#include <kmamba/core/Tensor.hpp>

#include <Kokkos_Core.hpp>

#include <algorithm>
#include <cstddef>
#include <cstdint>
#include <string>
#include <utility>
#include <vector>

namespace kmamba {
namespace test {

/// Packed sequence ids (batch, seqlen), row-major: row b's documents start at the positions of
/// starts[b % 3] below seqlen (documents of 1 and 2 tokens, one at the row's end, and a last one
/// shorter than the widest conv state); ids need not increase, only differ from the previous one.
inline std::vector<std::int64_t> packed_ids(int batch, int seqlen) {
  const std::vector<std::vector<int>> starts = {{1, 3, 4, 20, 35}, {2, 9, 10, seqlen - 1}, {5, 6, 7, 8}};
  std::vector<std::int64_t> ids;
  for (int b = 0; b < batch; ++b) {
    std::int64_t id = 3 + b;  // (7 id + 5) mod 11 cycles through ten values without a fixed point from here
    for (int t = 0; t < seqlen; ++t) {
      for (int start : starts[b % 3]) {
        if (start == t) id = (id * 7 + 5) % 11;
      }
      ids.push_back(id);
    }
  }
  return ids;
}

/// The documents [t0, t1) of row b of packed ids (batch, seqlen).
inline std::vector<std::pair<int, int>> documents(const std::vector<std::int64_t>& ids, int seqlen, int b) {
  std::vector<std::pair<int, int>> docs;
  const std::size_t row = static_cast<std::size_t>(b) * seqlen;
  int t0 = 0;
  for (int t = 1; t <= seqlen; ++t) {
    if (t == seqlen || ids[row + t] != ids[row + t - 1]) {
      docs.emplace_back(t0, t);
      t0 = t;
    }
  }
  return docs;
}

/// packed_ids(batch, seqlen) as a new (batch, seqlen) tensor in Mem.
template <class Mem>
kmamba::Tensor2<std::int64_t, Mem> device_packed_ids(int batch, int seqlen) {
  auto seq = kmamba::allocate_uninitialized<kmamba::Tensor2<std::int64_t, Mem>>("kmamba::test::seq_idx", batch, seqlen);
  const std::vector<std::int64_t> ids = packed_ids(batch, seqlen);
  auto h = Kokkos::create_mirror_view(seq);
  std::copy(ids.begin(), ids.end(), h.data());
  Kokkos::deep_copy(seq, h);
  return seq;
}

}  // namespace test
}  // namespace kmamba

#endif
