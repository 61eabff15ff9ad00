// Four ranks (threads) dispatch their tokens to the ranks holding their
// experts and combine the rows back. With y = recv_x, combine returns each
// token times the number of distinct ranks it went to, which is checked exactly.
#include <cstdio>
#include <set>
#include <vector>

#include <epx/comm/inproc.h>
#include <epx/exchange/buffer.h>

int main() {
  constexpr int kRanks = 4, kExperts = 8, kTokens = 3, kHidden = 4, kTopk = 2;
  const auto f32 = epx::DType::kF32;
  epx::InprocWorld world(epx::Topology::create(kRanks).value());
  epx::Status status = epx::first_error(world.run([&](epx::Transport& t) -> epx::Status {
    EPX_ASSIGN_OR_RETURN(auto buffer, epx::Buffer::create(t, {.num_experts = kExperts, .hidden = kHidden,
                                                               .dtype = f32, .max_tokens_per_rank = kTokens}));
    const int r = t.rank();
    std::vector<float> x(kTokens * kHidden), out(kTokens * kHidden);
    for (int i = 0; i < kTokens * kHidden; ++i) x[i] = 100.0f * r + i;  // encodes (rank, token, column)
    // Experts e live on rank e / 2. Token 0 goes to rank r twice (sent once),
    // token 1 to ranks r and r + 2, token 2 to rank r + 1 only (-1 = no expert).
    std::vector<int32_t> topk_idx = {2 * r, 2 * r + 1,
                                     2 * r + 1, (2 * r + 4) % kExperts,
                                     (2 * r + 2) % kExperts, -1};
    epx::DispatchResult recv;
    EPX_RETURN_IF_ERROR(buffer->dispatch(
        {.x = epx::TensorView::contiguous(x.data(), f32, {kTokens, kHidden}),
         .topk_idx = epx::TensorView::contiguous(topk_idx.data(), epx::DType::kI32, {kTokens, kTopk})},
        &recv));
    // The experts would turn recv.recv_x into y here; the identity keeps the check exact.
    EPX_RETURN_IF_ERROR(buffer->combine(recv.recv_x, recv.handle,
                                        epx::TensorView::contiguous(out.data(), f32, {kTokens, kHidden})));
    for (int token = 0; token < kTokens; ++token) {
      std::set<int> ranks;
      for (int k = 0; k < kTopk; ++k)
        if (int e = topk_idx[token * kTopk + k]; e >= 0) ranks.insert(e / (kExperts / kRanks));
      for (int h = 0; h < kHidden; ++h) {
        const int i = token * kHidden + h;
        const float expected = x[i] * static_cast<float>(ranks.size());
        if (out[i] != expected)
          return epx::internal_error("rank {}: out[{}][{}] = {}, expected {}", r, token, h, out[i], expected);
      }
    }
    return epx::Status::ok();
  }));
  std::printf("%s\n", status.is_ok() ? "dispatch + combine round trip: OK" : status.to_string().c_str());
  return status.is_ok() ? 0 : 1;
}
