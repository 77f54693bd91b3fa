/* Block metadata (core/block.c, core/block_state.h), white-box: the
 * functions are called directly, under the engine lock, on engines without
 * migration workers, so that nothing moves between the calls.
 *
 *   - the move-state table: kvhi_move_next for every state and event (the
 *     legal transitions reach the state the header's diagram shows, every
 *     other pair gives KVHI_MS_COUNT), what in_flight / copying / busy say
 *     in each state, and kvhi_block_move_event changing the state field
 *     and no other flag;
 *   - references: the last unref of a published block leaves it cached
 *     (in the prefix index and its tier's heap, now in the unreferenced
 *     class), of an unpublished one frees it and its slot;
 *   - holds: a held block is in no heap; one freed while held or while a
 *     copy runs from it is DEAD (unpublished, its handle stale, its slot
 *     kept) until the last unhold or the mover's free reaps it, and
 *     kvhi_block_writing_done frees the slot a block left meanwhile;
 *   - pins: per-tier pinned counts, and a pin taken while the block is in
 *     flight follows it to its new tier;
 *   - publication and the prefix index: a block is published once hashed
 *     and every (layer, token) cell is written, the older of two equal
 *     blocks keeps the index entry, an erased entry lets the other in;
 *     kvhi_block_forget_tokens keeps exactly the cells asked for;
 *   - copy-on-write: the copy carries data, tokens, hash, completeness and
 *     the written-cell bitmap, is not published, and takes the source's
 *     reference.
 *   - kvh_block_release's backlog: a release its key vouches for waits,
 *     its record untouched, until a later release pushes it out or any
 *     other call enters; stale, forged and double releases, used-up
 *     counts and references sequences hold still get the error the record
 *     gives, a key (a reuse count) never vouches for a handle whose
 *     generation agrees with it only in the key's bits, a record reused
 *     past what a key holds is checked in full, and releases from several
 *     threads lose none.
 * Feature tests cover the same calls through the public API (test_seq.c:
 * forks, CoW, truncate; test_tiers.c: pins, holds); these check the state
 * the calls leave behind. */
#include <pthread.h>
#include <stdbool.h>
#include <stdlib.h>
#include <string.h>

#include "test_util.h"

#include "core/block_state.h"
#include "core/engine.h"
#include "white_box_util.h"
#include "core/move.h"
#include "core/block.h"
#include "core/tier.h"
#include "core/seq.h"

enum { L = 3, H = 1, D = 4, BT = 4 }; /* 12 cells a block: one partial bitmap word */
static const size_t TOK = H * D * 4;

/* Memory-only engine, inline migration; copy_moves so that a move has a
 * source and a destination slot. */
static kvh_engine *open_engine(uint64_t dev, uint64_t host)
{
    kvh_config c = tu_cfg(L, H, D, BT, KVH_DTYPE_F32, dev, host, 0);
    c.copy_moves = 1;
    return tu_open_cfg(&c);
}

/* A sequence of n_blocks full blocks, tokens from base, KV written. */
static kvh_seq make_seq(kvh_engine *e, uint32_t n_blocks, int32_t base, uint64_t tag)
{
    kvh_seq s = tu_seq_new(e, 0);
    int32_t t[8 * BT];
    assert_true(n_blocks <= 8);
    tu_iota(t, n_blocks * BT, base);
    assert_ok(kvh_seq_append(e, s, t, n_blocks * BT));
    tu_write_pattern(e, s, L, TOK, tag, 0, n_blocks * BT);
    return s;
}

/* ---- the move-state table ---- */

static const char *const state_name[KVHI_MS_COUNT + 1] = {"IDLE",    "MOVING",         "DEMOTING", "RECALLED",
                                                          "COPYING", "COPYING_MOVING", "(illegal)"};
static const char *const event_name[KVHI_EV_COUNT] = {"MOVE_BEGIN", "MOVE_END",   "RECALLABLE",
                                                      "RECALL",     "COPY_BEGIN", "COPY_END"};

