/* The remote tier's keys and values (core/remote_format.c) and the key
 * slots of the cluster client (core/remote_cluster.c): round trips, every
 * field a reader checks, and forged values whose checksums are valid but
 * whose geometry, token count or length is hostile: rejected, never read
 * out of bounds (this test runs under ASan in `make test`). */
#include "test_util.h"

#include "core/crc32c.h"
#include "core/remote_cluster.h"
#include "core/remote_format.h"

#define BT 16
#define DATA 1024

static const kvhi_remote_id id = {.model_salt = 0x1234, .geo_tag = 0xabcdef01, .block_bytes = DATA, .block_tokens = BT};

typedef struct value {
    uint8_t bytes[KVHI_SLOT_HEADER_BYTES + DATA];
    int32_t tokens[BT];
} value;

static void make(value *v, uint64_t hash, uint64_t parent)
{
    for (int i = 0; i < BT; i++)
        v->tokens[i] = 100 + i;
    for (int i = 0; i < DATA; i++)
        v->bytes[KVHI_SLOT_HEADER_BYTES + i] = (uint8_t)(i * 7);
    kvhi_remote_value_encode(v->bytes, &id, hash, parent, v->tokens, v->bytes + KVHI_SLOT_HEADER_BYTES);
}

static void put32(uint8_t *p, uint32_t x)
{
    for (int i = 0; i < 4; i++)
        p[i] = (uint8_t)(x >> (8 * i));
}
static void put64(uint8_t *p, uint64_t x)
{
    for (int i = 0; i < 8; i++)
        p[i] = (uint8_t)(x >> (8 * i));
}

/* What a forger does: change a field, then make both checksums valid. */
static void reseal(value *v)
{
    put32(v->bytes + 64, kvhi_crc32c(0, v->bytes + KVHI_SLOT_HEADER_BYTES, DATA));
    put32(v->bytes + KVHI_SLOT_HEADER_BYTES - 4, kvhi_crc32c(0, v->bytes, KVHI_SLOT_HEADER_BYTES - 4));
}

static int check(const value *v, size_t len, uint64_t hash, uint64_t parent, const int32_t *tokens)
{
    kvhi_remote_expect ex = {.hash = hash, .parent = parent, .tokens = tokens};
    const char *why = NULL;
    int rc = kvhi_remote_value_check(v->bytes, len, &id, &ex, &why);
    if (rc != 0)
        assert_true(why && *why);
    /* The copying check (the match's path) agrees, and copies what it passes. */
    static uint8_t dst[DATA];
    memset(dst, 0xee, sizeof(dst));
    const char *why_copy = NULL;
    assert_int_equal(kvhi_remote_value_check_copy(v->bytes, len, dst, &id, &ex, &why_copy), rc);
    if (rc == 0)
        assert_memory_equal(dst, v->bytes + KVHI_SLOT_HEADER_BYTES, DATA);
    else
        assert_true(why_copy && *why_copy);
    return rc;
}

static void test_round_trip(void **state)
{
    (void)state;
    value v;
    make(&v, 0x55, 0x44);
    assert_int_equal(check(&v, sizeof(v.bytes), 0x55, 0x44, v.tokens), 0);
    uint64_t h = 0;
    assert_int_equal(kvhi_remote_value_check_alone(v.bytes, sizeof(v.bytes), &id, &h, NULL), 0);
    assert_int_equal(h, 0x55);
    assert_int_equal(kvhi_remote_value_bytes(&id), sizeof(v.bytes));
}

