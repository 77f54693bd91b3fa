/* Full-size run of test_disk_crash_loop.c (make stress). */
#define CRASH_LOOP_STRESS 1
#include "test_disk_crash_loop.c"
