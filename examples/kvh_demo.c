/* kvh-demo-c: an end-to-end tour of the kvh C API.
 *
 * N agents share one system prompt. The first agent computes its KV once;
 * every agent then finds it with kvh_seq_match_prefix (the blocks are
 * shared, copy-on-write, and pinned in the device tier), appends its own
 * tokens and writes their K/V. Each agent forks its sequence (a "what if"
 * branch that rewrites the tail), then a streaming "attention" pass walks
 * every sequence in windows: acquire the window (device-resident), read
 * K/V, score it against a query, release. A second thread sends prefetch
 * hints for the next window while the current one is computed. The device
 * budget is small, so blocks spill to the host tier and come back.
 *
 * Finally every K/V byte of every sequence is read back and compared with
 * what was written; the program exits 1 on any mismatch or failed call.
 *
 *   kvh-demo-c [--agents N] [--device-mb N] [--host-mb N] [--lru-k K] [--quiet]
 */
#include <math.h>
#include <pthread.h>
#include <stdint.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include <kvh/kvh.h>

/* ---- geometry: 2 layers x 2 KV heads x head_dim 32, 16-token blocks,
 * f16: 8 KiB per block ---- */
#define LAYERS 2
#define HEADS 2
#define DIM 32
#define BLOCK_TOKENS 16
#define SYS_TOKENS 256 /* system prompt: 16 blocks */
#define WINDOW 128     /* attention window, tokens */

#define CHECK(call)                                                                                                    \
    do {                                                                                                               \
        kvh_status st_ = (call);                                                                                       \
        if (st_ != KVH_OK) {                                                                                           \
            fprintf(stderr, "kvh-demo-c: %s failed at %s:%d: %s: %s\n", #call, __FILE__, __LINE__,                     \
                    kvh_status_name(st_), kvh_last_error());                                                           \
            exit(1);                                                                                                   \
        }                                                                                                              \
    } while (0)

/* ------------------------------------------------------------------ */
/* synthetic K/V: a deterministic value per (stream, position, layer,   */
/* K or V, head, dim), stored as IEEE half precision                    */
/* ------------------------------------------------------------------ */

static uint64_t mix(uint64_t x)
{
    x ^= x >> 33;
    x *= 0xff51afd7ed558ccdull;
    x ^= x >> 33;
    x *= 0xc4ceb9fe1a85ec53ull;
    return x ^ (x >> 33);
}

/* float in [-1, 1) -> f16 bits (round toward zero; normal range only). */
static uint16_t f32_to_f16(float f)
{
    uint32_t x;
    memcpy(&x, &f, 4);
    uint32_t sign = (x >> 16) & 0x8000u;
    int32_t exp = (int32_t)((x >> 23) & 0xff) - 127 + 15;
    uint32_t man = (x >> 13) & 0x3ffu;
    if (exp <= 0)
        return (uint16_t)sign; /* tiny: flush to zero */
    return (uint16_t)(sign | ((uint32_t)exp << 10) | man);
}

static float f16_to_f32(uint16_t h)
{
    uint32_t sign = (uint32_t)(h & 0x8000u) << 16, exp = (h >> 10) & 0x1fu, man = h & 0x3ffu, x;
    if (exp == 0)
        x = sign; /* zero (no subnormals are produced above) */
    else
        x = sign | ((exp - 15 + 127) << 23) | (man << 13);
    float f;
    memcpy(&f, &x, 4);
    return f;
}

static uint16_t kv_value(uint32_t stream, uint64_t pos, uint32_t layer, uint32_t kv, uint32_t head, uint32_t d)
{
    uint64_t h = mix(((uint64_t)stream << 40) ^ (pos << 12) ^ (layer << 8) ^ (kv << 7) ^ (head << 5) ^ d);
    float f = (float)((double)(h >> 11) / 9007199254740992.0 * 2.0 - 1.0);
    return f32_to_f16(f);
}

