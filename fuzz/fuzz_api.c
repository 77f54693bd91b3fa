/* Fuzz target: random sequences of ABI calls with random handles and
 * arguments, on one engine (disk tier or not, 0-2 migration workers, per
 * the first byte; when its top two bits are set, a second byte chooses
 * views (kvh_config.vmap), a kv_codec and the eviction policy).
 *
 * Each step: an opcode byte, then the arguments it needs. Opcodes below
 * 240 are the block, sequence, migration, prefix, pool and attention calls
 * (this file); 240..255 the weight contexts, admission, codecs, tolerance
 * setters, views and attention plans (fuzz/api_ops_*.h). Handles come from
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
#include "api_harness.h"
#include "api_ops_codecs.h"
#include "api_ops_contexts.h"
#include "api_ops_views.h"

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

static void open_engine(state *s)
{
    s->e = NULL;
    kvh_status st = kvh_engine_open(&s->cfg, &s->e);
    FZ_CHECK(st == KVH_OK, "open: %s: %s", kvh_status_name(st), kvh_last_error());
}

/* Opcode bytes 240..255: the calls added after the first corpus was
 * recorded (below 240 an opcode byte means what it always meant). */
static void newer_step(state *s, fz_in *in, uint8_t op)
{
    switch (op) {
    case 0:
        op_context_create(s, in);
        break;
    case 1:
        op_context_destroy(s, in);
        break;
    case 2:
        op_context_add_region(s, in);
        break;
    case 3:
        op_context_attach_seq(s, in);
        break;
    case 4:
        op_context_switch(s, in);
        break;
    case 5:
        op_context_wait_layer(s, in);
        break;
    case 6:
        op_context_region_data(s, in);
        break;
    case 7:
        op_context_query(s, in);
        break;
    case 8:
        op_admission_configure(s, in);
        break;
    case 9:
        op_seq_create_ex(s, in);
        break;
    case 10:
        op_codec(s, in);
        break;
    case 11:
        op_tolerance(s, in);
        break;
    case 12:
        op_vmap_create(s, in);
        break;
    case 13:
        op_vmap_use(s, in);
        break;
    case 14:
        op_vmap_attention(s, in);
        break;
    default:
        op_attention_plan(s, in);
        break;
    }
}