static void test_move_state_table(void **state)
{
    (void)state;
    enum kvhi_move_state want[KVHI_MS_COUNT][KVHI_EV_COUNT];
    for (int s = 0; s < KVHI_MS_COUNT; s++)
        for (int ev = 0; ev < KVHI_EV_COUNT; ev++)
            want[s][ev] = KVHI_MS_COUNT;
    /* The diagram of core/block_state.h, edge by edge. */
    want[KVHI_MS_IDLE][KVHI_EV_MOVE_BEGIN] = KVHI_MS_MOVING;
    want[KVHI_MS_IDLE][KVHI_EV_COPY_BEGIN] = KVHI_MS_COPYING;
    want[KVHI_MS_MOVING][KVHI_EV_MOVE_END] = KVHI_MS_IDLE;
    want[KVHI_MS_MOVING][KVHI_EV_RECALLABLE] = KVHI_MS_DEMOTING;
    want[KVHI_MS_DEMOTING][KVHI_EV_MOVE_END] = KVHI_MS_IDLE;
    want[KVHI_MS_DEMOTING][KVHI_EV_RECALL] = KVHI_MS_RECALLED;
    want[KVHI_MS_RECALLED][KVHI_EV_MOVE_END] = KVHI_MS_IDLE;
    want[KVHI_MS_COPYING][KVHI_EV_MOVE_BEGIN] = KVHI_MS_COPYING_MOVING;
    want[KVHI_MS_COPYING][KVHI_EV_COPY_END] = KVHI_MS_IDLE;
    want[KVHI_MS_COPYING_MOVING][KVHI_EV_MOVE_END] = KVHI_MS_COPYING;
    want[KVHI_MS_COPYING_MOVING][KVHI_EV_COPY_END] = KVHI_MS_MOVING;
    int wrong = 0;
    for (int s = 0; s < KVHI_MS_COUNT; s++)
        for (int ev = 0; ev < KVHI_EV_COUNT; ev++) {
            enum kvhi_move_state got = kvhi_move_next((enum kvhi_move_state)s, (enum kvhi_move_event)ev);
            if (got != want[s][ev]) {
                print_error("kvhi_move_next(%s, %s) = %s, expected %s\n", state_name[s], event_name[ev],
                            got <= KVHI_MS_COUNT ? state_name[got] : "(out of range)", state_name[want[s][ev]]);
                wrong++;
            }
        }
    assert_int_equal(wrong, 0);

    /* What each state means to the rest of the engine. */
    static const struct {
        enum kvhi_move_state s;
        bool in_flight, copying;
    } means[] = {{KVHI_MS_IDLE, false, false},    {KVHI_MS_MOVING, true, false},  {KVHI_MS_DEMOTING, true, false},
                 {KVHI_MS_RECALLED, true, false}, {KVHI_MS_COPYING, false, true}, {KVHI_MS_COPYING_MOVING, true, true}};
    assert_int_equal(sizeof(means) / sizeof(means[0]), KVHI_MS_COUNT);
    /* Every lasting flag set, so that a transition touching one shows. */
    const uint16_t lasting = (uint16_t)(~KVHI_BF_MOVE_MASK & 0xFFFFu);
    for (size_t i = 0; i < sizeof(means) / sizeof(means[0]); i++) {
        kvhi_block b;
        memset(&b, 0, sizeof(b));
        b.flags = (uint16_t)(lasting | ((unsigned)means[i].s << KVHI_BF_MOVE_SHIFT));
        assert_int_equal(kvhi_move_state(&b), means[i].s);
        assert_int_equal(kvhi_block_in_flight(&b), means[i].in_flight);
        assert_int_equal(kvhi_block_copying(&b), means[i].copying);
        assert_int_equal(kvhi_block_busy(&b), means[i].s != KVHI_MS_IDLE);
        /* Each legal event moves the field and nothing else. */
        for (int ev = 0; ev < KVHI_EV_COUNT; ev++) {
            if (want[means[i].s][ev] == KVHI_MS_COUNT)
                continue;
            kvhi_block c = b;
            kvhi_block_move_event(&c, (enum kvhi_move_event)ev);
            assert_int_equal(kvhi_move_state(&c), want[means[i].s][ev]);
            assert_int_equal(c.flags & lasting, lasting);
        }
    }
    /* The documented paths, walked on one block whose other flags are clear. */
    static const enum kvhi_move_event demote_recalled[] = {KVHI_EV_MOVE_BEGIN, KVHI_EV_RECALLABLE, KVHI_EV_RECALL,
                                                           KVHI_EV_MOVE_END};
    static const enum kvhi_move_event promote_while_copying[] = {KVHI_EV_COPY_BEGIN, KVHI_EV_MOVE_BEGIN,
                                                                 KVHI_EV_COPY_END, KVHI_EV_MOVE_END};
    static const enum kvhi_move_event copy_outlasts_move[] = {KVHI_EV_COPY_BEGIN, KVHI_EV_MOVE_BEGIN, KVHI_EV_MOVE_END,
                                                              KVHI_EV_COPY_END};
    const enum kvhi_move_event *paths[] = {demote_recalled, promote_while_copying, copy_outlasts_move};
    for (int p = 0; p < 3; p++) {
        kvhi_block b;
        memset(&b, 0, sizeof(b));
        b.flags = KVHI_BF_LIVE;
        for (int k = 0; k < 4; k++) {
            kvhi_block_move_event(&b, paths[p][k]);
            assert_true(kvhi_block_busy(&b) == (k < 3));
        }
        assert_int_equal(b.flags, KVHI_BF_LIVE);
    }
}

/* ---- references ---- */

static void test_last_reference(void **state)
{
    (void)state;
    kvh_engine *e = open_engine(8, 8);
    kvh_seq s = make_seq(e, 1, 100, 1);
    kvh_block h = tu_seq_block(e, s, 0);
    uint32_t b = wb_block_index(e, h);
    kvh_seq f;
    assert_ok(kvh_seq_fork(e, s, 0, &f));
    assert_int_equal(tu_binfo(e, h).refs, 2);
    wb_lock(e);
    kvhi_block *blk = kvhi_blk(e, b);
    assert_true(blk->flags & KVHI_BF_PUBLISHED);
    assert_int_equal(kvhi_prefix_find(&e->prefix, blk->hash), b);
    kvhi_lruk_key referenced = kvhi_block_current_key(e, b);
    wb_unlock(e);
    assert_ok(kvh_seq_free(e, f));
    assert_ok(kvh_seq_free(e, s));
    kvh_stats s1 = tu_stats(e);
    /* Cached: still live, indexed, evictable, and now sorting below every
     * referenced block (class bit clear). */
    wb_lock(e);
    assert_int_equal(blk->refs, 0);
    assert_true(blk->flags & KVHI_BF_LIVE);
    assert_int_equal(kvhi_prefix_find(&e->prefix, blk->hash), b);
    assert_true(blk->heap_pos != KVHI_HEAP_NONE);
    kvhi_lruk_key cached = kvhi_block_current_key(e, b);
    assert_true(referenced.primary >> 63);
    assert_false(cached.primary >> 63);
    assert_true(kvhi_lruk_less(&cached, &referenced));
    wb_unlock(e);
    assert_int_equal(tu_tier(e, KVH_TIER_DEVICE).used_blocks, 1);
    assert_int_equal(s1.blocks_freed, 0);

    /* An unpublished block (partial) is freed with its last reference. */
    kvh_seq p = tu_seq_new(e, 0);
    int32_t t[2] = {7, 8};
    assert_ok(kvh_seq_append(e, p, t, 2));
    kvh_block ph = tu_seq_block(e, p, 0);
    uint32_t pb = wb_block_index(e, ph);
    wb_lock(e);
    uint32_t gen = kvhi_blk(e, pb)->gen;
    wb_unlock(e);
    assert_ok(kvh_seq_free(e, p));
    kvh_stats s2 = tu_stats(e);
    assert_int_equal(s2.blocks_freed - s1.blocks_freed, 1);
    assert_int_equal(tu_tier(e, KVH_TIER_DEVICE).used_blocks, 1);
    wb_lock(e);
    assert_int_equal(kvhi_blk(e, pb)->flags, 0);
    assert_true(kvhi_blk(e, pb)->gen != gen); /* its handles are stale */
    wb_unlock(e);
    kvh_block_info bi;
    memset(&bi, 0, sizeof(bi));
    bi.struct_size = sizeof(bi);
    assert_kvh(KVH_ERR_BAD_HANDLE, kvh_block_info_get(e, ph, &bi));
}

/* ---- lazy entry into the victim order ---- */