static void test_reader_expectations(void **state)
{
    (void)state;
    value v;
    make(&v, 0x55, 0x44);
    int32_t other[BT];
    memcpy(other, v.tokens, sizeof(other));
    other[BT - 1]++;
    assert_int_not_equal(check(&v, sizeof(v.bytes), 0x56, 0x44, v.tokens), 0); /* hash */
    assert_int_not_equal(check(&v, sizeof(v.bytes), 0x55, 0x45, v.tokens), 0); /* parent */
    assert_int_not_equal(check(&v, sizeof(v.bytes), 0x55, 0x44, other), 0);    /* tokens */
    /* another model or geometry reading the same bytes */
    kvhi_remote_id other_id = id;
    other_id.geo_tag ^= 1;
    kvhi_remote_expect ex = {.hash = 0x55, .parent = 0x44, .tokens = v.tokens};
    assert_int_not_equal(kvhi_remote_value_check(v.bytes, sizeof(v.bytes), &other_id, &ex, NULL), 0);
    other_id = id;
    other_id.model_salt ^= 1;
    assert_int_not_equal(kvhi_remote_value_check(v.bytes, sizeof(v.bytes), &other_id, &ex, NULL), 0);
    other_id = id;
    other_id.block_tokens = 8;
    assert_int_not_equal(kvhi_remote_value_check(v.bytes, sizeof(v.bytes), &other_id, &ex, NULL), 0);
}

static void test_damage(void **state)
{
    (void)state;
    value v;
    make(&v, 0x55, 0x44);
    /* every single bit flip of the header or data, sampled */
    for (size_t bit = 0; bit < sizeof(v.bytes) * 8; bit += 37) {
        v.bytes[bit / 8] ^= (uint8_t)(1u << (bit % 8));
        assert_int_not_equal(check(&v, sizeof(v.bytes), 0x55, 0x44, v.tokens), 0);
        v.bytes[bit / 8] ^= (uint8_t)(1u << (bit % 8));
    }
    /* truncated, extended, empty (all lengths read within the buffer) */
    assert_int_not_equal(check(&v, sizeof(v.bytes) - 1, 0x55, 0x44, v.tokens), 0);
    assert_int_not_equal(check(&v, KVHI_SLOT_HEADER_BYTES, 0x55, 0x44, v.tokens), 0);
    assert_int_not_equal(check(&v, 100, 0x55, 0x44, v.tokens), 0);
    assert_int_not_equal(check(&v, 0, 0x55, 0x44, v.tokens), 0);
    uint8_t *longer = calloc(1, sizeof(v.bytes) + 1);
    memcpy(longer, v.bytes, sizeof(v.bytes));
    kvhi_remote_expect ex = {.hash = 0x55, .parent = 0x44, .tokens = v.tokens};
    assert_int_not_equal(kvhi_remote_value_check(longer, sizeof(v.bytes) + 1, &id, &ex, NULL), 0);
    free(longer);
}

static void test_forged_with_valid_checksums(void **state)
{
    (void)state;
    value v;
    /* hostile token counts: beyond the block, beyond the header page */
    const uint32_t counts[] = {0, BT - 1, BT + 1, 1021, 1022, 0x40000000u, 0xffffffffu};
    for (size_t i = 0; i < sizeof(counts) / sizeof(counts[0]); i++) {
        make(&v, 0x55, 0x44);
        put32(v.bytes + 12, counts[i]);
        reseal(&v);
        assert_int_not_equal(check(&v, sizeof(v.bytes), 0x55, 0x44, v.tokens), 0);
    }
    /* a block size that disagrees with the value's length, or wraps */
    const uint64_t sizes[] = {0, DATA - 1, DATA + 1, 1ull << 40, UINT64_MAX, UINT64_MAX - KVHI_SLOT_HEADER_BYTES + 1};
    for (size_t i = 0; i < sizeof(sizes) / sizeof(sizes[0]); i++) {
        make(&v, 0x55, 0x44);
        put64(v.bytes + 56, sizes[i]);
        reseal(&v);
        assert_int_not_equal(check(&v, sizeof(v.bytes), 0x55, 0x44, v.tokens), 0);
    }
    /* a slot or offset (a disk slot header posted as a value) */
    make(&v, 0x55, 0x44);
    put64(v.bytes + 24, 3);
    reseal(&v);
    assert_int_not_equal(check(&v, sizeof(v.bytes), 0x55, 0x44, v.tokens), 0);
    /* another geometry tag, version, or an unpublished block */
    make(&v, 0x55, 0x44);
    put32(v.bytes + KVHI_SLOT_HEADER_BYTES - 8, 0x1111);
    reseal(&v);
    assert_int_not_equal(check(&v, sizeof(v.bytes), 0x55, 0x44, v.tokens), 0);
    make(&v, 0x55, 0x44);
    put32(v.bytes + 8, 2);
    reseal(&v);
    assert_int_not_equal(check(&v, sizeof(v.bytes), 0x55, 0x44, v.tokens), 0);
    make(&v, 0x55, 0x44);
    put32(v.bytes + KVHI_SLOT_HEADER_BYTES - 12, 0);
    reseal(&v);
    assert_int_not_equal(check(&v, sizeof(v.bytes), 0x55, 0x44, v.tokens), 0);
    /* a reader whose own geometry is out of range trusts nothing */
    make(&v, 0x55, 0x44);
    kvhi_remote_id bad = id;
    bad.block_tokens = 0;
    assert_int_not_equal(kvhi_remote_value_check_alone(v.bytes, sizeof(v.bytes), &bad, NULL, NULL), 0);
    bad.block_tokens = 100000;
    assert_int_not_equal(kvhi_remote_value_check_alone(v.bytes, sizeof(v.bytes), &bad, NULL, NULL), 0);
}

