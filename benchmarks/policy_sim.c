#include "policy_sim.h"

#include <stdlib.h>
#include <string.h>

const char *sim_policy_name(sim_policy p)
{
    switch (p) {
    case SIM_LRU:
        return "lru";
    case SIM_LRU_K:
        return "lru-k";
    case SIM_LRU_K_HYST:
        return "lru-k-hyst";
    case SIM_LCTRU:
        return "lctru";
    case SIM_LRU_K_HINTS:
        return "lru-k+hints";
    case SIM_REUSE:
        return "reuse";
    case SIM_ADAPTIVE:
        return "adaptive";
    default:
        return "?";
    }
}

void sim_config_defaults(sim_config *c, uint32_t device_blocks, uint32_t host_blocks)
{
    *c = (sim_config){.device_blocks = device_blocks,
                      .host_blocks = host_blocks,
                      .lru_k = 2,
                      .hyst_hits = 2,
                      .hyst_window = 0,
                      .lctru_window = 8};
}

/* ------------------------------------------------------------------ */
/* indexed min-heap of blocks; each block is in at most one heap, so    */
/* one position array serves both tiers                                 */
/* ------------------------------------------------------------------ */

#define NO_POS UINT32_MAX

typedef struct key {
    uint64_t primary, secondary;
} key;

typedef struct heap {
    uint32_t *item;
    key *k;
    uint32_t size, cap;
    uint32_t *pos; /* shared, per block */
} heap;

static int key_less(key a, key b) { return a.primary != b.primary ? a.primary < b.primary : a.secondary < b.secondary; }

static int heap_init(heap *h, uint32_t cap, uint32_t *pos)
{
    h->item = malloc((cap ? cap : 1) * sizeof(*h->item));
    h->k = malloc((cap ? cap : 1) * sizeof(*h->k));
    h->size = 0;
    h->cap = cap;
    h->pos = pos;
    return h->item && h->k ? 0 : -1;
}

static void heap_free(heap *h)
{
    free(h->item);
    free(h->k);
}

static void heap_set(heap *h, uint32_t i, uint32_t item, key k)
{
    h->item[i] = item;
    h->k[i] = k;
    h->pos[item] = i;
}

static void heap_up(heap *h, uint32_t i)
{
    uint32_t it = h->item[i];
    key k = h->k[i];
    while (i > 0) {
        uint32_t p = (i - 1) / 2;
        if (!key_less(k, h->k[p]))
            break;
        heap_set(h, i, h->item[p], h->k[p]);
        i = p;
    }
    heap_set(h, i, it, k);
}

static void heap_down(heap *h, uint32_t i)
{
    uint32_t it = h->item[i];
    key k = h->k[i];
    for (;;) {
        uint32_t c = 2 * i + 1;
        if (c >= h->size)
            break;
        if (c + 1 < h->size && key_less(h->k[c + 1], h->k[c]))
            c++;
        if (!key_less(h->k[c], k))
            break;
        heap_set(h, i, h->item[c], h->k[c]);
        i = c;
    }
    heap_set(h, i, it, k);
}

static void heap_push(heap *h, uint32_t item, key k)
{
    heap_set(h, h->size, item, k);
    heap_up(h, h->size++);
}

static void heap_update(heap *h, uint32_t item, key k)
{
    uint32_t i = h->pos[item];
    key old = h->k[i];
    h->k[i] = k;
    if (key_less(k, old))
        heap_up(h, i);
    else
        heap_down(h, i);
}

static void heap_remove(heap *h, uint32_t item)
{
    uint32_t i = h->pos[item];
    h->pos[item] = NO_POS;
    if (--h->size == i)
        return;
    uint32_t moved = h->item[h->size];
    heap_set(h, i, moved, h->k[h->size]);
    heap_up(h, i);
    heap_down(h, h->pos[moved]);
}

/* ------------------------------------------------------------------ */
/* two-tier simulation                                                  */
/* ------------------------------------------------------------------ */

