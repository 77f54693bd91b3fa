/* Opens an engine on the CPU backend, appends tokens to a sequence and
 * prints the library version and the sequence length. */
#include <stdio.h>

#include <kvh/kvh.h>

#define CHECK(call)                                                                                                    \
    do {                                                                                                               \
        kvh_status st_ = (call);                                                                                       \
        if (st_ != KVH_OK) {                                                                                           \
            fprintf(stderr, "%s: %s (%s)\n", #call, kvh_status_name(st_), kvh_last_error());                           \
            return 1;                                                                                                  \
        }                                                                                                              \
    } while (0)

int main(void)
{
    kvh_config c;
    CHECK(kvh_config_init(&c, sizeof(c)));
    c.backend = KVH_BACKEND_CPU;
    c.device_bytes = 1 << 20;
    c.host_bytes = 1 << 20;
    kvh_engine *e = NULL;
    CHECK(kvh_engine_open(&c, &e));
    kvh_seq s;
    CHECK(kvh_seq_create(e, 0, &s));
    int32_t tokens[40];
    for (int i = 0; i < 40; i++)
        tokens[i] = i;
    CHECK(kvh_seq_append(e, s, tokens, 40));
    uint64_t n = 0;
    CHECK(kvh_seq_length(e, s, &n));
    CHECK(kvh_seq_free(e, s));
    CHECK(kvh_engine_close(e));
    printf("kvh %s: %llu tokens\n", kvh_version_string(), (unsigned long long)n);
    return n == 40 ? 0 : 1;
}
