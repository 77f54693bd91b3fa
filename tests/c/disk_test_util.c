/* The functions of disk_test_util.h (see there for what each does),
 * compiled once into the test library (tests/c/CMakeLists.txt). With
 * RL_ALLOC_WRAP defined (the library variant of the test programs that
 * wrap the allocator) the test's own buffers come from __real_malloc. */
#include "disk_test_util.h"

_Thread_local char dt_err[512];

static kvh_engine *dt_engines[DT_MAX_ENGINES];

/* ---- random numbers and deterministic content ---- */

uint64_t dt_seed(uint64_t def)
{
    const char *s = getenv("KVH_TEST_SEED");
    return s && *s ? strtoull(s, NULL, 0) : def;
}

long dt_env_long(const char *name, long def)
{
    const char *s = getenv(name);
    return s && *s ? strtol(s, NULL, 0) : def;
}

double dt_now(void)
{
    struct timespec ts;
    clock_gettime(CLOCK_MONOTONIC, &ts);
    return (double)ts.tv_sec + (double)ts.tv_nsec * 1e-9;
}

void dt_sleep_ms(double ms)
{
    if (ms <= 0)
        return;
    struct timespec ts = {(time_t)(ms / 1000), (long)((ms - (double)(time_t)(ms / 1000) * 1000) * 1e6)};
    while (nanosleep(&ts, &ts) != 0 && errno == EINTR) {
    }
}

void dt_tokens(dt_content c, uint64_t first, size_t n, int32_t *out)
{
    for (size_t i = 0; i < n; i++)
        out[i] = dt_token(c, first + i);
}

void dt_kv_token(dt_content c, uint32_t layer, uint64_t pos, int kv, uint8_t *out, size_t tok_bytes)
{
    uint64_t s =
        dt_mix(dt_stream_at(c, pos) * 0x2545f4914f6cdd1dull ^ ((uint64_t)layer << 40) ^ (pos << 1) ^ (uint64_t)kv);
    for (size_t i = 0; i < tok_bytes; i += 8) {
        uint64_t v = dt_mix(s + i);
        memcpy(out + i, &v, tok_bytes - i < 8 ? tok_bytes - i : 8);
    }
}

/* ---- engine geometry ---- */

kvh_config dt_cfg(dt_geo g, const char *dir, uint64_t dev_blocks, uint64_t host_blocks, uint64_t disk_slots,
                  uint32_t threads)
{
    kvh_config c;
    kvh_config_init(&c, sizeof(c));
    c.num_layers = g.layers;
    c.num_kv_heads = g.heads;
    c.head_dim = g.dim;
    c.block_tokens = g.bt;
    c.dtype = g.dtype;
    c.backend = KVH_BACKEND_CPU;
    c.device_bytes = dev_blocks * dt_block_bytes(g);
    c.host_bytes = host_blocks * dt_block_bytes(g);
    c.disk_bytes = disk_slots * dt_slot_bytes(g);
    c.disk_path = disk_slots ? dir : NULL;
    c.model_salt = 0x5eed;
    c.migration_threads = threads;
    return c;
}

/* ---- engines closed by the teardown even when a test fails ---- */

kvh_engine *dt_track(kvh_engine *e)
{
    for (int i = 0; e && i < DT_MAX_ENGINES; i++)
        if (!dt_engines[i]) {
            dt_engines[i] = e;
            break;
        }
    return e;
}

kvh_engine *dt_untrack(kvh_engine *e)
{
    for (int i = 0; e && i < DT_MAX_ENGINES; i++)
        if (dt_engines[i] == e)
            dt_engines[i] = NULL;
    return e;
}

kvh_engine *dt_open_a_(const kvh_config *c, const char *file, int line)
{
    kvh_engine *e = NULL;
    kvh_status st = kvh_engine_open(c, &e);
    if (st != KVH_OK) {
        print_error("%s:%d: kvh_engine_open returned %s: %s\n", file, line, kvh_status_name(st), kvh_last_error());
        _fail(file, line);
    }
    return dt_track(e);
}

kvh_status dt_close(kvh_engine *e) { return kvh_engine_close(dt_untrack(e)); }

int dt_teardown(void **state)
{
    (void)state;
    for (int i = 0; i < DT_MAX_ENGINES; i++)
        if (dt_engines[i]) {
            kvh_engine_close(dt_engines[i]);
            dt_engines[i] = NULL;
        }
    return 0;
}

/* ---- building and checking sequences (non-asserting) ---- */

kvh_status dt_keep(kvh_status st)
{
    if (st != KVH_OK)
        snprintf(dt_err, sizeof(dt_err), "%s", kvh_last_error());
    return st;
}

kvh_status dt_extend(kvh_engine *e, kvh_seq s, dt_geo g, dt_content c, uint64_t first, size_t n)
{
    size_t tb = dt_tok_bytes(g);
    int32_t *tk = dt_tmalloc(sizeof(int32_t) * (n ? n : 1));
    uint8_t *k = dt_tmalloc(tb * (n ? n : 1)), *v = dt_tmalloc(tb * (n ? n : 1));
    kvh_status st = tk && k && v ? KVH_OK : KVH_ERR_NOMEM;
    if (st == KVH_OK) {
        dt_tokens(c, first, n, tk);
        st = dt_keep(kvh_seq_append(e, s, tk, n));
    }
    for (uint32_t l = 0; st == KVH_OK && l < g.layers; l++) {
        for (size_t t = 0; t < n; t++) {
            dt_kv_token(c, l, first + t, 0, k + t * tb, tb);
            dt_kv_token(c, l, first + t, 1, v + t * tb, tb);
        }
        st = dt_keep(kvh_seq_write_kv(e, s, l, first, n, k, v));
    }
    free(tk);
    free(k);
    free(v);
    return st;
}

