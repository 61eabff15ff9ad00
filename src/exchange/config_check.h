// Private: what Buffer::create and LowLatencyBuffer::create check the same
// way (the placement, and that every rank passed the same config).
#pragma once

#include <cstdint>
#include <optional>
#include <span>
#include <string_view>

#include "epx/comm/transport.h"
#include "epx/core/clock.h"
#include "epx/exchange/placement.h"

namespace epx::detail {

// Checks a given placement against the world, or makes the default
// (contiguous blocks of E / R).
[[nodiscard]] Status resolve_placement(std::optional<ExpertPlacement>* placement, int num_experts, int num_ranks);

// FNV-1a over the expert -> rank map, as a non-negative word.
[[nodiscard]] int64_t placement_hash(const ExpertPlacement& placement);

// Collective: each rank passes its own check of its config and the fields
// that must agree (`names[i]` names fields[i]). A rank whose check failed
// returns it and the others Aborted naming that rank; fields that differ are
// InvalidArgument on every rank. `config` and `object` name the two in
// messages ("BufferConfig", "Buffer").
[[nodiscard]] Status agree_on_config(Transport& transport, const Status& local_status,
                                     std::span<const int64_t> fields, std::span<const char* const> names,
                                     std::string_view config, std::string_view object, const Deadline& deadline);

}  // namespace epx::detail
