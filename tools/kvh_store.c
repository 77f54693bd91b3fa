/* kvh-store: inspect a kvh disk store without an engine.
 *   kvh-store info DIR     geometry, blocks, bytes, prefix chains, and who
 *                          can read it (directory and file modes)
 *   kvh-store verify DIR   re-checks every block's checksums and the index
 *                          files; exit 0 only if all pass and a strict open
 *                          (disk_strict_index) takes the store: a missing
 *                          journal, a journal cut inside its header or an
 *                          index older than its journal or of another store
 *                          fail it too, even with no bad block or record, as
 *                          do blocks of another geometry and records past
 *                          the slabs or in a cycle of parents; what is bad
 *                          is listed
 *   kvh-store remote ...   the remote tier (tools/kvh_store_remote.c) */
#include <dirent.h>
#include <errno.h>
#include <fcntl.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/file.h>
#include <sys/stat.h>
#include <unistd.h>

#include "core/disk_access.h"
#include "core/disk_format.h"
#include "core/disk_index.h"
#include "core/prefix_index.h"
#include "tools/kvh_store_remote.h"

static void usage(FILE *f)
{
    fprintf(f, "usage: kvh-store info [--json] [--] DIR\n"
               "       kvh-store verify [--json] [--] DIR\n"
               "Inspects a kvh disk tier directory (kvh_config.disk_path).\n"
               "  info     geometry, block count, bytes, prefix chains, permissions\n"
               "  verify   re-reads every indexed block and checks its checksums and\n"
               "           the index files; exits 0 only when all pass and a strict\n"
               "           open (disk_strict_index) takes the store, and lists what\n"
               "           is bad\n"
               "  --json   JSON Lines: one object per line (verify: one for each bad\n"
               "           block, then the summary, which is always the last line)\n"
               "       kvh-store remote ping|count|verify|purge [--sample N] [--json]\n"
               "           the remote tier's keys of the model the KVH_* environment\n"
               "           names (KVH_REMOTE_ADDRS, KVH_MODEL_SALT, geometry)\n"
               "Exit status: 0 all good; 1 bad blocks or index records found (blocks\n"
               "of another geometry, records naming slots past the slab files or in\n"
               "a cycle of parents included), or index files a strict open refuses\n"
               "(a missing journal, a journal cut inside its header, an index older\n"
               "than its journal or of another store), even with 0 bad blocks and\n"
               "records; 2 bad arguments, or the store cannot be read (missing,\n"
               "damaged, in use).\n");
}

/* A store file for reading, as the engine opens it: a regular file only
 * (a FIFO in its place must not block the tool), no symlink followed.
 * -1 with errno set when it cannot be used. */
static int open_store_file(const kvhi_disk *d, const char *name)
{
    int fd = kvhi_store_openat(d, name, O_RDONLY | O_NONBLOCK);
    if (fd < 0) {
        errno = -fd;
        return -1;
    }
    return fd;
}

/* Opens DIR read-only: geometry from the index header, slot count from
 * the slab files, a shared lock so a running engine is not disturbed. */
