# ctest: no executable of the build tree, and none of an installed copy, has an empty or relative
# RPATH/RUNPATH entry. The dynamic loader reads an empty entry as the current directory and a
# relative one against it, so such a binary run inside a downloaded model folder would load a
# library planted there (libfmt.so.9, libcudart.so...). $ORIGIN-based entries are allowed.
#   cmake -DBUILD_DIR=<build tree> -DREADELF=<readelf> -DINSTALL_DIR=<scratch prefix> -P check_runpath.cmake
if(NOT BUILD_DIR OR NOT READELF OR NOT INSTALL_DIR)
  message(FATAL_ERROR "usage: cmake -DBUILD_DIR=... -DREADELF=... -DINSTALL_DIR=... -P check_runpath.cmake")
endif()

file(REMOVE_RECURSE "${INSTALL_DIR}")
execute_process(COMMAND "${CMAKE_COMMAND}" --install "${BUILD_DIR}" --prefix "${INSTALL_DIR}"
                RESULT_VARIABLE rc OUTPUT_QUIET ERROR_VARIABLE err)
if(NOT rc EQUAL 0)
  message(FATAL_ERROR "cmake --install ${BUILD_DIR} failed: ${err}")
endif()

set(bad "")
set(checked 0)
foreach(root "${BUILD_DIR}" "${INSTALL_DIR}")
  file(GLOB_RECURSE files LIST_DIRECTORIES false "${root}/*")
  foreach(f IN LISTS files)
    # compiler probes and the scratch install inside the build tree are checked once, as installed
    if(f MATCHES "/CMakeFiles/" OR (root STREQUAL BUILD_DIR AND f MATCHES "^${INSTALL_DIR}/"))
      continue()
    endif()
    if(IS_SYMLINK "${f}")
      continue()
    endif()
    file(READ "${f}" magic LIMIT 4 HEX)
    if(NOT magic STREQUAL "7f454c46")  # ELF
      continue()
    endif()
    execute_process(COMMAND "${READELF}" -d "${f}" OUTPUT_VARIABLE dyn ERROR_QUIET RESULT_VARIABLE rc)
    if(NOT rc EQUAL 0)
      continue()  # an object file or archive member readelf cannot list: no dynamic section
    endif()
    math(EXPR checked "${checked} + 1")
    string(REGEX MATCHALL "\\((RPATH|RUNPATH)\\)[^\n]*\\[[^]\n]*\\]" entries "${dyn}")
    foreach(e IN LISTS entries)
      string(REGEX REPLACE "^.*\\[(.*)\\]$" "\\1" path "${e}")
      # an empty list element: a leading, trailing or doubled ':'
      string(REPLACE ":" ";" parts "${path}")
      if(path STREQUAL "" OR path MATCHES "^:" OR path MATCHES ":$" OR path MATCHES "::")
        list(APPEND bad "${f}: empty entry in '${path}'")
        continue()
      endif()
      foreach(p IN LISTS parts)
        if(NOT p MATCHES "^/" AND NOT p MATCHES "^\\$ORIGIN" AND NOT p MATCHES "^\\$\\{ORIGIN\\}")
          list(APPEND bad "${f}: relative entry '${p}' in '${path}'")
        endif()
      endforeach()
    endforeach()
  endforeach()
endforeach()
file(REMOVE_RECURSE "${INSTALL_DIR}")
if(checked EQUAL 0)
  message(FATAL_ERROR "no ELF file with a dynamic section found under ${BUILD_DIR}")
endif()
if(bad)
  list(JOIN bad "\n  " lines)
  message(FATAL_ERROR "executables whose RPATH/RUNPATH has an empty or relative entry:\n  ${lines}")
endif()
message(STATUS "${checked} ELF files checked: every RPATH/RUNPATH entry is absolute or $ORIGIN-based")