/* A new block joins its tier's order pending (no key yet) and leaves it
 * in O(1) when freed unchosen; the first victim choice keys it, and the
 * victim is the block with the oldest history. A release of a forged
 * handle whose index lies past the records fails cleanly (its record is
 * prefetched before the lock only within bounds). */
static void test_new_blocks_enter_the_order_pending(void **state)
{
    (void)state;
    kvh_engine *e = open_engine(4, 8);
    kvh_block h[4];
    uint32_t idx[4];
    for (int i = 0; i < 4; i++) {
        assert_ok(kvh_block_alloc(e, 0, &h[i]));
        idx[i] = wb_block_index(e, h[i]); /* takes the lock itself */
    }
    wb_lock(e);
    kvhi_lruk_heap *dev = &e->tiers[KVH_TIER_DEVICE].heap;
    for (int i = 0; i < 4; i++) {
        kvhi_block *blk = kvhi_blk(e, idx[i]);
        assert_true(blk->heap_pos != KVHI_HEAP_NONE && (blk->heap_pos & KVHI_LRUK_PENDING));
    }
    assert_int_equal(dev->p_live, 4);
    assert_int_equal(dev->size + dev->q_live, 0);
    wb_unlock(e);

    /* Freed unchosen: out of the ring, no key ever made. */
    assert_ok(kvh_block_release(e, h[3]));
    wb_lock(e);
    assert_int_equal(kvhi_blk(e, idx[3])->heap_pos, KVHI_HEAP_NONE);
    assert_int_equal(dev->p_live, 3);
    /* The ring itself is not written: its entry stays, stale. */
    assert_int_equal(dev->p_len, 4);
    assert_int_equal(dev->pending[3], idx[3]);
    assert_false(kvhi_lruk_pending_live(dev, 3, idx[3]));
    wb_unlock(e);

    /* A fifth block in a full tier: the choice keys the pending three and
     * takes the oldest (h[0]) down to the host tier. */
    kvh_block h4, h5;
    assert_ok(kvh_block_alloc(e, 0, &h4));
    assert_ok(kvh_block_alloc(e, 0, &h5));
    assert_int_equal(tu_binfo(e, h[0]).tier, KVH_TIER_HOST);
    assert_int_equal(tu_binfo(e, h[1]).tier, KVH_TIER_DEVICE);
    wb_lock(e);
    assert_int_equal(kvhi_lruk_count(dev), 4);
    kvhi_block *b1 = kvhi_blk(e, idx[1]);
    assert_false(b1->heap_pos & KVHI_LRUK_PENDING); /* keyed by the choice */
    wb_unlock(e);

    /* Forged indices, in range and far past the records: refused, and
     * nothing changes. */
    kvh_stats before = tu_stats(e);
    uint64_t tag = (uint64_t)KVHI_TAG_BLOCK << KVHI_HANDLE_TAG_SHIFT;
    uint64_t forged[] = {tag | 0x3, tag | ((1ull << e->block_index_bits) - 1), tag | KVHI_HANDLE_PAYLOAD_MASK,
                         h[1].id ^ (1ull << 40), ~0ull};
    for (size_t i = 0; i < sizeof(forged) / sizeof(forged[0]); i++)
        assert_kvh(KVH_ERR_BAD_HANDLE, kvh_block_release(e, (kvh_block){forged[i]}));
    kvh_stats after = tu_stats(e);
    assert_int_equal(after.blocks_freed, before.blocks_freed);
    for (int i = 0; i < 3; i++)
        assert_ok(kvh_block_release(e, h[i]));
    assert_ok(kvh_block_release(e, h4));
    assert_ok(kvh_block_release(e, h5));
    assert_int_equal(tu_tier(e, KVH_TIER_DEVICE).used_blocks, 0);
    assert_int_equal(tu_tier(e, KVH_TIER_HOST).used_blocks, 0);
}

/* ---- kvh_block_release's backlog (core/block.h) ---- */

/* Under the lock as the engine's own threads take it: the backlog stays. */

/* A release the key vouches for returns at once and leaves its record as
 * it was; the next call of any other kind sees it done. */
static void test_release_waits_in_the_backlog(void **state)
{
    (void)state;
    kvh_engine *e = open_engine(8, 0);
    kvh_block a, b;
    assert_ok(kvh_block_alloc(e, 0, &a));
    assert_ok(kvh_block_alloc(e, 0, &b)); /* a is no longer the newest */
    uint32_t ia = wb_block_index(e, a);
    kvh_stats before = tu_stats(e);
    assert_ok(kvh_block_release(e, a));
    wb_lock_as_is(e);
    assert_int_equal(e->release_backlog_len, 1);
    assert_int_equal(e->release_backlog[e->release_backlog_head], a.id);
    assert_true(kvhi_blk(e, ia)->flags & KVHI_BF_LIVE); /* not yet touched */
    assert_int_equal(kvhi_blk(e, ia)->ext_refs, 1);
    assert_int_equal(e->block_release_keys[ia] >> KVHI_RELEASE_COUNT_SHIFT, 0);
    wb_unlock(e);
    /* Any other call applies it before its own work. */
    kvh_stats after = tu_stats(e);
    assert_int_equal(after.blocks_freed, before.blocks_freed + 1);
    wb_lock_as_is(e);
    assert_int_equal(e->release_backlog_len, 0);
    assert_false(kvhi_blk(e, ia)->flags & KVHI_BF_LIVE);
    assert_int_equal(e->block_release_keys[ia], 0);
    wb_unlock(e);
    /* The newest block's release is applied at once (its record is hot). */
    assert_ok(kvh_block_release(e, b));
    wb_lock_as_is(e);
    assert_int_equal(e->release_backlog_len, 0);
    wb_unlock(e);
    assert_int_equal(tu_tier(e, KVH_TIER_DEVICE).used_blocks, 0);
}

/* The backlog holds at most KVHI_RELEASE_BACKLOG releases: a longer run of
 * them applies the oldest as it goes, in the order they were made. */
