/* Weight contexts: registration, switches that keep every weight and KV
 * byte (checked against the source and by checksum), clean weights never
 * written, write-back of modified ones, corrupt sources, pinning, layer
 * readiness, switches under memory pressure with a disk tier, accounting
 * in the tiers, and argument checks. Each switch test runs on unified
 * memory (the CPU backend: moves are remaps) and with copies forced (the
 * path of a discrete GPU), with 0 and 2 migration threads. */
#include <fcntl.h>
#include <pthread.h>
#include <sched.h>
#include <stdatomic.h>
#include <ftw.h>
#include <stdio.h>
#include <sys/stat.h>
#include <unistd.h>

#include "test_util.h"
#include "context_test_util.h"
#include "core/context.h"

enum { L = 2, H = 2, D = 4, BT = 4 };
static const size_t TOK = H * D * 4;
enum { LAYERS = 4, BIG = 3000, SMALL = 1000, CHUNK = 1024 };
#define FILE_BYTES (LAYERS * (BIG + SMALL) + 512)

typedef struct mode {
    uint32_t threads;
    bool copies;
} mode;
static mode M_UNI0 = {0, false}, M_UNI2 = {2, false}, M_COPY0 = {0, true}, M_COPY2 = {2, true};
#define MODE(state) (*(mode *)*(state))

static char tmpdir[512];

static int remove_entry(const char *path, const struct stat *st, int flag, struct FTW *ftw)
{
    (void)st, (void)flag, (void)ftw;
    return remove(path);
}

static const char *scratch(const char *name, char *buf, size_t len)
{
    const char *d = getenv("KVH_TEST_TMPDIR");
    if (!d || !d[0]) {
        snprintf(tmpdir, sizeof(tmpdir), "/tmp/kvh-context-tests.%d", (int)getpid());
        mkdir(tmpdir, 0700);
        d = tmpdir;
    }
    snprintf(buf, len, "%s/%s", d, name);
    return buf;
}

static uint8_t *write_weights(const char *path, uint64_t seed) { return ct_write_weights(path, seed, FILE_BYTES); }

typedef struct model {
    kvh_context ctx;
    const uint8_t *file; /* contents of its weight file */
    uint8_t extra[700];  /* a region registered from bytes */
    uint32_t n_regions;
    uint64_t offset[2 * LAYERS + 1], size[2 * LAYERS + 1];
} model;

/* Per layer a big and a small region from the file (layers registered in
 * reverse to check the load order), plus one byte-sourced region. */
static void make_model(kvh_engine *e, model *m, const char *path, const uint8_t *file, uint32_t policy, uint64_t tag)
{
    kvh_context_params cp;
    assert_ok(kvh_context_params_init(&cp, sizeof(cp)));
    cp.kv_policy = policy;
    cp.chunk_bytes = CHUNK;
    cp.name = "model";
    assert_ok(kvh_context_create(e, &cp, &m->ctx));
    m->file = file;
    m->n_regions = 0;
    for (int l = LAYERS - 1; l >= 0; l--)
        for (int part = 0; part < 2; part++) {
            kvh_weight_region_params rp;
            assert_ok(kvh_weight_region_params_init(&rp, sizeof(rp)));
            rp.layer = (uint32_t)l;
            rp.name = part ? "small" : "big";
            rp.path = path;
            rp.file_offset = (uint64_t)l * (BIG + SMALL) + (part ? BIG : 0);
            rp.size = part ? SMALL : BIG;
            uint32_t idx = 99;
            assert_ok(kvh_context_add_region(e, m->ctx, &rp, &idx));
            assert_int_equal(idx, m->n_regions);
            m->offset[idx] = rp.file_offset;
            m->size[idx] = rp.size;
            m->n_regions++;
        }
    tu_rng r = {tag};
    tu_fill(&r, m->extra, sizeof(m->extra));
    kvh_weight_region_params rp;
    assert_ok(kvh_weight_region_params_init(&rp, sizeof(rp)));
    rp.layer = 0;
    rp.bytes = m->extra;
    rp.size = sizeof(m->extra);
    uint32_t idx;
    assert_ok(kvh_context_add_region(e, m->ctx, &rp, &idx));
    m->offset[idx] = UINT64_MAX;
    m->size[idx] = sizeof(m->extra);
    m->n_regions++;
}

/* Every region resident in the device tier with its expected bytes. */
static void check_model(kvh_engine *e, model *m)
{
    for (uint32_t i = 0; i < m->n_regions; i++) {
        void *p = NULL;
        uint64_t n = 0;
        assert_ok(kvh_context_region_data(e, m->ctx, i, 0, &p, &n));
        assert_int_equal(n, m->size[i]);
        const uint8_t *want = m->offset[i] == UINT64_MAX ? m->extra : m->file + m->offset[i];
        assert_memory_equal(p, want, n);
    }
    uint64_t checked = 0;
    assert_ok(kvh_context_verify(e, m->ctx, &checked));
    assert_true(checked >= m->n_regions);
}

static uint64_t slots_of(uint64_t bytes, uint64_t bb) { return (bytes + bb - 1) / bb; }

/* kvh.h: each region is charged its size in whole pages of the system's
 * page size, and a context the slots of its regions' pages together. */
static uint64_t page_bytes(void) { return (uint64_t)sysconf(_SC_PAGESIZE); }
static uint64_t pages_of(uint64_t bytes) { return (bytes + page_bytes() - 1) / page_bytes() * page_bytes(); }

/* Slots a context with the one region of `bytes` resident in a tier takes
 * there. */
static uint64_t region_slots(uint64_t bytes, uint64_t bb) { return slots_of(pages_of(bytes), bb); }

/* Slots one model takes: what make_model registers, counted before it
 * does. */
static uint64_t slots_per_model(uint64_t bb)
{
    return slots_of(pages_of(BIG) * LAYERS + pages_of(SMALL) * LAYERS + pages_of(sizeof(((model *)0)->extra)), bb);
}

static uint64_t model_slots(model *m, uint64_t bb)
{
    uint64_t pages = 0;
    for (uint32_t i = 0; i < m->n_regions; i++)
        pages += pages_of(m->size[i]);
    return slots_of(pages, bb);
}

static kvh_engine *open_engine(mode md, uint64_t dev_blocks, uint64_t host_blocks, const char *disk_dir)
{
    kvh_config c = tu_cfg(L, H, D, BT, KVH_DTYPE_F32, dev_blocks, host_blocks, md.threads);
    if (disk_dir) {
        c.disk_path = disk_dir;
        c.disk_bytes = 1ull << 20;
        c.disk_flags = KVH_DISK_RESET_ON_MISMATCH;
    }
    kvh_engine *e = tu_open_cfg(&c);
    assert_int_equal(kvhi_context_copy_on_unified(e, md.copies), 0);
    return e;
}

static kvh_seq kv_seq(kvh_engine *e, kvh_context ctx, uint32_t blocks, uint64_t tag)
{
    kvh_seq_params sp;
    assert_ok(kvh_seq_params_init(&sp, sizeof(sp)));
    sp.agent = (uint32_t)tag;
    sp.context = ctx;
    kvh_seq s;
    assert_ok(kvh_seq_create_ex(e, &sp, &s));
    int32_t t[64];
    tu_iota(t, blocks * BT, (int32_t)(tag * 1000));
    assert_ok(kvh_seq_append(e, s, t, blocks * BT));
    tu_write_pattern(e, s, L, TOK, tag, 0, blocks * BT);
    return s;
}