enum { IN_NONE, IN_DEVICE, IN_HOST, IN_STORE };

typedef struct sim {
    const trace *t;
    sim_policy policy;
    sim_config cfg;
    uint8_t *where;
    uint64_t *hist; /* lru_k most recent access times per block, newest first */
    uint32_t *pos;
    heap dev, host;
    uint32_t *scratch; /* lctru: blocks popped while looking for a victim */
    uint8_t *hinted;   /* lru-k+hints: a hint names it (hint_prio, hint_next) */
    uint8_t *fresh;    /* hinted since its last redemption */
    /* Lapse of hints, as core/hints.c: epochs of max(64, D + H) ticks of
     * the access clock; a hint not renewed since the epoch before the
     * current one is dropped. */
    uint32_t *hint_epoch_of;
    struct {
        uint32_t block, epoch;
    } * ring;
    size_t ring_head, ring_n, ring_cap;
    uint32_t epoch;
    uint64_t epoch_end, clock;
    int32_t *hint_prio, *hint_next; /* hint_next INT32_MIN: none */
    /* Named by a hint since its last access, and the highest priority
     * that named it: what a caller prefetching ahead knows (prefetch_ahead). */
    uint8_t *named;
    int32_t *named_prio;
    trace_position *by_pos; /* lru-k+hints: the blocks a hint range names */
    sim_result *r;
    /* reuse and adaptive (core/adaptive.c): the reuse order's period, and
     * the adaptive order's shadows of a device tier, one per order
     * (ORDER_*), with their decayed hits. */
    uint64_t reuse_period;
    heap shadow[3];
    uint32_t *shadow_pos[3];
    int64_t shadow_hits[3];
    uint32_t n_orders, order, best;
    uint64_t decay_left, decay_every, quiet_left, blocks_seen;
} sim;

/* The adaptive order's candidates, as core/adaptive.h numbers them. */
enum { ORDER_LRU, ORDER_LRU_K, ORDER_REUSE };

static const uint64_t *hist_of(const sim *s, uint32_t b) { return &s->hist[(size_t)b * s->cfg.lru_k]; }

/* core/adaptive.h, kvhi_adapt_reuse_key (without the referenced class:
 * no block is referenced while a victim is chosen here). */
static key reuse_key(const uint64_t *h, uint64_t period)
{
    uint64_t protect = h[1] != 0 && h[0] - h[1] <= period;
    return (key){(protect << 61) | h[1], h[0]};
}

static key order_key(const sim *s, uint32_t order, uint32_t b)
{
    const uint64_t *h = hist_of(s, b);
    if (order == ORDER_REUSE)
        return reuse_key(h, s->reuse_period);
    return order == ORDER_LRU ? (key){h[0], h[0]} : (key){h[s->cfg.lru_k - 1], h[0]};
}

static key key_of(const sim *s, uint32_t b)
{
    const uint64_t *h = hist_of(s, b);
    if (s->policy == SIM_REUSE)
        return reuse_key(h, s->reuse_period);
    if (s->policy == SIM_ADAPTIVE)
        return order_key(s, s->order, b);
    if (s->policy == SIM_LRU_K_HINTS && s->hinted[b])
        return (key){(1ull << 62) | ((uint32_t)s->hint_prio[b] ^ 0x80000000u), h[0]};
    if (s->policy == SIM_LRU_K || s->policy == SIM_LRU_K_HYST || s->policy == SIM_LRU_K_HINTS)
        return (key){h[s->cfg.lru_k - 1], h[0]};
    return (key){h[0], 0};
}

/* The block to evict from h (non-empty). */
static uint32_t victim(sim *s, heap *h)
{
    if (s->policy != SIM_LCTRU)
        return h->item[0];
    /* Look at the lctru_window least recent blocks, keep the least
     * tolerable (the first met wins ties: it is the least recent). */
    uint32_t n = 0, best = UINT32_MAX;
    float best_tol = 2.0f;
    while (n < s->cfg.lctru_window && h->size) {
        uint32_t b = h->item[0];
        heap_remove(h, b);
        s->scratch[n++] = b;
        if (s->t->tolerance[b] < best_tol) {
            best_tol = s->t->tolerance[b];
            best = b;
        }
    }
    for (uint32_t i = 0; i < n; i++)
        heap_push(h, s->scratch[i], key_of(s, s->scratch[i]));
    return best;
}

