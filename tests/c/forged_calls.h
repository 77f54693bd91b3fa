/* One table of every exported call that takes a handle, for the batteries
 * that feed forged, stale and wrong-type handle values (test_bad_input.c,
 * test_rel_abi_misuse.c): each call gets the forged value where its handle
 * goes and live objects everywhere else, so the only thing wrong with it is
 * that handle. */
#ifndef KVH_TEST_FORGED_CALLS_H
#define KVH_TEST_FORGED_CALLS_H

#include <stdint.h>

#include <kvh/kvh.h>

/* The live objects the calls are made around. The geometry sizes the
 * K/V and attention buffers (heads * head_dim <= FORGED_MAX_ROW). */
typedef struct forged_targets {
    kvh_engine *engine;
    kvh_seq seq;          /* paired with a forged sequence in batch calls */
    kvh_block block;      /* paired with a forged block in kvh_migrate */
    kvh_block slot_block; /* restored into the pool with a forged pool */
    kvh_pool pool;        /* a live pool for calls given a forged block */
    uint32_t heads, head_dim, block_tokens;
} forged_targets;

enum { FORGED_MAX_ROW = 1024 };

typedef enum forged_kind { FORGED_SEQ, FORGED_BLOCK, FORGED_FENCE, FORGED_POOL } forged_kind;

/* How many calls the table has; call numbers are 0 .. forged_call_count()-1. */
int forged_call_count(void);

/* Which kind of handle call number `call` takes. */
forged_kind forged_call_kind(int call);

/* The type tag (top byte) of live handles of that kind. */
uint8_t forged_kind_tag(forged_kind kind);

/* Makes call number `call` with `handle` in its handle argument; `variant`
 * picks among its optional arguments (a fence or none, a timeout). */
kvh_status forged_call(const forged_targets *t, int call, uint64_t handle, uint64_t variant);

#endif
