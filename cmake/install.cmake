# install(EXPORT) + a config and version file, so consumers write find_package(remat) and link
# remat::remat (and remat::dist when it was built with MPI); the same package is exported for the
# build tree too (find_package(remat) with remat_DIR or CMAKE_PREFIX_PATH set to the build
# directory, nothing installed). Included from the top-level CMakeLists.txt when REMAT_INSTALL is on.
include(CMakePackageConfigHelpers)

# Header-only, and every dependency is found again on the consumer's machine (find_dependency and
# imported targets, no path of this build), so the package is architecture-independent: datadir,
# where one install serves every multiarch libdir.
set(REMAT_CMAKE_DIR ${CMAKE_INSTALL_DATADIR}/cmake/remat)
install(TARGETS remat EXPORT rematTargets)
if(REMAT_HAVE_MPI)
  install(TARGETS remat_dist EXPORT rematTargets)
endif()
install(DIRECTORY include/ DESTINATION ${CMAKE_INSTALL_INCLUDEDIR})
install(EXPORT rematTargets NAMESPACE remat:: DESTINATION ${REMAT_CMAKE_DIR})
# The installed config is generated apart from the build tree's (below), which sits at the top of
# the build directory where find_package looks for it.
configure_package_config_file(${CMAKE_CURRENT_LIST_DIR}/rematConfig.cmake.in
                              ${PROJECT_BINARY_DIR}/CMakeFiles/rematInstall/rematConfig.cmake
                              INSTALL_DESTINATION ${REMAT_CMAKE_DIR})
write_basic_package_version_file(${PROJECT_BINARY_DIR}/rematConfigVersion.cmake
                                 COMPATIBILITY SameMinorVersion ARCH_INDEPENDENT)
install(FILES ${PROJECT_BINARY_DIR}/CMakeFiles/rematInstall/rematConfig.cmake ${PROJECT_BINARY_DIR}/rematConfigVersion.cmake
              ${CMAKE_CURRENT_LIST_DIR}/Findremat_dnnl.cmake
        DESTINATION ${REMAT_CMAKE_DIR})

# The build tree's package: the targets with this checkout's include directory, the same config.
export(EXPORT rematTargets NAMESPACE remat:: FILE ${PROJECT_BINARY_DIR}/rematTargets.cmake)
configure_package_config_file(${CMAKE_CURRENT_LIST_DIR}/rematConfig.cmake.in ${PROJECT_BINARY_DIR}/rematConfig.cmake
                              INSTALL_DESTINATION ${PROJECT_BINARY_DIR} INSTALL_PREFIX ${PROJECT_BINARY_DIR})
configure_file(${CMAKE_CURRENT_LIST_DIR}/Findremat_dnnl.cmake ${PROJECT_BINARY_DIR}/Findremat_dnnl.cmake COPYONLY)

# remat.pc, for builds without CMake: c++ $(pkg-config --cflags --libs remat) main.cpp; and
# remat-dist.pc for remat::dist. Both under datadir, beside the CMake package and where Debian
# puts the header-only eigen3.pc and nlohmann_json.pc: what they hold is this configuration's
# choice of options (-fopenmp, oneDNN, MPI), as the CMake package does, and no architecture's
# library directory (oneDNN's is written only when the compiler does not search it anyway, and
# MPI's flags come from MPI's own .pc). Eigen, fmt and nlohmann-json come through their own .pc
# files (Requires); OpenMP and oneDNN have none on Debian, so their flags are written out.
set(REMAT_PKGCONFIG_DIR ${CMAKE_INSTALL_DATADIR}/pkgconfig)
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
configure_file(${CMAKE_CURRENT_LIST_DIR}/remat.pc.in ${PROJECT_BINARY_DIR}/remat.pc @ONLY)
install(FILES ${PROJECT_BINARY_DIR}/remat.pc DESTINATION ${REMAT_PKGCONFIG_DIR})

# remat-dist.pc requires the MPI implementation's own module, named by which MPI this build found
# (its mpi.h tells); for an MPI without a known module there is no remat-dist.pc (remat::dist
# through CMake still works). FindMPI's definitions (MPI_CXX_SKIP_MPICXX: OMPI_SKIP_MPICXX, ...)
# keep mpi.h to the C API, so that no MPI C++ bindings library is needed, as for remat::dist.
set(REMAT_PC_MPI_MODULE "")
if(REMAT_HAVE_MPI AND EXISTS "${MPI_CXX_HEADER_DIR}/mpi.h")
  file(STRINGS "${MPI_CXX_HEADER_DIR}/mpi.h" _remat_mpi_h REGEX "^#define (OPEN_MPI|I_MPI_VERSION|MPICH_VERSION) ")
  if(_remat_mpi_h MATCHES "OPEN_MPI")
    set(REMAT_PC_MPI_MODULE ompi-c)
  elseif(_remat_mpi_h MATCHES "I_MPI_VERSION")  # before MPICH, from which Intel MPI derives
    set(REMAT_PC_MPI_MODULE impi)
  elseif(_remat_mpi_h MATCHES "MPICH_VERSION")
    set(REMAT_PC_MPI_MODULE mpich)
  endif()
endif()
if(REMAT_PC_MPI_MODULE)
  set(REMAT_PC_DIST_CFLAGS "")
  foreach(_remat_def IN LISTS MPI_CXX_COMPILE_DEFINITIONS)
    string(APPEND REMAT_PC_DIST_CFLAGS " -D${_remat_def}")
  endforeach()
  configure_file(${CMAKE_CURRENT_LIST_DIR}/remat-dist.pc.in ${PROJECT_BINARY_DIR}/remat-dist.pc @ONLY)
  install(FILES ${PROJECT_BINARY_DIR}/remat-dist.pc DESTINATION ${REMAT_PKGCONFIG_DIR})
elseif(REMAT_HAVE_MPI)
  message(STATUS "remat: no remat-dist.pc: no pkg-config module known for the MPI in ${MPI_CXX_HEADER_DIR}")
endif()
