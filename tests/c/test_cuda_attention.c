/* Paged attention on the CUDA backend against the CPU reference.
 *
 * Exits 77 (skipped) when no CUDA backend or device is usable. Otherwise
 * two engines with the same geometry, one CUDA and one CPU, get the same
 * sequences (tokens and K/V, through kvh_seq_write_kv); the CUDA engine
 * runs kvh_attention_decode/_prefill on q in device memory (allocated
 * through the backend table) on the legacy default stream, the CPU engine
 * runs the scalar reference, and the outputs are compared. The device
 * output buffer is poisoned with NaN (all bits set) before every run.
 *
 * Error bounds (per element, V_max = max |V|, here 127/64):
 *   io f32 : |cuda - ref| <= 1e-5 |ref| + 1e-5 V_max
 *   io f16 : |cuda - ref| <= 2^-10 |ref| + 1e-5 V_max   (one f16 ulp)
 *   io bf16: |cuda - ref| <= 2^-7 |ref| + 1e-5 V_max    (one bf16 ulp)
 *
 * Also: holds taken by a call are gone once the stream is synchronised
 * (the completion callback ran), closing an engine with attention still
 * queued waits for it, and head_dim > 256 is refused with
 * KVH_ERR_UNSUPPORTED.
 *
 * Graph capture: a persistent plan (kvh_attention_plan_create) run on a
 * stream that is capturing records its kernels; replaying the graph gives
 * the one-shot call's output bit for bit, twice. The test drives capture
 * through the CUDA driver API (libcuda.so.1, dlopen), since it does not
 * link the CUDA runtime.
 *
 * libkvh_cuda.so is looked up through KVH_CUDA_BACKEND, which this test
 * points at <build>/libkvh_cuda.so when it is not set. */
#include <dlfcn.h>
#include <math.h>

#include "test_util.h"

#include "core/engine.h"
#include "kernels/attention_dtype.h"
#include "kernels/cpu/attn_cpu.h"
#include "cuda_test_util.h"

#define MAX_SEQS 8

typedef struct pair {
    kvh_engine *gpu, *cpu;
    uint32_t layers, Hkv, D, bt, dtype;
    uint32_t n;
    kvh_seq gs[MAX_SEQS], cs[MAX_SEQS];
    uint32_t len[MAX_SEQS];
} pair;

static tu_rng rng;

static float rnd_val(void) { return (float)((int)tu_below(&rng, 255) - 127) / 64.0f; }

static kvh_config cfg_of(uint32_t layers, uint32_t Hkv, uint32_t D, uint32_t bt, uint32_t dtype, uint64_t blocks,
                         uint32_t backend)
{
    kvh_config c = tu_cfg(layers, Hkv, D, bt, dtype, blocks, 0, 1);
    c.backend = backend;
    c.host_bytes = 0;
    return c;
}

static void pair_open(pair *p, uint32_t layers, uint32_t Hkv, uint32_t D, uint32_t bt, uint32_t dtype, uint64_t blocks)
{
    memset(p, 0, sizeof(*p));
    p->layers = layers, p->Hkv = Hkv, p->D = D, p->bt = bt, p->dtype = dtype;
    kvh_config g = cfg_of(layers, Hkv, D, bt, dtype, blocks, KVH_BACKEND_CUDA);
    kvh_config c = cfg_of(layers, Hkv, D, bt, dtype, blocks, KVH_BACKEND_CPU);
    p->gpu = tu_open_cfg(&g);
    p->cpu = tu_open_cfg(&c);
    assert_string_equal(kvh_engine_backend(p->gpu), "cuda");
    assert_ok(kvhi_attention_set_impl(p->cpu, KVHI_ATTN_REFERENCE));
}

static void pair_close(pair *p)
{
    assert_ok(tu_close(p->gpu));
    assert_ok(tu_close(p->cpu));
}

/* Sequence of len tokens with the same random K/V in both engines; fork
 * of sequence `from` (plus extra tokens) when from >= 0. */
