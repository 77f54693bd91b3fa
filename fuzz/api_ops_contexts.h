/* fuzz_api ops: weight contexts and regions, admission by token budget.
 *
 * The harness keeps what each tracked context's regions hold (their bytes,
 * or the range of the weights file they name, plus whatever it wrote
 * through a writable kvh_context_region_data), so every region it reads
 * back is checked byte for byte, after any switches, demotions and KV
 * evictions in between. */
#ifndef KVH_FUZZ_API_OPS_CONTEXTS_H
#define KVH_FUZZ_API_OPS_CONTEXTS_H

#include "api_harness.h"

static int ctx_slot(const state *s, uint64_t id)
{
    for (int i = 0; id && i < NCTX; i++)
        if (s->ctxs[i] == id)
            return i;
    return -1;
}

static void op_context_create(state *s, fz_in *in)
{
    kvh_context_params p;
    FZ_CHECK(kvh_context_params_init(&p, sizeof(p)) == KVH_OK, "context params init");
    p.struct_size = struct_size(in, sizeof(p));
    uint8_t c = fz_u8(in);
    if (c & 1)
        p.chunk_bytes = c < 16 ? 0 : c < 32 ? (2ull << 30) : (uint64_t)(fz_u8(in) % 64) * 16 + 1;
    if (c & 2)
        p.kv_policy = fz_u8(in) % 3;
    p.name = c & 4 ? "fuzz" : NULL;
    kvh_context out = {SENT};
    kvh_status st = kvh_context_create(s->e, fz_u8(in) < 16 ? NULL : &p, &out);
    trace("context_create", st);
    FZ_KNOWN(st);
    if (st != KVH_OK) {
        FZ_CHECK(out.id == SENT, "context written by a failing create");
        return;
    }
    FZ_CHECK(out.id != 0, "null context created");
    int i = fz_u8(in) % NCTX;
    s->ctxs[i] = out.id;
    s->ctx[i].n_regions = 0;
}

static void op_context_destroy(state *s, fz_in *in)
{
    kvh_context x = {pick(in, s->ctxs, NCTX)};
    kvh_status st = kvh_context_destroy(s->e, x);
    trace("context_destroy", st);
    FZ_KNOWN(st);
    if (st == KVH_OK && x.id) {
        kvh_status again = kvh_context_destroy(s->e, x);
        FZ_CHECK(again == KVH_ERR_BAD_HANDLE, "a destroyed context destroyed again: %s", kvh_status_name(again));
        int i = ctx_slot(s, x.id);
        if (i >= 0)
            s->ctx[i].n_regions = 0; /* the stale handle stays in the pool */
    }
}

static void op_context_add_region(state *s, fz_in *in)
{
    kvh_context x = {pick(in, s->ctxs, NCTX)};
    kvh_weight_region_params p;
    FZ_CHECK(kvh_weight_region_params_init(&p, sizeof(p)) == KVH_OK, "region params init");
    p.struct_size = struct_size(in, sizeof(p));
    p.layer = fz_u8(in) % 4;
    p.size = fz_u8(in) < 8 ? 0 : 1 + fz_u16(in) % REG_MAX;
    p.pinned = fz_u8(in) < 32;
    uint8_t src = fz_u8(in) % 8, seed = fz_u8(in);
    uint8_t bytes[REG_MAX];
    for (size_t i = 0; i < sizeof(bytes); i++)
        bytes[i] = (uint8_t)fz_mix(seed * 4096 + i);
    if (src < 3 || src == 6) /* 3: no source */
        p.bytes = bytes;
    if (src >= 4) {
        p.path = src == 7 ? "" : s->weights_path;
        p.file_offset = fz_u8(in) < 16 ? fz_u64(in) : fz_u16(in) % sizeof(s->weights_file);
    }
    uint32_t r = UINT32_MAX;
    bool null_params = fz_u8(in) < 4, null_region = fz_u8(in) < 4;
    kvh_status st = kvh_context_add_region(s->e, x, null_params ? NULL : &p, null_region ? NULL : &r);
    trace("context_add_region", st);
    FZ_KNOWN(st);
    if (st != KVH_OK) {
        FZ_CHECK(r == UINT32_MAX, "region index written by a failing add_region");
        return;
    }
    int i = ctx_slot(s, x.id);
    if (i < 0 || r != s->ctx[i].n_regions || r >= NREG)
        return; /* not tracked: its slot was reused, or regions were added while it was not */
    FZ_CHECK(p.bytes || p.file_offset + p.size <= sizeof(s->weights_file), "a region past the end of its file");
    s->ctx[i].size[r] = p.size;
    memcpy(s->ctx[i].expect[r], p.bytes ? bytes : s->weights_file + p.file_offset, p.size);
    s->ctx[i].n_regions++;
}

