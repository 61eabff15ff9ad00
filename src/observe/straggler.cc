#include "epx/observe/straggler.h"

#include <algorithm>
#include <cmath>
#include <map>

#include <fmt/format.h>

namespace epx {

namespace {

// The thresholds of docs/operations.md (## Finding a straggler).
constexpr double kMinNetShare = 0.3;          // of the ranks' positive net blame (at most 3 stragglers)
constexpr double kMinSecondsPerStep = 1e-3;   // its net blame per step at least this ...
constexpr double kMinShareOfStep = 0.05;      // ... and 5% of the mean step time
constexpr double kHotRowsOverMean = 1.5;      // received rows vs the mean EP rank: a hot expert

double finite_or_zero(double x) { return std::isfinite(x) ? x : 0.0; }

// What the window says about one rank.
struct Blame {
  double late = 0;       // others' wait for it to arrive, summed over the window
  double slow_data = 0;  // others' wait for its data
  double waited = 0;     // its own wait for the others (exchange_wait)
  std::map<int, double> waiters;  // from the wait matrices: who waited for it, how long
  [[nodiscard]] double total() const { return late + slow_data; }
  // What it made the others wait beyond what they made it wait: about 0 for
  // every rank when the waiting is noise, large for the one everybody waits for.
  [[nodiscard]] double net() const { return total() - waited; }
};

struct Window {
  std::map<int, Blame> blame;  // by world rank
  int num_ranks = 0;
  bool one_node = false;  // every step on one node: no link between any two ranks
  double step_seconds = 0;  // summed
  std::vector<double> rows_per_ep_rank;  // received rows (tokens_per_rank), summed over layers and steps
};

void add_matrix(const WaitMatrix& m, Window& w) {
  for (int r = 0; r < m.num_ranks; ++r)
    for (int s = 0; s < m.num_ranks; ++s) {
      const double waited = finite_or_zero(m.arrival_at(r, s)) + finite_or_zero(m.data_at(r, s));
      if (r != s && waited > 0) w.blame[s].waiters[r] += waited;
    }
}

void add_rows(const StepRecord& step, Window& w) {
  for (const LayerRecord& layer : step.layers) {
    if (w.rows_per_ep_rank.size() < layer.tokens_per_rank.size()) w.rows_per_ep_rank.resize(layer.tokens_per_rank.size());
    for (std::size_t e = 0; e < layer.tokens_per_rank.size(); ++e)
      w.rows_per_ep_rank[e] += static_cast<double>(layer.tokens_per_rank[e]);
  }
}

Window summarize(std::span<const StepRecord> steps) {
  Window w;
  w.one_node = true;
  for (const StepRecord& step : steps) {
    w.one_node = w.one_node && step.num_nodes == 1;
    w.step_seconds += finite_or_zero(step.seconds);
    w.num_ranks = std::max(w.num_ranks, static_cast<int>(step.ranks.size()));
    for (const RankRecord& r : step.ranks) {
      Blame& b = w.blame[r.rank];
      b.late += finite_or_zero(r.late);
      b.slow_data += finite_or_zero(r.slow_data);
      b.waited += finite_or_zero(r.exchange_wait);
    }
    if (step.wait_matrix) add_matrix(*step.wait_matrix, w);
    add_rows(step, w);
  }
  return w;
}

// Received rows of world rank `rank`'s EP rank over the mean EP rank (0 when
// the window has no loads). tokens_per_rank is indexed by EP rank, summed
// over EP groups: world rank r is EP rank r % ep.
double rows_over_mean(const Window& w, int rank) {
  const std::size_t ep = w.rows_per_ep_rank.size();
  if (ep == 0) return 0;
  double sum = 0;
  for (double rows : w.rows_per_ep_rank) sum += rows;
  if (sum <= 0) return 0;
  return w.rows_per_ep_rank[static_cast<std::size_t>(rank) % ep] / (sum / static_cast<double>(ep));
}

// On one node the ranks' data moves through memory, copied by the ranks
// themselves: a rank slow with its data there is slow itself, not its link.
StragglerCause classify(const Blame& b, double rows_ratio, bool one_node) {
  if (b.slow_data > b.late && !one_node) return StragglerCause::kLink;
  return rows_ratio >= kHotRowsOverMean ? StragglerCause::kHotExpert : StragglerCause::kCompute;
}

// "ranks 0, 2, 3" waited for it, most first (from the wait matrices).
std::string waiters_text(const Blame& b) {
  std::vector<std::pair<double, int>> by_wait;
  for (const auto& [rank, seconds] : b.waiters) by_wait.emplace_back(-seconds, rank);
  std::sort(by_wait.begin(), by_wait.end());
  std::vector<int> ranks;
  for (const auto& entry : by_wait) ranks.push_back(entry.second);
  if (ranks.empty()) return "";
  return fmt::format("; waited for by rank{} {}", ranks.size() > 1 ? "s" : "", fmt::join(ranks, ", "));
}

std::string explain(const Blame& b, double share, double num_steps, double rows_ratio, bool one_node) {
  std::string rows = rows_ratio > 0 ? fmt::format("; receives {:.2f}x the mean rows", rows_ratio) : "";
  return fmt::format("the others waited {:.1f} ms/step for it ({:.0f}% of all waiting over {} steps): {:.1f} ms for it "
                     "to arrive, {:.1f} ms for its data{}; it waited {:.1f} ms/step for them{}{}",
                     1e3 * b.total() / num_steps, 100 * share, num_steps, 1e3 * b.late / num_steps,
                     1e3 * b.slow_data / num_steps, one_node ? " (one node: no link between ranks)" : "",
                     1e3 * b.waited / num_steps, rows, waiters_text(b));
}

}  // namespace

std::string_view cause_name(StragglerCause cause) {
  switch (cause) {
    case StragglerCause::kCompute: return "compute";
    case StragglerCause::kLink: return "link";
    case StragglerCause::kHotExpert: return "hot expert";
  }
  return "unknown";
}

std::string describe(const Straggler& straggler) {
  return fmt::format("rank {} ({}): {}", straggler.rank, cause_name(straggler.cause), straggler.explanation);
}

Result<std::vector<Straggler>> diagnose_metrics_file(const std::string& path, int64_t last_steps) {
  if (last_steps < 1) return invalid_argument("last_steps = {} is below 1", last_steps);
  StragglerWindow window(static_cast<std::size_t>(last_steps));
  EPX_RETURN_IF_ERROR(read_metrics(path, [&](StepRecord&& record) {
    window.add(std::move(record));
    return Status::ok();
  }));
  return window.diagnose();
}

void StragglerWindow::add(StepRecord step) {
  if (capacity_ == 0) return;
  if (steps_.size() == capacity_) steps_.erase(steps_.begin());
  steps_.push_back(std::move(step));
}

std::vector<Straggler> diagnose_stragglers(std::span<const StepRecord> window) {
  std::vector<Straggler> out;
  if (window.empty()) return out;
  const Window w = summarize(window);
  double total = 0, positive_net = 0;
  for (const auto& entry : w.blame) {
    total += entry.second.total();
    positive_net += std::max(entry.second.net(), 0.0);
  }
  if (total <= 0 || positive_net <= 0 || w.num_ranks < 2) return out;
  const double num_steps = static_cast<double>(window.size());
  const double min_per_step = std::max(kMinSecondsPerStep, kMinShareOfStep * w.step_seconds / num_steps);
  for (const auto& [rank, b] : w.blame) {
    if (b.net() < kMinNetShare * positive_net || b.net() / num_steps < min_per_step) continue;
    const double share = b.total() / total;
    const double per_step = b.total() / num_steps;
    const double rows_ratio = rows_over_mean(w, rank);
    out.push_back(Straggler{rank, classify(b, rows_ratio, w.one_node), share, per_step,
                            explain(b, share, num_steps, rows_ratio, w.one_node)});
  }
  std::sort(out.begin(), out.end(), [](const Straggler& a, const Straggler& b) { return a.share > b.share; });
  return out;
}

}  // namespace epx
