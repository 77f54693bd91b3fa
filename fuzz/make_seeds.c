/* Writes the seed corpora of fuzz/corpus/ (committed; re-run only when an
 * input format changes):
 *
 *   cc -O1 -I. -Iabi/include fuzz/make_seeds.c build/libkvh.a \
 *      -luring -lnuma -lpthread -lm -ldl -o /tmp/kvh-make-seeds
 *   /tmp/kvh-make-seeds fuzz/corpus
 *
 * fuzz_index and fuzz_slot_header get real metadata and slots of a store
 * written by the engine (the geometry of fuzz_index.c), in the targets'
 * input formats; fuzz_config and fuzz_api get hand-made call plans and a
 * few pseudo-random inputs; fuzz_remote_value values as the remote tier
 * writes them (core/remote_format.c). */
#define _GNU_SOURCE
#include <errno.h>
#include <fcntl.h>
#include <stdint.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/stat.h>
#include <sys/wait.h>
#include <unistd.h>

#include "kvh/kvh.h"
#include "core/remote_format.h"
#include "fuzz/fuzz_common.h"

static char out_root[512];

static void put(const char *target, const char *name, const void *data, size_t len)
{
    char dir[700], path[900];
    snprintf(dir, sizeof(dir), "%s/%s", out_root, target);
    mkdir(dir, 0755);
    snprintf(path, sizeof(path), "%s/%s", dir, name);
    FILE *f = fopen(path, "wb");
    if (!f || fwrite(data, 1, len, f) != len) {
        perror(path);
        exit(1);
    }
    fclose(f);
}

static uint8_t *slurp(const char *path, size_t *len)
{
    FILE *f = fopen(path, "rb");
    if (!f)
        return NULL;
    fseek(f, 0, SEEK_END);
    *len = (size_t)ftell(f);
    fseek(f, 0, SEEK_SET);
    uint8_t *b = malloc(*len + 1);
    if (fread(b, 1, *len, f) != *len)
        *len = 0;
    fclose(f);
    return b;
}

static kvh_config index_cfg(const char *dir)
{
    kvh_config c;
    kvh_config_init(&c, sizeof(c));
    c.num_layers = 1;
    c.num_kv_heads = 1;
    c.head_dim = 8;
    c.block_tokens = 4;
    c.dtype = KVH_DTYPE_F16;
    c.backend = KVH_BACKEND_CPU;
    c.device_bytes = 4 * 128;
    c.host_bytes = 4 * 128;
    c.disk_bytes = 8 * 8192;
    c.disk_path = dir;
    c.model_salt = 0xf00d;
    c.migration_threads = 0;
    c.disk_flags = KVH_DISK_BUFFERED;
    return c;
}

static void persist_chain(kvh_engine *e, int32_t base, int blocks)
{
    kvh_seq s;
    kvh_seq_create(e, 0, &s);
    int32_t tk[16];
    uint8_t k[16 * 16], v[16 * 16];
    for (int i = 0; i < 4 * blocks; i++)
        tk[i] = base + i;
    for (size_t i = 0; i < sizeof(k); i++)
        k[i] = (uint8_t)(i * 7 + (size_t)base), v[i] = (uint8_t)(i * 13 + (size_t)base);
    kvh_seq_append(e, s, tk, (size_t)(4 * blocks));
    kvh_seq_write_kv(e, s, 0, 0, (size_t)(4 * blocks), k, v);
    if (kvh_seq_persist(e, s) != KVH_OK) {
        fprintf(stderr, "persist: %s\n", kvh_last_error());
        exit(1);
    }
    kvh_seq_free(e, s);
}

/* The fuzz_index input for files index + journal: flags, u16 length of the
 * index part, index part (84 header bytes + records), journal part. */
static void index_seed(const char *name, uint8_t flags, const uint8_t *ix, size_t ixl, const uint8_t *jr, size_t jrl)
{
    size_t ip = ixl >= 4096 ? 84 + (ixl - 4096) : ixl, jp = jrl >= 4096 ? 84 + (jrl - 4096) : jrl;
    uint8_t *b = malloc(3 + ip + jp);
    b[0] = flags;
    b[1] = (uint8_t)ip, b[2] = (uint8_t)(ip >> 8);
    memcpy(b + 3, ix, ixl < 84 ? ixl : 84);
    if (ixl >= 4096)
        memcpy(b + 3 + 84, ix + 4096, ixl - 4096);
    memcpy(b + 3 + ip, jr, jrl < 84 ? jrl : 84);
    if (jrl >= 4096)
        memcpy(b + 3 + ip + 84, jr + 4096, jrl - 4096);
    put("fuzz_index", name, b, 3 + ip + jp);
    free(b);
}

