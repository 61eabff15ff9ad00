#include "epx/train/data.h"

#include <gtest/gtest.h>
#include <unistd.h>

#include <cmath>
#include <cstdio>
#include <filesystem>
#include <fstream>
#include <string>
#include <vector>

namespace epx {
namespace {

// Zipf(1) over 3 values by hand: weights 1, 1/2, 1/3 of 11/6.
TEST(Zipf, HandChecked) {
  ZipfDistribution zipf(3, 1.0);
  EXPECT_EQ(zipf.n(), 3);
  EXPECT_DOUBLE_EQ(zipf.probability(0), 6.0 / 11);
  EXPECT_DOUBLE_EQ(zipf.probability(1), 3.0 / 11);
  EXPECT_DOUBLE_EQ(zipf.probability(2), 2.0 / 11);
  EXPECT_EQ(zipf.probability(-1), 0.0);
  EXPECT_EQ(zipf.probability(3), 0.0);
  EXPECT_EQ(zipf.sample(0.0), 0);
  EXPECT_EQ(zipf.sample(6.0 / 11 - 1e-9), 0);
  EXPECT_EQ(zipf.sample(6.0 / 11 + 1e-9), 1);
  EXPECT_EQ(zipf.sample(9.0 / 11 + 1e-9), 2);
  EXPECT_EQ(zipf.sample(std::nextafter(1.0, 0.0)), 2);
  ZipfDistribution uniform(4, 0.0);
  for (int i = 0; i < 4; ++i) EXPECT_DOUBLE_EQ(uniform.probability(i), 0.25);
}

// Frequencies of 400k counter-based draws against the probabilities: each
// within 5 standard errors (sqrt(p (1 - p) / N)) plus 1e-4.
TEST(Zipf, FrequenciesMatchProbabilities) {
  for (double s : {0.0, 0.8, 1.1, 2.0}) {
    SCOPED_TRACE(s);
    const int n = 20;
    const int64_t num_draws = 400000;
    ZipfDistribution zipf(n, s);
    std::vector<int64_t> count(n, 0);
    for (int64_t i = 0; i < num_draws; ++i) ++count[zipf.sample(uniform01(42, 7, i))];
    double total_p = 0;
    for (int k = 0; k < n; ++k) {
      const double p = zipf.probability(k);
      total_p += p;
      const double freq = static_cast<double>(count[k]) / num_draws;
      const double tolerance = 5 * std::sqrt(p * (1 - p) / num_draws) + 1e-4;
      EXPECT_NEAR(freq, p, tolerance) << "value " << k;
    }
    EXPECT_NEAR(total_p, 1.0, 1e-12);
  }
}

TEST(CounterRng, DeterministicInRangeAndWellSpread) {
  EXPECT_EQ(uniform01(1, 2, 3), uniform01(1, 2, 3));
  EXPECT_NE(uniform01(1, 2, 3), uniform01(1, 2, 4));
  EXPECT_NE(uniform01(1, 2, 3), uniform01(1, 3, 3));
  EXPECT_NE(uniform01(1, 2, 3), uniform01(2, 2, 3));
  // Moments of 200k draws: uniform mean 1/2, variance 1/12; normal mean 0,
  // variance 1, 4th moment 3 (tolerances about 5 standard errors).
  const int num_draws = 200000;
  double su = 0, su2 = 0, sn = 0, sn2 = 0, sn4 = 0, lag = 0;
  double prev = 0;
  for (int i = 0; i < num_draws; ++i) {
    const double u = uniform01(9, 0, i);
    ASSERT_GE(u, 0.0);
    ASSERT_LT(u, 1.0);
    su += u;
    su2 += u * u;
    lag += (u - 0.5) * (prev - 0.5);
    prev = u;
    const double z = standard_normal(9, 1, i);
    ASSERT_TRUE(std::isfinite(z));
    sn += z;
    sn2 += z * z;
    sn4 += z * z * z * z;
  }
  EXPECT_NEAR(su / num_draws, 0.5, 0.004);
  EXPECT_NEAR(su2 / num_draws - 0.25, 1.0 / 12, 0.002);
  EXPECT_NEAR(lag / num_draws, 0.0, 0.001);  // neighbouring indices uncorrelated
  EXPECT_NEAR(sn / num_draws, 0.0, 0.012);
  EXPECT_NEAR(sn2 / num_draws, 1.0, 0.016);
  EXPECT_NEAR(sn4 / num_draws, 3.0, 0.12);
}

struct Batch {
  std::vector<float> x, target;
  std::vector<int32_t> cluster;
};

Batch fill(const SyntheticTask& task, int64_t first, int64_t count) {
  Batch b;
  b.x.resize(count * task.config().input_dim);
  b.target.resize(count * task.config().output_dim);
  b.cluster.resize(count);
  task.fill(first, count, b.x.data(), b.target.data(), b.cluster.data());
  return b;
}

TEST(SyntheticTask, FillIsAPureFunctionOfTheIndex) {
  const SyntheticTask task = std::move(SyntheticTask::create({.input_dim = 8, .output_dim = 5, .seed = 3})).value();
  const Batch whole = fill(task, 1000, 64);
  for (int64_t k : {0, 1, 17, 63, 64}) {
    SCOPED_TRACE(k);
    const Batch a = fill(task, 1000, k), b = fill(task, 1000 + k, 64 - k);
    std::vector<float> x = a.x, target = a.target;
    std::vector<int32_t> cluster = a.cluster;
    x.insert(x.end(), b.x.begin(), b.x.end());
    target.insert(target.end(), b.target.begin(), b.target.end());
    cluster.insert(cluster.end(), b.cluster.begin(), b.cluster.end());
    EXPECT_EQ(x, whole.x);  // exact: the same bits
    EXPECT_EQ(target, whole.target);
    EXPECT_EQ(cluster, whole.cluster);
  }
  // A second task with the same config gives the same data; null cluster is allowed.
  const SyntheticTask again = std::move(SyntheticTask::create({.input_dim = 8, .output_dim = 5, .seed = 3})).value();
  std::vector<float> x(64 * 8), target(64 * 5);
  again.fill(1000, 64, x.data(), target.data(), nullptr);
  EXPECT_EQ(x, whole.x);
  EXPECT_EQ(target, whole.target);
  // Another seed gives other data.
  const SyntheticTask other = std::move(SyntheticTask::create({.input_dim = 8, .output_dim = 5, .seed = 4})).value();
  EXPECT_NE(fill(other, 1000, 64).x, whole.x);
}

TEST(SyntheticTask, ClusterFrequenciesFollowZipfAndSamplesSitNearTheirCentre) {
  const SyntheticTaskConfig config{.num_clusters = 8, .zipf_s = 1.5, .cluster_spread = 0.3, .seed = 11};
  const SyntheticTask task = std::move(SyntheticTask::create(config)).value();
  const int64_t n = 100000;
  const Batch b = fill(task, 0, n);
  std::vector<int64_t> count(8, 0);
  double sq_dist = 0;
  for (int64_t i = 0; i < n; ++i) {
    const int c = b.cluster[i];
    ASSERT_TRUE(c >= 0 && c < 8);
    ++count[c];
    const float* centre = task.centre(c);
    for (int j = 0; j < config.input_dim; ++j) {
      const double d = b.x[i * config.input_dim + j] - centre[j];
      sq_dist += d * d;
    }
  }
  for (int c = 0; c < 8; ++c) {
    const double p = task.cluster_distribution().probability(c);
    EXPECT_NEAR(static_cast<double>(count[c]) / n, p, 5 * std::sqrt(p * (1 - p) / n) + 1e-4) << "cluster " << c;
  }
  // Skewed as configured: cluster 0 is 2^1.5 times as frequent as cluster 1.
  EXPECT_NEAR(static_cast<double>(count[0]) / count[1], std::pow(2.0, 1.5), 0.15);
  EXPECT_GT(count[0], 10 * count[7]);
  // RMS distance from the centre is cluster_spread (within 2%).
  EXPECT_NEAR(std::sqrt(sq_dist / n), 0.3, 0.006);
}

TEST(SyntheticTask, TargetsAreOrderOneAndDifferBetweenClusters) {
  const SyntheticTaskConfig config;  // defaults: 32 -> 16, 16 clusters
  const SyntheticTask task = std::move(SyntheticTask::create(config)).value();
  const Batch b = fill(task, 0, 4096);
  double sum_sq = 0;
  int64_t saturated = 0;
  bool any_nonzero = false;
  for (float t : b.target) {
    ASSERT_TRUE(std::isfinite(t));
    sum_sq += t * t;
    saturated += std::fabs(t) > 0.99f;
    any_nonzero = any_nonzero || t != 0;
  }
  ASSERT_TRUE(any_nonzero);
  const double rms = std::sqrt(sum_sq / b.target.size());
  EXPECT_GT(rms, 0.3);
  EXPECT_LT(rms, 0.8);
  EXPECT_LT(saturated, static_cast<int64_t>(b.target.size() / 50));  // under 2% saturated
  // fill's targets are evaluate() of the sample's own cluster.
  std::vector<float> t(config.output_dim);
  for (int64_t i = 0; i < 50; ++i) {
    task.evaluate(b.cluster[i], &b.x[i * config.input_dim], t.data());
    EXPECT_EQ(t, std::vector<float>(&b.target[i * config.output_dim], &b.target[(i + 1) * config.output_dim]));
  }
  // The same x under every other cluster's map: a clearly different target
  // (mean absolute difference above 0.1).
  const float* x = &b.x[0];
  std::vector<float> own(config.output_dim), other(config.output_dim);
  task.evaluate(b.cluster[0], x, own.data());
  for (int c = 0; c < config.num_clusters; ++c) {
    if (c == b.cluster[0]) continue;
    task.evaluate(c, x, other.data());
    double diff = 0;
    for (int o = 0; o < config.output_dim; ++o) diff += std::fabs(own[o] - other[o]);
    EXPECT_GT(diff / config.output_dim, 0.1) << "cluster " << c << " vs " << b.cluster[0];
  }
}

TEST(SyntheticTask, BadConfigsNameTheFieldAndTheLimit) {
  const struct {
    SyntheticTaskConfig config;
    const char* message;
  } cases[] = {
      {{.input_dim = 0}, "SyntheticTaskConfig.input_dim = 0 is outside [1, 8192]"},
      {{.output_dim = 9000}, "SyntheticTaskConfig.output_dim = 9000 is outside [1, 8192]"},
      {{.num_clusters = 0}, "SyntheticTaskConfig.num_clusters = 0 is outside [1, 65536]"},
      {{.input_dim = 4096, .output_dim = 4096, .num_clusters = 2},
       "SyntheticTaskConfig.num_clusters * input_dim * output_dim = 2 * 4096 * 4096 = 33554432 is above the limit "
       "16777216"},
      {{.zipf_s = -0.5}, "SyntheticTaskConfig.zipf_s = -0.5 is outside [0, 16]"},
      {{.zipf_s = NAN}, "SyntheticTaskConfig.zipf_s = nan is outside [0, 16]"},
      {{.cluster_spread = -1}, "SyntheticTaskConfig.cluster_spread = -1 is outside [0, 100]"},
  };
  for (const auto& c : cases) {
    const Result<SyntheticTask> task = SyntheticTask::create(c.config);
    ASSERT_FALSE(task.is_ok()) << c.message;
    EXPECT_EQ(task.status().code(), StatusCode::kInvalidArgument);
    EXPECT_EQ(task.status().message(), c.message);
  }
  EXPECT_TRUE(SyntheticTaskConfig{}.validate().is_ok());
}

class TextFile {
 public:
  explicit TextFile(const std::string& contents) {
    path_ = (std::filesystem::temp_directory_path() / ("epx_text_test_" + std::to_string(::getpid()) + "_" +
                                                         std::to_string(counter_++) + ".txt"))
                .string();
    std::ofstream(path_, std::ios::binary) << contents;
  }
  ~TextFile() { std::remove(path_.c_str()); }
  const std::string& path() const { return path_; }

