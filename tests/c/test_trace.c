/* benchmarks/trace.h: the block-access traces of `kvh-bench trace`, at the
 * edges of their file form: every 32-bit sequence id and 64-bit handle,
 * lines of any length up to TRACE_LINE_MAX, fields checked whole. */
#include "test_util.h"

#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "benchmarks/trace.h"

static const char *scratch_path(const char *name)
{
    static char path[4096];
    const char *dir = getenv("KVH_TEST_TMPDIR");
    snprintf(path, sizeof(path), "%s/%s", dir && *dir ? dir : "/tmp", name);
    return path;
}

/* Writes text to a scratch file and loads it: trace_load's result. */
static int load_text(trace *t, const char *text, char *err, size_t err_len)
{
    const char *path = scratch_path("edge.trace");
    FILE *f = fopen(path, "w");
    assert_non_null(f);
    assert_int_equal(fwrite(text, 1, strlen(text), f), strlen(text));
    assert_int_equal(fclose(f), 0);
    trace_init(t);
    err[0] = '\0';
    return trace_load(t, path, err, err_len);
}

/* Sequence ids are the source's: the largest ones count as sequences of
 * their own, found again, numbered densely, and cost no memory in
 * proportion to their value. */
static void test_sequence_ids_take_every_32_bit_value(void **state)
{
    (void)state;
    trace t;
    trace_init(&t);
    assert_int_equal(trace_add(&t, UINT32_MAX, 0, 0, 0.5f), 0);
    assert_int_equal(trace_add(&t, 4000000000u, 7, 0, 0.5f), 0);
    assert_int_equal(trace_add(&t, UINT32_MAX, 1, 0, 0.5f), 0);
    assert_int_equal(trace_add(&t, 0, 0, 0, 0.5f), 0);
    assert_int_equal(trace_count_seqs(&t), 3);
    assert_int_equal(t.n_seqs, 3);
    assert_int_equal(t.acc[0].seq_id, 0);
    assert_int_equal(t.acc[1].seq_id, 1);
    assert_int_equal(t.acc[2].seq_id, 0);
    assert_int_equal(t.acc[3].seq_id, 2);
    assert_int_equal(trace_find_seq(&t, UINT32_MAX), 0);
    assert_int_equal(trace_find_seq(&t, 4000000000u), 1);
    assert_int_equal(trace_find_seq(&t, 1), -1);
    assert_int_equal(trace_find(&t, UINT32_MAX, 1), 2);
    trace_free(&t);

    char err[512];
    assert_int_equal(load_text(&t, "4294967295 0\n", err, sizeof(err)), 0);
    assert_int_equal(t.n, 1);
    assert_int_equal(trace_count_seqs(&t), 1);
    assert_int_equal(t.acc[0].seq, UINT32_MAX);
    trace_free(&t);
}

/* A handle is any 64-bit value: all ones (once a key that wrapped to the
 * map's empty mark) and zero name one block each, found again at every
 * access. */
static void test_every_handle_names_one_block(void **state)
{
    (void)state;
    trace t;
    trace_init(&t);
    for (int i = 0; i < 3; i++) {
        assert_int_equal(trace_add_handle(&t, UINT64_MAX, 0, 0.5f), 0);
        assert_int_equal(trace_add_handle(&t, 0, 0, 0.5f), 0);
    }
    assert_int_equal(t.n, 6);
    assert_int_equal(t.n_blocks, 2);
    assert_int_equal(t.acc[0].block, t.acc[4].block);
    assert_int_equal(t.acc[1].block, t.acc[5].block);
    assert_int_not_equal(t.acc[0].block, t.acc[1].block);
    trace_free(&t);

    /* Many handles: the map grows and keeps all ones among them. */
    trace_init(&t);
    for (uint64_t h = 0; h < 5000; h++)
        assert_int_equal(trace_add_handle(&t, UINT64_MAX - h, 0, 0.5f), 0);
    assert_int_equal(trace_add_handle(&t, UINT64_MAX, 0, 0.5f), 0);
    assert_int_equal(t.n_blocks, 5000);
    assert_int_equal(t.acc[5000].block, 0);
    trace_free(&t);

    char err[512];
    assert_int_equal(load_text(&t,
                               "0.1\t0\t0x1\t0xffffffffffffffff\t0\tdevice\tmatch\n"
                               "0.2\t0\t0x1\t0xffffffffffffffff\t0\t-\thint\t3\n"
                               "0.3\t0\t0x1\t0xffffffffffffffff\t0\tdevice\tmatch\n",
                               err, sizeof(err)),
                     0);
    assert_int_equal(t.n, 2);
    assert_int_equal(t.n_blocks, 1);
    assert_int_equal(t.n_hints, 1); /* the block was found: the hint is kept */
    trace_free(&t);
}

