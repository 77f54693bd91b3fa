/* Weight-context switches racing with KV traffic: one thread switches
 * between two models (asynchronously, using early layers before the
 * switch completes), two threads write and read back KV of sequences
 * attached to the models, one thread reads stats and verifies. Every
 * weight and KV byte must survive; nothing may fail for lack of room.
 * Run under TSan by `make test`. */
#include <fcntl.h>
#include <pthread.h>
#include <sys/stat.h>
#include <unistd.h>

#include "test_util.h"

enum { L = 2, H = 2, D = 4, BT = 4 };
static const size_t TOK = H * D * 4;
enum { LAYERS = 6, REGION = 2000, ROUNDS = 24, KV_THREADS = 2, SEQS = 3, BLOCKS = 4 };

typedef struct shared {
    kvh_engine *e;
    kvh_context ctx[2];
    uint8_t *file[2];
    int failures;
    int done;
    pthread_mutex_t mu;
} shared;

static void note_failure(shared *sh, const char *what, kvh_status st)
{
    pthread_mutex_lock(&sh->mu);
    if (sh->failures++ < 5)
        fprintf(stderr, "%s: %s: %s\n", what, kvh_status_name(st), kvh_last_error());
    pthread_mutex_unlock(&sh->mu);
}

static int is_done(shared *sh)
{
    pthread_mutex_lock(&sh->mu);
    int d = sh->done;
    pthread_mutex_unlock(&sh->mu);
    return d;
}

static int region_matches(shared *sh, int m, uint32_t region)
{
    void *p;
    uint64_t n;
    kvh_status st = kvh_context_region_data(sh->e, sh->ctx[m], region, 0, &p, &n);
    if (st != KVH_OK) {
        note_failure(sh, "region_data", st);
        return 0;
    }
    return n == REGION && memcmp(p, sh->file[m] + (uint64_t)region * REGION, REGION) == 0;
}

static void *switcher(void *arg)
{
    shared *sh = arg;
    kvh_context none = {0};
    int cur = 0;
    kvh_status st = kvh_context_switch(sh->e, none, sh->ctx[0], NULL);
    if (st != KVH_OK)
        note_failure(sh, "first switch", st);
    for (int r = 0; r < ROUNDS; r++) {
        int next = 1 - cur;
        kvh_fence f;
        st = kvh_context_switch(sh->e, sh->ctx[cur], sh->ctx[next], &f);
        if (st != KVH_OK) {
            note_failure(sh, "switch", st);
            break;
        }
        /* Layer 0 can be used while the rest arrives. */
        if ((st = kvh_context_wait_layer(sh->e, sh->ctx[next], 0, UINT64_MAX)) != KVH_OK)
            note_failure(sh, "wait_layer", st);
        else if (!region_matches(sh, next, 0))
            note_failure(sh, "layer 0 bytes", KVH_ERR_CORRUPT);
        if ((st = kvh_fence_wait(sh->e, f, UINT64_MAX)) != KVH_OK)
            note_failure(sh, "switch fence", st);
        kvh_fence_free(sh->e, f);
        for (uint32_t i = 0; i < LAYERS; i++)
            if (!region_matches(sh, next, i))
                note_failure(sh, "weights after switch", KVH_ERR_CORRUPT);
        cur = next;
    }
    pthread_mutex_lock(&sh->mu);
    sh->done = 1;
    pthread_mutex_unlock(&sh->mu);
    return NULL;
}

typedef struct kv_arg {
    shared *sh;
    int id;
} kv_arg;

static void *kv_worker(void *argp)
{
    kv_arg *a = argp;
    shared *sh = a->sh;
    kvh_engine *e = sh->e;
    kvh_seq s[SEQS];
    for (int i = 0; i < SEQS; i++) {
        kvh_seq_params sp;
        kvh_seq_params_init(&sp, sizeof(sp));
        sp.agent = (uint32_t)a->id;
        sp.context = sh->ctx[(a->id + i) % 2];
        kvh_status st = kvh_seq_create_ex(e, &sp, &s[i]);
        if (st != KVH_OK) {
            note_failure(sh, "seq_create_ex", st);
            return NULL;
        }
    }
    uint8_t *k = malloc(TOK * BT), *v = malloc(TOK * BT), *want = malloc(TOK);
    uint64_t len[SEQS] = {0};
    for (int iter = 0; !is_done(sh) || iter < 8; iter++) {
        int i = iter % SEQS;
        uint64_t tag = (uint64_t)a->id * 100 + (uint64_t)i;
        if (len[i] < BLOCKS * BT) {
            int32_t t[BT];
            tu_iota(t, BT, (int32_t)(tag * 1000 + len[i]));
            kvh_status st = kvh_seq_append(e, s[i], t, BT);
            if (st != KVH_OK) {
                note_failure(sh, "append", st);
                break;
            }
            for (uint32_t l = 0; l < L; l++) {
                for (uint32_t j = 0; j < BT; j++) {
                    tu_pattern(k + j * TOK, TOK, tag, l, len[i] + j, 0);
                    tu_pattern(v + j * TOK, TOK, tag, l, len[i] + j, 1);
                }
                if ((st = kvh_seq_write_kv(e, s[i], l, len[i], BT, k, v)) != KVH_OK)
                    note_failure(sh, "write_kv", st);
            }
            len[i] += BT;
        }
        /* Read everything back from wherever it lives now. */
        for (uint64_t pos = 0; pos < len[i]; pos += BT)
            for (uint32_t l = 0; l < L; l++) {
                kvh_status st = kvh_seq_read_kv(e, s[i], l, pos, BT, k, v);
                if (st != KVH_OK) {
                    note_failure(sh, "read_kv", st);
                    continue;
                }
                for (uint32_t j = 0; j < BT; j++) {
                    tu_pattern(want, TOK, tag, l, pos + j, 0);
                    if (memcmp(k + j * TOK, want, TOK) != 0)
                        note_failure(sh, "KV bytes", KVH_ERR_CORRUPT);
                }
            }
    }
    for (int i = 0; i < SEQS; i++)
        kvh_seq_free(e, s[i]);
    free(k);
    free(v);
    free(want);
    return NULL;
}