kvh_status dt_build(kvh_engine *e, dt_geo g, dt_content c, size_t n, uint32_t agent, kvh_seq *out)
{
    kvh_seq s = {0};
    kvh_status st = dt_keep(kvh_seq_create(e, agent, &s));
    if (st != KVH_OK)
        return st;
    if ((st = dt_extend(e, s, g, c, 0, n)) != KVH_OK) {
        kvh_seq_free(e, s);
        return st;
    }
    *out = s;
    return KVH_OK;
}

kvh_status dt_verify(kvh_engine *e, kvh_seq s, dt_geo g, dt_content c, uint64_t pos, size_t n, char *msg,
                     size_t msg_len)
{
    size_t tb = dt_tok_bytes(g);
    int32_t *tk = dt_tmalloc(sizeof(int32_t) * (n ? n : 1));
    uint8_t *k = dt_tmalloc(tb * (n ? n : 1)), *v = dt_tmalloc(tb * (n ? n : 1)), *want = dt_tmalloc(tb);
    kvh_status st = tk && k && v && want ? KVH_OK : KVH_ERR_NOMEM;
    if (st == KVH_OK && n && (st = kvh_seq_tokens(e, s, pos, n, tk)) == KVH_OK) {
        for (size_t t = 0; t < n; t++)
            if (tk[t] != dt_token(c, pos + t)) {
                if (msg)
                    snprintf(msg, msg_len, "token id at %" PRIu64 " differs", pos + t);
                st = KVH_ERR_INTERNAL;
                break;
            }
    } else if (st != KVH_OK && msg)
        snprintf(msg, msg_len, "kvh_seq_tokens: %s: %s", kvh_status_name(st), kvh_last_error());
    for (uint32_t l = 0; st == KVH_OK && n && l < g.layers; l++) {
        memset(k, 0xA5, tb * n);
        memset(v, 0x5A, tb * n);
        st = kvh_seq_read_kv(e, s, l, pos, n, k, v);
        if (st != KVH_OK) {
            if (msg)
                snprintf(msg, msg_len, "read_kv(layer %u, pos %" PRIu64 ", n %zu): %s: %s", l, pos, n,
                         kvh_status_name(st), kvh_last_error());
            break;
        }
        for (size_t t = 0; t < n && st == KVH_OK; t++)
            for (int kv = 0; kv < 2; kv++) {
                dt_kv_token(c, l, pos + t, kv, want, tb);
                if (memcmp((kv ? v : k) + t * tb, want, tb) != 0) {
                    if (msg)
                        snprintf(msg, msg_len, "%s of layer %u token %" PRIu64 " differs (stream %" PRIu64 ")",
                                 kv ? "V" : "K", l, pos + t, dt_stream_at(c, pos + t));
                    st = KVH_ERR_INTERNAL;
                    break;
                }
            }
    }
    free(tk);
    free(k);
    free(v);
    free(want);
    return st;
}

kvh_status dt_match(kvh_engine *e, dt_content c, size_t n, kvh_seq *seq, size_t *matched)
{
    int32_t *tk = dt_tmalloc(sizeof(int32_t) * (n ? n : 1));
    if (!tk)
        return KVH_ERR_NOMEM;
    dt_tokens(c, 0, n, tk);
    kvh_seq s = {0};
    kvh_status st = kvh_seq_create(e, 0, &s);
    if (st == KVH_OK) {
        st = kvh_seq_match_prefix(e, s, tk, n, matched);
        if (st != KVH_OK)
            kvh_seq_free(e, s);
        else
            *seq = s;
    }
    free(tk);
    return st;
}

kvh_status dt_match_verify(kvh_engine *e, dt_geo g, dt_content c, size_t n, size_t *matched, char *msg, size_t msg_len)
{
    kvh_seq s;
    size_t m = 0;
    *matched = 0;
    kvh_status st = dt_match(e, c, n, &s, &m);
    if (st != KVH_OK) {
        if (msg)
            snprintf(msg, msg_len, "match_prefix: %s: %s", kvh_status_name(st), kvh_last_error());
        return st;
    }
    if (m % g.bt != 0 || m > n) {
        if (msg)
            snprintf(msg, msg_len, "match_prefix matched %zu of %zu tokens (block_tokens %u)", m, n, g.bt);
        st = KVH_ERR_INTERNAL;
    } else
        st = dt_verify(e, s, g, c, 0, m, msg, msg_len);
    kvh_seq_free(e, s);
    *matched = m;
    return st;
}

kvh_stats dt_stats(kvh_engine *e)
{
    kvh_stats s;
    memset(&s, 0, sizeof(s));
    s.struct_size = sizeof(s);
    kvh_engine_stats(e, &s);
    return s;
}

kvh_tier_info dt_tier(kvh_engine *e, uint32_t tier)
{
    kvh_tier_info t;
    memset(&t, 0, sizeof(t));
    t.struct_size = sizeof(t);
    kvh_tier_info_get(e, tier, &t);
    return t;
}

kvh_block_info dt_binfo(kvh_engine *e, kvh_seq s, uint64_t i)
{
    kvh_block b = {0};
    kvh_block_info info;
    memset(&info, 0, sizeof(info));
    info.struct_size = sizeof(info);
    info.tier = UINT32_MAX;
    if (kvh_seq_blocks(e, s, i, 1, &b) == KVH_OK)
        kvh_block_info_get(e, b, &info);
    return info;
}