static void test_release_backlog_is_bounded(void **state)
{
    (void)state;
    enum { N = KVHI_RELEASE_BACKLOG + 5 };
    kvh_engine *e = open_engine(N + 1, 0);
    kvh_block h[N + 1];
    uint32_t idx[N + 1];
    for (int i = 0; i <= N; i++) {
        assert_ok(kvh_block_alloc(e, 0, &h[i]));
        idx[i] = wb_block_index(e, h[i]);
    }
    for (int i = 0; i < N; i++)
        assert_ok(kvh_block_release(e, h[i]));
    wb_lock_as_is(e);
    assert_int_equal(e->release_backlog_len, KVHI_RELEASE_BACKLOG);
    for (int i = 0; i < N; i++) {
        bool applied = i < N - (int)KVHI_RELEASE_BACKLOG;
        assert_int_equal((kvhi_blk(e, idx[i])->flags & KVHI_BF_LIVE) == 0, applied);
    }
    wb_unlock(e);
    assert_int_equal(tu_tier(e, KVH_TIER_DEVICE).used_blocks, 1);
    assert_ok(kvh_block_release(e, h[N]));
}

/* What the key does not vouch for goes to the record, after the backlog:
 * a double release is a stale handle, a forged one is refused and leaves
 * the backlog's releases standing, a release past the handle references
 * is refused while a sequence still holds the block, and retains beyond
 * what a key's count can hold are all released, no more. */
static void test_release_errors_through_the_backlog(void **state)
{
    (void)state;
    kvh_engine *e = open_engine(8, 0);
    kvh_block a, b, newest;
    assert_ok(kvh_block_alloc(e, 0, &a));
    assert_ok(kvh_block_alloc(e, 0, &b));
    assert_ok(kvh_block_alloc(e, 0, &newest));
    assert_ok(kvh_block_release(e, a));
    assert_kvh(KVH_ERR_BAD_HANDLE, kvh_block_release(e, a));
    /* B's generation with the index of a record never handed out, b's
     * index with another generation, b under another tag: none is taken
     * on trust. */
    uint64_t index_mask = (1ull << e->block_index_bits) - 1;
    uint64_t forged[] = {(b.id & ~index_mask) | ((e->block_cap - 1) & index_mask), b.id ^ (1ull << 40),
                         (b.id & KVHI_HANDLE_PAYLOAD_MASK) | (uint64_t)KVHI_TAG_SEQ << KVHI_HANDLE_TAG_SHIFT};
    assert_ok(kvh_block_release(e, b));
    for (size_t i = 0; i < sizeof(forged) / sizeof(forged[0]); i++)
        assert_kvh(KVH_ERR_BAD_HANDLE, kvh_block_release(e, (kvh_block){forged[i]}));
    assert_kvh(KVH_ERR_BAD_HANDLE, kvh_block_release(e, b));

    /* More retains than a key counts (KVHI_RELEASE_COUNT_MAX). */
    enum { RETAINS = KVHI_RELEASE_COUNT_MAX + 20 };
    kvh_block c;
    assert_ok(kvh_block_alloc(e, 0, &c));
    for (int i = 0; i < RETAINS; i++)
        assert_ok(kvh_block_retain(e, c));
    assert_ok(kvh_block_alloc(e, 0, &newest)); /* c is no longer the newest */
    for (int i = 0; i <= RETAINS; i++)
        assert_ok(kvh_block_release(e, c));
    assert_kvh(KVH_ERR_BAD_HANDLE, kvh_block_release(e, c));

    /* A sequence's block, retained once through its handle. */
    kvh_seq s = make_seq(e, 1, 0, 1);
    kvh_block sb = {0};
    assert_ok(kvh_seq_blocks(e, s, 0, 1, &sb));
    assert_kvh(KVH_ERR_INVALID_ARG, kvh_block_release(e, sb)); /* no handle reference */
    assert_ok(kvh_block_retain(e, sb));
    assert_ok(kvh_block_alloc(e, 0, &newest));
    assert_ok(kvh_block_release(e, sb));
    assert_kvh(KVH_ERR_INVALID_ARG, kvh_block_release(e, sb));
    kvh_block_info bi = {.struct_size = sizeof(bi)};
    assert_ok(kvh_block_info_get(e, sb, &bi));
    assert_int_equal(bi.refs, 1); /* the sequence's */
    assert_ok(kvh_seq_free(e, s));
}

/* A key holds the record's reuse count, not its handle: a handle whose
 * generation agrees with it in the key's 30 bits but not above (a forged
 * one, or one of the generations a reuse count of 2^30 more would give)
 * is not taken on trust, and is refused. */
static void test_release_key_does_not_alias_generations(void **state)
{
    (void)state;
    kvh_engine *e = open_engine(8, 0);
    kvh_block a, newest;
    assert_ok(kvh_block_alloc(e, 0, &a));
    assert_ok(kvh_block_alloc(e, 0, &newest)); /* a is no longer the newest */
    uint32_t ia = wb_block_index(e, a);
    unsigned gen_bits = KVHI_HANDLE_TAG_SHIFT - e->block_index_bits;
    assert_true(gen_bits > KVHI_RELEASE_COUNT_SHIFT); /* there are bits above the key's */
    wb_lock_as_is(e);
    assert_int_equal(e->block_release_keys[ia] >> KVHI_RELEASE_COUNT_SHIFT, 1);
    wb_unlock(e);
    for (unsigned bit = KVHI_RELEASE_COUNT_SHIFT; bit < gen_bits; bit += 3) {
        kvh_block alias = {a.id ^ (1ull << (e->block_index_bits + bit))};
        assert_kvh(KVH_ERR_BAD_HANDLE, kvh_block_release(e, alias));
    }
    /* Nothing was taken: a's one reference is still there to release. */
    wb_lock_as_is(e);
    assert_int_equal(e->release_backlog_len, 0);
    assert_int_equal(kvhi_blk(e, ia)->ext_refs, 1);
    wb_unlock(e);
    assert_ok(kvh_block_release(e, a));
    assert_kvh(KVH_ERR_BAD_HANDLE, kvh_block_release(e, a));
    assert_ok(kvh_block_release(e, newest));
}

/* Records reused 2^30 times or more get no key: their releases are checked
 * in full, and still succeed once per reference and refuse stale handles.
 * One reuse short of that, the key still vouches. */