static void switch_preserves_everything(void **state)
{
    mode md = MODE(state);
    char pa[600], pb[600];
    uint8_t *fa = write_weights(scratch("a.bin", pa, sizeof(pa)), 11);
    uint8_t *fb = write_weights(scratch("b.bin", pb, sizeof(pb)), 22);
    uint64_t bb = tu_block_bytes_of(L, H, D, BT, KVH_DTYPE_F32);
    model *a = tu_alloc(sizeof(model)), *b = tu_alloc(sizeof(model));
    /* Size the tiers from one model's slot count. */
    /* The device tier holds one model and a little KV, not both models. */
    uint64_t per_model = slots_per_model(bb);
    kvh_engine *e = open_engine(md, per_model + 8, per_model + 24, NULL);
    make_model(e, a, pa, fa, KVH_CONTEXT_KV_DEMOTE, 1);
    make_model(e, b, pb, fb, KVH_CONTEXT_KV_DEMOTE, 2);
    assert_int_equal(model_slots(a, bb), per_model);
    kvh_seq sa = kv_seq(e, a->ctx, 3, 1), sb = kv_seq(e, b->ctx, 3, 2);

    kvh_context none = {0};
    assert_ok(kvh_context_switch(e, none, a->ctx, NULL));
    check_model(e, a);
    for (int round = 0; round < 4; round++) {
        model *out = round % 2 ? b : a, *in = round % 2 ? a : b;
        assert_ok(kvh_context_switch(e, out->ctx, in->ctx, NULL));
        check_model(e, in);
        kvh_context_info ii = ct_context_info(e, in->ctx), oi = ct_context_info(e, out->ctx);
        assert_int_equal(ii.layers_ready, in->n_regions);
        assert_int_equal(ii.bytes_device, ii.weight_bytes);
        assert_int_equal(oi.bytes_device, 0);
        assert_true(tu_check_pattern(e, sa, L, TOK, 1, 0, 3 * BT));
        assert_true(tu_check_pattern(e, sb, L, TOK, 2, 0, 3 * BT));
    }
    kvh_weight_stats ws = ct_weight_stats(e);
    assert_int_equal(ws.switches, 5);
    /* The host tier has room for the model that leaves, so departures
     * stay in RAM (copied down on discrete memory, re-accounted on unified
     * memory) and arrivals come from there. A clean region is dropped only
     * when both directions wait for each other's room (the arrival for
     * the device room a departure frees, the departure for the host room
     * an arrival frees), and is read again from its file. */
    uint64_t file_bytes = LAYERS * (BIG + SMALL), model_bytes = file_bytes + sizeof(a->extra);
    assert_true(ws.bytes_read_source >= 2 * file_bytes);
    assert_true(ws.bytes_read_source <= 2 * file_bytes + ws.bytes_dropped);
    assert_true(ws.bytes_dropped <= 4 * file_bytes / 2);
    assert_int_equal(ws.unified_memory, !md.copies);
    if (md.copies) {
        assert_int_equal(ws.bytes_remapped, 0);
        /* Each departure copied down or dropped (a copy kept in the host
         * tier may be dropped later as well); each arrival copied up or
         * read from its file. */
        assert_true(ws.bytes_device_to_host + ws.bytes_dropped >= 4 * model_bytes);
        assert_int_equal(ws.bytes_host_to_device + ws.bytes_read_source, 5 * model_bytes);
    } else {
        assert_int_equal(ws.bytes_host_to_device + ws.bytes_device_to_host, 0);
    }
    assert_true(ws.kv_blocks_demoted > 0);
    /* Accounting: the device tier's used slots include the weights. */
    kvh_tier_info dev = tu_tier(e, KVH_TIER_DEVICE);
    /* The context is charged the slots of its regions' pages together;
     * the bytes are the regions' own. */
    assert_int_equal(ws.bytes_device, LAYERS * (BIG + SMALL) + sizeof(a->extra));
    assert_int_equal(ws.slots_device, per_model);
    assert_true(dev.used_blocks >= ws.slots_device);
    assert_true(dev.used_blocks <= dev.capacity_blocks);
    assert_ok(kvh_seq_free(e, sa));
    assert_ok(kvh_seq_free(e, sb));
    assert_ok(kvh_context_destroy(e, a->ctx));
    assert_ok(kvh_context_destroy(e, b->ctx));
    ws = ct_weight_stats(e);
    assert_int_equal(ws.slots_device + ws.slots_host, 0);
    /* What is left in the tiers is KV (cached blocks of freed sequences). */
    kvh_stats ks = tu_stats(e);
    assert_int_equal(tu_tier(e, KVH_TIER_DEVICE).used_blocks + tu_tier(e, KVH_TIER_HOST).used_blocks,
                     ks.blocks_allocated - ks.blocks_freed);
}

/* Without room to keep them in the host tier, clean regions are dropped
 * and read again from their file: never written anywhere. */
static void clean_weights_never_written(void **state)
{
    mode md = MODE(state);
    char pa[600], pb[600];
    uint8_t *fa = write_weights(scratch("ca.bin", pa, sizeof(pa)), 33);
    uint8_t *fb = write_weights(scratch("cb.bin", pb, sizeof(pb)), 44);
    uint64_t bb = tu_block_bytes_of(L, H, D, BT, KVH_DTYPE_F32);
    uint64_t per_model = slots_per_model(bb);
    /* Host: room for the two byte-sourced regions only (a page each). */
    kvh_engine *e = open_engine(md, per_model + 2, 2 * region_slots(sizeof(((model *)0)->extra), bb), NULL);
    model *a = tu_alloc(sizeof(model)), *b = tu_alloc(sizeof(model));
    make_model(e, a, pa, fa, KVH_CONTEXT_KV_KEEP, 3);
    make_model(e, b, pb, fb, KVH_CONTEXT_KV_KEEP, 4);
    kvh_context none = {0};
    assert_ok(kvh_context_switch(e, none, a->ctx, NULL));
    for (int i = 0; i < 6; i++) {
        model *out = i % 2 ? b : a, *in = i % 2 ? a : b;
        assert_ok(kvh_context_switch(e, out->ctx, in->ctx, NULL));
        check_model(e, in);
    }
    kvh_weight_stats ws = ct_weight_stats(e);
    uint64_t file_bytes = LAYERS * (BIG + SMALL), extra = sizeof(a->extra);
    /* Most clean regions found no room and were dropped; the few that
     * fitted next to the byte-sourced ones stayed in RAM. */
    assert_true(ws.bytes_dropped >= 5 * file_bytes);
    if (md.copies) {
        /* Every arrival came from the file or from what RAM kept. */
        assert_int_equal(ws.bytes_read_source + ws.bytes_host_to_device, 7 * (file_bytes + extra));
        assert_true(ws.bytes_device_to_host >= 6 * extra);
    } else {
        assert_int_equal(ws.bytes_device_to_host + ws.bytes_host_to_device, 0);
    }
    /* Nothing went anywhere but RAM. */
    assert_int_equal(ws.bytes_host_to_disk, 0);
}

/* A region handed out writable is written back, not dropped, and comes
 * back with the change; its checksums follow. */
static void modified_weights_written_back(void **state)
{
    mode md = MODE(state);
    char pa[600], pb[600];
    uint8_t *fa = write_weights(scratch("ma.bin", pa, sizeof(pa)), 55);
    uint8_t *fb = write_weights(scratch("mb.bin", pb, sizeof(pb)), 66);
    /* The device tier holds one model with room to spare, not two; the
     * host tier both with room to spare, so the departure goes to RAM. */
    uint64_t per_model = slots_per_model(tu_block_bytes_of(L, H, D, BT, KVH_DTYPE_F32));
    kvh_engine *e = open_engine(md, per_model + per_model / 2, 3 * per_model, NULL);
    model *a = tu_alloc(sizeof(model)), *b = tu_alloc(sizeof(model));
    make_model(e, a, pa, fa, KVH_CONTEXT_KV_KEEP, 5);
    make_model(e, b, pb, fb, KVH_CONTEXT_KV_KEEP, 6);
    kvh_context none = {0};
    assert_ok(kvh_context_switch(e, none, a->ctx, NULL));
    uint8_t *p;
    uint64_t n;
    assert_ok(kvh_context_region_data(e, a->ctx, 0, 1, (void **)&p, &n));
    for (uint64_t i = 0; i < n; i += 7)
        p[i] ^= 0x5a;
    uint8_t *want = tu_alloc(n);
    memcpy(want, p, n);
    kvh_weight_stats before = ct_weight_stats(e);
    assert_ok(kvh_context_switch(e, a->ctx, b->ctx, NULL));
    kvh_weight_stats mid = ct_weight_stats(e);
    uint64_t moved =
        md.copies ? mid.bytes_device_to_host - before.bytes_device_to_host : mid.bytes_remapped - before.bytes_remapped;
    assert_true(moved >= n);
    assert_ok(kvh_context_switch(e, b->ctx, a->ctx, NULL));
    assert_ok(kvh_context_region_data(e, a->ctx, 0, 0, (void **)&p, &n));
    assert_memory_equal(p, want, n);
    uint64_t checked;
    assert_ok(kvh_context_verify(e, a->ctx, &checked));
}

/* A weight file changed behind the engine's back is caught by the chunk
 * checksums recorded at the first load. */
