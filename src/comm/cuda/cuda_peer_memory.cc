#include <cuda_runtime_api.h>
#include <unistd.h>

#include <cstring>
#include <vector>

#include "epx/comm/cuda.h"

namespace epx {
namespace {

// What each rank tells the others about its region.
struct Entry {
  int32_t ok = 0;        // 1: allocated and exported
  int32_t device = 0;
  int64_t pid = 0;       // same pid: a thread of this process, the pointer is usable as is
  uint64_t address = 0;  // the region's device pointer in its own process
  cudaIpcMemHandle_t handle{};
};

Status cuda_status(cudaError_t err, const char* call) {
  return internal_error("{} failed: {} ({})", call, cudaGetErrorName(err), cudaGetErrorString(err));
}

class CudaPeerMemory final : public PeerMemory {
 public:
  CudaPeerMemory(Transport& transport, int device, std::size_t bytes)
      : transport_(transport), device_(device), bytes_(bytes), peers_(transport.num_ranks(), nullptr),
        opened_(transport.num_ranks(), false) {}
  ~CudaPeerMemory() override {
    // Unmap the peers, wait until every rank of the world has, then free.
    if (cudaSetDevice(device_) != cudaSuccess) return;
    for (std::size_t r = 0; r < peers_.size(); ++r)
      if (opened_[r]) cudaIpcCloseMemHandle(peers_[r]);
    if (collective_) transport_.barrier(Deadline::after(Milliseconds(30000))).ignore();
    if (local_ != nullptr) cudaFree(local_);
  }
  [[nodiscard]] std::size_t size() const override { return bytes_; }
  [[nodiscard]] std::byte* local() const override { return static_cast<std::byte*>(local_); }
  [[nodiscard]] std::byte* peer(int rank) const override { return static_cast<std::byte*>(peers_[rank]); }

  // Allocates and exports this rank's region; the result goes into `mine`.
  Status allocate(Entry* mine) {
    cudaError_t err = cudaSetDevice(device_);
    if (err != cudaSuccess) return cuda_status(err, "cudaSetDevice");
    err = cudaMalloc(&local_, bytes_ > 0 ? bytes_ : 256);
    if (err != cudaSuccess) return cuda_status(err, "cudaMalloc");
    err = cudaMemset(local_, 0, bytes_ > 0 ? bytes_ : 256);
    if (err != cudaSuccess) return cuda_status(err, "cudaMemset");
    err = cudaIpcGetMemHandle(&mine->handle, local_);
    if (err != cudaSuccess) return cuda_status(err, "cudaIpcGetMemHandle");
    mine->ok = 1;
    mine->device = device_;
    mine->pid = static_cast<int64_t>(getpid());
    mine->address = reinterpret_cast<uint64_t>(local_);
    return Status::ok();
  }

  // Maps the regions of this node's ranks.
  Status map(const std::vector<Entry>& all) {
    const Topology& topo = transport_.topology();
    const int me = transport_.rank();
    for (int r = 0; r < topo.num_ranks(); ++r) {
      if (!topo.same_node(r, me)) continue;
      const Entry& e = all[r];
      if (r == me) {
        peers_[r] = local_;
      } else if (e.pid == all[me].pid) {
        if (e.device != device_) {
          int can = 0;
          cudaError_t err = cudaDeviceCanAccessPeer(&can, device_, e.device);
          if (err != cudaSuccess) return cuda_status(err, "cudaDeviceCanAccessPeer");
          if (!can) return failed_precondition("device {} cannot access device {} (no peer access)", device_, e.device);
          err = cudaDeviceEnablePeerAccess(e.device, 0);
          if (err == cudaErrorPeerAccessAlreadyEnabled) {
            cudaGetLastError();
          } else if (err != cudaSuccess) {
            return cuda_status(err, "cudaDeviceEnablePeerAccess");
          }
        }
        peers_[r] = reinterpret_cast<void*>(e.address);
      } else {
        const cudaError_t err = cudaIpcOpenMemHandle(&peers_[r], e.handle, cudaIpcMemLazyEnablePeerAccess);
        if (err != cudaSuccess)
          return internal_error("cudaIpcOpenMemHandle of rank {}'s region failed: {} ({})", r, cudaGetErrorName(err),
                                cudaGetErrorString(err));
        opened_[r] = true;
      }
    }
    return Status::ok();
  }
  void set_collective() { collective_ = true; }

 private:
  Transport& transport_;
  int device_;
  std::size_t bytes_;
  void* local_ = nullptr;
  std::vector<void*> peers_;
  std::vector<bool> opened_;
  bool collective_ = false;  // every rank got this far: destruction waits for the others
};

}  // namespace

Result<std::unique_ptr<PeerMemory>> map_cuda_peer_memory(Transport& transport, int device, std::size_t bytes,
                                                         const Deadline& deadline) {
  auto memory = std::make_unique<CudaPeerMemory>(transport, device, bytes);
  Entry mine;
  const Status allocated = memory->allocate(&mine);
  std::vector<Entry> all(transport.num_ranks());
  EPX_RETURN_IF_ERROR(transport.all_gather(std::span<const Entry>(&mine, 1), std::span<Entry>(all), deadline));
  EPX_RETURN_IF_ERROR(allocated);
  for (int r = 0; r < transport.num_ranks(); ++r)
    if (all[r].ok != 1) return aborted("rank {} could not allocate its CUDA peer memory, so none was mapped", r);
  // A mapping failure must reach every rank too: one more round of flags.
  const Status mapped = memory->map(all);
  const int32_t flag = mapped.is_ok() ? 1 : 0;
  std::vector<int32_t> flags(transport.num_ranks());
  EPX_RETURN_IF_ERROR(transport.all_gather(std::span<const int32_t>(&flag, 1), std::span<int32_t>(flags), deadline));
  EPX_RETURN_IF_ERROR(mapped);
  for (int r = 0; r < transport.num_ranks(); ++r)
    if (flags[r] != 1) return aborted("rank {} could not map its node's CUDA peer memory", r);
  memory->set_collective();
  return std::unique_ptr<PeerMemory>(std::move(memory));
}

}  // namespace epx