static void step(state *s, fz_in *in)
{
    kvh_engine *e = s->e;
    uint8_t opcode = fz_u8(in);
    if (opcode >= 240) {
        newer_step(s, in, opcode - 240);
        return;
    }
    uint8_t op = opcode % 40;
    kvh_status st = KVH_OK;
    int32_t tk[MAXN];
    uint8_t *k = s->k, *v = s->v;
    kvh_seq q = {pick(in, s->seqs, NSEQ)}, out_s = {SENT};
    kvh_block b = {pick(in, s->blocks, NBLK)}, out_b = {SENT};
    kvh_fence f = {pick(in, s->fences, NFEN)}, out_f = {SENT};
    kvh_pool p = {pick(in, s->pools, NPOOL)}, out_p = {SENT};
    uint64_t u64 = SENT;
    size_t sz = SENT;
    bool want_fence = fz_u8(in) & 1;
    switch (op) {
    case 0:
    case 1: {
        /* An agent byte of 0xF0 or more also gives the sequence a scope
         * (tenant scopes came after the corpus: no byte of its own). */
        uint8_t a = fz_u8(in);
        st = kvh_seq_create(e, a % 4, &out_s);
        if (st == KVH_OK && a >= 0xF0) {
            uint64_t scope = 1 + ((a >> 1) & 1), shared = (a & 4) ? 0 : scope, sc = SENT;
            FZ_CHECK(kvh_seq_set_scope(e, out_s, scope, shared, BT * ((a >> 3) & 1u)) == KVH_OK,
                     "set_scope of a new sequence: %s", kvh_last_error());
            FZ_CHECK(kvh_seq_get_scope(e, out_s, &sc, NULL, NULL) == KVH_OK && sc == scope, "get_scope");
        }
        if (st == KVH_OK)
            keep(s->seqs, NSEQ, in, out_s.id);
        break;
    }
    case 2:
        st = kvh_seq_free(e, q);
        break;
    case 3: {
        uint8_t a = fz_u8(in);
        st = kvh_seq_fork(e, q, a % 4, &out_s);
        if (st == KVH_OK && a >= 0xF0) { /* a scope on the child: only while it is empty */
            uint64_t len = 0, sc = SENT;
            FZ_CHECK(kvh_seq_length(e, out_s, &len) == KVH_OK, "length of a new child");
            FZ_CHECK(kvh_seq_get_scope(e, q, &sc, NULL, NULL) == KVH_OK, "get_scope of a forked sequence");
            uint64_t csc = ~sc;
            FZ_CHECK(kvh_seq_get_scope(e, out_s, &csc, NULL, NULL) == KVH_OK && csc == sc, "fork keeps the scope");
            kvh_status ss = kvh_seq_set_scope(e, out_s, a & 3, a & 3, 0);
            FZ_CHECK(ss == (len ? KVH_ERR_INVALID_ARG : KVH_OK), "set_scope on a child of %llu tokens: %s",
                     (unsigned long long)len, kvh_status_name(ss));
        }
        if (st == KVH_OK)
            keep(s->seqs, NSEQ, in, out_s.id);
        break;
    }
    case 4:
    case 5: { /* append, then write all layers of what was appended */
        size_t n = tokens_from(in, s, tk);
        uint64_t len = 0;
        st = kvh_seq_length(e, q, &len);
        if (st == KVH_OK && (st = kvh_seq_append(e, q, tk, n)) == KVH_OK)
            for (uint32_t l = 0; l < L && st == KVH_OK; l++) {
                fill_kv(s, tk, n, l, k, v);
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
            fill_kv(s, tk, n, layer < L ? layer : 0, k, v);
            st = kvh_seq_write_kv(e, q, layer, pos, n, k, v);
        } else
            st = kvh_seq_write_kv(e, q, layer, pos, n, k, v); /* out of range: must fail */
        break;
    }
    case 7:
    case 8: {
        uint32_t layer = fz_u8(in) % (L + 1);
        uint64_t pos = fz_u8(in) % 64;
        check_read(s, q, layer, pos, fz_u8(in) % (MAXN + 1));
        return;
    }
    case 9:
        st = kvh_seq_length(e, q, &u64);
        break;
    case 10: {
        uint64_t pos = fz_u8(in) % 64;
        st = kvh_seq_tokens(e, q, pos, fz_u8(in) % (MAXN + 1), tk);
        break;
    }
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
    case 16: {
        uint64_t first = fz_u8(in) % 40;
        st = kvh_seq_release(e, q, first, fz_u8(in) % 40);
        break;
    }
    case 17: {
        uint64_t first = fz_u8(in) % 40, n = fz_u8(in) % 40;
        st = kvh_seq_pin(e, q, first, n, fz_u8(in) & 1);
        break;
    }
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
        size_t n = fz_u8(in) % 4;
        st = kvh_block_table(e, batch, n, indptr, idx, fz_u8(in) % 65, lpl);
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
        size_t n = fz_u8(in) % 4;
        st = kvh_migrate(e, bl, n, fz_u8(in) % 4, want_fence ? &out_f : NULL);
        if (st == KVH_OK && want_fence)
            keep(s->fences, NFEN, in, out_f.id);
        break;
    }
    case 26: {
        uint64_t first = fz_u8(in) % 40, n = fz_u8(in) % 40;
        st = kvh_seq_migrate(e, q, first, n, fz_u8(in) % 4, want_fence ? &out_f : NULL);
        if (st == KVH_OK && want_fence)
            keep(s->fences, NFEN, in, out_f.id);
        break;
    }
    case 27: { /* prefetch, or a hint (advice only) */
        uint64_t first = fz_u8(in) % 40, n = fz_u8(in) % 40;
        int32_t priority = (int32_t)fz_u32(in);
        uint8_t how = fz_u8(in);
        if (how & 1) {
            /* Queue hints share this opcode (no opcode byte is free): the
             * priority's bits give the place and the kind (2 and 3 are
             * not kinds), or the steps to advance. */
            if (how & 2)
                st = kvh_seq_hint_queued(e, q, first, n, (uint32_t)priority >> 8, (kvh_hint_place)(priority & 3));
            else if (how & 4)
                st = kvh_hint_advance(e, (uint32_t)priority & 7, &u64);
            else
                st = kvh_seq_hint(e, q, first, n, priority);
            break;
        }
        st = kvh_prefetch(e, q, first, n, priority, want_fence ? &out_f : NULL);
        if (st == KVH_OK && want_fence)
            keep(s->fences, NFEN, in, out_f.id);
        break;
    }
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
        uint8_t c = fz_u8(in);
        size_t cap = c % 7;
        if (c >= 0xF0) /* scoped (see case 0) */
            st = kvh_prefix_lookup_scoped(e, c & 3, (c >> 2) & 1, BT * ((c >> 3) & 1u), tk, n, bl, cap, &sz);
        else
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
                               .slot_stride = BT * s->tok,
                               .token_stride = s->tok,
                               .head_stride = s->d * 2};
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
                fill_kv(s, tk, BT, l, &s->pool_mem[pi][2 * l][slot * BT * s->tok],
                        &s->pool_mem[pi][2 * l + 1][slot * BT * s->tok]);
        uint64_t parent = 0;
        uint8_t pb = fz_u8(in);
        if ((pb & 1) && pb >= 0xF0) /* scoped (see case 0) */
            kvh_prefix_hash_scoped(e, (pb >> 1) & 3, 0, s->prompts[0], BT, &parent);
        else if (pb & 1)
            kvh_prefix_hash(e, 0, s->prompts[0], BT, &parent);
        uint8_t ab = fz_u8(in);
        if (ab >= 0xF0)
            st = kvh_pool_offload_scoped(e, p, slot, (ab >> 2) & 3, parent, tk, n, ab % 4, &out_b);
        else
            st = kvh_pool_offload(e, p, slot, parent, tk, n, ab % 4, &out_b);
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
        float *qv = s->q, *ov = s->out;
        memset(qv, 0, sizeof(s->q));
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
        uint32_t agent = fz_u8(in) % 4;
        st = kvh_agent_set_quota(e, agent, (uint64_t)(fz_u8(in) % 4) * s->block_bytes);
        break;
    }
    default: /* close and reopen: every handle held becomes stale */
        FZ_CHECK(kvh_engine_close(e) == KVH_OK, "close: %s", kvh_last_error());
        open_engine(s);
        for (int i = 0; i < NPOOL; i++)
            s->pools[i] = 0;
        for (int i = 0; i < NBLK; i++)
            s->blocks[i] = s->owned[i] = s->owned_refs[i] = 0;
        /* close released the views and plans; context handles stay, stale */
        for (int i = 0; i < NVIEW; i++)
            forget_view(s, i);
        for (int i = 0; i < NPLAN; i++)
            s->plans[i] = NULL;
        for (int i = 0; i < NCTX; i++)
            s->ctx[i].n_regions = 0;
        return;
    }
    char what[16];
    snprintf(what, sizeof(what), "op %u", op);
    trace(what, st);
    FZ_KNOWN(st);
    if (st != KVH_OK) {
        FZ_CHECK(out_s.id == SENT && out_b.id == SENT && out_p.id == SENT,
                 "an out-parameter was written by a failing call (op %u: %s)", op, kvh_status_name(st));
        FZ_CHECK(op == 28 || op == 29 || op == 9 || u64 == SENT || op == 31, "u64 written on failure (op %u)", op);
    }
}

