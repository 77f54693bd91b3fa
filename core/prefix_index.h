/* Prefix index: chained 64-bit block hashes -> block index.
 *
 * The hash of a full block is H(parent hash, its token ids, model salt),
 * so equal hashes mean equal prefixes up to and including that block. The
 * table is open addressing with linear probing and backward-shift deletion
 * (no tombstones), sized at creation for every block the engine can hold. */
#ifndef KVH_CORE_PREFIX_INDEX_H
#define KVH_CORE_PREFIX_INDEX_H

#include <stddef.h>
#include <stdint.h>

#define KVHI_PREFIX_MISS UINT32_MAX

typedef struct kvhi_prefix_index {
    uint64_t *keys; /* 0 = empty slot */
    uint32_t *values;
    uint64_t mask;
    uint64_t count;
} kvhi_prefix_index;

/* Never returns 0 (the empty key). */
uint64_t kvhi_prefix_hash(uint64_t parent, const int32_t *tokens, size_t n, uint64_t salt);

/* Tenant scopes (kvh.h "Tenant scopes"). The salt of scope s is
 * model_salt ^ mix64(s), mix64 splitmix64's finaliser: a bijection with
 * mix64(0) = 0, so scope 0 hashes exactly as before scopes existed, and
 * two scopes of one engine never have the same salt. */
uint64_t kvhi_scope_salt(uint64_t model_salt, uint64_t scope);

/* What a sequence (or a scoped lookup) hashes in: logical block i, tokens
 * [i * bt, (i + 1) * bt), is in shared_scope when (i + 1) * bt <=
 * shared_tokens, else in scope. All zero: the engine's default scope. */
typedef struct kvhi_scope {
    uint64_t scope;
    uint64_t shared_scope;
    uint64_t shared_tokens;
} kvhi_scope;

/* Salt of logical block i under sc (sc NULL: the default scope). */
uint64_t kvhi_scope_block_salt(uint64_t model_salt, const kvhi_scope *sc, uint64_t i, uint32_t bt);

int kvhi_prefix_init(kvhi_prefix_index *ix, uint64_t max_entries);
void kvhi_prefix_destroy(kvhi_prefix_index *ix);
/* Values stored under hash, one per call: *pos starts at 0, and
 * KVHI_PREFIX_MISS follows the last. One hash may name several values:
 * blocks of different prefixes whose hashes are equal (a collision, or
 * one a caller forged by choosing tokens) are kept side by side, and the
 * caller tells them apart by parent and tokens (kvhi_block_find_published).
 * Hash 0 (the empty key) is never found and never inserted. */
static inline uint32_t kvhi_prefix_next(const kvhi_prefix_index *ix, uint64_t hash, uint64_t *pos)
{
    if (hash == 0) /* the empty key: never stored (a forged record may name it) */
        return KVHI_PREFIX_MISS;
    /* *pos counts the slots of hash's probe run already looked at. */
    for (;;) {
        uint64_t i = (hash + *pos) & ix->mask;
        uint64_t k = ix->keys[i];
        if (k == 0 || *pos > ix->mask)
            return KVHI_PREFIX_MISS;
        (*pos)++;
        if (k == hash)
            return ix->values[i];
    }
}
/* The first value stored under hash: white-box tests use it; the engine
 * looks blocks up by prefix (kvhi_block_find_published). */
static inline uint32_t kvhi_prefix_find(const kvhi_prefix_index *ix, uint64_t hash)
{
    uint64_t pos = 0;
    return kvhi_prefix_next(ix, hash, &pos);
}
/* Adds (hash, value); the caller has checked that no equal prefix is
 * stored. Returns 0, or -1 for hash 0. */
int kvhi_prefix_insert(kvhi_prefix_index *ix, uint64_t hash, uint32_t value);
/* Removes (hash, value), leaving other values of hash in place. */
void kvhi_prefix_erase(kvhi_prefix_index *ix, uint64_t hash, uint32_t value);

#endif