static uint64_t get64(const uint8_t *p)
{
    uint64_t v = 0;
    for (int i = 0; i < 8; i++)
        v |= (uint64_t)p[i] << (8 * i);
    return v;
}

static void store_seeds(void)
{
    char dir[] = "/tmp/kvh-seeds-XXXXXX";
    if (!mkdtemp(dir))
        exit(1);
    kvh_config c = index_cfg(dir);
    kvh_engine *e;
    if (kvh_engine_open(&c, &e) != KVH_OK)
        exit(1);
    persist_chain(e, 100, 2);
    kvh_engine_close(e);
    pid_t pid = fork();
    if (pid == 0) {
        kvh_engine *e2;
        if (kvh_engine_open(&c, &e2) != KVH_OK)
            _exit(1);
        persist_chain(e2, 200, 3);
        _exit(0); /* no close: these stay in the journal */
    }
    int ws;
    waitpid(pid, &ws, 0);
    char p[600];
    size_t ixl = 0, jrl = 0, sl = 0;
    snprintf(p, sizeof(p), "%s/index", dir);
    uint8_t *ix = slurp(p, &ixl);
    snprintf(p, sizeof(p), "%s/journal", dir);
    uint8_t *jr = slurp(p, &jrl);
    snprintf(p, sizeof(p), "%s/slab-0000.kvh", dir);
    uint8_t *slab = slurp(p, &sl);
    if (!ix || !jr || !slab)
        exit(1);
    index_seed("snapshot-and-journal", 0, ix, ixl, jr, jrl);
    index_seed("snapshot-and-journal-fixcrc", 3, ix, ixl, jr, jrl);
    index_seed("no-journal", 4, ix, ixl, jr, jrl);
    index_seed("reset-on-mismatch", 8, ix, ixl, jr, jrl);
    index_seed("geometry-header", 16 | 3, ix, ixl, jr, jrl);
    index_seed("empty-journal", 0, ix, ixl, jr, 4096);
    index_seed("short-header", 0, ix, 40, jr, jrl);
    uint8_t *torn = malloc(jrl);
    memcpy(torn, jr, jrl);
    index_seed("torn-tail", 0, ix, ixl, torn, jrl - 30);
    torn[4096 + 70] ^= 0x10;
    index_seed("bit-rot-record", 0, ix, ixl, torn, jrl);
    torn[20] ^= 1;
    index_seed("bad-journal-header", 0, ix, ixl, torn, jrl);
    free(torn);

    /* slot headers: the first slots of the slab, as verified by the engine */
    uint64_t store_id = get64(ix + 16);
    for (int s = 0; s < 5 && (size_t)(s + 1) * 8192 <= sl; s++) {
        const uint8_t *h = slab + (size_t)s * 8192;
        uint8_t b[1 + 8 * 3 + 2 + 4096 + 128];
        size_t n = 0;
        b[n++] = (uint8_t)(s == 4 ? 7 : 0);
        for (int i = 0; i < 8; i++)
            b[n++] = (uint8_t)(store_id >> (8 * i));
        for (int i = 0; i < 8; i++)
            b[n++] = (uint8_t)((uint64_t)s >> (8 * i));
        memcpy(b + n, h + 40, 8); /* the hash it holds */
        n += 8;
        b[n++] = 3; /* max_tokens 4 */
        b[n++] = 1; /* block size 128 */
        memcpy(b + n, h, 4096);
        n += 4096;
        memcpy(b + n, h + 4096, 128);
        n += 128;
        char name[32];
        snprintf(name, sizeof(name), "slot-%d", s);
        put("fuzz_slot_header", name, b, n);
    }
    uint8_t tiny[] = {6, 1, 2, 3};
    put("fuzz_slot_header", "tiny", tiny, sizeof(tiny));
    free(ix), free(jr), free(slab);
    char cmd[700];
    snprintf(cmd, sizeof(cmd), "rm -rf %s", dir);
    if (system(cmd) != 0)
        fprintf(stderr, "could not remove %s\n", dir);
}