/* Fills k and v ([n][HEADS][DIM]) for tokens [pos, pos + n) of one layer. */
static void make_kv(uint32_t stream, uint64_t pos, size_t n, uint32_t layer, uint16_t *k, uint16_t *v)
{
    for (size_t t = 0; t < n; t++)
        for (uint32_t h = 0; h < HEADS; h++)
            for (uint32_t d = 0; d < DIM; d++) {
                size_t i = (t * HEADS + h) * DIM + d;
                k[i] = kv_value(stream, pos + t, layer, 0, h, d);
                v[i] = kv_value(stream, pos + t, layer, 1, h, d);
            }
}

static void make_tokens(uint32_t stream, size_t n, int32_t *out)
{
    for (size_t i = 0; i < n; i++)
        out[i] = (int32_t)(mix(((uint64_t)stream << 32) | i) % 32000);
}

/* ------------------------------------------------------------------ */
/* what each sequence should contain                                    */
/* ------------------------------------------------------------------ */

enum { SYS_STREAM = 7 };

typedef struct track {
    kvh_seq seq;
    char name[32];
    uint32_t agent;
    uint64_t len;
    /* positions < split1 come from stream1 (the system prompt), < split2
     * from stream2, the rest from stream3. */
    uint64_t split1, split2;
    uint32_t stream1, stream2, stream3;
} track;

static uint32_t stream_at(const track *t, uint64_t pos)
{
    return pos < t->split1 ? t->stream1 : pos < t->split2 ? t->stream2 : t->stream3;
}

/* Appends n tokens of `stream` and writes their K/V on every layer. */
static void append_and_write(kvh_engine *e, track *t, uint32_t stream, size_t n)
{
    int32_t *tok = malloc(sizeof(int32_t) * n);
    uint16_t *k = malloc(sizeof(uint16_t) * n * HEADS * DIM), *v = malloc(sizeof(uint16_t) * n * HEADS * DIM);
    make_tokens(stream * 7919u + (uint32_t)t->len, n, tok);
    CHECK(kvh_seq_append(e, t->seq, tok, n));
    for (uint32_t l = 0; l < LAYERS; l++) {
        make_kv(stream, t->len, n, l, k, v);
        CHECK(kvh_seq_write_kv(e, t->seq, l, t->len, n, k, v));
    }
    t->len += n;
    free(tok);
    free(k);
    free(v);
}

/* Reads every K/V cell back; returns the number of wrong values. */
static uint64_t verify(kvh_engine *e, const track *t)
{
    uint64_t bad = 0;
    uint16_t k[WINDOW * HEADS * DIM], v[WINDOW * HEADS * DIM];
    for (uint64_t p = 0; p < t->len; p += WINDOW) {
        size_t n = t->len - p < WINDOW ? (size_t)(t->len - p) : WINDOW;
        for (uint32_t l = 0; l < LAYERS; l++) {
            CHECK(kvh_seq_read_kv(e, t->seq, l, p, n, k, v));
            for (size_t i = 0; i < n; i++)
                for (uint32_t h = 0; h < HEADS; h++)
                    for (uint32_t d = 0; d < DIM; d++) {
                        size_t x = (i * HEADS + h) * DIM + d;
                        uint32_t s = stream_at(t, p + i);
                        if (k[x] != kv_value(s, p + i, l, 0, h, d) || v[x] != kv_value(s, p + i, l, 1, h, d)) {
                            if (bad < 5)
                                fprintf(stderr, "  MISMATCH %s token %llu layer %u head %u dim %u\n", t->name,
                                        (unsigned long long)(p + i), l, h, d);
                            bad++;
                        }
                    }
        }
    }
    return bad;
}

/* ------------------------------------------------------------------ */
/* the prefetch thread                                                  */
/* ------------------------------------------------------------------ */