static void *observer(void *arg)
{
    shared *sh = arg;
    while (!is_done(sh)) {
        kvh_weight_stats ws = {.struct_size = sizeof(ws)};
        kvh_status st = kvh_weight_stats_get(sh->e, &ws);
        if (st != KVH_OK)
            note_failure(sh, "weight_stats", st);
        for (int m = 0; m < 2; m++) {
            kvh_context_info ci = {.struct_size = sizeof(ci)};
            if ((st = kvh_context_info_get(sh->e, sh->ctx[m], &ci)) != KVH_OK)
                note_failure(sh, "context_info", st);
            uint64_t n;
            st = kvh_context_verify(sh->e, sh->ctx[m], &n);
            if (st != KVH_OK && st != KVH_ERR_BUSY)
                note_failure(sh, "verify", st);
        }
        kvh_tier_info ti = {.struct_size = sizeof(ti)};
        if (kvh_tier_info_get(sh->e, KVH_TIER_DEVICE, &ti) == KVH_OK && ti.used_blocks > ti.capacity_blocks)
            note_failure(sh, "device tier over budget", KVH_ERR_INTERNAL);
        usleep(200);
    }
    return NULL;
}

static void switch_races_kv(void **state)
{
    uint32_t threads = *(uint32_t *)*state;
    shared sh = {0};
    pthread_mutex_init(&sh.mu, NULL);
    char path[2][600];
    const char *dir = getenv("KVH_TEST_TMPDIR");
    uint64_t bb = tu_block_bytes_of(L, H, D, BT, KVH_DTYPE_F32);
    /* kvh.h: each region is charged its size in whole pages, a context
     * the slots of its regions' pages together. */
    const uint64_t page = (uint64_t)sysconf(_SC_PAGESIZE);
    uint64_t per_model = (LAYERS * ((REGION + page - 1) / page * page) + bb - 1) / bb;
    kvh_config c = tu_cfg(L, H, D, BT, KVH_DTYPE_F32, per_model + 12, per_model + 40, threads);
    sh.e = tu_open_cfg(&c);
    for (int m = 0; m < 2; m++) {
        snprintf(path[m], sizeof(path[m]), "%s/mt%d.bin", dir && dir[0] ? dir : "/tmp", m);
        sh.file[m] = tu_alloc(LAYERS * REGION);
        tu_rng r = {1000 + (uint64_t)m};
        tu_fill(&r, sh.file[m], LAYERS * REGION);
        int fd = open(path[m], O_WRONLY | O_CREAT | O_TRUNC, 0600);
        assert_true(fd >= 0);
        assert_int_equal(write(fd, sh.file[m], LAYERS * REGION), LAYERS * REGION);
        close(fd);
        kvh_context_params cp;
        assert_ok(kvh_context_params_init(&cp, sizeof(cp)));
        cp.kv_policy = KVH_CONTEXT_KV_DEMOTE;
        cp.chunk_bytes = 512;
        assert_ok(kvh_context_create(sh.e, &cp, &sh.ctx[m]));
        for (uint32_t l = 0; l < LAYERS; l++) {
            kvh_weight_region_params rp;
            assert_ok(kvh_weight_region_params_init(&rp, sizeof(rp)));
            rp.layer = l;
            rp.path = path[m];
            rp.file_offset = (uint64_t)l * REGION;
            rp.size = REGION;
            uint32_t idx;
            assert_ok(kvh_context_add_region(sh.e, sh.ctx[m], &rp, &idx));
        }
    }
    pthread_t sw, obs, kv[KV_THREADS];
    kv_arg args[KV_THREADS];
    assert_int_equal(pthread_create(&sw, NULL, switcher, &sh), 0);
    assert_int_equal(pthread_create(&obs, NULL, observer, &sh), 0);
    for (int i = 0; i < KV_THREADS; i++) {
        args[i] = (kv_arg){&sh, i + 1};
        assert_int_equal(pthread_create(&kv[i], NULL, kv_worker, &args[i]), 0);
    }
    pthread_join(sw, NULL);
    pthread_join(obs, NULL);
    for (int i = 0; i < KV_THREADS; i++)
        pthread_join(kv[i], NULL);
    assert_int_equal(sh.failures, 0);
    kvh_weight_stats ws = {.struct_size = sizeof(ws)};
    assert_ok(kvh_weight_stats_get(sh.e, &ws));
    assert_int_equal(ws.switches, ROUNDS + 1);
    assert_int_equal(ws.crc_failures, 0);
    assert_int_equal(ws.bytes_device_to_host, 0); /* all weights clean */
    pthread_mutex_destroy(&sh.mu);
}

static uint32_t T0 = 0, T2 = 2;

int main(void)
{
    const struct CMUnitTest tests[] = {
        cmocka_unit_test_prestate_setup_teardown(switch_races_kv, NULL, tu_teardown, &T0),
        cmocka_unit_test_prestate_setup_teardown(switch_races_kv, NULL, tu_teardown, &T2),
    };
    return cmocka_run_group_tests(tests, NULL, NULL);
}