static int open_store(const char *path, kvhi_disk *d)
{
    memset(d, 0, sizeof(*d));
    d->path = (char *)path;
    d->read_only = true;
    d->journal_fd = d->lock_fd = -1;
    d->dir_fd = open(path, O_RDONLY | O_DIRECTORY | O_CLOEXEC);
    if (d->dir_fd < 0) {
        fprintf(stderr, "kvh-store: cannot open %s: %s\n", path, strerror(errno));
        return -1;
    }
    d->lock_fd = open_store_file(d, "LOCK");
    /* An engine locks the directory too (its LOCK file may have been
     * deleted and made anew). */
    if (flock(d->dir_fd, LOCK_SH | LOCK_NB) != 0 || (d->lock_fd >= 0 && flock(d->lock_fd, LOCK_SH | LOCK_NB) != 0)) {
        char pid[32] = "";
        ssize_t n = pread(d->lock_fd, pid, sizeof(pid) - 1, 0);
        pid[n > 0 ? n : 0] = '\0';
        pid[strcspn(pid, "\n")] = '\0';
        fprintf(stderr, "kvh-store: %s is open in %s%s; close it first\n", path,
                pid[0] ? "process " : "another process", pid);
        return -1;
    }
    /* The geometry: from the index header, else from the journal's (an
     * engine rebuilds a missing or damaged index from the journal and
     * the slots; the load below reports what a strict open refuses). */
    uint8_t hdr[KVHI_DISK_ALIGN];
    kvhi_index_header h;
    bool have_header = false;
    const char *const files[2] = {"index", "journal"};
    int denied = -1; /* a file this user may not read: no verdict on the store from here */
    for (int f = 0; f < 2 && !have_header; f++) {
        int fd = open_store_file(d, files[f]);
        if (fd < 0 && errno == EACCES && denied < 0)
            denied = f;
        have_header =
            fd >= 0 && read(fd, hdr, sizeof(hdr)) >= 84 && kvhi_index_header_decode(hdr, sizeof(hdr), &h) == 0;
        if (fd >= 0)
            close(fd);
    }
    if (!have_header && denied >= 0) {
        fprintf(stderr,
                "kvh-store: cannot read %s/%s: %s (run as the store's owner, or a member of its group "
                "when it was made with share_group)\n",
                path, files[denied], strerror(EACCES));
        return -1;
    }
    if (!have_header) {
        fprintf(stderr,
                "kvh-store: %s has no readable index or journal header (not a kvh store, or both are missing "
                "or damaged): its geometry is unknown here; an engine opened with it rebuilds the index from "
                "the slab files (disk_strict_index=1 refuses it)\n",
                path);
        return -1;
    }
    d->geo = h.geo;
    d->block_bytes = h.geo.block_bytes;
    d->slot_bytes = KVHI_SLOT_HEADER_BYTES + kvhi_round_up(d->block_bytes, KVHI_DISK_ALIGN);
    uint64_t total = 0;
    for (uint32_t i = 0;; i++) {
        char name[64];
        struct stat st;
        snprintf(name, sizeof(name), "slab-%04u.kvh", i);
        if (fstatat(d->dir_fd, name, &st, 0) != 0)
            break;
        total += (uint64_t)st.st_size / d->slot_bytes;
        d->n_slabs = i + 1;
        /* As the engine lays slabs out, every one is full but the last: a
         * file after one that is not is none of the store's (an engine
         * opened smaller left it, or it was put there), and is not read. */
        if ((uint64_t)st.st_size < kvhi_disk_slab_slots(d->slot_bytes) * d->slot_bytes)
            break;
    }
    /* Slabs may be truncated or missing: size the slot space from the
     * index records as well, so every indexed block is checked. */
    uint64_t max_slot = 0;
    size_t rb = kvhi_index_rec_bytes(h.geo.block_tokens);
    int32_t *tk = malloc(sizeof(int32_t) * h.geo.block_tokens);
    for (int f = 0; f < 2 && tk; f++) {
        int rfd = open_store_file(d, files[f]);
        uint8_t *rec = malloc(rb);
        if (rfd >= 0 && rec && lseek(rfd, KVHI_DISK_ALIGN, SEEK_SET) == KVHI_DISK_ALIGN)
            while (read(rfd, rec, rb) == (ssize_t)rb) {
                kvhi_index_rec r = {.tokens = tk};
                if (kvhi_index_rec_decode(rec, &r, h.geo.block_tokens) == 0 && r.slot + 1 > max_slot &&
                    r.slot < (1u << 30))
                    max_slot = r.slot + 1;
            }
        free(rec);
        if (rfd >= 0)
            close(rfd);
    }
    free(tk);
    if (max_slot > total)
        total = max_slot;
    if (total > UINT32_MAX / 2) /* as the engine: slot numbers are 32-bit */
        total = UINT32_MAX / 2;
    /* As the engine lays them out (kvhi_disk_open_slabs): a slot over 1 GiB
     * is a slab file of its own. */
    uint64_t per = kvhi_disk_slab_slots(d->slot_bytes);
    d->slots_per_slab = (uint32_t)(per < total ? per : total ? total : 1);
    d->n_slots = (uint32_t)total;
    d->queue_depth = 8;
    d->max_lanes = 1;
    d->slab_fds = calloc(d->n_slabs ? d->n_slabs : 1, sizeof(int));
    for (uint32_t i = 0; i < d->n_slabs; i++) {
        char name[64];
        snprintf(name, sizeof(name), "slab-%04u.kvh", i);
        d->slab_fds[i] = open_store_file(d, name);
    }
    d->lane_blocks = 1;
    pthread_mutex_init(&d->lane_lock, NULL);
    return 0;
}

