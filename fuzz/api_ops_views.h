/* fuzz_api ops: virtually contiguous views and attention plans.
 *
 * Views and plans are pointers, not generation-checked handles: using one
 * after its release is the caller's error, so the harness forgets each one
 * it releases and those the engine released at close. What it checks:
 * a view just made or refreshed shows exactly the sequence's K/V, view
 * attention equals paged attention bit for bit, and a plan's first run
 * equals the one-shot call bit for bit. Plans of sequences freed or
 * truncated since are still run (undefined output, never a fault). */
#ifndef KVH_FUZZ_API_OPS_VIEWS_H
#define KVH_FUZZ_API_OPS_VIEWS_H

#include "api_harness.h"

/* A view that was just made or refreshed against its sequence. */
static void check_view(state *s, const view_track *vt)
{
    kvh_vmap_view view = {.struct_size = sizeof(view)};
    FZ_CHECK(kvh_vmap_get(s->e, vt->vmap, &view) == KVH_OK, "vmap_get of a live view");
    uint64_t len = 0;
    FZ_CHECK(kvh_seq_length(s->e, (kvh_seq){vt->seq}, &len) == KVH_OK, "length of a view's sequence");
    FZ_CHECK(view.n_tokens == len && len <= view.capacity_tokens, "view maps %llu of %llu tokens (capacity %llu)",
             (unsigned long long)view.n_tokens, (unsigned long long)len, (unsigned long long)view.capacity_tokens);
    size_t row = (size_t)s->d * 2;
    for (uint64_t pos = 0; pos < len; pos += MAXN) {
        size_t n = len - pos < MAXN ? (size_t)(len - pos) : MAXN;
        /* cells never written cannot be read back; skip those chunks */
        if (kvh_seq_read_kv(s->e, (kvh_seq){vt->seq}, view.layer, pos, n, s->k, s->v) != KVH_OK)
            continue;
        for (size_t t = 0; t < n; t++)
            for (uint32_t h = 0; h < H; h++) {
                const uint8_t *vk = (const uint8_t *)view.k + h * view.head_stride + (pos + t) * row;
                const uint8_t *vv = (const uint8_t *)view.v + h * view.head_stride + (pos + t) * row;
                FZ_CHECK(!memcmp(vk, s->k + t * s->tok + h * row, row) && !memcmp(vv, s->v + t * s->tok + h * row, row),
                         "view of layer %u differs from read_kv at token %llu head %u", view.layer,
                         (unsigned long long)(pos + t), h);
            }
    }
}

static void forget_view(state *s, int i) { s->views[i] = (view_track){0}; }

static void op_vmap_create(state *s, fz_in *in)
{
    kvh_seq q = {pick(in, s->seqs, NSEQ)};
    uint32_t layer = fz_u8(in) % (L + 1);
    static const uint64_t caps[] = {0, 1, 16, 64, 1ull << 31, (1ull << 31) + 1, 1ull << 40, UINT64_MAX};
    uint8_t c = fz_u8(in);
    uint64_t cap = c < 128 ? caps[c % 8] : c % 128;
    if (fz_u8(in) & 1) { /* make it resident first, as a caller would */
        uint64_t len = 0;
        if (kvh_seq_length(s->e, q, &len) == KVH_OK)
            kvh_seq_acquire(s->e, q, 0, (len + BT - 1) / BT, NULL);
    }
    kvh_vmap *vm = (kvh_vmap *)&SENT;
    bool null_out = fz_u8(in) < 4;
    kvh_status st = kvh_seq_vmap(s->e, q, layer, cap, null_out ? NULL : &vm);
    trace("seq_vmap", st);
    FZ_KNOWN(st);
    if (st != KVH_OK) {
        FZ_CHECK(vm == (kvh_vmap *)&SENT, "vmap written by a failing kvh_seq_vmap");
        return;
    }
    FZ_CHECK(s->cfg.vmap, "a view of an engine opened without vmap");
    int i = fz_u8(in) % NVIEW;
    if (s->views[i].vmap)
        FZ_CHECK(kvh_vmap_release(s->e, s->views[i].vmap) == KVH_OK, "vmap_release");
    s->views[i] = (view_track){vm, q.id};
    check_view(s, &s->views[i]);
}

