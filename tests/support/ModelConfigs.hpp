// The small models of the model-level tests, spelt from their dimensions in one place: every field
// a test does not name keeps ModelConfig's default (expand 2, d_conv 4, conv bias, no linear bias).
#ifndef KMAMBA_TESTS_SUPPORT_MODEL_CONFIGS_HPP
#define KMAMBA_TESTS_SUPPORT_MODEL_CONFIGS_HPP

#include <kmamba/models/Config.hpp>

#include <tuple>

namespace kmamba {
namespace test {

/// The dimensions a small test model sets.
struct ModelDims {
  int d_model, n_layer, vocab_size, d_state, headdim, chunk_size;
  int ngroups = 1;
};

/// A validated config of `mixer` with the dimensions `dims`.
inline ModelConfig model_config(MixerKind mixer, const ModelDims& dims) {
  ModelConfig c;
  c.mixer = mixer;
  std::tie(c.d_model, c.n_layer, c.vocab_size, c.d_state, c.headdim, c.chunk_size, c.ngroups) =
      std::tie(dims.d_model, dims.n_layer, dims.vocab_size, dims.d_state, dims.headdim, dims.chunk_size, dims.ngroups);
  c.validate();
  return c;
}

}  // namespace test
}  // namespace kmamba

#endif