static void pair_add(pair *p, uint32_t len, int from, uint32_t extra)
{
    uint32_t i = p->n++;
    assert_true(i < MAX_SEQS);
    uint32_t first = 0;
    if (from >= 0) {
        assert_ok(kvh_seq_fork(p->gpu, p->gs[from], 0, &p->gs[i]));
        assert_ok(kvh_seq_fork(p->cpu, p->cs[from], 0, &p->cs[i]));
        first = p->len[from];
        len = first + extra;
    } else {
        assert_ok(kvh_seq_create(p->gpu, 0, &p->gs[i]));
        assert_ok(kvh_seq_create(p->cpu, 0, &p->cs[i]));
    }
    p->len[i] = len;
    uint32_t n = len - first;
    if (!n)
        return;
    int32_t *tok = tu_alloc(sizeof(int32_t) * n);
    for (uint32_t t = 0; t < n; t++)
        tok[t] = (int32_t)(tu_next(&rng) & 0x7fffffff);
    assert_ok(kvh_seq_append(p->gpu, p->gs[i], tok, n));
    assert_ok(kvh_seq_append(p->cpu, p->cs[i], tok, n));
    tu_free(tok);
    size_t cnt = (size_t)n * p->Hkv * p->D, eb = tu_dtype_size(p->dtype);
    uint8_t *k = tu_alloc(cnt * eb), *v = tu_alloc(cnt * eb);
    for (uint32_t l = 0; l < p->layers; l++) {
        for (size_t x = 0; x < cnt; x++) {
            kvhi_store_from_f32(p->dtype, k, x, rnd_val());
            kvhi_store_from_f32(p->dtype, v, x, rnd_val());
        }
        assert_ok(kvh_seq_write_kv(p->gpu, p->gs[i], l, first, n, k, v));
        assert_ok(kvh_seq_write_kv(p->cpu, p->cs[i], l, first, n, k, v));
    }
    tu_free(k);
    tu_free(v);
}

static double ulp_of(uint32_t io) { return io == KVH_DTYPE_F32 ? 1e-5 : io == KVH_DTYPE_F16 ? 0x1p-10 : 0x1p-7; }

/* Runs decode (q_lens NULL) or prefill on both engines and compares. */
static void compare(pair *p, uint32_t layer, uint32_t Hq, uint32_t io, const uint32_t *q_lens, const char *label)
{
    size_t rows = 0;
    for (uint32_t i = 0; i < p->n; i++)
        rows += q_lens ? q_lens[i] : 1;
    size_t elems = rows * Hq * p->D, bytes = elems * tu_dtype_size(io);
    uint8_t *q = tu_alloc(bytes), *ref = tu_alloc(bytes), *got = tu_alloc(bytes), *nan = tu_alloc(bytes);
    for (size_t x = 0; x < elems; x++)
        kvhi_store_from_f32(io, q, x, rnd_val());
    memset(nan, 0xff, bytes);
    memset(ref, 0xff, bytes);
    void *dq = dev_alloc(p->gpu, bytes), *dout = dev_alloc(p->gpu, bytes);
    h2d(p->gpu, dq, q, bytes);
    h2d(p->gpu, dout, nan, bytes);
    kvh_attention_params pr;
    assert_ok(kvh_attention_params_init(&pr, sizeof(pr)));
    pr.num_q_heads = Hq;
    pr.io_dtype = io;
    if (q_lens) {
        assert_ok(kvh_attention_prefill(p->cpu, layer, p->cs, q_lens, p->n, q, ref, &pr));
        assert_ok(kvh_attention_prefill(p->gpu, layer, p->gs, q_lens, p->n, dq, dout, &pr));
    } else {
        assert_ok(kvh_attention_decode(p->cpu, layer, p->cs, p->n, q, ref, &pr));
        assert_ok(kvh_attention_decode(p->gpu, layer, p->gs, p->n, dq, dout, &pr));
    }
    sync_default_stream(p->gpu);
    d2h(p->gpu, got, dout, bytes);
    /* the completion callback ran: no hold of the call is left */
    for (uint32_t i = 0; i < p->n; i++)
        if (p->len[i])
            assert_int_equal(tu_seq_binfo(p->gpu, p->gs[i], 0).holds, 0);
    double rtol = ulp_of(io), atol = 1e-5 * 127.0 / 64.0, worst = 0;
    for (size_t x = 0; x < elems; x++) {
        double a = kvhi_load_as_f32(io, got, x), b = kvhi_load_as_f32(io, ref, x);
        double e = fabs(a - b) / (rtol * fabs(b) + atol);
        if (!(e <= 1.0)) { /* NaN fails too */
            print_error("%s: element %zu (row %zu head %zu dim %zu): cuda %.9g, reference %.9g\n", label, x,
                        x / ((size_t)Hq * p->D), x / p->D % Hq, x % p->D, a, b);
            fail();
        }
        worst = e > worst ? e : worst;
    }
    print_message("%s: ok, worst error %.3f of the bound\n", label, worst);
    p->gpu->backend->device_free(p->gpu->backend_ctx, dq, bytes);
    p->gpu->backend->device_free(p->gpu->backend_ctx, dout, bytes);
    tu_free(q);
    tu_free(ref);
    tu_free(got);
    tu_free(nan);
}