 private:
  static inline int counter_ = 0;
  std::string path_;
};

TEST(TextTask, WindowsAndLabelsComeFromTheFile) {
  std::string text;
  for (int i = 0; i < 50; ++i) text += "line " + std::to_string(i) + ": the quick brown fox\n";
  const TextFile file(text);
  const TextTask task = std::move(TextTask::create({.path = file.path(), .window = 12, .seed = 5})).value();
  EXPECT_EQ(task.window(), 12);
  EXPECT_EQ(task.size_bytes(), static_cast<int64_t>(text.size()));

  const int64_t n = 3000;
  std::vector<uint8_t> context(n * 12);
  std::vector<int32_t> label(n);
  task.fill(0, n, context.data(), label.data());
  std::vector<bool> seen(text.size() - 12, false);
  for (int64_t i = 0; i < n; ++i) {
    const int64_t pos = task.position(i);
    ASSERT_TRUE(pos >= 0 && pos < static_cast<int64_t>(text.size()) - 12) << pos;
    seen[pos] = true;
    EXPECT_EQ(std::string(context.begin() + i * 12, context.begin() + (i + 1) * 12), text.substr(pos, 12));
    EXPECT_EQ(label[i], static_cast<uint8_t>(text[pos + 12]));
  }
  // Uniform over ~1.4k start positions: 3000 draws reach well over half of them.
  EXPECT_GT(std::count(seen.begin(), seen.end(), true), static_cast<int64_t>(seen.size() / 2));

  // Pure in the index: a split fill gives the same bytes.
  std::vector<uint8_t> c2(n * 12);
  std::vector<int32_t> l2(n);
  task.fill(0, 1234, c2.data(), l2.data());
  task.fill(1234, n - 1234, c2.data() + 1234 * 12, l2.data() + 1234);
  EXPECT_EQ(c2, context);
  EXPECT_EQ(l2, label);
}

TEST(TextTask, SmallestFileHasOneWindow) {
  const TextFile file("abcde");
  const TextTask task = std::move(TextTask::create({.path = file.path(), .window = 4})).value();
  std::vector<uint8_t> context(3 * 4);
  std::vector<int32_t> label(3);
  task.fill(7, 3, context.data(), label.data());
  EXPECT_EQ(std::string(context.begin(), context.end()), "abcdabcdabcd");
  EXPECT_EQ(label, (std::vector<int32_t>{'e', 'e', 'e'}));
}

TEST(TextTask, BadConfigsNameThePathSizeAndWindow) {
  const TextFile file("0123456789");
  Result<TextTask> r = TextTask::create({.path = file.path(), .window = 10});
  EXPECT_EQ(r.status().code(), StatusCode::kInvalidArgument);
  EXPECT_EQ(r.status().message(),
            "text file '" + file.path() + "' holds 10 bytes; window = 10 needs at least 11");
  r = TextTask::create({.path = file.path(), .window = 0});
  EXPECT_EQ(r.status().message(), "TextTaskConfig.window = 0 is outside [1, 1048576]");
  r = TextTask::create({.path = "", .window = 4});
  EXPECT_EQ(r.status().message(), "TextTaskConfig.path is empty; name a text file");
  const std::string missing = file.path() + ".missing";
  r = TextTask::create({.path = missing});
  EXPECT_EQ(r.status().code(), StatusCode::kNotFound);
  EXPECT_EQ(r.status().message(), "cannot open text file '" + missing + "': No such file or directory");
  r = TextTask::create({.path = std::filesystem::temp_directory_path().string()});
  EXPECT_EQ(r.status().code(), StatusCode::kInvalidArgument);  // a folder
}

}  // namespace
}  // namespace epx