/* Who can read the store: the directory's and every file's mode, against
 * what the engine makes (core/disk_access.h): 0700 / 0600, or 0750 / 0640
 * with KVH_DISK_SHARE_GROUP. */
enum { PERM_OWNER, PERM_GROUP, PERM_EXPOSED };
static const char *const perm_names[] = {"owner-only", "group", "exposed"};

typedef struct store_perms {
    int level;          /* the widest of the directory and its files */
    unsigned dir_mode;  /* permission bits of the directory */
    bool dir_writable;  /* by group or others: an engine refuses to open it */
    bool foreign;       /* owned by another user than this process's */
    char exposed[1024]; /* "name 0644, ..." of what is wider than group */
} store_perms;

static int perm_level(mode_t m, bool dir)
{
    if (!(m & 077))
        return PERM_OWNER;
    return (m & (dir ? 027 : 037)) ? PERM_EXPOSED : PERM_GROUP;
}

static void note_exposed(store_perms *p, const char *name, mode_t m)
{
    size_t at = strlen(p->exposed);
    if (at + 48 < sizeof(p->exposed))
        snprintf(p->exposed + at, sizeof(p->exposed) - at, "%s%s %04o", at ? ", " : "", name, (unsigned)(m & 07777));
}

static void store_perms_of(const kvhi_disk *d, store_perms *p)
{
    memset(p, 0, sizeof(*p));
    struct stat st;
    if (fstat(d->dir_fd, &st) != 0)
        return;
    p->dir_mode = st.st_mode & 07777;
    p->dir_writable = (st.st_mode & (S_IWGRP | S_IWOTH)) != 0;
    p->foreign = st.st_uid != geteuid();
    p->level = perm_level(st.st_mode, true);
    if (p->level == PERM_EXPOSED)
        note_exposed(p, "(directory)", st.st_mode);
    int fd = dup(d->dir_fd);
    DIR *dir = fd >= 0 ? fdopendir(fd) : NULL;
    if (!dir) {
        if (fd >= 0)
            close(fd);
        return;
    }
    rewinddir(dir);
    for (struct dirent *de; (de = readdir(dir)) != NULL;) {
        if (de->d_name[0] == '.')
            continue;
        if (fstatat(d->dir_fd, de->d_name, &st, AT_SYMLINK_NOFOLLOW) != 0 || !S_ISREG(st.st_mode))
            continue;
        int lv = perm_level(st.st_mode, false);
        if (lv > p->level)
            p->level = lv;
        if (lv == PERM_EXPOSED)
            note_exposed(p, de->d_name, st.st_mode);
        p->foreign |= st.st_uid != geteuid();
    }
    closedir(dir);
}

/* Length of the well-formed UTF-8 sequence at s (1-4), or 0 (RFC 3629:
 * no overlong forms, no surrogates, nothing past U+10FFFF). */
