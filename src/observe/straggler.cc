#include "epx/observe/straggler.h"

#include <algorithm>
#include <cmath>
#include <map>
#include <optional>

#include <fmt/format.h>

namespace epx {

namespace {

// The thresholds of docs/operations.md (## Finding a straggler).
constexpr double kMinNetShare = 0.3;          // of the ranks' positive net blame (at most 3 stragglers)
constexpr double kMinSecondsPerStep = 1e-3;   // its net blame per step at least this ...
constexpr double kMinShareOfStep = 0.05;      // ... and 5% of the mean step time
constexpr double kHotRowsOverMean = 1.5;      // received rows vs the mean EP rank: a hot expert
constexpr double kSlowNodeOverNext = 1.5;     // a slow node's link: every other node waits this much more for it

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
  int num_nodes = 0;  // the same in every step, else 0 (no node-level view)
  std::vector<double> data;  // the wait matrices' data waits summed, num_ranks^2 (row: the waiter)
  int matrix_steps = 0;
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
  if (m.num_ranks != w.num_ranks) return;  // a window mixing run sizes: no node-level view
  const std::size_t cells = static_cast<std::size_t>(m.num_ranks) * m.num_ranks;
  if (w.data.empty()) w.data.resize(cells);
  if (w.data.size() != cells || m.data.size() != cells) return;
  for (std::size_t i = 0; i < w.data.size(); ++i) w.data[i] += finite_or_zero(m.data[i]);
  ++w.matrix_steps;
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
  w.num_nodes = steps.front().num_nodes;
  for (const StepRecord& step : steps) {
    w.one_node = w.one_node && step.num_nodes == 1;
    if (step.num_nodes != w.num_nodes) w.num_nodes = 0;
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

// Data waits between nodes, summed from the wait matrices: at(x, y) is what
// the ranks of node x waited for the data of node y's ranks (ranks node-major).
struct NodeWaits {
  int num_nodes = 0, per_node = 0;
  std::vector<double> sum;
  [[nodiscard]] double at(int x, int y) const { return sum[static_cast<std::size_t>(x) * num_nodes + y]; }
  // What every other node waited for node y's data: the least of them.
  [[nodiscard]] double every_other(int y) const {
    double least = -1;
    for (int x = 0; x < num_nodes; ++x)
      if (x != y && (least < 0 || at(x, y) < least)) least = at(x, y);
    return least;
  }
};

NodeWaits node_waits(const Window& w) {
  NodeWaits n{w.num_nodes, w.num_ranks / w.num_nodes, {}};
  n.sum.assign(static_cast<std::size_t>(n.num_nodes) * n.num_nodes, 0.0);
  for (int r = 0; r < w.num_ranks; ++r)
    for (int s = 0; s < w.num_ranks; ++s)
      if (r / n.per_node != s / n.per_node)
        n.sum[static_cast<std::size_t>(r / n.per_node) * n.num_nodes + s / n.per_node] +=
            w.data[static_cast<std::size_t>(r) * w.num_ranks + s];
  return n;
}

// The rank of node y whose data the other nodes waited for most.
int most_waited_rank(const Window& w, const NodeWaits& n, int y) {
  int best = y * n.per_node;
  double best_wait = -1;
  for (int s = y * n.per_node; s < (y + 1) * n.per_node; ++s) {
    double wait = 0;
    for (int r = 0; r < w.num_ranks; ++r)
      if (r / n.per_node != y) wait += w.data[static_cast<std::size_t>(r) * w.num_ranks + s];
    if (wait > best_wait) best = s, best_wait = wait;
  }
  return best;
}

// A node whose link is slow: every other node waited for its data, and at
// least kSlowNodeOverNext times what every other node waited for any other
// node's. Needs 3 nodes or more and the wait matrices: with 2 nodes the one
// link is both ends' (a slow direction delays the other too, docs/operations.md),
// and without matrices the waits are not known per pair of nodes.
std::optional<Straggler> slow_node_link(const Window& w, double min_per_step) {
  if (w.num_nodes < 3 || w.matrix_steps == 0 || w.num_ranks % w.num_nodes != 0 ||
      w.data.size() != static_cast<std::size_t>(w.num_ranks) * w.num_ranks)
    return std::nullopt;
  const NodeWaits n = node_waits(w);
  int slow = 0;
  double next = 0;
  for (int y = 1; y < n.num_nodes; ++y)
    if (n.every_other(y) > n.every_other(slow)) slow = y;
  for (int y = 0; y < n.num_nodes; ++y)
    if (y != slow) next = std::max(next, n.every_other(y));
  const double steps = static_cast<double>(w.matrix_steps);
  const double wait = n.every_other(slow);
  if (wait / steps < min_per_step || wait < kSlowNodeOverNext * next) return std::nullopt;
  double all = 0, on_slow = 0;
  for (int x = 0; x < n.num_nodes; ++x)
    for (int y = 0; y < n.num_nodes; ++y) {
      all += n.at(x, y);
      if (y == slow) on_slow += n.at(x, y);
    }
  const int rank = most_waited_rank(w, n, slow);
  return Straggler{rank, StragglerCause::kLink, all > 0 ? on_slow / all : 0, on_slow / steps,
                   fmt::format("every other node waited for the data of node {} (ranks {}-{}): at least {:.1f} ms/step, "
                               "{:.1f}x the most every other node waited for any other node's; {:.0f}% of the data "
                               "waits between nodes over {} steps with wait matrices; its link is slow",
                               slow, slow * n.per_node, (slow + 1) * n.per_node - 1, 1e3 * wait / steps,
                               next > 0 ? wait / next : 0.0, 100 * (all > 0 ? on_slow / all : 0), w.matrix_steps)};
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
  if (total <= 0 || w.num_ranks < 2) return out;
  const double num_steps = static_cast<double>(window.size());
  const double min_per_step = std::max(kMinSecondsPerStep, kMinShareOfStep * w.step_seconds / num_steps);
  for (const auto& [rank, b] : w.blame) {
    if (positive_net <= 0 || b.net() < kMinNetShare * positive_net || b.net() / num_steps < min_per_step) continue;
    const double share = b.total() / total;
    const double per_step = b.total() / num_steps;
    const double rows_ratio = rows_over_mean(w, rank);
    out.push_back(Straggler{rank, classify(b, rows_ratio, w.one_node), share, per_step,
                            explain(b, share, num_steps, rows_ratio, w.one_node)});
  }
  // A slow node's link delays every rank that exchanges over it: the link
  // stragglers the blame finds are its shadows, the node is the cause.
  if (std::optional<Straggler> link = slow_node_link(w, min_per_step)) {
    std::erase_if(out, [](const Straggler& s) { return s.cause == StragglerCause::kLink; });
    out.push_back(std::move(*link));
  }
  std::sort(out.begin(), out.end(), [](const Straggler& a, const Straggler& b) { return a.share > b.share; });
  return out;
}

}  // namespace epx
