/* White-box: the eviction heaps stay exact under hints.
 *
 * Heaps take raised keys lazily (core/lruk.h): a stored key must never be
 * above the block's current key, or the victim choice would pass over it.
 * Hints raise keys (lazily) and lower them when redeemed or lapsed (at
 * once). Random operations (hint, prefetch, acquire, per-layer reads,
 * tolerance changes, frees) on small engines, with and without an agent
 * quota, under LRU-K and LCTRU, with and without a disk tier; after every
 * operation each heap (tiers and agents) is checked: stored key <= current
 * key, heap order, and every evictable block present. Inline migration
 * (no workers), so that the engine is quiescent between calls. */
#include <stdbool.h>
#include <stdio.h>
#include <stdlib.h>

#include "test_util.h"

#include "core/block_state.h"
#include "core/engine.h"
#include "core/block.h"
#include "core/tier.h"

enum { L = 2, H = 1, D = 4, BT = 4, N_SEQ = 12 };
static const size_t TOK = H * D * 4;

static int check_heap(kvh_engine *e, const kvhi_lruk_heap *h, const char *what)
{
    for (uint32_t i = 0; i < h->size; i++) {
        kvhi_lruk_key now = kvhi_block_current_key(e, h->entries[i].item);
        if (kvhi_lruk_less(&now, &h->entries[i].key)) {
            print_error("%s heap: block %u stored above its current key\n", what, h->entries[i].item);
            return 1;
        }
        if (i && kvhi_lruk_less(&h->entries[i].key, &h->entries[(i - 1) / KVHI_LRUK_ARITY].key)) {
            print_error("%s heap: order broken at %u\n", what, i);
            return 1;
        }
    }
    return 0;
}

static int check_engine(kvh_engine *e)
{
    static const char *const names[KVH_TIER_COUNT] = {"device", "host", "disk"};
    int bad = 0;
    for (uint32_t t = 0; t < KVH_TIER_COUNT; t++)
        if (e->tiers[t].present)
            bad += check_heap(e, &e->tiers[t].heap, names[t]);
    for (uint32_t a = 0; a < e->n_agents; a++)
        bad += check_heap(e, &e->agents[a].heap, "agent");
    for (uint32_t b = 0; b < e->block_cap; b++) {
        const kvhi_block *blk = &e->blocks[b];
        bool evictable = (blk->flags & KVHI_BF_LIVE) && !kvhi_block_busy(blk) && !(blk->flags & KVHI_BF_DEAD) &&
                         blk->pins == 0 && blk->holds == 0;
        if (evictable && blk->heap_pos == KVHI_HEAP_NONE) {
            print_error("block %u evictable but in no heap\n", b);
            bad++;
        }
    }
    return bad;
}

static void one_round(int round, tu_rng *r)
{
    kvh_config c = tu_cfg(L, H, D, BT, KVH_DTYPE_F32, 6, 10, 0);
    c.eviction_policy = round % 2 ? KVH_EVICT_LCTRU : KVH_EVICT_LRU_K;
    char dir[4096] = "";
    if (round % 4 >= 2) {
        const char *root = getenv("KVH_TEST_TMPDIR");
        snprintf(dir, sizeof(dir), "%s/heap-XXXXXX", root && *root ? root : "/tmp");
        assert_non_null(mkdtemp(dir));
        c.disk_path = dir;
        c.disk_bytes = 64ull * (tu_block_bytes_of(L, H, D, BT, KVH_DTYPE_F32) + 8192);
        c.disk_flags = KVH_DISK_RESET_ON_MISMATCH;
    }
    kvh_engine *e = tu_open_cfg(&c);
    if (round % 3 == 0)
        assert_ok(kvh_agent_set_quota(e, 1, 3 * tu_block_bytes(e)));
    kvh_seq s[N_SEQ];
    bool live[N_SEQ] = {false};
    float k[2 * BT * D], v[2 * BT * D];
    int done = 0, hinted_now = 0;
    for (int op = 0; op < 1500; op++) {
        int i = (int)tu_below(r, N_SEQ);
        int32_t prio = (int32_t)tu_below(r, 5) - 2;
        kvh_status st = KVH_OK;
        if (!live[i]) {
            kvh_seq q = tu_seq_new(e, (uint32_t)tu_below(r, 2));
            int32_t t[2 * BT];
            tu_iota(t, 2 * BT, (int32_t)tu_below(r, 1u << 20));
            size_t n = tu_below(r, 2) ? BT : 2 * BT;
            if (kvh_seq_append(e, q, t, n) == KVH_OK) {
                tu_write_pattern(e, q, L, TOK, (uint64_t)op, 0, n);
                s[i] = q;
                live[i] = true;
            } else {
                assert_ok(kvh_seq_free(e, q));
            }
            continue;
        }
        switch (tu_below(r, 8)) {
        case 0:
            if (tu_below(r, 3) == 0) {
                assert_ok(kvh_seq_free(e, s[i]));
                live[i] = false;
            }
            break;
        case 1:
        case 2:
            st = kvh_seq_hint(e, s[i], 0, BT, prio);
            break;
        case 3:
            st = kvh_prefetch(e, s[i], 0, BT, prio, NULL);
            break;
        case 4:
            if ((st = kvh_seq_acquire(e, s[i], 0, BT, NULL)) == KVH_OK)
                st = kvh_seq_release(e, s[i], 0, BT);
            break;
        case 5:
            st = kvh_seq_read_kv(e, s[i], (uint32_t)tu_below(r, L), 0, BT, k, v);
            break;
        case 6:
            st = kvh_seq_set_tolerance(e, s[i], 0, BT, (uint32_t)tu_below(r, KVH_TOLERANCE_MAX + 1));
            break;
        default:
            st = kvh_seq_migrate(e, s[i], 0, BT, (uint32_t)tu_below(r, c.disk_path ? 3 : 2), NULL);
            break;
        }
        /* Small tiers full of held or quota-bound blocks may refuse. */
        if (st != KVH_OK && st != KVH_ERR_NOSPACE && st != KVH_ERR_BUSY)
            fail_msg("round %d op %d: %s (%s)", round, op, kvh_status_name(st), kvh_last_error());
        if (check_engine(e))
            fail_msg("round %d op %d: heap invariant broken", round, op);
        if (st == KVH_OK)
            done++;
        hinted_now += e->hint_count > 0;
    }
    /* The run did what it is for: most operations went through, hints
     * were recorded most of the time. */
    assert_true(done > 1000);
    assert_true(hinted_now > 1000);
    tu_close(e);
}

static void test_heaps_stay_exact_under_hints(void **state)
{
    (void)state;
    tu_rng r = {tu_seed(31)};
    for (int round = 0; round < 24; round++)
        one_round(round, &r);
}

int main(void)
{
    const struct CMUnitTest tests[] = {
        cmocka_unit_test_teardown(test_heaps_stay_exact_under_hints, tu_teardown),
    };
    return cmocka_run_group_tests(tests, NULL, NULL);
}
