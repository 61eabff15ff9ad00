#include "epx/routing/router.h"

#include <algorithm>
#include <bit>
#include <cmath>
#include <cstring>
#include <limits>
#include <numeric>
#include <thread>

#if defined(__SSE2__)
#include <immintrin.h>
#endif

#include "core/guard.h"
#include "core/thread_shares.h"
#include "core/simd_clones.h"
#include "routing/scores.h"

namespace epx {

Status RouterConfig::validate() const {
  if (num_experts < 1) return invalid_argument("num_experts = {} must be at least 1", num_experts);
  if (topk < 1 || topk > num_experts)
    return invalid_argument("topk = {} is outside [1, num_experts = {}]", topk, num_experts);
  if (num_groups < 1 || num_groups > num_experts)
    return invalid_argument("num_groups = {} is outside [1, num_experts = {}]", num_groups, num_experts);
  if (topk_groups < 1 || topk_groups > num_groups)
    return invalid_argument("topk_groups = {} is outside [1, num_groups = {}]", topk_groups, num_groups);
  if (expert_group.empty()) {
    if (num_experts % num_groups != 0)
      return invalid_argument("num_experts = {} is not divisible by num_groups = {}", num_experts, num_groups);
  } else {
    if (static_cast<int64_t>(expert_group.size()) != num_experts)
      return invalid_argument("expert_group has {} entries, num_experts = {}", expert_group.size(), num_experts);
    for (int e = 0; e < num_experts; ++e)
      if (expert_group[e] < 0 || expert_group[e] >= num_groups)
        return invalid_argument("expert_group[{}] = {} is outside [0, num_groups = {})", e, expert_group[e],
                                num_groups);
  }
  if (num_groups > 1 && expert_group.empty()) {
    // Contiguous groups of num_experts / num_groups each: arithmetic, so a
    // huge setting costs no memory here.
    const int64_t fewest = int64_t{num_experts / num_groups} * topk_groups;
    if (topk > fewest)
      return invalid_argument("topk = {} is larger than the {} experts of the smallest {} groups", topk, fewest,
                              topk_groups);
  } else if (num_groups > 1) {
    std::vector<int> sizes = detail::group_sizes(*this);
    std::sort(sizes.begin(), sizes.end());
    if (sizes.front() == 0) return invalid_argument("a group of the {} groups has no expert", num_groups);
    const int fewest = std::accumulate(sizes.begin(), sizes.begin() + topk_groups, 0);
    if (topk > fewest)
      return invalid_argument("topk = {} is larger than the {} experts of the smallest {} groups", topk, fewest,
                              topk_groups);
  }
  if (softmax_after_topk && score_function != ScoreFunction::kSoftmax)
    return invalid_argument("softmax_after_topk needs score_function softmax");
  if (!std::isfinite(scaling_factor))
    return invalid_argument("scaling_factor = {} is not finite", scaling_factor);
  if (!(capacity_factor >= 0.0) || !std::isfinite(capacity_factor))
    return invalid_argument("capacity_factor = {} must be finite and >= 0", capacity_factor);
  if (capacity_alignment < 1)
    return invalid_argument("capacity_alignment = {} must be at least 1", capacity_alignment);
  if (pad_to_capacity && capacity_factor == 0.0)
    return invalid_argument("pad_to_capacity needs capacity_factor > 0, got {}", capacity_factor);
  return Status::ok();
}

int64_t expert_capacity(const RouterConfig& config, int64_t num_tokens) {
  if (config.capacity_factor <= 0.0 || config.num_experts < 1) return 0;
  const double raw = config.capacity_factor * static_cast<double>(num_tokens) * config.topk / config.num_experts;
  // The product is rounded: 1.1 * 50 is 55.00000000000001, whose ceiling
  // would be 56. A relative 1e-9 below an integer counts as that integer.
  int64_t capacity = static_cast<int64_t>(std::ceil(raw - 1e-9 * std::max(1.0, raw)));
  const int64_t align = std::max(1, config.capacity_alignment);
  return (capacity + align - 1) / align * align;
}

namespace {

// Best `k` of candidates[0, n) by score, ties to the lower id, written best
// first (k <= n). An insertion into a sorted list of k: no allocation, and
// for small k far cheaper than sorting all n.
void top_k_of(const float* score, const int32_t* candidates, int n, int k, int32_t* out) {
  auto better = [score](int32_t a, int32_t b) { return score[a] > score[b] || (score[a] == score[b] && a < b); };
  int count = 0;
  for (int i = 0; i < n; ++i) {
    const int32_t c = candidates[i];
    if (count == k) {
      if (!better(c, out[k - 1])) continue;
      --count;
    }
    int j = count;
    for (; j > 0 && better(c, out[j - 1]); --j) out[j] = out[j - 1];
    out[j] = c;
    ++count;
  }
}

// Bits i of the result: v[i] > threshold, for i in [0, 8). NaN compares false.
inline unsigned greater_mask8(const float* v, float threshold) {
#if defined(__SSE2__)
  const __m128 t = _mm_set1_ps(threshold);
  const int lo = _mm_movemask_ps(_mm_cmpgt_ps(_mm_loadu_ps(v), t));
  const int hi = _mm_movemask_ps(_mm_cmpgt_ps(_mm_loadu_ps(v + 4), t));
  return static_cast<unsigned>(lo | (hi << 4));
#else
  unsigned mask = 0;
  for (int i = 0; i < 8; ++i) mask |= static_cast<unsigned>(v[i] > threshold) << i;
  return mask;
#endif
}

// The best k values seen so far, best first, for candidates pushed in
// ascending id order. A later candidate never wins a tie, so "better" is a
// plain `>`: exactly top_k_of's order when top_k_of gets its candidates in
// ascending id order. Once k are held, blocks of 8 are compared with the k-th
// best at once and only the (few) greater ones are inserted.
class TopList {
 public:
  TopList(int k, float* value, int32_t* id) : k_(k), value_(value), id_(id) {}