/* A line is read whole, however long: a long comment is one comment (its
 * tail is no access), and blanks wider than a read buffer separate fields
 * as well as one. */
static void test_long_lines_are_read_whole(void **state)
{
    (void)state;
    size_t blanks = 3 * 4096;
    char *text = malloc(blanks + 1024);
    assert_non_null(text);
    /* A comment whose bytes past the 511th read as an access "7 8" when
     * the line is cut there. */
    char *p = text;
    *p++ = '#';
    memset(p, 'x', 510);
    p += 510;
    p += sprintf(p, " 7 8\n1");
    memset(p, ' ', blanks);
    p += blanks;
    strcpy(p, "2\n");
    trace t;
    char err[512];
    assert_int_equal(load_text(&t, text, err, sizeof(err)), 0);
    assert_int_equal(t.n, 1);
    assert_int_equal(t.acc[0].seq, 1);
    assert_int_equal(t.acc[0].index, 2);
    trace_free(&t);
    free(text);
}

/* A line longer than TRACE_LINE_MAX is refused by its own number. */
static void test_a_line_too_long_is_named(void **state)
{
    (void)state;
    size_t len = TRACE_LINE_MAX + 100;
    char *text = malloc(len + 64);
    assert_non_null(text);
    strcpy(text, "1 2\n#");
    memset(text + 5, 'x', len);
    strcpy(text + 5 + len, "\n3 4\n");
    trace t;
    char err[512];
    assert_int_equal(load_text(&t, text, err, sizeof(err)), -1);
    assert_non_null(strstr(err, "edge.trace:2: line longer than"));
    trace_free(&t);
    free(text);
}

/* Fields are checked whole, as trace.h documents them: anything after
 * them, a sign, a number past 32 bits, a tolerance outside [0, 1] (nan
 * included) is refused with the line's number. */
static void test_malformed_fields_are_refused(void **state)
{
    (void)state;
    static const char *const bad[] = {
        "1 2 zz",
        "1 2 0 nan",
        "1 2 0 inf",
        "1 2 0 1.5",
        "1 2 0 -0.5",
        "1 2 0 0.5 7",
        "1 2 0 0x0.8",
        "1 2x",
        "-1 2",
        "+1 2",
        "4294967296 0",
        "1 4294967296",
        "1 2 4294967296",
        "1",
        "hint 1 2 3",
        "hint 1 2 3 4 5",
        "hint 1 2 3 2147483648",
        "hint 1 2 3 -2147483649",
        "hint 1 2 3 4x",
        "hint -1 2 3 4",
        "hintx 1 2 3 4",
    };
    for (size_t i = 0; i < sizeof(bad) / sizeof(bad[0]); i++) {
        char text[256], err[512];
        snprintf(text, sizeof(text), "# first\n0 0\n%s\n", bad[i]);
        trace t;
        int rc = load_text(&t, text, err, sizeof(err));
        if (rc != -1 || !strstr(err, "edge.trace:3: expected"))
            fail_msg("'%s' was taken (rc %d, err '%s')", bad[i], rc, err);
        trace_free(&t);
    }
    /* What the form allows: blanks of any kind around fields, CRLF, every
     * 32-bit value, a tolerance's exponent, the extreme priorities. */
    trace t;
    char err[512];
    assert_int_equal(load_text(&t,
                               "  4294967295\t4294967295  4294967295 1e-1 \r\n"
                               "hint 1 0 4294967295 -2147483648\n"
                               "hint 1 0 1 +2147483647\n"
                               "1 0 0 1\n"
                               "1 1 0 0.\n",
                               err, sizeof(err)),
                     0);
    assert_int_equal(t.n, 3);
    assert_int_equal(t.acc[0].seq, UINT32_MAX);
    assert_int_equal(t.acc[0].index, UINT32_MAX);
    assert_int_equal(t.acc[0].agent, UINT32_MAX);
    assert_true(t.tolerance[0] == 0.1f);
    assert_true(t.tolerance[1] == 1.0f);
    assert_true(t.tolerance[2] == 0.0f);
    assert_int_equal(t.n_hints, 2);
    assert_int_equal(t.hints[0].n, UINT32_MAX);
    assert_int_equal(t.hints[0].priority, INT32_MIN);
    assert_int_equal(t.hints[1].priority, INT32_MAX);
    trace_free(&t);
}

