#include "train/checkpoint.h"

#include <cerrno>
#include <cstring>
#include <filesystem>
#include <fstream>

#include <fmt/format.h>
#include <nlohmann/json.hpp>

namespace epx::detail {
namespace {

namespace fs = std::filesystem;
constexpr char kMagic[8] = {'E', 'P', 'X', 'C', 'K', 'P', 'T', '1'};

std::string rank_file(const std::string& dir, int rank) { return fmt::format("{}/rank-{}.bin", dir, rank); }

class Writer {
 public:
  explicit Writer(const std::string& path) : path_(path), out_(path, std::ios::binary | std::ios::trunc) {}
  template <typename T>
  void pod(const T& v) { out_.write(reinterpret_cast<const char*>(&v), sizeof(T)); }
  void floats(const std::vector<float>& v) {
    pod(static_cast<uint64_t>(v.size()));
    out_.write(reinterpret_cast<const char*>(v.data()), static_cast<std::streamsize>(v.size() * sizeof(float)));
  }
  void text(const std::string& s) {
    pod(static_cast<uint32_t>(s.size()));
    out_.write(s.data(), static_cast<std::streamsize>(s.size()));
  }
  Status close() {
    out_.close();
    if (!out_) return internal_error("could not write {}: {}", path_, std::strerror(errno));
    return Status::ok();
  }
  bool opened() const { return out_.is_open(); }

 private:
  std::string path_;
  std::ofstream out_;
};

class Reader {
 public:
  explicit Reader(const std::string& path) : path_(path), in_(path, std::ios::binary) {}
  bool opened() const { return in_.is_open(); }
  template <typename T>
  Status pod(T* v) {
    in_.read(reinterpret_cast<char*>(v), sizeof(T));
    return in_ ? Status::ok() : truncated();
  }
  Status floats(std::vector<float>* v, std::size_t expected, const std::string& what) {
    uint64_t n = 0;
    EPX_RETURN_IF_ERROR(pod(&n));
    if (n != expected) return invalid_argument("{}: {} holds {} values, the model has {}", path_, what, n, expected);
    v->resize(n);
    in_.read(reinterpret_cast<char*>(v->data()), static_cast<std::streamsize>(n * sizeof(float)));
    return in_ ? Status::ok() : truncated();
  }
  Status text(std::string* s) {
    uint32_t n = 0;
    EPX_RETURN_IF_ERROR(pod(&n));
    if (n > 4096) return invalid_argument("{}: a name of {} bytes (limit 4096): not a checkpoint of this format", path_, n);
    s->resize(n);
    in_.read(s->data(), n);
    return in_ ? Status::ok() : truncated();
  }