  void push(float v, int32_t id) {
    if (count_ == k_) {
      if (!(v > value_[k_ - 1])) return;
      --count_;
    }
    int j = count_;
    for (; j > 0 && v > value_[j - 1]; --j) {
      value_[j] = value_[j - 1];
      id_[j] = id_[j - 1];
    }
    value_[j] = v;
    id_[j] = id;
    ++count_;
  }

  // Candidates v[0, n) with ids ids[i] (or first_id + i when ids is null),
  // ascending and above every id pushed before.
  void scan(const float* v, int n, const int32_t* ids, int32_t first_id) {
    auto id_of = [&](int i) { return ids ? ids[i] : first_id + i; };
    int i = 0;
    for (; i < n && count_ < k_; ++i) push(v[i], id_of(i));
    for (; i + 8 <= n; i += 8) {
      for (unsigned m = greater_mask8(v + i, value_[k_ - 1]); m != 0; m &= m - 1) {
        const int l = std::countr_zero(m);
        push(v[i + l], id_of(i + l));
      }
    }
    for (; i < n; ++i) push(v[i], id_of(i));
  }

  [[nodiscard]] int count() const { return count_; }

 private:
  int k_;
  int count_ = 0;
  float* value_;
  int32_t* id_;
};

// Four floats in one vector (GCC/Clang vector extension: SSE or NEON, the
// baseline of x86-64 and AArch64).
using Float4 = float __attribute__((vector_size(16)));

inline Float4 load4(const float* p) {
  Float4 v;
  std::memcpy(&v, p, sizeof(v));
  return v;
}
inline Float4 max4(Float4 a, Float4 b) { return a > b ? a : b; }
inline Float4 min4(Float4 a, Float4 b) { return a < b ? a : b; }

// (a, b) and (c, d), each a lane's best and second best (a >= b, c >= d):
// the best and second best of the four values, into (a, b).
inline void merge_top2(Float4& a, Float4& b, Float4 c, Float4 d) {
  b = max4(min4(a, c), max4(b, d));
  a = max4(a, c);
}

// The best two values of v[0, n) (n >= 1), best first; -inf for a missing
// second. Per lane (8 lanes) first, then over the lanes: no data-dependent
// branch. Only the values are defined (not which of two equal elements).
void top2_values(const float* v, int n, float* first, float* second) {
  constexpr float kLow = -std::numeric_limits<float>::infinity();
  const Float4 low = {kLow, kLow, kLow, kLow};
  Float4 m1[2] = {low, low};
  Float4 m2[2] = {low, low};
  auto add = [&](const float* x8) {
    for (int h = 0; h < 2; ++h) {
      const Float4 x = load4(x8 + 4 * h);
      m2[h] = max4(m2[h], min4(m1[h], x));
      m1[h] = max4(m1[h], x);
    }
  };
  int i = 0;
  for (; i + 8 <= n; i += 8) add(v + i);
  if (i < n) {
    float tail[8];
    std::fill(tail, tail + 8, kLow);
    std::copy(v + i, v + n, tail);
    add(tail);
  }
  // The 8 lanes' pairs merged in three rounds of vector operations (a scan
  // of the lanes for the best one was a chain of dependent loads and
  // compares, a fifth of route's time with groups).
  merge_top2(m1[0], m2[0], m1[1], m2[1]);
  merge_top2(m1[0], m2[0], __builtin_shufflevector(m1[0], m1[0], 2, 3, 0, 1),
             __builtin_shufflevector(m2[0], m2[0], 2, 3, 0, 1));
  merge_top2(m1[0], m2[0], __builtin_shufflevector(m1[0], m1[0], 1, 0, 3, 2),
             __builtin_shufflevector(m2[0], m2[0], 1, 0, 3, 2));
  *first = m1[0][0];
  *second = m2[0][0];
}

// The k-th largest of v[0, m) (1 <= k <= m, no NaN), by counting ranks: a
// few hundred compares without a data-dependent branch.
float kth_largest(const float* v, int m, int k) {
  float kth = v[0];
  for (int i = 0; i < m; ++i) {
    int rank = 0;
    for (int j = 0; j < m; ++j) rank += (v[j] > v[i]) | ((v[j] == v[i]) & (j < i));
    kth = rank == k - 1 ? v[i] : kth;
  }
  return kth;
}

// A lower bound of the k-th best of v[0, n) (1 <= k <= 16 <= n): the k-th
// best of 16 per-lane maxima, which are 16 distinct elements.
float kth_best_bound(const float* v, int n, int k) {
  Float4 m[4];
  for (int h = 0; h < 4; ++h) m[h] = load4(v + 4 * h);
  for (int i = 16; i + 16 <= n; i += 16)
    for (int h = 0; h < 4; ++h) m[h] = max4(m[h], load4(v + i + 4 * h));
  float lanes[16];
  std::memcpy(lanes, m, sizeof(lanes));
  return kth_largest(lanes, 16, k);
}

// A key whose integer order is the selection order: higher score first, then
// lower id; -0 and +0 are the same score. Not for NaN.
inline int64_t order_key(float v, int32_t id) {
  v += 0.0f;  // -0 -> +0
  int32_t bits;
  std::memcpy(&bits, &v, sizeof(bits));
  if (bits < 0) bits ^= 0x7fffffff;  // negative floats count down
  return static_cast<int64_t>(static_cast<uint64_t>(static_cast<int64_t>(bits)) << 32) |
         static_cast<int64_t>(~static_cast<uint32_t>(id));
}

// Bit i of the result: v[i] >= threshold, for i in [0, 8).
inline unsigned at_least_mask8(const float* v, float threshold) {
#if defined(__SSE2__)
  const __m128 t = _mm_set1_ps(threshold);
  const int lo = _mm_movemask_ps(_mm_cmpge_ps(_mm_loadu_ps(v), t));
  const int hi = _mm_movemask_ps(_mm_cmpge_ps(_mm_loadu_ps(v + 4), t));
  return static_cast<unsigned>(lo | (hi << 4));
#else
  unsigned mask = 0;
  for (int i = 0; i < 8; ++i) mask |= static_cast<unsigned>(v[i] >= threshold) << i;
  return mask;
#endif
}

// rank[i] = how many of key[0, n) are greater than key[i] (distinct keys:
// the order of key[i]). 64-bit compares vectorize from AVX2 on, hence the clones.
EPX_SIMD_CLONES void rank_keys(const int64_t* key, int n, int32_t* rank) {
  for (int i = 0; i < n; ++i) {
    int32_t r = 0;
    for (int j = 0; j < n; ++j) r += key[j] > key[i] ? 1 : 0;
    rank[i] = r;
  }
}

// The candidates at or above a threshold (blocks of 8 with none are skipped,
// the rest collected without branches), then ranked against each other: the
// best k of them in selection order. Not for NaN scores.
class ThresholdSelect {
 public:
  static constexpr int kMaxCandidates = 32;  // beyond this, rank by a scan

