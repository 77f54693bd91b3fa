/* Helpers of the weight-context tests (test_context.c,
 * test_context_hostile.c, test_weight_spill.c): weight files, snapshots of the engine's weight counters and of
 * one context's residency. Include after test_util.h. */
#ifndef KVH_TESTS_CONTEXT_TEST_UTIL_H
#define KVH_TESTS_CONTEXT_TEST_UTIL_H

#include <fcntl.h>
#include <string.h>
#include <unistd.h>

#include "test_util.h"

/* A weight file of `bytes` pseudo-random bytes from seed at path; returns
 * its contents. */
static inline uint8_t *ct_write_weights(const char *path, uint64_t seed, size_t bytes)
{
    uint8_t *b = tu_alloc(bytes);
    tu_rng r = {seed};
    tu_fill(&r, b, bytes);
    int fd = open(path, O_WRONLY | O_CREAT | O_TRUNC, 0600);
    assert_true(fd >= 0);
    assert_int_equal(write(fd, b, bytes), bytes);
    close(fd);
    return b;
}

static inline kvh_weight_stats ct_weight_stats(kvh_engine *e)
{
    kvh_weight_stats s;
    memset(&s, 0, sizeof(s));
    s.struct_size = sizeof(s);
    assert_ok(kvh_weight_stats_get(e, &s));
    return s;
}

static inline kvh_context_info ct_context_info(kvh_engine *e, kvh_context c)
{
    kvh_context_info i;
    memset(&i, 0, sizeof(i));
    i.struct_size = sizeof(i);
    assert_ok(kvh_context_info_get(e, c, &i));
    return i;
}

#endif
