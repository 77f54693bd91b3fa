# The installed package is relocatable: install BUILD into WORK/installed,
# move it to WORK/moved, check that no installed CMake or pkg-config file
# names the build tree, the source tree, the first prefix or a library path
# of this machine, then configure, build and run tests/c/consumer against
# the moved prefix with kvh::kvh and with kvh::kvh_static.
#
#   cmake -DCMAKE=... -DBUILD=... -DSRC=... -DWORK=... -DGENERATOR=...
#         -DCC=... -DURING=<liburing path> [-DNUMA=<libnuma path>]
#         -P check_install.cmake
include(${CMAKE_CURRENT_LIST_DIR}/check_util.cmake)
check_require(check_install.cmake CMAKE BUILD SRC WORK GENERATOR CC URING)

file(REMOVE_RECURSE ${WORK})
file(MAKE_DIRECTORY ${WORK})
run(${CMAKE} --install ${BUILD} --prefix ${WORK}/installed)
file(RENAME ${WORK}/installed ${WORK}/moved)

file(GLOB_RECURSE config_files ${WORK}/moved/*.cmake ${WORK}/moved/*.pc)
if(NOT config_files)
  message(FATAL_ERROR "no CMake package or pkg-config file installed")
endif()
set(forbidden ${BUILD} ${SRC} ${WORK}/installed ${URING})
if(NUMA)
  list(APPEND forbidden ${NUMA})
endif()
foreach(f IN LISTS config_files)
  file(READ ${f} text)
  foreach(p IN LISTS forbidden)
    string(FIND "${text}" "${p}" at)
    if(NOT at EQUAL -1)
      message(FATAL_ERROR "${f} names ${p}: not relocatable")
    endif()
  endforeach()
endforeach()
list(LENGTH config_files n)
message(STATUS "installed, moved; ${n} package files name no path of this machine")

# kvh.pc names its prefix from its own place: its libdir and includedir
# must be the moved tree's, however deep the libdir lies.
find_program(PKG_CONFIG pkg-config)
file(GLOB_RECURSE pc_files ${WORK}/moved/*/kvh.pc)
if(PKG_CONFIG AND pc_files)
  list(GET pc_files 0 pc)
  get_filename_component(pc_dir ${pc} DIRECTORY)
  set(ENV{PKG_CONFIG_PATH} ${pc_dir})
  foreach(var libdir includedir)
    execute_process(COMMAND ${PKG_CONFIG} --variable=${var} kvh OUTPUT_VARIABLE dir RESULT_VARIABLE rc
                    OUTPUT_STRIP_TRAILING_WHITESPACE)
    if(var STREQUAL "includedir")
      set(want kvh/kvh.h)
    else()
      set(want libkvh.a)
    endif()
    if(NOT rc EQUAL 0 OR NOT EXISTS "${dir}/${want}")
      message(FATAL_ERROR "kvh.pc's ${var} is '${dir}', which holds no ${want}")
    endif()
  endforeach()
  message(STATUS "kvh.pc: libdir and includedir are the moved tree's")
endif()

foreach(mode shared static)
  set(bin ${WORK}/consumer-${mode})
  set(static OFF)
  if(mode STREQUAL "static")
    set(static ON)
  endif()
  run(${CMAKE} -S ${SRC}/tests/c/consumer -B ${bin} -G ${GENERATOR} -DCMAKE_C_COMPILER=${CC}
      -DCMAKE_PREFIX_PATH=${WORK}/moved -DKVH_CONSUMER_STATIC=${static})
  run(${CMAKE} --build ${bin})
  run(${bin}/kvh_consumer)
  string(STRIP "${run_out}" line)
  message(STATUS "${mode}: ${line}")
  if(NOT line MATCHES "40 tokens$")
    message(FATAL_ERROR "${mode} consumer printed: ${run_out}")
  endif()
endforeach()
