// Tokenizers: text <-> token ids (docs/algorithms.md §5).
//
//   ByteTokenizer     one token per byte, ids 0..255: the default for models trained by kmamba.
//   BpeTokenizer      the byte-level BPE of GPT-2 / GPT-NeoX read from a Hugging Face tokenizer.json
//                     (the tokenizer of the released Mamba checkpoints).
//   StreamingDecoder  turns ids arriving one at a time into text made of whole UTF-8 characters only,
//                     holding back the bytes of a character that is split across tokens.
//
// Text is a std::string of bytes. decode() concatenates the bytes of the tokens, so
// decode(encode(text)) == text exactly (for BpeTokenizer with add_prefix_space, after the leading
// space that encoding added, as in Hugging Face). decode() may return incomplete UTF-8 when the ids
// end inside a character; StreamingDecoder never does.
//
//   auto tokenizer = kmamba::load_tokenizer(model_dir);          // tokenizer.json, else bytes
//   std::vector<std::int64_t> ids = tokenizer->encode("Hello, world");
//   kmamba::StreamingDecoder stream(*tokenizer);
//   for (std::int64_t id : generated) std::cout << stream.push(id) << std::flush;
//   std::cout << stream.flush();
#ifndef KMAMBA_MODELS_TOKENIZER_HPP
#define KMAMBA_MODELS_TOKENIZER_HPP

#include <cstdint>
#include <memory>
#include <string>
#include <utility>
#include <vector>

namespace kmamba {

/// A special (added) token: text matched verbatim before any other tokenization.
struct SpecialToken {
  std::int64_t id = 0;
  std::string content;
};

/// Text <-> token ids. Implementations are immutable after construction, so one tokenizer may be
/// used from several threads at once.
class Tokenizer {
 public:
  virtual ~Tokenizer() = default;

  /// The token ids of `text`. Adds no BOS/EOS token. Throws kmamba::UserError for text the
  /// tokenizer cannot represent (for BpeTokenizer: text that is not valid UTF-8).
  virtual std::vector<std::int64_t> encode(const std::string& text) const = 0;

  /// One more than the largest token id (ids in [0, vocab_size()) may still have gaps).
  virtual std::int64_t vocab_size() const = 0;

  /// The bytes token `id` stands for. Throws kmamba::UserError if `id` is not a token.
  virtual const std::string& token_bytes(std::int64_t id) const = 0;

  /// Whether `id` is a special token (see special_tokens()).
  virtual bool is_special(std::int64_t id) const = 0;

  /// The special tokens, in id order (empty for ByteTokenizer).
  virtual std::vector<SpecialToken> special_tokens() const = 0;

  /// The end-of-sequence token, or -1 if the tokenizer has none.
  virtual std::int64_t eos_id() const = 0;

  /// The concatenated bytes of `ids`; with `skip_special` special tokens contribute nothing.
  /// Throws kmamba::UserError for an id that is not a token.
  std::string decode(const std::vector<std::int64_t>& ids, bool skip_special = false) const;
};

/// One token per byte: token b is the byte b. vocab_size() == 256, no special tokens, no EOS.
/// Any byte string encodes (UTF-8 or not) and decodes back exactly.
class ByteTokenizer final : public Tokenizer {
 public:
  ByteTokenizer();

  std::vector<std::int64_t> encode(const std::string& text) const override;
  std::int64_t vocab_size() const override { return 256; }
  const std::string& token_bytes(std::int64_t id) const override;
  bool is_special(std::int64_t) const override { return false; }
  std::vector<SpecialToken> special_tokens() const override { return {}; }
  std::int64_t eos_id() const override { return -1; }

 private:
  std::vector<std::string> bytes_;
};

/// GPT-2 / GPT-NeoX byte-level BPE from a Hugging Face tokenizer.json.
///
/// What is read: model (type "BPE": vocab, merges in the "a b" string form or the ["a", "b"] array
/// form, unk_token, ignore_merges), added_tokens (id, content, special, single_word, lstrip,
/// rstrip), pre_tokenizer (ByteLevel, alone or as the only member of a Sequence: add_prefix_space,
/// use_regex), normalizer and decoder (checked, see below). post_processor is not applied: encode()
/// adds no BOS/EOS (GPT-NeoX's adds none either).
///
/// Encoding follows Hugging Face `tokenizers`:
///  1. added tokens are cut out of the text first: leftmost match, the longest one at a position,
///     honouring single_word (no letter, digit or '_' on either side), lstrip and rstrip (the
///     match absorbs the whitespace before / after it);
///  2. every other piece gets a leading space if add_prefix_space and it does not start with one,
///     and is split by the GPT-2 pattern
///       's|'t|'re|'ve|'m|'ll|'d| ?\p{L}+| ?\p{N}+| ?[^\s\p{L}\p{N}]+|\s+(?!\S)|\s+
///     implemented by hand over code points: \p{L} and \p{N} are the Unicode general categories
///     L and N from a generated table (scripts/gen_unicode_ranges.py, Unicode 14.0), \s is the
///     Unicode White_Space property;
///  3. each split's bytes are mapped to the GPT-2 byte-to-unicode alphabet and merged by BPE
///     (always the lowest-ranked adjacent pair, leftmost on ties).
///
/// Deviation: GPT-NeoX's tokenizer.json names an NFC normalizer, which kmamba does not apply
/// (no Unicode composition tables). Text already in NFC, which includes nearly all text (precomposed
/// characters), encodes exactly as Hugging Face does; text with decomposed sequences such as
/// "e" + U+0301 gets other ids, which still decode back to the same bytes. Other normalizers, and
/// decoders other than ByteLevel, are rejected.
class BpeTokenizer final : public Tokenizer {
 public:
  /// Reads the tokenizer.json at `path`. `eos_token` names the end-of-sequence token; if it is
  /// not a token, eos_id() is -1. Throws kmamba::UserError naming the file and the field for
  /// anything malformed or unsupported.
  static BpeTokenizer from_file(const std::string& path, const std::string& eos_token = "<|endoftext|>");