/* Frees a host slot: its victim goes to the store. */
static void room_in_host(sim *s)
{
    if (s->host.size < s->cfg.host_blocks)
        return;
    uint32_t v = victim(s, &s->host);
    heap_remove(&s->host, v);
    s->where[v] = IN_STORE;
    s->r->down_sh++;
}

/* Frees a device slot: its victim goes to the host tier (or straight to the
 * store without one). */
static void room_in_device(sim *s)
{
    if (s->dev.size < s->cfg.device_blocks)
        return;
    uint32_t v = victim(s, &s->dev);
    heap_remove(&s->dev, v);
    s->r->down_dh++;
    if (s->cfg.host_blocks == 0) {
        s->where[v] = IN_STORE;
        s->r->down_sh++;
        return;
    }
    room_in_host(s);
    s->where[v] = IN_HOST;
    heap_push(&s->host, v, key_of(s, v));
}

static int may_promote(const sim *s, uint32_t b, uint64_t now)
{
    if (s->policy != SIM_LRU_K_HYST)
        return 1;
    uint32_t need = s->cfg.hyst_hits;
    if (need <= 1)
        return 1;
    if (need > s->cfg.lru_k)
        need = s->cfg.lru_k;
    uint64_t window = s->cfg.hyst_window ? s->cfg.hyst_window : 4ull * s->cfg.device_blocks;
    uint64_t t = hist_of(s, b)[need - 1]; /* history already holds this access */
    return t != 0 && now - t < window;
}

static void record(sim *s, uint32_t b, uint64_t now)
{
    uint64_t *h = &s->hist[(size_t)b * s->cfg.lru_k];
    memmove(h + 1, h, (s->cfg.lru_k - 1) * sizeof(*h));
    h[0] = now;
}

/* The block's key changed: its heap learns it. */
static void rekey(sim *s, uint32_t b)
{
    if (s->where[b] == IN_DEVICE)
        heap_update(&s->dev, b, key_of(s, b));
    else if (s->where[b] == IN_HOST)
        heap_update(&s->host, b, key_of(s, b));
}

/* A hint for block b (core/hints.c): it keeps its two highest distinct
 * priorities, and with hint_promote it is promoted when the device tier
 * has room or a victim of a lower priority class. */
static void hints_advance(sim *s)
{
    if (s->clock < s->epoch_end)
        return;
    uint64_t horizon = (uint64_t)s->cfg.device_blocks + s->cfg.host_blocks;
    s->epoch++;
    s->epoch_end = s->clock + (horizon < 64 ? 64 : horizon);
    while (s->ring_n && s->epoch - s->ring[s->ring_head].epoch >= 2) {
        uint32_t b = s->ring[s->ring_head].block;
        if (s->hinted[b] && s->hint_epoch_of[b] == s->ring[s->ring_head].epoch) {
            s->hinted[b] = 0;
            rekey(s, b);
        }
        s->ring_head = (s->ring_head + 1) % s->ring_cap;
        s->ring_n--;
    }
}

/* Returns 0, or -1 when out of memory. */
static int ring_push(sim *s, uint32_t b)
{
    if (s->ring_n == s->ring_cap) {
        size_t cap = s->ring_cap ? s->ring_cap * 2 : 1024;
        void *r = malloc(cap * sizeof(*s->ring));
        if (!r)
            return -1;
        for (size_t i = 0; i < s->ring_n; i++)
            memcpy((char *)r + i * sizeof(*s->ring), &s->ring[(s->ring_head + i) % s->ring_cap], sizeof(*s->ring));
        free(s->ring);
        s->ring = r;
        s->ring_head = 0;
        s->ring_cap = cap;
    }
    size_t at = (s->ring_head + s->ring_n++) % s->ring_cap;
    s->ring[at].block = b;
    s->ring[at].epoch = s->epoch;
    return 0;
}

