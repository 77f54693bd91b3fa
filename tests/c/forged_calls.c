/* The forged-handle call table (forged_calls.h). */
#include "forged_calls.h"

#include <assert.h>

/* Calls 0-18 take a sequence, 19-24 a block, 25-27 a fence, 28-31 a pool. */
enum { SEQ_CALLS = 19, BLOCK_CALLS = 6, FENCE_CALLS = 3, POOL_CALLS = 4 };
enum { FIRST_BLOCK = SEQ_CALLS, FIRST_FENCE = FIRST_BLOCK + BLOCK_CALLS, FIRST_POOL = FIRST_FENCE + FENCE_CALLS };

int forged_call_count(void) { return FIRST_POOL + POOL_CALLS; }

forged_kind forged_call_kind(int call)
{
    if (call < FIRST_BLOCK)
        return FORGED_SEQ;
    if (call < FIRST_FENCE)
        return FORGED_BLOCK;
    if (call < FIRST_POOL)
        return FORGED_FENCE;
    return FORGED_POOL;
}

uint8_t forged_kind_tag(forged_kind kind)
{
    static const uint8_t tags[] = {
        [FORGED_SEQ] = 0x5A, [FORGED_BLOCK] = 0xB1, [FORGED_FENCE] = 0xF3, [FORGED_POOL] = 0x9C};
    return tags[kind];
}

/* Buffers large enough for any call of the table: four tokens of K and V
 * (f32), two query rows. Never read back, so shared across calls. */
static uint8_t kv_k[4 * FORGED_MAX_ROW * 4], kv_v[4 * FORGED_MAX_ROW * 4];
static float attn_q[2 * FORGED_MAX_ROW], attn_out[2 * FORGED_MAX_ROW];

static kvh_status seq_call(const forged_targets *t, int call, kvh_seq h, uint64_t variant)
{
    kvh_engine *e = t->engine;
    int32_t toks[8] = {1, 2, 3, 4, 5, 6, 7, 8}, indptr[3], indices[8], last_page_len[2];
    uint64_t u64 = 0;
    size_t sz = 0;
    kvh_seq child, pair[2] = {t->seq, h};
    kvh_fence fence;
    kvh_block blk;
    uint32_t q_lens[2] = {1, 1};
    kvh_fence *maybe_fence = (variant & 1) ? &fence : NULL;
    switch (call) {
    case 0:
        return kvh_seq_free(e, h);
    case 1:
        return kvh_seq_fork(e, h, 0, &child);
    case 2:
        return kvh_seq_append(e, h, toks, 3);
    case 3:
        return kvh_seq_length(e, h, &u64);
    case 4:
        return kvh_seq_tokens(e, h, 0, 1, toks);
    case 5:
        return kvh_seq_write_kv(e, h, 0, 0, 1, kv_k, kv_v);
    case 6:
        return kvh_seq_read_kv(e, h, 0, 0, 1, kv_k, kv_v);
    case 7:
        return kvh_seq_truncate(e, h, 0);
    case 8:
        return kvh_seq_match_prefix(e, h, toks, 8, &sz);
    case 9:
        return kvh_seq_acquire(e, h, 0, 1, maybe_fence);
    case 10:
        return kvh_seq_release(e, h, 0, 1);
    case 11:
        return kvh_seq_pin(e, h, 0, 1, variant & 1);
    case 12:
        return kvh_seq_blocks(e, h, 0, 1, &blk);
    case 13:
        return kvh_seq_migrate(e, h, 0, 1, KVH_TIER_HOST, maybe_fence);
    case 14:
        return kvh_prefetch(e, h, 0, 1, 0, maybe_fence);
    case 15:
        return kvh_seq_persist(e, h);
    case 16:
        return kvh_block_table(e, pair, 2, indptr, indices, 8, last_page_len);
    case 17:
        return kvh_attention_decode(e, 0, pair, 2, attn_q, attn_out, NULL);
    default:
        return kvh_attention_prefill(e, 0, pair, q_lens, 2, attn_q, attn_out, NULL);
    }
}

static kvh_status block_call(const forged_targets *t, int call, kvh_block h, uint64_t variant)
{
    kvh_engine *e = t->engine;
    kvh_block_info info = {.struct_size = sizeof(info)};
    kvh_block pair[2] = {t->block, h};
    kvh_fence fence;
    switch (call - FIRST_BLOCK) {
    case 0:
        return kvh_block_info_get(e, h, &info);
    case 1:
        return kvh_block_retain(e, h);
    case 2:
        return kvh_block_release(e, h);
    case 3:
        return kvh_block_pin(e, h, variant & 1);
    case 4:
        return kvh_migrate(e, pair, 2, KVH_TIER_HOST, (variant & 1) ? &fence : NULL);
    default:
        return kvh_pool_restore(e, t->pool, h, 0);
    }
}

static kvh_status fence_call(const forged_targets *t, int call, kvh_fence h, uint64_t variant)
{
    int32_t done = 0;
    switch (call - FIRST_FENCE) {
    case 0:
        return kvh_fence_wait(t->engine, h, (variant & 1) ? 0 : 1000);
    case 1:
        return kvh_fence_poll(t->engine, h, &done);
    default:
        return kvh_fence_free(t->engine, h);
    }
}

static kvh_status pool_call(const forged_targets *t, int call, kvh_pool h)
{
    int32_t toks[8] = {1, 2, 3, 4, 5, 6, 7, 8};
    kvh_block blk;
    switch (call - FIRST_POOL) {
    case 0:
        return kvh_pool_unregister(t->engine, h);
    case 1:
        return kvh_pool_offload(t->engine, h, 0, 0, toks, t->block_tokens, 0, &blk);
    case 2:
        return kvh_pool_restore(t->engine, h, t->slot_block, 0);
    default:
        return kvh_pool_offload(t->engine, h, 1, 0, toks, t->block_tokens, 3, &blk);
    }
}

kvh_status forged_call(const forged_targets *t, int call, uint64_t handle, uint64_t variant)
{
    assert(t->heads * t->head_dim <= FORGED_MAX_ROW && t->block_tokens <= 8);
    switch (forged_call_kind(call)) {
    case FORGED_SEQ:
        return seq_call(t, call, (kvh_seq){handle}, variant);
    case FORGED_BLOCK:
        return block_call(t, call, (kvh_block){handle}, variant);
    case FORGED_FENCE:
        return fence_call(t, call, (kvh_fence){handle}, variant);
    default:
        return pool_call(t, call, (kvh_pool){handle});
    }
}