/* ---- log capture ---- */

void dt_log_fn(void *user, int32_t level, const char *message)
{
    dt_log *l = user;
    pthread_mutex_lock(&l->mu);
    if (l->n < DT_LOG_MAX) {
        l->level[l->n] = level;
        snprintf(l->line[l->n], sizeof(l->line[0]), "%s", message);
        l->n++;
    }
    pthread_mutex_unlock(&l->mu);
}

void dt_log_init(dt_log *l)
{
    memset(l, 0, sizeof(*l));
    pthread_mutex_init(&l->mu, NULL);
}

void dt_log_attach(kvh_config *c, dt_log *l)
{
    c->log_fn = dt_log_fn;
    c->log_user = l;
    c->log_level = KVH_LOG_WARN;
}

int dt_log_count(dt_log *l, int max_level, ...)
{
    int count = 0;
    pthread_mutex_lock(&l->mu);
    for (int i = 0; i < l->n; i++) {
        if (l->level[i] > max_level)
            continue;
        va_list ap;
        va_start(ap, max_level);
        bool all = true;
        for (const char *s; (s = va_arg(ap, const char *)) != NULL;)
            all &= strcasestr(l->line[i], s) != NULL;
        va_end(ap);
        count += all;
    }
    pthread_mutex_unlock(&l->mu);
    return count;
}

/* ---- scratch directories and files ---- */

int dt_rmrf(const char *path)
{
    /* A link is removed, never followed into what it names. */
    struct stat top;
    if (lstat(path, &top) == 0 && S_ISLNK(top.st_mode))
        return unlink(path) == 0 ? 0 : -errno;
    DIR *d = opendir(path);
    if (!d)
        return errno == ENOENT ? 0 : (unlink(path) == 0 ? 0 : -errno);
    struct dirent *de;
    char sub[PATH_MAX];
    while ((de = readdir(d)) != NULL) {
        if (!strcmp(de->d_name, ".") || !strcmp(de->d_name, ".."))
            continue;
        if (snprintf(sub, sizeof(sub), "%s/%s", path, de->d_name) >= (int)sizeof(sub))
            continue;
        struct stat st;
        if (lstat(sub, &st) == 0 && S_ISDIR(st.st_mode))
            dt_rmrf(sub);
        else
            unlink(sub);
    }
    closedir(d);
    return rmdir(path) == 0 ? 0 : -errno;
}

void dt_scratch(const char *name, char *out, size_t len)
{
    const char *root = getenv("KVH_TEST_TMPDIR");
    char fallback[128];
    if (!root || !*root) {
        snprintf(fallback, sizeof(fallback), "/tmp/kvh-tests.%ld", (long)getpid());
        mkdir(fallback, 0755);
        root = fallback;
    }
    mkdir(root, 0755);
    snprintf(out, len, "%s/%s", root, name);
    dt_rmrf(out);
    mkdir(out, 0755);
}

void dt_scratch_mountpoint(const char *name, char *out, size_t len)
{
    dt_scratch(name, out, len);
    for (int i = 0; i < 8 && umount2(out, MNT_DETACH) == 0; i++)
        ;
    dt_rmrf(out);
    mkdir(out, 0755);
}

char *dt_path(char *buf, size_t len, const char *dir, const char *name)
{
    if (snprintf(buf, len, "%s/%s", dir, name) >= (int)len)
        buf[len - 1] = '\0';
    return buf;
}

uint8_t *dt_read_file(const char *path, size_t *len)
{
    int fd = open(path, O_RDONLY | O_CLOEXEC);
    if (fd < 0)
        return NULL;
    struct stat st;
    if (fstat(fd, &st) != 0) {
        close(fd);
        return NULL;
    }
    uint8_t *buf = dt_tmalloc((size_t)st.st_size + 1);
    size_t got = 0;
    while (buf && got < (size_t)st.st_size) {
        ssize_t n = pread(fd, buf + got, (size_t)st.st_size - got, (off_t)got);
        if (n <= 0) {
            free(buf);
            buf = NULL;
            break;
        }
        got += (size_t)n;
    }
    close(fd);
    if (buf)
        *len = got;
    return buf;
}

int dt_write_file(const char *path, const void *data, size_t len)
{
    int fd = open(path, O_WRONLY | O_CREAT | O_TRUNC | O_CLOEXEC, 0644);
    if (fd < 0)
        return -errno;
    size_t done = 0;
    while (done < len) {
        ssize_t n = pwrite(fd, (const uint8_t *)data + done, len - done, (off_t)done);
        if (n <= 0) {
            close(fd);
            return -EIO;
        }
        done += (size_t)n;
    }
    close(fd);
    return 0;
}

int dt_flip_bit(const char *path, uint64_t off, unsigned bit)
{
    int fd = open(path, O_RDWR | O_CLOEXEC);
    if (fd < 0)
        return -errno;
    uint8_t b;
    int rc = pread(fd, &b, 1, (off_t)off) == 1 ? 0 : -EIO;
    b ^= (uint8_t)(1u << (bit & 7));
    if (rc == 0 && pwrite(fd, &b, 1, (off_t)off) != 1)
        rc = -EIO;
    close(fd);
    return rc;
}

