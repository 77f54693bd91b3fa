/* kvh-store remote ACTION [--sample N] [--json]: the remote tier's keys of
 * the model and geometry the KVH_* environment describes (the variables of
 * kvh_config_from_env: KVH_REMOTE_ADDRS, KVH_REMOTE_PASSWORD, KVH_NUM_LAYERS,
 * KVH_MODEL_SALT, KVH_KV_CODEC, ...).
 *   ping     nodes that own slots, and how many answer
 *   count    keys of the model
 *   verify   reads up to N keys (default 64) and checks each value on its
 *            own (length, checksums, geometry); exit 1 if any is bad
 *   purge    deletes every key of the model */
#include "tools/kvh_store_remote.h"

#include <errno.h>
#include <stdbool.h>
#include <stdint.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "core/config_names.h"
#include "core/engine.h"
#include "core/remote_cluster.h"
#include "core/remote_tier.h"

#define BATCH 64

typedef struct keys {
    char (*key)[KVHI_REMOTE_KEY_BYTES];
    size_t n, cap, limit;
} keys;

static int collect(void *user, const char *key, size_t len)
{
    keys *k = user;
    if (len != KVHI_REMOTE_KEY_LEN)
        return 0; /* not one of ours, whatever the prefix says */
    if (k->n == k->cap) {
        size_t cap = k->cap ? 2 * k->cap : 256;
        void *more = realloc(k->key, cap * KVHI_REMOTE_KEY_BYTES);
        if (!more)
            return 1;
        k->key = more;
        k->cap = cap;
    }
    memcpy(k->key[k->n], key, len);
    k->key[k->n][len] = '\0';
    k->n++;
    return k->limit && k->n >= k->limit;
}

/* Runs one verb over keys [first, first + n): DEL or GET. */
static void run_keys(kvhi_remote *r, const char *verb, keys *k, size_t first, size_t n, kvhi_cluster_cmd *cmds)
{
    for (size_t i = 0; i < n; i++) {
        memset(&cmds[i], 0, sizeof(cmds[i]));
        cmds[i].argc = 2;
        cmds[i].argv[0] = verb;
        cmds[i].argvlen[0] = strlen(verb);
        cmds[i].argv[1] = k->key[first + i];
        cmds[i].argvlen[1] = KVHI_REMOTE_KEY_LEN;
    }
    kvhi_cluster_report rep;
    kvhi_cluster_run(r->cluster, cmds, n, &rep);
}

static const char remote_usage[] = "usage: kvh-store remote ping|count|verify|purge [--sample N] [--json]\n"
                                   "(the cluster and the model from KVH_REMOTE_ADDRS, KVH_MODEL_SALT, ...)\n";

