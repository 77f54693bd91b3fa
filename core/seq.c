/* Sequences: block tables, tokens, K/V writes with copy-on-write, prefix
 * attachment, acquire/release and prefetch. Every function is entered and
 * left with the engine lock held; those that bring blocks in from disk,
 * copy or wait drop it meanwhile, and re-read the sequence after. */
#include <stdlib.h>
#include <string.h>

#include "core/block_state.h"
#include "core/engine.h"
#include "core/host_spare.h"
#include "core/move.h"
#include "core/huge_alloc.h"
#include "core/block.h"
#include "core/migrate.h"
#include "core/seq.h"
#include "core/disk_tier.h"
#include "core/codec_tier.h"
#include "core/remote_tier.h"
#include "core/vmap.h"
#include "core/context.h"
#include "core/tier.h"

kvh_status kvhi_seq_get(kvh_engine *e, kvh_seq h, kvhi_seq **out)
{
    kvhi_seq *s = kvhi_handles_get(&e->seqs, h.id, NULL);
    if (!s)
        return kvhi_fail(KVH_ERR_BAD_HANDLE, "stale or unknown sequence handle 0x%llx", (unsigned long long)h.id);
    *out = s;
    return KVH_OK;
}

kvh_status kvhi_seq_block_range(kvh_engine *e, kvhi_seq *s, uint64_t first, uint64_t n, uint32_t *b0, uint32_t *b1)
{
    if (first > s->n_tokens || n > s->n_tokens - first)
        return kvhi_fail(KVH_ERR_RANGE, "tokens [%llu, +%llu) pass the sequence length %llu", (unsigned long long)first,
                         (unsigned long long)n, (unsigned long long)s->n_tokens);
    uint32_t bt = e->cfg.block_tokens;
    *b0 = (uint32_t)(first / bt);
    *b1 = n ? (uint32_t)((first + n + bt - 1) / bt) : *b0;
    return KVH_OK;
}

static void free_block_tables(kvhi_seq *s)
{
    kvhi_huge_free(s->blocks, sizeof(uint32_t) * (size_t)s->cap_blocks);
    kvhi_huge_free(s->held, sizeof(uint32_t) * (size_t)s->cap_blocks);
    kvhi_huge_free(s->pins, sizeof(uint32_t) * (size_t)s->cap_blocks);
    s->blocks = s->held = s->pins = NULL;
}

void kvhi_seq_tables_free(kvhi_seq *s)
{
    free_block_tables(s);
    free(s->durable_twin);
    s->durable_twin = NULL;
    s->n_durable = 0;
}

/* The block table is read at random, one entry per access: long ones get
 * huge pages (kvhi_huge_alloc), hence no realloc. */
/* The most blocks a sequence's table holds. */
#define SEQ_MAX_BLOCKS (UINT32_MAX / 2)

static kvh_status ensure_cap(kvhi_seq *s, uint64_t want)
{
    if (want <= s->cap_blocks)
        return KVH_OK;
    if (want > SEQ_MAX_BLOCKS)
        return kvhi_fail(KVH_ERR_RANGE, "sequence too long");
    uint32_t ncap = s->cap_blocks ? s->cap_blocks : 8;
    while (ncap < want)
        ncap *= 2;
    uint32_t *b = kvhi_huge_alloc(sizeof(uint32_t) * (size_t)ncap);
    uint32_t *h = kvhi_huge_alloc(sizeof(uint32_t) * (size_t)ncap);
    uint32_t *p = kvhi_huge_alloc(sizeof(uint32_t) * (size_t)ncap);
    if (!b || !h || !p) {
        kvhi_huge_free(b, sizeof(uint32_t) * (size_t)ncap);
        kvhi_huge_free(h, sizeof(uint32_t) * (size_t)ncap);
        kvhi_huge_free(p, sizeof(uint32_t) * (size_t)ncap);
        return kvhi_fail(KVH_ERR_NOMEM, "out of memory for a block table");
    }
    if (s->cap_blocks) {
        memcpy(b, s->blocks, sizeof(uint32_t) * s->cap_blocks);
        memcpy(h, s->held, sizeof(uint32_t) * s->cap_blocks);
        memcpy(p, s->pins, sizeof(uint32_t) * s->cap_blocks);
    }
    free_block_tables(s); /* not the durable twins: they stay with s */
    s->blocks = b;
    s->held = h;
    s->pins = p;
    s->cap_blocks = ncap;
    return KVH_OK;
}

kvh_status kvhi_seq_create(kvh_engine *e, uint32_t agent, kvh_seq *out)
{
    kvhi_seq *s = calloc(1, sizeof(*s));
    if (!s)
        return kvhi_fail(KVH_ERR_NOMEM, "out of memory for a sequence");
    s->agent = agent;
    if (kvhi_handles_add(&e->seqs, s, &out->id, NULL) != 0) {
        free(s);
        return kvhi_fail(KVH_ERR_NOMEM, "out of memory for a sequence");
    }
    return KVH_OK;
}

/* Gives up logical block i: the holds and pins the sequence took on it,
 * then its reference. */
static void drop_block(kvh_engine *e, kvhi_seq *s, uint32_t i)
{
    for (; s->held[i]; s->held[i]--)
        kvhi_block_unhold(e, s->blocks[i]);
    for (; s->pins[i]; s->pins[i]--)
        kvhi_block_pin(e, s->blocks[i], false);
    kvhi_block_unref(e, s->blocks[i]);
}

/* Drops the durable twins of logical blocks [from, n_durable). */
static void drop_durable_twins(kvh_engine *e, kvhi_seq *s, uint32_t from)
{
    for (uint32_t i = from; i < s->n_durable; i++)
        if (s->durable_twin[i] != KVHI_NO_BLOCK) {
            kvhi_block_unref(e, s->durable_twin[i]);
            s->durable_twin[i] = KVHI_NO_BLOCK;
        }
    if (from < s->n_durable)
        s->n_durable = from;
}

kvh_status kvhi_seq_keep_durable_twins(kvh_engine *e, kvhi_seq *s, const uint32_t *twins, uint32_t n)
{
    if (n > s->n_durable) {
        uint32_t *t = realloc(s->durable_twin, sizeof(uint32_t) * n);
        if (!t) {
            for (uint32_t i = 0; i < n; i++)
                if (twins[i] != KVHI_NO_BLOCK)
                    kvhi_block_unref(e, twins[i]);
            return kvhi_fail(KVH_ERR_NOMEM, "out of memory keeping the persisted blocks of a sequence");
        }
        for (uint32_t i = s->n_durable; i < n; i++)
            t[i] = KVHI_NO_BLOCK;
        s->durable_twin = t;
        s->n_durable = n;
    }
    for (uint32_t i = 0; i < n; i++) {
        /* One kept from an earlier persist stays: this one may have
         * failed before reaching block i. */
        if (twins[i] == KVHI_NO_BLOCK)
            continue;
        uint32_t old = s->durable_twin[i];
        s->durable_twin[i] = twins[i];
        if (old != KVHI_NO_BLOCK)
            kvhi_block_unref(e, old); /* after taking the new one: they may be the same */
    }
    return KVH_OK;
}

