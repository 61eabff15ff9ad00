// What only the socket backend has: its options, its rendezvous through a
// store, and a peer that closes its transport (the shared transport and
// exchange tests run on it through epx_socket_tests).
#include "epx/comm/socket.h"

#include <gtest/gtest.h>

#include <thread>
#include <vector>

namespace epx {
namespace {

SocketOptions options_for(int rank, int size, const std::string& prefix) {
  SocketOptions o;
  o.rank = rank;
  o.world_size = size;
  o.address = "127.0.0.1";
  o.prefix = prefix;
  o.setup_timeout = std::chrono::seconds(20);
  o.close_timeout = std::chrono::seconds(5);
  return o;
}

TEST(SocketTransport, BadOptionsAreInvalidArgumentNamingTheValue) {
  MemoryStore store;
  SocketOptions o = options_for(2, 2, "bad");
  auto out = connect_sockets(store, o);
  ASSERT_EQ(out.status().code(), StatusCode::kInvalidArgument);
  EXPECT_NE(out.status().message().find("rank = 2 is outside [0, world_size = 2)"), std::string::npos);
  o = options_for(0, 1, "bad");
  o.address = "";
  EXPECT_EQ(connect_sockets(store, o).status().code(), StatusCode::kInvalidArgument);
}

TEST(SocketTransport, AMissingRankIsADeadlineNamingIt) {
  MemoryStore store;
  SocketOptions o = options_for(0, 2, "missing");
  o.setup_timeout = std::chrono::milliseconds(300);
  auto out = connect_sockets(store, o);
  ASSERT_EQ(out.status().code(), StatusCode::kDeadlineExceeded) << out.status().to_string();
  EXPECT_NE(out.status().message().find("entry of rank 1"), std::string::npos) << out.status().to_string();
}

TEST(SocketTransport, APeerThatClosedItsTransportIsAbortedNotAWait) {
  MemoryStore store;
  std::vector<Status> got(2);
  std::vector<std::thread> ranks;
  for (int r = 0; r < 2; ++r) {
    ranks.emplace_back([&, r] {
      auto t = connect_sockets(store, options_for(r, 2, "close"));
      if (!t.is_ok()) {
        got[r] = t.status();
        return;
      }
      EXPECT_EQ((*t)->backend_name(), "socket");
      if (r == 1) return;  // closes at once: goodbye, not a failure
      std::byte out[8];
      const auto start = Clock::now();
      got[0] = (*t)->recv(1, 3, out, Deadline::after(std::chrono::seconds(60))).status();
      EXPECT_LT(Clock::now() - start, std::chrono::seconds(30));
    });
  }
  for (auto& t : ranks) t.join();
  EXPECT_EQ(got[0].code(), StatusCode::kAborted) << got[0].to_string();
  EXPECT_NE(got[0].message().find("closed its transport"), std::string::npos) << got[0].to_string();
  EXPECT_TRUE(got[1].is_ok()) << got[1].to_string();
}

}  // namespace
}  // namespace epx