static void op_context_attach_seq(state *s, fz_in *in)
{
    kvh_context x = {pick(in, s->ctxs, NCTX)};
    kvh_seq q = {pick(in, s->seqs, NSEQ)};
    kvh_status st = kvh_context_attach_seq(s->e, x, q);
    trace("context_attach_seq", st);
    FZ_KNOWN(st);
}

static void op_context_switch(state *s, fz_in *in)
{
    kvh_context from = {pick(in, s->ctxs, NCTX)}, to = {pick(in, s->ctxs, NCTX)};
    bool want_fence = fz_u8(in) & 1;
    kvh_fence f = {SENT};
    kvh_status st = kvh_context_switch(s->e, from, to, want_fence ? &f : NULL);
    trace("context_switch", st);
    FZ_KNOWN(st);
    if (st == KVH_OK && want_fence)
        keep(s->fences, NFEN, in, f.id);
    else
        FZ_CHECK(f.id == SENT, "fence written by a failing or fenceless switch");
}

static void op_context_wait_layer(state *s, fz_in *in)
{
    kvh_context x = {pick(in, s->ctxs, NCTX)};
    static const uint64_t timeouts[] = {0, 1000000, 1000000000};
    uint32_t layer = fz_u8(in) % 5;
    kvh_status st = kvh_context_wait_layer(s->e, x, layer, timeouts[fz_u8(in) % 3]);
    trace("context_wait_layer", st);
    FZ_KNOWN(st);
}

/* Reads a region back and checks its bytes; may write through it. */
static void op_context_region_data(state *s, fz_in *in)
{
    kvh_context x = {pick(in, s->ctxs, NCTX)};
    uint32_t r = fz_u8(in) % (NREG + 1);
    int32_t writable = fz_u8(in) < 64;
    void *data = (void *)&SENT;
    uint64_t size = SENT;
    bool null_data = fz_u8(in) < 4, null_size = fz_u8(in) < 32;
    kvh_status st = kvh_context_region_data(s->e, x, r, writable, null_data ? NULL : &data, null_size ? NULL : &size);
    trace("context_region_data", st);
    FZ_KNOWN(st);
    if (st != KVH_OK) {
        FZ_CHECK(data == (void *)&SENT && size == SENT, "out-parameters written by a failing region_data");
        return;
    }
    int i = ctx_slot(s, x.id);
    if (i < 0 || r >= s->ctx[i].n_regions)
        return;
    ctx_track *t = &s->ctx[i];
    FZ_CHECK(size == SENT || size == t->size[r], "region %u is %llu bytes, registered %llu", r,
             (unsigned long long)size, (unsigned long long)t->size[r]);
    FZ_CHECK(!memcmp(data, t->expect[r], t->size[r]), "region %u of context slot %d holds other bytes", r, i);
    if (writable) {
        uint8_t salt = fz_u8(in);
        for (uint64_t j = 0; j < t->size[r]; j += 7)
            t->expect[r][j] ^= salt;
        for (uint64_t j = 0; j < t->size[r]; j += 7)
            ((uint8_t *)data)[j] ^= salt;
    }
}

/* Pin, verify, info and the weight counters. */
static void op_context_query(state *s, fz_in *in)
{
    kvh_context x = {pick(in, s->ctxs, NCTX)};
    kvh_status st;
    switch (fz_u8(in) % 4) {
    case 0: {
        uint32_t r = fz_u8(in) % (NREG + 1);
        st = kvh_context_region_pin(s->e, x, r, fz_u8(in) & 1);
        trace("context_region_pin", st);
        break;
    }
    case 1: {
        uint64_t chunks = SENT;
        st = kvh_context_verify(s->e, x, fz_u8(in) & 1 ? &chunks : NULL);
        trace("context_verify", st);
        /* nothing modifies the file or the engine's clean copies */
        FZ_CHECK(st != KVH_ERR_CORRUPT, "a clean weight region failed its checksum: %s", kvh_last_error());
        FZ_CHECK(st == KVH_OK || chunks == SENT, "chunks written by a failing verify");
        break;
    }
    case 2: {
        kvh_context_info info;
        memset(&info, 0x5e, sizeof(info));
        info.struct_size = struct_size(in, sizeof(info));
        st = kvh_context_info_get(s->e, x, &info);
        trace("context_info_get", st);
        /* a shorter (older) struct is filled up to its size, no further */
        for (size_t b = info.struct_size; st == KVH_OK && b < sizeof(info); b++)
            FZ_CHECK(((const uint8_t *)&info)[b] == 0x5e, "context_info_get wrote byte %zu past struct_size %u", b,
                     info.struct_size);
        if (st == KVH_OK && info.struct_size == sizeof(info)) {
            FZ_CHECK(info.bytes_device + info.bytes_host <= info.weight_bytes, "context info: resident > total");
            FZ_CHECK(info.layers_ready <= info.regions, "context info: layers_ready > regions");
            int i = ctx_slot(s, x.id);
            if (i >= 0 && s->ctx[i].n_regions < NREG)
                FZ_CHECK(info.regions == s->ctx[i].n_regions, "context has %u regions, %u added", info.regions,
                         s->ctx[i].n_regions);
        }
        break;
    }
    default: {
        kvh_weight_stats ws;
        memset(&ws, 0x5e, sizeof(ws));
        ws.struct_size = struct_size(in, sizeof(ws));
        st = kvh_weight_stats_get(s->e, &ws);
        trace("weight_stats_get", st);
        if (st == KVH_OK && ws.struct_size == sizeof(ws))
            FZ_CHECK(ws.crc_failures == 0, "weight checksum failures without any corruption");
        break;
    }
    }
    FZ_KNOWN(st);
}