static void test_release_of_a_much_reused_record(void **state)
{
    (void)state;
    kvh_engine *e = open_engine(8, 0);
    const uint64_t limit = 1ull << KVHI_RELEASE_COUNT_SHIFT;
    const uint64_t reuses[2] = {limit - 1, limit + 7};
    for (int i = 0; i < 2; i++) {
        /* Every free record jumps to that many reuses past gen_start. */
        uint64_t gen = e->gen_start + reuses[i];
        wb_lock_as_is(e);
        for (uint32_t f = 0; f < e->block_free_top; f++) {
            kvhi_block *blk = kvhi_blk(e, e->block_free[f]);
            blk->gen = (uint32_t)gen;
            blk->gen_hi = (uint32_t)(gen >> 32);
        }
        wb_unlock(e);
        kvh_block a, newest;
        assert_ok(kvh_block_alloc(e, 0, &a));
        assert_ok(kvh_block_retain(e, a));
        assert_ok(kvh_block_alloc(e, 0, &newest));
        uint32_t ia = wb_block_index(e, a);
        wb_lock_as_is(e);
        uint32_t key = e->block_release_keys[ia];
        wb_unlock(e);
        if (reuses[i] < limit) {
            assert_int_equal(key, 2u << KVHI_RELEASE_COUNT_SHIFT | (uint32_t)reuses[i]);
        } else {
            assert_int_equal(key, 0);
        }
        /* The handle of the generation before, and the one the key's bits
         * alone would name. */
        kvh_block stale = {a.id - (1ull << e->block_index_bits)};
        kvh_block aliased = {a.id - (limit << e->block_index_bits)};
        assert_kvh(KVH_ERR_BAD_HANDLE, kvh_block_release(e, stale));
        assert_kvh(KVH_ERR_BAD_HANDLE, kvh_block_release(e, aliased));
        assert_ok(kvh_block_release(e, a));
        wb_lock_as_is(e);
        assert_int_equal(e->release_backlog_len, reuses[i] < limit ? 1 : 0); /* taken on trust or not */
        wb_unlock(e);
        assert_ok(kvh_block_release(e, a));
        assert_kvh(KVH_ERR_BAD_HANDLE, kvh_block_release(e, a));
        assert_ok(kvh_block_release(e, newest));
        assert_int_equal(tu_tier(e, KVH_TIER_DEVICE).used_blocks, 0);
    }
}

/* Releases from several threads, some waiting in the backlog while the
 * others allocate and read: every block is freed once, every double
 * release refused. */
enum { MT_THREADS = 3, MT_BLOCKS = 24, MT_ROUNDS = 200 };

typedef struct {
    kvh_engine *e;
    unsigned seed;
    int failures;
} release_worker;

static void *release_thread(void *arg)
{
    release_worker *w = arg;
    kvh_block h[MT_BLOCKS];
    for (int r = 0; r < MT_ROUNDS; r++) {
        int n = 0;
        for (; n < MT_BLOCKS; n++)
            if (kvh_block_alloc(w->e, 0, &h[n]) != KVH_OK) {
                w->failures++;
                break;
            }
        for (int i = n - 1; i > 0; i--) { /* release in a random order */
            int j = (int)(rand_r(&w->seed) % (unsigned)(i + 1));
            kvh_block t = h[i];
            h[i] = h[j];
            h[j] = t;
        }
        for (int i = 0; i < n; i++) {
            if (kvh_block_release(w->e, h[i]) != KVH_OK)
                w->failures++;
            if (i % 7 == 0 && kvh_block_release(w->e, h[i]) != KVH_ERR_BAD_HANDLE)
                w->failures++;
            kvh_block_info bi = {.struct_size = sizeof(bi)};
            if (i + 1 < n && kvh_block_info_get(w->e, h[i + 1], &bi) != KVH_OK)
                w->failures++;
        }
    }
    return NULL;
}

static void test_releases_from_threads(void **state)
{
    (void)state;
    kvh_engine *e = open_engine(MT_THREADS * MT_BLOCKS, 0);
    kvh_stats before = tu_stats(e);
    pthread_t t[MT_THREADS];
    release_worker w[MT_THREADS];
    for (int i = 0; i < MT_THREADS; i++) {
        w[i] = (release_worker){.e = e, .seed = 1234u + (unsigned)i};
        assert_int_equal(pthread_create(&t[i], NULL, release_thread, &w[i]), 0);
    }
    for (int i = 0; i < MT_THREADS; i++) {
        assert_int_equal(pthread_join(t[i], NULL), 0);
        assert_int_equal(w[i].failures, 0);
    }
    kvh_stats after = tu_stats(e);
    uint64_t made = (uint64_t)MT_THREADS * MT_BLOCKS * MT_ROUNDS;
    assert_int_equal(after.blocks_allocated - before.blocks_allocated, made);
    assert_int_equal(after.blocks_freed - before.blocks_freed, made);
    assert_int_equal(tu_tier(e, KVH_TIER_DEVICE).used_blocks, 0);
}

/* ---- holds and DEAD blocks ---- */

