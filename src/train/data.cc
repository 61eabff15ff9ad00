#include "epx/train/data.h"

#include <algorithm>
#include <cmath>
#include <cstring>
#include <numbers>

#include "epx/core/input_file.h"

namespace epx {
namespace {

// Streams of the counter-based generator, per task.
constexpr uint64_t kStreamCluster = 0;  // synthetic: the cluster of sample i
constexpr uint64_t kStreamNoise = 1;    // synthetic: x's offset from its centre
constexpr uint64_t kStreamCentre = 2;
constexpr uint64_t kStreamWeight = 3;
constexpr uint64_t kStreamBias = 4;
constexpr uint64_t kStreamPosition = 0;  // text: where window i starts

constexpr int kMaxDim = 8192;
constexpr int kMaxClusters = 65536;
constexpr int64_t kMaxMapElements = int64_t{1} << 24;
constexpr double kMaxZipfS = 16;
constexpr double kMaxSpread = 100;
constexpr int kMaxWindow = 1 << 20;
// Standard deviation of the biases b_c; A_c carries the rest of the unit variance.
constexpr double kBiasStd = 0.2;

}  // namespace

// ---- ZipfDistribution -------------------------------------------------------

ZipfDistribution::ZipfDistribution(int n, double s) : s_(s) {
  EPX_CHECK_GE(n, 1);
  EPX_CHECK(std::isfinite(s) && s >= 0);
  probability_.resize(static_cast<std::size_t>(n));
  cdf_.resize(static_cast<std::size_t>(n));
  double total = 0;
  for (int i = 0; i < n; ++i) {
    probability_[i] = std::pow(static_cast<double>(i) + 1, -s);
    total += probability_[i];
  }
  double running = 0;
  for (int i = 0; i < n; ++i) {
    probability_[i] /= total;
    running += probability_[i];
    cdf_[i] = running;
  }
  cdf_[n - 1] = 1.0;
}

int ZipfDistribution::sample(double u) const {
  // The first i with u < cdf[i]; u >= 1 (outside the contract) gives n - 1.
  const auto it = std::upper_bound(cdf_.begin(), cdf_.end(), u);
  return static_cast<int>(std::min<std::ptrdiff_t>(it - cdf_.begin(), static_cast<std::ptrdiff_t>(cdf_.size()) - 1));
}

double ZipfDistribution::probability(int i) const {
  return i >= 0 && i < n() ? probability_[static_cast<std::size_t>(i)] : 0.0;
}

// ---- SyntheticTask -----------------------------------------------------------

Status SyntheticTaskConfig::validate() const {
  if (input_dim < 1 || input_dim > kMaxDim)
    return invalid_argument("SyntheticTaskConfig.input_dim = {} is outside [1, {}]", input_dim, kMaxDim);
  if (output_dim < 1 || output_dim > kMaxDim)
    return invalid_argument("SyntheticTaskConfig.output_dim = {} is outside [1, {}]", output_dim, kMaxDim);
  if (num_clusters < 1 || num_clusters > kMaxClusters)
    return invalid_argument("SyntheticTaskConfig.num_clusters = {} is outside [1, {}]", num_clusters, kMaxClusters);
  const int64_t map_elements = int64_t{num_clusters} * input_dim * output_dim;
  if (map_elements > kMaxMapElements)
    return invalid_argument(
        "SyntheticTaskConfig.num_clusters * input_dim * output_dim = {} * {} * {} = {} is above the limit {}",
        num_clusters, input_dim, output_dim, map_elements, kMaxMapElements);
  if (!(std::isfinite(zipf_s) && zipf_s >= 0 && zipf_s <= kMaxZipfS))
    return invalid_argument("SyntheticTaskConfig.zipf_s = {} is outside [0, {}]", zipf_s, kMaxZipfS);
  if (!(std::isfinite(cluster_spread) && cluster_spread >= 0 && cluster_spread <= kMaxSpread))
    return invalid_argument("SyntheticTaskConfig.cluster_spread = {} is outside [0, {}]", cluster_spread,
                            kMaxSpread);
  return Status::ok();
}

Result<SyntheticTask> SyntheticTask::create(const SyntheticTaskConfig& config) {
  EPX_RETURN_IF_ERROR(config.validate());
  return SyntheticTask(config);
}

SyntheticTask::SyntheticTask(const SyntheticTaskConfig& config)
    : config_(config), zipf_(config.num_clusters, config.zipf_s) {
  const int64_t in = config.input_dim, out = config.output_dim, k = config.num_clusters;
  const uint64_t seed = config.seed;
  // Centres: N(0, 1/in) coordinates, so norms are about 1.
  centres_.resize(static_cast<std::size_t>(k * in));
  const double centre_scale = 1.0 / std::sqrt(static_cast<double>(in));
  for (int64_t i = 0; i < k * in; ++i)
    centres_[i] = static_cast<float>(centre_scale * standard_normal(seed, kStreamCentre, i));
  // ||x||^2 is about 1 + spread^2, so A_ij ~ N(0, (1 - bias var) / (1 + spread^2))
  // gives (A x + b)_o a variance of about 1.
  const double spread2 = config.cluster_spread * config.cluster_spread;
  const double weight_scale = std::sqrt((1.0 - kBiasStd * kBiasStd) / (1.0 + spread2));
  weights_.resize(static_cast<std::size_t>(k * out * in));
  for (int64_t i = 0; i < k * out * in; ++i)
    weights_[i] = static_cast<float>(weight_scale * standard_normal(seed, kStreamWeight, i));
  biases_.resize(static_cast<std::size_t>(k * out));
  for (int64_t i = 0; i < k * out; ++i)
    biases_[i] = static_cast<float>(kBiasStd * standard_normal(seed, kStreamBias, i));
}

const float* SyntheticTask::centre(int cluster) const {
  EPX_CHECK(cluster >= 0 && cluster < config_.num_clusters);
  return centres_.data() + static_cast<std::size_t>(cluster) * config_.input_dim;
}

void SyntheticTask::evaluate(int cluster, const float* x, float* target) const {
  EPX_CHECK(cluster >= 0 && cluster < config_.num_clusters);
  const int in = config_.input_dim, out = config_.output_dim;
  const float* a = weights_.data() + static_cast<std::size_t>(cluster) * out * in;
  const float* b = biases_.data() + static_cast<std::size_t>(cluster) * out;
  for (int o = 0; o < out; ++o) {
    // Summed in double in column order: the same bits wherever the sample sits in a batch.
    double sum = b[o];
    const float* row = a + static_cast<std::size_t>(o) * in;
    for (int j = 0; j < in; ++j) sum += static_cast<double>(row[j]) * x[j];
    target[o] = static_cast<float>(std::tanh(sum));
  }
}

void SyntheticTask::fill(int64_t first, int64_t count, float* x, float* target, int32_t* cluster) const {
  EPX_CHECK_GE(first, 0);
  EPX_CHECK_GE(count, 0);
  if (count == 0) return;
  EPX_CHECK(x != nullptr && target != nullptr);
  const int in = config_.input_dim, out = config_.output_dim;
  const uint64_t seed = config_.seed;
  const double noise_scale = config_.cluster_spread / std::sqrt(static_cast<double>(in));
  for (int64_t s = 0; s < count; ++s) {
    const auto index = static_cast<uint64_t>(first + s);
    const int c = zipf_.sample(uniform01(seed, kStreamCluster, index));
    const float* mean = centre(c);
    float* xs = x + s * in;
    for (int j = 0; j < in; ++j) {
      const double z = standard_normal(seed, kStreamNoise, index * static_cast<uint64_t>(in) + j);
      xs[j] = static_cast<float>(mean[j] + noise_scale * z);
    }
    evaluate(c, xs, target + s * out);
    if (cluster != nullptr) cluster[s] = c;
  }
}

// ---- TextTask ----------------------------------------------------------------

Result<TextTask> TextTask::create(const TextTaskConfig& config) {
  if (config.path.empty()) return invalid_argument("TextTaskConfig.path is empty; name a text file");
  if (config.window < 1 || config.window > kMaxWindow)
    return invalid_argument("TextTaskConfig.window = {} is outside [1, {}]", config.window, kMaxWindow);
  auto bytes = std::make_shared<std::vector<uint8_t>>();
  EPX_RETURN_IF_ERROR(read_input_file(config.path, "text file", kMaxTextBytes, bytes.get()));
  if (static_cast<int64_t>(bytes->size()) <= config.window)
    return invalid_argument("text file '{}' holds {} bytes; window = {} needs at least {}", config.path,
                            bytes->size(), config.window, int64_t{config.window} + 1);
  return TextTask(config, std::move(bytes));
}

int64_t TextTask::position(int64_t index) const {
  EPX_CHECK_GE(index, 0);
  const int64_t num_starts = size_bytes() - config_.window;
  const double u = uniform01(config_.seed, kStreamPosition, static_cast<uint64_t>(index));
  return std::min(static_cast<int64_t>(u * static_cast<double>(num_starts)), num_starts - 1);
}

void TextTask::fill(int64_t first, int64_t count, uint8_t* context, int32_t* label) const {
  EPX_CHECK_GE(first, 0);
  EPX_CHECK_GE(count, 0);
  if (count == 0) return;
  EPX_CHECK(context != nullptr && label != nullptr);
  const int window = config_.window;
  const uint8_t* data = bytes_->data();
  for (int64_t s = 0; s < count; ++s) {
    const int64_t pos = position(first + s);
    std::memcpy(context + s * window, data + pos, static_cast<std::size_t>(window));
    label[s] = data[pos + window];
  }
}

}  // namespace epx