static void changed_source_is_corrupt(void **state)
{
    mode md = MODE(state);
    char pa[600], pb[600];
    uint8_t *fa = write_weights(scratch("xa.bin", pa, sizeof(pa)), 77);
    uint8_t *fb = write_weights(scratch("xb.bin", pb, sizeof(pb)), 88);
    uint64_t bb = tu_block_bytes_of(L, H, D, BT, KVH_DTYPE_F32);
    uint64_t per_model = slots_per_model(bb);
    /* Host: room for the two byte-sourced regions only (a page each). */
    kvh_engine *e = open_engine(md, per_model + 2, 2 * region_slots(sizeof(((model *)0)->extra), bb), NULL);
    model *a = tu_alloc(sizeof(model)), *b = tu_alloc(sizeof(model));
    make_model(e, a, pa, fa, KVH_CONTEXT_KV_KEEP, 7);
    make_model(e, b, pb, fb, KVH_CONTEXT_KV_KEEP, 8);
    kvh_context none = {0};
    assert_ok(kvh_context_switch(e, none, a->ctx, NULL));
    assert_ok(kvh_context_switch(e, a->ctx, b->ctx, NULL));
    /* Flip one byte of layer 2's big region in a's file. */
    int fd = open(pa, O_WRONLY);
    assert_true(fd >= 0);
    uint8_t x = fa[2 * (BIG + SMALL) + 1500] ^ 1;
    assert_int_equal(pwrite(fd, &x, 1, 2 * (BIG + SMALL) + 1500), 1);
    close(fd);
    kvh_fence f;
    assert_ok(kvh_context_switch(e, b->ctx, a->ctx, &f));
    assert_kvh(KVH_ERR_CORRUPT, kvh_fence_wait(e, f, UINT64_MAX));
    assert_ok(kvh_fence_free(e, f));
    assert_int_equal(ct_weight_stats(e).crc_failures, 1);
    /* Layers before the bad one loaded; waiting for it reports the error. */
    assert_ok(kvh_context_wait_layer(e, a->ctx, 1, UINT64_MAX));
    assert_kvh(KVH_ERR_CORRUPT, kvh_context_wait_layer(e, a->ctx, 2, UINT64_MAX));
    assert_int_equal(ct_context_info(e, a->ctx).loading, 0);
    /* Once a switch has taken it out, that error is over: no switch loads
     * its layers (it kept reporting the old error). */
    assert_ok(kvh_context_switch(e, a->ctx, b->ctx, NULL));
    assert_kvh(KVH_ERR_NOT_RESIDENT, kvh_context_wait_layer(e, a->ctx, 0, 0));
}

/* With a fence, early layers can be used before the switch completes. */
static void layers_ready_in_order(void **state)
{
    mode md = MODE(state);
    char pa[600];
    uint8_t *fa = write_weights(scratch("la.bin", pa, sizeof(pa)), 99);
    /* Each memory tier holds the model with room to spare. */
    uint64_t per_model = slots_per_model(tu_block_bytes_of(L, H, D, BT, KVH_DTYPE_F32));
    kvh_engine *e = open_engine(md, per_model + per_model / 2, per_model + per_model / 2, NULL);
    model *a = tu_alloc(sizeof(model));
    make_model(e, a, pa, fa, KVH_CONTEXT_KV_KEEP, 9);
    assert_kvh(KVH_ERR_NOT_RESIDENT, kvh_context_wait_layer(e, a->ctx, 0, 0));
    kvh_context none = {0};
    kvh_fence f;
    assert_ok(kvh_context_switch(e, none, a->ctx, &f));
    assert_ok(kvh_context_wait_layer(e, a->ctx, 0, UINT64_MAX));
    /* Regions of layer 0 (registered last) are there now. */
    void *p;
    assert_ok(kvh_context_region_data(e, a->ctx, 2 * (LAYERS - 1), 0, &p, NULL));
    assert_memory_equal(p, fa, BIG);
    assert_ok(kvh_fence_wait(e, f, UINT64_MAX));
    assert_ok(kvh_fence_free(e, f));
    assert_ok(kvh_context_wait_layer(e, a->ctx, LAYERS - 1, 0));
    check_model(e, a);
    /* Unloading: switch to nothing. */
    assert_ok(kvh_context_switch(e, a->ctx, none, NULL));
    assert_int_equal(ct_context_info(e, a->ctx).bytes_device, 0);
    assert_kvh(KVH_ERR_NOT_RESIDENT, kvh_context_region_data(e, a->ctx, 0, 0, &p, NULL));
}

/* Pinned regions stay in the device tier through a switch away. */
static void pinned_regions_stay(void **state)
{
    mode md = MODE(state);
    char pa[600], pb[600];
    uint8_t *fa = write_weights(scratch("pa.bin", pa, sizeof(pa)), 111);
    uint8_t *fb = write_weights(scratch("pb.bin", pb, sizeof(pb)), 222);
    kvh_engine *e = open_engine(md, 96, 96, NULL);
    model *a = tu_alloc(sizeof(model)), *b = tu_alloc(sizeof(model));
    make_model(e, a, pa, fa, KVH_CONTEXT_KV_KEEP, 10);
    make_model(e, b, pb, fb, KVH_CONTEXT_KV_KEEP, 11);
    assert_ok(kvh_context_region_pin(e, a->ctx, 1, 1));
    kvh_context none = {0};
    assert_ok(kvh_context_switch(e, none, a->ctx, NULL));
    assert_ok(kvh_context_switch(e, a->ctx, b->ctx, NULL));
    void *p;
    assert_ok(kvh_context_region_data(e, a->ctx, 1, 0, &p, NULL));
    assert_memory_equal(p, fa + a->offset[1], a->size[1]);
    assert_kvh(KVH_ERR_NOT_RESIDENT, kvh_context_region_data(e, a->ctx, 0, 0, &p, NULL));
    assert_int_equal(ct_context_info(e, a->ctx).bytes_device, a->size[1]);
    assert_kvh(KVH_ERR_RANGE, kvh_context_region_pin(e, a->ctx, 99, 1));
}

/* The device tier full of KV and the host tier too: a switch evicts KV
 * down to the disk tier instead of failing, and every KV byte survives. */
static void switch_under_pressure(void **state)
{
    mode md = MODE(state);
    char pa[600], pb[600], dir[600];
    uint8_t *fa = write_weights(scratch("ua.bin", pa, sizeof(pa)), 123);
    uint8_t *fb = write_weights(scratch("ub.bin", pb, sizeof(pb)), 456);
    scratch("disk", dir, sizeof(dir));
    mkdir(dir, 0700);
    uint64_t bb = tu_block_bytes_of(L, H, D, BT, KVH_DTYPE_F32);
    uint64_t per_model = slots_per_model(bb);
    kvh_engine *e = open_engine(md, per_model + 4, per_model + 4, dir);
    model *a = tu_alloc(sizeof(model)), *b = tu_alloc(sizeof(model));
    make_model(e, a, pa, fa, KVH_CONTEXT_KV_DEMOTE, 12);
    make_model(e, b, pb, fb, KVH_CONTEXT_KV_DEMOTE, 13);
    /* KV filling both memory tiers several times over. */
    enum { NSEQ = 12, BLOCKS = 6 };
    kvh_seq s[NSEQ];
    for (int i = 0; i < NSEQ; i++)
        s[i] = kv_seq(e, i % 2 ? b->ctx : a->ctx, BLOCKS, 100 + (uint64_t)i);
    kvh_context none = {0};
    assert_ok(kvh_context_switch(e, none, a->ctx, NULL));
    for (int round = 0; round < 6; round++) {
        model *out = round % 2 ? b : a, *in = round % 2 ? a : b;
        assert_ok(kvh_context_switch(e, out->ctx, in->ctx, NULL));
        check_model(e, in);
    }
    for (int i = 0; i < NSEQ; i++)
        assert_true(tu_check_pattern(e, s[i], L, TOK, 100 + (uint64_t)i, 0, BLOCKS * BT));
    assert_true(tu_stats(e).blocks_host_to_disk > 0);
}

