# The API reference: `cmake --build <build> --target docs` runs Doxygen (Debian `doxygen`) over
# include/remat with the README as its main page, into <build>/docs/html. Optional: the target
# exists only when Doxygen is found. Any warning (an undocumented public name, a broken reference)
# fails it; tests/CMakeLists.txt runs it as the CTest `docs`.
find_package(Doxygen QUIET)
find_package(Python3 COMPONENTS Interpreter QUIET)  # the Markdown filter (cmake/doxygen_markdown_filter.py)
if(DOXYGEN_FOUND AND Python3_Interpreter_FOUND)
  set(REMAT_DOCS_DIR ${PROJECT_BINARY_DIR}/docs)
  configure_file(${CMAKE_CURRENT_LIST_DIR}/Doxyfile.in ${PROJECT_BINARY_DIR}/Doxyfile @ONLY)
  add_custom_target(docs COMMAND Doxygen::doxygen ${PROJECT_BINARY_DIR}/Doxyfile
                    WORKING_DIRECTORY ${PROJECT_SOURCE_DIR}
                    COMMENT "remat: API reference (Doxygen) in ${REMAT_DOCS_DIR}/html" VERBATIM)
endif()
if(TARGET docs)
  message(STATUS "remat: API reference target `docs` (Doxygen): YES")
else()
  message(STATUS "remat: API reference target `docs` (Doxygen): NO (needs doxygen and python3)")
endif()