static void test_shapes(void **state)
{
    (void)state;
    static const struct {
        uint32_t D, bt, dtype, io, Hkv, G;
    } cases[] = {
        {128, 16, KVH_DTYPE_F16, KVH_DTYPE_F16, 8, 4}, {128, 32, KVH_DTYPE_BF16, KVH_DTYPE_BF16, 2, 8},
        {64, 16, KVH_DTYPE_F32, KVH_DTYPE_F32, 2, 1},  {80, 16, KVH_DTYPE_F16, KVH_DTYPE_F32, 1, 2},
        {96, 32, KVH_DTYPE_BF16, KVH_DTYPE_F16, 2, 3}, {256, 16, KVH_DTYPE_F16, KVH_DTYPE_BF16, 1, 8},
        {256, 32, KVH_DTYPE_F32, KVH_DTYPE_F32, 1, 4}, {128, 16, KVH_DTYPE_F16, KVH_DTYPE_F32, 1, 40},
        {40, 4, KVH_DTYPE_F16, KVH_DTYPE_F32, 2, 2},   {5, 1, KVH_DTYPE_F16, KVH_DTYPE_F16, 1, 3},
        {7, 64, KVH_DTYPE_F32, KVH_DTYPE_BF16, 2, 1},
    };
    for (size_t c = 0; c < sizeof(cases) / sizeof(cases[0]); c++) {
        pair p;
        pair_open(&p, 2, cases[c].Hkv, cases[c].D, cases[c].bt, cases[c].dtype, 6000 * 16 / cases[c].bt / 8 + 64);
        pair_add(&p, 1, -1, 0);
        pair_add(&p, cases[c].bt, -1, 0);
        pair_add(&p, 3 * cases[c].bt + 5, -1, 0);
        pair_add(&p, 700, -1, 0);
        pair_add(&p, 0, 2, 3); /* a fork with a copied-on-write tail */
        char label[128];
        uint32_t Hq = cases[c].Hkv * cases[c].G;
        snprintf(label, sizeof(label), "case %zu D %u bt %u kv %u io %u Hkv %u G %u decode", c, cases[c].D, cases[c].bt,
                 cases[c].dtype, cases[c].io, cases[c].Hkv, cases[c].G);
        compare(&p, 1, Hq, cases[c].io, NULL, label);
        uint32_t ql[5] = {1, cases[c].bt, 7, 100, 2};
        snprintf(label, sizeof(label), "case %zu prefill", c);
        compare(&p, 0, Hq, cases[c].io, ql, label);
        pair_close(&p);
    }
}

/* Long contexts: split-K over many chunks, a batch of 32 x 8K (the
 * benchmark's shape, smaller), prefill rows straddling chunks. */
static void test_long(void **state)
{
    (void)state;
    pair p;
    pair_open(&p, 1, 8, 128, 16, KVH_DTYPE_F16, 40000 * 8 / 16 + 64);
    pair_add(&p, 32768, -1, 0);
    pair_add(&p, 8192, -1, 0);
    pair_add(&p, 8191, -1, 0);
    pair_add(&p, 1000, -1, 0);
    compare(&p, 0, 32, KVH_DTYPE_F16, NULL, "long decode f16");
    compare(&p, 0, 32, KVH_DTYPE_F32, NULL, "long decode f32");
    uint32_t ql[4] = {16, 300, 1, 999};
    compare(&p, 0, 32, KVH_DTYPE_BF16, ql, "long prefill");
    pair_close(&p);
}

