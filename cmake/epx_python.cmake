# The Python module (python/, docs/python.md): on by default where Debian's
# python3 (interpreter and headers), pybind11 and numpy are found, and off in
# the sanitizer and fuzz builds (an ASan-built extension would need the ASan
# runtime preloaded into python3).
set(epx_python_default ON)
set(epx_python_why "")
if(EPX_SANITIZE OR EPX_BUILD_FUZZ)
  set(epx_python_default OFF)
  set(epx_python_why "EPX_SANITIZE or EPX_BUILD_FUZZ is on")
else()
  if(NOT DEFINED Python3_EXECUTABLE AND EXISTS /usr/bin/python3)
    set(Python3_EXECUTABLE /usr/bin/python3)  # Debian's, with numpy and torch; not a pyenv shim
  endif()
  find_package(Python3 COMPONENTS Interpreter Development.Module)
  find_package(pybind11 CONFIG QUIET)
  if(Python3_FOUND)
    execute_process(COMMAND ${Python3_EXECUTABLE} -c "import numpy; print(numpy.get_include())"
                    OUTPUT_VARIABLE epx_numpy_include OUTPUT_STRIP_TRAILING_WHITESPACE
                    RESULT_VARIABLE epx_numpy_result ERROR_QUIET)
  endif()
  if(NOT Python3_FOUND)
    set(epx_python_why "python3 with its headers was not found (python3-dev)")
  elseif(NOT pybind11_FOUND)
    set(epx_python_why "pybind11 was not found (pybind11-dev)")
  elseif(NOT epx_numpy_result EQUAL 0 OR NOT EXISTS "${epx_numpy_include}/numpy/ndarrayobject.h")
    set(epx_python_why "numpy was not found for ${Python3_EXECUTABLE} (python3-numpy)")
  endif()
  if(epx_python_why)
    set(epx_python_default OFF)
  endif()
endif()
option(EPX_BUILD_PYTHON "Build the Python module epx (python/; needs pybind11, python3-dev, numpy)" ${epx_python_default})
if(EPX_BUILD_PYTHON AND epx_python_why)
  message(FATAL_ERROR "EPX_BUILD_PYTHON is on but ${epx_python_why}: install it (scripts/setup.sh) "
                      "or configure with -DEPX_BUILD_PYTHON=OFF")
endif()
if(EPX_BUILD_PYTHON)
  message(STATUS "epx: the Python module is built for ${Python3_EXECUTABLE} (${Python3_VERSION})")
  add_subdirectory(python)
elseif(epx_python_why)
  message(STATUS "epx: the Python module is not built: ${epx_python_why}")
else()
  message(STATUS "epx: the Python module is not built: EPX_BUILD_PYTHON is off")
endif()
