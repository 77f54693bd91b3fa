/* External pools against a hostile caller, from kvh.h's promises alone
 * ("Prefix index and external pools", "Batched, asynchronous pool
 * transfers"): bad layouts, slots, handles and kvh_pool_xfer arrays get
 * their exact status with nothing written, retained or queued; offload and
 * restore move exact bytes between pools of different layouts (padded,
 * misaligned, head-major) and through every tier, a disk store reopen
 * included, checked against copies the test keeps; a restore writes the
 * elements of its slot and layers and no other byte; unregistering and
 * closing leave the blocks and the caller's memory sound. */
#include <limits.h>
#include <pthread.h>
#include <stdatomic.h>

#include "test_util.h"
#include "disk_test_util.h"

enum { L = 2, H = 2, D = 8, BT = 4 };
static const dt_geo G = {L, H, D, BT, KVH_DTYPE_F16};
enum { ROW = D * 2, TOKB = H * ROW, SLOT_ELEMS = BT * H * ROW, BLOCK_BYTES = 2 * L * SLOT_ELEMS };
static const uint8_t PAD = 0xa5; /* bytes of a pool that are no element */

/* ---- pools of any layout, with the padding between elements kept ---- */

typedef struct hp_pool {
    uint32_t slots;
    size_t base_off, bytes; /* first element's offset in each buffer; size */
    uint8_t *buf[L][2];     /* per layer, K and V */
    void *kp[L], *vp[L];
    kvh_pool_layout layout;
} hp_pool;

static size_t hp_off(const hp_pool *p, uint32_t slot, uint32_t t, uint32_t h)
{
    return p->base_off + slot * p->layout.slot_stride + t * p->layout.token_stride + h * p->layout.head_stride;
}

/* A pool of slots slots with these strides, its first element base_off
 * bytes into each buffer (an odd base_off misaligns it): padding PAD,
 * elements random from seed. */
static void hp_init(hp_pool *p, uint32_t slots, uint64_t slot_stride, uint64_t token_stride, uint64_t head_stride,
                    size_t base_off, uint64_t seed)
{
    memset(p, 0, sizeof(*p));
    p->slots = slots;
    p->base_off = base_off;
    p->layout.struct_size = sizeof(kvh_pool_layout);
    p->layout.memory = KVH_MEMORY_HOST;
    p->layout.num_slots = slots;
    p->layout.slot_stride = slot_stride;
    p->layout.token_stride = token_stride;
    p->layout.head_stride = head_stride;
    p->bytes = 0;
    for (uint32_t s = 0; s < slots; s++)
        for (uint32_t t = 0; t < BT; t++)
            for (uint32_t h = 0; h < H; h++)
                if (hp_off(p, s, t, h) + ROW > p->bytes)
                    p->bytes = hp_off(p, s, t, h) + ROW;
    p->bytes += 24; /* a tail of padding */
    tu_rng r = {seed};
    for (uint32_t l = 0; l < L; l++) {
        for (int kv = 0; kv < 2; kv++) {
            p->buf[l][kv] = tu_alloc(p->bytes);
            memset(p->buf[l][kv], PAD, p->bytes);
            for (uint32_t s = 0; s < slots; s++)
                for (uint32_t t = 0; t < BT; t++)
                    for (uint32_t h = 0; h < H; h++)
                        tu_fill(&r, p->buf[l][kv] + hp_off(p, s, t, h), ROW);
        }
        p->kp[l] = p->buf[l][0] + base_off;
        p->vp[l] = p->buf[l][1] + base_off;
    }
    p->layout.k_base = p->kp;
    p->layout.v_base = p->vp;
}

/* vLLM's layout: [slot][token][head][dim] packed. */
static void hp_vllm(hp_pool *p, uint32_t slots, uint64_t seed) { hp_init(p, slots, SLOT_ELEMS, TOKB, ROW, 0, seed); }

/* Head-major, every stride padded to an odd size, bases misaligned. */
static void hp_padded(hp_pool *p, uint32_t slots, uint64_t seed)
{
    uint64_t ts = ROW + 3, hs = BT * ts + 5, ss = H * hs + 7;
    hp_init(p, slots, ss, ts, hs, 1, seed);
}

/* Token rows of a head packed (token_stride == one row), heads apart by
 * an odd gap. */
static void hp_rows_packed(hp_pool *p, uint32_t slots, uint64_t seed)
{
    uint64_t hs = BT * ROW + 9, ss = H * hs + 2;
    hp_init(p, slots, ss, ROW, hs, 3, seed);
}

/* The logical KV of a slot, [layer][K,V][token][head][dim]. */
static void hp_get(const hp_pool *p, uint32_t slot, uint8_t *out)
{
    for (uint32_t l = 0; l < L; l++)
        for (int kv = 0; kv < 2; kv++)
            for (uint32_t t = 0; t < BT; t++)
                for (uint32_t h = 0; h < H; h++)
                    memcpy(out + (((l * 2 + (uint32_t)kv) * BT + t) * H + h) * ROW,
                           p->buf[l][kv] + hp_off(p, slot, t, h), ROW);
}

/* Writes logical KV into a slot, layers [l0, l0 + nl) only. */
static void hp_put_layers(hp_pool *p, uint32_t slot, const uint8_t *in, uint32_t l0, uint32_t nl)
{
    for (uint32_t l = l0; l < l0 + nl; l++)
        for (int kv = 0; kv < 2; kv++)
            for (uint32_t t = 0; t < BT; t++)
                for (uint32_t h = 0; h < H; h++)
                    memcpy(p->buf[l][kv] + hp_off(p, slot, t, h),
                           in + (((l * 2 + (uint32_t)kv) * BT + t) * H + h) * ROW, ROW);
}

static void hp_put(hp_pool *p, uint32_t slot, const uint8_t *in) { hp_put_layers(p, slot, in, 0, L); }

/* A copy of every byte of a pool (padding included). */
typedef struct hp_image {
    uint8_t *buf[L][2];
    size_t bytes;
} hp_image;

static void hp_snap(const hp_pool *p, hp_image *img)
{
    img->bytes = p->bytes;
    for (uint32_t l = 0; l < L; l++)
        for (int kv = 0; kv < 2; kv++) {
            img->buf[l][kv] = tu_alloc(p->bytes);
            memcpy(img->buf[l][kv], p->buf[l][kv], p->bytes);
        }
}

/* Every byte of the pool equals the image: prints the first difference. */
static int hp_same(const hp_pool *p, const hp_image *img)
{
    for (uint32_t l = 0; l < L; l++)
        for (int kv = 0; kv < 2; kv++)
            for (size_t i = 0; i < p->bytes; i++)
                if (p->buf[l][kv][i] != img->buf[l][kv][i]) {
                    print_error("pool byte %zu of layer %u %s: 0x%02x, expected 0x%02x\n", i, l, kv ? "V" : "K",
                                p->buf[l][kv][i], img->buf[l][kv][i]);
                    return 0;
                }
    return 1;
}

/* The image with a slot's elements (layers [l0, l0 + nl)) replaced. */
static void hp_image_put(const hp_pool *p, hp_image *img, uint32_t slot, const uint8_t *in, uint32_t l0, uint32_t nl)
{
    hp_pool view = *p;
    for (uint32_t l = 0; l < L; l++)
        for (int kv = 0; kv < 2; kv++)
            view.buf[l][kv] = img->buf[l][kv];
    hp_put_layers(&view, slot, in, l0, nl);
}

