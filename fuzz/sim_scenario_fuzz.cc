// `epx sim SCENARIO`: the TOML text of a scenario into a validated Scenario.
// The text claims to be configs/sim/fuzz.toml (run from the repository root),
// so a hardware.profile of "../hardware/h100.toml" is read as in the real
// scenarios (and a bare name, "h100", among the shipped profiles). Any input gives a scenario that passes its own validation, or a
// refusal (InvalidArgument, or NotFound for a profile file) naming the file.
#include <cstddef>
#include <cstdint>

#include "epx/sim/scenario.h"
#include "fuzz_check.h"

extern "C" int LLVMFuzzerTestOneInput(const uint8_t* data, size_t size) {
  const std::string path = "configs/sim/fuzz.toml";
  auto scenario = epx::sim::parse_scenario(epx::fuzz::as_text(data, size), path);
  if (!scenario.is_ok()) {
    epx::fuzz::check_refusal(scenario.status(), path);
    return 0;
  }
  const epx::Status valid = scenario->validate();
  EPX_FUZZ_CHECK(valid.is_ok(), valid);
  EPX_FUZZ_CHECK(scenario->num_gpus() >= 1 && scenario->ep_groups_per_stage() >= 1);
  return 0;
}