/* The libFuzzer entry point (no header declares it). */
int LLVMFuzzerTestOneInput(const uint8_t *data, size_t size);

int LLVMFuzzerTestOneInput(const uint8_t *data, size_t size)
{
    fz_in in = {data, size, 0};
    static state s;
    memset(&s, 0, sizeof(s));
    uint8_t mode = fz_u8(&in);
    kvh_config_init(&s.cfg, sizeof(s.cfg));
    s.d = D_SMALL;
    s.cfg.migration_threads = (mode >> 6) % 3;
    if (mode >> 6 == 3) { /* a second byte: views, kv codec, eviction policy */
        uint8_t feat = fz_u8(&in);
        s.cfg.migration_threads = feat % 3;
        s.cfg.vmap = (feat & 4) != 0;
        s.d = s.cfg.vmap ? D_VIEWS : D_SMALL;
        s.codec = (feat >> 3) % 4;
        if (s.codec >= KVH_CODEC_Q4_G32 && s.d % 64)
            s.codec = KVH_CODEC_INT8;
        s.cfg.kv_codec = s.codec;
        s.cfg.eviction_policy = (feat >> 5) & 1 ? KVH_EVICT_LCTRU : KVH_EVICT_LRU_K;
        s.cfg.lctru_window = (feat >> 6) * 3;
    }
    s.tok = H * s.d * 2;
    s.cfg.num_layers = L;
    s.cfg.num_kv_heads = H;
    s.cfg.head_dim = s.d;
    s.cfg.block_tokens = BT;
    s.cfg.dtype = KVH_DTYPE_F16;
    s.cfg.backend = KVH_BACKEND_CPU;
    uint64_t bb = s.block_bytes = 2ull * L * BT * s.tok;
    s.cfg.device_bytes = (2 + mode % 6) * bb;
    s.cfg.host_bytes = ((mode >> 3) % 8) * bb;
    s.disk = mode & 4;
    const char *dir = fz_dir("api");
    fz_clear(dir);
    if (s.disk) {
        s.cfg.disk_path = dir;
        s.cfg.disk_bytes = 24 * (4096 + (bb + 4095) / 4096 * 4096);
        s.cfg.disk_flags = KVH_DISK_BUFFERED;
    }
    /* the file weight regions may name (a GGUF stand-in) */
    for (size_t i = 0; i < sizeof(s.weights_file); i++)
        s.weights_file[i] = (uint8_t)fz_mix(i ^ 0xfeed);
    snprintf(s.weights_path, sizeof(s.weights_path), "%s/weights.bin", dir);
    FZ_CHECK(fz_write(dir, "weights.bin", s.weights_file, sizeof(s.weights_file)) == 0, "weights file");
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
