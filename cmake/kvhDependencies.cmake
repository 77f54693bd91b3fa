# Imported targets for the system libraries libkvh links:
#
#   kvh::uring   liburing (required by libkvh; sets KVH_URING_FOUND)
#   kvh::numa    libnuma  (optional; sets KVH_NUMA_FOUND)
#
# Included by CMakeLists.txt and, installed beside kvhConfig.cmake, by the
# package config, so the exported kvh::kvh_static names these targets and
# each consumer finds the libraries on its own machine: no path of the
# build machine is written into the installed files. KVH_URING_LIB,
# KVH_NUMA_LIB and the *_INCLUDE variables are ordinary cache entries a
# consumer may set.
if(NOT TARGET kvh::uring)
  find_library(KVH_URING_LIB uring)
  find_path(KVH_URING_INCLUDE liburing.h)
  if(KVH_URING_LIB AND KVH_URING_INCLUDE)
    add_library(kvh::uring UNKNOWN IMPORTED)
    set_target_properties(kvh::uring PROPERTIES
      IMPORTED_LOCATION "${KVH_URING_LIB}"
      INTERFACE_INCLUDE_DIRECTORIES "${KVH_URING_INCLUDE}")
  endif()
endif()
set(KVH_URING_FOUND FALSE)
if(TARGET kvh::uring)
  set(KVH_URING_FOUND TRUE)
endif()

if(NOT TARGET kvh::numa)
  find_library(KVH_NUMA_LIB numa)
  find_path(KVH_NUMA_INCLUDE numa.h)
  if(KVH_NUMA_LIB AND KVH_NUMA_INCLUDE)
    add_library(kvh::numa UNKNOWN IMPORTED)
    set_target_properties(kvh::numa PROPERTIES
      IMPORTED_LOCATION "${KVH_NUMA_LIB}"
      INTERFACE_INCLUDE_DIRECTORIES "${KVH_NUMA_INCLUDE}")
  endif()
endif()
set(KVH_NUMA_FOUND FALSE)
if(TARGET kvh::numa)
  set(KVH_NUMA_FOUND TRUE)
endif()