void kvhi_seq_destroy(kvh_engine *e, kvhi_seq *s)
{
    drop_durable_twins(e, s, 0);
    for (uint32_t i = 0; i < s->n_blocks; i++)
        drop_block(e, s, i);
    kvhi_seq_tables_free(s);
    free(s);
}

kvh_status kvhi_seq_fork(kvh_engine *e, kvhi_seq *s, uint32_t agent, kvh_seq *out)
{
    kvh_seq h;
    kvh_status st = kvhi_seq_create(e, agent, &h);
    if (st != KVH_OK)
        return st;
    kvhi_seq *c = kvhi_handles_get(&e->seqs, h.id, NULL);
    st = ensure_cap(c, s->n_blocks);
    /* The published blocks persist made durable in place of seq's own
     * are kept by the child too, while it holds its copy of those blocks:
     * a fork of a persisted sequence keeps its prefix durable. */
    if (st == KVH_OK && s->n_durable) {
        c->durable_twin = malloc(sizeof(uint32_t) * s->n_durable);
        if (!c->durable_twin)
            st = kvhi_fail(KVH_ERR_NOMEM, "out of memory forking a sequence");
    }
    if (st != KVH_OK) {
        kvhi_handles_remove(&e->seqs, kvhi_handle_index(h.id));
        kvhi_seq_destroy(e, c);
        return st;
    }
    for (uint32_t i = 0; i < s->n_blocks; i++) {
        c->blocks[i] = s->blocks[i];
        c->held[i] = 0;
        c->pins[i] = 0; /* pins stay the parent's */
        kvhi_block_ref(e, s->blocks[i]);
    }
    for (uint32_t i = 0; i < s->n_durable; i++) {
        c->durable_twin[i] = s->durable_twin[i];
        if (c->durable_twin[i] != KVHI_NO_BLOCK)
            kvhi_block_ref(e, c->durable_twin[i]);
    }
    c->n_durable = s->n_durable;
    c->n_blocks = s->n_blocks;
    c->n_tokens = s->n_tokens;
    c->scope = s->scope; /* its new blocks continue the same chains */
    *out = h;
    return KVH_OK;
}

/* b's bytes are about to change: its kept clean copies (host, disk) go. */
static void forget_clean_copies(kvh_engine *e, uint32_t b)
{
    kvhi_clean_drop(e, b);
    if (e->blocks[b].flags & KVHI_BF_DISK_COPY)
        kvhi_disk_forget(e, b);
}

/* Keeps the sequence's reference on b, a block it is replacing at logical
 * position i, as i's durable twin when b is persisted (an index record
 * names it) and i has none: kvh.h keeps a persisted prefix while a
 * sequence holds its own blocks of it, and the blocks after i stay
 * reachable only through b. False when b is not kept (not persisted, a
 * twin already there, or no memory for the table). */
static bool keep_replaced_durable(kvh_engine *e, kvhi_seq *s, uint32_t i, uint32_t b)
{
    if (!(e->blocks[b].flags & KVHI_BF_JOURNALED))
        return false;
    if (i < s->n_durable && s->durable_twin[i] != KVHI_NO_BLOCK)
        return false;
    if (i >= s->n_durable) {
        uint32_t *t = realloc(s->durable_twin, sizeof(uint32_t) * (i + 1));
        if (!t)
            return false;
        for (uint32_t k = s->n_durable; k <= i; k++)
            t[k] = KVHI_NO_BLOCK;
        s->durable_twin = t;
        s->n_durable = i + 1;
    }
    s->durable_twin[i] = b;
    return true;
}

/* Moves the holds and pins s keeps on its logical block i from block
 * from to block to. */
static void move_holds_and_pins(kvh_engine *e, const kvhi_seq *s, uint32_t i, uint32_t from, uint32_t to)
{
    for (uint32_t h = 0; h < s->held[i]; h++) {
        kvhi_block_unhold(e, from);
        kvhi_block_hold(e, to);
    }
    for (uint32_t p = 0; p < s->pins[i]; p++) {
        kvhi_block_pin(e, from, false);
        kvhi_block_pin(e, to, true);
    }
}

/* Gives the holds and pins of logical block i of s back to b from its
 * copy nb, and frees nb: a copy of an acquired or pinned block that
 * cannot be brought to the device tier. b goes back up if it left it
 * meanwhile (best effort: it is held again), its agent's quota aside: it
 * was there before the call, and its eviction made room for the copy.
 * Unheld while the copy went up, b may still be on its way down in
 * another call's move: that move ends first. */
static void undo_private_copy(kvh_engine *e, kvhi_seq *s, uint32_t i, uint32_t b, uint32_t nb)
{
    move_holds_and_pins(e, s, i, nb, b);
    kvhi_block_unref(e, nb);
    if (kvhi_block_in_device(e, b) || !kvhi_block_wait_movable(e, b, e->blocks[b].gen, KVH_TIER_DEVICE) ||
        e->blocks[b].tier == KVH_TIER_DEVICE)
        return;
    bool was = kvhi_quota_exempt_set(true);
    kvhi_error_kept why; /* the failure being undone is the one to report */
    kvhi_error_keep(&why);
    (void)kvhi_move_block(e, b, KVH_TIER_DEVICE, s->agent);
    kvhi_error_put_back(&why);
    kvhi_quota_exempt_set(was);
}

/* Replaces logical block i of s by a private copy if it is shared or
 * published (immutable); moves this sequence's holds to the copy. A
 * persisted block replaced is kept as the sequence's durable twin.
 * call_holds: holds of s->held[i] the caller took for the call itself,
 * which promise no device residency as an acquire's do. */
static kvh_status make_private(kvh_engine *e, kvhi_seq *s, uint32_t i, uint32_t call_holds)
{
    for (;;) {
        uint32_t b = s->blocks[i];
        kvhi_block *blk = &e->blocks[b];
        if (blk->refs == 1 && !(blk->flags & KVHI_BF_PUBLISHED)) {
            if (!kvhi_block_busy(blk)) {
                forget_clean_copies(e, b);
                return KVH_OK;
            }
            kvhi_block_wait_idle(e, b); /* then check again */
            continue;
        }
        /* An acquired range resident in the device tier stays there, and
         * so does a block this sequence pinned there. */
        bool keep_in_device = (s->held[i] > call_holds || s->pins[i]) && kvhi_block_in_device(e, b);
        /* Keep b alive and unmovable while the copy is made. */
        kvhi_block_ref(e, b);
        kvhi_block_hold(e, b);
        uint32_t nb;
        kvh_status st = kvhi_block_ensure_memory(e, b);
        if (st == KVH_OK)
            st = kvhi_block_cow(e, b, s->agent, &nb); /* drops our extra ref on success */
        kvhi_block_unhold(e, b);
        if (st != KVH_OK) {
            kvhi_block_unref(e, b);
            return st;
        }
        move_holds_and_pins(e, s, i, b, nb);
        if (keep_in_device && !kvhi_block_in_device(e, nb)) {
            /* The copy, made where there was room, goes up, in place of b
             * if need be (b is no longer held by this sequence). */
            st = kvhi_move_block(e, nb, KVH_TIER_DEVICE, s->agent);
            if (st == KVH_OK && !kvhi_block_in_device(e, nb))
                st = kvhi_fail(KVH_ERR_NOSPACE, "no room in the device tier for a copy of an acquired or pinned block");
            if (st != KVH_OK) {
                undo_private_copy(e, s, i, b, nb);
                return st;
            }
        }
        s->blocks[i] = nb;
        if (!keep_replaced_durable(e, s, i, b))
            kvhi_block_unref(e, b); /* the sequence's own reference */
    }
}