int dt_store_save(const char *dir, dt_saved_store *s)
{
    memset(s, 0, sizeof(*s));
    DIR *d = opendir(dir);
    if (!d)
        return -errno;
    struct dirent *de;
    char p[PATH_MAX];
    while ((de = readdir(d)) != NULL && s->n < 16) {
        if (de->d_name[0] == '.')
            continue;
        dt_saved_file *f = &s->f[s->n];
        if (snprintf(f->name, sizeof(f->name), "%s", de->d_name) >= (int)sizeof(f->name))
            continue;
        f->data = dt_read_file(dt_path(p, sizeof(p), dir, de->d_name), &f->len);
        if (f->data)
            s->n++;
    }
    closedir(d);
    return 0;
}

int dt_store_restore(const char *dir, const dt_saved_store *s)
{
    DIR *d = opendir(dir);
    if (!d)
        return -errno;
    struct dirent *de;
    char p[PATH_MAX];
    while ((de = readdir(d)) != NULL) {
        if (de->d_name[0] == '.')
            continue;
        bool keep = false;
        for (int i = 0; i < s->n; i++)
            keep |= !strcmp(s->f[i].name, de->d_name);
        if (!keep)
            unlink(dt_path(p, sizeof(p), dir, de->d_name));
    }
    closedir(d);
    for (int i = 0; i < s->n; i++) {
        int rc = dt_write_file(dt_path(p, sizeof(p), dir, s->f[i].name), s->f[i].data, s->f[i].len);
        if (rc)
            return rc;
    }
    return 0;
}

const dt_saved_file *dt_store_file(const dt_saved_store *s, const char *name)
{
    for (int i = 0; i < s->n; i++)
        if (!strcmp(s->f[i].name, name))
            return &s->f[i];
    return NULL;
}

void dt_store_free(dt_saved_store *s)
{
    for (int i = 0; i < s->n; i++)
        free(s->f[i].data);
    memset(s, 0, sizeof(*s));
}

int dt_slab_direct(const char *dir)
{
    char want[PATH_MAX], real[PATH_MAX];
    if (!realpath(dir, real) || snprintf(want, sizeof(want), "%s/slab-0000.kvh", real) >= (int)sizeof(want))
        return -1;
    DIR *d = opendir("/proc/self/fd");
    if (!d)
        return -1;
    int result = -1;
    struct dirent *de;
    while (result < 0 && (de = readdir(d)) != NULL) {
        char link[64], target[PATH_MAX];
        if (de->d_name[0] == '.' || snprintf(link, sizeof(link), "/proc/self/fd/%s", de->d_name) >= (int)sizeof(link))
            continue;
        ssize_t n = readlink(link, target, sizeof(target) - 1);
        if (n <= 0)
            continue;
        target[n] = '\0';
        if (strcmp(target, want) != 0)
            continue;
        char info[64];
        if (snprintf(info, sizeof(info), "/proc/self/fdinfo/%s", de->d_name) >= (int)sizeof(info))
            continue;
        FILE *f = fopen(info, "r");
        char line[128];
        while (f && fgets(line, sizeof(line), f))
            if (!strncmp(line, "flags:", 6)) {
                unsigned long flags = strtoul(line + 6, NULL, 8);
                result = (flags & O_DIRECT) ? 1 : 0;
                break;
            }
        if (f)
            fclose(f);
    }
    closedir(d);
    return result;
}

/* ---- child processes ---- */

/* The handler dt_child_signals installs: a backtrace, then the signal's
 * default action. */
static void dt_crash_handler(int sig)
{
    void *frames[64];
    int n = backtrace(frames, 64);
    char head[96];
    int len = snprintf(head, sizeof(head), "\n*** child %ld: signal %d (%s); backtrace:\n", (long)getpid(), sig,
                       strsignal(sig));
    if (len > 0 && write(2, head, (size_t)len) < 0)
        _exit(128 + sig);
    backtrace_symbols_fd(frames, n, 2);
    signal(sig, SIG_DFL);
    raise(sig);
}

void dt_child_signals(void)
{
    int sigs[] = {SIGSEGV, SIGBUS, SIGABRT, SIGILL, SIGFPE};
    for (size_t i = 0; i < sizeof(sigs) / sizeof(sigs[0]); i++)
        signal(sigs[i], dt_crash_handler);
}

pid_t dt_fork_child(void)
{
    fflush(stdout);
    fflush(stderr);
    pid_t pid = fork();
    if (pid == 0)
        dt_child_signals();
    return pid;
}

int dt_reap(pid_t pid)
{
    int ws;
    while (waitpid(pid, &ws, 0) < 0)
        if (errno != EINTR)
            return -1;
    return ws;
}

int dt_in_child(int (*fn)(void *), void *arg)
{
    pid_t pid = dt_fork_child();
    if (pid < 0)
        return -1;
    if (pid == 0)
        _exit(fn(arg));
    int ws = dt_reap(pid);
    return ws < 0 ? -1 : WIFEXITED(ws) ? WEXITSTATUS(ws) : WIFSIGNALED(ws) ? 128 + WTERMSIG(ws) : -1;
}

void dt_print_file(const char *path, const char *what)
{
    size_t len = 0;
    uint8_t *b = dt_read_file(path, &len);
    if (b && len) {
        b[len] = '\0';
        print_error("%s:\n%s\n", what, (char *)b);
    }
    free(b);
}

