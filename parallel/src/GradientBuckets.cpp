#include <kmamba/parallel/GradientBuckets.hpp>

#include <algorithm>

namespace kmamba {

std::size_t default_bucket_elements(int ranks) {
  return std::max<std::size_t>(default_bucket_bytes / sizeof(float), static_cast<std::size_t>(std::max(ranks, 1)));
}

const char* gradient_compression_name(GradientCompression compression) {
  return impl::enum_table<const char*>(compression, {"none", "bf16", "powersgd"}, "unknown");
}

GradientCompression parse_gradient_compression(const std::string& name, const std::string& what) {
  if (name == "none") return GradientCompression::None;
  if (name == "bf16") return GradientCompression::Bf16;
  KMAMBA_REQUIRE(name == "powersgd",
                 what << ": unknown gradient compression '" << name << "' (expected none, bf16 or powersgd)");
  return GradientCompression::PowerSgd;
}

BucketLayout::BucketLayout(std::size_t elements, int ranks, std::size_t bucket_elements)
    : elements_(elements), ranks_(ranks) {
  KMAMBA_REQUIRE(ranks >= 1, "kmamba::BucketLayout: ranks must be >= 1, got " << ranks);
  const std::size_t r = static_cast<std::size_t>(ranks);
  std::size_t bucket = bucket_elements > 0 ? bucket_elements : default_bucket_elements(ranks);
  bucket = std::max(r, bucket / r * r);
  tail_begin_ = elements / r * r;
  for (std::size_t begin = 0; begin < tail_begin_; begin += bucket) {
    Bucket b;
    b.begin = begin;
    b.size = std::min(bucket, tail_begin_ - begin);
    b.shard_offset = shard_elements_;
    shard_elements_ += b.size / r;
    buckets_.push_back(b);
  }
  shard_elements_ += elements - tail_begin_;
}

}  // namespace kmamba