static kvh_status append_blocks(kvh_engine *e, kvhi_seq *s, const int32_t *tokens, size_t n, uint64_t room,
                                uint64_t need);

kvh_status kvhi_seq_append(kvh_engine *e, kvhi_seq *s, const int32_t *tokens, size_t n)
{
    if (n == 0)
        return KVH_OK;
    /* More blocks than the engine has, or a length that would overflow:
     * refused before any arithmetic on it. */
    if (n > (uint64_t)e->block_cap * e->cfg.block_tokens || s->n_tokens + n < s->n_tokens)
        return kvhi_fail(KVH_ERR_NOSPACE, "appending %zu tokens needs more blocks than the engine has (%u)", n,
                         e->block_cap);
    uint32_t bt = e->cfg.block_tokens;
    uint32_t last_fill = s->n_blocks ? e->blocks[s->blocks[s->n_blocks - 1]].n_tokens : bt;
    uint64_t room = bt - last_fill;
    uint64_t need = n > room ? (n - room + bt - 1) / bt : 0;
    kvh_status st = ensure_cap(s, (uint64_t)s->n_blocks + need);
    if (st != KVH_OK)
        return st;
    /* Only an append that adds blocks grows the reservation: one into the
     * last block's room takes none, even from a sequence that grew past
     * its reservation while admission was off. */
    uint64_t grown = 0;
    if (need && (st = kvhi_admission_grow(e, s, (uint64_t)s->n_blocks + need, &grown)) != KVH_OK)
        return st;
    if ((st = append_blocks(e, s, tokens, n, room, need)) != KVH_OK)
        kvhi_admission_shrink(e, s, grown);
    return st;
}

/* kvhi_seq_append's work: `need` new blocks after `room` tokens left in
 * the last one. */
static kvh_status append_blocks(kvh_engine *e, kvhi_seq *s, const int32_t *tokens, size_t n, uint64_t room,
                                uint64_t need)
{
    uint32_t bt = e->cfg.block_tokens;
    kvh_status st = KVH_OK;
    /* Allocate everything first, then make the last block private (a copy
     * when it is shared), so that a failure of either leaves the sequence
     * as it was: the copy, which replaces the block, comes last. */
    uint32_t first_new = s->n_blocks;
    for (uint64_t i = 0; i < need; i++) {
        uint32_t b;
        st = kvhi_block_new(e, s->agent, KVH_TIER_DEVICE, &b);
        if (st != KVH_OK) {
            for (uint32_t j = first_new; j < first_new + i; j++)
                kvhi_block_unref(e, s->blocks[j]);
            return st;
        }
        s->blocks[first_new + i] = b;
        s->held[first_new + i] = 0;
        s->pins[first_new + i] = 0;
    }
    if (room && (st = make_private(e, s, s->n_blocks - 1, 0)) != KVH_OK) {
        for (uint32_t j = first_new; j < first_new + need; j++)
            kvhi_block_unref(e, s->blocks[j]);
        return st;
    }
    uint32_t li = room ? s->n_blocks - 1 : s->n_blocks;
    s->n_blocks += (uint32_t)need;
    for (size_t t = 0; t < n;) {
        uint32_t b = s->blocks[li];
        kvhi_block *blk = &e->blocks[b];
        if (blk->n_tokens == 0)
            blk->parent_hash = li ? e->blocks[s->blocks[li - 1]].hash : 0;
        uint32_t take = bt - blk->n_tokens;
        if (take > n - t)
            take = (uint32_t)(n - t);
        memcpy(kvhi_block_tokens(e, b) + blk->n_tokens, tokens + t, take * sizeof(int32_t));
        blk->n_tokens = (uint16_t)(blk->n_tokens + take);
        t += take;
        if (blk->n_tokens == bt) {
            blk->hash = kvhi_prefix_hash(blk->parent_hash, kvhi_block_tokens(e, b), bt,
                                         kvhi_scope_block_salt(e->cfg.model_salt, &s->scope, li, bt));
            blk->flags |= KVHI_BF_HASHED;
            kvhi_block_try_publish(e, b);
            li++;
        }
    }
    s->n_tokens += n;
    return KVH_OK;
}

kvh_status kvhi_seq_tokens(kvh_engine *e, kvhi_seq *s, uint64_t first, size_t n, int32_t *out)
{
    uint32_t b0 = 0, b1 = 0;
    kvh_status st = kvhi_seq_block_range(e, s, first, n, &b0, &b1);
    if (st != KVH_OK)
        return st;
    uint32_t bt = e->cfg.block_tokens;
    for (uint64_t t = first; t < first + n; t++)
        out[t - first] = kvhi_block_tokens(e, s->blocks[t / bt])[t % bt];
    return KVH_OK;
}

/* Counts an access of b for stats, recency and prefetch accounting. */
static void note_access(kvh_engine *e, uint32_t b)
{
    kvhi_block *blk = &e->blocks[b];
    e->stats.lookups++;
    if (blk->tier == KVH_TIER_DEVICE)
        e->stats.hits_device++;
    else if (blk->tier == KVH_TIER_HOST)
        e->stats.hits_host++;
    else
        e->stats.hits_disk++;
    if (blk->flags & KVHI_BF_PREFETCHED) {
        e->stats.prefetch_useful++;
        blk->flags &= (uint16_t)~KVHI_BF_PREFETCHED;
    }
    kvhi_block_touch(e, b);
}

void kvhi_count_prefix_hit(kvh_engine *e, uint32_t tier_found)
{
    e->stats.prefix_hit_blocks++;
    e->stats.prefix_hit_tokens += e->cfg.block_tokens;
    if (tier_found == KVH_TIER_HOST)
        e->stats.prefix_hit_blocks_host++;
    else if (tier_found == KVH_TIER_DISK)
        e->stats.prefix_hit_blocks_disk++;
}

/* Copies cnt tokens at offset off of one layer between b and user arrays
 * shaped [token][kv_head][head_dim]. to_block selects the direction. */