/* The demo's tab-separated form, checked field by field as the plain one
 * is: a handle wider than 64 bits was cut to all ones (two blocks taken
 * for one), and signs, unknown kinds and extra fields passed. */
static void test_malformed_demo_lines_are_refused(void **state)
{
    (void)state;
    static const char *const bad[] = {
        "0.1\t0\t0x1\t0x10000000000000000\t0\tdevice\tmatch",
        "0.1\t0\t0x1\t0x1ffffffffffffffff\t0\tdevice\tmatch",
        "0.1\t0\t0x1\t-0x5\t0\tdevice\tmatch",
        "0.1\t-1\t0x1\t0x5\t0\tdevice\tmatch",
        "0.1\t99999999999999999999\t0x1\t0x5\t0\tdevice\tmatch",
        "0.1\t0\t0x1\t0x5\t0\tdevice\tbogus",
        "0.1\t0\t0x1\t0x5\t0\tdevice\tmatch\textra",
        "nan\t0\t0x1\t0x5\t0\tdevice\tmatch",
        "0.1\t0\t0x1\t0x5\t0\t\tmatch",
        "0.1\t0\t0x1\t0x5\t0\t-\thint",
        "0.1\t0\t0x1\t0x5\t0\t-\thint\t2147483648",
        "0.1\t0\t0x1\t0xzz\t0\tdevice\tmatch",
    };
    for (size_t i = 0; i < sizeof(bad) / sizeof(bad[0]); i++) {
        char text[256], err[512];
        snprintf(text, sizeof(text), "# first\n0.0\t0\t0x1\t0x0\t0\tdevice\tmatch\n%s\n", bad[i]);
        trace t;
        int rc = load_text(&t, text, err, sizeof(err));
        if (rc != -1 || !strstr(err, "edge.trace:3: expected 'T_S"))
            fail_msg("'%s' was taken (rc %d, err '%s')", bad[i], rc, err);
        trace_free(&t);
    }
    /* 16 digits with or without 0x, leading zeros, CRLF */
    trace t;
    char err[512];
    assert_int_equal(load_text(&t,
                               "0.1\t4294967295\tffffffffffffffff\t0x00000000000000000000ffffffffffffffff\t0\tdevice\t"
                               "decode\r\n"
                               "0.2\t0\t0x1\tFFFFFFFFFFFFFFFF\t0\thost\tprefill\n",
                               err, sizeof(err)),
                     0);
    assert_int_equal(t.n, 2);
    assert_int_equal(t.n_blocks, 1);
    assert_int_equal(t.acc[0].agent, UINT32_MAX);
    trace_free(&t);
}

/* A file mixing the two forms named blocks of both in one key space:
 * handle 0x100000005 and the plain pair (1, 5) were one block. */
static void test_a_file_of_both_forms_is_refused(void **state)
{
    (void)state;
    static const char *const mixed[] = {
        "0.1\t0\t0x1\t0x100000005\t0\tdevice\tmatch\n1 5\n",
        "1 5\n0.1\t0\t0x1\t0x100000005\t0\tdevice\tmatch\n",
    };
    for (size_t i = 0; i < 2; i++) {
        trace t;
        char err[512];
        assert_int_equal(load_text(&t, mixed[i], err, sizeof(err)), -1);
        if (!strstr(err, "edge.trace:2:") || !strstr(err, "one form"))
            fail_msg("%s", err);
        trace_free(&t);
    }
}

/* A saved trace replays as it was made: tolerances were written with
 * three decimals, so 0.4412 and 0.4409 both came back as 0.441. */