static void test_holds_and_dead_blocks(void **state)
{
    (void)state;
    kvh_engine *e = open_engine(8, 8);
    kvh_block h;
    assert_ok(kvh_block_alloc(e, 0, &h));
    uint32_t b = wb_block_index(e, h);
    wb_lock(e);
    kvhi_block *blk = kvhi_blk(e, b);
    assert_true(blk->heap_pos != KVHI_HEAP_NONE);
    kvhi_block_hold(e, b);
    kvhi_block_hold(e, b);
    assert_int_equal(blk->holds, 2);
    assert_int_equal(blk->heap_pos, KVHI_HEAP_NONE); /* never a victim */
    kvhi_block_unhold(e, b);
    assert_int_equal(blk->heap_pos, KVHI_HEAP_NONE); /* one hold left */
    kvhi_block_unhold(e, b);
    assert_true(blk->heap_pos != KVHI_HEAP_NONE);

    /* Freed while held: DEAD, slot kept, reaped by the last unhold. */
    uint32_t used0 = kvhi_slot_pool_used(&e->tiers[KVH_TIER_DEVICE].slots);
    uint64_t freed0 = e->stats.blocks_freed;
    kvhi_block_hold(e, b);
    kvhi_block_free_now(e, b);
    assert_true(blk->flags & KVHI_BF_DEAD);
    assert_true(blk->flags & KVHI_BF_LIVE);
    assert_int_equal(kvhi_slot_pool_used(&e->tiers[KVH_TIER_DEVICE].slots), used0);
    assert_int_equal(e->stats.blocks_freed, freed0);
    uint32_t out = 0;
    assert_kvh(KVH_ERR_BAD_HANDLE, kvhi_block_resolve(e, h, &out));
    kvhi_block_unhold(e, b);
    assert_int_equal(blk->flags, 0);
    assert_int_equal(kvhi_slot_pool_used(&e->tiers[KVH_TIER_DEVICE].slots), used0 - 1);
    assert_int_equal(e->stats.blocks_freed, freed0 + 1);
    wb_unlock(e);

    /* A cached (published, unreferenced) block freed while a disk copy is
     * read from its slot: out of the prefix index at once, destroyed by
     * the mover's free once the copy ends; the slot it left meanwhile is
     * freed with the copy. */
    kvh_seq s = make_seq(e, 1, 200, 2);
    b = wb_block_index(e, tu_seq_block(e, s, 0));
    assert_ok(kvh_seq_free(e, s));
    wb_lock(e);
    blk = kvhi_blk(e, b);
    uint64_t hash = blk->hash;
    assert_int_equal(blk->refs, 0);
    assert_int_equal(kvhi_prefix_find(&e->prefix, hash), b);
    kvhi_block_move_event(blk, KVHI_EV_COPY_BEGIN);
    kvhi_block_update_evictable(e, b);
    assert_int_equal(blk->heap_pos, KVHI_HEAP_NONE);
    uint32_t left = 0;
    assert_ok(kvhi_reserve_slot(e, KVH_TIER_HOST, 0, &left));
    blk->deferred_slot = left;
    blk->deferred_tier = KVH_TIER_HOST;
    uint32_t host_used = kvhi_slot_pool_used(&e->tiers[KVH_TIER_HOST].slots);
    freed0 = e->stats.blocks_freed;
    kvhi_block_free_now(e, b);
    assert_true(blk->flags & KVHI_BF_DEAD);
    assert_false(blk->flags & KVHI_BF_PUBLISHED);
    assert_int_equal(kvhi_prefix_find(&e->prefix, hash), KVHI_PREFIX_MISS);
    assert_int_equal(e->stats.blocks_freed, freed0);
    kvhi_block_writing_done(e, b);
    assert_int_equal(kvhi_move_state(blk), KVHI_MS_IDLE);
    assert_int_equal(blk->deferred_slot, KVHI_NO_BLOCK);
    assert_int_equal(kvhi_slot_pool_used(&e->tiers[KVH_TIER_HOST].slots), host_used - 1);
    assert_true(blk->flags & KVHI_BF_DEAD); /* the mover reaps it: */
    kvhi_block_free_now(e, b);
    assert_int_equal(blk->flags, 0);
    assert_int_equal(e->stats.blocks_freed, freed0 + 1);
    wb_unlock(e);
    assert_int_equal(tu_tier(e, KVH_TIER_DEVICE).used_blocks, 0);
    assert_int_equal(tu_tier(e, KVH_TIER_HOST).used_blocks, 0);
}

/* ---- pins ---- */

static void test_pin_follows_a_moving_block(void **state)
{
    (void)state;
    kvh_engine *e = open_engine(4, 4);
    kvh_seq s = make_seq(e, 1, 300, 3);
    kvh_block h = tu_seq_block(e, s, 0);
    uint32_t b = wb_block_index(e, h);
    wb_lock(e);
    kvhi_xfer x;
    assert_int_equal(kvhi_move_begin(e, b, KVH_TIER_HOST, &x, false), 0);
    kvhi_block_pin(e, b, true); /* lands while the copy runs */
    assert_int_equal(e->tiers[KVH_TIER_DEVICE].pinned, 1);
    kvhi_unlock_for_copy(e);
    kvhi_xfer_run(e, &x);
    kvhi_relock_after_copy(e);
    assert_int_equal(x.err, 0);
    assert_ok(kvhi_move_end(e, &x, NULL));
    assert_int_equal(kvhi_blk(e, b)->tier, KVH_TIER_HOST);
    assert_int_equal(kvhi_blk(e, b)->heap_pos, KVHI_HEAP_NONE);
    wb_unlock(e);
    assert_int_equal(tu_tier(e, KVH_TIER_DEVICE).pinned_blocks, 0);
    assert_int_equal(tu_tier(e, KVH_TIER_HOST).pinned_blocks, 1);
    assert_ok(kvh_block_pin(e, h, 1)); /* nests */
    assert_int_equal(tu_binfo(e, h).pins, 2);
    assert_int_equal(tu_tier(e, KVH_TIER_HOST).pinned_blocks, 1);
    wb_lock(e);
    kvhi_block_pin(e, b, false);
    kvhi_block_pin(e, b, false);
    kvhi_block_pin(e, b, false); /* no pin left: ignored */
    assert_int_equal(kvhi_blk(e, b)->pins, 0);
    assert_true(kvhi_blk(e, b)->heap_pos != KVHI_HEAP_NONE);
    wb_unlock(e);
    assert_int_equal(tu_tier(e, KVH_TIER_HOST).pinned_blocks, 0);
    assert_true(tu_check_pattern(e, s, L, TOK, 3, 0, BT));
}

/* ---- publication and the prefix index ---- */

static void write_layer(kvh_engine *e, kvh_seq s, uint32_t layer, uint64_t pos, size_t n, uint64_t tag)
{
    uint8_t k[BT * 16], v[BT * 16];
    assert_true(n <= BT);
    for (size_t t = 0; t < n; t++) {
        tu_pattern(k + t * TOK, TOK, tag, layer, pos + t, 0);
        tu_pattern(v + t * TOK, TOK, tag, layer, pos + t, 1);
    }
    assert_ok(kvh_seq_write_kv(e, s, layer, pos, n, k, v));
}

