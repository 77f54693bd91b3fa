/* Durable twins of blocks persisted through their handles
 * (kvh_blocks_persist; core/durable_twin.c). When a caller's block has a
 * twin, a published block of the same prefix, persisting makes the twin
 * durable in its place; the twin must then live as long as the caller's
 * block, or a full tier drops it (a cached block nothing references is
 * the first to go) and the store forgets the prefix the caller was told
 * is durable. Sequences keep theirs themselves (kvhi_seq_keep_durable_twins);
 * this table keeps them for blocks named by handles: block -> twin, one
 * reference on the twin per entry, dropped when the block is destroyed. */
#ifndef KVH_CORE_DURABLE_TWIN_H
#define KVH_CORE_DURABLE_TWIN_H

#include <stdint.h>

typedef struct kvhi_twin_table {
    uint32_t *keys; /* block index + 1; 0: empty */
    uint32_t *twins;
    uint32_t cap; /* a power of two, or 0 */
    uint32_t count;
} kvhi_twin_table;

struct kvh_engine;

/* Records that `block` keeps `twin`, taking over the caller's reference on
 * twin (dropped at once when block already keeps one). 0, or -1 out of
 * memory (the reference is then the caller's still). Lock held. */
int kvhi_twin_keep(struct kvh_engine *e, uint32_t block, uint32_t twin);
/* block is being destroyed: drops the reference on its twin, if any. */
void kvhi_twin_drop_slow(struct kvh_engine *e, uint32_t block);
void kvhi_twin_table_free(kvhi_twin_table *t);

#endif
