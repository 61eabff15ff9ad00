#include "train_record.h"

#include <cmath>
#include <cstddef>
#include <limits>

namespace epx::app {
namespace {

// What the metrics line keeps of a number it writes as null when non-finite.
double as_written(double value) { return std::isfinite(value) ? value : std::numeric_limits<double>::quiet_NaN(); }

LayerRecord layer_record(int index, const LoadStats& s) {
  return LayerRecord{.layer = index,
                     .max_vio = as_written(s.max_vio),
                     .cv = as_written(s.cv),
                     .dropped = s.num_dropped,
                     .worst_rank = s.worst_rank,
                     .worst_rank_share = as_written(s.worst_rank_share),
                     .idle_fraction = as_written(s.idle_fraction),
                     .tokens_per_expert = s.tokens_per_expert,
                     .tokens_per_rank = s.tokens_per_rank};
}

RankRecord rank_record(int index, const RankTimes& t) {
  return RankRecord{.rank = index,
                    .router = t.router,
                    .dispatch = t.dispatch,
                    .experts = t.experts,
                    .combine = t.combine,
                    .dense = t.dense,
                    .wait = t.wait,
                    .sync = t.sync,
                    .total = t.total,
                    .grad_reduce = t.grad_reduce,
                    .grad_wait = t.grad_wait,
                    .grad_bytes = t.grad_bytes,
                    .exchange_wait = t.exchange_wait,
                    .waited_for = t.waited_for,
                    .late = t.late,
                    .slow_data = t.slow_data};
}

}  // namespace

StepRecord step_record(const StepReport& r) {
  StepRecord out;
  out.step = r.step;
  out.loss = as_written(r.loss);
  out.main_loss = as_written(r.main_loss);
  out.lr = as_written(r.learning_rate);
  out.grad_norm = as_written(r.grad_norm);
  out.seconds = as_written(r.seconds);
  out.tokens_per_s = as_written(r.tokens_per_second);
  out.num_nodes = r.num_nodes;
  out.resumed_from = r.resumed_from;
  for (std::size_t l = 0; l < r.layers.size(); ++l) out.layers.push_back(layer_record(static_cast<int>(l), r.layers[l]));
  for (std::size_t k = 0; k < r.ranks.size(); ++k) out.ranks.push_back(rank_record(static_cast<int>(k), r.ranks[k]));
  if (r.wait_matrix)
    out.wait_matrix = WaitMatrix{.num_ranks = r.wait_matrix->num_ranks,
                                 .arrival = r.wait_matrix->arrival,
                                 .data = r.wait_matrix->data};
  if (r.eplb)
    out.eplb = EplbRecord{.balance_before = r.eplb->balance_before,
                          .balance_after = r.eplb->balance_after,
                          .moved_slots = r.eplb->num_moved_slots,
                          .moved_bytes = r.eplb->moved_bytes};
  return out;
}

}  // namespace epx::app