static int kv_copy(kvh_engine *e, uint32_t b, uint32_t layer, uint32_t off, uint32_t cnt, void *uk, void *uv,
                   bool to_block)
{
    kvhi_block *blk = &e->blocks[b];
    uint32_t H = e->cfg.num_kv_heads, bt = e->cfg.block_tokens;
    size_t row = (size_t)e->cfg.head_dim * e->elem_bytes;
    if (e->tiers[blk->tier].encoded)
        return kvhi_codec_kv_copy(e, b, layer, off, cnt, uk, uv, to_block);
    uint8_t *base = kvhi_block_data(e, b) + (uint64_t)layer * e->layer_bytes;
    bool device = blk->tier == KVH_TIER_DEVICE && !e->device_host_addressable;
    for (uint32_t kv = 0; kv < 2; kv++) {
        uint8_t *user = kv ? uv : uk;
        if (!user)
            continue;
        for (uint32_t h = 0; h < H; h++) {
            uint8_t *blk_rows = base + ((size_t)(kv * H + h) * bt + off) * row;
            uint8_t *user_rows = user + (size_t)h * row;
            if (device) {
                char msg[256];
                int rc = to_block ? e->backend->copy_2d(e->backend_ctx, blk_rows, row, user_rows, H * row, row, cnt,
                                                        KVHI_COPY_HOST_TO_DEVICE, msg, sizeof(msg))
                                  : e->backend->copy_2d(e->backend_ctx, user_rows, H * row, blk_rows, row, row, cnt,
                                                        KVHI_COPY_DEVICE_TO_HOST, msg, sizeof(msg));
                if (rc != 0)
                    return -1;
                continue;
            }
            for (uint32_t t = 0; t < cnt; t++) {
                if (to_block)
                    memcpy(blk_rows + t * row, user_rows + (size_t)t * H * row, row);
                else
                    memcpy(user_rows + (size_t)t * H * row, blk_rows + t * row, row);
            }
        }
    }
    return 0;
}

/* Checks layer and tokens [pos, pos + n) of s, which lie in logical
 * blocks [*b0, *b1). */
static kvh_status layer_range(kvh_engine *e, kvhi_seq *s, uint32_t layer, uint64_t pos, size_t n, uint32_t *b0,
                              uint32_t *b1)
{
    if (layer >= e->cfg.num_layers)
        return kvhi_fail(KVH_ERR_RANGE, "layer %u >= num_layers %u", layer, e->cfg.num_layers);
    return kvhi_seq_block_range(e, s, pos, n, b0, b1);
}

/* True when logical block i of s can take a write now: private (only s
 * refers to it and it is not published), in a memory tier and idle. */
static bool writable_now(kvh_engine *e, kvhi_seq *s, uint32_t i)
{
    const kvhi_block *blk = &e->blocks[s->blocks[i]];
    return blk->refs == 1 && !(blk->flags & KVHI_BF_PUBLISHED) && blk->tier != KVH_TIER_DISK && !kvhi_block_busy(blk);
}

/* Brings logical block i of s to the state writable_now names: copies it
 * (make_private) and reads it back from disk as needed. Each step drops
 * the lock and may undo the other's work, so it repeats until both hold
 * at once. */
static kvh_status make_writable(kvh_engine *e, kvhi_seq *s, uint32_t i)
{
    kvh_status st;
    while (!writable_now(e, s, i)) {
        if ((st = kvhi_block_ensure_memory(e, s->blocks[i])) != KVH_OK)
            return st;
        if (writable_now(e, s, i))
            break;
        if ((st = make_private(e, s, i, 1)) != KVH_OK) /* write_part's own hold */
            return st;
    }
    return KVH_OK;
}

/* Writes tokens [pos, pos + n) of one layer, which lie in logical blocks
 * [b0, b1) of s (k and v point at token pos). A failure (no room for a
 * copy, or to bring a block back from disk) must leave the part
 * unwritten, so every block of it is made private and brought into
 * memory before the first byte is written. Each is held meanwhile, so
 * that bringing in the next one cannot evict it again; the hold is
 * counted in s->held so that make_private moves it to the copy. The
 * blocks must therefore fit in the memory tiers together (beside what is
 * pinned or held there), or the part fails with KVH_ERR_NOSPACE, writing
 * nothing. Every step may drop the lock, and another thread (a persist, a
 * worker's move) may meanwhile publish, move or start copying a block
 * already prepared, so the whole part is checked again after the last
 * step, and prepared again until it passes. */
static kvh_status write_part(kvh_engine *e, kvhi_seq *s, uint32_t layer, uint64_t pos, uint64_t n, const uint8_t *k,
                             const uint8_t *v, uint32_t b0, uint32_t b1)
{
    uint32_t bt = e->cfg.block_tokens;
    size_t tok_bytes = (size_t)e->cfg.num_kv_heads * e->cfg.head_dim * e->elem_bytes;
    kvh_status st = KVH_OK;
    for (uint32_t li = b0; li < b1; li++) {
        s->held[li]++;
        kvhi_block_hold(e, s->blocks[li]);
    }
    for (bool ready = false; !ready && st == KVH_OK;) {
        for (uint32_t li = b0; li < b1 && st == KVH_OK; li++)
            st = make_writable(e, s, li);
        ready = true;
        for (uint32_t li = b0; li < b1 && ready; li++)
            ready = writable_now(e, s, li);
    }
    /* From here on the lock is held throughout. */
    for (uint64_t t = pos; t < pos + n && st == KVH_OK;) {
        uint32_t bi = (uint32_t)(t / bt), off = (uint32_t)(t % bt);
        uint32_t cnt = bt - off;
        if (cnt > pos + n - t)
            cnt = (uint32_t)(pos + n - t);
        size_t skip = (size_t)(t - pos) * tok_bytes;
        uint32_t b = s->blocks[bi];
        /* A move while the lock was dropped may have kept a clean host
         * copy of the bytes about to change, or a demotion recalled by
         * kvhi_block_ensure_memory a clean disk copy. */
        forget_clean_copies(e, b);
        if (kv_copy(e, b, layer, off, cnt, (uint8_t *)k + skip, (uint8_t *)v + skip, true) != 0)
            st = kvhi_fail(KVH_ERR_IO, "copy into the device tier failed");
        if (st == KVH_OK)
            st = kvhi_block_mark_written(e, b, layer, off, off + cnt);
        t += cnt;
    }
    for (uint32_t li = b0; li < b1; li++) {
        s->held[li]--;
        kvhi_block_unhold(e, s->blocks[li]);
    }
    return st;
}

/* Where [p, p + bytes) lies in memory s's blocks live in: a memory tier's
 * arena, or a view of s (read-only pages); a copy between it and a block
 * could then overwrite bytes it has still to read. Cheap when it is
 * neither: the views are checked one by one only inside the range that
 * covers all of s's (lock held). */
enum kv_alias { ALIAS_NONE, ALIAS_TIER, ALIAS_VIEW };

