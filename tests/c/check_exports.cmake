# Fails unless every symbol that libkvh.so defines in its dynamic symbol
# table starts with "kvh_" (ABI rule 5), and kvh_version is among them.
#   cmake -DNM=/usr/bin/nm -DLIB=build/libkvh.so -P check_exports.cmake
# Version nodes from the linker map (KVH_0, type A) are not symbols and are
# skipped; "name@@KVH_0" is read as "name".
if(NOT NM OR NOT LIB)
  message(FATAL_ERROR "usage: cmake -DNM=<nm> -DLIB=<libkvh.so> -P check_exports.cmake")
endif()
execute_process(COMMAND ${NM} -D --defined-only ${LIB}
  OUTPUT_VARIABLE out ERROR_VARIABLE err RESULT_VARIABLE rc)
if(NOT rc EQUAL 0)
  message(FATAL_ERROR "${NM} -D --defined-only ${LIB} failed (${rc}): ${err}")
endif()

string(REPLACE "\n" ";" lines "${out}")
set(ours 0)
set(bad "")
set(have_version OFF)
foreach(line IN LISTS lines)
  if(line STREQUAL "")
    continue()
  endif()
  if(NOT line MATCHES "^([0-9a-fA-F]+ +)?([A-Za-z?]) +([^ ]+)$")
    message(FATAL_ERROR "cannot parse nm line: '${line}'")
  endif()
  set(type "${CMAKE_MATCH_2}")
  string(REGEX REPLACE "@.*$" "" sym "${CMAKE_MATCH_3}")
  if(type STREQUAL "A")
    continue()  # version node such as KVH_0
  endif()
  if(sym MATCHES "^kvh_")
    math(EXPR ours "${ours} + 1")
    if(sym STREQUAL "kvh_version")
      set(have_version ON)
    endif()
  else()
    list(APPEND bad "${type} ${sym}")
  endif()
endforeach()

if(bad)
  list(JOIN bad "\n  " bad_text)
  message(FATAL_ERROR "${LIB} exports symbols outside the kvh_ namespace:\n  ${bad_text}")
endif()
if(NOT have_version)
  message(FATAL_ERROR "${LIB} does not export kvh_version (${ours} kvh_* symbols found)")
endif()
message(STATUS "abi_exports: ${LIB} exports ${ours} kvh_* symbols and nothing else")