static void hp_fill_random(hp_pool *p, uint32_t slot, uint64_t seed)
{
    uint8_t kvb[BLOCK_BYTES];
    tu_rng r = {seed};
    tu_fill(&r, kvb, sizeof(kvb));
    hp_put(p, slot, kvb);
}

static void tokens_of(int32_t *t, uint32_t tag, uint32_t i) { tu_iota(t, BT, (int32_t)(tag * 1000 + i * BT)); }

static uint32_t threads_of(void **state) { return (uint32_t)(uintptr_t)*state; }

static kvh_engine *mem_engine(uint64_t dev, uint64_t host, uint32_t threads)
{
    return tu_open(L, H, D, BT, KVH_DTYPE_F16, dev, host, threads);
}

static void xfer_init(kvh_pool_xfer *x, uint32_t slot)
{
    memset(x, 0, sizeof(*x));
    x->struct_size = sizeof(kvh_pool_xfer);
    x->slot = slot;
}

static void wait_free(kvh_engine *e, kvh_fence f, kvh_status expect)
{
    assert_kvh(expect, kvh_fence_wait(e, f, UINT64_MAX));
    assert_ok(kvh_fence_free(e, f));
}

/* ---- register: every bad layout refused, nothing written ---- */

static void test_register_refuses_bad_layouts(void **state)
{
    (void)state;
    kvh_engine *e = mem_engine(4, 4, 0);
    hp_pool *p = tu_alloc(sizeof(*p));
    hp_vllm(p, 4, 1);
    kvh_pool out = {0x1234};
    kvh_pool_layout lay = p->layout;
    assert_kvh(KVH_ERR_INVALID_ARG, kvh_pool_register(NULL, &lay, &out));
    assert_kvh(KVH_ERR_INVALID_ARG, kvh_pool_register(e, NULL, &out));
    assert_kvh(KVH_ERR_INVALID_ARG, kvh_pool_register(e, &lay, NULL));
    /* Only the full size is taken, larger and multiples of 8 included. */
    const uint32_t sizes[] = {0,
                              8,
                              sizeof(kvh_pool_layout) - 8,
                              sizeof(kvh_pool_layout) - 1,
                              sizeof(kvh_pool_layout) + 1,
                              sizeof(kvh_pool_layout) + 8,
                              UINT32_MAX};
    for (size_t i = 0; i < sizeof(sizes) / sizeof(sizes[0]); i++) {
        lay = p->layout;
        lay.struct_size = sizes[i];
        assert_kvh(KVH_ERR_STRUCT_SIZE, kvh_pool_register(e, &lay, &out));
    }
    lay = p->layout;
    lay.k_base = NULL;
    assert_kvh(KVH_ERR_INVALID_ARG, kvh_pool_register(e, &lay, &out));
    lay = p->layout;
    lay.v_base = NULL;
    assert_kvh(KVH_ERR_INVALID_ARG, kvh_pool_register(e, &lay, &out));
    /* A NULL pointer for any one layer. */
    void *kp[L], *vp[L];
    for (uint32_t l = 0; l < L; l++)
        for (int kv = 0; kv < 2; kv++) {
            memcpy(kp, p->kp, sizeof(kp));
            memcpy(vp, p->vp, sizeof(vp));
            (kv ? vp : kp)[l] = NULL;
            lay = p->layout;
            lay.k_base = kp;
            lay.v_base = vp;
            assert_kvh(KVH_ERR_INVALID_ARG, kvh_pool_register(e, &lay, &out));
        }
    lay = p->layout;
    lay.num_slots = 0;
    assert_kvh(KVH_ERR_INVALID_ARG, kvh_pool_register(e, &lay, &out));
    lay = p->layout;
    lay.memory = 2;
    assert_kvh(KVH_ERR_INVALID_ARG, kvh_pool_register(e, &lay, &out));
    lay.memory = UINT32_MAX;
    assert_kvh(KVH_ERR_INVALID_ARG, kvh_pool_register(e, &lay, &out));
    lay.memory = KVH_MEMORY_CUDA; /* the CPU backend */
    assert_kvh(KVH_ERR_UNSUPPORTED, kvh_pool_register(e, &lay, &out));
    /* Strides below one head's row (head_dim elements of 2 bytes). */
    const uint64_t small[] = {0, 1, ROW - 1};
    for (size_t i = 0; i < 3; i++) {
        lay = p->layout;
        lay.token_stride = small[i];
        assert_kvh(KVH_ERR_INVALID_ARG, kvh_pool_register(e, &lay, &out));
        lay = p->layout;
        lay.head_stride = small[i];
        assert_kvh(KVH_ERR_INVALID_ARG, kvh_pool_register(e, &lay, &out));
    }
    /* Out-parameters are written only on success. */
    assert_int_equal(out.id, 0x1234);
    /* Exactly one row each is enough; the pointer arrays are copied. */
    lay = p->layout;
    lay.token_stride = ROW;
    lay.head_stride = ROW * BT;
    lay.k_base = kp;
    lay.v_base = vp;
    memcpy(kp, p->kp, sizeof(kp));
    memcpy(vp, p->vp, sizeof(vp));
    assert_ok(kvh_pool_register(e, &lay, &out));
    assert_true(out.id != 0 && out.id != 0x1234);
    memset(kp, 0, sizeof(kp));
    memset(vp, 0, sizeof(vp));
    int32_t tk[BT];
    tokens_of(tk, 1, 0);
    kvh_block b = {0};
    assert_ok(kvh_pool_offload(e, out, 3, 0, tk, BT, 0, &b));
    assert_ok(kvh_block_release(e, b));
    assert_ok(kvh_pool_unregister(e, out));
}

/* ---- offload / restore: bad arguments change nothing ---- */

