// Links the installed CUDA backend (epx::epx_cuda) and says whether a GPU can run it here.
#include <cstdio>
#include <string>

#include <epx/exchange/cuda_group.h>

int main() {
  const std::string why = epx::cuda_unavailable_reason();
  std::printf("epx_cuda linked; %s\n", why.empty() ? "a CUDA device is usable here" : why.c_str());
  return 0;
}
