// `epx train --config FILE`: the TOML text of a config file into the options.
// Any input is parsed or refused with InvalidArgument naming the file.
#include <cstddef>
#include <cstdint>

#include "fuzz_check.h"
#include "train.h"

extern "C" int LLVMFuzzerTestOneInput(const uint8_t* data, size_t size) {
  const std::string path = "fuzz.toml";
  epx::app::TrainOptions options;
  const epx::Status s = epx::app::parse_train_config(epx::fuzz::as_text(data, size), path, options);
  if (!s.is_ok()) {
    EPX_FUZZ_CHECK(s.code() == epx::StatusCode::kInvalidArgument, s);
    epx::fuzz::check_refusal(s, path);
  }
  return 0;
}