static uint64_t rng = 0x5eed5eed;
static uint8_t rnd(void)
{
    rng = rng * 6364136223846793005ull + 1442695040888963407ull;
    return (uint8_t)(rng >> 56);
}

static void random_seeds(const char *target, int count, size_t min, size_t max)
{
    for (int i = 0; i < count; i++) {
        size_t n = min + rnd() % (max - min + 1);
        uint8_t *b = malloc(n);
        for (size_t j = 0; j < n; j++)
            b[j] = rnd();
        char name[32];
        snprintf(name, sizeof(name), "random-%d", i);
        put(target, name, b, n);
        free(b);
    }
}

static void config_seeds(void)
{
    /* flags, [sizes], geometry selector, then fields (see fuzz_config.c) */
    uint8_t valid[] = {0, 0, 2, 2, 16, 4, 1, 1, 0,  0, 0, 0, 2, 1, 0, 0, 0, 0, 2, 0, 0, 0,  0, 0, 0, 0,  0, 0, 0,
                       0, 0, 0, 0, 0,  0, 0, 0, 32, 1, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 16, 0, 0, 0, 16, 0, 0, 0};
    put("fuzz_config", "valid-cpu", valid, sizeof(valid));
    valid[0] = 32 | 16;
    put("fuzz_config", "valid-disk-log", valid, sizeof(valid));
    valid[0] = 128;
    put("fuzz_config", "bad-struct-size", valid, sizeof(valid));
    valid[0] = 1 | 2;
    put("fuzz_config", "bad-init-sizes", valid, sizeof(valid));
    random_seeds("fuzz_config", 6, 8, 96);
}

/* fuzz_api plans of the calls behind opcodes 240..255 (fuzz/api_ops_*.h);
 * run a target with KVH_FUZZ_TRACE=1 to see each call and its status. */
#define SEQ_CREATE(slot) 0, 0, 0, 0, 0, 0, 0, slot
#define SEQ_APPEND(seq, n, prompt) 4, seq, 0, 0, 0, 0, n, prompt, 0, 0 /* + write_kv of both layers */
#define SEQ_ACQUIRE(seq, first_block, n_blocks) 14, seq, 0, 0, 0, 0, first_block, n_blocks, 0
#define SEQ_MIGRATE(seq, n_blocks, tier) 26, seq, 0, 0, 0, 0, 0, n_blocks, tier
#define SEQ_READ(seq, layer, n) 7, seq, 0, 0, 0, 0, layer, 0, n
#define SEQ_FORK(seq, slot) 3, seq, 0, 0, 0, 0, 0, slot
#define SEQ_WRITE(seq, pos, n) 6, seq, 0, 0, 0, 0, pos, n, 0
#define SEQ_FREE(seq) 2, seq, 0, 0, 0, 0
#define REOPEN 39, 0, 0, 0, 0, 0
#define NULL_HANDLE 230