dt_kill_result dt_kill_child(int (*fn)(void *arg, int ready_fd), void *arg, bool early, int ready_ms, uint64_t delay_us,
                             int *ws)
{
    int rp[2];
    *ws = 0;
    if (pipe(rp) != 0)
        return DT_KILL_NO_FORK;
    pid_t pid = dt_fork_child();
    if (pid < 0) {
        close(rp[0]);
        close(rp[1]);
        return DT_KILL_NO_FORK;
    }
    if (pid == 0) {
        close(rp[0]);
        _exit(fn(arg, rp[1]));
    }
    close(rp[1]);
    if (!early) {
        struct pollfd pf = {rp[0], POLLIN, 0};
        char ch;
        if (!(poll(&pf, 1, ready_ms) == 1 && read(rp[0], &ch, 1) == 1)) {
            kill(pid, SIGKILL);
            *ws = dt_reap(pid);
            close(rp[0]);
            return DT_KILL_NO_READY;
        }
    }
    usleep((useconds_t)delay_us);
    kill(pid, SIGKILL);
    *ws = dt_reap(pid);
    close(rp[0]);
    return WIFSIGNALED(*ws) && WTERMSIG(*ws) == SIGKILL ? DT_KILLED : DT_KILL_EARLY_END;
}

bool dt_kill_failed(dt_kill_result kr, int ws, char *msg, size_t len)
{
    switch (kr) {
    case DT_KILLED:
        return false;
    case DT_KILL_NO_FORK:
        snprintf(msg, len, "no child process: %s", strerror(errno));
        break;
    case DT_KILL_NO_READY:
        snprintf(msg, len, "the child did not open the store (status 0x%x)", ws);
        break;
    case DT_KILL_EARLY_END:
        if (WIFSIGNALED(ws))
            snprintf(msg, len, "the child died of signal %d (%s) (backtrace in its stderr above)", WTERMSIG(ws),
                     strsignal(WTERMSIG(ws)));
        else
            snprintf(msg, len, "the child ended on its own (exit %d) instead of being killed",
                     WIFEXITED(ws) ? WEXITSTATUS(ws) : -1);
        break;
    }
    return true;
}

/* ---- the durability oracle ---- */

void dt_oracle_write(int fd, const char *fmt, ...)
{
    char line[192];
    va_list ap;
    va_start(ap, fmt);
    int n = vsnprintf(line, sizeof(line), fmt, ap);
    va_end(ap);
    if (n > 0 && write(fd, line, (size_t)n) != n)
        _exit(70);
}

int dt_oracle_read(const char *path, dt_oracle *o)
{
    size_t len = 0;
    uint8_t *buf = dt_read_file(path, &len);
    if (!buf)
        return 0;
    int lines = 0;
    size_t start = 0;
    for (size_t i = 0; i < len; i++) {
        if (buf[i] != '\n')
            continue;
        buf[i] = '\0';
        const char *l = (const char *)buf + start;
        start = i + 1;
        unsigned id;
        unsigned long long base, split, own, n, nfull;
        lines++;
        o->last_is_persist = l[0] == 'S';
        if (sscanf(l, "P %u %llu %llu %llu %llu", &id, &base, &split, &own, &n) == 5 && id < DT_ORACLE_MAX_SEQS) {
            o->seq[id].used = true;
            o->seq[id].c = (dt_content){base, split, own};
            o->seq[id].n = (size_t)n;
            if (id + 1 > o->max_id)
                o->max_id = id + 1;
        } else if (sscanf(l, "A %u %llu", &id, &nfull) == 2 && id < DT_ORACLE_MAX_SEQS) {
            if (nfull > o->seq[id].acked)
                o->seq[id].acked = (size_t)nfull;
            o->acks++;
        }
    }
    free(buf);
    return lines;
}

kvh_engine *dt_oracle_check(const kvh_config *cfg, dt_geo g, const dt_oracle *o, uint32_t first_id, dt_check *r)
{
    memset(r, 0, sizeof(*r));
    kvh_engine *e = NULL;
    kvh_status st = kvh_engine_open(cfg, &e);
    if (st != KVH_OK) {
        r->errors++;
        snprintf(r->msg, sizeof(r->msg), "reopen: %s: %s", kvh_status_name(st), kvh_last_error());
        return NULL;
    }
    for (uint32_t id = first_id; id < o->max_id && id < DT_ORACLE_MAX_SEQS; id++) {
        const dt_planned *p = &o->seq[id];
        if (!p->used)
            continue;
        size_t m = 0;
        char msg[256] = "";
        r->seqs++;
        r->acked_blocks += p->acked;
        st = dt_match_verify(e, g, p->c, p->n, &m, msg, sizeof(msg));
        r->matched_blocks += m / g.bt;
        if (st != KVH_OK) {
            if (!r->errors++)
                snprintf(r->msg, sizeof(r->msg), "seq %u (acked %zu blocks): %s", id, p->acked, msg);
        } else if (m < p->acked * g.bt) {
            if (!r->errors++)
                snprintf(r->msg, sizeof(r->msg),
                         "seq %u: %zu blocks were acknowledged durable, only %zu found after the crash", id, p->acked,
                         m / g.bt);
        }
    }
    r->corrupt = dt_stats(e).corrupt_blocks;
    if (r->corrupt && !r->errors++)
        snprintf(r->msg, sizeof(r->msg),
                 "%" PRIu64 " blocks failed verification after a kill (nothing was "
                 "damaged on disk: a kill loses no written data)",
                 r->corrupt);
    return e;
}

/* ---- the workload of a crash child ---- */