int kvh_store_remote_main(int argc, char **argv)
{
    for (int i = 2; i < argc; i++)
        if (!strcmp(argv[i], "--help") || !strcmp(argv[i], "-h")) {
            fputs(remote_usage, stdout);
            return 0;
        }
    /* The action is the first argument that is not an option: options
     * may come before or after it. */
    const char *action = NULL;
    bool json = false;
    size_t sample = 64;
    for (int i = 2; i < argc; i++) {
        if (!action && argv[i][0] != '-')
            action = argv[i];
        else if (!strcmp(argv[i], "--json"))
            json = true;
        else if (!strcmp(argv[i], "--sample")) {
            if (i + 1 >= argc) {
                fprintf(stderr, "kvh-store remote: --sample needs a value\n");
                return 2;
            }
            const char *v = argv[++i];
            char *end;
            errno = 0;
            unsigned long long n = strtoull(v, &end, 10);
            /* strtoull takes "-1" as ULLONG_MAX and 0 is the scan's "no
             * limit": either would read every key instead of a sample. */
            if (end == v || *end || errno || v[strspn(v, " \t")] == '-' || n == 0 || n > SIZE_MAX) {
                fprintf(stderr, "kvh-store remote: --sample must be a whole number >= 1, got '%s'\n", v);
                return 2;
            }
            sample = (size_t)n;
        } else {
            fprintf(stderr, "kvh-store remote: unknown argument %s\n", argv[i]);
            return 2;
        }
    }
    if (!action)
        action = "";
    if (strcmp(action, "ping") && strcmp(action, "count") && strcmp(action, "verify") && strcmp(action, "purge")) {
        fputs(remote_usage, stderr);
        return 2;
    }
    kvh_config cfg;
    kvh_config_init(&cfg, sizeof(cfg));
    if (kvh_config_from_env(&cfg, sizeof(cfg), NULL) != KVH_OK) {
        fprintf(stderr, "kvh-store remote: %s\n", kvh_last_error());
        return 2;
    }
    /* The geometry names the model's keys: one no engine opens with
     * (block_tokens 3, 0 layers) names none, and "0 key(s)" would read as
     * an empty tier. ping looks at the nodes only. */
    const char *field = NULL;
    if (strcmp(action, "ping") && kvhi_config_check_geometry(&cfg, &field) != KVH_OK) {
        const char *var = field ? kvhi_config_env_var(field) : NULL;
        fprintf(stderr, "kvh-store remote: %s%s%s\n", var ? var : "", var ? ": " : "", kvh_last_error());
        return 2;
    }
    if (!cfg.remote_addrs || !cfg.remote_addrs[0]) {
        fprintf(stderr, "kvh-store remote: set KVH_REMOTE_ADDRS (host:port of a cluster node)\n");
        return 2;
    }
    kvhi_remote *r;
    if (kvhi_remote_open_client(&cfg, &r) != KVH_OK) {
        fprintf(stderr, "kvh-store remote: %s\n", kvh_last_error());
        return 2;
    }
    char prefix[KVHI_REMOTE_MODEL_PREFIX_LEN + 1], err[256] = "";
    kvhi_remote_model_prefix(prefix, &r->id);
    int rc = 0;
    if (!strcmp(action, "ping")) {
        uint32_t up = 0, known = 0;
        kvhi_cluster_health(r->cluster, &up, &known);
        rc = known && up == known ? 0 : 1;
        if (rc) /* why it failed, where a wrapper looks for it (stdout may be JSON) */
            fprintf(stderr, "kvh-store remote ping: %u of %u node(s) answer\n", up, known);
        if (json)
            printf("{\"nodes\": %u, \"answering\": %u}\n", known, up);
        else
            printf("remote tier %s: %u of %u node(s) answer\n", cfg.remote_addrs, up, known);
        kvhi_remote_close_client(r);
        return rc;
    }
    /* A scan of no answering node finds no keys: say so rather than
     * report an empty tier, or a partial count as the whole. */
    uint32_t up = 0, known = 0;
    kvhi_cluster_health(r->cluster, &up, &known);
    if (!known || up != known) {
        if (!known)
            fprintf(stderr, "kvh-store remote: no node of %s answers\n", cfg.remote_addrs);
        else
            fprintf(stderr, "kvh-store remote: only %u of %u node(s) of %s answer\n", up, known, cfg.remote_addrs);
        kvhi_remote_close_client(r);
        return 1;
    }
    keys k = {.limit = !strcmp(action, "verify") ? sample : 0};
    /* A node that could not be scanned leaves its keys out: what follows
     * covers the keys found, and says it is partial. */
    bool partial = kvhi_cluster_scan(r->cluster, prefix, collect, &k, err, sizeof(err)) != 0;
    if (partial) {
        fprintf(stderr, "kvh-store remote: %s\n", err);
        rc = 2;
    }
    kvhi_cluster_cmd cmds[BATCH];
    size_t bad = 0, deleted = 0;
    if (!strcmp(action, "verify")) {
        for (size_t i = 0; i < k.n; i += BATCH) {
            size_t n = k.n - i < BATCH ? k.n - i : BATCH;
            run_keys(r, "GET", &k, i, n, cmds);
            for (size_t j = 0; j < n; j++) {
                const char *val = NULL, *why = "no answer";
                size_t len = 0;
                int kind = kvhi_cluster_reply(&cmds[j], &val, &len, NULL);
                if (kind == KVHI_REPLY_NIL)
                    continue; /* expired or evicted since the scan */
                if (cmds[j].result == KVHI_CMD_TOO_LARGE)
                    why = "a value longer than a block's";
                if (kind != KVHI_REPLY_STRING || kvhi_remote_value_check_alone(val, len, &r->id, NULL, &why) != 0) {
                    bad++;
                    if (!json)
                        printf("bad: %s: %s\n", k.key[i + j], why);
                }
            }
            kvhi_cluster_cmds_clear(r->cluster, cmds, n);
        }
        if (bad) {
            rc = rc ? rc : 1;
            fprintf(stderr, "kvh-store remote verify: %zu of %zu sampled value(s) bad\n", bad, k.n);
        }
    } else if (!strcmp(action, "purge")) {
        for (size_t i = 0; i < k.n; i += BATCH) {
            size_t n = k.n - i < BATCH ? k.n - i : BATCH;
            run_keys(r, "DEL", &k, i, n, cmds);
            for (size_t j = 0; j < n; j++) {
                long long v = 0;
                if (kvhi_cluster_reply(&cmds[j], NULL, NULL, &v) == KVHI_REPLY_INTEGER)
                    deleted += (size_t)v;
            }
            kvhi_cluster_cmds_clear(r->cluster, cmds, n);
        }
    }
    const char *scope = partial ? " (partial: a node could not be scanned)" : "";
    if (json)
        printf("{\"prefix\": \"%s\", \"keys\": %zu, \"bad\": %zu, \"deleted\": %zu, \"partial\": %s}\n", prefix, k.n,
               bad, deleted, partial ? "true" : "false");
    else if (!strcmp(action, "count"))
        printf("%s*: %zu key(s)%s\n", prefix, k.n, scope);
    else if (!strcmp(action, "verify"))
        printf("%s*: %zu key(s) checked, %zu bad%s\n", prefix, k.n, bad, scope);
    else
        printf("%s*: %zu key(s) deleted%s\n", prefix, deleted, scope);
    free(k.key);
    kvhi_remote_close_client(r);
    return rc;
}