static void test_errors_and_close(void **state)
{
    (void)state;
    /* head_dim beyond the CUDA kernels */
    kvh_config g = cfg_of(1, 1, 512, 16, KVH_DTYPE_F16, 64, KVH_BACKEND_CUDA);
    kvh_engine *e = tu_open_cfg(&g);
    kvh_seq s;
    int32_t tok[4] = {1, 2, 3, 4};
    assert_ok(kvh_seq_create(e, 0, &s));
    assert_ok(kvh_seq_append(e, s, tok, 4));
    void *dq = dev_alloc(e, 512 * 4), *dout = dev_alloc(e, 512 * 4);
    assert_kvh(KVH_ERR_UNSUPPORTED, kvh_attention_decode(e, 0, &s, 1, dq, dout, NULL));
    assert_int_equal(tu_seq_binfo(e, s, 0).holds, 0);
    e->backend->device_free(e->backend_ctx, dq, 512 * 4);
    e->backend->device_free(e->backend_ctx, dout, 512 * 4);
    assert_ok(tu_close(e));

    /* Close with attention still queued: close waits for the completion
     * callbacks, so the kernels are done when it returns. The buffers
     * belong to another engine ("keeper") whose backend context outlives
     * the closed one. */
    kvh_config kc = cfg_of(1, 1, 64, 16, KVH_DTYPE_F16, 16, KVH_BACKEND_CUDA);
    kvh_engine *keeper = tu_open_cfg(&kc);
    pair p;
    pair_open(&p, 1, 2, 128, 16, KVH_DTYPE_F16, 4096);
    pair_add(&p, 20000, -1, 0);
    size_t bytes = 8 * 128 * 4;
    float *host = tu_alloc(bytes);
    for (size_t x = 0; x < bytes / 4; x++)
        host[x] = rnd_val();
    dq = dev_alloc(keeper, bytes);
    dout = dev_alloc(keeper, bytes);
    h2d(keeper, dq, host, bytes);
    memset(host, 0xff, bytes);
    h2d(keeper, dout, host, bytes);
    kvh_attention_params pr;
    assert_ok(kvh_attention_params_init(&pr, sizeof(pr)));
    pr.num_q_heads = 8;
    for (int i = 0; i < 8; i++)
        assert_ok(kvh_attention_decode(p.gpu, 0, p.gs, 1, dq, dout, &pr));
    assert_ok(tu_close(p.gpu)); /* no sync before: close waits */
    d2h(keeper, host, dout, bytes);
    for (size_t x = 0; x < bytes / 4; x++)
        assert_false(isnan(host[x]));
    keeper->backend->device_free(keeper->backend_ctx, dq, bytes);
    keeper->backend->device_free(keeper->backend_ctx, dout, bytes);
    assert_ok(tu_close(keeper));
    assert_ok(tu_close(p.cpu));
}

/* The few driver-API calls graph capture needs (CUstream = cudaStream_t). */
typedef struct driver_api {
    int (*stream_create)(void **stream, unsigned flags);
    int (*begin_capture)(void *stream, int mode);
    int (*end_capture)(void *stream, void **graph);
    int (*instantiate)(void **exec, void *graph, unsigned long long flags);
    int (*launch)(void *exec, void *stream);
    int (*stream_sync)(void *stream);
    int (*exec_destroy)(void *exec);
    int (*graph_destroy)(void *graph);
    int (*stream_destroy)(void *stream);
} driver_api;

static int load_driver(driver_api *d)
{
    void *lib = dlopen("libcuda.so.1", RTLD_NOW | RTLD_LOCAL);
    if (!lib)
        return -1;
    *(void **)&d->stream_create = dlsym(lib, "cuStreamCreate");
    *(void **)&d->begin_capture = dlsym(lib, "cuStreamBeginCapture_v2");
    *(void **)&d->end_capture = dlsym(lib, "cuStreamEndCapture");
    *(void **)&d->instantiate = dlsym(lib, "cuGraphInstantiateWithFlags");
    *(void **)&d->launch = dlsym(lib, "cuGraphLaunch");
    *(void **)&d->stream_sync = dlsym(lib, "cuStreamSynchronize");
    *(void **)&d->exec_destroy = dlsym(lib, "cuGraphExecDestroy");
    *(void **)&d->graph_destroy = dlsym(lib, "cuGraphDestroy");
    *(void **)&d->stream_destroy = dlsym(lib, "cuStreamDestroy_v2");
    return d->stream_create && d->begin_capture && d->end_capture && d->instantiate && d->launch && d->stream_sync &&
                   d->exec_destroy && d->graph_destroy && d->stream_destroy
               ? 0
               : -1;
}