static void newer_api_seeds(void)
{
    /* views (head_dim 512), INT8 codec, LCTRU, one worker */
    uint8_t views[] = {
        0xc0 | (4 << 3) | 2,
        4 | 8 | 32 | 2, /* device 6 blocks, host 4 */
        SEQ_CREATE(0),
        SEQ_APPEND(0, 12, 0),
        252,
        0,
        0,
        3,
        1,
        255,
        0, /* view of layer 0, capacity 64 (acquired first) */
        254,
        1,
        0,
        0,
        1,
        1,
        0,
        1,
        0, /* decode over it == paged decode */
        SEQ_APPEND(0, 8, 1),
        253,
        0,
        0,
        1, /* refresh: the appended block */
        254,
        1,
        0,
        0,
        3,
        3,
        0,
        2,
        1, /* prefill, 2 query heads per KV head */
        252,
        0,
        1,
        2,
        1,
        255,
        1, /* view of layer 1, capacity 16 */
        253,
        1,
        1,
        0, /* get */
        251,
        0,
        0,
        0,
        0,
        8,
        0,
        200, /* seq tolerance 200 */
        251,
        0,
        0,
        2,
        0,
        8,
        0,
        0,
        1,                     /* derive tolerance, max error 0.25 */
        SEQ_MIGRATE(0, 20, 1), /* held by the views: stays */
        253,
        0,
        2,
        253,
        1,
        2,                     /* release both views */
        SEQ_MIGRATE(0, 20, 1), /* now encoded into the host tier */
        SEQ_READ(0, 0, 20),
        SEQ_ACQUIRE(0, 0, 20),
        255,
        0,
        0,
        0,
        0,
        0,
        1,
        0,
        0,
        0,
        0,
        0,
        0,
        1,
        255, /* plan: decode of seq 0 */
        255,
        0,
        1,
        255, /* run */
        SEQ_FORK(0, 1),
        SEQ_WRITE(0, 0, 4), /* copy-on-write under the plan */
        255,
        0,
        1,
        255,
        SEQ_FREE(0),
        255,
        0,
        1,
        255, /* run after the sequence is gone */
        255,
        0,
        3, /* destroy */
        252,
        1,
        0,
        0,
        1,
        255,
        2,      /* view of the fork */
        REOPEN, /* close releases the view */
    };
    put("fuzz_api", "newer-views-plans-int8", views, sizeof(views));
    views[1] = 4 | 16 | 1; /* Q4_G32, LRU-K, no worker */
    put("fuzz_api", "newer-views-plans-q4", views, sizeof(views));

    /* weight contexts and admission; disk tier, one worker */
    uint8_t contexts[] = {
        64 | (7 << 3) | 5,
        240,
        0,
        0x27,
        4,
        1,
        255,
        0, /* context 0: 65-byte chunks, KV demoted */
        240,
        0,
        0x20,
        255,
        1, /* context 1: defaults */
        242,
        0,
        0,
        0,
        255,
        100,
        0,
        255,
        0,
        5,
        255,
        255, /* 101 bytes, layer 0 */
        242,
        0,
        0,
        1,
        255,
        200,
        1,
        255,
        4,
        0,
        255,
        16,
        0,
        255,
        255, /* 457 bytes of the file */
        242,
        1,
        0,
        0,
        255,
        50,
        0,
        255,
        0,
        9,
        255,
        255, /* 51 bytes into context 1 */
        249,
        0,
        0,
        10,
        0,
        0, /* seq of context 0 */
        SEQ_APPEND(0, 12, 0),
        243,
        0,
        0, /* attach it (again) */
        244,
        NULL_HANDLE,
        0,
        0, /* load context 0 */
        246,
        0,
        0,
        255,
        255,
        255, /* read region 0 back */
        246,
        0,
        1,
        0,
        255,
        255,
        0x5a, /* write through region 1 */
        244,
        0,
        1,
        1,
        0, /* switch to context 1, fenced */
        28,
        0,
        0,
        0,
        0,
        0,
        200, /* wait for it */
        245,
        1,
        3,
        2, /* wait_layer */
        246,
        1,
        0,
        255,
        255,
        255,
        244,
        1,
        0,
        0, /* and back */
        246,
        0,
        1,
        255,
        255,
        255, /* the written bytes came back */
        247,
        0,
        1,
        1,
        247,
        0,
        2,
        0,
        247,
        0,
        3,
        0,
        247,
        0,
        0,
        0,
        1,
        248,
        0,
        16,
        2,
        2,
        255, /* admission: 2 + 2 blocks, short <= 16 */
        249,
        0,
        0,
        8,
        NULL_HANDLE,
        1, /* 8 tokens: short pool */
        249,
        0,
        0,
        20,
        NULL_HANDLE, /* 20 tokens: too long for the long pool */
        249,
        0,
        0,
        250,
        0,
        NULL_HANDLE, /* UINT64_MAX tokens: refused too */
        241,
        1,
        241,
        0, /* destroy both (and again) */
        REOPEN,
        246,
        0,
        0,
        255,
        255,
        255, /* stale handle of a closed engine */
    };
    put("fuzz_api", "newer-contexts-admission", contexts, sizeof(contexts));

    /* codecs on caller buffers: Q4 f32, INT8 f16, the f32 extremes, forged */
    uint8_t
        codecs[] =
            {
                0,   250, 2,   0,   1,   3,   255, 3,   7,   255, 255, 255, 250, 1,   1,   200, 4,   255,
                170, 8,   255, 255, 255, 250, 3,   0,   2,   2,   255, 161, 9,   255, 255, 255, 250, 1,
                2,   3,   4,   255, 160, 10,  255, 255, 255, 250, 2,   0,   1,   2,   255, 200, 11,  255,
                255, 0,   3,   7,   250, 4,   3,   0,   1,   0,   0,   0,   0,   0, /* unknown codec and dtype, NULLs */
            };
    put("fuzz_api", "newer-codecs", codecs, sizeof(codecs));
}