static void promote_block(sim *s, uint32_t b);

/* promote: whether this hint may also promote b (hint_promote: every
 * hint, or with prefetch_ahead only the window's prefetches). */
static void hint_block(sim *s, uint32_t b, int32_t priority, int promote)
{
    uint8_t where = s->where[b];
    if (where == IN_NONE)
        return; /* not made yet */
    hints_advance(s);
    if (!(s->hinted[b] && s->hint_epoch_of[b] == s->epoch) && ring_push(s, b) != 0)
        return; /* as the engine: a hint is advice, dropped when out of memory */
    s->hint_epoch_of[b] = s->epoch;
    if (priority == INT32_MIN)
        priority = INT32_MIN + 1;
    s->fresh[b] = 1;
    if (!s->hinted[b]) {
        s->hint_prio[b] = priority;
        s->hint_next[b] = INT32_MIN;
        s->hinted[b] = 1;
    } else if (priority > s->hint_prio[b]) {
        s->hint_next[b] = s->hint_prio[b];
        s->hint_prio[b] = priority;
    } else if (priority < s->hint_prio[b] && priority > s->hint_next[b]) {
        s->hint_next[b] = priority;
    }
    rekey(s, b);
    if (promote)
        promote_block(s, b);
}

/* A hinted block's promotion (hint_promote): into a free device slot, or
 * in place of a device block of a lower class. */
static void promote_block(sim *s, uint32_t b)
{
    uint8_t where = s->where[b];
    if (where == IN_DEVICE || where == IN_NONE || !s->cfg.hint_promote)
        return;
    if (s->dev.size >= s->cfg.device_blocks && !(s->dev.k[0].primary < key_of(s, b).primary))
        return; /* the device victim is hinted as soon or sooner */
    if (where == IN_HOST) {
        heap_remove(&s->host, b);
    } else {
        s->r->up_sh++;
    }
    s->r->up_dh++;
    room_in_device(s);
    s->where[b] = IN_DEVICE;
    heap_push(&s->dev, b, key_of(s, b));
}

/* A hint from the trace. With prefetch_ahead it is advice: the blocks it
 * names are noted (named, named_prio) for the window's prefetches. */
static void apply_hint(sim *s, const trace_hint *h)
{
    int promote = s->cfg.prefetch_ahead == 0;
    /* The blocks it names that the trace has, in index order: a demo-form
     * hint's one block, or a run of by_pos (however large N is, no more
     * work than the blocks there are). */
    size_t lo = 0, hi = 1, nb = s->t->n_blocks;
    if (h->block == UINT32_MAX) {
        lo = trace_position_at(s->by_pos, nb, h->seq, h->first);
        hi = trace_position_at(s->by_pos, nb, h->seq, (uint64_t)h->first + h->n);
    }
    /* As kvh_prefetch: the whole range is hinted before any of it is
     * promoted, so that no promotion takes the place of a block of it. */
    for (size_t i = lo; i < hi; i++) {
        uint32_t b = h->block != UINT32_MAX ? h->block : s->by_pos[i].block;
        if (s->where[b] == IN_NONE)
            continue;
        hint_block(s, b, h->priority, 0);
        if (!s->named[b] || h->priority > s->named_prio[b])
            s->named_prio[b] = h->priority;
        s->named[b] = 1;
    }
    for (size_t i = lo; i < hi && promote; i++)
        promote_block(s, h->block != UINT32_MAX ? h->block : s->by_pos[i].block);
}

static void reheap(sim *s, heap *h)
{
    for (uint32_t i = 0; i < h->size; i++)
        h->k[i] = key_of(s, h->item[i]);
    for (uint32_t i = h->size / 2 + 1; i-- > 0;)
        if (i < h->size)
            heap_down(h, i);
}