  // value and id must have room for every candidate offered plus 8.
  ThresholdSelect(float threshold, float* value, int32_t* id) : threshold_(threshold), value_(value), id_(id) {}

  void offer(float v, int32_t id) {
    value_[count_] = v;
    id_[count_] = id;
    count_ += v >= threshold_ ? 1 : 0;
  }
  // Candidates score[first_id, first_id + n), ids first_id + i.
  void offer_range(const float* score, int32_t first_id, int n) {
    const float* v = score + first_id;
    int i = 0;
    for (; i + 8 <= n; i += 8) {
      if (at_least_mask8(v + i, threshold_) == 0) continue;
      for (int l = 0; l < 8; ++l) offer(v[i + l], first_id + i + l);
    }
    for (; i < n; ++i) offer(v[i], first_id + i);
  }
  [[nodiscard]] bool small() const { return count_ <= kMaxCandidates; }

  // The ids of the best k (k <= count), best first. Needs small().
  void best(int k, int32_t* out) const {
    int64_t key[kMaxCandidates];
    for (int i = 0; i < count_; ++i) key[i] = order_key(value_[i], id_[i]);
    int32_t rank[kMaxCandidates];
    rank_keys(key, count_, rank);
    int32_t slot[kMaxCandidates + 1];
    for (int i = 0; i < count_; ++i) slot[std::min(rank[i], k)] = id_[i];
    std::copy(slot, slot + k, out);
  }