  /// The same from the text of a tokenizer.json; `source` names it in error messages.
  static BpeTokenizer from_json(const std::string& json_text, const std::string& source = "tokenizer.json",
                                const std::string& eos_token = "<|endoftext|>");

  std::vector<std::int64_t> encode(const std::string& text) const override;
  std::int64_t vocab_size() const override;
  const std::string& token_bytes(std::int64_t id) const override;
  bool is_special(std::int64_t id) const override;
  std::vector<SpecialToken> special_tokens() const override;
  std::int64_t eos_id() const override;

  /// The id of the token whose vocabulary string (byte-level alphabet, e.g. "Ġthe") or added-token
  /// content is `token`, or -1.
  std::int64_t token_to_id(const std::string& token) const;

  /// Whether the pre-tokenizer adds a leading space to text that lacks one.
  bool add_prefix_space() const;

 private:
  struct State;
  explicit BpeTokenizer(std::shared_ptr<const State> state);
  std::shared_ptr<const State> state_;
};

/// The tokenizer of the model directory `model_dir`: BpeTokenizer if it holds a tokenizer.json,
/// otherwise ByteTokenizer (the tokenizer of kmamba's byte-level models). When the byte fallback
/// meets a model whose config.json gives a vocab_size above 256, that model was trained with
/// another tokenizer and bytes give it the wrong ids: a warning naming the directory goes to
/// stderr, once per process. Throws kmamba::UserError naming the file for a tokenizer.json it
/// cannot read or a config.json that is not JSON.
std::unique_ptr<Tokenizer> load_tokenizer(const std::string& model_dir);

/// The tokenizer files of a Hugging Face model directory held in memory, so that they travel with
/// the model into the checkpoints trained from it (Trainer::set_tokenizer_files): tokenizer.json
/// and, where present, its companions tokenizer_config.json and special_tokens_map.json.
struct TokenizerFiles {
  /// The companions of tokenizer.json that travel with it.
  static constexpr const char* companions[2] = {"tokenizer_config.json", "special_tokens_map.json"};

  /// (file name, content), tokenizer.json first; empty: no tokenizer.
  std::vector<std::pair<std::string, std::string>> files;

  /// The tokenizer files of `dir`; none when it holds no tokenizer.json (companions alone are no
  /// tokenizer). Throws kmamba::UserError naming a file that exists but cannot be read.
  static TokenizerFiles from_directory(const std::string& dir);
  /// The tokenizer.json at `path` (whatever its name), with the companions beside it when it is
  /// named tokenizer.json. Throws kmamba::UserError naming the file when it cannot be read.
  static TokenizerFiles from_file(const std::string& path);

  bool empty() const { return files.empty(); }
  /// Writes the files into the existing directory `dir`; kmamba::UserError naming a file on failure.
  void write(const std::string& dir) const;
};

/// Incremental detokenizer for streaming output. push() takes ids one at a time and returns only
/// whole, valid UTF-8 characters; the bytes of a character that continues in a later token are
/// held back. Bytes that can never form a character (invalid UTF-8) come out as U+FFFD, one per
/// maximal invalid subsequence, so the concatenated output is always valid UTF-8 and equals
/// decode(ids) whenever that is valid UTF-8. Holds a reference to the tokenizer, which must
/// outlive it.
class StreamingDecoder {
 public:
  /// With `skip_special`, special tokens produce no text.
  explicit StreamingDecoder(const Tokenizer& tokenizer, bool skip_special = false);

  /// Appends token `id` and returns the text that is now complete (often empty).
  std::string push(std::int64_t id);

  /// Returns the held-back bytes (an incomplete character becomes U+FFFD) and empties the decoder,
  /// ready for a new sequence. Call it at the end of a sequence.
  std::string flush();

  /// Number of bytes held back.
  std::size_t pending_bytes() const { return pending_.size(); }

 private:
  const Tokenizer* tokenizer_;
  bool skip_special_;
  std::string pending_;
};

}  // namespace kmamba

#endif