static void test_graph_capture(void **state)
{
    (void)state;
    driver_api drv;
    if (load_driver(&drv) != 0) {
        print_message("graph capture: the driver API is not available, not tested\n");
        return;
    }
    pair p;
    pair_open(&p, 1, 2, 128, 16, KVH_DTYPE_F16, 256);
    pair_add(&p, 1000, -1, 0);
    pair_add(&p, 37, -1, 0);
    const uint32_t Hq = 8;
    size_t bytes = (size_t)p.n * Hq * p.D * sizeof(float);
    float *q = tu_alloc(bytes), *a = tu_alloc(bytes), *b = tu_alloc(bytes), *nan = tu_alloc(bytes);
    for (size_t x = 0; x < bytes / sizeof(float); x++)
        q[x] = rnd_val();
    memset(nan, 0xff, bytes);
    void *dq = dev_alloc(p.gpu, bytes), *dout = dev_alloc(p.gpu, bytes);
    h2d(p.gpu, dq, q, bytes);
    kvh_attention_params pr;
    assert_ok(kvh_attention_params_init(&pr, sizeof(pr)));
    pr.num_q_heads = Hq;
    assert_ok(kvh_attention_decode(p.gpu, 0, p.gs, p.n, dq, dout, &pr));
    sync_default_stream(p.gpu);
    d2h(p.gpu, a, dout, bytes);

    kvh_attention_plan *plan = NULL;
    assert_ok(kvh_attention_plan_create(p.gpu, 0, p.gs, NULL, p.n, &pr, &plan));
    void *stream = NULL, *graph = NULL, *exec = NULL;
    assert_int_equal(drv.stream_create(&stream, 1 /* non-blocking */), 0);
    assert_int_equal(drv.begin_capture(stream, 2 /* relaxed */), 0);
    /* the one-shot call refuses a capturing stream; the plan does not */
    pr.stream = stream;
    assert_kvh(KVH_ERR_UNSUPPORTED, kvh_attention_decode(p.gpu, 0, p.gs, p.n, dq, dout, &pr));
    assert_ok(kvh_attention_run(p.gpu, plan, dq, dout, stream));
    assert_int_equal(drv.end_capture(stream, &graph), 0);
    assert_int_equal(drv.instantiate(&exec, graph, 0), 0);
    for (int replay = 0; replay < 2; replay++) {
        h2d(p.gpu, dout, nan, bytes);
        assert_int_equal(drv.launch(exec, stream), 0);
        assert_int_equal(drv.stream_sync(stream), 0);
        d2h(p.gpu, b, dout, bytes);
        assert_memory_equal(a, b, bytes);
    }
    drv.exec_destroy(exec);
    drv.graph_destroy(graph);
    drv.stream_destroy(stream);
    assert_ok(kvh_attention_plan_destroy(p.gpu, plan));
    assert_int_equal(tu_seq_binfo(p.gpu, p.gs[0], 0).holds, 0);
    p.gpu->backend->device_free(p.gpu->backend_ctx, dq, bytes);
    p.gpu->backend->device_free(p.gpu->backend_ctx, dout, bytes);
    pair_close(&p);
}

int main(void)
{
    set_backend_path();
    rng.s = tu_seed(2024);
    kvh_config c = cfg_of(1, 1, 64, 16, KVH_DTYPE_F16, 16, KVH_BACKEND_CUDA);
    if (cuda_usable_or_skip(&c))
        return 77;
    const struct CMUnitTest tests[] = {
        cmocka_unit_test_teardown(test_shapes, tu_teardown),
        cmocka_unit_test_teardown(test_long, tu_teardown),
        cmocka_unit_test_teardown(test_errors_and_close, tu_teardown),
        cmocka_unit_test_teardown(test_graph_capture, tu_teardown),
    };
    return cmocka_run_group_tests(tests, NULL, NULL);
}
