#include "epx/comm/transport.h"

namespace epx {

TransportCounters& TransportCounters::operator+=(const TransportCounters& other) {
  inter_node_bytes += other.inter_node_bytes;
  inter_node_messages += other.inter_node_messages;
  intra_node_bytes += other.intra_node_bytes;
  intra_node_messages += other.intra_node_messages;
  collective_calls += other.collective_calls;
  collective_bytes += other.collective_bytes;
  return *this;
}

namespace {
thread_local WaitStyle t_wait_style = WaitStyle::kEager;
}  // namespace

Result<std::unique_ptr<Transport>> Transport::split(int /*color*/, int /*key*/, const Deadline& /*deadline*/) {
  return unimplemented("the {} transport cannot be split into groups", backend_name());
}

void set_thread_wait_style(WaitStyle style) { t_wait_style = style; }
WaitStyle thread_wait_style() { return t_wait_style; }

}  // namespace epx