static void test_offload_and_restore_misuse(void **state)
{
    (void)state;
    kvh_engine *e = mem_engine(4, 4, 0);
    kvh_engine *other = mem_engine(4, 4, 0);
    hp_pool *p = tu_alloc(sizeof(*p));
    hp_padded(p, 3, 2);
    kvh_pool pool;
    assert_ok(kvh_pool_register(e, &p->layout, &pool));
    kvh_pool opool;
    assert_ok(kvh_pool_register(other, &p->layout, &opool));
    int32_t tk[BT];
    tokens_of(tk, 2, 0);
    kvh_block good;
    assert_ok(kvh_pool_offload(e, pool, 0, 0, tk, BT, 0, &good));
    kvh_seq s = tu_seq_new(e, 0);
    kvh_stats s0 = tu_stats(e);
    hp_image before;
    hp_snap(p, &before);

    kvh_block b = {0x77};
    const size_t bad_n[] = {0, BT - 1, BT + 1, SIZE_MAX};
    for (size_t i = 0; i < 4; i++) {
        assert_kvh(KVH_ERR_INVALID_ARG, kvh_pool_offload(e, pool, 1, 0, tk, bad_n[i], 0, &b));
        assert_kvh(KVH_ERR_INVALID_ARG, kvh_pool_offload_scoped(e, pool, 1, 9, 0, tk, bad_n[i], 0, &b));
    }
    assert_kvh(KVH_ERR_INVALID_ARG, kvh_pool_offload(e, pool, 1, 0, NULL, BT, 0, &b));
    assert_kvh(KVH_ERR_INVALID_ARG, kvh_pool_offload(e, pool, 1, 0, tk, BT, 0, NULL));
    assert_kvh(KVH_ERR_INVALID_ARG, kvh_pool_offload(NULL, pool, 1, 0, tk, BT, 0, &b));
    assert_kvh(KVH_ERR_INVALID_ARG, kvh_pool_offload_scoped(e, pool, 1, 9, 0, NULL, BT, 0, &b));
    assert_kvh(KVH_ERR_RANGE, kvh_pool_offload(e, pool, 3, 0, tk, BT, 0, &b));
    assert_kvh(KVH_ERR_RANGE, kvh_pool_offload(e, pool, UINT32_MAX, 0, tk, BT, 0, &b));
    assert_kvh(KVH_ERR_RANGE, kvh_pool_offload_scoped(e, pool, 3, 9, 0, tk, BT, 0, &b));
    /* Forged pools: null, flipped bits, another type's handle, another
     * engine's. */
    const kvh_pool forged[] = {
        {0},    {pool.id ^ 1}, {pool.id ^ (1ull << 40)}, {pool.id + 0x100000000ull}, {UINT64_MAX}, {good.id},
        {s.id}, {opool.id}};
    for (size_t i = 0; i < sizeof(forged) / sizeof(forged[0]); i++) {
        assert_kvh(KVH_ERR_BAD_HANDLE, kvh_pool_offload(e, forged[i], 1, 0, tk, BT, 0, &b));
        assert_kvh(KVH_ERR_BAD_HANDLE, kvh_pool_restore(e, forged[i], good, 1));
    }
    assert_int_equal(b.id, 0x77);

    /* Restores: slot, forged blocks, blocks whose KV is incomplete. */
    assert_kvh(KVH_ERR_RANGE, kvh_pool_restore(e, pool, good, 3));
    assert_kvh(KVH_ERR_RANGE, kvh_pool_restore(e, pool, good, UINT32_MAX));
    assert_kvh(KVH_ERR_INVALID_ARG, kvh_pool_restore(NULL, pool, good, 1));
    const kvh_block fb[] = {{0}, {good.id ^ 1}, {good.id ^ (1ull << 40)}, {UINT64_MAX}, {pool.id}, {s.id}};
    for (size_t i = 0; i < sizeof(fb) / sizeof(fb[0]); i++)
        assert_kvh(KVH_ERR_BAD_HANDLE, kvh_pool_restore(e, pool, fb[i], 1));
    kvh_block ob;
    assert_ok(kvh_pool_offload(other, opool, 0, 0, tk, BT, 0, &ob));
    assert_kvh(KVH_ERR_BAD_HANDLE, kvh_pool_restore(e, pool, ob, 1));
    kvh_block fresh;
    assert_ok(kvh_block_alloc(e, 0, &fresh));
    assert_kvh(KVH_ERR_INVALID_ARG, kvh_pool_restore(e, pool, fresh, 1));
    /* A full block of a sequence with one layer's KV missing. */
    int32_t st[BT];
    tokens_of(st, 3, 0);
    assert_ok(kvh_seq_append(e, s, st, BT));
    uint8_t kv[BT * TOKB];
    memset(kv, 0x3c, sizeof(kv));
    assert_ok(kvh_seq_write_kv(e, s, 0, 0, BT, kv, kv));
    assert_kvh(KVH_ERR_INVALID_ARG, kvh_pool_restore(e, pool, tu_seq_block(e, s, 0), 1));
    /* A freed block's handle. */
    assert_ok(kvh_block_release(e, fresh));
    assert_kvh(KVH_ERR_BAD_HANDLE, kvh_pool_restore(e, pool, fresh, 1));

    /* Nothing above wrote a byte of the pool or made a block. */
    assert_true(hp_same(p, &before));
    kvh_stats s1 = tu_stats(e);
    assert_int_equal(s1.blocks_allocated - s0.blocks_allocated, 2); /* fresh and the sequence's */
    assert_int_equal(tu_binfo(e, good).refs, 1);
    /* And the engine still works. */
    uint8_t want[BLOCK_BYTES], got[BLOCK_BYTES];
    hp_get(p, 0, want);
    assert_ok(kvh_pool_restore(e, pool, good, 2));
    hp_get(p, 2, got);
    assert_memory_equal(got, want, BLOCK_BYTES);
    assert_ok(kvh_block_release(e, good));
    assert_ok(kvh_block_release(other, ob));
}

/* ---- exact bytes between pools of different layouts ---- */

static void test_restore_across_layouts_touches_only_the_slot(void **state)
{
    (void)state;
    kvh_engine *e = mem_engine(8, 8, threads_of(state));
    enum { NP = 3, SL = 3 };
    hp_pool *p = tu_alloc(sizeof(hp_pool) * NP);
    hp_vllm(&p[0], SL, 10);
    hp_padded(&p[1], SL, 11);
    hp_rows_packed(&p[2], SL, 12);
    kvh_pool pool[NP];
    for (int i = 0; i < NP; i++)
        assert_ok(kvh_pool_register(e, &p[i].layout, &pool[i]));
    /* One block from slot 1 of each pool, with a copy of its KV. */
    uint8_t(*kv)[BLOCK_BYTES] = tu_alloc(NP * BLOCK_BYTES);
    kvh_block b[NP];
    for (int i = 0; i < NP; i++) {
        int32_t tk[BT];
        tokens_of(tk, 20 + (uint32_t)i, 0);
        hp_get(&p[i], 1, kv[i]);
        assert_ok(kvh_pool_offload(e, pool[i], 1, 0, tk, BT, 0, &b[i]));
    }
    /* Every block into slot 2 of every pool (and slot 0 for one layer):
     * the slot's elements become the block's, no other byte changes. */
    for (int dst = 0; dst < NP; dst++)
        for (int src = 0; src < NP; src++) {
            hp_image want;
            hp_snap(&p[dst], &want);
            hp_image_put(&p[dst], &want, 2, kv[src], 0, L);
            assert_ok(kvh_pool_restore(e, pool[dst], b[src], 2));
            assert_true(hp_same(&p[dst], &want));

            hp_snap(&p[dst], &want);
            hp_image_put(&p[dst], &want, 0, kv[src], 1, 1);
            kvh_pool_xfer x;
            xfer_init(&x, 0);
            x.block = b[src];
            kvh_fence lf[1];
            assert_ok(kvh_pool_restore_batch(e, pool[dst], &x, 1, 1, 1, lf));
            wait_free(e, lf[0], KVH_OK);
            assert_ok(x.status);
            assert_true(hp_same(&p[dst], &want));
        }
    /* The blocks' bytes did not change through all that. */
    kvh_seq s = tu_seq_new(e, 0);
    int32_t tk[BT];
    tokens_of(tk, 21, 0);
    size_t m = 0;
    assert_ok(kvh_seq_match_prefix(e, s, tk, BT, &m));
    assert_int_equal(m, BT);
    uint8_t k[BT * TOKB], v[BT * TOKB];
    for (uint32_t l = 0; l < L; l++) {
        assert_ok(kvh_seq_read_kv(e, s, l, 0, BT, k, v));
        assert_memory_equal(k, kv[1] + (l * 2 + 0) * SLOT_ELEMS, sizeof(k));
        assert_memory_equal(v, kv[1] + (l * 2 + 1) * SLOT_ELEMS, sizeof(v));
    }
    for (int i = 0; i < NP; i++) {
        assert_ok(kvh_block_release(e, b[i]));
        assert_ok(kvh_pool_unregister(e, pool[i]));
    }
}

