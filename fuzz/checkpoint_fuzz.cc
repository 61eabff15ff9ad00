// `epx train --resume DIR`: the two kinds of checkpoint file a resume reads,
// from bytes (train/checkpoint.h). The first input byte picks the file and mode:
//   0 meta.json as it is          1 meta.json with its meta_xxh3 recomputed
//   2 a part file (dense.bin,     3 a part file with its magic, version and
//     experts-N.bin) as it is        checksums made right
// Modes 1 and 3 take the input past the checksums, so the fuzzer reaches the
// structure behind them. Any input is parsed or refused with InvalidArgument
// naming the file; an accepted part file serialises back to the same bytes,
// and an accepted meta.json formats to text that parses again.
#include <cstddef>
#include <cstdint>
#include <cstring>
#include <span>
#include <vector>

#define XXH_INLINE_ALL
#include <xxhash.h>

#include <fmt/format.h>
#include <nlohmann/json.hpp>

#include "fuzz_check.h"
#include "train/checkpoint.h"

namespace {

using epx::detail::CheckpointMeta;

// meta.json with its self-checksum made right (when the text is a JSON object).
std::string with_meta_checksum(std::string_view text) {
  nlohmann::json j = nlohmann::json::parse(text, nullptr, /*allow_exceptions=*/false);
  if (j.is_discarded() || !j.is_object()) return std::string(text);
  j.erase("meta_xxh3");
  const std::string compact = j.dump(-1, ' ', false, nlohmann::json::error_handler_t::replace);
  j["meta_xxh3"] = fmt::format("{:016x}", XXH3_64bits(compact.data(), compact.size()));
  return j.dump(2, ' ', false, nlohmann::json::error_handler_t::replace);
}

void check_meta(std::string_view text) {
  const std::string name = "meta.json";
  CheckpointMeta meta;
  const epx::Status s = epx::detail::parse_checkpoint_meta(text, name, &meta);
  if (!s.is_ok()) return epx::fuzz::check_refusal(s, name);
  CheckpointMeta again;
  const epx::Status back = epx::detail::parse_checkpoint_meta(epx::detail::format_checkpoint_meta(meta), name, &again);
  EPX_FUZZ_CHECK(back.is_ok(), back);
  EPX_FUZZ_CHECK(again.step == meta.step && again.num_ranks == meta.num_ranks && again.ep == meta.ep &&
                 again.files.size() == meta.files.size());
}

// The header's fixed fields and checksums set from the bytes (offsets of
// serialize_part_file's header: 72 bytes, the last three words at 48, 56, 64).
void fix_part_header(std::vector<uint8_t>& bytes) {
  constexpr std::size_t kHeader = 72;
  if (bytes.size() < kHeader) return;
  const uint32_t version = 3, header_bytes = kHeader;
  std::memcpy(bytes.data(), "EPX-CKPT", 8);
  std::memcpy(bytes.data() + 8, &version, 4);
  std::memcpy(bytes.data() + 12, &header_bytes, 4);
  const uint64_t payload_bytes = bytes.size() - kHeader;
  const uint64_t payload_xxh3 = XXH3_64bits(bytes.data() + kHeader, payload_bytes);
  std::memcpy(bytes.data() + 48, &payload_bytes, 8);
  std::memcpy(bytes.data() + 56, &payload_xxh3, 8);
  const uint64_t header_xxh3 = XXH3_64bits(bytes.data(), 64);
  std::memcpy(bytes.data() + 64, &header_xxh3, 8);
}

void check_part_file(std::span<const uint8_t> bytes) {
  const std::string name = "experts-0.bin";
  epx::detail::PartFileHeader header;
  epx::detail::PartState state;
  const epx::Status s = epx::detail::parse_part_file(bytes, name, &header, &state);
  if (!s.is_ok()) return epx::fuzz::check_refusal(s, name);
  const std::vector<uint8_t> again = epx::detail::serialize_part_file(header, state);
  EPX_FUZZ_CHECK(again.size() == bytes.size() && std::equal(again.begin(), again.end(), bytes.begin()));
}

}  // namespace

extern "C" int LLVMFuzzerTestOneInput(const uint8_t* data, size_t size) {
  if (size == 0) return 0;
  const int mode = data[0] % 4;
  const std::span<const uint8_t> rest(data + 1, size - 1);
  if (mode == 0) check_meta(epx::fuzz::as_text(rest.data(), rest.size()));
  if (mode == 1) check_meta(with_meta_checksum(epx::fuzz::as_text(rest.data(), rest.size())));
  if (mode == 2) check_part_file(rest);
  if (mode == 3) {
    std::vector<uint8_t> fixed(rest.begin(), rest.end());
    fix_part_header(fixed);
    check_part_file(fixed);
  }
  return 0;
}
