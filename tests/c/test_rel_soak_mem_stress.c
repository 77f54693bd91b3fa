/* Soak (make stress), the part that passes today: the agents workload on
 * the memory-only engine for KVH_REL_SOAK_SECONDS / 2 (default 150 s),
 * counters checked and memory required flat at every checkpoint. The
 * disk-tier soak is known_failing/test_rel_soak_stress.c. */
#define REL_STRESS 1
#define REL_SOAK 1
#define REL_AGENTS_MEMORY_ONLY 1
#include "known_failing/test_rel_agents_mt.c"