 private:
  Status truncated() const { return invalid_argument("{} ends early: truncated or not an epx checkpoint", path_); }
  std::string path_;
  std::ifstream in_;
};

}  // namespace

Status save_checkpoint(const std::string& dir, const CheckpointMeta& meta, Transport& transport,
                       std::span<Parameter* const> params, AdamW& adam, std::span<MoELayer* const> layers,
                       const Deadline& deadline) {
  const std::string tmp = dir + ".tmp";
  const int rank = transport.rank();
  Status local = Status::ok();
  if (rank == 0) {
    std::error_code ec;
    fs::remove_all(tmp, ec);
    fs::create_directories(tmp, ec);
    if (ec) local = internal_error("could not create {}: {}", tmp, ec.message());
  }
  // Ranks agree on every step's outcome, so that none is left waiting.
  auto agree = [&](Status s) -> Status {
    int32_t failed = s.is_ok() ? 0 : 1;
    EPX_RETURN_IF_ERROR(transport.all_reduce(std::span<int32_t>(&failed, 1), ReduceOp::kMax, deadline));
    if (!s.is_ok()) return s;
    if (failed) return aborted("another rank could not write its part of checkpoint {}", dir);
    return Status::ok();
  };
  EPX_RETURN_IF_ERROR(agree(local));
  {
    Writer w(rank_file(tmp, rank));
    if (!w.opened()) {
      local = internal_error("could not open {}: {}", rank_file(tmp, rank), std::strerror(errno));
    } else {
      w.pod(kMagic);
      w.pod(static_cast<int64_t>(meta.step));
      w.pod(static_cast<int64_t>(adam.num_steps()));
      w.pod(static_cast<uint32_t>(params.size()));
      for (const Parameter* p : params) {
        const AdamW::Moments& m = adam.moments()[p->name];
        w.text(p->name);
        w.floats(p->value);
        w.floats(m.m.empty() ? std::vector<float>(p->value.size(), 0.0f) : m.m);
        w.floats(m.v.empty() ? std::vector<float>(p->value.size(), 0.0f) : m.v);
      }
      w.pod(static_cast<uint32_t>(layers.size()));
      for (MoELayer* layer : layers) w.floats(layer->bias().values());
      local = w.close();
    }
  }
  EPX_RETURN_IF_ERROR(agree(local));
  if (rank == 0) {
    nlohmann::json j = {{"format", "epx-checkpoint-1"}, {"step", meta.step}, {"num_ranks", meta.num_ranks},
                        {"num_nodes", meta.num_nodes}, {"model", meta.fingerprint}};
    if (!meta.layer_slots.empty()) {
      j["layer_slots"] = meta.layer_slots;
      j["eplb_window"] = meta.eplb_window;
    }
    std::ofstream out(tmp + "/meta.json", std::ios::trunc);
    out << j.dump(2) << "\n";
    out.close();
    if (!out) {
      local = internal_error("could not write {}/meta.json: {}", tmp, std::strerror(errno));
    } else {
      // The last complete checkpoint stays until the new one is in place:
      // DIR -> DIR.old, DIR.tmp -> DIR, then DIR.old goes.
      std::error_code ec;
      const std::string old = dir + ".old";
      fs::remove_all(old, ec);
      ec.clear();
      if (fs::exists(dir, ec)) fs::rename(dir, old, ec);
      if (ec) local = internal_error("could not rename {} to {}: {}", dir, old, ec.message());
      if (local.is_ok()) {
        fs::rename(tmp, dir, ec);
        if (ec) local = internal_error("could not rename {} to {}: {}", tmp, dir, ec.message());
      }
      if (local.is_ok()) fs::remove_all(old, ec);
    }
  }
  return agree(local);
}

Status read_checkpoint_meta(const std::string& dir, CheckpointMeta* expected) {
  const std::string meta_path = dir + "/meta.json";
  std::ifstream meta_in(meta_path);
  if (!meta_in) return not_found("no checkpoint at {}: cannot open {}", dir, meta_path);
  nlohmann::json j = nlohmann::json::parse(meta_in, nullptr, /*allow_exceptions=*/false);
  if (j.is_discarded() || !j.is_object() || j.value("format", "") != "epx-checkpoint-1")
    return invalid_argument("{} is not an epx checkpoint meta file (format epx-checkpoint-1)", meta_path);
  const int num_ranks = j.value("num_ranks", 0), num_nodes = j.value("num_nodes", 0);
  if (num_ranks != expected->num_ranks || num_nodes != expected->num_nodes)
    return invalid_argument("checkpoint {} was written by {} ranks on {} nodes; this run has {} ranks on {} nodes", dir,
                            num_ranks, num_nodes, expected->num_ranks, expected->num_nodes);
  const std::string model = j.value("model", "");
  if (model != expected->fingerprint)
    return invalid_argument("checkpoint {} holds model '{}'; this run builds '{}'", dir, model, expected->fingerprint);
  for (int r = 0; r < num_ranks; ++r)
    if (!fs::exists(rank_file(dir, r))) return not_found("checkpoint {} has no file for rank {}", dir, r);
  expected->step = j.value("step", int64_t{0});
  expected->layer_slots.clear();
  expected->eplb_window.clear();
  if (j.contains("layer_slots")) {
    const auto& slots = j["layer_slots"];
    const auto& window = j.value("eplb_window", nlohmann::json::array());
    bool ok = slots.is_array() && window.is_array() && slots.size() == window.size();
    for (std::size_t l = 0; ok && l < slots.size(); ++l) {
      ok = slots[l].is_array() && window[l].is_array();
      for (std::size_t i = 0; ok && i < slots[l].size(); ++i) ok = slots[l][i].is_number_integer();
      for (std::size_t i = 0; ok && i < window[l].size(); ++i) ok = window[l][i].is_number_integer();
      if (ok) {
        expected->layer_slots.push_back(slots[l].get<std::vector<int32_t>>());
        expected->eplb_window.push_back(window[l].get<std::vector<int64_t>>());
      }
    }
    if (!ok) return invalid_argument("{}: layer_slots and eplb_window must be lists of integer lists, one per layer", meta_path);
  }
  return Status::ok();
}

Status load_checkpoint(const std::string& dir, CheckpointMeta* expected, int rank, std::span<Parameter* const> params,
                       AdamW& adam, std::span<MoELayer* const> layers) {
  EPX_RETURN_IF_ERROR(read_checkpoint_meta(dir, expected));
  Reader r(rank_file(dir, rank));
  if (!r.opened()) return not_found("checkpoint {} has no file for rank {}", dir, rank);
  char magic[8];
  EPX_RETURN_IF_ERROR(r.pod(&magic));
  if (std::memcmp(magic, kMagic, sizeof(kMagic)) != 0)
    return invalid_argument("{} is not an epx checkpoint file", rank_file(dir, rank));
  int64_t step = 0, adam_steps = 0;
  uint32_t num_params = 0;
  EPX_RETURN_IF_ERROR(r.pod(&step));
  EPX_RETURN_IF_ERROR(r.pod(&adam_steps));
  EPX_RETURN_IF_ERROR(r.pod(&num_params));
  if (num_params != params.size())
    return invalid_argument("{} holds {} parameters, the model has {}", rank_file(dir, rank), num_params, params.size());
  for (Parameter* p : params) {
    std::string name;
    EPX_RETURN_IF_ERROR(r.text(&name));
    if (name != p->name) return invalid_argument("{} holds parameter '{}' where the model has '{}'", rank_file(dir, rank), name, p->name);
    AdamW::Moments& m = adam.moments()[p->name];
    EPX_RETURN_IF_ERROR(r.floats(&p->value, p->value.size(), name));
    EPX_RETURN_IF_ERROR(r.floats(&m.m, p->value.size(), name + " (first moment)"));
    EPX_RETURN_IF_ERROR(r.floats(&m.v, p->value.size(), name + " (second moment)"));
  }
  uint32_t num_layers = 0;
  EPX_RETURN_IF_ERROR(r.pod(&num_layers));
  if (num_layers != layers.size())
    return invalid_argument("{} holds {} layers' biases, the model has {} layers", rank_file(dir, rank), num_layers, layers.size());
  for (MoELayer* layer : layers) {
    std::vector<float> bias;
    EPX_RETURN_IF_ERROR(r.floats(&bias, layer->bias().values().size(), "an expert bias"));
    layer->bias().set_values(bias);
  }
  adam.set_num_steps(adam_steps);
  expected->step = step;
  return Status::ok();
}

}  // namespace epx::detail