static void adaptive_best(sim *s)
{
    uint32_t best = s->order;
    for (uint32_t o = 0; o < s->n_orders; o++)
        if (s->shadow_hits[o] > s->shadow_hits[best])
            best = o;
    s->best = best;
}

/* core/adaptive.c, kvhi_adapt_access_slow, on every access: the shadows
 * (each a device tier of D blocks under one order), the decay, and the
 * switch, which re-keys both tiers and waits as many accesses as the
 * engine re-keys entries (every block made so far but the one accessed,
 * which is held meanwhile). */
static void adaptive_access(sim *s, uint32_t b)
{
    for (uint32_t o = 0; o < s->n_orders; o++) {
        heap *h = &s->shadow[o];
        if (s->shadow_pos[o][b] != NO_POS) {
            s->shadow_hits[o]++;
            heap_update(h, b, order_key(s, o, b));
            continue;
        }
        heap_push(h, b, order_key(s, o, b));
        if (h->size > s->cfg.device_blocks)
            heap_remove(h, h->item[0]);
    }
    adaptive_best(s);
    if (--s->decay_left == 0) {
        s->decay_left = s->decay_every;
        for (uint32_t o = 0; o < s->n_orders; o++)
            s->shadow_hits[o] -= s->shadow_hits[o] / 2;
        adaptive_best(s);
    }
    if (s->quiet_left) {
        s->quiet_left--;
        return;
    }
    if (s->shadow_hits[s->best] - s->shadow_hits[s->order] <= 4)
        return;
    s->order = s->best;
    reheap(s, &s->dev);
    reheap(s, &s->host);
    s->quiet_left = s->blocks_seen - 1;
}

static void access_block(sim *s, uint32_t b, uint64_t now)
{
    sim_result *r = s->r;
    r->accesses++;
    record(s, b, now);
    if (s->named)
        s->named[b] = 0;
    if (s->policy == SIM_ADAPTIVE) {
        s->blocks_seen += s->where[b] == IN_NONE;
        adaptive_access(s, b);
    }
    if (s->policy == SIM_LRU_K_HINTS && s->hinted[b] && s->fresh[b]) {
        /* the first access after a hint redeems it: the next one, if any,
         * takes over */
        s->fresh[b] = 0;
        s->hinted[b] = s->hint_next[b] != INT32_MIN;
        s->hint_prio[b] = s->hint_next[b];
        s->hint_next[b] = INT32_MIN;
        rekey(s, b);
    }
    s->clock = now;
    /* The engine checks for a new epoch on a use (kvhi_block_touch), not
     * when it makes a block. */
    if (s->ring_n && s->where[b] != IN_NONE)
        hints_advance(s);
    switch (s->where[b]) {
    case IN_DEVICE:
        r->hits_device++;
        heap_update(&s->dev, b, key_of(s, b));
        return;
    case IN_HOST:
        r->hits_host++;
        r->up_dh++;
        if (!may_promote(s, b, now)) {
            heap_update(&s->host, b, key_of(s, b));
            return;
        }
        heap_remove(&s->host, b);
        room_in_device(s);
        break;
    case IN_STORE:
        r->misses++;
        r->up_sh++;
        r->up_dh++;
        if (!may_promote(s, b, now) && s->cfg.host_blocks) {
            room_in_host(s);
            s->where[b] = IN_HOST;
            heap_push(&s->host, b, key_of(s, b));
            return;
        }
        room_in_device(s);
        break;
    default: /* first access: computed in the device tier */
        r->misses++;
        r->first_accesses++;
        room_in_device(s);
        break;
    }
    s->where[b] = IN_DEVICE;
    heap_push(&s->dev, b, key_of(s, b));
}

void sim_hits_by_fetches(sim_result *r)
{
    uint64_t reused = r->accesses - r->first_accesses;
    r->hits_device = reused > r->up_dh ? reused - r->up_dh : 0;
    uint64_t mem = reused > r->up_sh ? reused - r->up_sh : 0;
    r->hits_host = mem > r->hits_device ? mem - r->hits_device : 0;
    r->misses = r->accesses - r->hits_device - r->hits_host;
}