kvh_engine *dt_crash_start(dt_crash_workload *w, const char *oracle, const char *errlog, const kvh_config *cfg,
                           int ready_fd)
{
    int ofd = open(oracle, O_WRONLY | O_APPEND | O_CREAT | O_CLOEXEC, 0644);
    int efd = open(errlog, O_WRONLY | O_APPEND | O_CREAT | O_CLOEXEC, 0644);
    if (ofd < 0 || efd < 0)
        _exit(60);
    dup2(efd, 2);
    w->ofd = ofd;
    kvh_engine *e = NULL;
    kvh_status st = kvh_engine_open(cfg, &e);
    if (st != KVH_OK)
        DT_CHILD_FAIL(10, "open: %s", kvh_status_name(st));
    if (write(ready_fd, "R", 1) != 1)
        _exit(61);
    return e;
}

void dt_crash_extend(const dt_crash_workload *w, kvh_engine *e, dt_live *l, size_t to, dt_rng *rng)
{
    if (to <= l->len)
        return;
    size_t n = to - l->len, tb = dt_tok_bytes(w->g);
    int32_t *tk = malloc(sizeof(int32_t) * n);
    uint8_t *k = malloc(tb * n), *v = malloc(tb * n);
    dt_tokens(l->c, l->len, n, tk);
    kvh_status st = DT_RETRY_NOSPACE(w, kvh_seq_append(e, l->s, tk, n));
    if (st != KVH_OK)
        DT_CHILD_FAIL(11, "append %zu to seq %u: %s", n, l->id, kvh_status_name(st));
    for (uint32_t layer = 0; layer < w->g.layers; layer++) {
        for (size_t t = 0; t < n; t++) {
            dt_kv_token(l->c, layer, l->len + t, 0, k + t * tb, tb);
            dt_kv_token(l->c, layer, l->len + t, 1, v + t * tb, tb);
        }
        if ((st = DT_RETRY_NOSPACE(w, kvh_seq_write_kv(e, l->s, layer, l->len, n, k, v))) != KVH_OK)
            DT_CHILD_FAIL(12, "write_kv seq %u: %s", l->id, kvh_status_name(st));
        if (layer == 0 && dt_below(rng, w->spill_one_in) == 0 &&
            (st = kvh_seq_migrate(e, l->s, 0, to, KVH_TIER_DISK, NULL)) != KVH_OK && st != KVH_ERR_NOSPACE)
            DT_CHILD_FAIL(13, "spill of half-written seq %u: %s", l->id, kvh_status_name(st));
    }
    l->len = to;
    free(tk);
    free(k);
    free(v);
}

void dt_crash_persist(const dt_crash_workload *w, kvh_engine *e, dt_live *l)
{
    dt_oracle_write(w->ofd, "S %u\n", l->id);
    kvh_status st = DT_RETRY_NOSPACE(w, kvh_seq_persist(e, l->s));
    if (st == KVH_ERR_NOSPACE)
        return;
    if (st != KVH_OK)
        DT_CHILD_FAIL(14, "persist seq %u: %s", l->id, kvh_status_name(st));
    dt_oracle_write(w->ofd, "A %u %zu\n", l->id, l->len / w->g.bt);
}

void dt_crash_read_back(const dt_crash_workload *w, kvh_engine *e, const dt_live *l)
{
    char msg[256] = "";
    kvh_status st = DT_RETRY_NOSPACE(w, dt_verify(e, l->s, w->g, l->c, 0, l->len, msg, sizeof(msg)));
    if (st != KVH_OK && st != KVH_ERR_NOSPACE)
        DT_CHILD_FAIL(20, "read back seq %u: %s", l->id, msg);
}

void dt_crash_match_back(const dt_crash_workload *w, kvh_engine *e, const dt_live *l)
{
    size_t m = 0;
    char msg[256] = "";
    kvh_status st = DT_RETRY_NOSPACE(w, dt_match_verify(e, w->g, l->c, l->len, &m, msg, sizeof(msg)));
    if (st != KVH_OK && st != KVH_ERR_NOSPACE)
        DT_CHILD_FAIL(21, "match seq %u: %s", l->id, msg);
}

void dt_crash_new_seq(const dt_crash_workload *w, kvh_engine *e, dt_live *L, int *nl, int max_live, uint32_t *id,
                      uint64_t *budget, dt_rng *rng)
{
    dt_geo g = w->g;
    size_t want = (1 + dt_below(rng, w->max_new_blocks)) * g.bt + (dt_below(rng, 2) ? dt_below(rng, g.bt) : 0);
    int from = -1;
    for (int i = 0; i < *nl && from < 0; i++)
        if (L[i].plain && L[i].len > 0 && dt_below(rng, 2))
            from = i;
    size_t final = (from >= 0 ? L[from].len : 0) + want;
    if (!(*nl < max_live && dt_below(rng, 3) == 0 && *budget >= dt_crash_cost(w, final) && *id < w->max_ids))
        return;
    dt_live *l = &L[*nl];
    if (from >= 0) {
        l->c = (dt_content){L[from].c.own, L[from].len, w->first_stream + *id};
        l->plain = false;
    } else {
        l->c = dt_plain(w->first_stream + *id);
        l->plain = true;
    }
    l->final = final;
    l->id = (*id)++;
    *budget -= dt_crash_cost(w, final);
    dt_oracle_write(w->ofd, "P %u %llu %llu %llu %zu\n", l->id, (unsigned long long)l->c.base,
                    (unsigned long long)l->c.split, (unsigned long long)l->c.own, l->final);
    kvh_status st;
    uint32_t agent = w->agents > 1 ? (uint32_t)dt_below(rng, w->agents) : 0;
    if (from >= 0) {
        if ((st = kvh_seq_fork(e, L[from].s, agent, &l->s)) != KVH_OK)
            DT_CHILD_FAIL(15, "fork: %s", kvh_status_name(st));
        l->len = l->c.split;
    } else {
        if ((st = kvh_seq_create(e, agent, &l->s)) != KVH_OK)
            DT_CHILD_FAIL(16, "create: %s", kvh_status_name(st));
        l->len = 0;
    }
    size_t first = dt_below(rng, 2) ? l->final : l->len + 1 + dt_below(rng, l->final - l->len);
    dt_crash_extend(w, e, l, first, rng);
    (*nl)++;
}

