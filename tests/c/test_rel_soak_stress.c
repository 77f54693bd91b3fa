/* Soak (make stress): the agents workload of test_rel_agents_mt.c for
 * KVH_REL_SOAK_SECONDS (default 300), with memory-flat checks. */
#define REL_STRESS 1
#define REL_SOAK 1
#include "test_rel_agents_mt.c"