static void test_a_saved_trace_keeps_every_tolerance(void **state)
{
    (void)state;
    static const float tol[] = {0.4412f, 0.4409f, 1e-7f, 0.999999f, 0.0f, 1.0f, 0.1f};
    trace t;
    trace_init(&t);
    for (uint32_t i = 0; i < sizeof(tol) / sizeof(tol[0]); i++)
        assert_int_equal(trace_add(&t, 1, i, 0, tol[i]), 0);
    const char *path = scratch_path("saved.trace");
    assert_int_equal(trace_save(&t, path), 0);
    trace back;
    trace_init(&back);
    char err[512];
    assert_int_equal(trace_load(&back, path, err, sizeof(err)), 0);
    assert_int_equal(back.n_blocks, t.n_blocks);
    for (uint32_t b = 0; b < t.n_blocks; b++)
        if (back.tolerance[b] != t.tolerance[b])
            fail_msg("block %u: tolerance %.9g saved, %.9g read back", b, t.tolerance[b], back.tolerance[b]);
    trace_free(&t);
    trace_free(&back);
}

/* A NUL byte anywhere in a line, not only at its start, is refused. */
static void test_a_nul_byte_is_refused(void **state)
{
    (void)state;
    const char *path = scratch_path("nul.trace");
    FILE *f = fopen(path, "w");
    assert_non_null(f);
    fwrite("0 0\n1 2\0 3\n", 1, 11, f);
    assert_int_equal(fclose(f), 0);
    trace t;
    trace_init(&t);
    char err[512];
    assert_int_equal(trace_load(&t, path, err, sizeof(err)), -1);
    assert_non_null(strstr(err, "nul.trace:2: not text"));
    trace_free(&t);
}

/* The by-position order walks the blocks of a range of a sequence, with
 * range ends past 2^32 - 1 taken as they are, not wrapped. */
static void test_blocks_by_position(void **state)
{
    (void)state;
    trace t;
    trace_init(&t);
    assert_int_equal(trace_add(&t, 5, UINT32_MAX, 0, 0.5f), 0);
    assert_int_equal(trace_add(&t, 5, 0, 0, 0.5f), 0);
    assert_int_equal(trace_add(&t, 2, 9, 0, 0.5f), 0);
    assert_int_equal(trace_add(&t, 5, 300, 0, 0.5f), 0);
    assert_int_equal(trace_add(&t, UINT32_MAX, 0, 0, 0.5f), 0);
    trace_position *p = trace_blocks_by_position(&t);
    assert_non_null(p);
    size_t n = t.n_blocks;
    assert_int_equal(n, 5);
    assert_int_equal(p[0].seq, 2);
    assert_int_equal(p[1].block, 1); /* (5, 0) */
    assert_int_equal(p[2].block, 3); /* (5, 300) */
    assert_int_equal(p[3].block, 0); /* (5, 2^32 - 1) */
    assert_int_equal(p[4].seq, UINT32_MAX);
    /* Seq 5 from index 1 on: (5, 300) and (5, 2^32 - 1), then seq 2^32 - 1. */
    assert_int_equal(trace_position_at(p, n, 5, 1), 2);
    assert_int_equal(trace_position_at(p, n, 5, (uint64_t)UINT32_MAX + 1), 4);
    assert_int_equal(trace_position_at(p, n, 5, UINT32_MAX), 3);
    assert_int_equal(trace_position_at(p, n, 3, 0), 1);
    assert_int_equal(trace_position_at(p, n, UINT32_MAX, (uint64_t)UINT32_MAX + 1), 5);
    free(p);
    trace_free(&t);
}

int main(void)
{
    const struct CMUnitTest tests[] = {
        cmocka_unit_test(test_sequence_ids_take_every_32_bit_value),
        cmocka_unit_test(test_every_handle_names_one_block),
        cmocka_unit_test(test_long_lines_are_read_whole),
        cmocka_unit_test(test_a_line_too_long_is_named),
        cmocka_unit_test(test_malformed_fields_are_refused),
        cmocka_unit_test(test_a_nul_byte_is_refused),
        cmocka_unit_test(test_malformed_demo_lines_are_refused),
        cmocka_unit_test(test_a_file_of_both_forms_is_refused),
        cmocka_unit_test(test_a_saved_trace_keeps_every_tolerance),
        cmocka_unit_test(test_blocks_by_position),
    };
    return cmocka_run_group_tests_name("trace", tests, NULL, NULL);
}