static enum kv_alias aliases_engine_memory(kvh_engine *e, const kvhi_seq *s, const void *p, size_t bytes)
{
    if (!p || !bytes)
        return ALIAS_NONE;
    uintptr_t lo = (uintptr_t)p, hi = lo + bytes;
    for (uint32_t t = 0; t < KVH_TIER_DISK; t++) {
        const kvhi_tier *tier = &e->tiers[t];
        uint64_t arena = tier->bytes_mapped;
        if (t == KVH_TIER_DEVICE && e->vmap_arena && e->slab.slab_blocks && tier->present) {
            /* Whole slabs, piece-major: a last partial slab's pieces lie
             * past slots * slot_bytes. */
            uint64_t g = e->slab.slab_blocks;
            arena = (tier->slots.capacity + g - 1) / g * g * tier->slot_bytes;
        }
        if (tier->present && tier->base && lo < (uintptr_t)tier->base + arena && (uintptr_t)tier->base < hi)
            return ALIAS_TIER;
    }
    if (s->n_views && lo < s->view_hi && s->view_lo < hi && kvhi_vmap_overlaps(e, p, bytes))
        return ALIAS_VIEW;
    return ALIAS_NONE;
}

static kvh_status write_kv(kvh_engine *e, kvhi_seq *s, uint32_t layer, uint64_t pos, size_t n, const void *k,
                           const void *v, uint32_t b0, uint32_t b1);

kvh_status kvhi_seq_write_kv(kvh_engine *e, kvhi_seq *s, uint32_t layer, uint64_t pos, size_t n, const void *k,
                             const void *v)
{
    uint32_t b0 = 0, b1 = 0;
    kvh_status st = layer_range(e, s, layer, pos, n, &b0, &b1);
    if (st != KVH_OK)
        return st;
    /* Input that lies in the engine's own memory (a block view) is taken
     * as it is now, before any block it overlaps changes. */
    size_t bytes = n * (size_t)e->cfg.num_kv_heads * e->cfg.head_dim * e->elem_bytes;
    void *copy[2] = {NULL, NULL};
    const void *src[2] = {k, v};
    for (int i = 0; i < 2; i++)
        if (aliases_engine_memory(e, s, src[i], bytes) != ALIAS_NONE) {
            if (!(copy[i] = malloc(bytes))) {
                free(copy[0]);
                return kvhi_fail(KVH_ERR_NOMEM, "out of memory for a copy of K/V that overlaps the engine's memory");
            }
            memcpy(copy[i], src[i], bytes);
            src[i] = copy[i];
        }
    st = write_kv(e, s, layer, pos, n, src[0], src[1], b0, b1);
    free(copy[0]);
    free(copy[1]);
    return st;
}

static kvh_status write_kv(kvh_engine *e, kvhi_seq *s, uint32_t layer, uint64_t pos, size_t n, const void *k,
                           const void *v, uint32_t b0, uint32_t b1)
{
    kvh_status st = KVH_OK;
    uint32_t bt = e->cfg.block_tokens;
    /* Each block is counted (kvh_stats) in the tier it is in as the call
     * asks for it, before a copy or a move for the write, and also when
     * the write then fails. Filling a block is part of making it (its
     * allocation already counted as its first access); only rewriting
     * cells is a use. A fill counted per layer would make every new block
     * look hot to LRU-K and defeat its resistance to one-off blocks. */
    for (uint64_t t = pos; t < pos + n; t = (t / bt + 1) * bt)
        if (kvhi_block_cell_written(e, s->blocks[t / bt], layer, (uint32_t)(t % bt)))
            note_access(e, s->blocks[t / bt]);
    /* The whole range in one part, so that a failure writes nothing; but a
     * range of more blocks than the memory tiers hold in all could never
     * be written so, and goes a block at a time (a failure then leaves the
     * blocks before it written). */
    uint64_t memory_blocks = 0;
    for (uint32_t t = 0; t < KVH_TIER_DISK; t++)
        if (e->tiers[t].present)
            memory_blocks += kvhi_tier_slots(e, t);
    if (b1 - b0 <= memory_blocks)
        return write_part(e, s, layer, pos, n, k, v, b0, b1);
    size_t tok_bytes = (size_t)e->cfg.num_kv_heads * e->cfg.head_dim * e->elem_bytes;
    for (uint64_t t = pos; t < pos + n && st == KVH_OK;) {
        uint64_t end = (t / bt + 1) * bt < pos + n ? (t / bt + 1) * bt : pos + n;
        size_t skip = (size_t)(t - pos) * tok_bytes;
        st = write_part(e, s, layer, t, end - t, (const uint8_t *)k + skip, (const uint8_t *)v + skip,
                        (uint32_t)(t / bt), (uint32_t)(t / bt) + 1);
        t = end;
    }
    return st;
}

static kvh_status read_kv(kvh_engine *e, kvhi_seq *s, uint32_t layer, uint64_t pos, size_t n, void *k, void *v);

kvh_status kvhi_seq_read_kv(kvh_engine *e, kvhi_seq *s, uint32_t layer, uint64_t pos, size_t n, void *k, void *v)
{
    uint32_t b0 = 0, b1 = 0;
    kvh_status st = layer_range(e, s, layer, pos, n, &b0, &b1);
    if (st != KVH_OK)
        return st;
    /* Output that lies in the engine's own memory (a block view) is
     * filled only once every byte has been read, so that it cannot
     * overwrite a block before that block is read. */
    size_t bytes = n * (size_t)e->cfg.num_kv_heads * e->cfg.head_dim * e->elem_bytes;
    void *copy[2] = {NULL, NULL}, *dst[2] = {k, v};
    enum kv_alias where[2] = {aliases_engine_memory(e, s, k, bytes), aliases_engine_memory(e, s, v, bytes)};
    if (where[0] == ALIAS_VIEW || where[1] == ALIAS_VIEW)
        return kvhi_fail(KVH_ERR_INVALID_ARG, "%s lies in a view of the sequence, which is read-only",
                         where[0] == ALIAS_VIEW ? "k" : "v");
    /* Both go through copies when either must: one output may be
     * another's input (V read into where K's block lies). */
    bool staged = where[0] != ALIAS_NONE || where[1] != ALIAS_NONE;
    for (int i = 0; staged && i < 2; i++)
        if (dst[i] && !(dst[i] = copy[i] = malloc(bytes))) {
            free(copy[0]);
            return kvhi_fail(KVH_ERR_NOMEM, "out of memory for a copy of K/V that overlaps the engine's memory");
        }
    st = read_kv(e, s, layer, pos, n, dst[0], dst[1]);
    if (st == KVH_OK && staged) {
        if (k)
            memcpy(k, dst[0], bytes);
        if (v)
            memcpy(v, dst[1], bytes);
    }
    free(copy[0]);
    free(copy[1]);
    return st;
}