/* Slots that share memory (slot_stride 0) are allowed: each offload reads
 * what the memory holds at the time, each restore writes it. */
static void test_aliased_slots(void **state)
{
    (void)state;
    kvh_engine *e = mem_engine(8, 8, 0);
    hp_pool *p = tu_alloc(sizeof(*p));
    hp_init(p, 1, 0, TOKB, ROW, 0, 30);
    p->layout.num_slots = 4; /* four names for the same memory */
    kvh_pool pool;
    assert_ok(kvh_pool_register(e, &p->layout, &pool));
    uint8_t a[BLOCK_BYTES], c[BLOCK_BYTES], got[BLOCK_BYTES];
    hp_get(p, 0, a);
    int32_t t0[BT], t1[BT];
    tokens_of(t0, 30, 0);
    tokens_of(t1, 31, 0);
    kvh_block b0, b1;
    assert_ok(kvh_pool_offload(e, pool, 3, 0, t0, BT, 0, &b0));
    hp_fill_random(p, 0, 31);
    hp_get(p, 0, c);
    assert_ok(kvh_pool_offload(e, pool, 2, 0, t1, BT, 0, &b1));
    assert_ok(kvh_pool_restore(e, pool, b0, 1));
    hp_get(p, 0, got);
    assert_memory_equal(got, a, BLOCK_BYTES);
    assert_ok(kvh_pool_restore(e, pool, b1, 3));
    hp_get(p, 0, got);
    assert_memory_equal(got, c, BLOCK_BYTES);
    assert_ok(kvh_block_release(e, b0));
    assert_ok(kvh_block_release(e, b1));
}

/* ---- bytes through small memory tiers, the disk and a reopen ---- */

static void test_exact_bytes_through_disk_and_reopen(void **state)
{
    char dir[PATH_MAX];
    dt_scratch("pool_hostile_disk", dir, sizeof(dir));
    kvh_config c = dt_cfg(G, dir, 1, 1, 32, threads_of(state));
    kvh_engine *e = dt_open_a(&c);
    enum { N = 8 };
    hp_pool *p = tu_alloc(sizeof(*p));
    hp_padded(p, N, 40);
    kvh_pool pool;
    assert_ok(kvh_pool_register(e, &p->layout, &pool));
    uint8_t(*kv)[BLOCK_BYTES] = tu_alloc(N * BLOCK_BYTES);
    int32_t tok[N][BT];
    kvh_block b[N];
    uint64_t parent = 0;
    for (uint32_t i = 0; i < N; i++) {
        tokens_of(tok[i], 40, i);
        hp_get(p, i, kv[i]);
        assert_ok(kvh_pool_offload(e, pool, i, parent, tok[i], BT, 0, &b[i]));
        assert_ok(kvh_prefix_hash(e, parent, tok[i], BT, &parent));
    }
    /* Memory holds two blocks: the rest went to disk. */
    uint32_t on_disk = 0;
    for (uint32_t i = 0; i < N; i++)
        on_disk += tu_binfo(e, b[i]).tier == KVH_TIER_DISK;
    assert_true(on_disk >= N - 2);
    /* Scramble the pool, then restore block i into slot N-1-i, half one
     * by one and half as one batch; every byte checked. */
    for (uint32_t i = 0; i < N; i++)
        hp_fill_random(p, i, 400 + i);
    hp_image want;
    hp_snap(p, &want);
    for (uint32_t i = 0; i < N; i++)
        hp_image_put(p, &want, N - 1 - i, kv[i], 0, L);
    /* The batches hold their blocks while they run and the host tier
     * holds one block: one item each, all queued at once. */
    kvh_pool_xfer x[N / 2];
    kvh_fence lf[N / 2][L];
    for (uint32_t i = 0; i < N; i += 2)
        assert_ok(kvh_pool_restore(e, pool, b[i], N - 1 - i));
    for (uint32_t i = 1; i < N; i += 2) {
        xfer_init(&x[i / 2], N - 1 - i);
        x[i / 2].block = b[i];
        assert_ok(kvh_pool_restore_batch(e, pool, &x[i / 2], 1, 0, L, lf[i / 2]));
    }
    for (uint32_t i = 0; i < N / 2; i++)
        for (uint32_t l = 0; l < L; l++)
            wait_free(e, lf[i][l], KVH_OK);
    for (uint32_t i = 0; i < N / 2; i++)
        assert_ok(x[i].status);
    assert_true(hp_same(p, &want));

    /* Durable, closed with the pool still registered, reopened: found by
     * prefix and restored from disk, still exact. */
    assert_ok(kvh_blocks_persist(e, b, N, NULL));
    for (uint32_t i = 0; i < N; i++)
        assert_ok(kvh_block_release(e, b[i]));
    assert_ok(dt_close(e));
    e = dt_open_a(&c);
    assert_kvh(KVH_ERR_BAD_HANDLE, kvh_pool_restore(e, pool, b[0], 0)); /* the old engine's handles */
    assert_ok(kvh_pool_register(e, &p->layout, &pool));
    kvh_block found[N];
    size_t nf = 0;
    assert_ok(kvh_prefix_lookup(e, &tok[0][0], N * BT, found, N, &nf));
    assert_int_equal(nf, N);
    for (uint32_t i = 0; i < N; i++)
        hp_fill_random(p, i, 800 + i);
    hp_snap(p, &want);
    for (uint32_t i = 0; i < N; i++)
        hp_image_put(p, &want, i, kv[i], 0, L);
    for (uint32_t i = 0; i < N; i++)
        assert_ok(kvh_pool_restore(e, pool, found[i], i));
    assert_true(hp_same(p, &want));
    for (uint32_t i = 0; i < N; i++)
        assert_ok(kvh_block_release(e, found[i]));
}

/* A restore whose block cannot come off disk (memory tiers full of pinned
 * blocks) fails with KVH_ERR_NOSPACE and writes nothing; a batch writes
 * only the items that did not fail. */