/* Refresh, get, release (also NULL) of a view. */
static void op_vmap_use(state *s, fz_in *in)
{
    int i = fz_u8(in) % NVIEW;
    view_track *vt = &s->views[i];
    kvh_status st;
    switch (fz_u8(in) % 4) {
    case 0: {
        int32_t changed = 7;
        st = kvh_vmap_refresh(s->e, vt->vmap, fz_u8(in) & 1 ? &changed : NULL);
        trace("vmap_refresh", st);
        if (st == KVH_OK)
            check_view(s, vt);
        else
            FZ_CHECK(changed == 7, "changed written by a failing refresh");
        break;
    }
    case 1: {
        kvh_vmap_view view;
        memset(&view, 0x5e, sizeof(view));
        view.struct_size = struct_size(in, sizeof(view));
        st = kvh_vmap_get(s->e, vt->vmap, &view);
        trace("vmap_get", st);
        if (st == KVH_OK && view.struct_size == sizeof(view))
            FZ_CHECK(view.n_tokens <= view.capacity_tokens && view.k && view.v, "vmap_get: %llu tokens, capacity %llu",
                     (unsigned long long)view.n_tokens, (unsigned long long)view.capacity_tokens);
        else
            FZ_CHECK(view.layer == 0x5e5e5e5e, "view written by a failing vmap_get");
        break;
    }
    default:
        st = kvh_vmap_release(s->e, vt->vmap);
        trace("vmap_release", st);
        FZ_CHECK(st == KVH_OK, "vmap_release: %s", kvh_status_name(st));
        forget_view(s, i);
        break;
    }
    FZ_KNOWN(st);
}

static void attention_params(fz_in *in, kvh_attention_params *ap)
{
    kvh_attention_params_init(ap, sizeof(*ap));
    ap->struct_size = struct_size(in, sizeof(*ap));
    uint8_t c = fz_u8(in);
    ap->num_q_heads = c % 4 == 0 ? 0 : c % 4 == 1 ? H : c % 4 == 2 ? MAX_QH : 3;
    ap->threads = 1 + (c >> 2) % 2;
    if (c >= 250)
        ap->scale = NAN;
}

/* View attention over up to 2 views; when it succeeds, paged attention
 * over the views' sequences must give the same bits. */
static void op_vmap_attention(state *s, fz_in *in)
{
    kvh_vmap *views[2];
    kvh_seq seqs[2];
    size_t n = fz_u8(in) % 3;
    for (size_t i = 0; i < 2; i++) {
        view_track *vt = &s->views[fz_u8(in) % NVIEW];
        views[i] = vt->vmap;
        seqs[i] = (kvh_seq){vt->seq};
    }
    uint32_t qlens[2];
    for (int i = 0; i < 2; i++)
        qlens[i] = fz_u8(in) % 5;
    kvh_attention_params ap;
    attention_params(in, &ap);
    bool prefill = fz_u8(in) & 1;
    memset(s->out, 0, sizeof(s->out));
    for (size_t i = 0; i < sizeof(s->q) / sizeof(s->q[0]); i++)
        s->q[i] = (float)((int)(fz_mix(i) % 17) - 8) / 8;
    kvh_status st = prefill ? kvh_attention_prefill_vmap(s->e, views, qlens, n, s->q, s->out, &ap)
                            : kvh_attention_decode_vmap(s->e, views, n, s->q, s->out, &ap);
    trace(prefill ? "attention_prefill_vmap" : "attention_decode_vmap", st);
    FZ_KNOWN(st);
    if (st != KVH_OK || n == 0)
        return;
    kvh_vmap_view view = {.struct_size = sizeof(view)};
    FZ_CHECK(kvh_vmap_get(s->e, views[0], &view) == KVH_OK, "vmap_get");
    for (size_t i = 1; i < n; i++) {
        kvh_vmap_view other = {.struct_size = sizeof(other)};
        FZ_CHECK(kvh_vmap_get(s->e, views[i], &other) == KVH_OK, "vmap_get");
        if (other.layer != view.layer)
            return; /* a paged call covers one layer */
    }
    memset(s->out2, 0, sizeof(s->out2));
    kvh_status paged = prefill ? kvh_attention_prefill(s->e, view.layer, seqs, qlens, n, s->q, s->out2, &ap)
                               : kvh_attention_decode(s->e, view.layer, seqs, n, s->q, s->out2, &ap);
    FZ_KNOWN(paged);
    FZ_CHECK(paged == KVH_OK, "paged attention over current views' sequences: %s: %s", kvh_status_name(paged),
             kvh_last_error());
    FZ_CHECK(!memcmp(s->out, s->out2, sizeof(s->out)), "view and paged attention differ");
}

