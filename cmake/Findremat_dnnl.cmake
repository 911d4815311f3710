# oneDNN (libdnnl) as the imported target remat::dnnl, found by library and header. Used by remat's
# own build and, installed beside rematConfig.cmake, by find_package(remat) on the consumer's
# machine, so the exported remat::remat names a target rather than this build's path to libdnnl.
#
# Not oneDNN's own CMake package: Debian's libdnnl-dev builds it with the OpenCL GPU runtime, and
# its DNNL::dnnl requires find_package(OpenCL) (libOpenCL.so, a -dev package remat does not need)
# and links OpenCL into every consumer, although remat calls only the CPU sgemm.
#
# Sets remat_dnnl_FOUND; REMAT_DNNL_LIBRARY and REMAT_DNNL_INCLUDE are cache entries a user can
# point at another oneDNN.
find_library(REMAT_DNNL_LIBRARY dnnl)
find_path(REMAT_DNNL_INCLUDE oneapi/dnnl/dnnl.h)
mark_as_advanced(REMAT_DNNL_LIBRARY REMAT_DNNL_INCLUDE)

include(FindPackageHandleStandardArgs)
find_package_handle_standard_args(remat_dnnl REQUIRED_VARS REMAT_DNNL_LIBRARY REMAT_DNNL_INCLUDE)

if(remat_dnnl_FOUND AND NOT TARGET remat::dnnl)
  add_library(remat::dnnl UNKNOWN IMPORTED)
  set_target_properties(remat::dnnl PROPERTIES IMPORTED_LOCATION "${REMAT_DNNL_LIBRARY}"
                                               INTERFACE_INCLUDE_DIRECTORIES "${REMAT_DNNL_INCLUDE}")
endif()