static void test_restore_without_room_writes_nothing(void **state)
{
    char dir[PATH_MAX];
    dt_scratch("pool_hostile_room", dir, sizeof(dir));
    kvh_config c = dt_cfg(G, dir, 1, 1, 16, threads_of(state));
    kvh_engine *e = dt_open_a(&c);
    hp_pool *p = tu_alloc(sizeof(*p));
    hp_rows_packed(p, 4, 50);
    kvh_pool pool;
    assert_ok(kvh_pool_register(e, &p->layout, &pool));
    uint8_t kv[2][BLOCK_BYTES];
    kvh_block b[2];
    for (uint32_t i = 0; i < 2; i++) {
        int32_t tk[BT];
        tokens_of(tk, 50, i);
        hp_get(p, i, kv[i]);
        assert_ok(kvh_pool_offload(e, pool, i, 0, tk, BT, 0, &b[i]));
    }
    assert_ok(kvh_migrate(e, b, 2, KVH_TIER_DISK, NULL));
    kvh_block pin[2];
    for (int i = 0; i < 2; i++) {
        assert_ok(kvh_block_alloc(e, 0, &pin[i]));
        assert_ok(kvh_block_pin(e, pin[i], 1));
    }
    assert_int_equal(tu_binfo(e, b[0]).tier, KVH_TIER_DISK);
    hp_image want;
    hp_snap(p, &want);
    assert_kvh(KVH_ERR_NOSPACE, kvh_pool_restore(e, pool, b[0], 3));
    kvh_pool_xfer x[2];
    xfer_init(&x[0], 2);
    x[0].block = b[0];
    xfer_init(&x[1], 3);
    x[1].block = b[1];
    kvh_fence lf[L];
    assert_ok(kvh_pool_restore_batch(e, pool, x, 2, 0, L, lf));
    for (uint32_t l = 0; l < L; l++)
        wait_free(e, lf[l], KVH_ERR_NOSPACE);
    assert_kvh(KVH_ERR_NOSPACE, x[0].status);
    assert_kvh(KVH_ERR_NOSPACE, x[1].status);
    assert_true(hp_same(p, &want));
    /* Room again (the host tier's pin goes): the same blocks restore
     * exactly. */
    int host_pin = tu_binfo(e, pin[0]).tier == KVH_TIER_HOST ? 0 : 1;
    assert_int_equal(tu_binfo(e, pin[host_pin]).tier, KVH_TIER_HOST);
    assert_ok(kvh_block_pin(e, pin[host_pin], 0));
    assert_ok(kvh_block_release(e, pin[host_pin]));
    hp_image_put(p, &want, 3, kv[1], 0, L);
    assert_ok(kvh_pool_restore(e, pool, b[1], 3));
    assert_true(hp_same(p, &want));
    assert_ok(kvh_block_pin(e, pin[1 - host_pin], 0));
    assert_ok(kvh_block_release(e, pin[1 - host_pin]));
    for (int i = 0; i < 2; i++)
        assert_ok(kvh_block_release(e, b[i]));
}

/* A block on disk restores into a free device-tier slot when the host
 * tier is full of pinned blocks: NOSPACE means no memory tier could take
 * it (kvh.h, kvh_pool_restore_batch). */
static void test_restore_from_disk_uses_a_free_device_slot(void **state)
{
    char dir[PATH_MAX];
    dt_scratch("pool_hostile_devslot", dir, sizeof(dir));
    kvh_config c = dt_cfg(G, dir, 1, 1, 16, threads_of(state));
    kvh_engine *e = dt_open_a(&c);
    hp_pool *p = tu_alloc(sizeof(*p));
    hp_vllm(p, 4, 55);
    kvh_pool pool;
    assert_ok(kvh_pool_register(e, &p->layout, &pool));
    int32_t tk[BT];
    tokens_of(tk, 55, 0);
    uint8_t kv[BLOCK_BYTES];
    hp_get(p, 0, kv);
    kvh_block b;
    assert_ok(kvh_pool_offload(e, pool, 0, 0, tk, BT, 0, &b));
    assert_ok(kvh_migrate(e, &b, 1, KVH_TIER_DISK, NULL));
    kvh_block pin[2];
    for (int i = 0; i < 2; i++) {
        assert_ok(kvh_block_alloc(e, 0, &pin[i]));
        assert_ok(kvh_block_pin(e, pin[i], 1));
    }
    int dev_pin = tu_binfo(e, pin[0]).tier == KVH_TIER_DEVICE ? 0 : 1;
    assert_int_equal(tu_binfo(e, pin[dev_pin]).tier, KVH_TIER_DEVICE);
    assert_ok(kvh_block_pin(e, pin[dev_pin], 0));
    assert_ok(kvh_block_release(e, pin[dev_pin]));
    assert_int_equal(tu_tier(e, KVH_TIER_DEVICE).used_blocks, 0);
    hp_image want;
    hp_snap(p, &want);
    hp_image_put(p, &want, 2, kv, 0, L);
    assert_ok(kvh_pool_restore(e, pool, b, 2));
    assert_true(hp_same(p, &want));
    kvh_pool_xfer x;
    xfer_init(&x, 3);
    x.block = b;
    assert_ok(kvh_migrate(e, &b, 1, KVH_TIER_DISK, NULL));
    hp_image_put(p, &want, 3, kv, 0, L);
    kvh_fence lf[L];
    assert_ok(kvh_pool_restore_batch(e, pool, &x, 1, 0, L, lf));
    for (uint32_t l = 0; l < L; l++)
        wait_free(e, lf[l], KVH_OK);
    assert_ok(x.status);
    assert_true(hp_same(p, &want));
    assert_ok(kvh_block_release(e, b));
}

/* ---- kvh_pool_xfer arrays: struct_size games ---- */

/* A kvh_pool_xfer from a newer kvh.h: fields this one does not know. */
typedef struct wide_xfer {
    kvh_pool_xfer x;
    uint64_t newer[2];
} wide_xfer;

