/* Full-size run of test_rel_faults.c (make stress): the sweeps again with 2
 * migration workers. */
#define REL_STRESS 1
#include "test_rel_faults.c"
