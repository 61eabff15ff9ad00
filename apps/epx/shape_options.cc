#include "shape_options.h"

#include "cli_checks.h"

namespace epx::app {

void add_shape_options(CLI::App* cmd, const ShapeFields& f) {
  if (f.ranks != nullptr)
    cmd->add_option("--ranks", *f.ranks, "Ranks (threads)")->transform(in_range(1, 256))->capture_default_str();
  if (f.nodes != nullptr)
    cmd->add_option("--nodes", *f.nodes, "Emulated nodes; must divide --ranks; > 1 takes the two-hop path")
        ->transform(in_range(1, 256))
        ->capture_default_str();
  if (f.hidden != nullptr)
    cmd->add_option("--hidden", *f.hidden, "Elements per token row")
        ->transform(in_range(f.min_hidden, 1 << 20))
        ->capture_default_str();
  if (f.experts != nullptr)
    cmd->add_option("--experts", *f.experts, "Experts, placed in equal blocks over the ranks")
        ->transform(in_range(1, 65536))
        ->capture_default_str();
  if (f.topk != nullptr)
    cmd->add_option("--topk", *f.topk, "Experts per token")->transform(in_range(1, 64))->capture_default_str();
  if (f.skew != nullptr)
    cmd->add_option("--skew", *f.skew, "Routing skew: expert e drawn with weight (e+1)^-skew; 0 = uniform")
        ->transform(in_range(0.0, 16.0))
        ->capture_default_str();
  if (f.seed != nullptr)
    cmd->add_option("--seed", *f.seed, "Routing seed")->transform(at_least(uint64_t{0}))->capture_default_str();
}

}  // namespace epx::app