void dt_crash_reopen(kvh_engine **e, const kvh_config *c, dt_live *L, int *nl, int fail_code)
{
    for (int i = 0; i < *nl; i++)
        kvh_seq_free(*e, L[i].s);
    *nl = 0;
    kvh_status st;
    if ((st = kvh_engine_close(*e)) != KVH_OK)
        DT_CHILD_FAIL(fail_code, "close: %s", kvh_status_name(st));
    *e = NULL;
    if ((st = kvh_engine_open(c, e)) != KVH_OK)
        DT_CHILD_FAIL(fail_code + 1, "reopen: %s", kvh_status_name(st));
}

/* ---- kvh-store ---- */

bool dt_store_tool(char *out, size_t len)
{
    const char *env = getenv("KVH_STORE_BIN");
    if (env && *env) {
        snprintf(out, len, "%s", env);
        return access(out, X_OK) == 0;
    }
    char self[PATH_MAX];
    ssize_t n = readlink("/proc/self/exe", self, sizeof(self) - 1);
    if (n <= 0)
        return false;
    self[n] = '\0';
    char *slash = strrchr(self, '/');
    if (!slash)
        return false;
    *slash = '\0';
    if (snprintf(out, len, "%s/../../tools/kvh-store", self) >= (int)len)
        return false;
    return access(out, X_OK) == 0;
}

int dt_run_tool(const char *tool, const char *a1, const char *a2, const char *a3, char *out, size_t len)
{
    int p[2];
    if (pipe(p) != 0)
        return -1;
    pid_t pid = dt_fork_child();
    if (pid < 0) {
        close(p[0]);
        close(p[1]);
        return -1;
    }
    if (pid == 0) {
        dup2(p[1], 1);
        dup2(p[1], 2);
        close(p[0]);
        close(p[1]);
        /* In the ASan build the tool is instrumented too; what it does not
         * free before exiting is not what these tests check, and a leak
         * report would change its exit status. */
        const char *asan = getenv("ASAN_OPTIONS");
        char opts[1024];
        snprintf(opts, sizeof(opts), "%s%sdetect_leaks=0", asan ? asan : "", asan && *asan ? ":" : "");
        setenv("ASAN_OPTIONS", opts, 1);
        execl(tool, tool, a1, a2, a3, (char *)NULL);
        _exit(127);
    }
    close(p[1]);
    size_t got = 0;
    for (;;) {
        char tmp[4096];
        ssize_t n = read(p[0], tmp, sizeof(tmp));
        if (n < 0 && errno == EINTR)
            continue;
        if (n <= 0)
            break;
        size_t take = (size_t)n;
        if (len && got + take > len - 1)
            take = len - 1 - got;
        memcpy(out + got, tmp, take);
        got += take;
    }
    close(p[0]);
    if (len)
        out[got] = '\0';
    int ws = dt_reap(pid);
    return ws >= 0 && WIFEXITED(ws) ? WEXITSTATUS(ws) : -1;
}

/* ---- chain stores ---- */

const char *dt_flip_target_name(dt_flip_target t)
{
    return t == DT_FLIP_DATA ? "slot data" : t == DT_FLIP_SLOT_HEADER ? "slot header" : "index record";
}

int dt_chains_persist(kvh_engine *e, const dt_chains *ch, int first, int last)
{
    for (int c = first; c <= last; c++) {
        kvh_seq s;
        if (dt_build(e, ch->g, ch->content(c), dt_chain_len(ch), 0, &s) != KVH_OK)
            return 1;
        if (kvh_seq_persist(e, s) != KVH_OK)
            return 2;
        if (kvh_seq_free(e, s) != KVH_OK)
            return 3;
    }
    return 0;
}

typedef struct dt_chains_child_arg {
    const kvh_config *cfg;
    const dt_chains *ch;
} dt_chains_child_arg;

/* The child of dt_chains_build_a: persists the journal-only chains and
 * exits with its engine open. */
static int dt_chains_journal_child(void *arg)
{
    const dt_chains_child_arg *a = arg;
    kvh_engine *e = NULL;
    if (kvh_engine_open(a->cfg, &e) != KVH_OK)
        return 9;
    /* ends with the engine open: these chains stay in the journal only */
    return dt_chains_persist(e, a->ch, a->ch->in_snapshot, a->ch->n - 1);
}

void dt_chains_expect_a(kvh_engine *e, const dt_chains *ch, int c, int want, const char *what)
{
    size_t m = 0;
    char msg[256] = "";
    kvh_status st = dt_match_verify(e, ch->g, ch->content(c), dt_chain_len(ch), &m, msg, sizeof(msg));
    if (st != KVH_OK)
        fail_msg("%s: chain %d: %s", what, c, msg);
    if (m != (size_t)want * ch->g.bt)
        fail_msg("%s: chain %d matched %zu blocks, expected %d (the damaged block %s)", what, c, m / ch->g.bt, want,
                 m > (size_t)want * ch->g.bt ? "was served: the damage went undetected" : "");
}