int sim_run(const trace *t, sim_policy p, const sim_config *c, sim_result *out)
{
    memset(out, 0, sizeof(*out));
    sim s = {.t = t, .policy = p, .cfg = *c, .r = out};
    if (s.cfg.lru_k < 1)
        s.cfg.lru_k = 1;
    if (s.cfg.lru_k > 4)
        s.cfg.lru_k = 4;
    if (s.cfg.device_blocks < 1)
        s.cfg.device_blocks = 1;
    if (p == SIM_LRU || p == SIM_LCTRU)
        s.cfg.lru_k = 1;
    if (p == SIM_REUSE && s.cfg.lru_k < 2)
        s.cfg.lru_k = 2; /* the reuse key reads two accesses */
    if (p == SIM_LRU_K_HYST && s.cfg.lru_k < s.cfg.hyst_hits)
        s.cfg.lru_k = s.cfg.hyst_hits > 4 ? 4 : s.cfg.hyst_hits;
    size_t nb = t->n_blocks ? t->n_blocks : 1;
    s.where = calloc(nb, 1);
    s.hist = calloc(nb * s.cfg.lru_k, sizeof(*s.hist));
    s.pos = malloc(nb * sizeof(*s.pos));
    s.scratch = malloc((s.cfg.lctru_window ? s.cfg.lctru_window : 1) * sizeof(*s.scratch));
    s.hinted = calloc(nb, 1);
    s.fresh = calloc(nb, 1);
    s.hint_epoch_of = calloc(nb, sizeof(*s.hint_epoch_of));
    s.hint_prio = calloc(nb, sizeof(*s.hint_prio));
    s.hint_next = calloc(nb, sizeof(*s.hint_next));
    s.named = calloc(nb, 1);
    s.named_prio = calloc(nb, sizeof(*s.named_prio));
    int rc = -1;
    if (p == SIM_LRU_K_HINTS && t->n_hints > 0)
        s.by_pos = trace_blocks_by_position(t);
    if (!s.where || !s.hist || !s.pos || !s.scratch || !s.hinted || !s.fresh || !s.hint_prio || !s.hint_next ||
        !s.hint_epoch_of || !s.named || !s.named_prio || (p == SIM_LRU_K_HINTS && t->n_hints > 0 && !s.by_pos))
        goto out;
    memset(s.pos, 0xff, nb * sizeof(*s.pos));
    if (heap_init(&s.dev, s.cfg.device_blocks, s.pos) != 0 || heap_init(&s.host, s.cfg.host_blocks, s.pos) != 0)
        goto out;
    if (p == SIM_LCTRU && s.cfg.lctru_window == 0)
        s.cfg.lctru_window = 1;
    s.reuse_period = 3ull * s.cfg.device_blocks;
    if (p == SIM_ADAPTIVE) {
        /* As core/adaptive.c: the reuse order needs K >= 2; it starts as
         * LRU-K. */
        s.n_orders = s.cfg.lru_k >= 2 ? 3 : 2;
        s.order = s.best = ORDER_LRU_K;
        uint64_t mem = (uint64_t)s.cfg.device_blocks + s.cfg.host_blocks;
        s.decay_every = s.decay_left = mem * 32;
        for (uint32_t o = 0; o < s.n_orders; o++) {
            s.shadow_pos[o] = malloc(nb * sizeof(uint32_t));
            if (!s.shadow_pos[o] || heap_init(&s.shadow[o], s.cfg.device_blocks + 1, s.shadow_pos[o]) != 0)
                goto out;
            memset(s.shadow_pos[o], 0xff, nb * sizeof(uint32_t));
        }
    }
    size_t h = 0;
    for (size_t i = 0; i < t->n; i++) {
        for (; h < t->n_hints && t->hints[h].at <= i; h++)
            if (p == SIM_LRU_K_HINTS)
                apply_hint(&s, &t->hints[h]);
        /* The window's far end: prefetched if the queue names it. */
        size_t ahead = i + s.cfg.prefetch_ahead;
        if (p == SIM_LRU_K_HINTS && s.cfg.hint_promote && s.cfg.prefetch_ahead && ahead < t->n &&
            s.named[t->acc[ahead].block])
            hint_block(&s, t->acc[ahead].block, s.named_prio[t->acc[ahead].block], 1);
        access_block(&s, t->acc[i].block, (uint64_t)i + 1);
    }
    if (p == SIM_LRU_K_HINTS && s.cfg.hint_promote)
        sim_hits_by_fetches(out);
    rc = 0;
out:
    heap_free(&s.dev);
    heap_free(&s.host);
    for (uint32_t o = 0; o < 3; o++) {
        heap_free(&s.shadow[o]);
        free(s.shadow_pos[o]);
    }
    free(s.where);
    free(s.hist);
    free(s.pos);
    free(s.scratch);
    free(s.hinted);
    free(s.fresh);
    free(s.named);
    free(s.named_prio);
    free(s.hint_epoch_of);
    free(s.ring);
    free(s.hint_prio);
    free(s.hint_next);
    free(s.by_pos);
    return rc;
}