 private:
  float threshold_;
  float* value_;
  int32_t* id_;
  int count_ = 0;
};

// The machine's cores, at most 8: route's most threads. Asked once.
int64_t machine_threads() {
  static const int64_t threads = std::clamp<int64_t>(std::thread::hardware_concurrency(), 1, 8);
  return threads;
}

// Drops over-capacity (token, slot) pairs from out in place.
void apply_capacity(const RouterConfig& config, RouterOutput& out) {
  const int64_t T = out.num_tokens;
  const int K = out.topk;
  std::vector<std::vector<int64_t>> slots(config.num_experts);  // flat (token * K + slot)
  for (int64_t s = 0; s < T * K; ++s) slots[out.topk_idx[s]].push_back(s);
  for (auto& list : slots) {
    if (static_cast<int64_t>(list.size()) <= out.capacity) continue;
    if (config.drop_policy == DropPolicy::kScore) {
      std::stable_sort(list.begin(), list.end(), [&](int64_t a, int64_t b) {
        return out.topk_weights[a] > out.topk_weights[b];
      });
    }
    for (std::size_t i = out.capacity; i < list.size(); ++i) {
      out.topk_idx[list[i]] = -1;
      out.topk_weights[list[i]] = 0.0f;
      ++out.num_dropped;
    }
  }
}

// What routing a token needs besides its logits, fixed for a whole call: the
// groups (and whether each is one range of ids), the bias, and the output.
struct RoutePlan {
  const RouterConfig& config;
  const TensorView& logits;
  const float* bias;  // null: no expert bias
  RouterOutput& out;
  int E, K, G;
  std::vector<std::vector<int32_t>> groups;
  int per_group;          // experts of a group that make its score
  bool ranges = true;     // every group is one range of ids (contiguous groups always are)
  int largest_group = 0;
  std::vector<int32_t> group_of;
  // A NaN bias makes selection scores incomparable, and then the order in
  // which candidates are visited shows: keep the original order for them.
  bool bias_has_nan;