static void test_publication(void **state)
{
    (void)state;
    kvh_engine *e = open_engine(8, 8);
    int32_t t[BT];
    tu_iota(t, BT, 400);
    kvh_seq a = tu_seq_new(e, 0);
    assert_ok(kvh_seq_append(e, a, t, BT)); /* full: hashed, nothing written */
    uint32_t b = wb_block_index(e, tu_seq_block(e, a, 0));
    kvhi_block *blk = kvhi_blk(e, b);
    wb_lock(e);
    uint64_t hash = blk->hash;
    assert_true(blk->flags & KVHI_BF_HASHED);
    assert_false(blk->flags & (KVHI_BF_KV_COMPLETE | KVHI_BF_PUBLISHED));
    wb_unlock(e);
    /* Layer by layer, the last one in two pieces. */
    write_layer(e, a, 0, 0, BT, 4);
    write_layer(e, a, 2, 0, BT, 4);
    write_layer(e, a, 1, 0, 2, 4);
    wb_lock(e);
    for (uint32_t l = 0; l < L; l++)
        for (uint32_t k = 0; k < BT; k++)
            assert_int_equal(kvhi_block_cell_written(e, b, l, k), l != 1 || k < 2);
    assert_false(blk->flags & (KVHI_BF_KV_COMPLETE | KVHI_BF_PUBLISHED));
    assert_int_equal(kvhi_prefix_find(&e->prefix, hash), KVHI_PREFIX_MISS);
    wb_unlock(e);
    write_layer(e, a, 1, 2, BT - 2, 4);
    wb_lock(e);
    assert_true(blk->flags & KVHI_BF_KV_COMPLETE);
    assert_true(blk->flags & KVHI_BF_PUBLISHED);
    assert_null(blk->written); /* complete: the bitmap is gone */
    assert_int_equal(kvhi_prefix_find(&e->prefix, hash), b);
    wb_unlock(e);

    /* An equal block made later: complete, same hash, not published. */
    kvh_seq c = tu_seq_new(e, 0);
    assert_ok(kvh_seq_append(e, c, t, BT));
    tu_write_pattern(e, c, L, TOK, 4, 0, BT);
    uint32_t b2 = wb_block_index(e, tu_seq_block(e, c, 0));
    kvhi_block *blk2 = kvhi_blk(e, b2);
    wb_lock(e);
    assert_true(b2 != b);
    assert_int_equal(blk2->hash, hash);
    assert_true(blk2->flags & KVHI_BF_KV_COMPLETE);
    assert_false(blk2->flags & KVHI_BF_PUBLISHED);
    assert_int_equal(kvhi_prefix_find(&e->prefix, hash), b);
    kvhi_block_try_publish(e, b2); /* still taken */
    assert_false(blk2->flags & KVHI_BF_PUBLISHED);
    wb_unlock(e);
    /* The first one goes (its sequence is freed and it is dropped): the
     * entry is erased, and the twin can take it. */
    assert_ok(kvh_seq_free(e, a));
    wb_lock(e);
    assert_int_equal(blk->refs, 0);
    uint32_t slot = kvhi_block_drop(e, b);
    kvhi_release_slot(e, KVH_TIER_DEVICE, slot);
    assert_int_equal(kvhi_prefix_find(&e->prefix, hash), KVHI_PREFIX_MISS);
    kvhi_block_try_publish(e, b2);
    assert_true(blk2->flags & KVHI_BF_PUBLISHED);
    assert_int_equal(kvhi_prefix_find(&e->prefix, hash), b2);
    wb_unlock(e);

    /* Truncate's bookkeeping on a private, complete block (a third equal
     * one, so unpublished): keep 3 tokens of 4 in every layer, forget the
     * hash; writing the forgotten cells again completes it exactly. */
    kvh_seq p = tu_seq_new(e, 0);
    assert_ok(kvh_seq_append(e, p, t, BT));
    tu_write_pattern(e, p, L, TOK, 4, 0, BT);
    uint32_t pb = wb_block_index(e, tu_seq_block(e, p, 0));
    kvhi_block *pblk = kvhi_blk(e, pb);
    wb_lock(e);
    assert_true(pblk->flags & KVHI_BF_KV_COMPLETE);
    assert_false(pblk->flags & KVHI_BF_PUBLISHED);
    assert_ok(kvhi_block_forget_tokens(e, pb, 3));
    assert_int_equal(pblk->n_tokens, 3);
    assert_int_equal(pblk->hash, 0);
    assert_false(pblk->flags & (KVHI_BF_HASHED | KVHI_BF_KV_COMPLETE));
    for (uint32_t l = 0; l < L; l++)
        for (uint32_t k = 0; k < BT; k++)
            assert_int_equal(kvhi_block_cell_written(e, pb, l, k), k < 3);
    for (uint32_t l = 0; l + 1 < L; l++)
        assert_ok(kvhi_block_mark_written(e, pb, l, 3, BT));
    assert_false(pblk->flags & KVHI_BF_KV_COMPLETE); /* layer 2 still lacks two */
    assert_ok(kvhi_block_mark_written(e, pb, L - 1, 3, BT));
    assert_true(pblk->flags & KVHI_BF_KV_COMPLETE);
    assert_false(pblk->flags & KVHI_BF_PUBLISHED); /* not hashed: never published */
    wb_unlock(e);
    assert_ok(kvh_seq_free(e, p));
    assert_ok(kvh_seq_free(e, c));
}

/* ---- copy-on-write ---- */

static void test_cow_copy(void **state)
{
    (void)state;
    kvh_engine *e = open_engine(8, 8);
    kvh_seq s = tu_seq_new(e, 0);
    int32_t t[BT];
    tu_iota(t, BT, 600);
    assert_ok(kvh_seq_append(e, s, t, BT));
    write_layer(e, s, 0, 0, BT, 6);
    write_layer(e, s, 2, 1, 3, 6); /* tokens 1..3 of layer 2 */
    kvh_seq f;
    assert_ok(kvh_seq_fork(e, s, 5, &f)); /* a second reference */
    uint32_t b = wb_block_index(e, tu_seq_block(e, s, 0));
    kvh_stats s0 = tu_stats(e);
    wb_lock(e);
    kvhi_block *src = kvhi_blk(e, b);
    assert_int_equal(src->refs, 2);
    src->tolerance = 77;
    uint32_t nb = KVHI_NO_BLOCK;
    assert_ok(kvhi_block_cow(e, b, 5, &nb));
    kvhi_block *dst = kvhi_blk(e, nb);
    assert_true(nb != b);
    assert_int_equal(src->refs, 1); /* the copy took one of its references */
    assert_int_equal(dst->refs, 1);
    assert_int_equal(dst->agent, 5);
    assert_int_equal(dst->n_tokens, BT);
    assert_int_equal(dst->hash, src->hash);
    assert_int_equal(dst->parent_hash, src->parent_hash);
    assert_int_equal(dst->tolerance, 77);
    assert_true(dst->flags & KVHI_BF_HASHED);
    assert_false(dst->flags & (KVHI_BF_KV_COMPLETE | KVHI_BF_PUBLISHED));
    assert_memory_equal(kvhi_block_tokens(e, nb), t, sizeof(t));
    for (uint32_t l = 0; l < L; l++)
        for (uint32_t k = 0; k < BT; k++)
            assert_int_equal(kvhi_block_cell_written(e, nb, l, k), kvhi_block_cell_written(e, b, l, k));
    assert_true(dst->written != src->written); /* its own bitmap */
    assert_memory_equal(kvhi_block_data(e, nb), kvhi_block_data(e, b), e->block_bytes);
    assert_int_equal(e->stats.cow_copies - s0.cow_copies, 1);
    assert_int_equal(e->stats.blocks_allocated - s0.blocks_allocated, 1);
    /* The copy is the fork's now: put it in the fork's table. */
    kvhi_seq *fq = NULL;
    assert_ok(kvhi_seq_get(e, f, &fq));
    assert_int_equal(fq->blocks[0], b);
    fq->blocks[0] = nb;
    wb_unlock(e);
    /* Completing the copy publishes it: the source, incomplete, never
     * took the index entry. */
    write_layer(e, f, 1, 0, BT, 6);
    write_layer(e, f, 2, 0, BT, 6);
    wb_lock(e);
    assert_true(dst->flags & KVHI_BF_KV_COMPLETE);
    assert_true(dst->flags & KVHI_BF_PUBLISHED);
    assert_false(src->flags & KVHI_BF_PUBLISHED);
    wb_unlock(e);
    /* The source still reads what it had. */
    uint8_t k[BT * 16], v[BT * 16], want[16];
    assert_ok(kvh_seq_read_kv(e, s, 0, 0, BT, k, v));
    for (uint32_t p = 0; p < BT; p++) {
        tu_pattern(want, TOK, 6, 0, p, 0);
        assert_memory_equal(k + p * TOK, want, TOK);
    }
    assert_ok(kvh_seq_free(e, f));
    assert_ok(kvh_seq_free(e, s));
}

