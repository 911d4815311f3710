# install(EXPORT) + a config and version file, so consumers write find_package(remat) and link
# remat::remat (and remat::dist when it was built with MPI).
include(GNUInstallDirs)
include(CMakePackageConfigHelpers)

set(REMAT_CMAKE_DIR ${CMAKE_INSTALL_LIBDIR}/cmake/remat)
install(TARGETS remat EXPORT rematTargets)
if(REMAT_HAVE_MPI)
  install(TARGETS remat_dist EXPORT rematTargets)
endif()
install(DIRECTORY include/ DESTINATION ${CMAKE_INSTALL_INCLUDEDIR})
install(EXPORT rematTargets NAMESPACE remat:: DESTINATION ${REMAT_CMAKE_DIR})
configure_package_config_file(${CMAKE_CURRENT_LIST_DIR}/rematConfig.cmake.in
                              ${CMAKE_CURRENT_BINARY_DIR}/rematConfig.cmake INSTALL_DESTINATION ${REMAT_CMAKE_DIR})
write_basic_package_version_file(${CMAKE_CURRENT_BINARY_DIR}/rematConfigVersion.cmake
                                 COMPATIBILITY SameMinorVersion ARCH_INDEPENDENT)
install(FILES ${CMAKE_CURRENT_BINARY_DIR}/rematConfig.cmake ${CMAKE_CURRENT_BINARY_DIR}/rematConfigVersion.cmake
        DESTINATION ${REMAT_CMAKE_DIR})

# remat.pc, for builds without CMake: c++ $(pkg-config --cflags --libs remat) main.cpp. It goes
# beside the CMake config, under the libdir rather than datadir although the library is header-only,
# because its flags are this build's: -fopenmp and oneDNN's library (a multiarch path on Debian) are
# what this configuration chose, so the file is no more architecture-independent than the config is.
# Eigen, fmt and nlohmann-json come through their own .pc files (Requires); OpenMP and oneDNN have
# none on Debian, so their flags are written out.
set(REMAT_PKGCONFIG_DIR ${CMAKE_INSTALL_LIBDIR}/pkgconfig)
if(IS_ABSOLUTE "${REMAT_PKGCONFIG_DIR}")
  set(REMAT_PC_PREFIX "${CMAKE_INSTALL_PREFIX}")
else()
  # ${pcfiledir} is the directory remat.pc was found in: the prefix is the way back up from it.
  file(RELATIVE_PATH _remat_up "/p/${REMAT_PKGCONFIG_DIR}" "/p")
  string(REGEX REPLACE "/$" "" _remat_up "${_remat_up}")
  set(REMAT_PC_PREFIX "\${pcfiledir}/${_remat_up}")
endif()
if(IS_ABSOLUTE "${CMAKE_INSTALL_INCLUDEDIR}")
  set(REMAT_PC_INCLUDEDIR "${CMAKE_INSTALL_INCLUDEDIR}")
else()
  set(REMAT_PC_INCLUDEDIR "\${prefix}/${CMAKE_INSTALL_INCLUDEDIR}")
endif()
set(REMAT_PC_CFLAGS "")
set(REMAT_PC_LIBS "")
if(REMAT_OPENMP)
  string(APPEND REMAT_PC_CFLAGS " ${OpenMP_CXX_FLAGS}")
  string(APPEND REMAT_PC_LIBS " ${OpenMP_CXX_FLAGS}")
endif()
if(REMAT_HAVE_ONEDNN)
  # Its directories only when the compiler does not search them anyway: an explicit -I/usr/include
  # reorders the system headers and breaks libstdc++'s #include_next.
  string(APPEND REMAT_PC_CFLAGS " -DREMAT_WITH_ONEDNN")
  if(NOT REMAT_DNNL_INCLUDE IN_LIST CMAKE_CXX_IMPLICIT_INCLUDE_DIRECTORIES)
    string(APPEND REMAT_PC_CFLAGS " -I${REMAT_DNNL_INCLUDE}")
  endif()
  get_filename_component(_remat_dnnl_dir "${REMAT_DNNL_LIBRARY}" DIRECTORY)
  if(NOT _remat_dnnl_dir IN_LIST CMAKE_CXX_IMPLICIT_LINK_DIRECTORIES)
    string(APPEND REMAT_PC_LIBS " -L${_remat_dnnl_dir}")
  endif()
  string(APPEND REMAT_PC_LIBS " -ldnnl")
endif()
configure_file(${CMAKE_CURRENT_LIST_DIR}/remat.pc.in ${CMAKE_CURRENT_BINARY_DIR}/remat.pc @ONLY)
install(FILES ${CMAKE_CURRENT_BINARY_DIR}/remat.pc DESTINATION ${REMAT_PKGCONFIG_DIR})