static void bad_arguments(void **state)
{
    (void)state;
    kvh_engine *e = open_engine(M_UNI0, 64, 64, NULL);
    kvh_context c, none = {0};
    assert_kvh(KVH_ERR_INVALID_ARG, kvh_context_create(e, NULL, NULL));
    assert_kvh(KVH_ERR_INVALID_ARG, kvh_context_create(NULL, NULL, &c));
    kvh_context_params cp;
    assert_kvh(KVH_ERR_STRUCT_SIZE, kvh_context_params_init(&cp, sizeof(cp) - 4));
    assert_ok(kvh_context_params_init(&cp, sizeof(cp)));
    cp.chunk_bytes = 0;
    assert_kvh(KVH_ERR_INVALID_ARG, kvh_context_create(e, &cp, &c));
    cp.chunk_bytes = 4096;
    cp.kv_policy = 7;
    assert_kvh(KVH_ERR_INVALID_ARG, kvh_context_create(e, &cp, &c));
    cp.struct_size = 3;
    assert_kvh(KVH_ERR_STRUCT_SIZE, kvh_context_create(e, &cp, &c));
    assert_ok(kvh_context_create(e, NULL, &c));
    kvh_weight_region_params rp;
    assert_ok(kvh_weight_region_params_init(&rp, sizeof(rp)));
    uint32_t idx;
    assert_kvh(KVH_ERR_INVALID_ARG, kvh_context_add_region(e, c, &rp, &idx)); /* size 0 */
    rp.size = 10;
    assert_kvh(KVH_ERR_INVALID_ARG, kvh_context_add_region(e, c, &rp, &idx)); /* no source */
    uint8_t bytes[10] = {0};
    rp.bytes = bytes;
    rp.path = "/nonexistent";
    assert_kvh(KVH_ERR_INVALID_ARG, kvh_context_add_region(e, c, &rp, &idx)); /* two sources */
    rp.bytes = NULL;
    assert_kvh(KVH_ERR_IO, kvh_context_add_region(e, c, &rp, &idx));
    char p[600];
    write_weights(scratch("short.bin", p, sizeof(p)), 1);
    rp.path = p;
    rp.file_offset = FILE_BYTES - 5;
    assert_kvh(KVH_ERR_IO, kvh_context_add_region(e, c, &rp, &idx));
    rp.file_offset = 0;
    char dir[600]; /* a directory or a FIFO is no weight file (a FIFO would block the open) */
    scratch("weights.d", dir, sizeof(dir));
    assert_int_equal(mkdir(dir, 0700), 0);
    rp.path = dir;
    assert_kvh(KVH_ERR_IO, kvh_context_add_region(e, c, &rp, &idx));
    char fifo[600];
    scratch("weights.fifo", fifo, sizeof(fifo));
    assert_int_equal(mkfifo(fifo, 0600), 0);
    rp.path = fifo;
    assert_kvh(KVH_ERR_IO, kvh_context_add_region(e, c, &rp, &idx));
    rmdir(dir);
    unlink(fifo);
    rp.path = p;
    rp.size = 1ull << 40; /* larger than any tier */
    assert_kvh(KVH_ERR_IO, kvh_context_add_region(e, c, &rp, &idx));
    rp.path = NULL;
    rp.bytes = bytes;
    rp.size = 1ull << 20; /* bytes larger than the host tier */
    /* (never read: refused before any copy) */
    assert_kvh(KVH_ERR_NOSPACE, kvh_context_add_region(e, c, &rp, &idx));
    assert_kvh(KVH_ERR_INVALID_ARG, kvh_context_switch(e, c, c, NULL));
    kvh_context forged = {c.id ^ 0x100000000ull};
    assert_kvh(KVH_ERR_BAD_HANDLE, kvh_context_switch(e, none, forged, NULL));
    assert_kvh(KVH_ERR_BAD_HANDLE, kvh_context_destroy(e, forged));
    kvh_seq bad_seq = {12345};
    assert_kvh(KVH_ERR_BAD_HANDLE, kvh_context_attach_seq(e, c, bad_seq));
    void *d;
    assert_kvh(KVH_ERR_RANGE, kvh_context_region_data(e, c, 0, 0, &d, NULL));
    assert_kvh(KVH_ERR_INVALID_ARG, kvh_context_region_data(e, c, 0, 0, NULL, NULL));
    kvh_context_info ci;
    ci.struct_size = 4;
    assert_kvh(KVH_ERR_STRUCT_SIZE, kvh_context_info_get(e, c, &ci));
    kvh_weight_stats ws;
    ws.struct_size = 2;
    assert_kvh(KVH_ERR_STRUCT_SIZE, kvh_weight_stats_get(e, &ws));
    /* An older, shorter stats struct is filled up to its size. */
    ws.struct_size = offsetof(kvh_weight_stats, slots_device);
    assert_ok(kvh_weight_stats_get(e, &ws));
    assert_ok(kvh_context_destroy(e, c));
    assert_kvh(KVH_ERR_BAD_HANDLE, kvh_context_destroy(e, c));
    assert_ok(kvh_context_destroy(e, none));
}

/* A context still loaded when the engine closes is freed with it. */
static void close_with_contexts(void **state)
{
    mode md = MODE(state);
    char pa[600];
    uint8_t *fa = write_weights(scratch("za.bin", pa, sizeof(pa)), 5);
    /* Room for the whole model: the switch in flight at the close is one
     * that would complete. */
    uint64_t per_model = slots_per_model(tu_block_bytes_of(L, H, D, BT, KVH_DTYPE_F32));
    kvh_engine *e = open_engine(md, per_model + per_model / 2, per_model + per_model / 2, NULL);
    model *a = tu_alloc(sizeof(model));
    make_model(e, a, pa, fa, KVH_CONTEXT_KV_KEEP, 14);
    kvh_context none = {0};
    kvh_fence f;
    assert_ok(kvh_context_switch(e, none, a->ctx, &f));
    assert_ok(tu_close(e)); /* waits for the switch */
}

/* A KVH_CONTEXT_KV_DEMOTE switch counts the KV blocks it moved: a block
 * that attached sequences share (a fork) is moved and counted once, so
 * kv_blocks_demoted and kv_blocks_promoted equal the blocks that changed
 * tier, with or without migration workers. */
static void demote_counts_shared_blocks_once(void **state)
{
    mode md = MODE(state);
    enum { NB = 4 };
    kvh_engine *e = open_engine(md, 64, 64, NULL);
    kvh_context_params cp;
    assert_ok(kvh_context_params_init(&cp, sizeof(cp)));
    cp.kv_policy = KVH_CONTEXT_KV_DEMOTE;
    kvh_context a, b;
    assert_ok(kvh_context_create(e, &cp, &a));
    assert_ok(kvh_context_create(e, NULL, &b));
    kvh_seq s = kv_seq(e, a, NB, 3), f;
    assert_ok(kvh_seq_fork(e, s, 0, &f));
    assert_ok(kvh_context_attach_seq(e, a, f));
    kvh_context none = {0};
    assert_ok(kvh_context_switch(e, none, a, NULL));
    kvh_weight_stats w0 = ct_weight_stats(e);
    assert_ok(kvh_context_switch(e, a, b, NULL));
    kvh_weight_stats w1 = ct_weight_stats(e);
    kvh_block blocks[NB];
    assert_ok(kvh_seq_blocks(e, s, 0, NB, blocks));
    for (int i = 0; i < NB; i++)
        assert_int_equal(tu_binfo(e, blocks[i]).tier, KVH_TIER_HOST);
    assert_int_equal(w1.kv_blocks_demoted - w0.kv_blocks_demoted, NB);
    assert_ok(kvh_context_switch(e, b, a, NULL));
    kvh_weight_stats w2 = ct_weight_stats(e);
    for (int i = 0; i < NB; i++)
        assert_int_equal(tu_binfo(e, blocks[i]).tier, KVH_TIER_DEVICE);
    assert_int_equal(w2.kv_blocks_promoted - w1.kv_blocks_promoted, NB);
    assert_true(tu_check_pattern(e, s, L, TOK, 3, 0, NB * BT));
    assert_true(tu_check_pattern(e, f, L, TOK, 3, 0, NB * BT));
    assert_ok(kvh_seq_free(e, f));
    assert_ok(kvh_seq_free(e, s));
    assert_ok(kvh_context_destroy(e, a));
    assert_ok(kvh_context_destroy(e, b));
}

/* KVH_CONTEXT_KV_DEMOTE moves the KV out of the device tier: to the disk
 * tier where there is no host tier, or the host tier is full of weights
 * (the switch said OK and left it all on the device). */
static void demote_goes_to_disk_where_the_host_cannot_take_it(void **state)
{
    mode md = MODE(state);
    enum { NB = 3 };
    for (int host_full = 0; host_full < 2; host_full++) {
        char dir[600];
        scratch(host_full ? "demote-full" : "demote-none", dir, sizeof(dir));
        uint64_t bb = tu_block_bytes_of(L, H, D, BT, KVH_DTYPE_F32);
        static uint8_t weights[64 << 10];
        uint64_t host_blocks = host_full ? region_slots(sizeof(weights), bb) : 0;
        kvh_engine *e = open_engine(md, 64, host_blocks, dir);
        kvh_context_params cp;
        assert_ok(kvh_context_params_init(&cp, sizeof(cp)));
        cp.kv_policy = KVH_CONTEXT_KV_DEMOTE;
        kvh_context a, w, none = {0};
        assert_ok(kvh_context_create(e, &cp, &a));
        assert_ok(kvh_context_create(e, NULL, &w));
        if (host_full) {
            kvh_weight_region_params rp;
            assert_ok(kvh_weight_region_params_init(&rp, sizeof(rp)));
            rp.size = sizeof(weights);
            rp.bytes = weights;
            uint32_t idx;
            assert_ok(kvh_context_add_region(e, w, &rp, &idx));
            assert_int_equal(tu_tier(e, KVH_TIER_HOST).used_blocks, host_blocks);
        }
        assert_ok(kvh_context_switch(e, none, a, NULL));
        kvh_seq s = kv_seq(e, a, NB, 5);
        kvh_weight_stats w0 = ct_weight_stats(e);
        assert_ok(kvh_context_switch(e, a, none, NULL));
        kvh_block blocks[NB];
        assert_ok(kvh_seq_blocks(e, s, 0, NB, blocks));
        for (int i = 0; i < NB; i++)
            assert_int_equal(tu_binfo(e, blocks[i]).tier, KVH_TIER_DISK);
        assert_int_equal(ct_weight_stats(e).kv_blocks_demoted - w0.kv_blocks_demoted, NB);
        assert_ok(kvh_context_switch(e, none, a, NULL));
        for (int i = 0; i < NB; i++)
            assert_int_equal(tu_binfo(e, blocks[i]).tier, KVH_TIER_DEVICE);
        assert_true(tu_check_pattern(e, s, L, TOK, 5, 0, NB * BT));
        assert_ok(kvh_seq_free(e, s));
        assert_ok(tu_close(e));
    }
}

