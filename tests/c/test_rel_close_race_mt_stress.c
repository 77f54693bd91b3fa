/* Full-size run of test_rel_close_race_mt.c (make stress). */
#define REL_STRESS 1
#include "test_rel_close_race_mt.c"
