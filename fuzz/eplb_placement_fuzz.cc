// `epx eplb --current FILE`: a slot -> expert placement file. The last four
// bytes of the input pick the shape the file is read against (experts 1..64,
// ranks 1..16, slots per rank 1..16 or a count that ranks do not divide, the
// policy); the rest is the file. Any input gives a placement of exactly that
// shape, or InvalidArgument naming the file.
#include <cstddef>
#include <cstdint>
#include <sstream>

#include "eplb.h"
#include "fuzz_check.h"

namespace {

struct Shape {
  int num_experts, num_ranks, num_slots;
  epx::PlacementPolicy policy;
};

Shape shape_of(const uint8_t* tail) {
  Shape s{};
  s.num_experts = 1 + tail[0] % 64;
  s.num_ranks = 1 + tail[1] % 16;
  const int slots_per_rank = 1 + tail[2] % 16;
  // One time in eight the slots are not a multiple of the ranks.
  s.num_slots = s.num_ranks * slots_per_rank + ((tail[3] & 0x70) == 0 ? 1 : 0);
  s.policy = (tail[3] & 1) ? epx::PlacementPolicy::kGlobal : epx::PlacementPolicy::kHierarchical;
  return s;
}

}  // namespace

extern "C" int LLVMFuzzerTestOneInput(const uint8_t* data, size_t size) {
  if (size < 4) return 0;
  const Shape shape = shape_of(data + size - 4);
  const std::string path = "fuzz-placement.txt";
  std::istringstream in{std::string(epx::fuzz::as_text(data, size - 4))};
  auto placement =
      epx::app::parse_placement(in, path, shape.num_experts, shape.num_slots, shape.num_ranks, shape.policy);
  if (!placement.is_ok()) {
    EPX_FUZZ_CHECK(placement.status().code() == epx::StatusCode::kInvalidArgument, placement.status());
    epx::fuzz::check_refusal(placement.status(), path);
    return 0;
  }
  EPX_FUZZ_CHECK(placement->num_experts() == shape.num_experts && placement->num_ranks() == shape.num_ranks);
  EPX_FUZZ_CHECK(placement->num_slots() == shape.num_slots);
  for (int32_t e : placement->slot_expert()) EPX_FUZZ_CHECK(e >= -1 && e < shape.num_experts);
  return 0;
}