/* Unnamed contexts and regions are named in messages by handle and index
 * ("weight region '' of context ''" said nothing). A region from bytes
 * with neither host nor disk tier to go to cannot leave the device tier. */
static void unnamed_ones_are_named_by_handle_and_index(void **state)
{
    mode md = MODE(state);
    kvh_engine *e = open_engine(md, 64, 0, NULL);
    kvh_context w, none = {0};
    assert_ok(kvh_context_create(e, NULL, &w));
    static uint8_t weights[2][4096];
    for (int i = 0; i < 2; i++) {
        kvh_weight_region_params rp;
        assert_ok(kvh_weight_region_params_init(&rp, sizeof(rp)));
        rp.size = sizeof(weights[i]);
        rp.bytes = weights[i];
        uint32_t idx;
        assert_ok(kvh_context_add_region(e, w, &rp, &idx));
        assert_int_equal(idx, i);
    }
    assert_ok(kvh_context_switch(e, none, w, NULL));
    assert_kvh(KVH_ERR_NOSPACE, kvh_context_switch(e, w, none, NULL));
    char want[96];
    snprintf(want, sizeof(want), "of context '0x%llx'", (unsigned long long)w.id);
    assert_non_null(strstr(kvh_last_error(), want));
    assert_true(strstr(kvh_last_error(), "weight region '#1'") || strstr(kvh_last_error(), "weight region '#0'"));
    assert_ok(tu_close(e));
}

/* The weight slots of each memory tier, in kvh_weight_stats and in the
 * tier's used_blocks alike (no KV here), and the weight bytes resident. */
static void expect_weights(kvh_engine *e, uint64_t dev_slots, uint64_t dev_bytes, uint64_t host_slots,
                           uint64_t host_bytes)
{
    kvh_weight_stats ws = ct_weight_stats(e);
    assert_int_equal(ws.slots_device, dev_slots);
    assert_int_equal(ws.bytes_device, dev_bytes);
    assert_int_equal(ws.slots_host, host_slots);
    assert_int_equal(ws.bytes_host, host_bytes);
    assert_int_equal(tu_tier(e, KVH_TIER_DEVICE).used_blocks, dev_slots);
    if (tu_tier(e, KVH_TIER_HOST).capacity_blocks)
        assert_int_equal(tu_tier(e, KVH_TIER_HOST).used_blocks, host_slots);
}

static void add_byte_region(kvh_engine *e, kvh_context c, const uint8_t *byte)
{
    kvh_weight_region_params rp;
    assert_ok(kvh_weight_region_params_init(&rp, sizeof(rp)));
    rp.size = 1;
    rp.bytes = byte;
    uint32_t idx;
    assert_ok(kvh_context_add_region(e, c, &rp, &idx));
}

/* kvh.h: each region is its own allocation, charged whole pages, however
 * small and however many its context has. Two 1-byte regions take two
 * pages' slots in every tier they visit (registration, switch in, a
 * pinned one staying behind, clean ones kept in the host tier) and give
 * every slot back. */
static void tiny_regions_take_a_page_each(void **state)
{
    mode md = MODE(state);
    const uint64_t ps = page_bytes() / tu_block_bytes_of(L, H, D, BT, KVH_DTYPE_F32); /* slots a page */
    kvh_engine *e = open_engine(md, 4 * ps, 4 * ps, NULL);
    kvh_context c, f, none = {0};
    assert_ok(kvh_context_create(e, NULL, &c));
    const uint8_t bytes[2] = {0x11, 0x22};
    add_byte_region(e, c, &bytes[0]);
    add_byte_region(e, c, &bytes[1]);
    expect_weights(e, 0, 0, 2 * ps, 2);
    assert_ok(kvh_context_switch(e, none, c, NULL));
    expect_weights(e, 2 * ps, 2, 0, 0);
    for (uint32_t i = 0; i < 2; i++) {
        void *p = NULL;
        assert_ok(kvh_context_region_data(e, c, i, 0, &p, NULL));
        assert_int_equal(*(uint8_t *)p, bytes[i]);
    }
    assert_ok(kvh_context_region_pin(e, c, 0, 1));
    assert_ok(kvh_context_switch(e, c, none, NULL));
    expect_weights(e, 1 * ps, 1, 1 * ps, 1);
    assert_ok(kvh_context_switch(e, none, c, NULL));
    expect_weights(e, 2 * ps, 2, 0, 0);
    assert_ok(kvh_context_region_pin(e, c, 0, 0));

    /* Clean 1-byte regions from a file: kept in the host tier on the way
     * out (there is room), one slot each there too. */
    char path[600];
    uint8_t *file = write_weights(scratch("tiny.bin", path, sizeof(path)), 5);
    assert_ok(kvh_context_create(e, NULL, &f));
    for (uint32_t i = 0; i < 2; i++) {
        kvh_weight_region_params rp;
        assert_ok(kvh_weight_region_params_init(&rp, sizeof(rp)));
        rp.size = 1;
        rp.path = path;
        rp.file_offset = 100 * i;
        uint32_t idx;
        assert_ok(kvh_context_add_region(e, f, &rp, &idx));
    }
    expect_weights(e, 2 * ps, 2, 0, 0); /* nothing of f placed yet */
    assert_ok(kvh_context_switch(e, c, f, NULL));
    expect_weights(e, 2 * ps, 2, 2 * ps, 2);
    assert_ok(kvh_context_switch(e, f, c, NULL));
    expect_weights(e, 2 * ps, 2, 2 * ps, 2);
    assert_int_equal(ct_context_info(e, f).bytes_host, 2);
    assert_ok(kvh_context_switch(e, c, f, NULL));
    for (uint32_t i = 0; i < 2; i++) {
        void *p = NULL;
        assert_ok(kvh_context_region_data(e, f, i, 0, &p, NULL));
        assert_int_equal(*(uint8_t *)p, file[100 * i]);
    }
    assert_ok(kvh_context_destroy(e, c));
    expect_weights(e, 2 * ps, 2, 0, 0);
    assert_ok(kvh_context_destroy(e, f));
    expect_weights(e, 0, 0, 0, 0);
}

/* A page a region is a budget: registration takes no more regions than
 * the tier they land in has pages, a switch brings in no more than the
 * device tier has (KVH_ERR_NOSPACE, the rest stays where it was), and
 * every slot comes back. */
static void regions_beyond_the_pages_are_refused(void **state)
{
    mode md = MODE(state);
    enum { DEV = 6, HOST = 10 };                                                      /* pages */
    const uint64_t ps = page_bytes() / tu_block_bytes_of(L, H, D, BT, KVH_DTYPE_F32); /* slots a page */
    kvh_engine *e = open_engine(md, DEV * ps, HOST * ps, NULL);
    kvh_context c, none = {0};
    assert_ok(kvh_context_create(e, NULL, &c));
    uint8_t bytes[HOST + 1];
    for (uint32_t i = 0; i <= HOST; i++)
        bytes[i] = (uint8_t)(i * 37 + 1);
    for (uint32_t i = 0; i < HOST; i++)
        add_byte_region(e, c, &bytes[i]);
    kvh_weight_region_params rp;
    assert_ok(kvh_weight_region_params_init(&rp, sizeof(rp)));
    rp.size = 1;
    rp.bytes = &bytes[HOST];
    uint32_t idx;
    assert_kvh(KVH_ERR_NOSPACE, kvh_context_add_region(e, c, &rp, &idx));
    assert_int_equal(ct_context_info(e, c).regions, HOST);
    expect_weights(e, 0, 0, HOST * ps, HOST);
    /* More pages than the device tier has: refused before any moves. */
    assert_kvh(KVH_ERR_NOSPACE, kvh_context_switch(e, none, c, NULL));
    assert_non_null(strstr(kvh_last_error(), "more than the whole device tier"));
    expect_weights(e, 0, 0, HOST * ps, HOST);
    kvh_context_info ci = ct_context_info(e, c);
    assert_int_equal(ci.bytes_device, 0);
    assert_int_equal(ci.layers_ready, 0);
    assert_ok(kvh_context_destroy(e, c));
    expect_weights(e, 0, 0, 0, 0);

    /* From a file nothing is placed until the switch, which refuses a
     * context of more pages than the device tier's slots. */
    char path[600];
    write_weights(scratch("budget.bin", path, sizeof(path)), 6);
    assert_ok(kvh_context_create(e, NULL, &c));
    rp.bytes = NULL;
    rp.path = path;
    for (uint32_t i = 0; i < 3 * DEV; i++) {
        rp.file_offset = i;
        assert_ok(kvh_context_add_region(e, c, &rp, &idx));
    }
    expect_weights(e, 0, 0, 0, 0);
    assert_kvh(KVH_ERR_NOSPACE, kvh_context_switch(e, none, c, NULL));
    expect_weights(e, 0, 0, 0, 0);
    assert_ok(kvh_context_destroy(e, c));
    expect_weights(e, 0, 0, 0, 0);

    /* Without a host tier, bytes are placed in the device tier: as many
     * regions as it has slots. */
    kvh_engine *d = open_engine(md, DEV * ps, 0, NULL);
    assert_ok(kvh_context_create(d, NULL, &c));
    for (uint32_t i = 0; i < DEV; i++)
        add_byte_region(d, c, &bytes[i]);
    rp.path = NULL;
    rp.bytes = &bytes[DEV];
    assert_kvh(KVH_ERR_NOSPACE, kvh_context_add_region(d, c, &rp, &idx));
    expect_weights(d, DEV * ps, DEV, 0, 0);
    assert_ok(kvh_context_destroy(d, c));
    expect_weights(d, 0, 0, 0, 0);
}