static void test_keys(void **state)
{
    (void)state;
    char key[KVHI_REMOTE_KEY_BYTES], prefix[KVHI_REMOTE_MODEL_PREFIX_LEN + 1];
    int32_t tokens[BT], other[BT];
    for (uint32_t i = 0; i < BT; i++)
        tokens[i] = other[i] = (int32_t)(100 + i);
    other[BT - 1]++;
    kvhi_remote_key(key, &id, 0xff, 7, tokens);
    assert_int_equal(strncmp(key, "kvh:v2:0000000000001234-abcdef01:00000000000000ff-", 50), 0);
    assert_int_equal(strlen(key), KVHI_REMOTE_KEY_LEN);
    kvhi_remote_model_prefix(prefix, &id);
    assert_int_equal(strncmp(key, prefix, KVHI_REMOTE_MODEL_PREFIX_LEN), 0);
    assert_int_equal(strlen(prefix), KVHI_REMOTE_MODEL_PREFIX_LEN);
    /* The same prefix always names the same key; an equal hash with
     * another parent or other tokens (a collision, or a forged hash)
     * names another, so the store keeps both. */
    char again[KVHI_REMOTE_KEY_BYTES], k2[KVHI_REMOTE_KEY_BYTES], k3[KVHI_REMOTE_KEY_BYTES];
    kvhi_remote_key(again, &id, 0xff, 7, tokens);
    kvhi_remote_key(k2, &id, 0xff, 7, other);
    kvhi_remote_key(k3, &id, 0xff, 8, tokens);
    assert_string_equal(key, again);
    assert_string_not_equal(key, k2);
    assert_string_not_equal(key, k3);
    assert_int_equal(strncmp(key, k2, 50), 0); /* the hash part is the same */
}

/* Slots as redis-server 7.0 computes them (CLUSTER KEYSLOT). */
static void test_key_slots(void **state)
{
    (void)state;
    static const struct {
        const char *key;
        unsigned slot;
    } known[] = {{"foo", 12182},          {"somekey", 11058},
                 {"hello", 866},          {"{user1000}.following", 3443},
                 {"foo{}{bar}", 8363},    {"foo{{bar}}zap", 4015},
                 {"foo{bar}{zap}", 5061}, {"kvh:v1:0000000000000001-0000abcd:00000000000000ff", 7588}};
    for (size_t i = 0; i < sizeof(known) / sizeof(known[0]); i++)
        assert_int_equal(kvhi_cluster_key_slot(known[i].key, strlen(known[i].key)), known[i].slot);
    assert_int_equal(kvhi_cluster_key_slot("{user1000}.followers", 20), 3443);
    assert_int_equal(kvhi_cluster_key_slot("", 0), 0);
}

int main(void)
{
    const struct CMUnitTest tests[] = {
        cmocka_unit_test(test_round_trip), cmocka_unit_test(test_reader_expectations),
        cmocka_unit_test(test_damage),     cmocka_unit_test(test_forged_with_valid_checksums),
        cmocka_unit_test(test_keys),       cmocka_unit_test(test_key_slots),
    };
    return cmocka_run_group_tests(tests, NULL, NULL);
}
