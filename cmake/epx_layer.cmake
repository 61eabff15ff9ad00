# epx_add_layer(NAME SOURCES... DEPS ...): one static library per layer,
# exported as epx::NAME and linked into the umbrella epx::epx.
function(epx_add_layer name)
  cmake_parse_arguments(ARG "" "" "SOURCES;DEPS" ${ARGN})
  add_library(${name} STATIC ${ARG_SOURCES})
  add_library(epx::${name} ALIAS ${name})
  target_include_directories(${name}
    PUBLIC $<BUILD_INTERFACE:${PROJECT_SOURCE_DIR}/include> $<INSTALL_INTERFACE:${CMAKE_INSTALL_INCLUDEDIR}>
    PRIVATE ${PROJECT_SOURCE_DIR}/src)
  target_link_libraries(${name} PUBLIC ${ARG_DEPS})
  if(NOT EPX_BUILD_FUZZ)  # the fuzz build keeps its -O1: quicker to build; the readers it fuzzes gain little
    target_compile_options(${name} PRIVATE -O3)
  endif()
  install(TARGETS ${name} EXPORT epxTargets ARCHIVE DESTINATION ${CMAKE_INSTALL_LIBDIR})
endfunction()