static void op_admission_configure(state *s, fz_in *in)
{
    kvh_admission_params p;
    FZ_CHECK(kvh_admission_params_init(&p, sizeof(p)) == KVH_OK, "admission params init");
    p.struct_size = struct_size(in, sizeof(p));
    p.short_max_tokens = fz_u8(in) % 64;
    p.short_device_bytes = (uint64_t)(fz_u8(in) % 6) * s->block_bytes;
    p.long_device_bytes = (uint64_t)(fz_u8(in) % 6) * s->block_bytes;
    kvh_status st = kvh_admission_configure(s->e, fz_u8(in) < 8 ? NULL : &p);
    trace("admission_configure", st);
    FZ_KNOWN(st);
}

static bool admission_info(state *s, kvh_admission_info *info)
{
    memset(info, 0x5e, sizeof(*info));
    info->struct_size = sizeof(*info);
    kvh_status st = kvh_admission_info_get(s->e, info);
    FZ_KNOWN(st);
    return st == KVH_OK;
}

/* kvh_seq_create_ex; the budget it reserves is checked against the
 * pools: exactly ceil(budget / block_tokens) blocks when admitted, more
 * than the pool has left when refused. */
static void op_seq_create_ex(state *s, fz_in *in)
{
    kvh_seq_params p;
    FZ_CHECK(kvh_seq_params_init(&p, sizeof(p)) == KVH_OK, "seq params init");
    p.struct_size = struct_size(in, sizeof(p));
    p.agent = fz_u8(in) % 4;
    uint8_t b = fz_u8(in);
    p.token_budget = b < 128 ? b % 32 : b < 240 ? fz_u16(in) : UINT64_MAX - fz_u8(in);
    p.context = (kvh_context){pick(in, s->ctxs, NCTX)};
    kvh_admission_info before, after;
    bool checked = admission_info(s, &before) && p.struct_size == sizeof(p);
    kvh_seq out = {SENT};
    kvh_status st = kvh_seq_create_ex(s->e, &p, &out);
    trace("seq_create_ex", st);
    FZ_KNOWN(st);
    if (st == KVH_OK)
        keep(s->seqs, NSEQ, in, out.id);
    else
        FZ_CHECK(out.id == SENT, "seq written by a failing create_ex");
    if (!checked || !before.enabled || !p.token_budget || !admission_info(s, &after))
        return;
    bool is_long = p.token_budget > before.short_max_tokens;
    unsigned __int128 need = ((unsigned __int128)p.token_budget + BT - 1) / BT;
    uint64_t was = is_long ? before.long_reserved_blocks : before.short_reserved_blocks;
    uint64_t now = is_long ? after.long_reserved_blocks : after.short_reserved_blocks;
    uint64_t quota = is_long ? before.long_quota_blocks : before.short_quota_blocks;
    if (st == KVH_OK)
        FZ_CHECK(now == was + need && was + need <= quota,
                 "admitted a budget of %llu tokens: %s pool reserved %llu -> %llu of %llu",
                 (unsigned long long)p.token_budget, is_long ? "long" : "short", (unsigned long long)was,
                 (unsigned long long)now, (unsigned long long)quota);
    else if (st == KVH_ERR_NOSPACE)
        FZ_CHECK(now == was && was + need > quota,
                 "refused a budget of %llu tokens: %s pool reserved %llu -> %llu of %llu",
                 (unsigned long long)p.token_budget, is_long ? "long" : "short", (unsigned long long)was,
                 (unsigned long long)now, (unsigned long long)quota);
}

#endif