static kvh_status read_kv(kvh_engine *e, kvhi_seq *s, uint32_t layer, uint64_t pos, size_t n, void *k, void *v)
{
    kvh_status st;
    uint32_t bt = e->cfg.block_tokens;
    for (uint64_t t = pos; t < pos + n; t++)
        if (!kvhi_block_cell_written(e, s->blocks[t / bt], layer, (uint32_t)(t % bt)))
            return kvhi_fail(KVH_ERR_RANGE, "KV of token %llu in layer %u was never written", (unsigned long long)t,
                             layer);
    size_t tok_bytes = (size_t)e->cfg.num_kv_heads * e->cfg.head_dim * e->elem_bytes;
    /* Each block counted in the tier it is in as the call asks for it:
     * bringing one in may move another of the range, and a failure may
     * come before the last. */
    for (uint64_t t = pos; t < pos + n; t = (t / bt + 1) * bt)
        note_access(e, s->blocks[t / bt]);
    for (uint64_t t = pos; t < pos + n;) {
        uint32_t li = (uint32_t)(t / bt), off = (uint32_t)(t % bt);
        uint32_t cnt = bt - off;
        if (cnt > pos + n - t)
            cnt = (uint32_t)(pos + n - t);
        uint32_t b = s->blocks[li];
        size_t skip = (size_t)(t - pos) * tok_bytes;
        if ((st = kvhi_block_ensure_memory(e, b)) != KVH_OK)
            return st;
        if (kv_copy(e, b, layer, off, cnt, k ? (uint8_t *)k + skip : NULL, v ? (uint8_t *)v + skip : NULL, false) != 0)
            return kvhi_fail(KVH_ERR_IO, "copy from the device tier failed");
        t += cnt;
    }
    return KVH_OK;
}

kvh_status kvhi_seq_truncate(kvh_engine *e, kvhi_seq *s, uint64_t n_tokens)
{
    if (n_tokens > s->n_tokens)
        return kvhi_fail(KVH_ERR_RANGE, "truncate to %llu > length %llu", (unsigned long long)n_tokens,
                         (unsigned long long)s->n_tokens);
    uint32_t bt = e->cfg.block_tokens;
    uint32_t keep_blocks = (uint32_t)((n_tokens + bt - 1) / bt);
    uint32_t tail = (uint32_t)(n_tokens % bt);
    kvh_status st;
    /* The only fallible step (a copy of a shared partial block) goes first. */
    if (tail && e->blocks[s->blocks[keep_blocks - 1]].n_tokens > tail) {
        /* A disk slot's header names the block's hash and tokens: a block
         * that forgets tokens is first brought to memory, or its next read
         * from disk would fail that check. Both steps may drop the lock,
         * so they repeat until the block is private, in memory and idle
         * at once. */
        uint32_t li = keep_blocks - 1;
        for (;;) {
            if ((st = make_private(e, s, li, 0)) != KVH_OK)
                return st;
            kvhi_block *blk = &e->blocks[s->blocks[li]];
            if (blk->tier != KVH_TIER_DISK && !kvhi_block_busy(blk))
                break;
            if ((st = kvhi_block_ensure_memory(e, s->blocks[li])) != KVH_OK)
                return st;
        }
        if ((st = kvhi_block_forget_tokens(e, s->blocks[li], tail)) != KVH_OK)
            return st;
    }
    drop_durable_twins(e, s, (uint32_t)(n_tokens / bt)); /* full blocks kept keep theirs */
    for (uint32_t i = keep_blocks; i < s->n_blocks; i++)
        drop_block(e, s, i);
    s->n_blocks = keep_blocks;
    s->n_tokens = n_tokens;
    return KVH_OK;
}

kvh_status kvhi_seq_match_prefix(kvh_engine *e, kvhi_seq *s, const int32_t *tokens, size_t n, size_t *matched)
{
    if (s->n_tokens != 0)
        return kvhi_fail(KVH_ERR_INVALID_ARG, "match_prefix needs an empty sequence (length %llu)",
                         (unsigned long long)s->n_tokens);
    uint32_t bt = e->cfg.block_tokens;
    if (n / bt > SEQ_MAX_BLOCKS)
        return kvhi_fail(KVH_ERR_RANGE, "%zu tokens are more than a sequence can hold", n);
    /* No match is longer than the engine has blocks: a longer prompt gets
     * a table that size, not one for every block it names. */
    size_t nb = n / bt < e->block_cap ? n / bt : e->block_cap;
    /* An admitted sequence matches no further than its pool lets it grow
     * (core/admission.c); the room is reserved now, as the lock may drop
     * below, and what the match did not use is given back. */
    uint64_t may = kvhi_admission_room(e, s), before = s->admission_blocks, grown = 0;
    if (nb > may)
        nb = (size_t)may;
    kvh_status st = ensure_cap(s, nb);
    if (st != KVH_OK || (st = kvhi_admission_grow(e, s, nb, &grown)) != KVH_OK)
        return st;
    e->stats.prefix_queries++;
    uint64_t parent = 0;
    size_t i = 0;
    for (; i < nb; i++) {
        const int32_t *tk = tokens + i * bt;
        uint64_t h = kvhi_prefix_hash(parent, tk, bt, kvhi_scope_block_salt(e->cfg.model_salt, &s->scope, i, bt));
        uint32_t b = kvhi_block_find_published(e, h, parent, tk);
        if (b == KVHI_PREFIX_MISS)
            break;
        kvhi_block *blk = &e->blocks[b];
        /* Found on disk by the open and never touched since (no access in
         * its history): no agent here computed it, so the one taking it is
         * charged for it (kvh.h, kvh_agent_set_quota), before it moves up. */
        if (blk->hist[0] == 0 && blk->refs == 0 && blk->tier != KVH_TIER_DEVICE && !kvhi_block_busy(blk))
            blk->agent = s->agent;
        blk->refs++;            /* not kvhi_block_ref: the touch re-keys it */
        kvhi_block_touch(e, b); /* also re-keys it: referenced now */
        s->blocks[i] = b;
        s->held[i] = 0;
        s->pins[i] = 0;
        parent = h;
    }
    size_t found = i;
    /* Blocks found on disk are read and verified now, in parallel: a block
     * that fails its checksum ends the match there (a miss, never served). */
    bool on_disk = false;
    for (size_t j = 0; j < found; j++)
        on_disk |= e->blocks[s->blocks[j]].tier == KVH_TIER_DISK;
    /* Where each block was found, for the counters (the reads below move
     * those on disk). */
    uint8_t *found_in = malloc(found ? found : 1);
    if (!found_in) {
        for (size_t j = 0; j < found; j++)
            kvhi_block_unref(e, s->blocks[j]);
        kvhi_admission_shrink(e, s, grown);
        return kvhi_fail(KVH_ERR_NOMEM, "out of memory matching a prefix");
    }
    for (size_t j = 0; j < found; j++)
        found_in[j] = e->blocks[s->blocks[j]].tier;
    if (on_disk) {
        /* Held so that nothing of the chain is pushed down meanwhile. */
        for (size_t j = 0; j < found; j++)
            kvhi_block_hold(e, s->blocks[j]);
        uint32_t fidx;
        if ((st = kvhi_fence_new(e, &fidx, NULL)) == KVH_OK) {
            uint32_t to = e->tiers[KVH_TIER_HOST].present ? KVH_TIER_HOST : KVH_TIER_DEVICE;
            for (size_t j = 0; j < found; j++)
                if (e->blocks[s->blocks[j]].tier == KVH_TIER_DISK)
                    kvhi_enqueue(e, s->blocks[j], to, INT32_MAX - 1, KVHI_JOB_NEED, fidx);
            kvhi_fence_wait_idx(e, fidx, UINT64_MAX);
            kvhi_fence_drop(e, fidx);
        }
        /* What did not fit in memory is checked where it lies. */
        size_t readable = kvhi_disk_verify(e, s->blocks, found);
        for (i = 0; i < readable; i++)
            if (e->blocks[s->blocks[i]].flags & KVHI_BF_CORRUPT)
                break;
        kvhi_clear_error();
        st = KVH_OK;
        for (size_t j = 0; j < found; j++)
            kvhi_block_unhold(e, s->blocks[j]);
    }
    for (size_t j = i; j < found; j++)
        kvhi_block_unref(e, s->blocks[j]);
    s->n_blocks = (uint32_t)i;
    s->n_tokens = (uint64_t)i * bt;
    for (size_t j = 0; j < i; j++)
        kvhi_count_prefix_hit(e, found_in[j]);
    free(found_in);
    if (e->remote && i == found)
        i = kvhi_remote_match(e, s, tokens, nb, i);
    uint64_t used = i > before ? i - before : 0;
    kvhi_admission_shrink(e, s, grown > used ? grown - used : 0);
    *matched = i * bt;
    return KVH_OK;
}