static void test_xfer_struct_size_games(void **state)
{
    kvh_engine *e = mem_engine(8, 8, threads_of(state));
    hp_pool *p = tu_alloc(sizeof(*p));
    hp_vllm(p, 6, 60);
    kvh_pool pool;
    assert_ok(kvh_pool_register(e, &p->layout, &pool));
    int32_t tok[3][BT];
    kvh_pool_xfer x[3];
    for (uint32_t i = 0; i < 3; i++) {
        tokens_of(tok[i], 60, i);
        xfer_init(&x[i], i);
        x[i].tokens = tok[i];
        x[i].block.id = 0xdead;
        x[i].status = 12345;
    }
    kvh_stats s0 = tu_stats(e);
    kvh_fence f = {0x99};
    const uint32_t bad_first[] = {0, 8, sizeof(kvh_pool_xfer) - 8, sizeof(kvh_pool_xfer) - 1,
                                  sizeof(kvh_pool_xfer) + 4};
    for (size_t i = 0; i < sizeof(bad_first) / sizeof(bad_first[0]); i++) {
        x[0].struct_size = bad_first[i];
        assert_kvh(KVH_ERR_INVALID_ARG, kvh_pool_offload_batch(e, pool, x, 1, 0, &f));
    }
    x[0].struct_size = sizeof(kvh_pool_xfer);
    const uint32_t bad_later[] = {0, sizeof(kvh_pool_xfer) - 8, sizeof(kvh_pool_xfer) + 8, UINT32_MAX};
    for (size_t i = 0; i < 4; i++) {
        x[2].struct_size = bad_later[i];
        assert_kvh(KVH_ERR_INVALID_ARG, kvh_pool_offload_batch(e, pool, x, 3, 0, &f));
    }
    x[2].struct_size = sizeof(kvh_pool_xfer);
    x[1].tokens = NULL;
    assert_kvh(KVH_ERR_INVALID_ARG, kvh_pool_offload_batch(e, pool, x, 3, 0, &f));
    x[1].tokens = tok[1];
    x[2].slot = 1;
    assert_kvh(KVH_ERR_INVALID_ARG, kvh_pool_offload_batch(e, pool, x, 3, 0, &f));
    x[2].slot = 6;
    assert_kvh(KVH_ERR_RANGE, kvh_pool_offload_batch(e, pool, x, 3, 0, &f));
    x[2].slot = UINT32_MAX;
    assert_kvh(KVH_ERR_RANGE, kvh_pool_offload_batch(e, pool, x, 3, 0, &f));
    x[2].slot = 2;
    assert_kvh(KVH_ERR_INVALID_ARG, kvh_pool_offload_batch(e, pool, x, 7, 0, &f));
    assert_kvh(KVH_ERR_INVALID_ARG, kvh_pool_offload_batch(e, pool, x, SIZE_MAX, 0, &f));
    /* Refused with nothing queued, retained or written. */
    assert_int_equal(f.id, 0x99);
    for (uint32_t i = 0; i < 3; i++) {
        assert_int_equal(x[i].block.id, 0xdead);
        assert_int_equal(x[i].status, 12345);
    }
    assert_int_equal(tu_stats(e).blocks_allocated, s0.blocks_allocated);
    assert_int_equal(tu_tier(e, KVH_TIER_HOST).used_blocks + tu_tier(e, KVH_TIER_DEVICE).used_blocks, 0);

    /* A newer, larger entry: its stride is honoured and the fields this
     * kvh does not know are left alone. */
    wide_xfer *w = tu_alloc(sizeof(wide_xfer) * 3);
    for (uint32_t i = 0; i < 3; i++) {
        w[i].x = x[i];
        w[i].x.struct_size = sizeof(wide_xfer);
        w[i].x.slot = 2 - i;
        w[i].newer[0] = 0x1111111111111111ull * (i + 1);
        w[i].newer[1] = ~w[i].newer[0];
    }
    uint8_t kv[3][BLOCK_BYTES];
    for (uint32_t i = 0; i < 3; i++)
        hp_get(p, 2 - i, kv[i]);
    assert_ok(kvh_pool_offload_batch(e, pool, &w[0].x, 3, 0, &f));
    wait_free(e, f, KVH_OK);
    for (uint32_t i = 0; i < 3; i++) {
        assert_ok(w[i].x.status);
        assert_true(w[i].x.block.id != 0 && w[i].x.block.id != 0xdead);
        assert_true(w[i].newer[0] == 0x1111111111111111ull * (i + 1) && w[i].newer[1] == ~w[i].newer[0]);
    }
    /* Restored through the same wide entries into slots 3..5. */
    hp_image want;
    hp_snap(p, &want);
    for (uint32_t i = 0; i < 3; i++) {
        w[i].x.slot = 3 + i;
        w[i].x.status = 777;
        hp_image_put(p, &want, 3 + i, kv[i], 0, L);
    }
    kvh_fence lf[L] = {{0x5}, {0x6}};
    w[1].x.struct_size = sizeof(kvh_pool_xfer); /* unequal: refused */
    assert_kvh(KVH_ERR_INVALID_ARG, kvh_pool_restore_batch(e, pool, &w[0].x, 3, 0, L, lf));
    assert_int_equal(lf[0].id, 0x5);
    assert_int_equal(w[0].x.status, 777);
    w[1].x.struct_size = sizeof(wide_xfer);
    assert_ok(kvh_pool_restore_batch(e, pool, &w[0].x, 3, 0, L, lf));
    for (uint32_t l = 0; l < L; l++)
        wait_free(e, lf[l], KVH_OK);
    for (uint32_t i = 0; i < 3; i++) {
        assert_ok(w[i].x.status);
        assert_true(w[i].newer[0] == 0x1111111111111111ull * (i + 1) && w[i].newer[1] == ~w[i].newer[0]);
    }
    assert_true(hp_same(p, &want));
    /* n = 0 with NULL xfers: complete fences, one per layer. */
    assert_ok(kvh_pool_restore_batch(e, pool, NULL, 0, 0, L, lf));
    for (uint32_t l = 0; l < L; l++) {
        int32_t done = 0;
        assert_ok(kvh_fence_poll(e, lf[l], &done));
        assert_int_equal(done, 1);
        assert_ok(kvh_fence_free(e, lf[l]));
    }
    for (uint32_t i = 0; i < 3; i++)
        assert_ok(kvh_block_release(e, w[i].x.block));
}

/* Restore batches naming other pools' handles, foreign or freed blocks,
 * layers out of range: refused whole, nothing taken or written. */
static void test_restore_batch_misuse(void **state)
{
    kvh_engine *e = mem_engine(8, 8, threads_of(state));
    kvh_engine *other = mem_engine(4, 4, 0);
    hp_pool *p = tu_alloc(sizeof(*p));
    hp_padded(p, 4, 70);
    kvh_pool pool, opool;
    assert_ok(kvh_pool_register(e, &p->layout, &pool));
    assert_ok(kvh_pool_register(other, &p->layout, &opool));
    int32_t tk[BT];
    tokens_of(tk, 70, 0);
    kvh_block b, ob, fresh;
    assert_ok(kvh_pool_offload(e, pool, 0, 0, tk, BT, 0, &b));
    assert_ok(kvh_pool_offload(other, opool, 0, 0, tk, BT, 0, &ob));
    assert_ok(kvh_block_alloc(e, 0, &fresh));
    hp_image want;
    hp_snap(p, &want);
    kvh_pool_xfer x[2];
    xfer_init(&x[0], 1);
    x[0].block = b;
    xfer_init(&x[1], 2);
    x[1].block = b;
    x[0].status = x[1].status = 4242;
    kvh_fence lf[L] = {{0x5}, {0x6}};
    assert_kvh(KVH_ERR_RANGE, kvh_pool_restore_batch(e, pool, x, 2, 1, UINT32_MAX, lf));
    assert_kvh(KVH_ERR_RANGE, kvh_pool_restore_batch(e, pool, x, 2, L, 1, lf));
    assert_kvh(KVH_ERR_BAD_HANDLE, kvh_pool_restore_batch(e, opool, x, 2, 0, L, lf));
    assert_kvh(KVH_ERR_BAD_HANDLE, kvh_pool_restore_batch(e, (kvh_pool){b.id}, x, 2, 0, L, lf));
    x[1].block = ob;
    assert_kvh(KVH_ERR_BAD_HANDLE, kvh_pool_restore_batch(e, pool, x, 2, 0, L, lf));
    x[1].block = (kvh_block){pool.id};
    assert_kvh(KVH_ERR_BAD_HANDLE, kvh_pool_restore_batch(e, pool, x, 2, 0, L, lf));
    x[1].block = fresh;
    assert_kvh(KVH_ERR_INVALID_ARG, kvh_pool_restore_batch(e, pool, x, 2, 0, L, lf));
    assert_ok(kvh_block_release(e, fresh));
    assert_kvh(KVH_ERR_BAD_HANDLE, kvh_pool_restore_batch(e, pool, x, 2, 0, L, lf));
    x[1].block = b;
    x[1].slot = 4;
    assert_kvh(KVH_ERR_RANGE, kvh_pool_restore_batch(e, pool, x, 2, 0, L, lf));
    assert_kvh(KVH_ERR_INVALID_ARG, kvh_pool_restore_batch(e, pool, x, 5, 0, L, lf));
    assert_int_equal(lf[0].id, 0x5);
    assert_int_equal(lf[1].id, 0x6);
    assert_int_equal(x[0].status, 4242);
    kvh_block_info bi = tu_binfo(e, b);
    assert_int_equal(bi.refs, 1);
    assert_int_equal(bi.holds, 0);
    assert_true(hp_same(p, &want));
    /* The same block into two slots is fine. */
    x[1].slot = 2;
    uint8_t kv[BLOCK_BYTES];
    hp_get(p, 0, kv);
    hp_image_put(p, &want, 1, kv, 0, L);
    hp_image_put(p, &want, 2, kv, 0, L);
    assert_ok(kvh_pool_restore_batch(e, pool, x, 2, 0, L, lf));
    for (uint32_t l = 0; l < L; l++)
        wait_free(e, lf[l], KVH_OK);
    assert_true(hp_same(p, &want));
    assert_ok(kvh_block_release(e, b));
    assert_ok(kvh_block_release(other, ob));
}