/* Plan create (checked against the one-shot call), run (twice as often),
 * destroy. */
static void op_attention_plan(state *s, fz_in *in)
{
    int i = fz_u8(in) % NPLAN;
    uint8_t what = fz_u8(in) % 4;
    kvh_status st;
    if (what == 0) {
        kvh_seq seqs[3];
        for (int j = 0; j < 3; j++)
            seqs[j] = (kvh_seq){pick(in, s->seqs, NSEQ)};
        size_t n = fz_u8(in) % 4;
        uint32_t qlens[3];
        for (int j = 0; j < 3; j++)
            qlens[j] = fz_u8(in) % 5;
        bool prefill = fz_u8(in) & 1;
        uint32_t layer = fz_u8(in) % (L + 1);
        kvh_attention_params ap;
        attention_params(in, &ap);
        bool null_params = fz_u8(in) < 16;
        kvh_attention_plan *pl = (kvh_attention_plan *)&SENT;
        st = kvh_attention_plan_create(s->e, layer, seqs, prefill ? qlens : NULL, n, null_params ? NULL : &ap, &pl);
        trace("attention_plan_create", st);
        FZ_KNOWN(st);
        if (st != KVH_OK) {
            FZ_CHECK(pl == (kvh_attention_plan *)&SENT, "plan written by a failing create");
            return;
        }
        if (s->plans[i])
            FZ_CHECK(kvh_attention_plan_destroy(s->e, s->plans[i]) == KVH_OK, "plan_destroy");
        s->plans[i] = pl;
        for (size_t j = 0; j < sizeof(s->q) / sizeof(s->q[0]); j++)
            s->q[j] = (float)((int)(fz_mix(j + 99) % 17) - 8) / 8;
        memset(s->out, 0, sizeof(s->out));
        memset(s->out2, 0, sizeof(s->out2));
        FZ_CHECK(kvh_attention_run(s->e, pl, s->q, s->out, NULL) == KVH_OK, "first run of a plan: %s",
                 kvh_last_error());
        const kvh_attention_params *app = null_params ? NULL : &ap;
        kvh_status once = prefill ? kvh_attention_prefill(s->e, layer, seqs, qlens, n, s->q, s->out2, app)
                                  : kvh_attention_decode(s->e, layer, seqs, n, s->q, s->out2, app);
        FZ_CHECK(once == KVH_OK, "one-shot call over a planned batch: %s: %s", kvh_status_name(once), kvh_last_error());
        FZ_CHECK(!memcmp(s->out, s->out2, sizeof(s->out)), "plan run and one-shot attention differ");
        return;
    }
    if (what <= 2) {
        bool null_q = fz_u8(in) < 8;
        st = kvh_attention_run(s->e, s->plans[i], null_q ? NULL : s->q, s->out, NULL);
        trace("attention_run", st);
        FZ_KNOWN(st);
        FZ_CHECK(st == KVH_OK || !s->plans[i] || null_q, "run of a live plan: %s", kvh_status_name(st));
        return;
    }
    st = kvh_attention_plan_destroy(s->e, s->plans[i]);
    trace("attention_plan_destroy", st);
    FZ_CHECK(st == KVH_OK, "plan_destroy: %s", kvh_status_name(st));
    s->plans[i] = NULL;
}

#endif