/* The error for a region past the context's names the index asked for,
 * also UINT32_MAX, where one more would wrap to 0. */
static void a_missing_region_is_named_as_asked(void **state)
{
    (void)state;
    kvh_engine *e = open_engine(M_UNI0, 64, 64, NULL);
    kvh_context c;
    assert_ok(kvh_context_create(e, NULL, &c));
    uint8_t byte = 1;
    add_byte_region(e, c, &byte);
    const uint32_t asked[] = {1, 7, UINT32_MAX};
    for (size_t i = 0; i < sizeof(asked) / sizeof(asked[0]); i++) {
        char want[64];
        snprintf(want, sizeof(want), "no region %u", asked[i]);
        void *p;
        assert_kvh(KVH_ERR_RANGE, kvh_context_region_data(e, c, asked[i], 0, &p, NULL));
        const char *msg = kvh_last_error();
        assert_true(strlen(msg) >= strlen(want));
        assert_string_equal(msg + strlen(msg) - strlen(want), want);
        assert_kvh(KVH_ERR_RANGE, kvh_context_region_pin(e, c, asked[i], 1));
        msg = kvh_last_error();
        assert_true(strlen(msg) >= strlen(want));
        assert_string_equal(msg + strlen(msg) - strlen(want), want);
    }
    assert_ok(kvh_context_destroy(e, c));
}

/* Two contexts of memory only (regions from bytes: no file to read them
 * again), each three quarters of a tier, trade places between the device
 * and host tiers with no disk: neither tier can hold both, so each side
 * must make room for the other as it goes. It failed with NOSPACE and
 * left both half loaded. */
static void memory_only_contexts_trade_places(void **state)
{
    enum { REGIONS = 3, REGION = 8192, SLOTS = 64 }; /* 16 slots of 512 bytes a region */
    kvh_engine *e = open_engine(MODE(state), SLOTS, SLOTS, NULL);
    static uint8_t src[2][REGIONS * REGION];
    kvh_context ctx[2], none = {0};
    for (int m = 0; m < 2; m++) {
        kvh_context_params cp;
        assert_ok(kvh_context_params_init(&cp, sizeof(cp)));
        assert_ok(kvh_context_create(e, &cp, &ctx[m]));
        for (size_t i = 0; i < sizeof(src[m]); i++)
            src[m][i] = (uint8_t)(i * 131 + m * 7 + 1);
        /* Bytes are copied into the host tier as they are registered:
         * the first context moves out of the way first. */
        for (uint32_t r = 0; r < REGIONS; r++) {
            kvh_weight_region_params rp;
            assert_ok(kvh_weight_region_params_init(&rp, sizeof(rp)));
            rp.layer = r;
            rp.bytes = src[m] + r * REGION;
            rp.size = REGION;
            uint32_t idx;
            assert_ok(kvh_context_add_region(e, ctx[m], &rp, &idx));
        }
        if (m == 0)
            assert_ok(kvh_context_switch(e, none, ctx[0], NULL));
    }
    for (int round = 0; round < 4; round++) {
        int out = round % 2, in = 1 - out;
        assert_ok(kvh_context_switch(e, ctx[out], ctx[in], NULL));
        kvh_context_info ii = ct_context_info(e, ctx[in]), oi = ct_context_info(e, ctx[out]);
        assert_int_equal(ii.bytes_device, REGIONS * REGION);
        assert_int_equal(oi.bytes_host, REGIONS * REGION);
        for (uint32_t r = 0; r < REGIONS; r++) {
            void *p = NULL;
            assert_ok(kvh_context_region_data(e, ctx[in], r, 0, &p, NULL));
            assert_memory_equal(p, src[in] + r * REGION, REGION);
        }
    }
    for (int m = 0; m < 2; m++)
        assert_ok(kvh_context_destroy(e, ctx[m]));
    assert_ok(tu_close(e));
}

typedef struct verify_arg {
    kvh_engine *e;
    kvh_context ctx;
    int busy, failed;
} verify_arg;

static void *verify_often(void *p)
{
    verify_arg *v = p;
    for (int i = 0; i < 200; i++) {
        kvh_status st = kvh_context_verify(v->e, v->ctx, NULL);
        v->busy += st == KVH_ERR_BUSY;
        v->failed += st != KVH_OK && st != KVH_ERR_BUSY;
    }
    return NULL;
}

/* Verifies of one idle context from two threads: each checks, none is
 * refused (one thread got KVH_ERR_BUSY on every call: the header lists it
 * only while a switch involves the context). */
static void verifies_run_side_by_side(void **state)
{
    char pa[600];
    uint8_t *fa = write_weights(scratch("va.bin", pa, sizeof(pa)), 91);
    uint64_t slots = slots_per_model(tu_block_bytes_of(L, H, D, BT, KVH_DTYPE_F32));
    kvh_engine *e = open_engine(MODE(state), slots + 4, slots + 4, NULL);
    model *a = tu_alloc(sizeof(model));
    make_model(e, a, pa, fa, KVH_CONTEXT_KV_KEEP, 9);
    kvh_context none = {0};
    assert_ok(kvh_context_switch(e, none, a->ctx, NULL));
    verify_arg v[2] = {{e, a->ctx, 0, 0}, {e, a->ctx, 0, 0}};
    pthread_t t[2];
    for (int i = 0; i < 2; i++)
        assert_int_equal(pthread_create(&t[i], NULL, verify_often, &v[i]), 0);
    for (int i = 0; i < 2; i++)
        assert_int_equal(pthread_join(t[i], NULL), 0);
    for (int i = 0; i < 2; i++)
        assert_int_equal(v[i].busy + v[i].failed, 0);
    assert_ok(tu_close(e));
}

/* A switch's error keeps its whole text: region and context names as
 * long as a model's, and the reason after them (it was cut at 191
 * characters, mid-word). The device tier is full of pinned KV. */
static void long_names_keep_the_reason(void **state)
{
    enum { DEV_BLOCKS = 16 };
    kvh_engine *e = open_engine(MODE(state), DEV_BLOCKS, 64, NULL);
    kvh_context_params cp;
    assert_ok(kvh_context_params_init(&cp, sizeof(cp)));
    cp.name = "mmmmmmmmmmmmmmmmmmmmmmmmmmmmmmmmmmmmmmm";
    kvh_context c;
    assert_ok(kvh_context_create(e, &cp, &c));
    static uint8_t bytes[4096];
    kvh_weight_region_params rp;
    assert_ok(kvh_weight_region_params_init(&rp, sizeof(rp)));
    rp.name = "model.layers.17.mlp.down_proj.weight";
    rp.bytes = bytes;
    rp.size = sizeof(bytes);
    uint32_t idx;
    assert_ok(kvh_context_add_region(e, c, &rp, &idx));
    kvh_seq s;
    assert_ok(kvh_seq_create(e, 0, &s));
    int32_t t[DEV_BLOCKS * BT];
    tu_iota(t, DEV_BLOCKS * BT, 1);
    assert_ok(kvh_seq_append(e, s, t, DEV_BLOCKS * BT));
    assert_ok(kvh_seq_pin(e, s, 0, DEV_BLOCKS * BT, 1));
    kvh_context none = {0};
    assert_kvh(KVH_ERR_NOSPACE, kvh_context_switch(e, none, c, NULL));
    const char *msg = kvh_last_error(), *reason = "every block is pinned, held or in flight";
    assert_true(strlen(msg) > 191);
    assert_non_null(strstr(msg, rp.name));
    assert_non_null(strstr(msg, reason));
    assert_ok(kvh_seq_pin(e, s, 0, DEV_BLOCKS * BT, 0));
    assert_ok(kvh_seq_free(e, s));
    assert_ok(kvh_context_destroy(e, c));
    assert_ok(tu_close(e));
}