/* ---- handles: stale, reused slots, double release ---- */

static void test_stale_and_double_released_handles(void **state)
{
    (void)state;
    kvh_engine *e = mem_engine(8, 8, 0);
    hp_pool *p = tu_alloc(sizeof(*p));
    hp_vllm(p, 4, 80);
    kvh_pool pool;
    assert_ok(kvh_pool_register(e, &p->layout, &pool));
    int32_t tk[BT];
    tokens_of(tk, 80, 0);
    kvh_block b;
    uint8_t kv[BLOCK_BYTES];
    hp_get(p, 0, kv);
    assert_ok(kvh_pool_offload(e, pool, 0, 0, tk, BT, 0, &b));
    /* Released twice: the second finds no reference of a handle left. */
    assert_ok(kvh_block_release(e, b));
    assert_kvh(KVH_ERR_INVALID_ARG, kvh_block_release(e, b));
    kvh_block_info bi = tu_binfo(e, b);
    assert_int_equal(bi.refs, 0);
    assert_int_equal(bi.published, 1);
    /* Still cached: found again and restorable, exact. */
    kvh_block again;
    assert_ok(kvh_pool_offload(e, pool, 1, 0, tk, BT, 0, &again));
    assert_int_equal(again.id, b.id);
    assert_ok(kvh_pool_restore(e, pool, again, 3));
    uint8_t got[BLOCK_BYTES];
    hp_get(p, 3, got);
    assert_memory_equal(got, kv, BLOCK_BYTES);

    /* A pool unregistered twice, and one registered after it: the old
     * handle never names the new pool. */
    assert_ok(kvh_pool_unregister(e, pool));
    assert_kvh(KVH_ERR_BAD_HANDLE, kvh_pool_unregister(e, pool));
    assert_ok(kvh_pool_unregister(e, (kvh_pool){0}));
    assert_kvh(KVH_ERR_INVALID_ARG, kvh_pool_unregister(NULL, pool));
    kvh_pool fresh;
    assert_ok(kvh_pool_register(e, &p->layout, &fresh));
    assert_true(fresh.id != pool.id);
    assert_kvh(KVH_ERR_BAD_HANDLE, kvh_pool_restore(e, pool, again, 2));
    kvh_block nb = {0x55};
    assert_kvh(KVH_ERR_BAD_HANDLE, kvh_pool_offload(e, pool, 2, 0, tk, BT, 0, &nb));
    assert_int_equal(nb.id, 0x55);
    assert_kvh(KVH_ERR_BAD_HANDLE, kvh_pool_unregister(e, (kvh_pool){again.id}));
    kvh_pool_xfer x;
    xfer_init(&x, 2);
    x.block = again;
    kvh_fence lf[1];
    assert_kvh(KVH_ERR_BAD_HANDLE, kvh_pool_restore_batch(e, pool, &x, 1, 0, 1, lf));
    /* Many register / unregister rounds never hand out a value twice. */
    uint64_t seen[64];
    for (int i = 0; i < 64; i++) {
        kvh_pool q;
        assert_ok(kvh_pool_register(e, &p->layout, &q));
        for (int j = 0; j < i; j++)
            assert_true(seen[j] != q.id);
        assert_true(q.id != pool.id && q.id != fresh.id);
        seen[i] = q.id;
        assert_ok(kvh_pool_unregister(e, q));
        assert_kvh(KVH_ERR_BAD_HANDLE, kvh_pool_restore(e, q, again, 0));
    }
    assert_ok(kvh_block_release(e, again));
    assert_ok(kvh_pool_unregister(e, fresh));
}

/* Blocks outlive the pool they came from; the caller's memory may go at
 * once after unregister. */
static void test_blocks_outlive_their_pool(void **state)
{
    kvh_engine *e = mem_engine(4, 4, threads_of(state));
    hp_pool *a = tu_alloc(sizeof(*a)), *c = tu_alloc(sizeof(*c));
    hp_vllm(a, 3, 90);
    hp_padded(c, 3, 91);
    kvh_pool pa, pc;
    assert_ok(kvh_pool_register(e, &a->layout, &pa));
    assert_ok(kvh_pool_register(e, &c->layout, &pc));
    uint8_t kv[3][BLOCK_BYTES];
    kvh_pool_xfer x[3];
    int32_t tok[3][BT];
    uint64_t scope = 0xfeedull;
    for (uint32_t i = 0; i < 3; i++) {
        hp_get(a, i, kv[i]);
        tokens_of(tok[i], 90, i);
        xfer_init(&x[i], i);
        x[i].tokens = tok[i];
        x[i].scope = scope;
        if (i)
            assert_ok(kvh_prefix_hash_scoped(e, scope, x[i - 1].parent_hash, tok[i - 1], BT, &x[i].parent_hash));
    }
    kvh_fence f;
    assert_ok(kvh_pool_offload_batch(e, pa, x, 3, 0, &f));
    wait_free(e, f, KVH_OK);
    assert_ok(kvh_pool_unregister(e, pa));
    /* The memory goes (ASan would see a later touch). */
    for (uint32_t l = 0; l < L; l++)
        for (int kv2 = 0; kv2 < 2; kv2++) {
            tu_free(a->buf[l][kv2]);
            a->buf[l][kv2] = NULL;
        }
    assert_kvh(KVH_ERR_BAD_HANDLE, kvh_pool_restore(e, pa, x[0].block, 0));
    /* The default scope does not see them; their own scope does. */
    size_t nf = 9;
    kvh_block found[3];
    assert_ok(kvh_prefix_lookup(e, &tok[0][0], 3 * BT, found, 3, &nf));
    assert_int_equal(nf, 0);
    assert_ok(kvh_prefix_lookup_scoped(e, scope, scope, 0, &tok[0][0], 3 * BT, found, 3, &nf));
    assert_int_equal(nf, 3);
    hp_image want;
    hp_snap(c, &want);
    for (uint32_t i = 0; i < 3; i++) {
        assert_int_equal(found[i].id, x[i].block.id);
        hp_image_put(c, &want, 2 - i, kv[i], 0, L);
        assert_ok(kvh_pool_restore(e, pc, found[i], 2 - i));
        assert_ok(kvh_block_release(e, found[i]));
        assert_ok(kvh_block_release(e, x[i].block));
    }
    assert_true(hp_same(c, &want));
}

