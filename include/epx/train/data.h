// Training data for `epx train`: a synthetic regression task that rewards
// experts for specialising, and byte-level next-token prediction over a text
// file.
//
//   EPX_ASSIGN_OR_RETURN(epx::SyntheticTask task, epx::SyntheticTask::create({.seed = 7}));
//   std::vector<float> x(B * 32), target(B * 16);
//   // Rank r of R takes samples [step * B * R + r * B, ... + B) of the stream.
//   task.fill(first, B, x.data(), target.data(), nullptr);
//
// Every sample is a pure function of (seed, sample index): no generator state
// is carried from one call to the next, so `fill(a, n)` equals `fill(a, k)`
// followed by `fill(a + k, n - k)`, batches do not depend on how many ranks
// split them, and a run resumed at step s sees the data it would have seen.
// Values are the same on every run with the same libm (normals use log, cos).
#pragma once

#include <cstdint>
#include <memory>
#include <string>
#include <vector>

#include "epx/core/random.h"  // uniform01, standard_normal
#include "epx/core/status.h"

namespace epx {

// Zipf(s) over {0..n-1}: P(i) proportional to 1/(i+1)^s (s = 0 is uniform).
// `sample(u)` maps a uniform u in [0, 1) to i by the inverse CDF, so it is
// deterministic and monotone in u. Needs n >= 1 and a finite s >= 0 (checked:
// a violation aborts; validate user input first, as SyntheticTaskConfig does).
class ZipfDistribution {
 public:
  ZipfDistribution(int n, double s);
  [[nodiscard]] int sample(double u) const;
  // 0 outside [0, n).
  [[nodiscard]] double probability(int i) const;
  [[nodiscard]] int n() const { return static_cast<int>(probability_.size()); }
  [[nodiscard]] double s() const { return s_; }

 private:
  double s_;
  std::vector<double> probability_;
  std::vector<double> cdf_;  // cdf_[i] = P(<= i); cdf_[n - 1] = 1 exactly
};

struct SyntheticTaskConfig {
  int input_dim = 32;      // [1, 8192]
  int output_dim = 16;     // [1, 8192]
  int num_clusters = 16;   // [1, 65536]; num_clusters * input_dim * output_dim <= 2^24
  double zipf_s = 1.1;     // [0, 16]; cluster c has probability proportional to 1/(c+1)^zipf_s
  double cluster_spread = 0.3;  // [0, 100]; RMS distance of a sample from its cluster centre
                                // (centres have norm about 1)
  uint64_t seed = 1;
  // InvalidArgument naming the field, its value and the limit.
  [[nodiscard]] Status validate() const;
};

// Inputs drawn around `num_clusters` centres with Zipf-skewed frequencies
// (cluster 0 the most frequent); each cluster c has its own random map,
// target = tanh(A_c x + b_c), with A_c scaled so that the pre-activations have
// a standard deviation of about 1 (targets O(1), rarely saturated). A model
// whose experts specialise on clusters can learn it; one shared dense map
// cannot fit all clusters at once.
//
// Sample i: cluster = Zipf.sample(uniform01(seed, 0, i));
// x = centre[cluster] + cluster_spread * z / sqrt(input_dim), z_j standard
// normals keyed by (seed, 1, i * input_dim + j). Centres, A_c and b_c come from
// other streams of the same seed.
class SyntheticTask {
 public:
  [[nodiscard]] static Result<SyntheticTask> create(const SyntheticTaskConfig& config);
  [[nodiscard]] const SyntheticTaskConfig& config() const { return config_; }
  [[nodiscard]] const ZipfDistribution& cluster_distribution() const { return zipf_; }

  // Samples [first, first + count) of the infinite stream: x [count, input_dim],
  // target [count, output_dim] (row-major f32), cluster [count] (may be null).
  // Needs first >= 0, count >= 0 and non-null x and target when count > 0.
  void fill(int64_t first, int64_t count, float* x, float* target, int32_t* cluster) const;
  // target [output_dim] = tanh(A_c x + b_c) for any x [input_dim] and cluster c
  // in [0, num_clusters): what fill writes for a sample of cluster c.
  void evaluate(int cluster, const float* x, float* target) const;
  // Cluster c's centre, [input_dim].
  [[nodiscard]] const float* centre(int cluster) const;

 private:
  explicit SyntheticTask(const SyntheticTaskConfig& config);

  SyntheticTaskConfig config_;
  ZipfDistribution zipf_;
  std::vector<float> centres_;  // [num_clusters, input_dim]
  std::vector<float> weights_;  // A: [num_clusters, output_dim, input_dim]
  std::vector<float> biases_;   // b: [num_clusters, output_dim]
};

struct TextTaskConfig {
  std::string path;
  int window = 16;  // [1, 2^20]; the file must hold more than `window` bytes
  uint64_t seed = 1;
};

// Byte-level next-token prediction over a text file: sample i is the window
// of `window` bytes starting at a position drawn uniformly from
// [0, size_bytes - window) by uniform01(seed, 0, i), and its label is the byte
// after the window. The file is read once at create; copies share its bytes.
class TextTask {
 public:
  // NotFound when the file cannot be opened (path and errno text);
  // InvalidArgument for an empty path, a window outside [1, 2^20] or a file of
  // at most `window` bytes (naming the path, its size and the window).
  [[nodiscard]] static Result<TextTask> create(const TextTaskConfig& config);
  [[nodiscard]] const TextTaskConfig& config() const { return config_; }
  [[nodiscard]] int window() const { return config_.window; }
  [[nodiscard]] int64_t size_bytes() const { return static_cast<int64_t>(bytes_->size()); }
  // Where sample i's window starts in the file.
  [[nodiscard]] int64_t position(int64_t index) const;

  // context [count, window] bytes, label [count] in [0, 256). Needs first >= 0,
  // count >= 0 and non-null outputs when count > 0.
  void fill(int64_t first, int64_t count, uint8_t* context, int32_t* label) const;

 private:
  TextTask(TextTaskConfig config, std::shared_ptr<const std::vector<uint8_t>> bytes)
      : config_(std::move(config)), bytes_(std::move(bytes)) {}

  TextTaskConfig config_;
  std::shared_ptr<const std::vector<uint8_t>> bytes_;
};

}  // namespace epx
