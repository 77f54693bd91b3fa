# libkvh builds without hiredis's headers: configure SRC with
# KVH_WITH_REMOTE=OFF into WORK, build the shared library alone, then build
# and run tests/c/remote_absent/main.c against it.
#
#   cmake -DCMAKE=... -DSRC=... -DWORK=... -DGENERATOR=... -DCC=...
#         -P check_remote_absent.cmake
include(${CMAKE_CURRENT_LIST_DIR}/check_util.cmake)
check_require(check_remote_absent.cmake CMAKE SRC WORK GENERATOR CC)

file(MAKE_DIRECTORY ${WORK})
run(${CMAKE} -S ${SRC} -B ${WORK}/build -G ${GENERATOR} -DCMAKE_C_COMPILER=${CC} -DCMAKE_BUILD_TYPE=Release
    -DKVH_WITH_REMOTE=OFF -DKVH_BUILD_TESTS=OFF -DKVH_BUILD_BENCH=OFF -DKVH_WITH_CUDA=OFF)
run(${CMAKE} --build ${WORK}/build --target kvh -j2)
run(${CC} -o ${WORK}/probe ${SRC}/tests/c/remote_absent/main.c -I${SRC}/abi/include
    -L${WORK}/build -lkvh -Wl,-rpath,${WORK}/build)
run(${WORK}/probe)
message(STATUS "${run_out}")