static int utf8_length(const unsigned char *s)
{
    unsigned char c = s[0];
    int n = c < 0x80 ? 1 : c >= 0xC2 && c <= 0xDF ? 2 : c >= 0xE0 && c <= 0xEF ? 3 : c >= 0xF0 && c <= 0xF4 ? 4 : 0;
    for (int i = 1; i < n; i++)
        if ((s[i] & 0xC0) != 0x80)
            return 0;
    if ((c == 0xE0 && s[1] < 0xA0) || (c == 0xED && s[1] >= 0xA0) || (c == 0xF0 && s[1] < 0x90) ||
        (c == 0xF4 && s[1] >= 0x90))
        return 0;
    return n;
}

/* s as the inside of a JSON string: quotes, backslashes and control
 * bytes escaped, and a byte that is not UTF-8 (a directory may be named
 * anything) written as U+FFFD, so that the output stays JSON. */
static void print_json_text(const char *text)
{
    const unsigned char *s = (const unsigned char *)text;
    while (*s) {
        unsigned char c = *s;
        int n = utf8_length(s);
        if (c == '"' || c == '\\')
            printf("\\%c", c);
        else if (c < 0x20)
            printf("\\u%04x", c);
        else if (n == 0)
            fputs("\\ufffd", stdout);
        else
            fwrite(s, 1, (size_t)n, stdout);
        s += n ? n : 1;
    }
}

/* The prefix chains the records form: a record whose parent is not
 * indexed starts one (a root); depth by walking parents, memoised, so this
 * stays linear. Records whose parents lead into a cycle (which chained
 * hashes never make: forged or damaged records) are on no chain. */
typedef struct chain_shape {
    uint64_t roots, longest, in_cycles;
    bool failed; /* out of memory: nothing counted */
} chain_shape;

#define ON_NO_CHAIN UINT32_MAX

static chain_shape chain_shape_of(const kvhi_index_list *list)
{
    chain_shape c = {0};
    size_t n = list->n ? list->n : 1;
    kvhi_prefix_index ix;
    uint32_t *depth = calloc(n, sizeof(uint32_t));
    uint32_t *stack = malloc(sizeof(uint32_t) * n);
    uint8_t *state = calloc(n, 1); /* 0 new, 1 on the walk now, 2 done */
    if (!depth || !stack || !state || kvhi_prefix_init(&ix, list->n) != 0) {
        free(depth), free(stack), free(state);
        c.failed = true;
        return c;
    }
    for (size_t i = 0; i < list->n; i++)
        kvhi_prefix_insert(&ix, list->items[i].hash, (uint32_t)i);
    for (size_t i = 0; i < list->n; i++) {
        uint32_t top = 0, cur = (uint32_t)i, base;
        for (;;) {
            if (state[cur] == 2) {
                base = depth[cur];
                break;
            }
            if (state[cur] == 1) { /* back to a record of this walk */
                base = ON_NO_CHAIN;
                break;
            }
            state[cur] = 1;
            stack[top++] = cur;
            uint32_t p = list->items[cur].parent ? kvhi_prefix_find(&ix, list->items[cur].parent) : KVHI_PREFIX_MISS;
            if (p == KVHI_PREFIX_MISS) {
                base = 0;
                c.roots++;
                break;
            }
            cur = p;
        }
        while (top) {
            uint32_t r = stack[--top];
            depth[r] = base == ON_NO_CHAIN ? ON_NO_CHAIN : ++base;
            state[r] = 2;
            if (base == ON_NO_CHAIN)
                c.in_cycles++;
            else if (base > c.longest)
                c.longest = base;
        }
    }
    kvhi_prefix_destroy(&ix);
    free(depth), free(stack), free(state);
    return c;
}

static bool is_help(const char *a) { return !strcmp(a, "--help") || !strcmp(a, "-h"); }

