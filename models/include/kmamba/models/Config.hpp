// Model configuration: every field of Hugging Face's MambaConfig / Mamba2Config and of the
// mamba_ssm MambaConfig, read from config.json (either flavour), validated, and written back in the
// Hugging Face layout.
#ifndef KMAMBA_MODELS_CONFIG_HPP
#define KMAMBA_MODELS_CONFIG_HPP

#include <cstdint>
#include <limits>
#include <string>

namespace kmamba {

enum class MixerKind { Mamba1, Mamba2, Mamba3 };

/// "Mamba1", "Mamba2", "Mamba3".
const char* mixer_name(MixerKind kind);

struct ModelConfig {
  MixerKind mixer = MixerKind::Mamba2;

  // Language model (mamba_ssm names; HF names in comments).
  int d_model = 768;                // hidden_size
  int n_layer = 24;                 // num_hidden_layers
  int vocab_size = 50277;           // vocab_size (the real vocabulary)
  int pad_vocab_size_multiple = 1;  // mamba_ssm pads the embedding rows to a multiple of this
  bool tie_embeddings = true;       // tie_word_embeddings
  bool rms_norm = true;
  bool residual_in_fp32 = true;
  double norm_epsilon = 1e-5;  // layer_norm_epsilon
  int d_intermediate = 0;      // GatedMLP width (0: none; kmamba supports 0 only)
  int pad_token_id = 0, bos_token_id = 0, eos_token_id = 0;
  double initializer_range = 0.1;
  bool rescale_prenorm_residual = true;

  // Mixer (Mamba-1/2/3).
  int d_state = 128;  // state_size
  int d_conv = 4;     // conv_kernel
  int expand = 2;
  int dt_rank = 0;   // time_step_rank; 0 = "auto" = ceil(d_model / 16) (Mamba-1)
  int headdim = 64;  // head_dim (Mamba-2/3)
  int nheads = 0;    // num_heads; 0 = d_inner / headdim
  int ngroups = 1;   // n_groups
  int chunk_size = 256;
  bool conv_bias = true;  // use_conv_bias
  bool bias = false;      // use_bias
  bool norm_before_gate = false;
  double dt_min = 1e-3, dt_max = 0.1, dt_init_floor = 1e-4, dt_scale = 1.0;
  bool dt_init_random = true;  // time_step_init_scheme "random" (else "constant")
  double dt_limit_min = 0.0, dt_limit_max = std::numeric_limits<double>::infinity();  // time_step_limit
  // Mamba-3.
  double rope_fraction = 0.5;
  double A_floor = 1e-4;
  bool is_mimo = false;
  int mimo_rank = 4;
  bool is_outproj_norm = false;
  // The initial value of every B_bias and C_bias entry (a kmamba addition; the reference's is 1).
  // Initialisation only: config.json does not carry it (mamba_ssm's Mamba3 takes no such argument).
  double bc_bias_init = 1.0;

  int d_inner() const { return expand * d_model; }
  int num_heads() const { return nheads > 0 ? nheads : d_inner() / headdim; }
  int resolved_dt_rank() const { return dt_rank > 0 ? dt_rank : (d_model + 15) / 16; }
  /// Rows of the embedding table: vocab_size rounded up to pad_vocab_size_multiple.
  int padded_vocab_size() const;

  /// Throws kmamba::UserError naming the first inconsistent field and why.
  void validate() const;

  /// Parses config.json text in the HF (model_type "mamba" / "mamba2") or mamba_ssm layout
  /// (d_model, n_layer, ssm_cfg) with kmamba::parse_json. The sizes (hidden_size,
  /// num_hidden_layers, vocab_size; d_model, n_layer, vocab_size) are required, the other fields
  /// default as transformers / mamba_ssm do. `source` names the file in error messages. Validates.
  static ModelConfig from_json(const std::string& json_text, const std::string& source);
  /// Reads and parses a config.json file (a regular file of at most 16 MB).
  static ModelConfig load(const std::string& path);
  /// The HF layout (MambaForCausalLM / Mamba2ForCausalLM), as transformers writes it, for
  /// transformers 4 and 5: rescale_prenorm_residual false (an initialisation setting, which
  /// transformers 5 would apply to the loaded out_proj weights) and an infinite time_step_limit
  /// bound as Python's json writes it, the bare token Infinity (from_json reads it).
  std::string to_hf_json() const;
  /// Writes to_hf_json() to `path` through kmamba::write_output_file (atomically for a regular file).
  void save(const std::string& path) const;
};

}  // namespace kmamba

#endif