typedef struct hinter {
    kvh_engine *e;
    pthread_mutex_t lock;
    pthread_cond_t cond;
    int has_hint, done;
    kvh_seq seq;
    uint64_t first, n;
    uint64_t sent, failed;
} hinter;

static void *hint_main(void *arg)
{
    hinter *h = arg;
    pthread_mutex_lock(&h->lock);
    for (;;) {
        while (!h->has_hint && !h->done)
            pthread_cond_wait(&h->cond, &h->lock);
        if (!h->has_hint && h->done)
            break;
        kvh_seq s = h->seq;
        uint64_t first = h->first, n = h->n;
        h->has_hint = 0;
        pthread_mutex_unlock(&h->lock);
        /* Fire and forget: no fence; a hint never holds anything. */
        kvh_status st = kvh_prefetch(h->e, s, first, n, 1, NULL);
        pthread_mutex_lock(&h->lock);
        if (st == KVH_OK)
            h->sent++;
        else
            h->failed++;
    }
    pthread_mutex_unlock(&h->lock);
    return NULL;
}

static void hint(hinter *h, kvh_seq s, uint64_t first, uint64_t n)
{
    pthread_mutex_lock(&h->lock);
    h->seq = s;
    h->first = first;
    h->n = n;
    h->has_hint = 1; /* a newer hint replaces one not yet sent */
    pthread_cond_signal(&h->cond);
    pthread_mutex_unlock(&h->lock);
}

/* ------------------------------------------------------------------ */

static void usage(FILE *f)
{
    fprintf(f, "usage: kvh-demo-c [--agents N] [--device-mb N] [--host-mb N] [--lru-k K] [--quiet]\n"
               "\n"
               "End-to-end demo of the kvh C API on the CPU backend: N agents (default 4)\n"
               "share a pinned system prompt through kvh_seq_match_prefix, append and write\n"
               "synthetic K/V, fork, stream through their KV in acquired windows while a\n"
               "second thread sends prefetch hints, and finally every byte is read back and\n"
               "checked. The device tier is small (--device-mb, default 1) so blocks spill\n"
               "to the host tier (--host-mb, default 64). --lru-k sets the eviction policy's\n"
               "history depth (default 2). Exit status 1 on any mismatch.\n");
}

static int parse_uint(const char *s, unsigned long lo, unsigned long hi, unsigned long *out)
{
    char *end;
    unsigned long v = strtoul(s, &end, 10);
    if (!*s || *end || v < lo || v > hi)
        return -1;
    *out = v;
    return 0;
}

static void print_stats(const kvh_stats *s)
{
    const struct {
        const char *name;
        uint64_t v;
    } rows[] = {
        {"lookups", s->lookups},
        {"hits_device", s->hits_device},
        {"hits_host", s->hits_host},
        {"hits_disk", s->hits_disk},
        {"prefix_queries", s->prefix_queries},
        {"prefix_hit_blocks", s->prefix_hit_blocks},
        {"prefix_hit_tokens", s->prefix_hit_tokens},
        {"blocks_device_to_host", s->blocks_device_to_host},
        {"blocks_host_to_device", s->blocks_host_to_device},
        {"bytes_device_to_host", s->bytes_device_to_host},
        {"bytes_host_to_device", s->bytes_host_to_device},
        {"prefetch_issued", s->prefetch_issued},
        {"prefetch_useful", s->prefetch_useful},
        {"prefetch_late", s->prefetch_late},
        {"prefetch_wasted", s->prefetch_wasted},
        {"prefetch_skipped", s->prefetch_skipped},
        {"cow_copies", s->cow_copies},
        {"evictions", s->evictions},
        {"drops", s->drops},
        {"corrupt_blocks", s->corrupt_blocks},
        {"acquire_stall_ns", s->acquire_stall_ns},
        {"blocks_allocated", s->blocks_allocated},
        {"blocks_freed", s->blocks_freed},
    };
    for (size_t i = 0; i < sizeof(rows) / sizeof(rows[0]); i++)
        printf("    %-24s %llu\n", rows[i].name, (unsigned long long)rows[i].v);
}

