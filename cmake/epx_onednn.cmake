# oneDNN (Debian: libdnnl-dev), the GEMM library of the experts layer, as the
# imported target epx::onednn. Found by header and library rather than by
# oneDNN's own package config, which also asks for the OpenCL headers of its
# GPU runtime. Included by epx's build and by the installed epxConfig.cmake.
if(NOT TARGET epx::onednn)
  find_path(EPX_ONEDNN_INCLUDE_DIR oneapi/dnnl/dnnl.hpp)
  find_library(EPX_ONEDNN_LIBRARY NAMES dnnl)
  include(FindPackageHandleStandardArgs)
  find_package_handle_standard_args(EpxOneDNN
    REQUIRED_VARS EPX_ONEDNN_LIBRARY EPX_ONEDNN_INCLUDE_DIR
    REASON_FAILURE_MESSAGE "the experts layer needs oneDNN (Debian: libdnnl-dev, which scripts/setup.sh installs)")
  if(EpxOneDNN_FOUND)
    add_library(epx::onednn UNKNOWN IMPORTED)
    set_target_properties(epx::onednn PROPERTIES
      IMPORTED_LOCATION "${EPX_ONEDNN_LIBRARY}"
      INTERFACE_INCLUDE_DIRECTORIES "${EPX_ONEDNN_INCLUDE_DIR}")
  endif()
endif()
