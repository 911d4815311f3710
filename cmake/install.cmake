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