/* ---- pins and holds through the public calls: limits, ownership ---- */

/* Record index of a block handle. */
static uint32_t record_of(kvh_engine *e, kvh_block h) { return kvhi_handle_unpack_index(h.id, e->block_index_bits); }

/* A block's pin count stops at 2^32 - 1 (KVH_ERR_RANGE, nothing
 * changed); a handle's pins are the handle's (a block destroyed with some
 * leaves none behind for the record's next block); a sequence's holds
 * stop at 2^32 - 1 too, with nothing held by the refused call. The counts
 * are set near their limits directly (2^32 calls take minutes). */
static void test_pin_and_hold_limits(void **state)
{
    (void)state;
    kvh_engine *e = open_engine(8, 8);
    kvh_block h;
    assert_ok(kvh_block_alloc(e, 0, &h));
    assert_ok(kvh_block_pin(e, h, 1));
    uint32_t b = record_of(e, h);
    pthread_mutex_lock(&e->lock);
    e->blocks[b].pins = UINT32_MAX - 1;
    *kvhi_block_map_find(&e->handle_pins, b) = UINT32_MAX - 1;
    pthread_mutex_unlock(&e->lock);
    assert_ok(kvh_block_pin(e, h, 1));
    assert_kvh(KVH_ERR_RANGE, kvh_block_pin(e, h, 1));
    assert_int_equal(tu_binfo(e, h).pins, UINT32_MAX);
    assert_ok(kvh_block_pin(e, h, 0));
    pthread_mutex_lock(&e->lock);
    e->blocks[b].pins = 1;
    *kvhi_block_map_find(&e->handle_pins, b) = 1;
    pthread_mutex_unlock(&e->lock);
    /* Freed while pinned by its handle: the next block of the record has
     * no handle pin to drop. */
    assert_ok(kvh_block_release(e, h));
    kvh_block h2;
    assert_ok(kvh_block_alloc(e, 0, &h2));
    assert_int_equal(record_of(e, h2), b);
    assert_kvh(KVH_ERR_INVALID_ARG, kvh_block_pin(e, h2, 0));
    assert_int_equal(tu_binfo(e, h2).pins, 0);
    assert_ok(kvh_block_release(e, h2));
    assert_int_equal(tu_tier(e, KVH_TIER_DEVICE).pinned_blocks, 0);

    kvh_seq s = make_seq(e, 1, 0, 7);
    assert_ok(kvh_seq_acquire(e, s, 0, BT, NULL));
    kvhi_seq *is = NULL;
    pthread_mutex_lock(&e->lock);
    assert_ok(kvhi_seq_get(e, s, &is));
    is->held[0] = UINT32_MAX;
    pthread_mutex_unlock(&e->lock);
    assert_kvh(KVH_ERR_RANGE, kvh_seq_acquire(e, s, 0, BT, NULL));
    assert_int_equal(tu_seq_binfo(e, s, 0).holds, 1);
    pthread_mutex_lock(&e->lock);
    is->held[0] = 1;
    pthread_mutex_unlock(&e->lock);
    assert_ok(kvh_seq_release(e, s, 0, BT));
    assert_int_equal(tu_seq_binfo(e, s, 0).holds, 0);
    assert_ok(kvh_seq_free(e, s));
}

static int teardown(void **state)
{
    wb_release_held_lock();
    return tu_teardown(state);
}

int main(void)
{
    const struct CMUnitTest tests[] = {
        cmocka_unit_test(test_move_state_table),
        cmocka_unit_test_teardown(test_last_reference, teardown),
        cmocka_unit_test_teardown(test_new_blocks_enter_the_order_pending, teardown),
        cmocka_unit_test_teardown(test_release_waits_in_the_backlog, teardown),
        cmocka_unit_test_teardown(test_release_backlog_is_bounded, teardown),
        cmocka_unit_test_teardown(test_release_errors_through_the_backlog, teardown),
        cmocka_unit_test_teardown(test_release_key_does_not_alias_generations, teardown),
        cmocka_unit_test_teardown(test_release_of_a_much_reused_record, teardown),
        cmocka_unit_test_teardown(test_releases_from_threads, teardown),
        cmocka_unit_test_teardown(test_holds_and_dead_blocks, teardown),
        cmocka_unit_test_teardown(test_pin_follows_a_moving_block, teardown),
        cmocka_unit_test_teardown(test_publication, teardown),
        cmocka_unit_test_teardown(test_cow_copy, teardown),
        cmocka_unit_test_teardown(test_pin_and_hold_limits, teardown),
    };
    return cmocka_run_group_tests_name("block", tests, NULL, NULL);
}
