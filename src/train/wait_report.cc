#include "train/wait_report.h"

#include <cmath>

#include <fmt/format.h>
#include <fmt/ranges.h>

namespace epx::detail {

void append_wait_row(const std::vector<MoELayer*>& layers, const Transport& ep, int world_size,
                     std::vector<double>* row) {
  const std::size_t first = row->size();
  row->resize(first + wait_row_size(world_size), 0.0);
  double* arrival = row->data() + first;
  double* data = arrival + world_size;
  double& blocked = data[world_size];
  for (const MoELayer* layer : layers) {
    const WaitRecord& w = layer->waits();
    for (std::size_t s = 0; s < w.arrival.size(); ++s) {
      const int world = ep.world_rank(static_cast<int>(s));
      arrival[world] += w.arrival[s];
      data[world] += w.data[s];
    }
    blocked += w.blocked;
  }
}

namespace {

// The rank `r` waited for most (arrival + data), -1 when it never waited.
int most_waited_for(const double* arrival, const double* data, int num_ranks) {
  int most = -1;
  double longest = 0;
  for (int s = 0; s < num_ranks; ++s)
    if (arrival[s] + data[s] > longest) {
      longest = arrival[s] + data[s];
      most = s;
    }
  return most;
}

}  // namespace

void fill_wait_fields(std::span<const double> rows, std::size_t stride, std::size_t offset, bool with_matrix,
                      std::vector<RankTimes>* ranks, std::optional<WaitMatrixReport>* matrix) {
  const int R = static_cast<int>(ranks->size());
  if (with_matrix) {
    matrix->emplace();
    (*matrix)->num_ranks = R;
    (*matrix)->arrival.reserve(static_cast<std::size_t>(R) * R);
    (*matrix)->data.reserve(static_cast<std::size_t>(R) * R);
  }
  for (RankTimes& t : *ranks) t.late = t.slow_data = 0;
  for (int r = 0; r < R; ++r) {
    const double* arrival = rows.data() + static_cast<std::size_t>(r) * stride + offset;
    const double* data = arrival + R;
    RankTimes& t = (*ranks)[static_cast<std::size_t>(r)];
    t.exchange_wait = data[R];
    t.waited_for = most_waited_for(arrival, data, R);
    for (int s = 0; s < R; ++s) {
      (*ranks)[static_cast<std::size_t>(s)].late += arrival[s];
      (*ranks)[static_cast<std::size_t>(s)].slow_data += data[s];
    }
    if (with_matrix) {
      (*matrix)->arrival.insert((*matrix)->arrival.end(), arrival, arrival + R);
      (*matrix)->data.insert((*matrix)->data.end(), data, data + R);
    }
  }
}

bool wait_matrix_due(int64_t step, int64_t every) { return every > 0 && (step + 1) % every == 0; }

std::string json_number(double value) { return std::isfinite(value) ? fmt::format("{}", value) : "null"; }

std::string wait_matrix_json(const std::optional<WaitMatrixReport>& matrix) {
  if (!matrix) return {};
  return fmt::format(",\"wait_matrix\":{{\"num_ranks\":{},\"arrival\":[{}],\"data\":[{}]}}", matrix->num_ranks,
                     fmt::join(matrix->arrival, ","), fmt::join(matrix->data, ","));
}

}  // namespace epx::detail