bool dt_chains_find(const dt_chains *ch, int32_t t0, int *pc, int *pk)
{
    *pc = *pk = -1;
    for (int c = 0; c < ch->n; c++)
        for (int k = 0; k < ch->blocks; k++)
            if (dt_token(ch->content(c), (uint64_t)k * ch->g.bt) == t0) {
                *pc = c, *pk = k;
                return true;
            }
    return false;
}

void dt_chains_map_a(const dt_saved_store *saved, const dt_chains *ch, dt_block_loc *loc, size_t *journal_records)
{
    size_t rec_bytes = kvhi_index_rec_bytes(ch->g.bt), nblocks = (size_t)ch->n * (size_t)ch->blocks;
    int *seen = calloc(nblocks, sizeof(int));
    assert_non_null(seen);
    const char *files[2] = {"index", "journal"};
    for (int f = 0; f < 2; f++) {
        const dt_saved_file *sf = dt_store_file(saved, files[f]);
        assert_non_null(sf);
        assert_true(sf->len >= 4096);
        size_t nrec = (sf->len - 4096) / rec_bytes;
        if (f == 1)
            *journal_records = nrec;
        for (size_t i = 0; i < nrec; i++) {
            int32_t tk[256];
            kvhi_index_rec r = {.tokens = tk};
            size_t off = 4096 + i * rec_bytes;
            assert_true(ch->g.bt <= 256);
            assert_int_equal(kvhi_index_rec_decode(sf->data + off, &r, ch->g.bt), 0);
            int c = -1, k = -1;
            if (!dt_chains_find(ch, tk[0], &c, &k))
                fail_msg("%s record %zu names an unknown block", files[f], i);
            size_t b = (size_t)c * (size_t)ch->blocks + (size_t)k;
            if (r.kind != KVHI_REC_ADD || seen[b]++)
                fail_msg("unexpected chain store layout: %s record %zu (kind %u) for chain %d block %d", files[f], i,
                         r.kind, c, k);
            loc[b] = (dt_block_loc){(uint32_t)r.slot, f == 1, off, (int)i};
        }
    }
    for (int c = 0; c < ch->n; c++)
        for (int k = 0; k < ch->blocks; k++) {
            size_t b = (size_t)c * (size_t)ch->blocks + (size_t)k;
            if (!seen[b])
                fail_msg("chain %d block %d has no record", c, k);
            if (loc[b].in_journal != (c >= ch->in_snapshot))
                fail_msg("chain %d block %d: its record is in the %s", c, k, loc[b].in_journal ? "journal" : "index");
        }
    free(seen);
}

void dt_flip_pick(dt_rng *rng, dt_flip *f, const dt_block_loc *L, uint64_t slot_bytes, size_t rec_bytes,
                  bool allow_record)
{
    uint64_t r = dt_below(rng, 100);
    f->t = r < 45 ? DT_FLIP_DATA : (r < 70 || !allow_record) ? DT_FLIP_SLOT_HEADER : DT_FLIP_RECORD;
    f->bit = (unsigned)dt_below(rng, 8);
    if (f->t == DT_FLIP_DATA) {
        f->file = "slab-0000.kvh";
        f->off = (uint64_t)L->slot * slot_bytes + 4096 + dt_below(rng, 4096);
    } else if (f->t == DT_FLIP_SLOT_HEADER) {
        f->file = "slab-0000.kvh";
        f->off = (uint64_t)L->slot * slot_bytes + dt_below(rng, 4096);
    } else {
        f->file = L->in_journal ? "journal" : "index";
        f->off = L->rec_off + dt_below(rng, rec_bytes);
    }
}

uint64_t dt_flips_counted(const dt_flip *fl, int n, const dt_chains *ch, const dt_block_loc *loc,
                          size_t journal_records, long *uncounted)
{
    bool *journal_bad = calloc(journal_records + 1, sizeof(bool));
    assert_non_null(journal_bad);
    for (int i = 0; i < n; i++) {
        const dt_block_loc *L = &loc[fl[i].chain * ch->blocks + fl[i].block];
        if (fl[i].t == DT_FLIP_RECORD && L->in_journal)
            journal_bad[L->journal_index] = true;
    }
    uint64_t expect = 0;
    for (int i = 0; i < n; i++) {
        const dt_block_loc *L = &loc[fl[i].chain * ch->blocks + fl[i].block];
        if (fl[i].t != DT_FLIP_RECORD || !L->in_journal) {
            expect++;
            continue;
        }
        bool counted = false;
        for (size_t j = (size_t)L->journal_index + 1; j < journal_records && !counted; j++)
            counted = !journal_bad[j];
        expect += counted;
        if (uncounted)
            *uncounted += !counted;
    }
    free(journal_bad);
    return expect;
}

void dt_chains_build_a(const kvh_config *cfg, const dt_chains *ch, dt_saved_store *saved, dt_block_loc *loc,
                       size_t *journal_records)
{
    kvh_engine *e = dt_open_a(cfg);
    assert_int_equal(dt_chains_persist(e, ch, 0, ch->in_snapshot - 1), 0);
    dt_assert_ok(dt_close(e));
    dt_chains_child_arg a = {cfg, ch};
    assert_int_equal(dt_in_child(dt_chains_journal_child, &a), 0);
    assert_int_equal(dt_store_save(cfg->disk_path, saved), 0);
    dt_chains_map_a(saved, ch, loc, journal_records);
}

void *dt_persist_in_thread(void *call)
{
    dt_persist_call *a = call;
    a->st = kvh_seq_persist(a->e, a->s);
    return NULL;
}
