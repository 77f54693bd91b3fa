/* Warnings for instruction-set overrides in the environment that name
 * nothing, or what this CPU does not run (core/isa_overrides.c). */
#ifndef KVH_CORE_ISA_OVERRIDES_H
#define KVH_CORE_ISA_OVERRIDES_H

#include "core/engine.h"

/* Logs one warning per such variable (engine open). */
void kvhi_warn_isa_overrides(kvh_engine *e);

#endif