/* A caller thread that rewrites its own xfers[0].slot and .tokens while
 * batches read them (a race of the caller's making): kvh takes each
 * value once, so every slot is free again once the batches are done
 * (none counted in and out under two values), and a NULL tokens pointer
 * seen late is refused, not read. */
static kvh_pool_xfer flipped[4];
static atomic_int flipping;
static int32_t flip_tokens[BT];

static void *flip_slot(void *arg)
{
    (void)arg;
    while (atomic_load(&flipping)) {
        __atomic_store_n(&flipped[0].slot, 6, __ATOMIC_RELAXED);
        __atomic_store_n(&flipped[0].tokens, NULL, __ATOMIC_RELAXED);
        __atomic_store_n(&flipped[0].slot, 0, __ATOMIC_RELAXED);
        __atomic_store_n(&flipped[0].tokens, flip_tokens, __ATOMIC_RELAXED);
    }
    return NULL;
}

static void test_slots_rewritten_during_a_batch(void **state)
{
    kvh_engine *e = mem_engine(64, 64, threads_of(state));
    hp_pool p;
    hp_padded(&p, 8, 17);
    kvh_pool pool;
    assert_ok(kvh_pool_register(e, &p.layout, &pool));
    int32_t tok[4][BT], src_tok[BT];
    tokens_of(src_tok, 999, 0);
    kvh_block src;
    assert_ok(kvh_pool_offload(e, pool, 7, 0, src_tok, BT, 0, &src));
    tokens_of(flip_tokens, 998, 0);
    atomic_store(&flipping, 1);
    pthread_t th;
    assert_int_equal(pthread_create(&th, NULL, flip_slot, NULL), 0);
    /* Nothing asserts while the thread runs: a failure stops the loop. */
    int ran = 0;
    char failed[320] = "";
    for (int round = 0; round < 400 && !failed[0]; round++) {
        for (uint32_t i = 0; i < 4; i++) {
            tokens_of(tok[i], (uint32_t)round + 1, i);
            xfer_init(&flipped[i], i);
            flipped[i].tokens = tok[i];
        }
        kvh_fence f;
        kvh_status st = kvh_pool_offload_batch(e, pool, flipped, 4, 0, &f);
        if (st == KVH_OK) {
            ran++;
            kvh_status done = kvh_fence_wait(e, f, UINT64_MAX);
            kvh_fence_free(e, f);
            for (uint32_t i = 0; i < 4; i++)
                if (kvh_block_release(e, flipped[i].block) != KVH_OK || done != KVH_OK)
                    snprintf(failed, sizeof(failed), "round %d: the batch or its blocks: %s", round, kvh_last_error());
        } else if (st != KVH_ERR_INVALID_ARG)
            snprintf(failed, sizeof(failed), "round %d: %s (%s)", round, kvh_status_name(st), kvh_last_error());
        for (uint32_t s = 0; s < 7 && !failed[0]; s++)
            if (kvh_pool_restore(e, pool, src, s) == KVH_ERR_BUSY)
                snprintf(failed, sizeof(failed), "round %d: slot %u refused with nothing running: %s", round, s,
                         kvh_last_error());
    }
    atomic_store(&flipping, 0);
    pthread_join(th, NULL);
    if (failed[0])
        fail_msg("%s", failed);
    assert_true(ran > 0);
    assert_ok(kvh_block_release(e, src));
    assert_ok(kvh_pool_unregister(e, pool));
}

/* Closing with pools registered, blocks referenced and batches queued:
 * every status written, nothing leaked (ASan), and no pool byte written
 * after close returns. */
static void test_close_with_pools_registered(void **state)
{
    kvh_engine *e = mem_engine(16, 16, threads_of(state));
    enum { NP = 3, SL = 4 };
    hp_pool *p = tu_alloc(sizeof(hp_pool) * NP);
    kvh_pool pool[NP];
    kvh_pool_xfer x[NP][SL];
    int32_t tok[NP][SL][BT];
    kvh_fence f[NP];
    for (uint32_t i = 0; i < NP; i++) {
        hp_padded(&p[i], SL, 100 + i);
        assert_ok(kvh_pool_register(e, &p[i].layout, &pool[i]));
        for (uint32_t s = 0; s < SL; s++) {
            tokens_of(tok[i][s], 100 + i, s);
            xfer_init(&x[i][s], s);
            x[i][s].tokens = tok[i][s];
        }
        assert_ok(kvh_pool_offload_batch(e, pool[i], x[i], SL, 0, &f[i]));
    }
    wait_free(e, f[0], KVH_OK);
    wait_free(e, f[1], KVH_OK); /* a restore may not write slots an offload reads */
    /* Pool 0's blocks restored into pool 1, layer by layer. */
    kvh_pool_xfer r[SL];
    for (uint32_t s = 0; s < SL; s++) {
        xfer_init(&r[s], s);
        r[s].block = x[0][s].block;
    }
    kvh_fence lf[L];
    assert_ok(kvh_pool_restore_batch(e, pool[1], r, SL, 0, L, lf));
    assert_ok(tu_close(e));
    hp_image after[NP];
    for (uint32_t i = 0; i < NP; i++) {
        for (uint32_t s = 0; s < SL; s++) {
            kvh_status st = x[i][s].status;
            assert_true(st == KVH_OK || st == KVH_ERR_CLOSED);
        }
        hp_snap(&p[i], &after[i]);
    }
    for (uint32_t s = 0; s < SL; s++)
        assert_true(r[s].status == KVH_OK || r[s].status == KVH_ERR_CLOSED);
    /* Nobody writes the pools any more. */
    struct timespec ms = {0, 20 * 1000 * 1000};
    nanosleep(&ms, NULL);
    for (uint32_t i = 0; i < NP; i++)
        assert_true(hp_same(&p[i], &after[i]));
}

static int teardown(void **state)
{
    dt_teardown(state);
    return tu_teardown(state);
}

#define BOTH(fn)                                                                                                       \
    cmocka_unit_test_prestate_setup_teardown(fn, NULL, teardown, (void *)(uintptr_t)0),                                \
        cmocka_unit_test_prestate_setup_teardown(fn, NULL, teardown, (void *)(uintptr_t)2)

int main(void)
{
    const struct CMUnitTest tests[] = {
        cmocka_unit_test_teardown(test_register_refuses_bad_layouts, teardown),
        cmocka_unit_test_teardown(test_offload_and_restore_misuse, teardown),
        BOTH(test_restore_across_layouts_touches_only_the_slot),
        cmocka_unit_test_teardown(test_aliased_slots, teardown),
        BOTH(test_exact_bytes_through_disk_and_reopen),
        BOTH(test_restore_without_room_writes_nothing),
        BOTH(test_restore_from_disk_uses_a_free_device_slot),
        BOTH(test_xfer_struct_size_games),
        BOTH(test_restore_batch_misuse),
        cmocka_unit_test_teardown(test_stale_and_double_released_handles, teardown),
        BOTH(test_blocks_outlive_their_pool),
        BOTH(test_close_with_pools_registered),
        BOTH(test_slots_rewritten_during_a_batch),
    };
    return cmocka_run_group_tests_name("pool_hostile", tests, NULL, NULL);
}