/* A sequence of n full blocks of KV-less tokens 1, 2, ... */
static kvh_seq seq_of_blocks(kvh_engine *e, uint32_t n)
{
    kvh_seq s;
    assert_ok(kvh_seq_create(e, 0, &s));
    int32_t *t = tu_alloc(sizeof(int32_t) * n * BT);
    tu_iota(t, n * BT, 1);
    assert_ok(kvh_seq_append(e, s, t, n * BT));
    tu_free(t);
    return s;
}

/* A context of n regions from memory, region r of layer r at bytes + r * size. */
static kvh_context context_of_layers(kvh_engine *e, uint8_t *bytes, uint32_t n, size_t size)
{
    kvh_context_params cp;
    assert_ok(kvh_context_params_init(&cp, sizeof(cp)));
    kvh_context c;
    assert_ok(kvh_context_create(e, &cp, &c));
    for (uint32_t r = 0; r < n; r++) {
        kvh_weight_region_params rp;
        assert_ok(kvh_weight_region_params_init(&rp, sizeof(rp)));
        rp.layer = r;
        rp.bytes = bytes + (size_t)r * size;
        rp.size = size;
        uint32_t idx;
        assert_ok(kvh_context_add_region(e, c, &rp, &idx));
    }
    return c;
}

/* A context whose regions together exceed the device tier, each fitting
 * alone, is refused before anything moves: the switch used to evict
 * every KV block, load part of it and report a full tier. */
static void a_context_larger_than_the_device_tier_moves_nothing(void **state)
{
    enum { DEV_BLOCKS = 20, KV_BLOCKS = 8, REGION = 4096 }; /* 8 slots of 512 bytes a region */
    kvh_engine *e = open_engine(MODE(state), DEV_BLOCKS, 64, NULL);
    kvh_seq s = seq_of_blocks(e, KV_BLOCKS);
    uint64_t kv_device = tu_tier(e, KVH_TIER_DEVICE).used_blocks;
    static uint8_t bytes[3][REGION];
    kvh_context c = context_of_layers(e, &bytes[0][0], 3, REGION);
    kvh_context none = {0};
    assert_kvh(KVH_ERR_NOSPACE, kvh_context_switch(e, none, c, NULL));
    assert_non_null(strstr(kvh_last_error(), "more than the whole device tier"));
    assert_int_equal(tu_tier(e, KVH_TIER_DEVICE).used_blocks, kv_device);
    assert_int_equal(ct_context_info(e, c).bytes_device, 0);
    assert_ok(kvh_seq_free(e, s));
    assert_ok(kvh_context_destroy(e, c));
    assert_ok(tu_close(e));
}

/* A switch whose work runs out of room (the KV that would have to leave
 * is pinned) keeps the regions that arrived, leaves the rest where they
 * were, and the same call again completes it once room is free (kvh.h). */
static void a_failed_switch_keeps_what_arrived_and_a_retry_ends_it(void **state)
{
    enum { DEV_BLOCKS = 20, KV_BLOCKS = 8, REGION = 4096 }; /* 8 slots of 512 bytes a region */
    kvh_engine *e = open_engine(MODE(state), DEV_BLOCKS, 64, NULL);
    kvh_seq s = seq_of_blocks(e, KV_BLOCKS);
    assert_ok(kvh_seq_pin(e, s, 0, KV_BLOCKS * BT, 1)); /* 12 slots left: one region, not two */
    static uint8_t bytes[2][REGION];
    for (uint32_t r = 0; r < 2; r++)
        for (uint32_t i = 0; i < REGION; i++)
            bytes[r][i] = (uint8_t)(i * 7u + r * 131u + 1u);
    kvh_context c = context_of_layers(e, &bytes[0][0], 2, REGION);
    kvh_context none = {0};
    assert_kvh(KVH_ERR_NOSPACE, kvh_context_switch(e, none, c, NULL));
    assert_non_null(strstr(kvh_last_error(), "pinned, held or in flight"));
    assert_int_equal(ct_context_info(e, c).bytes_device, REGION); /* layer 0 arrived */
    void *p = NULL;
    size_t n = 0;
    assert_ok(kvh_context_region_data(e, c, 0, 0, &p, &n));
    assert_int_equal(n, REGION);
    assert_memory_equal(p, bytes[0], REGION);
    assert_kvh(KVH_ERR_NOT_RESIDENT, kvh_context_region_data(e, c, 1, 0, &p, &n));

    assert_ok(kvh_seq_pin(e, s, 0, KV_BLOCKS * BT, 0));
    kvh_weight_stats before = ct_weight_stats(e);
    assert_ok(kvh_context_switch(e, none, c, NULL));
    kvh_weight_stats after = ct_weight_stats(e);
    assert_int_equal(ct_context_info(e, c).bytes_device, 2 * REGION);
    /* The retry brought the missing region alone. */
    assert_int_equal(after.bytes_host_to_device + after.bytes_remapped -
                         (before.bytes_host_to_device + before.bytes_remapped),
                     REGION);
    for (uint32_t r = 0; r < 2; r++) {
        assert_ok(kvh_context_region_data(e, c, r, 0, &p, &n));
        assert_memory_equal(p, bytes[r], REGION);
    }
    assert_ok(kvh_seq_free(e, s));
    assert_ok(kvh_context_destroy(e, c));
    assert_ok(tu_close(e));
}

/* Bytes wait in the host tier until a switch: without a disk tier, a
 * region from memory larger than the host tier (but not the device tier)
 * is refused as such, not as a tier with no room "now". */
static void bytes_beyond_the_host_tier_say_why(void **state)
{
    kvh_engine *e = open_engine(MODE(state), 256, 32, NULL); /* host: 16 KiB */
    kvh_context c;
    assert_ok(kvh_context_create(e, NULL, &c));
    static uint8_t bytes[32768];
    kvh_weight_region_params rp;
    assert_ok(kvh_weight_region_params_init(&rp, sizeof(rp)));
    rp.bytes = bytes;
    rp.size = sizeof(bytes);
    uint32_t idx;
    assert_kvh(KVH_ERR_NOSPACE, kvh_context_add_region(e, c, &rp, &idx));
    assert_non_null(strstr(kvh_last_error(), "larger than the host tier"));
    assert_int_equal(ct_context_info(e, c).regions, 0);
    assert_ok(kvh_context_destroy(e, c));
    assert_ok(tu_close(e));
}

static kvh_context bytes_context(kvh_engine *e, const uint8_t *bytes, uint32_t regions, uint64_t size)
{
    kvh_context c;
    assert_ok(kvh_context_create(e, NULL, &c));
    for (uint32_t r = 0; r < regions; r++) {
        kvh_weight_region_params rp;
        assert_ok(kvh_weight_region_params_init(&rp, sizeof(rp)));
        rp.layer = r;
        rp.bytes = bytes + r * size;
        rp.size = size;
        uint32_t idx;
        assert_ok(kvh_context_add_region(e, c, &rp, &idx));
    }
    return c;
}

/* A device tier full of pinned weights: the error says weights fill it
 * (it blamed blocks pinned, held or in flight, with no KV there). */
static void a_tier_full_of_weights_says_so(void **state)
{
    enum { REGION = 4096 }; /* 8 slots of 512 bytes */
    kvh_engine *e = open_engine(MODE(state), 20, 64, NULL);
    static uint8_t bytes[4 * REGION];
    kvh_context a = bytes_context(e, bytes, 2, REGION), none = {0};
    assert_ok(kvh_context_switch(e, none, a, NULL));
    for (uint32_t r = 0; r < 2; r++)
        assert_ok(kvh_context_region_pin(e, a, r, 1));
    kvh_context b = bytes_context(e, bytes + 2 * REGION, 2, REGION);
    assert_kvh(KVH_ERR_NOSPACE, kvh_context_switch(e, a, b, NULL));
    assert_non_null(strstr(kvh_last_error(), "16 of the device tier's 20 slots hold weights of contexts"));
    for (uint32_t r = 0; r < 2; r++)
        assert_ok(kvh_context_region_pin(e, a, r, 0));
    assert_ok(tu_close(e));
}

typedef struct verify_loop {
    kvh_engine *e;
    kvh_context ctx;
    atomic_int *stop;
} verify_loop;

