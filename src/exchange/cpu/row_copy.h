// Private: how the exchange copies payload rows into memory another rank
// reads later (a peer's receive region, a message's staging).
//
// A dispatch writes far more than any cache holds at the sizes that matter
// (1024 tokens x 8 ranks x 14 KB rows is 624 MB), so the rows leave the cache
// before their reader comes. Written through the cache, every line is first
// read from memory (read for ownership), then written back: two trips for
// one. Streamed (non-temporal stores, x86-64), each line is written once.
// glibc's memcpy streams too, but only above a size (about 100 MB or more,
// set by the CPU's cache) that one 14 KB row never reaches, so the exchange streams its rows itself when the
// bytes it writes in one call pass the cache (row_stores_for).
//
// Both ways copy the same bytes: the choice changes speed, never results.
// Streamed stores are weakly ordered: a copier calls finish_streamed_rows()
// before it tells a reader the rows are there (the exchange's closing sync).
#pragma once

#include <cstddef>

namespace epx::detail {

enum class RowStores { kCached, kStreamed };

// Streamed when `bytes_written` by one call, over every rank of the node
// that writes at the same time, pass the last-level cache (its size as the
// CPU reports it, at most 32 MiB: one core complex's L3 on AMD Zen, and a VM
// can report far more cache than it has).
RowStores row_stores_for(std::size_t bytes_written);

// Copies `bytes` from src to dst (not overlapping), as `stores` says.
void copy_row(std::byte* dst, const std::byte* src, std::size_t bytes, RowStores stores);

// Orders this thread's streamed stores before its later stores (sfence).
void finish_streamed_rows();

}  // namespace epx::detail