static void print_tiers(kvh_engine *e, const char *when)
{
    static const char *names[KVH_TIER_COUNT] = {"device", "host", "disk"};
    printf("  tiers %s:\n", when);
    for (uint32_t t = 0; t < KVH_TIER_COUNT; t++) {
        kvh_tier_info ti = {.struct_size = sizeof(ti)};
        CHECK(kvh_tier_info_get(e, t, &ti));
        if (ti.capacity_blocks == 0) {
            printf("    %-7s (not configured)\n", names[t]);
            continue;
        }
        printf("    %-7s %5llu / %5llu blocks used (%5.1f%%), %llu pinned, %.2f MiB\n", names[t],
               (unsigned long long)ti.used_blocks, (unsigned long long)ti.capacity_blocks,
               100.0 * (double)ti.used_blocks / (double)ti.capacity_blocks, (unsigned long long)ti.pinned_blocks,
               (double)ti.used_bytes / (1 << 20));
    }
}

static int cmp_u64(const void *a, const void *b)
{
    uint64_t x = *(const uint64_t *)a, y = *(const uint64_t *)b;
    return x < y ? -1 : x > y;
}

int main(int argc, char **argv)
{
    unsigned long agents = 4, device_mb = 1, host_mb = 64, lru_k = 2;
    int quiet = 0;
    for (int i = 1; i < argc; i++) {
        if (!strcmp(argv[i], "--help") || !strcmp(argv[i], "-h")) {
            usage(stdout);
            return 0;
        } else if (!strcmp(argv[i], "--quiet")) {
            quiet = 1;
        } else if (i + 1 < argc && !strcmp(argv[i], "--agents")) {
            if (parse_uint(argv[++i], 1, 64, &agents)) {
                fprintf(stderr, "kvh-demo-c: --agents takes 1..64\n");
                return 2;
            }
        } else if (i + 1 < argc && !strcmp(argv[i], "--device-mb")) {
            if (parse_uint(argv[++i], 1, 65536, &device_mb)) {
                fprintf(stderr, "kvh-demo-c: --device-mb takes 1..65536\n");
                return 2;
            }
        } else if (i + 1 < argc && !strcmp(argv[i], "--lru-k")) {
            if (parse_uint(argv[++i], 1, 4, &lru_k)) {
                fprintf(stderr, "kvh-demo-c: --lru-k takes 1..4\n");
                return 2;
            }
        } else if (i + 1 < argc && !strcmp(argv[i], "--host-mb")) {
            if (parse_uint(argv[++i], 1, 1048576, &host_mb)) {
                fprintf(stderr, "kvh-demo-c: --host-mb takes 1..1048576\n");
                return 2;
            }
        } else {
            fprintf(stderr, "kvh-demo-c: unknown argument '%s'\n", argv[i]);
            usage(stderr);
            return 2;
        }
    }

    /* ---- 1. the engine ---- */
    kvh_config cfg;
    CHECK(kvh_config_init(&cfg, sizeof(cfg)));
    cfg.backend = KVH_BACKEND_CPU;
    cfg.num_layers = LAYERS;
    cfg.num_kv_heads = HEADS;
    cfg.head_dim = DIM;
    cfg.block_tokens = BLOCK_TOKENS;
    cfg.dtype = KVH_DTYPE_F16;
    cfg.device_bytes = (uint64_t)device_mb << 20;
    cfg.host_bytes = (uint64_t)host_mb << 20;
    cfg.model_salt = 0x64656d6fu; /* "demo": the model identity of prefix hashes */
    cfg.migration_threads = 2;
    cfg.lru_k = (uint32_t)lru_k;
    kvh_engine *e = NULL;
    CHECK(kvh_engine_open(&cfg, &e));
    uint64_t block_bytes = 0;
    CHECK(kvh_engine_block_bytes(e, &block_bytes));
    printf("kvh %s, backend %s: %u layers x %u KV heads x head_dim %u, %u tokens per block, f16 = %llu KiB "
           "per block\n",
           kvh_version_string(), kvh_engine_backend(e), LAYERS, HEADS, DIM, BLOCK_TOKENS,
           (unsigned long long)(block_bytes >> 10));
    printf("device tier %lu MiB, host tier %lu MiB, %lu agents\n\n", device_mb, host_mb, agents);

    track *tr = calloc(2 * agents + 1, sizeof(track));
    size_t ntr = 0;

    /* ---- 2. the system prompt, computed once ---- */
    track *sys = &tr[ntr++];
    snprintf(sys->name, sizeof(sys->name), "system-prompt");
    sys->split1 = sys->split2 = UINT64_MAX;
    sys->stream1 = SYS_STREAM;
    CHECK(kvh_seq_create(e, 0, &sys->seq));
    int32_t sys_tokens[SYS_TOKENS];
    make_tokens(SYS_STREAM * 7919u, SYS_TOKENS, sys_tokens);
    {
        uint16_t *k = malloc(sizeof(uint16_t) * SYS_TOKENS * HEADS * DIM);
        uint16_t *v = malloc(sizeof(uint16_t) * SYS_TOKENS * HEADS * DIM);
        CHECK(kvh_seq_append(e, sys->seq, sys_tokens, SYS_TOKENS));
        for (uint32_t l = 0; l < LAYERS; l++) {
            make_kv(SYS_STREAM, 0, SYS_TOKENS, l, k, v);
            CHECK(kvh_seq_write_kv(e, sys->seq, l, 0, SYS_TOKENS, k, v));
        }
        free(k);
        free(v);
        sys->len = SYS_TOKENS;
    }
    /* Pin it: the shared prefix never leaves the device tier. */
    CHECK(kvh_seq_pin(e, sys->seq, 0, SYS_TOKENS, 1));
    printf("[1] system prompt: %d tokens (%d blocks) written once and pinned in the device tier\n", SYS_TOKENS,
           SYS_TOKENS / BLOCK_TOKENS);

    /* ---- 3. agents: match the shared prefix, then their own tokens ---- */
    track *ag = &tr[ntr];
    ntr += agents;
    for (uint32_t a = 0; a < agents; a++) {
        track *t = &ag[a];
        snprintf(t->name, sizeof(t->name), "agent-%u", a);
        t->agent = a + 1;
        t->split1 = SYS_TOKENS;
        t->split2 = UINT64_MAX;
        t->stream1 = SYS_STREAM;
        t->stream2 = 100 + a;
        CHECK(kvh_seq_create(e, t->agent, &t->seq));
        /* The agent's prompt starts with the system prompt: attach the
         * cached blocks instead of recomputing them. */
        size_t matched = 0;
        CHECK(kvh_seq_match_prefix(e, t->seq, sys_tokens, SYS_TOKENS, &matched));
        if (matched != SYS_TOKENS) {
            fprintf(stderr, "kvh-demo-c: agent %u matched %zu of %d system-prompt tokens\n", a, matched, SYS_TOKENS);
            return 1;
        }
        t->len = matched;
        /* Its own conversation: 400..700 tokens, in a few turns. */
        size_t own = 400 + 100 * (a % 4);
        for (size_t done = 0; done < own;) {
            size_t turn = own - done < 150 ? own - done : 150;
            append_and_write(e, t, t->stream2, turn);
            done += turn;
        }
        if (!quiet)
            printf("[2] %s: matched %zu cached tokens, appended %zu of its own -> %llu tokens\n", t->name, matched, own,
                   (unsigned long long)t->len);
    }
    print_tiers(e, "after the agents wrote their KV");

    /* ---- 4. forks: each agent branches and rewrites the tail ---- */
    track *fk = &tr[ntr];
    ntr += agents;
    for (uint32_t a = 0; a < agents; a++) {
        track *p = &ag[a], *c = &fk[a];
        *c = *p;
        snprintf(c->name, sizeof(c->name), "agent-%u/fork", a);
        CHECK(kvh_seq_fork(e, p->seq, p->agent, &c->seq));
        /* Drop the last 40 tokens (mid-block) and continue differently:
         * the shared partial block is copied on write. */
        uint64_t cut = p->len - 40;
        CHECK(kvh_seq_truncate(e, c->seq, cut));
        c->len = cut;
        c->split2 = cut;
        c->stream3 = 200 + a;
        append_and_write(e, c, c->stream3, 80);
        if (!quiet)
            printf("[3] %s: forked from %s at %llu tokens, rewrote the tail -> %llu tokens\n", c->name, p->name,
                   (unsigned long long)cut, (unsigned long long)c->len);
    }

    /* ---- 5. attention over acquired windows, prefetching the next ---- */
    hinter h = {.e = e};
    pthread_mutex_init(&h.lock, NULL);
    pthread_cond_init(&h.cond, NULL);
    pthread_t hint_thread;
    if (pthread_create(&hint_thread, NULL, hint_main, &h) != 0) {
        fprintf(stderr, "kvh-demo-c: cannot start the prefetch thread\n");
        return 1;
    }
    size_t n_attn = ntr - 1; /* every agent and fork */
    track *attn = &tr[1];
    uint64_t windows = 0;
    double checksum = 0;
    uint16_t k[WINDOW * HEADS * DIM], v[WINDOW * HEADS * DIM];
    float q[DIM];
    for (uint32_t d = 0; d < DIM; d++)
        q[d] = f16_to_f32(kv_value(999, d, 0, 0, 0, d));
    for (size_t i = 0; i < n_attn; i++) {
        track *t = &attn[i];
        for (uint64_t p = 0; p < t->len; p += WINDOW) {
            uint64_t n = t->len - p < WINDOW ? t->len - p : WINDOW;
            /* Hint the window after this one (or the next sequence's first). */
            if (p + n < t->len)
                hint(&h, t->seq, p + n, t->len - (p + n) < WINDOW ? t->len - (p + n) : WINDOW);
            else if (i + 1 < n_attn)
                hint(&h, attn[i + 1].seq, 0, attn[i + 1].len < WINDOW ? attn[i + 1].len : WINDOW);
            CHECK(kvh_seq_acquire(e, t->seq, p, n, NULL)); /* resident in the device tier now */
            /* One decode step of single-head attention per layer:
             * softmax(q.K / sqrt(d)) . V over the window. */
            for (uint32_t l = 0; l < LAYERS; l++) {
                CHECK(kvh_seq_read_kv(e, t->seq, l, p, (size_t)n, k, v));
                double mx = -INFINITY, den = 0, out = 0;
                double *sc = malloc(sizeof(double) * n);
                for (uint64_t s = 0; s < n; s++) {
                    double dot = 0;
                    for (uint32_t d = 0; d < DIM; d++)
                        dot += q[d] * f16_to_f32(k[(s * HEADS) * DIM + d]);
                    sc[s] = dot / sqrt((double)DIM);
                    if (sc[s] > mx)
                        mx = sc[s];
                }
                for (uint64_t s = 0; s < n; s++) {
                    double w = exp(sc[s] - mx);
                    den += w;
                    out += w * f16_to_f32(v[(s * HEADS) * DIM]);
                }
                checksum += out / den;
                free(sc);
            }
            CHECK(kvh_seq_release(e, t->seq, p, n));
            windows++;
        }
    }
    pthread_mutex_lock(&h.lock);
    h.done = 1;
    pthread_cond_signal(&h.cond);
    pthread_mutex_unlock(&h.lock);
    pthread_join(hint_thread, NULL);
    printf("[4] attention: %llu windows of <= %d tokens acquired, scored and released over %zu sequences "
           "(checksum %.6f)\n",
           (unsigned long long)windows, WINDOW, n_attn, checksum);
    printf("    prefetch thread sent %llu hints (%llu refused)\n", (unsigned long long)h.sent,
           (unsigned long long)h.failed);

    /* ---- 6. report ---- */
    printf("\nsequences:\n");
    uint64_t total_refs = 0;
    size_t cap = 0;
    for (size_t i = 0; i < ntr; i++)
        cap += (size_t)((tr[i].len + BLOCK_TOKENS - 1) / BLOCK_TOKENS);
    uint64_t *all = malloc(sizeof(uint64_t) * (cap ? cap : 1));
    size_t nall = 0;
    for (size_t i = 0; i < ntr; i++) {
        track *t = &tr[i];
        uint64_t len = 0;
        CHECK(kvh_seq_length(e, t->seq, &len));
        if (len != t->len) {
            fprintf(stderr, "kvh-demo-c: %s has %llu tokens, expected %llu\n", t->name, (unsigned long long)len,
                    (unsigned long long)t->len);
            return 1;
        }
        size_t nb = (size_t)((len + BLOCK_TOKENS - 1) / BLOCK_TOKENS);
        kvh_block *bl = malloc(sizeof(kvh_block) * (nb ? nb : 1));
        CHECK(kvh_seq_blocks(e, t->seq, 0, nb, bl));
        size_t shared = 0, on_device = 0;
        for (size_t b = 0; b < nb; b++) {
            kvh_block_info bi = {.struct_size = sizeof(bi)};
            CHECK(kvh_block_info_get(e, bl[b], &bi));
            shared += bi.refs > 1;
            on_device += bi.tier == KVH_TIER_DEVICE;
            all[nall++] = bl[b].id;
        }
        total_refs += nb;
        printf("  %-16s %5llu tokens  %3zu blocks  %3zu shared  %3zu in device tier\n", t->name,
               (unsigned long long)len, nb, shared, on_device);
        free(bl);
    }
    qsort(all, nall, sizeof(uint64_t), cmp_u64);
    size_t distinct = 0, multi = 0;
    for (size_t i = 0; i < nall;) {
        size_t j = i;
        while (j < nall && all[j] == all[i])
            j++;
        distinct++;
        multi += j - i > 1;
        i = j;
    }
    free(all);
    printf("  block-table entries %llu -> %zu distinct blocks (%zu shared by 2+ sequences); sharing saved %.1f "
           "MiB\n",
           (unsigned long long)total_refs, distinct, multi,
           (double)(total_refs - distinct) * (double)block_bytes / (1 << 20));
    print_tiers(e, "at the end");
    kvh_stats st = {.struct_size = sizeof(st)};
    CHECK(kvh_engine_stats(e, &st));
    printf("  engine counters:\n");
    print_stats(&st);

    /* ---- 7. verify every byte ---- */
    uint64_t bad = 0, cells = 0;
    for (size_t i = 0; i < ntr; i++) {
        bad += verify(e, &tr[i]);
        cells += tr[i].len * LAYERS * HEADS * DIM * 2;
    }
    printf("\nverify: %llu K/V values in %zu sequences read back: %s\n", (unsigned long long)cells, ntr,
           bad ? "MISMATCH" : "all match");
    if (bad)
        fprintf(stderr, "kvh-demo-c: %llu values differ from what was written\n", (unsigned long long)bad);

    CHECK(kvh_seq_pin(e, sys->seq, 0, SYS_TOKENS, 0));
    for (size_t i = 0; i < ntr; i++)
        CHECK(kvh_seq_free(e, tr[i].seq));
    CHECK(kvh_engine_close(e));
    free(tr);
    pthread_mutex_destroy(&h.lock);
    pthread_cond_destroy(&h.cond);
    return bad ? 1 : 0;
}