static void *verify_until_stopped(void *p)
{
    verify_loop *v = p;
    while (!atomic_load(v->stop))
        (void)kvh_context_verify(v->e, v->ctx, NULL);
    return NULL;
}

/* Verifies that overlap, one thread's starting before another's ends,
 * never let a switch of their context start (six threads held it off
 * for over a minute): a waiting switch keeps new ones off. */
static void overlapping_verifies_let_a_switch_start(void **state)
{
    enum { THREADS = 6, REGION = 4 << 20 };
    uint64_t slots = 2 * REGION / tu_block_bytes_of(L, H, D, BT, KVH_DTYPE_F32);
    kvh_engine *e = open_engine(MODE(state), slots, slots, NULL);
    uint8_t *bytes = tu_alloc(REGION);
    kvh_context c = bytes_context(e, bytes, 1, REGION), none = {0};
    assert_ok(kvh_context_switch(e, none, c, NULL));
    atomic_int stop = 0;
    verify_loop v = {e, c, &stop};
    pthread_t t[THREADS];
    for (int i = 0; i < THREADS; i++)
        assert_int_equal(pthread_create(&t[i], NULL, verify_until_stopped, &v), 0);
    usleep(100 * 1000); /* the verifies overlap */
    double t0 = tu_now();
    assert_ok(kvh_context_switch(e, c, none, NULL));
    double took = tu_now() - t0;
    atomic_store(&stop, 1);
    for (int i = 0; i < THREADS; i++)
        assert_int_equal(pthread_join(t[i], NULL), 0);
    if (took > 20)
        fail_msg("the switch waited %.1f s for verifies", took);
    assert_ok(tu_close(e));
}

typedef struct churn {
    kvh_engine *e;
    atomic_int stop;
} churn;

static void *alloc_and_release(void *p)
{
    churn *ch = p;
    while (!atomic_load(&ch->stop)) {
        kvh_block b;
        if (kvh_block_alloc(ch->e, 0, &b) == KVH_OK) {
            sched_yield();
            (void)kvh_block_release(ch->e, b);
        }
        sched_yield();
    }
    return NULL;
}

/* Two memory-only contexts trading tiers while another thread allocates
 * and releases a KV block: a device slot freed by that thread signals
 * nothing to the switch, whose two sides then waited on each other for
 * good (in 10-92 rounds). Each switch must end, done or refused. */
static void trading_contexts_beside_block_churn_never_hang(void **state)
{
    enum { REGIONS = 3, REGION = 16384, ROUNDS = 60 }; /* 32 slots of 512 bytes a region */
    kvh_engine *e = open_engine(MODE(state), 128, 96, NULL);
    static uint8_t bytes[2][REGIONS * REGION];
    for (int m = 0; m < 2; m++)
        for (size_t i = 0; i < sizeof(bytes[m]); i++)
            bytes[m][i] = (uint8_t)(i * 29 + m + 3);
    kvh_context ctx[2], none = {0};
    ctx[0] = bytes_context(e, bytes[0], REGIONS, REGION);
    assert_ok(kvh_context_switch(e, none, ctx[0], NULL));
    ctx[1] = bytes_context(e, bytes[1], REGIONS, REGION);
    churn ch = {.e = e};
    pthread_t t;
    assert_int_equal(pthread_create(&t, NULL, alloc_and_release, &ch), 0);
    for (int round = 0; round < ROUNDS; round++) {
        int out = round % 2, in = 1 - out;
        kvh_fence f;
        assert_ok(kvh_context_switch(e, ctx[out], ctx[in], &f));
        kvh_status st = kvh_fence_wait(e, f, 20ull * 1000 * 1000 * 1000);
        if (st == KVH_ERR_TIMEOUT) {
            atomic_store(&ch.stop, 1);
            pthread_join(t, NULL);
            fail_msg("round %d: the switch did not end in 20 s", round);
        }
        assert_ok(kvh_fence_free(e, f));
        if (st != KVH_OK) {
            assert_int_equal(st, KVH_ERR_NOSPACE); /* the other thread's block can take the last slot */
            continue;
        }
        for (uint32_t r = 0; r < REGIONS; r++) {
            void *p = NULL;
            assert_ok(kvh_context_region_data(e, ctx[in], r, 0, &p, NULL));
            assert_memory_equal(p, bytes[in] + r * REGION, REGION);
        }
    }
    atomic_store(&ch.stop, 1);
    assert_int_equal(pthread_join(t, NULL), 0);
    /* Under churn every round may be refused on a loaded machine (the
     * other thread's block takes the slot an arrival needs); alone, the
     * two trade places every time. */
    int in = ct_context_info(e, ctx[0]).bytes_device > ct_context_info(e, ctx[1]).bytes_device;
    for (int round = 0; round < 4; round++, in = 1 - in) {
        assert_ok(kvh_context_switch(e, ctx[1 - in], ctx[in], NULL));
        for (uint32_t r = 0; r < REGIONS; r++) {
            void *p = NULL;
            assert_ok(kvh_context_region_data(e, ctx[in], r, 0, &p, NULL));
            assert_memory_equal(p, bytes[in] + r * REGION, REGION);
        }
    }
    assert_ok(tu_close(e));
}

/* A switch waiting to start (for verifies to end) holds a context as
 * one running does: a verify and a destroy meanwhile are BUSY. The wait
 * is set by hand here; overlapping_verifies_let_a_switch_start makes it
 * with threads. */
static void a_waiting_switch_keeps_verify_and_destroy_off(void **state)
{
    (void)state;
    kvh_engine *e = open_engine(M_UNI0, 64, 64, NULL);
    static uint8_t bytes[4096];
    kvh_context c = bytes_context(e, bytes, 1, sizeof(bytes));
    kvhi_context *x = NULL;
    pthread_mutex_lock(&e->lock);
    assert_ok(kvhi_context_resolve(e, c, &x));
    x->switches_waiting++;
    pthread_mutex_unlock(&e->lock);
    assert_kvh(KVH_ERR_BUSY, kvh_context_verify(e, c, NULL));
    assert_kvh(KVH_ERR_BUSY, kvh_context_destroy(e, c));
    pthread_mutex_lock(&e->lock);
    x->switches_waiting--;
    pthread_mutex_unlock(&e->lock);
    assert_ok(kvh_context_verify(e, c, NULL));
    assert_ok(kvh_context_destroy(e, c));
    assert_ok(tu_close(e));
}

#define MODES(fn)                                                                                                      \
    cmocka_unit_test_prestate_setup_teardown(fn, NULL, tu_teardown, &M_UNI0),                                          \
        cmocka_unit_test_prestate_setup_teardown(fn, NULL, tu_teardown, &M_UNI2),                                      \
        cmocka_unit_test_prestate_setup_teardown(fn, NULL, tu_teardown, &M_COPY0),                                     \
        cmocka_unit_test_prestate_setup_teardown(fn, NULL, tu_teardown, &M_COPY2)

int main(void)
{
    const struct CMUnitTest tests[] = {
        MODES(switch_preserves_everything),
        MODES(clean_weights_never_written),
        MODES(modified_weights_written_back),
        MODES(changed_source_is_corrupt),
        MODES(layers_ready_in_order),
        MODES(pinned_regions_stay),
        MODES(switch_under_pressure),
        MODES(close_with_contexts),
        MODES(demote_counts_shared_blocks_once),
        MODES(demote_goes_to_disk_where_the_host_cannot_take_it),
        MODES(unnamed_ones_are_named_by_handle_and_index),
        MODES(tiny_regions_take_a_page_each),
        MODES(regions_beyond_the_pages_are_refused),
        MODES(memory_only_contexts_trade_places),
        MODES(verifies_run_side_by_side),
        MODES(long_names_keep_the_reason),
        MODES(a_context_larger_than_the_device_tier_moves_nothing),
        MODES(a_failed_switch_keeps_what_arrived_and_a_retry_ends_it),
        MODES(bytes_beyond_the_host_tier_say_why),
        MODES(a_tier_full_of_weights_says_so),
        cmocka_unit_test_prestate_setup_teardown(overlapping_verifies_let_a_switch_start, NULL, tu_teardown, &M_COPY2),
        MODES(trading_contexts_beside_block_churn_never_hang),
        cmocka_unit_test_teardown(a_waiting_switch_keeps_verify_and_destroy_off, tu_teardown),
        cmocka_unit_test_teardown(bad_arguments, tu_teardown),
        cmocka_unit_test_teardown(a_missing_region_is_named_as_asked, tu_teardown),
    };
    int failed = cmocka_run_group_tests(tests, NULL, NULL);
    /* Outside ctest (no KVH_TEST_TMPDIR) the scratch directory is ours. */
    if (tmpdir[0])
        nftw(tmpdir, remove_entry, 8, FTW_DEPTH | FTW_PHYS);
    return failed;
}
