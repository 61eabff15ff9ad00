// Private: the trainer's per-step who-waited-for-whom summary (RankTimes'
// exchange_wait, waited_for, late, slow_data) and matrix (WaitMatrixReport),
// from the layers' WaitRecords.
//
// Every rank appends its row to what the step report all-gathers
// (append_wait_row); rank 0 turns the gathered rows into the fields
// (fill_wait_fields), so the column sums (late, slow_data) cost one
// all-gather of 2 R + 1 doubles per rank that the report makes anyway.
#pragma once

#include <cstdint>
#include <optional>
#include <span>
#include <string>
#include <vector>

#include "epx/comm/transport.h"
#include "epx/layer/moe_layer.h"
#include "epx/train/trainer.h"

namespace epx::detail {

// Doubles append_wait_row adds for a world of `world_size` ranks.
[[nodiscard]] constexpr std::size_t wait_row_size(int world_size) { return 2 * static_cast<std::size_t>(world_size) + 1; }

// Appends this rank's row: arrival[world_size], data[world_size] (the
// layers' last forward + backward, summed; the layers' ranks are those of
// `ep`, placed at their world ranks), then the seconds blocked.
void append_wait_row(const std::vector<MoELayer*>& layers, const Transport& ep, int world_size,
                     std::vector<double>* row);

// Rank 0: `rows` holds every rank's gathered fields, `stride` doubles per
// rank, its wait row at `offset`. Sets each of ranks[0..R)'s wait fields
// and, when `with_matrix`, the matrices.
void fill_wait_fields(std::span<const double> rows, std::size_t stride, std::size_t offset, bool with_matrix,
                      std::vector<RankTimes>* ranks, std::optional<WaitMatrixReport>* matrix);

// Whether step `step` (0-based) reports the matrix: the every-th, 2 every-th,
// ... step (like eplb_every and save_every); never when `every` is 0.
[[nodiscard]] bool wait_matrix_due(int64_t step, int64_t every);

// A number for a JSON line: its shortest round-trip form, or null when it
// is not finite (JSON has no NaN).
[[nodiscard]] std::string json_number(double value);

// ,"wait_matrix":{...} for StepReport::to_json ("" without a matrix).
[[nodiscard]] std::string wait_matrix_json(const std::optional<WaitMatrixReport>& matrix);

}  // namespace epx::detail
