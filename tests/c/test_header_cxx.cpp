// The public header compiles as strict C++11 (-std=c++11 -Wall -Wextra
// -pedantic -Werror, set in tests/c/CMakeLists.txt) and links from C++:
// extern "C" is in place, no C-only constructs leak into the header.
#include <kvh/kvh.h>
#include <kvh/kvh.h> // include guard

#include <cstdio>
#include <cstring>

static_assert(sizeof(kvh_seq) == sizeof(uint64_t), "handles are 64-bit values");
static_assert(sizeof(kvh_block) == sizeof(uint64_t), "handles are 64-bit values");
static_assert(sizeof(kvh_status) == sizeof(int32_t), "kvh_status is an int32_t");
static_assert(KVH_OK == 0, "KVH_OK is zero");

int main()
{
    const char *ok = kvh_strerror(KVH_OK);
    const char *inval = kvh_strerror(KVH_ERR_INVALID_ARG);
    if (ok == nullptr || inval == nullptr || inval[0] == '\0' || std::strcmp(ok, inval) == 0) {
        std::fprintf(stderr, "FAIL: kvh_strerror from C++\n");
        return 1;
    }
    if (kvh_version() != KVH_VERSION_NUMBER) {
        std::fprintf(stderr, "FAIL: kvh_version() != KVH_VERSION_NUMBER\n");
        return 1;
    }
    std::printf("kvh public header OK as C++11: %s\n", inval);
    return 0;
}
