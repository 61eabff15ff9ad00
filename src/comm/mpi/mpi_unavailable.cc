// The MPI backend's entry points in a build without MPI (EPX_WITH_MPI=OFF):
// they say so instead of failing later.
#include <cstdlib>

#include "epx/comm/mpi.h"

namespace epx {

bool mpi_available() { return false; }

bool launched_by_mpi() {
  for (const char* name : {"OMPI_COMM_WORLD_SIZE", "PMIX_RANK", "PMI_RANK", "PMI_SIZE"})
    if (std::getenv(name) != nullptr) return true;
  return false;
}

Result<std::unique_ptr<MpiSession>> MpiSession::init(int*, char***) {
  return unimplemented("epx was built without the MPI backend; configure with -DEPX_WITH_MPI=ON (needs libopenmpi-dev)");
}

MpiSession::~MpiSession() = default;

std::string MpiSession::library_version() const { return "none"; }

Result<std::unique_ptr<Transport>> MpiSession::connect(const MpiOptions&) {
  return unimplemented("epx was built without the MPI backend");
}

}  // namespace epx