static int run_main(int argc, char **argv)
{
    bool remote = argc >= 2 && !strcmp(argv[1], "remote");
    for (int i = 1; i < argc && !remote && strcmp(argv[i], "--"); i++)
        if (is_help(argv[i])) {
            usage(stdout);
            return 0;
        }
    if (remote)
        return kvh_store_remote_main(argc, argv);
    if (argc < 2 || (strcmp(argv[1], "info") && strcmp(argv[1], "verify"))) {
        if (argc >= 2)
            fprintf(stderr, "kvh-store: unknown action %s\n", argv[1]);
        usage(stderr);
        return 2;
    }
    /* Options before or after DIR; after "--", DIR even if it starts
     * with "-". */
    const char *dir = NULL;
    bool json = false, options = true;
    for (int i = 2; i < argc; i++) {
        const char *a = argv[i];
        if (options && !strcmp(a, "--"))
            options = false;
        else if (options && !strcmp(a, "--json"))
            json = true;
        else if (!dir && (!options || a[0] != '-' || !a[1]))
            dir = a;
        else {
            fprintf(stderr, "kvh-store: unknown argument %s (kvh-store --help)\n", a);
            return 2;
        }
    }
    if (!dir) {
        fprintf(stderr, "kvh-store: %s needs the store's directory (kvh-store --help)\n", argv[1]);
        return 2;
    }
    kvhi_disk d;
    if (open_store(dir, &d) != 0)
        return 2;
    char msg[256];
    kvhi_index_list list;
    if (kvhi_index_load(&d, false, &list, msg, sizeof(msg)) != KVHI_INDEX_OK) {
        fprintf(stderr, "kvh-store: %s\n", msg);
        return 2;
    }
    if (!strcmp(argv[1], "info")) {
        chain_shape chains = chain_shape_of(&list);
        if (chains.failed) {
            fprintf(stderr, "kvh-store: out of memory walking the prefix chains\n");
            return 2;
        }
        uint64_t roots = chains.roots, longest = chains.longest;
        uint64_t bytes = (uint64_t)list.n * d.block_bytes;
        store_perms pm;
        store_perms_of(&d, &pm);
        if (json) {
            printf("{\"path\": \"");
            print_json_text(d.path);
            printf(
                "\", \"layers\": %u, \"kv_heads\": %u, \"head_dim\": %u, \"block_tokens\": %u, "
                "\"dtype\": \"%s\", \"kv_codec\": \"%s\", \"model_salt\": %llu, \"block_bytes\": %llu, \"slots\": %u, \"blocks\": %zu, "
                "\"bytes\": %llu, \"tokens\": %llu, \"prefix_chains\": %llu, \"longest_chain_blocks\": %llu, "
                "\"bad_records\": %llu, \"permissions\": \"%s\", \"dir_mode\": \"%04o\", "
                "\"dir_writable_by_others\": %s, \"other_owner\": %s, \"exposed\": \"",
                d.geo.num_layers, d.geo.num_kv_heads, d.geo.head_dim, d.geo.block_tokens,
                kvhi_disk_dtype_name(d.geo.dtype), kvhi_disk_codec_name(d.geo.dtype),
                (unsigned long long)d.geo.model_salt, (unsigned long long)d.block_bytes, d.n_slots, list.n,
                (unsigned long long)bytes, (unsigned long long)list.n * d.geo.block_tokens, (unsigned long long)roots,
                (unsigned long long)longest, (unsigned long long)list.bad_records, perm_names[pm.level], pm.dir_mode,
                pm.dir_writable ? "true" : "false", pm.foreign ? "true" : "false");
            print_json_text(pm.exposed);
            printf("\"}\n");
        } else
            printf(
                "store         %s\n"
                "geometry      %u layers x %u kv heads x %u dim, %u tokens/block, %s, kv codec %s\n"
                "model salt    0x%016llx\n"
                "block bytes   %llu\n"
                "slots         %u (%zu used)\n"
                "blocks        %zu (%llu tokens, %.1f MiB)\n"
                "prefix chains %llu (longest %llu blocks)\n"
                "bad records   %llu\n"
                "permissions   %s (directory %04o)%s%s%s%s\n",
                d.path, d.geo.num_layers, d.geo.num_kv_heads, d.geo.head_dim, d.geo.block_tokens,
                kvhi_disk_dtype_name(d.geo.dtype), kvhi_disk_codec_name(d.geo.dtype),
                (unsigned long long)d.geo.model_salt, (unsigned long long)d.block_bytes, d.n_slots, list.n, list.n,
                (unsigned long long)list.n * d.geo.block_tokens, bytes / 1048576.0, (unsigned long long)roots,
                (unsigned long long)longest, (unsigned long long)list.bad_records, perm_names[pm.level], pm.dir_mode,
                pm.level == PERM_EXPOSED ? "\n              other users can read cached prompts' KV: " : "", pm.exposed,
                pm.dir_writable ? "\n              the directory is writable by other users: an engine refuses it" : "",
                pm.foreign ? "\n              owned by another user than this one" : "");
        if (pm.dir_writable)
            fprintf(stderr,
                    "kvh-store: %s is writable by other users: an engine refuses it (another user could plant or "
                    "swap its files); chmod 700 %s && chmod 600 %s/* before opening it\n",
                    d.path, d.path, d.path);
        else if (pm.level == PERM_EXPOSED)
            fprintf(stderr,
                    "kvh-store: %s is readable by other users; an engine narrows it to 0700/0600 on its next open, "
                    "or: chmod 700 %s && chmod 600 %s/*\n",
                    d.path, d.path, d.path);
        kvhi_index_list_free(&list);
        kvhi_disk_close(&d);
        return 0;
    }
    /* verify */
    uint8_t *buf;
    if (posix_memalign((void **)&buf, KVHI_DISK_ALIGN, d.slot_bytes) != 0) {
        fprintf(stderr,
                "kvh-store: cannot allocate a slot's %llu bytes to read it (the index header's block size is "
                "%llu bytes)\n",
                (unsigned long long)d.slot_bytes, (unsigned long long)d.block_bytes);
        return 2;
    }
    /* Blocks and index records are counted apart: an engine rebuilds a
     * damaged record from its slot's header, so it loses no block. */
    uint64_t bad = 0;
    for (size_t i = 0; i < list.n; i++) {
        kvhi_index_entry *ent = &list.items[i];
        uint32_t slab = ent->slot / d.slots_per_slab;
        int fd = slab < d.n_slabs ? d.slab_fds[slab] : -1;
        off_t off = (off_t)kvhi_disk_slot_offset(&d, ent->slot);
        ssize_t n = fd < 0 ? -1 : pread(fd, buf, d.slot_bytes, off);
        const char *why = fd < 0  ? "its slab file is missing or not a readable regular file"
                          : n < 0 ? "its slab file cannot be read"
                                  : "short read (truncated slab)";
        /* The slot's padding past the block's bytes is never read back:
         * a slab cut inside it loses nothing. */
        int rc = n >= (ssize_t)(KVHI_SLOT_HEADER_BYTES + d.block_bytes)
                     ? kvhi_slot_verify(buf, buf + KVHI_SLOT_HEADER_BYTES, d.block_bytes, d.store_id, d.geo_tag,
                                        ent->slot, (uint64_t)off, ent->hash, d.geo.block_tokens, NULL, &why)
                     : -100;
        if (rc != 0) {
            bad++;
            if (json)
                printf("{\"slot\": %u, \"hash\": \"%016llx\", \"ok\": false, \"why\": \"%s\"}\n", ent->slot,
                       (unsigned long long)ent->hash, why);
            else
                printf("BAD slot %u hash %016llx: %s\n", ent->slot, (unsigned long long)ent->hash, why);
        }
    }
    /* Slots a rebuild of the index (damaged index, missing journal, torn
     * tail) dropped because they failed their check are bad blocks too,
     * though no list entry names them any more. */
    bad += list.bad_slots;
    if (list.bad_slots && !json)
        printf("BAD %llu blocks failed their checks while the index was rebuilt from the slots\n",
               (unsigned long long)list.bad_slots);
    if (list.bad_records && !json)
        printf("BAD %llu index records or headers damaged or missing (failed their checksum, or cut off)\n",
               (unsigned long long)list.bad_records);
    /* Records naming slots past any slab file (2^30 or more here, where
     * the slot space follows the records too: forged or damaged ones). */
    if (list.past_end && !json)
        printf("BAD %llu index records name slots past the store's slab files (an engine drops their blocks)\n",
               (unsigned long long)list.past_end);
    chain_shape chains = chain_shape_of(&list);
    if (chains.failed) {
        fprintf(stderr, "kvh-store: out of memory walking the prefix chains\n");
        return 2;
    }
    if (chains.in_cycles && !json)
        printf("BAD %llu index records are in, or descend from, a cycle of parents, which no chain of hashes "
               "makes (forged or damaged records)\n",
               (unsigned long long)chains.in_cycles);
    /* Damage to the index files that no record count shows (the journal
     * missing beside the index, or cut inside its header page): the load
     * rebuilt the index from the slots, as an engine does, but one with
     * disk_strict_index refuses the store. */
    bool damaged = list.damage[0] != '\0';
    if (damaged && !json)
        printf("BAD %s (an engine with disk_strict_index=1 refuses the store; with 0 it rebuilds the index "
               "from the slot headers)\n",
               list.damage);
    /* A crash leaves a torn tail, bit rot can too: not damage, but the
     * two settings then keep different blocks. */
    bool torn = list.torn_tail && !damaged;
    if (torn && !json)
        printf("NOTE the journal ends in a torn or damaged record: an engine with disk_strict_index=1 cuts it "
               "there and drops the records past it; with 0 it rebuilds them from the slot headers\n");
    if (json) {
        printf("{\"blocks\": %llu, \"bad\": %llu, \"bad_records\": %llu", (unsigned long long)(list.n + list.bad_slots),
               (unsigned long long)bad, (unsigned long long)list.bad_records);
        if (damaged) {
            printf(", \"damage\": \"");
            print_json_text(list.damage);
            printf("\"");
        }
        if (torn)
            printf(", \"torn_tail\": true");
        if (list.past_end)
            printf(", \"records_past_end\": %llu", (unsigned long long)list.past_end);
        if (chains.in_cycles)
            printf(", \"records_in_parent_cycles\": %llu", (unsigned long long)chains.in_cycles);
        printf("}\n");
    } else
        printf("%llu blocks checked, %llu bad\n", (unsigned long long)(list.n + list.bad_slots),
               (unsigned long long)bad);
    free(buf);
    uint64_t bad_records = list.bad_records + list.past_end + chains.in_cycles;
    /* The verdict on stderr as well: the lines above may be JSON, and a
     * wrapper (kvh store verify) reports a tool that fails without a word. */
    if (bad || bad_records || damaged)
        fprintf(stderr, "kvh-store verify: %s: %llu of %llu block(s) bad, %llu bad index record(s)%s\n", d.path,
                (unsigned long long)bad, (unsigned long long)(list.n + list.bad_slots), (unsigned long long)bad_records,
                damaged ? ", index or journal damaged" : "");
    kvhi_index_list_free(&list);
    kvhi_disk_close(&d);
    return bad || bad_records || damaged ? 1 : 0;
}

int main(int argc, char **argv)
{
    int rc = run_main(argc, argv);
    /* A report that never reached stdout (a full disk) is not a success. */
    errno = 0;
    if (fflush(stdout) != 0 || ferror(stdout)) {
        fprintf(stderr, "kvh-store: write error on standard output%s%s\n", errno ? ": " : "",
                errno ? strerror(errno) : "");
        if (rc == 0)
            rc = 1;
    }
    return rc;
}
