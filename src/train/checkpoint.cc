#include "train/checkpoint.h"

#include <fcntl.h>
#include <sys/stat.h>
#include <sys/statvfs.h>
#include <unistd.h>

#include <algorithm>
#include <atomic>
#include <bit>
#include <cerrno>
#include <charconv>
#include <chrono>
#include <cstdlib>
#include <cstring>
#include <filesystem>
#include <map>
#include <thread>

#include <fmt/format.h>
#include <nlohmann/json.hpp>

// xxHash from Debian's libxxhash-dev, inlined: no link-time dependency.
#define XXH_INLINE_ALL
#include <xxhash.h>

#include "epx/core/input_file.h"
#include "epx/train/checkpoint_lock.h"

namespace epx::detail {
namespace {

namespace fs = std::filesystem;
static_assert(std::endian::native == std::endian::little, "checkpoint files are little-endian");

constexpr char kMagic[8] = {'E', 'P', 'X', '-', 'C', 'K', 'P', 'T'};
constexpr std::size_t kHeaderBytes = 72;
constexpr uint32_t kMaxNameBytes = 4096;
constexpr uint64_t kMaxMetaBytes = uint64_t{64} << 20;
constexpr uint64_t kMaxPartFileBytes = uint64_t{1} << 40;
// Appended to the message for a checkpoint of an older format.
constexpr const char* kOlderFormat =
    " (format 3 stores experts in logical order; an older checkpoint resumes only with the epx that wrote it)";

uint64_t xxh3(std::span<const uint8_t> bytes) { return XXH3_64bits(bytes.data(), bytes.size()); }
std::string hex(uint64_t v) { return fmt::format("{:016x}", v); }
std::string errno_text() { return std::strerror(errno); }

// Appends little-endian values to a byte vector.
class ByteWriter {
 public:
  template <typename T>
  void pod(const T& v) {
    const auto* p = reinterpret_cast<const uint8_t*>(&v);
    out_.insert(out_.end(), p, p + sizeof(T));
  }
  void floats(const std::vector<float>& v) {
    pod(static_cast<uint64_t>(v.size()));
    const auto* p = reinterpret_cast<const uint8_t*>(v.data());
    out_.insert(out_.end(), p, p + v.size() * sizeof(float));
  }
  void text(const std::string& s) {
    pod(static_cast<uint32_t>(s.size()));
    out_.insert(out_.end(), s.begin(), s.end());
  }
  std::vector<uint8_t>& bytes() { return out_; }

 private:
  std::vector<uint8_t> out_;
};

// Reads values from a byte span; every length is checked against what is left.
class ByteReader {
 public:
  ByteReader(std::span<const uint8_t> bytes, const std::string& name) : bytes_(bytes), name_(name) {}
  template <typename T>
  Status pod(T* v, std::string_view what) {
    EPX_RETURN_IF_ERROR(need(sizeof(T), what));
    std::memcpy(v, bytes_.data() + at_, sizeof(T));
    at_ += sizeof(T);
    return Status::ok();
  }
  Status floats(std::vector<float>* v, std::string_view what) {
    uint64_t n = 0;
    EPX_RETURN_IF_ERROR(pod(&n, what));
    if (n > left() / sizeof(float))
      return invalid_argument("{}: {} claims {} values but only {} bytes are left", name_, what, n, left());
    v->resize(n);
    if (n > 0) std::memcpy(v->data(), bytes_.data() + at_, n * sizeof(float));  // no null pointer to memcpy
    at_ += n * sizeof(float);
    return Status::ok();
  }
  Status text(std::string* s, std::string_view what) {
    uint32_t n = 0;
    EPX_RETURN_IF_ERROR(pod(&n, what));
    if (n > kMaxNameBytes) return invalid_argument("{}: {} of {} bytes (limit {})", name_, what, n, kMaxNameBytes);
    EPX_RETURN_IF_ERROR(need(n, what));
    s->assign(reinterpret_cast<const char*>(bytes_.data() + at_), n);
    at_ += n;
    return Status::ok();
  }
  [[nodiscard]] std::size_t left() const { return bytes_.size() - at_; }

