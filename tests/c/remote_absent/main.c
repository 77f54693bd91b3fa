/* Run against a libkvh built with KVH_WITH_REMOTE=OFF
 * (check_remote_absent.cmake): an engine opens and works without the
 * remote tier, and one asking for a remote tier is refused with
 * KVH_ERR_UNSUPPORTED and a message naming the missing package. */
#include <stdio.h>
#include <string.h>

#include <kvh/kvh.h>

static int open_engine(const char *remote_addrs, kvh_engine **e)
{
    kvh_config c;
    if (kvh_config_init(&c, sizeof(c)) != KVH_OK)
        return -1;
    c.backend = KVH_BACKEND_CPU;
    c.device_bytes = 1 << 20;
    c.host_bytes = 1 << 20;
    c.remote_addrs = remote_addrs;
    return (int)kvh_engine_open(&c, e);
}

int main(void)
{
    kvh_engine *e = NULL;
    int st = open_engine(NULL, &e);
    if (st != KVH_OK) {
        fprintf(stderr, "plain open: %s (%s)\n", kvh_status_name(st), kvh_last_error());
        return 1;
    }
    kvh_seq s;
    int32_t tokens[40] = {0};
    uint64_t n = 0;
    if (kvh_seq_create(e, 0, &s) != KVH_OK || kvh_seq_append(e, s, tokens, 40) != KVH_OK ||
        kvh_seq_length(e, s, &n) != KVH_OK || n != 40 || kvh_engine_close(e) != KVH_OK) {
        fprintf(stderr, "engine without a remote tier: %s\n", kvh_last_error());
        return 1;
    }

    e = NULL;
    st = open_engine("127.0.0.1:6379", &e);
    const char *why = kvh_last_error();
    if (st != KVH_ERR_UNSUPPORTED || e != NULL || !strstr(why, "libhiredis-dev")) {
        fprintf(stderr, "remote open: %s (%s), engine %p\n", kvh_status_name(st), why, (void *)e);
        return 1;
    }
    printf("no remote tier: %s\n", why);
    return 0;
}