static void api_seeds(void)
{
    /* mode, then steps: opcode + arguments (fuzz_api.c) */
    uint8_t basic[] = {
        4 | (2 << 3) | 3, /* disk tier, host 2 blocks, device 5 */
        0,
        0,
        0,
        0,
        0,
        1, /* create */
        4,
        0,
        0,
        0,
        0,
        0,
        0,
        12,
        0,
        0,
        0, /* append 12 prompt tokens */
        11,
        0,
        0,
        0,
        0,
        0, /* persist */
        13,
        1,
        0,
        0,
        0,
        0,
        12,
        0, /* match on another seq */
        14,
        0,
        0,
        0,
        0,
        1,
        0,
        8,
        1, /* acquire */
        3,
        0,
        0,
        0,
        0,
        0,
        0,
        2, /* fork */
        26,
        0,
        0,
        0,
        0,
        0,
        0,
        12,
        2, /* migrate to disk */
        7,
        0,
        0,
        0,
        0,
        0,
        0,
        0,
        12, /* read */
        39,
        0,
        0,
        0,
        0,
        0, /* close + reopen */
        13,
        2,
        0,
        0,
        0,
        0,
        12,
        0,
        7,
        0,
        0,
        0,
        0,
        0,
        0,
        0,
        12,
    };
    put("fuzz_api", "basic-disk", basic, sizeof(basic));
    basic[0] = 3 | (1 << 6);
    put("fuzz_api", "basic-memory-worker", basic, sizeof(basic));
    random_seeds("fuzz_api", 8, 32, 400);
    newer_api_seeds();
}

/* fuzz_remote_value: flags, geometry choice 7 (256-byte blocks of 16
 * tokens), hash, parent, then a value as the remote tier encodes it. */
static void remote_value_seeds(void)
{
    const uint64_t hash = 0x1122334455667788ull, parent = 0x99aabbccddeeff00ull;
    kvhi_remote_id id = {.model_salt = 0x5a17, .geo_tag = 0xfeedf00d, .block_bytes = 256, .block_tokens = 16};
    int32_t tokens[16];
    for (int i = 0; i < 16; i++)
        tokens[i] = (int32_t)fz_mix(hash + (uint64_t)i);
    static uint8_t b[18 + KVHI_SLOT_HEADER_BYTES + 256];
    b[0] = 0;
    b[1] = 7;
    for (int i = 0; i < 8; i++) {
        b[2 + i] = (uint8_t)(hash >> (8 * i));
        b[10 + i] = (uint8_t)(parent >> (8 * i));
    }
    uint8_t *v = b + 18;
    for (int i = 0; i < 256; i++)
        v[KVHI_SLOT_HEADER_BYTES + i] = (uint8_t)(i * 13);
    kvhi_remote_value_encode(v, &id, hash, parent, tokens, v + KVHI_SLOT_HEADER_BYTES);
    put("fuzz_remote_value", "valid", b, sizeof(b));
    b[0] = 4; /* checked on its own */
    put("fuzz_remote_value", "valid-alone", b, sizeof(b));
    b[0] = 1; /* a changed token count, resealed by the target */
    v[12] = 0xff;
    put("fuzz_remote_value", "forged-count", b, sizeof(b));
    put("fuzz_remote_value", "truncated", b, 18 + 100);
}

int main(int argc, char **argv)
{
    if (argc != 2) {
        fprintf(stderr, "usage: %s OUTDIR\n", argv[0]);
        return 2;
    }
    snprintf(out_root, sizeof(out_root), "%s", argv[1]);
    mkdir(out_root, 0755);
    store_seeds();
    config_seeds();
    api_seeds();
    remote_value_seeds();
    return 0;
}