/* ------------------------------------------------------------------ */
/* Belady's MIN with bypass                                             */
/* ------------------------------------------------------------------ */

uint64_t sim_min_hits(const trace *t, uint32_t capacity)
{
    if (t->n == 0)
        return 0;
    if (capacity == 0)
        return 0;
    size_t nb = t->n_blocks;
    uint64_t *next_use = malloc(t->n * sizeof(*next_use));
    uint64_t *upcoming = malloc(nb * sizeof(*upcoming));
    uint32_t *pos = malloc(nb * sizeof(*pos));
    heap cache = {0};
    uint64_t hits = UINT64_MAX;
    if (!next_use || !upcoming || !pos || heap_init(&cache, capacity, pos) != 0)
        goto out;
    /* next_use[i]: index of the next access to the same block, or "never"
     * (UINT64_MAX). One backward pass. */
    for (size_t b = 0; b < nb; b++)
        upcoming[b] = UINT64_MAX;
    for (size_t i = t->n; i-- > 0;) {
        uint32_t b = t->acc[i].block;
        next_use[i] = upcoming[b];
        upcoming[b] = i;
    }
    memset(pos, 0xff, nb * sizeof(*pos));
    hits = 0;
    /* The heap's minimum is the block used farthest in the future: key =
     * ~next_use. */
    for (size_t i = 0; i < t->n; i++) {
        uint32_t b = t->acc[i].block;
        key k = {~next_use[i], 0};
        if (pos[b] != NO_POS) {
            hits++;
            heap_update(&cache, b, k);
            continue;
        }
        if (next_use[i] == UINT64_MAX)
            continue; /* never used again: keeping it cannot help */
        if (cache.size < capacity) {
            heap_push(&cache, b, k);
            continue;
        }
        if (key_less(k, cache.k[0]))
            continue; /* it is the farthest: bypass */
        heap_remove(&cache, cache.item[0]);
        heap_push(&cache, b, k);
    }
out:
    heap_free(&cache);
    free(next_use);
    free(upcoming);
    free(pos);
    return hits;
}

int sim_min(const trace *t, const sim_config *c, sim_result *out)
{
    memset(out, 0, sizeof(*out));
    uint64_t dev = sim_min_hits(t, c->device_blocks);
    uint64_t mem = sim_min_hits(t, c->device_blocks + c->host_blocks);
    if (dev == UINT64_MAX || mem == UINT64_MAX)
        return -1;
    out->accesses = t->n;
    out->first_accesses = t->n_blocks;
    out->hits_device = dev;
    out->hits_host = mem - dev;
    out->misses = t->n - mem;
    /* First accesses are computed in the device tier: no copy. */
    out->up_dh = t->n - dev - t->n_blocks;
    out->up_sh = out->misses - t->n_blocks;
    return 0;
}
