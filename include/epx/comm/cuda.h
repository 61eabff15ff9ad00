// Device peer memory over any Transport: the `cuda` side of comm.
//
// map_cuda_peer_memory is map_peer_memory for GPU memory: a collective over
// `transport` that gives every rank a zero-filled region of `bytes` on its
// GPU and, for each rank of its node, a device pointer to that rank's region
// usable in this process's kernels. Ranks in other processes (MPI) share
// theirs through CUDA IPC handles (cudaIpcGetMemHandle / cudaIpcOpenMemHandle)
// exchanged with the transport's all_gather; ranks that are threads of one
// process (inproc) use each other's pointers directly, with peer access
// between distinct devices. Regions of other nodes are not mapped (nullptr).
// The transport carries only the control path; the bytes move over NVLink/PCIe.
//
// Errors: a rank whose allocation or mapping fails returns why; the others
// return Aborted (nothing is left mapped). Destruction is collective inside a
// node (peers unmap before the owner frees): destroy in the same order on
// every rank, as with Transport::map_peer_memory. Built with EPX_WITH_CUDA.
//
//   EPX_ASSIGN_OR_RETURN(auto memory, epx::map_cuda_peer_memory(transport, /*device=*/local_rank, bytes, deadline));
//   std::byte* peer = memory->peer(r);  // a device pointer, or nullptr off the node
#pragma once

#include <cstddef>
#include <memory>

#include "epx/comm/transport.h"

namespace epx {

Result<std::unique_ptr<PeerMemory>> map_cuda_peer_memory(Transport& transport, int device, std::size_t bytes,
                                                         const Deadline& deadline);

}  // namespace epx
