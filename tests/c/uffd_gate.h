/* A pool slot in userfaultfd memory (tests/c/uffd_gate.c): the migration
 * worker gathering it for an offload batch stops on the page fault until
 * the test fills the memory, so the batch's fence stays pending, and the
 * engine busy (a close waits for it), as long as the test wants.
 *
 *   uffd_gate_arm(e, g, geometry, first_token)
 *       registers the pool, starts the batch (one block of f32 K/V for
 *       tokens first_token..) and returns once the worker has faulted;
 *       false, holding nothing, where userfaultfd is not available
 *   uffd_gate_open(g)   fills the memory (zeros): the batch goes on
 *   uffd_gate_free(g)   gives back the descriptor and the memory
 */
#ifndef KVH_TESTS_UFFD_GATE_H
#define KVH_TESTS_UFFD_GATE_H

#include <stdbool.h>
#include <stddef.h>
#include <stdint.h>

#include <kvh/kvh.h>

typedef struct uffd_gate_geometry {
    uint32_t layers, block_tokens, kv_heads, head_dim;
} uffd_gate_geometry;

typedef struct uffd_gate {
    int fd;
    void *mem;
    size_t len;
    kvh_pool pool;
    kvh_fence fence;
    kvh_pool_xfer x;
    int32_t *tokens;
} uffd_gate;

bool uffd_gate_arm(kvh_engine *e, uffd_gate *g, uffd_gate_geometry geo, int32_t first_token);
void uffd_gate_open(uffd_gate *g);
void uffd_gate_free(uffd_gate *g);

#endif