kvh_status kvhi_seq_acquire(kvh_engine *e, kvhi_seq *s, uint64_t first, uint64_t n, kvh_fence *fence)
{
    uint32_t b0 = 0, b1 = 0;
    kvh_status st = kvhi_seq_block_range(e, s, first, n, &b0, &b1);
    if (st != KVH_OK)
        return st;
    /* Checked first so that a refusal changes nothing. */
    for (uint32_t i = b0; i < b1; i++)
        if (s->held[i] == UINT32_MAX || e->blocks[s->blocks[i]].holds == UINT32_MAX)
            return kvhi_fail(KVH_ERR_RANGE, "block %u of the sequence is held %u times already", i, UINT32_MAX);
    uint32_t fidx;
    kvh_fence fh;
    if ((st = kvhi_fence_new(e, &fidx, &fh)) != KVH_OK)
        return st;
    uint64_t device_slots = kvhi_tier_slots(e, KVH_TIER_DEVICE);
    if (b1 - b0 > device_slots) {
        kvhi_fence *f = kvhi_handles_at(&e->fences, fidx);
        f->range_blocks = b1 - b0;
        f->device_slots = device_slots;
    }
    uint64_t t0 = kvhi_now_ns();
    /* Hold first so nothing in the range is chosen as a victim while the
     * missing blocks are promoted. */
    for (uint32_t i = b0; i < b1; i++) {
        s->held[i]++;
        kvhi_block_hold(e, s->blocks[i]);
    }
    bool waited = false;
    for (uint32_t i = b0; i < b1; i++) {
        uint32_t b = s->blocks[i];
        kvhi_block *blk = &e->blocks[b];
        /* A block on its way to disk is called back instead of read back:
         * one still in the device tier is usable at once. */
        kvhi_block_recall(e, b);
        bool resident = kvhi_block_in_device(e, b);
        if (!resident && (blk->flags & KVHI_BF_PREFETCHED) && blk->tier != KVH_TIER_DEVICE) {
            /* A prefetch's promotion in flight (core/migrate.c): waited for.
             * (One that arrived and is leaving again is used: note_access.) */
            e->stats.prefetch_late++;
            blk->flags &= (uint16_t)~KVHI_BF_PREFETCHED; /* its arrival is not "prefetched, unused" */
        }
        if (!resident)
            blk->flags &= (uint16_t)~KVHI_BF_PREFETCHING; /* a queued prefetch gives way to this fetch */
        note_access(e, b);
        if (!resident) {
            waited = true;
            kvhi_enqueue(e, b, KVH_TIER_DEVICE, INT32_MAX, KVHI_JOB_NEED, fidx);
        }
    }
    if (fence) {
        *fence = fh;
        return KVH_OK;
    }
    st = kvhi_fence_wait_idx(e, fidx, UINT64_MAX);
    kvhi_fence_drop(e, fidx);
    if (waited) {
        uint64_t stall_ns = kvhi_now_ns() - t0;
        e->stats.acquire_stall_ns += stall_ns;
        kvhi_latency_record(&e->latency, KVH_LATENCY_ACQUIRE_STALL, stall_ns);
    }
    if (st != KVH_OK) {
        for (uint32_t i = b0; i < b1; i++) {
            s->held[i]--;
            kvhi_block_unhold(e, s->blocks[i]);
        }
    }
    return st;
}

kvh_status kvhi_seq_pin(kvh_engine *e, kvhi_seq *s, uint64_t first, uint64_t n, bool pin)
{
    uint32_t b0 = 0, b1 = 0;
    kvh_status st = kvhi_seq_block_range(e, s, first, n, &b0, &b1);
    if (st != KVH_OK)
        return st;
    /* Checked first so that a refusal changes nothing. */
    for (uint32_t i = b0; i < b1; i++) {
        if (!pin && s->pins[i] == 0)
            return kvhi_fail(KVH_ERR_INVALID_ARG, "block %u of the sequence is not pinned by it", i);
        if (pin && (s->pins[i] == UINT32_MAX || e->blocks[s->blocks[i]].pins == UINT32_MAX))
            return kvhi_fail(KVH_ERR_RANGE, "block %u of the sequence is pinned %u times already", i, UINT32_MAX);
    }
    for (uint32_t i = b0; i < b1; i++) {
        if (pin) {
            /* Each block is pinned as soon as it has settled: pinned, it
             * is no victim while the next one's move is waited for. */
            kvhi_block_settle_for_pin(e, s->blocks[i]);
            if (e->blocks[s->blocks[i]].pins == UINT32_MAX) { /* another sequence's pins, meanwhile */
                for (uint32_t j = b0; j < i; j++) {
                    s->pins[j]--;
                    kvhi_block_pin(e, s->blocks[j], false);
                }
                return kvhi_fail(KVH_ERR_RANGE, "block %u of the sequence is pinned %u times already", i, UINT32_MAX);
            }
            s->pins[i]++;
        } else {
            s->pins[i]--;
        }
        kvhi_block_pin(e, s->blocks[i], pin);
    }
    return KVH_OK;
}

kvh_status kvhi_seq_release(kvh_engine *e, kvhi_seq *s, uint64_t first, uint64_t n)
{
    uint32_t b0 = 0, b1 = 0;
    kvh_status st = kvhi_seq_block_range(e, s, first, n, &b0, &b1);
    if (st != KVH_OK)
        return st;
    for (uint32_t i = b0; i < b1; i++)
        if (s->held[i] == 0)
            return kvhi_fail(KVH_ERR_INVALID_ARG, "block %u of the sequence is not acquired", i);
    for (uint32_t i = b0; i < b1; i++) {
        s->held[i]--;
        kvhi_block_unhold(e, s->blocks[i]);
    }
    return KVH_OK;
}

