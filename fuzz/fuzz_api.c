/* Fuzz target: random sequences of ABI calls with random handles and
 * arguments, on one engine (disk tier or not, 0-2 migration workers, per
 * the first byte).
 *
 * Each step: an opcode byte, then the arguments it needs. Handles come from
 * small pools of real ones (live, freed, of a closed engine) or straight
 * from the input (forged). Buffers are always as large as the lengths the
 * harness passes -- the ABI cannot check a caller's buffer, so lying about
 * one is not something a library can survive. Likewise kvh_block_release
 * is only called on references the harness holds (from kvh_block_alloc,
 * retain, prefix_lookup, pool_offload) or on forged values: releasing a
 * sequence's own reference is a misuse the library does not detect (see
 * tests/RELIABILITY.md), and block handles of a closed engine are dropped
 * at reopen (they can alias blocks of the new engine, also reported
 * there).
 *
 * K/V content is a pure function of (token id, layer, K or V, byte), so
 * whatever the calls did -- forks, copy-on-write, truncation, prefix
 * matches, pool offloads, migrations -- every successful read can be
 * checked: wrong bytes abort (a real bug, not an ABI misuse).
 *
 * Properties: no crash or sanitizer report, documented status codes only,
 * out-parameters untouched on failure, correct K/V on every read, the
 * engine closes with KVH_OK.
 */
#include "fuzz_common.h"

enum { L = 2, H = 2, D = 4, BT = 4, TOK = H * D * 2, MAXN = 24, NSEQ = 8, NBLK = 16, NFEN = 8, NPOOL = 2 };

static uint8_t kv_byte(int32_t token, uint32_t layer, int kv, size_t j)
{
    return (uint8_t)fz_mix(((uint64_t)(uint32_t)token << 20) ^ ((uint64_t)layer << 12) ^ ((uint64_t)kv << 10) ^ j);
}

static void fill_kv(const int32_t *tokens, size_t n, uint32_t layer, uint8_t *k, uint8_t *v)
{
    for (size_t t = 0; t < n; t++)
        for (size_t j = 0; j < TOK; j++) {
            k[t * TOK + j] = kv_byte(tokens[t], layer, 0, j);
            v[t * TOK + j] = kv_byte(tokens[t], layer, 1, j);
        }
}

typedef struct state {
    kvh_engine *e;
    kvh_config cfg;
    bool disk;
    uint64_t seqs[NSEQ], blocks[NBLK], fences[NFEN], pools[NPOOL];
    uint64_t owned[NBLK]; /* block references the harness holds ... */
    uint32_t owned_refs[NBLK]; /* ... and how many */
    uint8_t pool_mem[NPOOL][2 * L][4 * BT * TOK]; /* [layer*2 + kv][slot][token][head][dim] */
    void *kbase[NPOOL][L], *vbase[NPOOL][L];
    int32_t prompts[4][MAXN];
} state;

static uint64_t pick(fz_in *in, const uint64_t *pool, int n)
{
    uint8_t c = fz_u8(in);
    if (c < 200)
        return pool[c % n];
    if (c < 230)
        return fz_u64(in); /* forged */
    return 0; /* the null handle */
}

static void keep(uint64_t *pool, int n, fz_in *in, uint64_t h) { pool[fz_u8(in) % n] = h; }

/* One more reference the harness holds on block h. */
static void own(state *s, uint64_t h)
{
    int free_i = -1;
    for (int i = 0; i < NBLK; i++) {
        if (s->owned[i] == h && s->owned_refs[i]) {
            s->owned_refs[i]++;
            return;
        }
        if (!s->owned_refs[i] && free_i < 0)
            free_i = i;
    }
    if (free_i >= 0) {
        s->owned[free_i] = h;
        s->owned_refs[free_i] = 1;
    }
    /* else: the reference leaks into the engine (freed at close) */
}

static size_t tokens_from(fz_in *in, state *s, int32_t *tk)
{
    size_t n = fz_u8(in) % (MAXN + 1);
    uint8_t src = fz_u8(in);
    for (size_t i = 0; i < n; i++)
        tk[i] = src < 160 ? s->prompts[src % 4][i] : (int32_t)(fz_u8(in) % 8);
    return n;
}

