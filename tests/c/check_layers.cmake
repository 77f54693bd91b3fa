# Fails when a lower layer of libkvh depends on a higher one: kernels use
# nothing of core or abi, core uses nothing of abi (docs/ARCHITECTURE.md,
# section 1), neither by an undefined symbol of their objects that only a
# higher layer's objects define, nor by including a header under abi/
# (other than the public kvh/kvh.h, reached as "kvh/kvh.h").
#   cmake -DNM=nm -DSRC=<source root> -DKERNELS=<objs> -DCORE=<objs> -DABI=<objs> -P check_layers.cmake
# Each object list is ";"- or "|"-separated.
cmake_policy(VERSION 3.18)
foreach(v NM SRC KERNELS CORE ABI)
  if(NOT DEFINED ${v} OR "${${v}}" STREQUAL "")
    message(FATAL_ERROR "usage: cmake -DNM=nm -DSRC=<root> -DKERNELS=<objs> -DCORE=<objs> -DABI=<objs> -P check_layers.cmake")
  endif()
  string(REPLACE "|" ";" ${v} "${${v}}")
endforeach()

# nm -P of each object: "name type [value size]", one a line.
function(symbols_of objs kind out)
  set(result "")
  foreach(obj IN LISTS objs)
    execute_process(COMMAND ${NM} -P ${kind} ${obj}
      OUTPUT_VARIABLE text ERROR_VARIABLE err RESULT_VARIABLE rc)
    if(NOT rc EQUAL 0)
      message(FATAL_ERROR "${NM} -P ${kind} ${obj} failed (${rc}): ${err}")
    endif()
    string(REPLACE "\n" ";" lines "${text}")
    get_filename_component(name ${obj} NAME)
    foreach(line IN LISTS lines)
      if(line MATCHES "^([^ ]+) ([A-Za-z])")
        set(sym "${CMAKE_MATCH_1}")
        set(type "${CMAKE_MATCH_2}")
        # Defined: global text, data, bss, read-only, weak.
        if(kind STREQUAL "--defined-only" AND NOT type MATCHES "^[TDBRVWCG]$")
          continue()
        endif()
        list(APPEND result "${sym}@${name}")
      endif()
    endforeach()
  endforeach()
  set(${out} "${result}" PARENT_SCOPE)
endfunction()

function(names_of pairs out)
  set(result "")
  foreach(p IN LISTS pairs)
    string(REGEX REPLACE "@[^@]*$" "" n "${p}")
    list(APPEND result "${n}")
  endforeach()
  list(REMOVE_DUPLICATES result)
  set(${out} "${result}" PARENT_SCOPE)
endfunction()

symbols_of("${KERNELS}" --defined-only kernels_def)
symbols_of("${CORE}" --defined-only core_def)
symbols_of("${ABI}" --defined-only abi_def)
names_of("${kernels_def}" kernels_names)
names_of("${core_def}" core_names)
names_of("${abi_def}" abi_names)

set(bad "")
# uses(layer objs, names it may use, names of the layers above it)
function(check_uses layer objs allowed above)
  symbols_of("${objs}" --undefined-only undef)
  set(found "")
  foreach(p IN LISTS undef)
    string(REGEX MATCH "^(.*)@([^@]*)$" _ "${p}")
    set(sym "${CMAKE_MATCH_1}")
    set(obj "${CMAKE_MATCH_2}")
    list(FIND allowed "${sym}" in_allowed)
    list(FIND above "${sym}" in_above)
    if(in_allowed EQUAL -1 AND NOT in_above EQUAL -1)
      list(APPEND found "${layer} object ${obj} uses ${sym}, defined only above it")
    endif()
  endforeach()
  set(bad "${bad};${found}" PARENT_SCOPE)
endfunction()

check_uses(kernels "${KERNELS}" "${kernels_names}" "${core_names};${abi_names}")
check_uses(core "${CORE}" "${core_names};${kernels_names}" "${abi_names}")

# Includes: no core/ or kernels/ source or header names a file under abi/.
file(GLOB_RECURSE lower_sources
  ${SRC}/core/*.c ${SRC}/core/*.h ${SRC}/kernels/*.c ${SRC}/kernels/*.h
  ${SRC}/kernels/*.cu ${SRC}/kernels/*.cuh ${SRC}/kernels/*.cpp ${SRC}/kernels/*.inc)
foreach(f IN LISTS lower_sources)
  file(STRINGS ${f} includes REGEX "^[ \t]*#[ \t]*include[ \t]*[\"<]abi/")
  foreach(line IN LISTS includes)
    file(RELATIVE_PATH rel ${SRC} ${f})
    string(STRIP "${line}" line)
    list(APPEND bad "${rel} includes from abi/: ${line}")
  endforeach()
endforeach()

list(REMOVE_ITEM bad "")
if(bad)
  list(REMOVE_DUPLICATES bad)
  list(JOIN bad "\n  " text)
  message(FATAL_ERROR "wrong-way dependencies between the layers of libkvh:\n  ${text}")
endif()
list(LENGTH KERNELS nk)
list(LENGTH CORE nc)
list(LENGTH ABI na)
message(STATUS "abi_layers: ${nk} kernels, ${nc} core and ${na} abi objects; no lower layer uses a higher one")