 private:
  Status need(std::size_t n, std::string_view what) const {
    if (n > left()) return invalid_argument("{} ends early: {} needs {} bytes, {} are left", name_, what, n, left());
    return Status::ok();
  }
  std::span<const uint8_t> bytes_;
  const std::string& name_;
  std::size_t at_ = 0;
};

// ---- files ----------------------------------------------------------------

// A regular file of at most `max_bytes`; a FIFO or a device put in a
// checkpoint folder is refused without blocking on it.
Status read_file(const fs::path& path, uint64_t max_bytes, std::vector<uint8_t>* out) {
  const auto limit = static_cast<int64_t>(std::min<uint64_t>(max_bytes, INT64_MAX));
  return read_input_file(path.string(), "the checkpoint file", limit, out);
}

// A full disk, a quota or a file-size limit is ResourceExhausted (as for the
// metrics file); any other write failure Internal.
StatusCode write_error_code(int err) {
  return err == ENOSPC || err == EDQUOT || err == EFBIG ? StatusCode::kResourceExhausted : StatusCode::kInternal;
}

// Writes, fsyncs and closes `path`; on any failure removes it.
Status write_file_durably(const fs::path& path, std::span<const uint8_t> bytes) {
  const int fd = ::open(path.c_str(), O_WRONLY | O_CREAT | O_TRUNC | O_CLOEXEC, 0644);
  if (fd < 0) return internal_error("cannot create {}: {}", path.string(), errno_text());
  std::size_t done = 0;
  std::string error;
  int err = 0;
  const auto failed = [&] {
    err = errno;
    error = errno_text();
  };
  while (error.empty() && done < bytes.size()) {
    const ssize_t n = ::write(fd, bytes.data() + done, bytes.size() - done);
    if (n < 0 && errno == EINTR) continue;
    if (n < 0) failed();
    if (n > 0) done += static_cast<std::size_t>(n);
  }
  if (error.empty() && ::fsync(fd) != 0) failed();
  if (::close(fd) != 0 && error.empty()) failed();
  if (error.empty()) return Status::ok();
  ::unlink(path.c_str());
  return make_status(write_error_code(err), "cannot write {} ({} bytes): {}", path.string(), bytes.size(), error);
}

Status fsync_dir(const fs::path& dir) {
  const int fd = ::open(dir.c_str(), O_RDONLY | O_DIRECTORY | O_CLOEXEC);
  if (fd < 0) return internal_error("cannot open folder {}: {}", dir.string(), errno_text());
  const bool ok = ::fsync(fd) == 0;
  const std::string error = ok ? "" : errno_text();
  ::close(fd);
  if (!ok) return internal_error("cannot fsync folder {}: {}", dir.string(), error);
  return Status::ok();
}

std::span<const uint8_t> as_bytes(std::string_view s) {
  return {reinterpret_cast<const uint8_t*>(s.data()), s.size()};
}

// The nearest existing ancestor of `dir` (itself when it exists).
fs::path existing_ancestor(const fs::path& dir) {
  fs::path p = fs::absolute(dir).lexically_normal();
  std::error_code ec;
  while (!fs::exists(p, ec) && p.has_parent_path() && p.parent_path() != p) p = p.parent_path();
  return p;
}

// "step-000120" -> 120; -1 for any other name.
int64_t parse_step_folder(const std::string& name) {
  if (name.size() < 6 || name.rfind("step-", 0) != 0) return -1;
  int64_t step = -1;
  const char* end = name.data() + name.size();
  auto [p, ec] = std::from_chars(name.data() + 5, end, step);
  return ec == std::errc() && p == end && step >= 0 ? step : -1;
}

}  // namespace

uint64_t model_hash(std::string_view fingerprint) { return xxh3(as_bytes(fingerprint)); }
std::string step_folder_name(int64_t step) { return fmt::format("step-{:06}", step); }
std::string expert_file_name(int ep_rank) { return fmt::format("experts-{}.bin", ep_rank); }
std::string expert_entry_name(const std::string& param, int expert) { return fmt::format("{}#{}", param, expert); }

// ---- file format ------------------------------------------------------

std::vector<uint8_t> serialize_part_file(const PartFileHeader& header, const PartState& state) {
  ByteWriter payload;
  payload.pod(state.adam_steps);
  payload.pod(static_cast<uint32_t>(state.params.size()));
  for (const PartState::Param& p : state.params) {
    payload.text(p.name);
    payload.floats(p.value);
    payload.floats(p.m);
    payload.floats(p.v);
  }
  payload.pod(static_cast<uint32_t>(state.biases.size()));
  for (const std::vector<float>& b : state.biases) payload.floats(b);

  ByteWriter out;
  out.pod(kMagic);
  out.pod(kCheckpointFormatVersion);
  out.pod(static_cast<uint32_t>(kHeaderBytes));
  out.pod(header.part);
  out.pod(header.num_ranks);
  out.pod(header.num_nodes);
  out.pod(uint32_t{0});
  out.pod(header.step);
  out.pod(header.model_hash);
  out.pod(static_cast<uint64_t>(payload.bytes().size()));
  out.pod(xxh3(payload.bytes()));
  out.pod(xxh3(out.bytes()));
  out.bytes().insert(out.bytes().end(), payload.bytes().begin(), payload.bytes().end());
  return std::move(out.bytes());
}

namespace {

Status parse_header(ByteReader& r, std::span<const uint8_t> bytes, const std::string& name, PartFileHeader* h) {
  char magic[8];
  uint32_t version = 0, header_bytes = 0, reserved = 0;
  uint64_t header_xxh3 = 0;
  EPX_RETURN_IF_ERROR(r.pod(&magic, "the magic"));
  if (std::memcmp(magic, kMagic, sizeof(kMagic)) != 0) {
    if (std::memcmp(magic, "EPXCKPT1", 8) == 0)
      return invalid_argument("{} is an epx checkpoint of format 1; this epx reads format {}", name, kCheckpointFormatVersion);
    return invalid_argument("{} is not an epx checkpoint file (no EPX-CKPT magic)", name);
  }
  EPX_RETURN_IF_ERROR(r.pod(&version, "the format version"));
  if (version != kCheckpointFormatVersion)
    return invalid_argument("{} is of checkpoint format {}; this epx reads format {}{}", name, version,
                            kCheckpointFormatVersion, version < kCheckpointFormatVersion ? kOlderFormat : "");
  EPX_RETURN_IF_ERROR(r.pod(&header_bytes, "the header size"));
  if (header_bytes != kHeaderBytes) return invalid_argument("{}: header of {} bytes, want {}", name, header_bytes, kHeaderBytes);
  EPX_RETURN_IF_ERROR(r.pod(&h->part, "the part index"));
  EPX_RETURN_IF_ERROR(r.pod(&h->num_ranks, "the rank count"));
  EPX_RETURN_IF_ERROR(r.pod(&h->num_nodes, "the node count"));
  EPX_RETURN_IF_ERROR(r.pod(&reserved, "the header"));
  if (reserved != 0)  // zero in formats 2 and 3; any other value is another format or damage
    return invalid_argument("{}: the header's reserved word is {}, not 0: not a file of format {}", name, reserved,
                            kCheckpointFormatVersion);
  EPX_RETURN_IF_ERROR(r.pod(&h->step, "the step"));
  EPX_RETURN_IF_ERROR(r.pod(&h->model_hash, "the model hash"));
  EPX_RETURN_IF_ERROR(r.pod(&h->payload_bytes, "the payload size"));
  EPX_RETURN_IF_ERROR(r.pod(&h->payload_xxh3, "the payload checksum"));
  EPX_RETURN_IF_ERROR(r.pod(&header_xxh3, "the header checksum"));
  const uint64_t actual = xxh3(bytes.first(kHeaderBytes - sizeof(uint64_t)));
  if (actual != header_xxh3)
    return invalid_argument("{}: the header's checksum is {}, its bytes hash to {}: the header is damaged", name,
                            hex(header_xxh3), hex(actual));
  if (h->payload_bytes != r.left())
    return invalid_argument("{}: the header promises {} payload bytes, the file holds {} (bytes appended or cut)", name,
                            h->payload_bytes, r.left());
  const uint64_t payload = xxh3(bytes.subspan(kHeaderBytes));
  if (payload != h->payload_xxh3)
    return invalid_argument("{}: the payload's checksum is {}, the header says {}: the file is damaged", name,
                            hex(payload), hex(h->payload_xxh3));
  return Status::ok();
}

Status parse_payload(ByteReader& r, const std::string& name, PartState* state) {
  uint32_t num_params = 0, num_layers = 0;
  EPX_RETURN_IF_ERROR(r.pod(&state->adam_steps, "the AdamW step count"));
  EPX_RETURN_IF_ERROR(r.pod(&num_params, "the parameter count"));
  // Each parameter takes at least 28 bytes (a name length and three value counts).
  if (num_params > r.left() / 28)
    return invalid_argument("{}: {} parameters cannot fit in the {} bytes left", name, num_params, r.left());
  state->params.assign(num_params, {});
  for (uint32_t i = 0; i < num_params; ++i) {
    PartState::Param& p = state->params[i];
    EPX_RETURN_IF_ERROR(r.text(&p.name, fmt::format("parameter {}'s name", i)));
    EPX_RETURN_IF_ERROR(r.floats(&p.value, p.name));
    EPX_RETURN_IF_ERROR(r.floats(&p.m, p.name + " (first moment)"));
    EPX_RETURN_IF_ERROR(r.floats(&p.v, p.name + " (second moment)"));
  }
  EPX_RETURN_IF_ERROR(r.pod(&num_layers, "the layer count"));
  if (num_layers > r.left() / 8)
    return invalid_argument("{}: {} layers' biases cannot fit in the {} bytes left", name, num_layers, r.left());
  state->biases.assign(num_layers, {});
  for (uint32_t l = 0; l < num_layers; ++l)
    EPX_RETURN_IF_ERROR(r.floats(&state->biases[l], fmt::format("layer {}'s expert bias", l)));
  if (r.left() != 0) return invalid_argument("{}: {} bytes follow the payload", name, r.left());
  return Status::ok();
}

}  // namespace

Status parse_part_file(std::span<const uint8_t> bytes, const std::string& name, PartFileHeader* header,
                       PartState* state) {
  ByteReader r(bytes, name);
  EPX_RETURN_IF_ERROR(parse_header(r, bytes, name, header));
  return parse_payload(r, name, state);
}

// ---- meta.json -------------------------------------------------------------

std::string format_checkpoint_meta(const CheckpointMeta& meta) {
  nlohmann::json files = nlohmann::json::array();
  for (const CheckpointFile& f : meta.files) {
    nlohmann::json file = {{"name", f.name}, {"bytes", f.bytes}, {"xxh3", hex(f.xxh3)}};
    if (!f.experts.empty()) file["experts"] = f.experts;
    files.push_back(std::move(file));
  }
  nlohmann::json j = {{"format", "epx-checkpoint"}, {"version", kCheckpointFormatVersion}, {"step", meta.step},
                      {"num_ranks", meta.num_ranks}, {"num_nodes", meta.num_nodes}, {"ep", meta.ep},
                      {"num_slots", meta.num_slots}, {"model", meta.fingerprint},
                      {"model_xxh3", hex(model_hash(meta.fingerprint))}, {"files", files}};
  if (!meta.layer_slots.empty()) {
    j["layer_slots"] = meta.layer_slots;
    j["eplb_window"] = meta.eplb_window;
  }
  if (!meta.run_id.empty()) j["run_id"] = meta.run_id;
  if (!meta.data.empty()) j["data"] = meta.data;
  j["meta_xxh3"] = hex(xxh3(as_bytes(j.dump())));  // of everything above, compact, keys sorted
  return j.dump(2) + "\n";
}

namespace {

using Json = nlohmann::json;

bool get_hex(const Json& j, const char* key, uint64_t* out) {
  const auto it = j.find(key);
  if (it == j.end() || !it->is_string()) return false;
  const std::string& s = it->get_ref<const std::string&>();
  if (s.size() != 16 || s.find_first_not_of("0123456789abcdef") != std::string::npos) return false;
  auto [p, ec] = std::from_chars(s.data(), s.data() + s.size(), *out, 16);
  return ec == std::errc() && p == s.data() + s.size();
}

// An integer JSON value in [lo, hi].
bool to_int(const Json& v, int64_t lo, int64_t hi, int64_t* out) {
  if (!v.is_number_integer()) return false;
  if (v.is_number_unsigned() && v.get<uint64_t>() > static_cast<uint64_t>(hi)) return false;
  *out = v.get<int64_t>();
  return *out >= lo && *out <= hi;
}

template <typename T>
bool get_int(const Json& j, const char* key, int64_t lo, int64_t hi, T* out) {
  const auto it = j.find(key);
  int64_t v = 0;
  if (it == j.end() || !to_int(*it, lo, hi, &v)) return false;
  *out = static_cast<T>(v);
  return true;
}

template <typename T>
bool get_int_lists(const Json& j, const char* key, int64_t lo, int64_t hi, std::vector<std::vector<T>>* out) {
  const auto it = j.find(key);
  if (it == j.end() || !it->is_array()) return false;
  for (const Json& list : *it) {
    if (!list.is_array()) return false;
    std::vector<T>& row = out->emplace_back();
    for (const Json& v : list) {
      int64_t x = 0;
      if (!to_int(v, lo, hi, &x)) return false;
      row.push_back(static_cast<T>(x));
    }
  }
  return true;
}

// The optional run_id (a short word) and data settings (an object of strings).
Status parse_meta_run(const Json& j, const std::string& name, CheckpointMeta* meta) {
  constexpr std::size_t kMaxRunId = 64, kMaxSettings = 64, kMaxValue = 4096;
  if (const auto it = j.find("run_id"); it != j.end()) {
    if (!it->is_string() || it->get_ref<const std::string&>().empty() ||
        it->get_ref<const std::string&>().size() > kMaxRunId ||
        it->get_ref<const std::string&>().find_first_not_of("0123456789abcdefghijklmnopqrstuvwxyz-_") != std::string::npos)
      return invalid_argument("{}: run_id must be a word of at most {} lowercase letters, digits, '-' or '_'", name,
                              kMaxRunId);
    meta->run_id = it->get<std::string>();
  }
  const auto it = j.find("data");
  if (it == j.end()) return Status::ok();
  if (!it->is_object() || it->size() > kMaxSettings)
    return invalid_argument("{}: data must be an object of at most {} settings", name, kMaxSettings);
  for (const auto& [key, value] : it->items()) {
    if (!value.is_string() || key.size() > kMaxValue || value.get_ref<const std::string&>().size() > kMaxValue)
      return invalid_argument("{}: data.{} must be a string of at most {} bytes", name, key.substr(0, 64), kMaxValue);
    meta->data[key] = value.get<std::string>();
  }
  return Status::ok();
}

Status parse_meta_files(const Json& j, const std::string& name, CheckpointMeta* meta) {
  if (!j.contains("files") || !j["files"].is_array())
    return invalid_argument("{}: 'files' must list the rank files", name);
  for (const Json& f : j["files"]) {
    CheckpointFile file;
    if (!f.is_object() || !f.contains("name") || !f["name"].is_string() ||
        !get_int(f, "bytes", 0, static_cast<int64_t>(kMaxPartFileBytes), &file.bytes) || !get_hex(f, "xxh3", &file.xxh3))
      return invalid_argument("{}: files[{}] must hold a name, bytes and an xxh3 of 16 lowercase hex digits", name,
                              meta->files.size());
    if (f.contains("experts") && !get_int_lists(f, "experts", 0, 1 << 20, &file.experts))
      return invalid_argument("{}: files[{}].experts must be lists of expert ids, one per layer", name,
                              meta->files.size());
    file.name = f["name"].get<std::string>();
    meta->files.push_back(std::move(file));
  }
  return Status::ok();
}

}  // namespace

Status parse_checkpoint_meta(std::string_view text, const std::string& name, CheckpointMeta* meta) {
  // Values nested deeper than meta.json's own are dropped while parsing (the
  // checksum then fails), so that nothing below recurses deeply.
  const Json::parser_callback_t shallow = [](int depth, Json::parse_event_t, Json&) { return depth <= 8; };
  Json j = Json::parse(text.begin(), text.end(), shallow, /*allow_exceptions=*/false);
  if (j.is_discarded() || !j.is_object())
    return invalid_argument("{} is not JSON: not an epx checkpoint meta file", name);
  if (j.contains("format") && j["format"] == "epx-checkpoint-1")
    return invalid_argument("{} is of checkpoint format 1 (epx before verified checkpoints); this epx reads format {}",
                            name, kCheckpointFormatVersion);
  uint64_t stored = 0;
  if (!j.contains("format") || j["format"] != "epx-checkpoint" || !get_hex(j, "meta_xxh3", &stored))
    return invalid_argument("{} is not an epx checkpoint meta file (format epx-checkpoint with a meta_xxh3)", name);
  uint32_t version = 0;
  if (!get_int(j, "version", 0, 1000, &version) || version != kCheckpointFormatVersion)
    return invalid_argument("{}: checkpoint format version {}; this epx reads {}{}", name,
                            j.contains("version") ? j["version"].dump() : "(none)", kCheckpointFormatVersion,
                            version > 0 && version < kCheckpointFormatVersion ? kOlderFormat : "");
  j.erase("meta_xxh3");
  const uint64_t actual = xxh3(as_bytes(j.dump()));
  if (actual != stored)
    return invalid_argument("{}: its content hashes to {} but its meta_xxh3 says {}: the file was edited or damaged", name,
                            hex(actual), hex(stored));
  *meta = {};
  if (!get_int(j, "step", 0, int64_t{1} << 62, &meta->step) ||
      !get_int(j, "num_ranks", 1, 1 << 20, &meta->num_ranks) || !get_int(j, "num_nodes", 1, 1 << 20, &meta->num_nodes) ||
      !get_int(j, "ep", 1, 1 << 20, &meta->ep) || !get_int(j, "num_slots", 1, 1 << 20, &meta->num_slots) ||
      !j.contains("model") || !j["model"].is_string())
    return invalid_argument("{}: step, num_ranks, num_nodes, ep, num_slots and model must be set", name);
  meta->fingerprint = j["model"].get<std::string>();
  uint64_t mh = 0;
  if (!get_hex(j, "model_xxh3", &mh) || mh != model_hash(meta->fingerprint))
    return invalid_argument("{}: model_xxh3 does not match its model '{}'", name, meta->fingerprint);
  EPX_RETURN_IF_ERROR(parse_meta_files(j, name, meta));
  EPX_RETURN_IF_ERROR(parse_meta_run(j, name, meta));
  if (j.contains("layer_slots")) {
    const bool ok = get_int_lists(j, "layer_slots", -1, 1 << 30, &meta->layer_slots) &&
                    get_int_lists(j, "eplb_window", 0, int64_t{1} << 62, &meta->eplb_window) &&
                    meta->layer_slots.size() == meta->eplb_window.size();
    if (!ok) return invalid_argument("{}: layer_slots and eplb_window must be lists of integer lists, one per layer", name);
  }
  return Status::ok();
}

// ---- the checkpoint directory ----------------------------------------------

Status check_save_dir(const std::string& dir) {
  std::error_code ec;
  const fs::path path(dir);
  const fs::file_status st = fs::status(path, ec);
  if (!fs::exists(st)) {
    const fs::path base = existing_ancestor(path);
    if (!fs::is_directory(base, ec))
      return invalid_argument("--save {}: {} exists and is not a folder", dir, base.string());
    return Status::ok();
  }
  if (!fs::is_directory(st))
    return invalid_argument("--save {} is an existing file; epx writes checkpoints only into a folder it owns "
                            "(a new or empty folder, or one holding {})", dir, kCheckpointMarker);
  if (fs::exists(path / kCheckpointMarker, ec)) return Status::ok();
  fs::directory_iterator it(path, ec);
  if (ec) return invalid_argument("--save {}: cannot list the folder: {}", dir, ec.message());
  // Another process's probe file (every MPI process probes) does not count,
  // nor the marker that rank 0 made since the check above (a new folder),
  // nor the lock file rank 0 may have taken meanwhile (the lock itself
  // refuses a second run).
  const auto ours = [](const fs::path& p) {
    const std::string name = p.filename().string();
    return name.rfind(".epx-probe-", 0) == 0 || name == kCheckpointMarker || name == kSaveLockFile;
  };
  while (it != fs::directory_iterator() && ours(it->path())) it.increment(ec);
  if (ec || it == fs::directory_iterator()) return Status::ok();
  return invalid_argument("--save {} is a folder that holds other files (e.g. '{}') and no {} marker; epx writes "
                          "checkpoints only into a new or empty folder, or one it created",
                          dir, it->path().filename().string(), kCheckpointMarker);
}

Status make_checkpoint_folder(const std::string& dir_name) {
  EPX_RETURN_IF_ERROR(check_save_dir(dir_name));
  const fs::path dir(dir_name);
  std::error_code ec;
  fs::create_directories(dir, ec);
  if (ec) return internal_error("cannot create checkpoint folder {}: {}", dir_name, ec.message());
  if (!fs::exists(dir / kCheckpointMarker, ec)) {
    EPX_RETURN_IF_ERROR(write_file_durably(dir / kCheckpointMarker, as_bytes("epx checkpoint folder\n")));
    EPX_RETURN_IF_ERROR(fsync_dir(dir));
  }
  return Status::ok();
}

std::vector<StepOwner> list_step_owners(const std::string& dir) {
  std::vector<StepOwner> out;
  std::error_code ec;
  for (const fs::directory_entry& e : fs::directory_iterator(dir, ec)) {
    const int64_t step = parse_step_folder(e.path().filename().string());
    if (step < 0 || !e.is_directory(ec)) continue;
    StepOwner& owner = out.emplace_back();
    owner.step = step;
    std::vector<uint8_t> bytes;
    CheckpointMeta meta;
    const fs::path meta_path = e.path() / "meta.json";
    owner.readable = read_file(meta_path, kMaxMetaBytes, &bytes).is_ok() &&
                     parse_checkpoint_meta(std::string_view(reinterpret_cast<const char*>(bytes.data()), bytes.size()),
                                           meta_path.string(), &meta)
                         .is_ok();
    if (owner.readable) owner.run_id = std::move(meta.run_id);
  }
  std::sort(out.begin(), out.end(), [](const StepOwner& a, const StepOwner& b) { return a.step < b.step; });
  return out;
}

namespace {
std::atomic<int64_t> g_save_dir_probes{0}, g_meta_reads{0};
}  // namespace

CheckpointProbes checkpoint_probes() { return {.save_dir = g_save_dir_probes.load(), .meta = g_meta_reads.load()}; }

Result<SaveSpace> probe_save_dir(const std::string& dir) {
  g_save_dir_probes.fetch_add(1);
  EPX_RETURN_IF_ERROR(check_save_dir(dir));
  SaveSpace space;
  const fs::path base = existing_ancestor(dir);
  space.probed = base.string();
  char host[256] = {};
  ::gethostname(host, sizeof(host) - 1);
  const fs::path probe = base / fmt::format(".epx-probe-{}-{}", host, ::getpid());
  const int fd = ::open(probe.c_str(), O_WRONLY | O_CREAT | O_EXCL | O_CLOEXEC, 0644);
  if (fd < 0) return invalid_argument("--save {}: cannot create a file in {}: {}", dir, space.probed, errno_text());
  ::close(fd);
  ::unlink(probe.c_str());
  struct statvfs vfs {};
  if (::statvfs(base.c_str(), &vfs) != 0)
    return invalid_argument("--save {}: cannot read the free space of {}: {}", dir, space.probed, errno_text());
  space.free_bytes = static_cast<uint64_t>(vfs.f_bavail) * vfs.f_frsize;
  return space;
}

Result<std::string> resolve_checkpoint(const std::string& path) {
  const fs::path p(path);
  std::error_code ec;
  if (!fs::exists(p, ec)) return not_found("no checkpoint at {}: it does not exist", path);
  if (fs::exists(p / "meta.json", ec)) return path;
  if (!fs::exists(p / "latest", ec))
    return not_found("no checkpoint at {}: it holds neither a 'latest' file nor meta.json", path);
  std::vector<uint8_t> bytes;
  EPX_RETURN_IF_ERROR(read_file(p / "latest", 256, &bytes));
  std::string name(bytes.begin(), bytes.end());
  while (!name.empty() && (name.back() == '\n' || name.back() == '\r')) name.pop_back();
  if (parse_step_folder(name) < 0)
    return invalid_argument("{}/latest names '{}', not a step folder (step-NNNNNN)", path, name);
  if (!fs::exists(p / name / "meta.json", ec))
    return not_found("{}/latest names {}, which holds no meta.json", path, name);
  return (p / name).string();
}

namespace {

// "experts=8" where `saved` and `mine` differ first; both whole otherwise.
std::string model_difference(const std::string& saved, const std::string& mine) {
  std::vector<std::string> a, b;
  for (const std::string* s : {&saved, &mine}) {
    std::vector<std::string>& out = s == &saved ? a : b;
    for (std::size_t start = 0; start <= s->size();) {
      const std::size_t end = std::min(s->find(' ', start), s->size());
      out.push_back(s->substr(start, end - start));
      start = end + 1;
    }
  }
  for (std::size_t i = 0; i < std::min(a.size(), b.size()); ++i)
    if (a[i] != b[i]) return fmt::format("{} in the checkpoint, {} in this run", a[i], b[i]);
  return fmt::format("'{}' in the checkpoint, '{}' in this run", saved, mine);
}

// Each file's expert lists: one list per layer in every file, ids in
// [0, experts), no (layer, expert) in two files, every layer's lists together
// [0, experts) for the same experts count.
Status check_expert_lists(const std::string& where, const CheckpointMeta& saved) {
  std::size_t num_layers = saved.files.size() > 1 ? saved.files[1].experts.size() : 0;
  std::vector<std::vector<int>> seen(num_layers);  // per layer, per expert: the file listing it, -1 none
  for (std::size_t i = 1; i < saved.files.size(); ++i) {
    const CheckpointFile& f = saved.files[i];
    if (f.experts.size() != num_layers)
      return invalid_argument("{}/meta.json: {} lists experts of {} layers, {} of {}", where, f.name, f.experts.size(),
                              saved.files[1].name, num_layers);
    for (std::size_t l = 0; l < num_layers; ++l)
      for (std::size_t k = 0; k < f.experts[l].size(); ++k) {
        const int32_t e = f.experts[l][k];
        if (e >= saved.num_slots)
          return invalid_argument("{}/meta.json: {} lists expert {} of layer {}, beyond num_slots = {}", where, f.name,
                                  e, l, saved.num_slots);
        if (static_cast<std::size_t>(e) >= seen[l].size()) seen[l].resize(static_cast<std::size_t>(e) + 1, -1);
        if (seen[l][e] >= 0)
          return invalid_argument("{}/meta.json lists layer {}'s expert {} in both {} and {}", where, l, e,
                                  saved.files[seen[l][e]].name, f.name);
        if (k > 0 && e < f.experts[l][k - 1])
          return invalid_argument("{}/meta.json: {}'s experts of layer {} are not in ascending order", where, f.name, l);
        seen[l][e] = static_cast<int>(i);
      }
  }
  for (std::size_t l = 0; l < num_layers; ++l) {
    if (seen[l].size() != seen[0].size())
      return invalid_argument("{}/meta.json lists {} experts for layer {}, {} for layer 0", where, seen[l].size(), l,
                              seen[0].size());
    const auto hole = std::find(seen[l].begin(), seen[l].end(), -1);
    if (hole != seen[l].end())
      return invalid_argument("{}/meta.json lists no file for layer {}'s expert {}", where, l, hole - seen[l].begin());
  }
  return Status::ok();
}

// meta.json of `where` against this run: the same model; the files it must
// list (dense.bin, experts-0.bin .. experts-(ep-1).bin) and their experts.
Status check_meta(const std::string& where, const CheckpointMeta& saved, const CheckpointMeta& expected) {
  if (saved.fingerprint != expected.fingerprint)
    return invalid_argument("checkpoint {} is of another model: {}", where,
                            model_difference(saved.fingerprint, expected.fingerprint));
  if (saved.num_ranks % saved.ep != 0 || saved.num_ranks % saved.num_nodes != 0)
    return invalid_argument("{}/meta.json: ep = {} and nodes = {} must divide ranks = {}", where, saved.ep,
                            saved.num_nodes, saved.num_ranks);
  if (saved.files.size() != static_cast<std::size_t>(saved.ep) + 1)
    return invalid_argument("{}/meta.json lists {} files; ep = {} needs {} (dense.bin and one expert file per EP rank)",
                            where, saved.files.size(), saved.ep, saved.ep + 1);
  for (std::size_t i = 0; i < saved.files.size(); ++i) {
    const std::string want = i == 0 ? kDenseFileName : expert_file_name(static_cast<int>(i) - 1);
    if (saved.files[i].name != want)
      return invalid_argument("{}/meta.json lists '{}' as file {}, want {}", where, saved.files[i].name, i, want);
    if (i == 0 && !saved.files[0].experts.empty())
      return invalid_argument("{}/meta.json lists experts in {}", where, kDenseFileName);
  }
  EPX_RETURN_IF_ERROR(check_expert_lists(where, saved));
  const int64_t named = parse_step_folder(fs::path(where).lexically_normal().filename().string());
  if (named >= 0 && named != saved.step)
    return invalid_argument("{}/meta.json says step {}, its folder's name step {}", where, saved.step, named);
  return Status::ok();
}

// Reads file `part` of meta.json's list and checks it against meta.json; fills `state`.
Status read_part_file(const std::string& where, const CheckpointMeta& meta, int part, PartState* state) {
  const CheckpointFile& listed = meta.files[part];
  const fs::path path = fs::path(where) / listed.name;
  const std::string name = path.string();
  Result<InputFile> file = InputFile::open(name, "the checkpoint file", -1);  // never a FIFO or a device
  if (!file.is_ok() && file.status().code() == StatusCode::kNotFound)
    return not_found("checkpoint {} has no {} (meta.json lists {} files)", where, listed.name, meta.files.size());
  EPX_RETURN_IF_ERROR(file.status());
  const auto size = static_cast<uint64_t>(file->size());
  if (size != listed.bytes)
    return invalid_argument("{} is {} bytes; meta.json lists {} (bytes appended or cut)", name, size, listed.bytes);
  std::vector<uint8_t> bytes;
  EPX_RETURN_IF_ERROR(file->read_all("the checkpoint file", name, &bytes));
  PartFileHeader h;
  EPX_RETURN_IF_ERROR(parse_part_file(bytes, name, &h, state));
  if (h.part != part) {
    const std::string holds = h.part == 0 ? kDenseFileName : expert_file_name(h.part - 1);
    return invalid_argument("{} holds the part of {}, not of {} (files swapped or renamed)", name, holds, listed.name);
  }
  if (h.num_ranks != meta.num_ranks || h.num_nodes != meta.num_nodes)
    return invalid_argument("{} was written by {} ranks on {} nodes; meta.json says {} on {}", name, h.num_ranks,
                            h.num_nodes, meta.num_ranks, meta.num_nodes);
  if (h.step != meta.step) return invalid_argument("{} is of step {}; meta.json says step {}", name, h.step, meta.step);
  if (h.model_hash != model_hash(meta.fingerprint))
    return invalid_argument("{} is of another model (hash {}) than meta.json's ({})", name, hex(h.model_hash),
                            hex(model_hash(meta.fingerprint)));
  const uint64_t actual = xxh3(bytes);
  if (actual != listed.xxh3)
    return invalid_argument("{} hashes to {}; meta.json lists {} (a file of another checkpoint?)", name, hex(actual),
                            hex(listed.xxh3));
  return Status::ok();
}

}  // namespace

namespace {

// read_checkpoint_meta of the step folder `where`.
Status read_meta_at(const std::string& where, CheckpointMeta* expected) {
  const fs::path meta_path = fs::path(where) / "meta.json";
  std::vector<uint8_t> bytes;
  EPX_RETURN_IF_ERROR(read_file(meta_path, kMaxMetaBytes, &bytes));
  CheckpointMeta saved;
  EPX_RETURN_IF_ERROR(parse_checkpoint_meta(
      std::string_view(reinterpret_cast<const char*>(bytes.data()), bytes.size()), meta_path.string(), &saved));
  EPX_RETURN_IF_ERROR(check_meta(where, saved, *expected));
  *expected = std::move(saved);
  return Status::ok();
}

}  // namespace

Status read_checkpoint_meta(const std::string& path, CheckpointMeta* expected) {
  g_meta_reads.fetch_add(1);
  EPX_ASSIGN_OR_RETURN(std::string where, resolve_checkpoint(path));
  return read_meta_at(where, expected);
}

Status verify_checkpoint(const std::string& path, CheckpointMeta* expected) {
  g_meta_reads.fetch_add(1);
  EPX_ASSIGN_OR_RETURN(std::string where, resolve_checkpoint(path));
  EPX_RETURN_IF_ERROR(read_meta_at(where, expected));
  for (std::size_t i = 0; i < expected->files.size(); ++i) {
    PartState state;
    EPX_RETURN_IF_ERROR(read_part_file(where, *expected, static_cast<int>(i), &state));
  }
  return Status::ok();
}

// ---- save ------------------------------------------------------------------

namespace {

// Every rank learns whether any rank failed, and the first failure's code and
// message (cut to 254 bytes), so every rank reports what failed in the same
// terms (a full disk is ResourceExhausted on each); this rank's own error wins.
Status agree(Transport& transport, const Status& mine, const Deadline& deadline) {
  // Each rank's status code (0: OK) in the first byte, its message after it.
  constexpr std::size_t kText = 256;
  std::vector<char> text(kText, '\0'), all(kText * static_cast<std::size_t>(transport.num_ranks()));
  if (!mine.is_ok()) {
    const std::string m = mine.message().empty() ? "failed" : mine.message();
    text[0] = static_cast<char>(mine.code());
    std::memcpy(text.data() + 1, m.data(), std::min(m.size(), kText - 2));
  }
  EPX_RETURN_IF_ERROR(transport.all_gather(std::span<const char>(text), std::span<char>(all), deadline));
  if (!mine.is_ok()) return mine;
  for (int r = 0; r < transport.num_ranks(); ++r) {
    const char* other = all.data() + static_cast<std::size_t>(r) * kText;
    if (other[0] != '\0')
      return make_status(static_cast<StatusCode>(other[0]), "rank {}: {}", r, std::string(other + 1, strnlen(other + 1, kText - 1)));
  }
  return Status::ok();
}

// A save stopped by a crash leaves `.step-N.tmp` (never published: removed)
// or, rewriting step N, `.step-N.old` (put back when step-N is missing).
void tidy_leftover(const fs::path& dir, const std::string& name) {
  if (name.rfind(".step-", 0) != 0) return;
  std::error_code ec;
  if (name.ends_with(".tmp")) fs::remove_all(dir / name, ec);
  if (!name.ends_with(".old")) return;
  const fs::path original = dir / name.substr(1, name.size() - 5);
  if (fs::exists(original, ec))
    fs::remove_all(dir / name, ec);
  else
    fs::rename(dir / name, original, ec);
}

// Rank 0: DIR exists, is ours (marker), holds no stale temporary folder, and
// has a fresh empty `tmp`.
Status prepare_save(const fs::path& dir, const fs::path& tmp) {
  EPX_RETURN_IF_ERROR(make_checkpoint_folder(dir.string()));
  std::error_code ec;
  for (const fs::directory_entry& e : fs::directory_iterator(dir, ec)) tidy_leftover(dir, e.path().filename().string());
  fs::create_directory(tmp, ec);
  if (ec) return internal_error("cannot create {}: {}", tmp.string(), ec.message());
  return Status::ok();
}

// Values [local * n, (local + 1) * n) of v.
std::span<float> block(std::vector<float>& v, int local, std::size_t n) {
  return std::span<float>(v).subspan(static_cast<std::size_t>(local) * n, n);
}

std::vector<float> copy_block(std::vector<float>& v, int local, std::size_t n) {
  const std::span<float> b = block(v, local, n);
  return {b.begin(), b.end()};
}

// dense.bin's content: every dense parameter once, the biases, the AdamW steps.
PartState collect_dense(std::span<Parameter* const> params, AdamW& adam, std::span<MoELayer* const> layers) {
  PartState state;
  state.adam_steps = adam.num_steps();
  for (const Parameter* p : params) {
    if (p->kind != ParamKind::kDense) continue;
    const AdamW::Moments& m = adam.moments_of(*p);
    state.params.push_back({p->name, p->value, m.m, m.v});
  }
  for (MoELayer* layer : layers) state.biases.push_back(layer->bias().values());
  return state;
}

// Per layer: logical expert -> its first replica's slot (the lowest).
std::vector<std::vector<int>> first_slots(std::span<MoELayer* const> layers) {
  std::vector<std::vector<int>> out;
  for (MoELayer* layer : layers) {
    std::vector<int>& first = out.emplace_back(static_cast<std::size_t>(layer->config().router.num_experts), -1);
    const std::vector<int32_t>& slots = layer->slot_expert();
    for (int s = static_cast<int>(slots.size()) - 1; s >= 0; --s)
      if (slots[s] >= 0) first[slots[s]] = s;
  }
  return out;
}

// experts-N.bin's content for EP rank `ep_rank`: the logical experts whose
// first replica it holds, by layer and expert id, with their moments.
PartState collect_experts(AdamW& adam, std::span<MoELayer* const> layers, int ep_rank) {
  PartState state;
  state.adam_steps = adam.num_steps();
  const std::vector<std::vector<int>> first = first_slots(layers);
  for (std::size_t l = 0; l < layers.size(); ++l) {
    MoELayer& layer = *layers[l];
    std::map<int, int> mine;  // logical expert -> local slot, ascending
    for (int local = 0; local < layer.num_local_experts(); ++local) {
      const int e = layer.local_logical_expert(local);
      if (e >= 0 && layer.buffer().placement().global_id(ep_rank, local) == first[l][e]) mine[e] = local;
    }
    for (const auto& [e, local] : mine)
      for (Parameter* p : layer.expert_parameters()) {
        const std::size_t n = p->value.size() / static_cast<std::size_t>(layer.num_local_experts());
        AdamW::Moments& m = adam.moments_of(*p);
        state.params.push_back({expert_entry_name(p->name, e), copy_block(p->value, local, n),
                                copy_block(m.m, local, n), copy_block(m.v, local, n)});
      }
  }
  return state;
}

// meta.json's file list without sizes: dense.bin, then experts-N.bin (from
// EP rank N of EP group 0) with the logical experts it holds, by layer.
std::vector<CheckpointFile> list_files(int ep, std::span<MoELayer* const> layers) {
  std::vector<CheckpointFile> files = {{kDenseFileName, 0, 0, {}}};
  for (int r = 0; r < ep; ++r) files.push_back({expert_file_name(r), 0, 0, std::vector<std::vector<int32_t>>(layers.size())});
  const std::vector<std::vector<int>> first = first_slots(layers);
  for (std::size_t l = 0; l < layers.size(); ++l)
    for (std::size_t e = 0; e < first[l].size(); ++e)
      files[1 + layers[l]->buffer().placement().rank_of(first[l][e])].experts[l].push_back(static_cast<int32_t>(e));
  return files;
}

// The sizes and checksums: `sizes` holds (dense bytes, xxh3, expert file
// bytes, xxh3) of every rank; experts-N.bin came from rank N.
void fill_sizes(std::span<const uint64_t> sizes, std::vector<CheckpointFile>* files) {
  (*files)[0].bytes = sizes[0];
  (*files)[0].xxh3 = sizes[1];
  for (std::size_t r = 0; r + 1 < files->size(); ++r) {
    (*files)[1 + r].bytes = sizes[4 * r + 2];
    (*files)[1 + r].xxh3 = sizes[4 * r + 3];
  }
}

// Rank 0, after every file is in `tmp`: meta.json, the rename, `latest`.
Status publish(const fs::path& dir, const fs::path& tmp, const CheckpointMeta& meta) {
  const std::string text = format_checkpoint_meta(meta);
  EPX_RETURN_IF_ERROR(write_file_durably(tmp / "meta.json", as_bytes(text)));
  EPX_RETURN_IF_ERROR(fsync_dir(tmp));
  if (const char* delay = std::getenv("EPX_TEST_CHECKPOINT_DELAY_MS"))  // test hook: a window for kill -9
    std::this_thread::sleep_for(std::chrono::milliseconds(std::atoi(delay)));
  const std::string name = step_folder_name(meta.step);
  const fs::path final_path = dir / name, old = dir / ("." + name + ".old");
  std::error_code ec;
  if (fs::exists(final_path, ec)) {  // the same step again (a resume that runs no step)
    fs::rename(final_path, old, ec);
    if (ec) return internal_error("cannot move {} aside: {}", final_path.string(), ec.message());
  }
  fs::rename(tmp, final_path, ec);
  if (ec) {
    const Status s = internal_error("cannot rename {} to {}: {}", tmp.string(), final_path.string(), ec.message());
    if (fs::exists(old, ec)) fs::rename(old, final_path, ec);  // `latest` names it: put it back
    return s;
  }
  EPX_RETURN_IF_ERROR(fsync_dir(dir));
  EPX_RETURN_IF_ERROR(write_file_durably(dir / "latest.tmp", as_bytes(name + "\n")));
  fs::rename(dir / "latest.tmp", dir / "latest", ec);
  if (ec) return internal_error("cannot rename {}/latest.tmp to latest: {}", dir.string(), ec.message());
  EPX_RETURN_IF_ERROR(fsync_dir(dir));
  fs::remove_all(old, ec);
  return Status::ok();
}

// Rank 0: removes all but the newest `keep` step folders of `run_id`;
// `current` stays, and so does every folder of another run.
Status prune(const fs::path& dir, int64_t current, int keep, const std::string& run_id) {
  std::vector<int64_t> others;
  std::error_code ec;
  for (const StepOwner& s : list_step_owners(dir.string()))
    if (s.step != current && s.readable && s.run_id == run_id) others.push_back(s.step);
  std::sort(others.rbegin(), others.rend());
  for (std::size_t i = static_cast<std::size_t>(std::max(keep - 1, 0)); i < others.size(); ++i) {
    fs::remove_all(dir / step_folder_name(others[i]), ec);
    if (ec)
      return internal_error("checkpoint {} is complete, but removing the old {} failed: {}", step_folder_name(current),
                            step_folder_name(others[i]), ec.message());
  }
  return Status::ok();
}

// Serialises `state` as file `part` and writes it into `tmp`; (bytes, xxh3).
Status write_part(const fs::path& tmp, const std::string& name, int part, const CheckpointMeta& meta,
                  const PartState& state, uint64_t* out) {
  const PartFileHeader header{.part = part, .num_ranks = meta.num_ranks, .num_nodes = meta.num_nodes,
                              .step = meta.step, .model_hash = model_hash(meta.fingerprint)};
  const std::vector<uint8_t> bytes = serialize_part_file(header, state);
  out[0] = bytes.size();
  out[1] = xxh3(bytes);
  return write_file_durably(tmp / name, bytes);
}

}  // namespace

CheckpointWrite::CheckpointWrite(const std::string& dir, int keep, const CheckpointMeta& meta, int rank)
    : dir_(dir), tmp_(dir + "/." + step_folder_name(meta.step) + ".tmp"), keep_(keep), rank_(rank), meta_(meta) {}

CheckpointWrite::~CheckpointWrite() {
  if (writer_.joinable()) writer_.join();
  if (rank_ == 0 && !finished_) {  // never published: the temporary folder goes
    std::error_code ec;
    fs::remove_all(tmp_, ec);
  }
}

Status CheckpointWrite::fail(const Status& s) const {
  return Status(s.code(), fmt::format("writing checkpoint {} in {}: {} (the previous checkpoints are kept)",
                                      step_folder_name(meta_.step), dir_, s.message()));
}

Result<std::unique_ptr<CheckpointWrite>> CheckpointWrite::begin(const std::string& dir, int keep,
                                                                const CheckpointMeta& meta, Transport& transport,
                                                                const ParallelLayout& layout,
                                                                std::span<Parameter* const> params, AdamW& adam,
                                                                std::span<MoELayer* const> layers,
                                                                const Deadline& deadline) {
  const int rank = transport.rank();
  std::unique_ptr<CheckpointWrite> w(new CheckpointWrite(dir, keep, meta, rank));
  Status s = rank == 0 ? prepare_save(fs::path(dir), fs::path(w->tmp_)) : Status::ok();
  if (s = agree(transport, s, deadline); !s.is_ok()) return w->fail(s);
  // The snapshot: rank 0 dense.bin's content, each rank of EP group 0 its expert file's.
  if (rank == 0) {
    w->dense_ = collect_dense(params, adam, layers);
    w->meta_.files = list_files(layout.ep(), layers);
  }
  if (layout.ep_group(rank) == 0) {
    w->ep_rank_ = layout.ep_rank(rank);
    w->experts_ = collect_experts(adam, layers, w->ep_rank_);
  }
  return w;
}

void CheckpointWrite::write() {
  if (const char* delay = std::getenv("EPX_TEST_CHECKPOINT_WRITE_DELAY_MS"))  // test hook: a slow disk
    std::this_thread::sleep_for(std::chrono::milliseconds(std::atoi(delay)));
  Status s;
  if (rank_ == 0) s = write_part(fs::path(tmp_), kDenseFileName, 0, meta_, *dense_, sums_);
  if (s.is_ok() && experts_)
    s = write_part(fs::path(tmp_), expert_file_name(ep_rank_), 1 + ep_rank_, meta_, *experts_, sums_ + 2);
  dense_.reset();  // the snapshot's memory goes as soon as it is on disk
  experts_.reset();
  written_status_ = s;
  written_.store(true);
}

void CheckpointWrite::write_in_background() {
  writer_ = std::thread([this] {
    try {
      write();
    } catch (const std::exception& e) {  // bad_alloc serialising: a failed save, not a terminate()
      written_status_ = resource_exhausted("writing in the background: {}", e.what());
      written_.store(true);
    }
  });
}

void CheckpointWrite::wait() {
  if (writer_.joinable()) writer_.join();
}

Status CheckpointWrite::finish(Transport& transport, const Deadline& deadline) {
  if (writer_.joinable()) writer_.join();
  if (!written_.load()) write();
  Status s = written_status_;
  if (s = agree(transport, s, deadline); !s.is_ok()) return fail(s);
  std::vector<uint64_t> all(4 * static_cast<std::size_t>(transport.num_ranks()));
  s = transport.all_gather(std::span<const uint64_t>(sums_, 4), std::span<uint64_t>(all), deadline);
  if (!s.is_ok()) return fail(s);
  if (rank_ == 0) {
    fill_sizes(all, &meta_.files);
    s = publish(fs::path(dir_), fs::path(tmp_), meta_);
    if (s.is_ok()) finished_ = true;  // published: the folder is no longer temporary
    if (s.is_ok()) s = prune(fs::path(dir_), meta_.step, keep_, meta_.run_id);
  }
  if (s = agree(transport, s, deadline); !s.is_ok()) return fail(s);
  finished_ = true;
  return Status::ok();
}

Status save_checkpoint(const std::string& dir_name, int keep, const CheckpointMeta& meta_in, Transport& transport,
                       const ParallelLayout& layout, std::span<Parameter* const> params, AdamW& adam,
                       std::span<MoELayer* const> layers, const Deadline& deadline) {
  EPX_ASSIGN_OR_RETURN(std::unique_ptr<CheckpointWrite> w, CheckpointWrite::begin(dir_name, keep, meta_in, transport,
                                                                                  layout, params, adam, layers,
                                                                                  deadline));
  w->write();
  return w->finish(transport, deadline);
}

// ---- load ------------------------------------------------------------------

namespace {

// What one rank reads: dense.bin and, by name, the expert entries of the
// expert files that hold its logical experts.
struct RankPart {
  PartState dense;
  std::vector<PartState> expert_files;
  std::map<std::string, PartState::Param*> entries;
};

// dense.bin fits the model: its dense parameters in order, names and sizes; the biases.
Status check_dense_fit(const std::string& name, const PartState& state, std::span<Parameter* const> params,
                       std::span<MoELayer* const> layers) {
  std::size_t i = 0;
  for (const Parameter* p : params) {
    if (p->kind != ParamKind::kDense) continue;
    if (i >= state.params.size()) return invalid_argument("{} holds {} parameters; the model has more", name, i);
    const PartState::Param& q = state.params[i++];
    if (q.name != p->name)
      return invalid_argument("{} holds parameter '{}' where the model has '{}'", name, q.name, p->name);
    const std::size_t n = p->value.size();
    if (q.value.size() != n || q.m.size() != n || q.v.size() != n)
      return invalid_argument("{}: {} holds {} values, the model {}", name, q.name, q.value.size(), n);
  }
  if (i != state.params.size())
    return invalid_argument("{} holds {} dense parameters, the model has {}", name, state.params.size(), i);
  if (state.biases.size() != layers.size())
    return invalid_argument("{} holds {} layers' biases, the model has {} layers", name, state.biases.size(), layers.size());
  for (std::size_t l = 0; l < layers.size(); ++l)
    if (state.biases[l].size() != layers[l]->bias().values().size())
      return invalid_argument("{}: layer {}'s bias holds {} values, the model {}", name, l, state.biases[l].size(),
                              layers[l]->bias().values().size());
  return Status::ok();
}

// The expert files (indices into meta.files) holding this rank's logical experts.
Result<std::vector<int>> files_for(const std::string& where, const CheckpointMeta& meta,
                                   std::span<MoELayer* const> layers) {
  std::vector<int> out;
  for (std::size_t l = 0; l < layers.size(); ++l)
    for (int local = 0; local < layers[l]->num_local_experts(); ++local) {
      const int e = layers[l]->local_logical_expert(local);
      if (e < 0) continue;
      int found = -1;
      for (std::size_t i = 1; i < meta.files.size() && found < 0; ++i) {
        const auto& list = meta.files[i].experts;
        if (l < list.size() && std::binary_search(list[l].begin(), list[l].end(), e)) found = static_cast<int>(i);
      }
      if (found < 0) return invalid_argument("{}/meta.json lists no file for layer {}'s expert {}", where, l, e);
      if (std::find(out.begin(), out.end(), found) == out.end()) out.push_back(found);
    }
  std::sort(out.begin(), out.end());
  return out;
}

// Every local expert's entries are there with their sizes.
Status check_expert_fit(const std::string& where, RankPart& part, std::span<MoELayer* const> layers) {
  for (MoELayer* layer : layers)
    for (int local = 0; local < layer->num_local_experts(); ++local) {
      const int e = layer->local_logical_expert(local);
      if (e < 0) continue;
      for (const Parameter* p : layer->expert_parameters()) {
        const std::size_t n = p->value.size() / static_cast<std::size_t>(layer->num_local_experts());
        const std::string name = expert_entry_name(p->name, e);
        const auto it = part.entries.find(name);
        if (it == part.entries.end())
          return invalid_argument("checkpoint {}: the file meta.json names for {} does not hold it", where, name);
        const PartState::Param& q = *it->second;
        if (q.value.size() != n || q.m.size() != n || q.v.size() != n)
          return invalid_argument("checkpoint {}: {} holds {} values, the model {}", where, name, q.value.size(), n);
      }
    }
  return Status::ok();
}

// meta.json, the files this rank needs and their fit to the model; nothing is loaded.
Status read_rank_part(const std::string& path, CheckpointMeta* expected, std::span<Parameter* const> params,
                      std::span<MoELayer* const> layers, RankPart* part) {
  EPX_ASSIGN_OR_RETURN(std::string where, resolve_checkpoint(path));
  EPX_RETURN_IF_ERROR(read_meta_at(where, expected));
  EPX_RETURN_IF_ERROR(read_part_file(where, *expected, 0, &part->dense));
  EPX_RETURN_IF_ERROR(check_dense_fit((fs::path(where) / kDenseFileName).string(), part->dense, params, layers));
  EPX_ASSIGN_OR_RETURN(std::vector<int> needed, files_for(where, *expected, layers));
  part->expert_files.resize(needed.size());
  for (std::size_t i = 0; i < needed.size(); ++i)
    EPX_RETURN_IF_ERROR(read_part_file(where, *expected, needed[i], &part->expert_files[i]));
  for (PartState& f : part->expert_files)
    for (PartState::Param& q : f.params) part->entries[q.name] = &q;
  return check_expert_fit(where, *part, layers);
}

// Copies what `part` holds into the model and the optimizer.
void apply(RankPart& part, std::span<Parameter* const> params, AdamW& adam, std::span<MoELayer* const> layers) {
  std::size_t i = 0;
  for (Parameter* p : params) {
    if (p->kind != ParamKind::kDense) continue;
    PartState::Param& q = part.dense.params[i++];
    AdamW::Moments& m = adam.moments()[p->name];
    p->value = std::move(q.value);
    p->mark_written();
    m.m = std::move(q.m);
    m.v = std::move(q.v);
  }
  for (MoELayer* layer : layers)
    for (Parameter* p : layer->expert_parameters()) {
      const int num_local = layer->num_local_experts();
      const std::size_t n = p->value.size() / static_cast<std::size_t>(num_local);
      AdamW::Moments& m = adam.moments_of(*p);
      for (int local = 0; local < num_local; ++local) {
        const int e = layer->local_logical_expert(local);
        const PartState::Param* q = e < 0 ? nullptr : part.entries.at(expert_entry_name(p->name, e));
        const std::pair<std::vector<float>*, const std::vector<float>*> parts[3] = {
            {&p->value, q ? &q->value : nullptr}, {&m.m, q ? &q->m : nullptr}, {&m.v, q ? &q->v : nullptr}};
        for (const auto& [to, from] : parts) {
          const std::span<float> b = block(*to, local, n);
          if (from) std::copy(from->begin(), from->end(), b.begin());
          else std::fill(b.begin(), b.end(), 0.0f);  // an empty slot
        }
      }
      p->mark_written();
    }
  for (std::size_t l = 0; l < layers.size(); ++l) layers[l]->bias().set_values(part.dense.biases[l]);
  adam.set_num_steps(part.dense.adam_steps);
}

}  // namespace

Status load_checkpoint(const std::string& path, CheckpointMeta* expected, Transport& transport,
                       std::span<Parameter* const> params, AdamW& adam, std::span<MoELayer* const> layers,
                       const Deadline& deadline) {
  RankPart part;
  Status s = read_rank_part(path, expected, params, layers, &part);
  EPX_RETURN_IF_ERROR(agree(transport, s, deadline));
  int64_t steps[2] = {expected->step, -expected->step};  // every rank found the same step
  EPX_RETURN_IF_ERROR(transport.all_reduce(std::span<int64_t>(steps, 2), ReduceOp::kMax, deadline));
  if (steps[0] != -steps[1])
    return aborted("the ranks found checkpoint {} at steps {} to {}: was its 'latest' replaced meanwhile?", path,
                   -steps[1], steps[0]);
  apply(part, params, adam, layers);
  return Status::ok();
}

}  // namespace epx::detail