/* Reads [pos, pos + n) of seq and checks it against the token ids. */
static void check_read(state *s, kvh_seq q, uint32_t layer, uint64_t pos, size_t n)
{
    uint8_t k[MAXN * TOK], v[MAXN * TOK], wk[MAXN * TOK], wv[MAXN * TOK];
    int32_t tk[MAXN];
    if (n > MAXN)
        n = MAXN;
    kvh_status st = kvh_seq_read_kv(s->e, q, layer, pos, n, k, v);
    FZ_KNOWN(st);
    if (st != KVH_OK)
        return;
    FZ_CHECK(kvh_seq_tokens(s->e, q, pos, n, tk) == KVH_OK, "tokens of a range that was just read");
    fill_kv(tk, n, layer, wk, wv);
    FZ_CHECK(!memcmp(k, wk, n * TOK) && !memcmp(v, wv, n * TOK),
             "wrong K/V served: layer %u tokens [%llu, +%zu)", layer, (unsigned long long)pos, n);
}

static void open_engine(state *s)
{
    s->e = NULL;
    kvh_status st = kvh_engine_open(&s->cfg, &s->e);
    FZ_CHECK(st == KVH_OK, "open: %s: %s", kvh_status_name(st), kvh_last_error());
}

static void step(state *s, fz_in *in)
{
    kvh_engine *e = s->e;
    uint8_t op = fz_u8(in) % 40;
    kvh_status st = KVH_OK;
    int32_t tk[MAXN];
    uint8_t k[MAXN * TOK], v[MAXN * TOK];
    const uint64_t SENT = 0x5e5e5e5e5e5e5e5eull;
    kvh_seq q = {pick(in, s->seqs, NSEQ)}, out_s = {SENT};
    kvh_block b = {pick(in, s->blocks, NBLK)}, out_b = {SENT};
    kvh_fence f = {pick(in, s->fences, NFEN)}, out_f = {SENT};
    kvh_pool p = {pick(in, s->pools, NPOOL)}, out_p = {SENT};
    uint64_t u64 = SENT;
    size_t sz = SENT;
    bool want_fence = fz_u8(in) & 1;
    switch (op) {
    case 0:
    case 1:
        st = kvh_seq_create(e, fz_u8(in) % 4, &out_s);
        if (st == KVH_OK)
            keep(s->seqs, NSEQ, in, out_s.id);
        break;
    case 2:
        st = kvh_seq_free(e, q);
        break;
    case 3:
        st = kvh_seq_fork(e, q, fz_u8(in) % 4, &out_s);
        if (st == KVH_OK)
            keep(s->seqs, NSEQ, in, out_s.id);
        break;
    case 4:
    case 5: { /* append, then write all layers of what was appended */
        size_t n = tokens_from(in, s, tk);
        uint64_t len = 0;
        st = kvh_seq_length(e, q, &len);
        if (st == KVH_OK && (st = kvh_seq_append(e, q, tk, n)) == KVH_OK)
            for (uint32_t l = 0; l < L && st == KVH_OK; l++) {
                fill_kv(tk, n, l, k, v);
                if (fz_u8(in) < 230)
                    st = kvh_seq_write_kv(e, q, l, len, n, k, v);
            }
        break;
    }
    case 6: { /* write_kv of a random range: content from its token ids */
        uint64_t pos = fz_u8(in) % 64;
        size_t n = fz_u8(in) % (MAXN + 1);
        uint32_t layer = fz_u8(in) % (L + 1);
        st = kvh_seq_tokens(e, q, pos, n, tk);
        if (st == KVH_OK) {
            fill_kv(tk, n, layer < L ? layer : 0, k, v);
            st = kvh_seq_write_kv(e, q, layer, pos, n, k, v);
        } else
            st = kvh_seq_write_kv(e, q, layer, pos, n, k, v); /* out of range: must fail */
        break;
    }
    case 7:
    case 8:
        check_read(s, q, fz_u8(in) % (L + 1), fz_u8(in) % 64, fz_u8(in) % (MAXN + 1));
        return;
    case 9:
        st = kvh_seq_length(e, q, &u64);
        break;
    case 10:
        st = kvh_seq_tokens(e, q, fz_u8(in) % 64, fz_u8(in) % (MAXN + 1), tk);
        break;
    case 11:
        st = kvh_seq_persist(e, q);
        break;
    case 12:
        st = kvh_seq_truncate(e, q, fz_u8(in) % 64);
        break;
    case 13: {
        size_t n = tokens_from(in, s, tk);
        st = kvh_seq_match_prefix(e, q, tk, n, &sz);
        if (st == KVH_OK) {
            FZ_CHECK(sz <= n && sz % BT == 0, "matched %zu of %zu", sz, n);
            check_read(s, q, 0, 0, sz);
            check_read(s, q, 1, 0, sz);
        }
        break;
    }
    case 14:
    case 15: {
        uint64_t first = fz_u8(in) % 40, n = fz_u8(in) % 40;
        st = kvh_seq_acquire(e, q, first, n, want_fence ? &out_f : NULL);
        if (st == KVH_OK && want_fence)
            keep(s->fences, NFEN, in, out_f.id);
        if (st == KVH_OK && fz_u8(in) & 1) {
            check_read(s, q, 0, first, n);
            kvh_status r = kvh_seq_release(e, q, first, n);
            FZ_KNOWN(r);
        }
        break;
    }
    case 16:
        st = kvh_seq_release(e, q, fz_u8(in) % 40, fz_u8(in) % 40);
        break;
    case 17:
        st = kvh_seq_pin(e, q, fz_u8(in) % 40, fz_u8(in) % 40, fz_u8(in) & 1);
        break;
    case 18: {
        kvh_block bl[4] = {{SENT}, {SENT}, {SENT}, {SENT}};
        size_t n = fz_u8(in) % 5;
        st = kvh_seq_blocks(e, q, fz_u8(in) % 12, n, bl);
        for (size_t i = 0; st == KVH_OK && i < n; i++)
            keep(s->blocks, NBLK, in, bl[i].id);
        break;
    }
    case 19: {
        kvh_seq batch[3] = {q, {pick(in, s->seqs, NSEQ)}, {pick(in, s->seqs, NSEQ)}};
        int32_t indptr[4], idx[64], lpl[3];
        st = kvh_block_table(e, batch, fz_u8(in) % 4, indptr, idx, fz_u8(in) % 65, lpl);
        break;
    }
    case 20: {
        kvh_block_info bi = {.struct_size = fz_u8(in) < 240 ? sizeof(bi) : fz_u8(in)};
        st = kvh_block_info_get(e, b, &bi);
        break;
    }
    case 21:
        st = kvh_block_alloc(e, fz_u8(in) % 4, &out_b);
        if (st == KVH_OK) {
            keep(s->blocks, NBLK, in, out_b.id);
            own(s, out_b.id);
        }
        break;
    case 22:
        st = kvh_block_retain(e, b);
        if (st == KVH_OK)
            own(s, b.id);
        break;
    case 23: { /* release a reference the harness holds, or a forged value */
        int i = fz_u8(in) % (NBLK + 1);
        if (i < NBLK && s->owned_refs[i]) {
            st = kvh_block_release(e, (kvh_block){s->owned[i]});
            FZ_CHECK(st == KVH_OK, "release of a held reference: %s", kvh_status_name(st));
            s->owned_refs[i]--;
        } else {
            uint64_t forged = fz_u64(in) | 1;
            bool live = false;
            for (int j = 0; j < NBLK; j++)
                live |= forged == s->blocks[j] || forged == s->owned[j];
            if (!live)
                st = kvh_block_release(e, (kvh_block){forged});
        }
        break;
    }
    case 24:
        st = kvh_block_pin(e, b, fz_u8(in) & 1);
        break;
    case 25: {
        kvh_block bl[3] = {b, {pick(in, s->blocks, NBLK)}, {pick(in, s->blocks, NBLK)}};
        st = kvh_migrate(e, bl, fz_u8(in) % 4, fz_u8(in) % 4, want_fence ? &out_f : NULL);
        if (st == KVH_OK && want_fence)
            keep(s->fences, NFEN, in, out_f.id);
        break;
    }
    case 26:
        st = kvh_seq_migrate(e, q, fz_u8(in) % 40, fz_u8(in) % 40, fz_u8(in) % 4, want_fence ? &out_f : NULL);
        if (st == KVH_OK && want_fence)
            keep(s->fences, NFEN, in, out_f.id);
        break;
    case 27:
        st = kvh_prefetch(e, q, fz_u8(in) % 40, fz_u8(in) % 40, (int32_t)fz_u32(in), want_fence ? &out_f : NULL);
        if (st == KVH_OK && want_fence)
            keep(s->fences, NFEN, in, out_f.id);
        break;
    case 28:
        st = kvh_fence_wait(e, f, fz_u8(in) < 128 ? 0 : 1000000);
        break;
    case 29: {
        int32_t done = 7;
        st = kvh_fence_poll(e, f, &done);
        FZ_CHECK(st == KVH_OK || st == KVH_ERR_BAD_HANDLE || done == 1, "poll failed but done=%d", done);
        break;
    }
    case 30:
        st = kvh_fence_free(e, f);
        break;
    case 31: {
        size_t n = tokens_from(in, s, tk);
        st = kvh_prefix_hash(e, fz_u64(in), tk, n, &u64);
        break;
    }
    case 32: {
        size_t n = tokens_from(in, s, tk);
        kvh_block bl[6];
        size_t cap = fz_u8(in) % 7;
        st = kvh_prefix_lookup(e, tk, n, bl, cap, &sz);
        if (st == KVH_OK) {
            FZ_CHECK(sz <= cap && sz <= n / BT, "lookup found %zu (cap %zu, n %zu)", sz, cap, n);
            for (size_t i = 0; i < sz; i++) {
                if (fz_u8(in) & 1) {
                    keep(s->blocks, NBLK, in, bl[i].id);
                    own(s, bl[i].id); /* a reference the harness may release later */
                } else
                    FZ_CHECK(kvh_block_release(e, bl[i]) == KVH_OK, "release of a looked-up block");
            }
        }
        break;
    }
    case 33: { /* register a pool over harness memory (always large enough) */
        int i = fz_u8(in) % NPOOL;
        kvh_pool_layout lay = {.struct_size = fz_u8(in) < 240 ? sizeof(lay) : fz_u8(in),
                               .memory = fz_u8(in) % 3,
                               .num_slots = fz_u8(in) % 6,
                               .k_base = (void *const *)s->kbase[i],
                               .v_base = (void *const *)s->vbase[i],
                               .slot_stride = BT * TOK,
                               .token_stride = TOK,
                               .head_stride = D * 2};
        if (lay.num_slots > 4)
            lay.num_slots = 4;
        st = kvh_pool_register(e, &lay, &out_p);
        if (st == KVH_OK)
            s->pools[i] = out_p.id;
        break;
    }
    case 34:
        st = kvh_pool_unregister(e, p);
        break;
    case 35: { /* offload: the pool slot gets the content of its tokens first */
        uint32_t slot = fz_u8(in) % 6;
        size_t n = tokens_from(in, s, tk);
        int pi = -1;
        for (int i = 0; i < NPOOL; i++)
            if (s->pools[i] == p.id)
                pi = i;
        if (pi >= 0 && slot < 4 && n >= BT)
            for (uint32_t l = 0; l < L; l++)
                fill_kv(tk, BT, l, &s->pool_mem[pi][2 * l][slot * BT * TOK], &s->pool_mem[pi][2 * l + 1][slot * BT * TOK]);
        uint64_t parent = 0;
        if (fz_u8(in) & 1)
            kvh_prefix_hash(e, 0, s->prompts[0], BT, &parent);
        st = kvh_pool_offload(e, p, slot, parent, tk, n, fz_u8(in) % 4, &out_b);
        if (st == KVH_OK) {
            keep(s->blocks, NBLK, in, out_b.id);
            own(s, out_b.id);
        }
        break;
    }
    case 36:
        st = kvh_pool_restore(e, p, b, fz_u8(in) % 6);
        break;
    case 37: { /* attention over up to 2 sequences, buffers sized for them */
        kvh_seq batch[2] = {q, {pick(in, s->seqs, NSEQ)}};
        size_t n = fz_u8(in) % 3;
        uint32_t qlens[2] = {fz_u8(in) % 5, fz_u8(in) % 5};
        float qv[8 * H * D], ov[8 * H * D];
        memset(qv, 0, sizeof(qv));
        kvh_attention_params ap;
        kvh_attention_params_init(&ap, sizeof(ap));
        ap.threads = 1;
        ap.num_q_heads = fz_u8(in) & 1 ? H : 0;
        uint32_t layer = fz_u8(in) % (L + 1);
        st = fz_u8(in) & 1 ? kvh_attention_decode(e, layer, batch, n, qv, ov, &ap)
                           : kvh_attention_prefill(e, layer, batch, qlens, n, qv, ov, &ap);
        break;
    }
    case 38: {
        kvh_stats stt = {.struct_size = sizeof(stt)};
        st = kvh_engine_stats(e, &stt);
        FZ_CHECK(st == KVH_OK && stt.blocks_allocated >= stt.blocks_freed, "stats");
        kvh_tier_info ti = {.struct_size = sizeof(ti)};
        st = kvh_tier_info_get(e, fz_u8(in) % 4, &ti);
        if (st == KVH_OK)
            FZ_CHECK(ti.used_bytes == ti.used_blocks * ti.block_bytes, "tier occupancy");
        st = kvh_agent_set_quota(e, fz_u8(in) % 4, (uint64_t)(fz_u8(in) % 4) * 2 * L * BT * TOK);
        break;
    }
    default: /* close and reopen: every handle held becomes stale */
        FZ_CHECK(kvh_engine_close(e) == KVH_OK, "close: %s", kvh_last_error());
        open_engine(s);
        for (int i = 0; i < NPOOL; i++)
            s->pools[i] = 0;
        for (int i = 0; i < NBLK; i++)
            s->blocks[i] = s->owned[i] = s->owned_refs[i] = 0;
        return;
    }
    FZ_KNOWN(st);
    if (st != KVH_OK) {
        FZ_CHECK(out_s.id == SENT && out_b.id == SENT && out_p.id == SENT,
                 "an out-parameter was written by a failing call (op %u: %s)", op, kvh_status_name(st));
        FZ_CHECK(op == 28 || op == 29 || op == 9 || u64 == SENT || op == 31, "u64 written on failure (op %u)", op);
    }
}