/* A block and the generation it had when a call named it: a move queued
 * inline drops the lock, and the caller's array (a sequence's block
 * table, which another thread may grow) or the block itself may change
 * meanwhile, so a call that queues several moves works from these. */
typedef struct named_block {
    uint32_t block;
    uint32_t gen;
} named_block;

static named_block *name_blocks(kvh_engine *e, const uint32_t *blocks, size_t n)
{
    named_block *out = malloc(sizeof(named_block) * (n ? n : 1));
    if (!out)
        return NULL;
    for (size_t i = 0; i < n; i++)
        out[i] = (named_block){blocks[i], e->blocks[blocks[i]].gen};
    return out;
}

/* The block still is the one named (not freed, nor reused meanwhile). */
static bool still_named(kvh_engine *e, named_block nb)
{
    const kvhi_block *blk = &e->blocks[nb.block];
    return blk->gen == nb.gen && (blk->flags & KVHI_BF_LIVE) && !(blk->flags & KVHI_BF_DEAD);
}

/* Puts the device-tier blocks that kept clean host copies ahead of the
 * others, in order otherwise. Bound for the host tier, they go down onto
 * their copies without a copy; queued behind the others, they would find
 * those copies taken back to make room for them (kvhi_reserve_slot) and
 * cost a copy each after all. Without memory the order stays. */
static void copies_first(kvh_engine *e, named_block *named, size_t n)
{
    if (!e->clean.count || n < 2)
        return;
    named_block *rest = malloc(sizeof(named_block) * n);
    if (!rest)
        return;
    size_t k = 0, r = 0;
    for (size_t i = 0; i < n; i++) {
        const kvhi_block *blk = &e->blocks[named[i].block];
        if (blk->tier == KVH_TIER_DEVICE && e->clean.slot_of[named[i].block] != KVHI_NO_BLOCK)
            named[k++] = named[i];
        else
            rest[r++] = named[i];
    }
    memcpy(named + k, rest, sizeof(named_block) * r);
    free(rest);
}

kvh_status kvhi_prefetch(kvh_engine *e, kvhi_seq *s, uint64_t first, uint64_t n, int32_t priority, kvh_fence *fence)
{
    uint32_t b0 = 0, b1 = 0;
    kvh_status st = kvhi_seq_block_range(e, s, first, n, &b0, &b1);
    if (st != KVH_OK)
        return st;
    uint32_t fidx = KVHI_NO_BLOCK;
    if (fence && (st = kvhi_fence_new(e, &fidx, fence)) != KVH_OK)
        return st;
    uint32_t min_hits = e->cfg.promote_min_hits;
    /* An inline promotion drops the lock, after which s may be gone (this
     * call is @threads any): work from the blocks as named now. */
    named_block *named = name_blocks(e, s->blocks ? s->blocks + b0 : NULL, b1 - b0);
    if (!named) {
        if (fidx != KVHI_NO_BLOCK)
            kvhi_fence_drop(e, fidx);
        return kvhi_fail(KVH_ERR_NOMEM, "out of memory queueing a prefetch");
    }
    /* Predicted: kept above unhinted blocks until used (core/hints.c).
     * Every block of the range first: a promotion run here drops the lock
     * and makes room, and must not take it from a block of the range not
     * yet hinted. */
    for (uint32_t i = 0; i < b1 - b0; i++)
        kvhi_hint_set(e, named[i].block, priority);
    for (uint32_t i = 0; i < b1 - b0; i++) {
        if (!still_named(e, named[i]))
            continue;
        uint32_t b = named[i].block;
        kvhi_block *blk = &e->blocks[b];
        if (blk->tier == KVH_TIER_DEVICE && !kvhi_block_in_flight(blk))
            continue;
        /* Queued, or on its way up (a prefetched block arrived unused and
         * now leaving the device tier may be prefetched again). */
        if ((blk->flags & KVHI_BF_PREFETCHING) || ((blk->flags & KVHI_BF_PREFETCHED) && blk->tier != KVH_TIER_DEVICE))
            continue;
        if (++blk->hits < min_hits || blk->pins) {
            e->stats.prefetch_skipped++;
            continue;
        }
        /* Counted as issued when its promotion starts (core/migrate.c). */
        uint32_t gen = blk->gen;
        blk->flags |= KVHI_BF_PREFETCHING;
        if (kvhi_enqueue(e, b, KVH_TIER_DEVICE, priority, KVHI_JOB_PREFETCH, fidx) != KVH_OK && blk->gen == gen)
            blk->flags &= (uint16_t)~KVHI_BF_PREFETCHING; /* not queued: a later prefetch may try again */
    }
    free(named);
    return KVH_OK;
}

kvh_status kvhi_seq_hint(kvh_engine *e, kvhi_seq *s, uint64_t first, uint64_t n, int32_t priority)
{
    uint32_t b0 = 0, b1 = 0;
    kvh_status st = kvhi_seq_block_range(e, s, first, n, &b0, &b1);
    if (st != KVH_OK)
        return st;
    for (uint32_t i = b0; i < b1; i++)
        kvhi_hint_set(e, s->blocks[i], priority);
    return KVH_OK;
}

kvh_status kvhi_migrate_blocks(kvh_engine *e, const uint32_t *blocks, size_t n, uint32_t tier, kvh_fence *fence)
{
    if (tier >= KVH_TIER_COUNT || !e->tiers[tier].present)
        return kvhi_fail(KVH_ERR_INVALID_ARG, "tier %u is not configured", tier);
    if (n == 1 && !fence) {
        /* One block, and the caller waits anyway: move it here rather than
         * pay two thread hand-offs for it. */
        uint32_t b = blocks[0]; /* blocks may not outlive the wait below */
        kvhi_block *blk = &e->blocks[b];
        if (blk->pins)
            return KVH_OK;
        if (!kvhi_block_wait_movable(e, b, blk->gen, tier) || blk->tier == tier || blk->pins ||
            (blk->holds && tier > blk->tier))
            return KVH_OK; /* freed meanwhile, already there, pinned since, or held above */
        return kvhi_move_block(e, b, tier, blk->agent);
    }
    named_block *named = name_blocks(e, blocks, n);
    if (!named)
        return kvhi_fail(KVH_ERR_NOMEM, "out of memory queueing %zu moves", n);
    uint32_t fidx;
    kvh_fence fh;
    kvh_status st = kvhi_fence_new(e, &fidx, &fh);
    if (st != KVH_OK) {
        free(named);
        return st;
    }
    if (tier == KVH_TIER_HOST)
        copies_first(e, named, n);
    for (size_t i = 0; i < n; i++)
        if (still_named(e, named[i]) && !e->blocks[named[i].block].pins)
            kvhi_enqueue(e, named[i].block, tier, 0, KVHI_JOB_MOVE, fidx);
    free(named);
    if (fence) {
        *fence = fh;
        return KVH_OK;
    }
    st = kvhi_fence_wait_idx(e, fidx, UINT64_MAX);
    kvhi_fence_drop(e, fidx);
    return st;
}