  RoutePlan(const RouterConfig& c, const TensorView& l, const float* b, RouterOutput& o)
      : config(c),
        logits(l),
        bias(b),
        out(o),
        E(c.num_experts),
        K(c.topk),
        G(c.num_groups),
        groups(detail::group_members(c)),
        per_group(std::max(1, c.topk / c.topk_groups)),
        group_of(c.num_experts, 0),
        bias_has_nan(b && std::any_of(b, b + c.num_experts, [](float x) { return std::isnan(x); })) {
    for (int g = 0; g < G; ++g) {
      const std::vector<int32_t>& m = groups[g];
      ranges = ranges && m.back() - m.front() + 1 == static_cast<int32_t>(m.size());
      largest_group = std::max(largest_group, static_cast<int>(m.size()));
      for (int32_t e : m) group_of[e] = g;
    }
  }
};

// One thread's working memory for routing its tokens (allocated once per range).
struct RouteScratch {
  explicit RouteScratch(const RoutePlan& p)
      : select(p.bias ? p.E : 0),
        group_score(p.G),
        member_score(p.ranges ? 0 : p.largest_group),
        best_value(std::max(p.K, p.per_group)),
        best_id(std::max(p.K, p.per_group)),
        group_value(p.config.topk_groups),
        best_groups(p.config.topk_groups),
        candidate_score(p.ranges ? 0 : p.E),
        candidates(p.E),
        group_kept(p.G),
        group_top(2 * p.G),
        witness(2 * p.G),
        pick_value(p.E + 8),
        pick_id(p.E + 8) {}
  std::vector<float> select, group_score, member_score, best_value;
  std::vector<int32_t> best_id;
  std::vector<float> group_value;
  std::vector<int32_t> best_groups;
  std::vector<float> candidate_score;
  std::vector<int32_t> candidates;
  std::vector<uint8_t> group_kept;
  std::vector<float> group_top, witness, pick_value;
  std::vector<int32_t> pick_id;
};

// Group scores: the sum of each group's best `per_group` selection scores.
void score_groups(const RoutePlan& p, const float* score, RouteScratch& w) {
  for (int g = 0; g < p.G; ++g) {
    const std::vector<int32_t>& m = p.groups[g];
    const int size = static_cast<int>(m.size());
    const int n = std::min(p.per_group, size);
    const float* member = score + m.front();
    if (!p.ranges) {
      for (int i = 0; i < size; ++i) w.member_score[i] = score[m[i]];
      member = w.member_score.data();
    }
    if (n <= 2 && !p.bias_has_nan) {
      float* top = w.group_top.data() + 2 * g;
      top2_values(member, size, &top[0], &top[1]);
      w.group_score[g] = n == 1 ? 0.0f + top[0] : (0.0f + top[0]) + top[1];
    } else {
      TopList best(n, w.best_value.data(), w.best_id.data());
      best.scan(member, size, nullptr, 0);
      float sum = 0.0f;
      for (int j = 0; j < n; ++j) sum += w.best_value[j];
      w.group_score[g] = sum;
    }
  }
}

// The best topk_groups groups (ties to the lower group id) into w.best_groups and w.group_kept.
void keep_best_groups(const RoutePlan& p, RouteScratch& w) {
  const int G = p.G;
  if (std::none_of(w.group_score.begin(), w.group_score.end(), [](float x) { return std::isnan(x); })) {
    for (int g = 0; g < G; ++g) {
      int rank = 0;
      for (int h = 0; h < G; ++h)
        rank += (w.group_score[h] > w.group_score[g]) | ((w.group_score[h] == w.group_score[g]) & (h < g));
      if (rank < p.config.topk_groups) w.best_groups[rank] = g;
    }
  } else {
    TopList kept(p.config.topk_groups, w.group_value.data(), w.best_groups.data());
    kept.scan(w.group_score.data(), G, nullptr, 0);
  }
  std::fill(w.group_kept.begin(), w.group_kept.end(), uint8_t{0});
  for (int32_t g : w.best_groups) w.group_kept[g] = 1;
}

// The fast path of grouped selection: the kept groups' best values are
// distinct candidates, so when there are K of them the K-th best of them
// bounds the K-th best expert. False when it does not apply (sel untouched).
bool select_grouped_by_bound(const RoutePlan& p, const float* score, int32_t* sel, RouteScratch& w) {
  if (p.bias_has_nan || p.per_group > 2 || p.config.topk_groups * p.per_group < p.K) return false;
  int num_witnesses = 0;
  for (int32_t g : w.best_groups)
    for (int j = 0; j < std::min(p.per_group, static_cast<int>(p.groups[g].size())); ++j)
      w.witness[num_witnesses++] = w.group_top[2 * g + j];
  if (num_witnesses < p.K) return false;
  ThresholdSelect pick(kth_largest(w.witness.data(), num_witnesses, p.K), w.pick_value.data(), w.pick_id.data());
  if (p.ranges) {
    for (int32_t g : w.best_groups) pick.offer_range(score, p.groups[g].front(), static_cast<int>(p.groups[g].size()));
  } else {
    for (int e = 0; e < p.E; ++e)
      if (w.group_kept[p.group_of[e]]) pick.offer(score[e], e);
  }
  if (!pick.small()) return false;
  pick.best(p.K, sel);
  return true;
}

// Group-limited top-k: the best K experts of the best topk_groups groups, into sel.
void select_grouped(const RoutePlan& p, const float* score, int32_t* sel, RouteScratch& w) {
  score_groups(p, score, w);
  keep_best_groups(p, w);
  if (select_grouped_by_bound(p, score, sel, w)) return;
  if (p.bias_has_nan) {
    int n = 0;
    for (int32_t g : w.best_groups)
      for (int32_t e : p.groups[g]) w.candidates[n++] = e;
    top_k_of(score, w.candidates.data(), n, p.K, sel);
  } else if (p.ranges) {
    // Ascending ids across the kept groups: scan them by first id.
    std::sort(w.best_groups.begin(), w.best_groups.end(),
              [&](int32_t x, int32_t y) { return p.groups[x].front() < p.groups[y].front(); });
    TopList top(p.K, w.best_value.data(), sel);
    for (int32_t g : w.best_groups)
      top.scan(score + p.groups[g].front(), static_cast<int>(p.groups[g].size()), nullptr, p.groups[g].front());
  } else {
    int n = 0;
    for (int e = 0; e < p.E; ++e) {  // branch-free compaction, ids ascending
      w.candidate_score[n] = score[e];
      w.candidates[n] = e;
      n += w.group_kept[p.group_of[e]];
    }
    TopList top(p.K, w.best_value.data(), sel);
    top.scan(w.candidate_score.data(), n, w.candidates.data(), 0);
  }
}

// Plain top-k over all experts, into sel.
void select_flat(const RoutePlan& p, const float* score, int32_t* sel, RouteScratch& w) {
  if (!p.bias_has_nan && p.K <= 16 && p.E >= 16) {
    ThresholdSelect pick(kth_best_bound(score, p.E, p.K), w.pick_value.data(), w.pick_id.data());
    pick.offer_range(score, 0, p.E);
    if (pick.small()) {
      pick.best(p.K, sel);
      return;
    }
  }
  TopList top(p.K, w.best_value.data(), sel);
  top.scan(score, p.E, nullptr, 0);
}

// Token t's gate weights for its selected experts (softmax over them, or
// their probabilities), normalised and scaled as configured.
void write_weights(const RoutePlan& p, int64_t t, const float* row, const float* prob, const int32_t* sel) {
  const int K = p.K;
  float* w = p.out.selected_probs.data() + t * K;
  if (p.config.softmax_after_topk) {
    float max_logit = row[sel[0]];
    for (int j = 1; j < K; ++j) max_logit = std::max(max_logit, row[sel[j]]);
    float sum = 0.0f;
    for (int j = 0; j < K; ++j) sum += (w[j] = std::exp(row[sel[j]] - max_logit));
    for (int j = 0; j < K; ++j) w[j] /= sum;
  } else {
    for (int j = 0; j < K; ++j) w[j] = prob[sel[j]];
  }
  float denom = 1.0f;
  if (p.config.normalize_weights) {
    denom = 0.0f;
    for (int j = 0; j < K; ++j) denom += w[j];
  }
  for (int j = 0; j < K; ++j) {
    p.out.topk_idx[t * K + j] = sel[j];
    p.out.topk_weights[t * K + j] = p.config.scaling_factor * (w[j] / denom);
  }
}

// Routes tokens [t_begin, t_end). Tokens are independent: each range writes
// only its own rows, so how the tokens are split over threads never changes
// a bit. A range stops at a non-finite logit and says so in *bad_logits.
void route_tokens(const RoutePlan& p, int64_t t_begin, int64_t t_end, uint8_t* bad_logits) {
  RouteScratch w(p);
  for (int64_t t = t_begin; t < t_end; ++t) {
    const float* row = p.logits.row<const float>(t);
    if (!detail::all_finite(row, p.E)) {
      *bad_logits = 1;
      return;
    }
    float* prob = p.out.scores.data() + t * p.E;
    detail::probabilities_row(p.config.score_function, row, prob, p.E);
    const float* base = p.config.softmax_after_topk ? row : prob;
    const float* score = base;  // selection scores
    if (p.bias) {
      detail::add_rows(base, p.bias, w.select.data(), p.E);
      score = w.select.data();
    }
    int32_t* sel = p.out.selected_idx.data() + t * p.K;
    if (p.G > 1)
      select_grouped(p, score, sel, w);
    else
      select_flat(p, score, sel, w);
    write_weights(p, t, row, prob, sel);
  }
}

// The bias as a pointer, after checking its shape; null when there is none.
Result<const float*> checked_bias(const TensorView& logits, const TensorView& expert_bias, int E) {
  if (!expert_bias.defined()) return static_cast<const float*>(nullptr);
  if (expert_bias.ndim() != 1 || expert_bias.dtype() != DType::kF32 || expert_bias.size(0) != E ||
      expert_bias.stride(0) != 1 || expert_bias.device().kind != DeviceKind::kHost) {
    EPX_RETURN_IF_ERROR(detail::check_logits(logits, E));
    return invalid_argument("expert_bias must be a host f32[{}] with unit stride, got {}", E, expert_bias.describe());
  }
  return expert_bias.data_as<const float>();
}

// Sizes every field of out for T tokens (its vectors keep their capacity).
void reset_output(const RouterConfig& config, int64_t T, RouterOutput& out) {
  const int E = config.num_experts, K = config.topk;
  out.num_tokens = T;
  out.num_experts = E;
  out.topk = K;
  out.num_dropped = 0;
  out.topk_idx.assign(T * K, -1);
  out.topk_weights.assign(T * K, 0.0f);
  out.selected_idx.assign(T * K, -1);
  out.selected_probs.assign(T * K, 0.0f);
  out.scores.resize(T * E);
}

// Every field of out is written (its vectors keep their capacity).
Status route_into_output(const RouterConfig& config, const TensorView& logits, const TensorView& expert_bias,
                         RouterOutput& out) {
  EPX_RETURN_IF_ERROR(config.validate());
  // The logits' values are checked row by row while routing (below); a bad
  // shape is reported here, and a bad value before a bad bias, as always.
  EPX_RETURN_IF_ERROR(detail::check_logits_shape(logits, config.num_experts));
  const int E = config.num_experts;
  const int64_t T = logits.size(0);
  EPX_ASSIGN_OR_RETURN(const float* bias, checked_bias(logits, expert_bias, E));
  reset_output(config, T, out);
  const RoutePlan plan(config, logits, bias, out);

  // Large batches use the machine's cores (at most 8 threads); small ones stay on the caller's.
  constexpr int64_t kMinWorkPerThread = 1 << 17;  // (token, expert) pairs
  const int64_t wanted = T * E / kMinWorkPerThread;
  // The core count is a system call (a file read): asked only for a batch that could use it.
  const int64_t num_threads = wanted < 2 ? 1 : std::clamp<int64_t>(wanted, 1, machine_threads());
  // A worker that cannot start (the process is out of threads) leaves its
  // range to the caller's thread: the same output, later.
  std::vector<uint8_t> bad_logits(num_threads, 0);  // one flag per range
  detail::run_shares(static_cast<int>(num_threads), "a router worker thread", [&](int i) {
    route_tokens(plan, T * i / num_threads, T * (i + 1) / num_threads, &bad_logits[i]);
  });
  if (std::find(bad_logits.begin(), bad_logits.end(), 1) != bad_logits.end()) {
    EPX_RETURN_IF_ERROR(detail::check_logits(logits, E));
    return internal_error("a logits row was not finite, yet check_logits found no bad value");
  }
  out.capacity = expert_capacity(config, T);
  if (out.capacity > 0) apply_capacity(config, out);
  out.tokens_per_expert.assign(E, 0);
  for (int32_t e : out.topk_idx)
    if (e >= 0) ++out.tokens_per_expert[e];
  out.rows_per_expert = out.tokens_per_expert;
  if (config.pad_to_capacity) std::fill(out.rows_per_expert.begin(), out.rows_per_expert.end(), out.capacity);
  return Status::ok();
}

}  // namespace

Result<RouterOutput> route(const RouterConfig& config, const TensorView& logits, const TensorView& expert_bias) {
  return detail::guard("route", [&]() -> Result<RouterOutput> {
    RouterOutput out;
    EPX_RETURN_IF_ERROR(route_into_output(config, logits, expert_bias, out));
    return out;
  });
}

Status route_into(const RouterConfig& config, const TensorView& logits, const TensorView& expert_bias,
                  RouterOutput* out) {
  if (out == nullptr) return invalid_argument("route_into needs an output, got a null pointer");
  return detail::guard("route", [&] { return route_into_output(config, logits, expert_bias, *out); });
}

Result<std::vector<float>> route_backward(const RouterConfig& config, const RouterOutput& forward,
                                          const TensorView& grad_topk_weights) {
  EPX_RETURN_IF_ERROR(config.validate());
  const int E = config.num_experts;
  const int K = config.topk;
  const int64_t T = forward.num_tokens;
  if (forward.num_experts != E || forward.topk != K ||
      static_cast<int64_t>(forward.selected_idx.size()) != T * K ||
      static_cast<int64_t>(forward.scores.size()) != T * E)
    return invalid_argument("forward was made for num_experts = {}, topk = {}; the config has {} and {}",
                            forward.num_experts, forward.topk, E, K);
  if (grad_topk_weights.ndim() != 2)
    return invalid_argument("grad_topk_weights must be 2-D, got {}", grad_topk_weights.describe());
  EPX_RETURN_IF_ERROR(check_matrix(grad_topk_weights, "grad_topk_weights", DType::kF32, T, K));

  std::vector<float> grad(T * E, 0.0f);
  std::vector<float> g_p(K);
  for (int64_t t = 0; t < T; ++t) {
    const float* gw = grad_topk_weights.row<const float>(t);
    const float* p = forward.selected_probs.data() + t * K;
    const int32_t* sel = forward.selected_idx.data() + t * K;
    const int32_t* kept = forward.topk_idx.data() + t * K;
    // Through scaling and normalization: w_j = c * p_j / Z.
    float denom = 1.0f;
    if (config.normalize_weights) {
      denom = 0.0f;
      for (int j = 0; j < K; ++j) denom += p[j];
    }
    float dot = 0.0f;  // sum_m gw_m * w_m / c, over kept slots
    for (int j = 0; j < K; ++j) {
      const float g = kept[j] >= 0 ? gw[j] : 0.0f;
      g_p[j] = config.scaling_factor * g / denom;
      dot += g * p[j];
    }
    if (config.normalize_weights)
      for (int j = 0; j < K; ++j) g_p[j] -= config.scaling_factor * dot / (denom * denom);

    // Through the score function.
    float* out = grad.data() + t * E;
    if (config.softmax_after_topk) {
      float inner = 0.0f;
      for (int j = 0; j < K; ++j) inner += g_p[j] * p[j];
      for (int j = 0; j < K; ++j) out[sel[j]] = p[j] * (g_p[j] - inner);
    } else if (config.score_function == ScoreFunction::kSigmoid) {
      for (int j = 0; j < K; ++j) out[sel[j]] = g_p[j] * p[j] * (1.0f - p[j]);
    } else {
      const float* s = forward.scores.data() + t * E;
      float inner = 0.0f;
      for (int j = 0; j < K; ++j) inner += g_p[j] * p[j];
      for (int e = 0; e < E; ++e) out[e] = -s[e] * inner;
      for (int j = 0; j < K; ++j) out[sel[j]] += s[sel[j]] * g_p[j];
    }
  }
  return grad;
}

}  // namespace epx