int LLVMFuzzerTestOneInput(const uint8_t *data, size_t size)
{
    fz_in in = {data, size, 0};
    static state s;
    memset(&s, 0, sizeof(s));
    uint8_t mode = fz_u8(&in);
    kvh_config_init(&s.cfg, sizeof(s.cfg));
    s.cfg.num_layers = L;
    s.cfg.num_kv_heads = H;
    s.cfg.head_dim = D;
    s.cfg.block_tokens = BT;
    s.cfg.dtype = KVH_DTYPE_F16;
    s.cfg.backend = KVH_BACKEND_CPU;
    uint64_t bb = 2ull * L * BT * TOK;
    s.cfg.device_bytes = (2 + mode % 6) * bb;
    s.cfg.host_bytes = ((mode >> 3) % 8) * bb;
    s.cfg.migration_threads = (mode >> 6) % 3;
    s.disk = mode & 4;
    if (s.disk) {
        const char *dir = fz_dir("api");
        fz_clear(dir);
        s.cfg.disk_path = dir;
        s.cfg.disk_bytes = 24 * 8192;
        s.cfg.disk_flags = KVH_DISK_BUFFERED;
    }
    for (int i = 0; i < 4; i++)
        for (int t = 0; t < MAXN; t++)
            s.prompts[i][t] = (int32_t)((t * 7 + i * (t / 8 + 1)) % 13);
    for (int i = 0; i < NPOOL; i++)
        for (int l = 0; l < L; l++) {
            s.kbase[i][l] = s.pool_mem[i][2 * l];
            s.vbase[i][l] = s.pool_mem[i][2 * l + 1];
        }
    open_engine(&s);
    for (int steps = 0; steps < 400 && !fz_done(&in); steps++)
        step(&s, &in);
    kvh_status st = kvh_engine_close(s.e);
    FZ_CHECK(st == KVH_OK, "close: %s: %s", kvh_status_name(st), kvh_last_error());
    return 0;
}
