/* Who may read a store (core/disk_access.c): owner-only modes whatever the
 * umask, group sharing only when asked, narrowing what an older store
 * left open, refusing a directory other users can write to, and never
 * following a link planted in place of a store file; an open refused
 * because the store is held changes none of its modes. */
#include <grp.h>
#include <sys/stat.h>
#include <sys/wait.h>

#include "disk_test_util.h"

static const dt_geo G = {1, 1, 8, 4, KVH_DTYPE_F16};

static unsigned mode_of(const char *dir, const char *name)
{
    char path[PATH_MAX];
    struct stat st;
    if (lstat(name ? dt_path(path, sizeof(path), dir, name) : dir, &st) != 0)
        fail_msg("lstat %s/%s: %s", dir, name ? name : "", strerror(errno));
    return (unsigned)(st.st_mode & 07777);
}

/* Opens a store at dir (flags: kvh_disk_flags), persists one block and
 * closes it, so that every kind of store file exists. */
static void make_store(const char *dir, uint32_t flags)
{
    kvh_config c = dt_cfg(G, dir, 4, 4, 16, 0);
    c.disk_flags = flags;
    kvh_engine *e = dt_open_a(&c);
    kvh_seq s;
    dt_assert_ok(dt_build(e, G, dt_plain(1), G.bt, 0, &s));
    dt_assert_ok(kvh_seq_persist(e, s));
    dt_assert_ok(kvh_seq_free(e, s));
    dt_assert_ok(dt_close(e));
}

static kvh_status open_store(const char *dir, kvh_engine **e)
{
    kvh_config c = dt_cfg(G, dir, 4, 4, 16, 0);
    *e = NULL;
    kvh_status st = kvh_engine_open(&c, e);
    dt_track(*e);
    return st;
}

static const char *const FILES[] = {"LOCK", "index", "journal", "slab-0000.kvh"};

static void test_owner_only_whatever_the_umask(void **state)
{
    (void)state;
    char dir[PATH_MAX];
    dt_scratch("owner", dir, sizeof(dir));
    rmdir(dir); /* the store makes it */
    mode_t old = umask(0);
    make_store(dir, 0);
    umask(old);
    assert_int_equal(mode_of(dir, NULL), 0700);
    for (size_t i = 0; i < sizeof(FILES) / sizeof(FILES[0]); i++)
        if (mode_of(dir, FILES[i]) != 0600)
            fail_msg("%s has mode %04o, want 0600", FILES[i], mode_of(dir, FILES[i]));
}

static void test_group_share_when_asked(void **state)
{
    (void)state;
    char dir[PATH_MAX];
    dt_scratch("group", dir, sizeof(dir));
    rmdir(dir);
    mode_t old = umask(0);
    make_store(dir, KVH_DISK_SHARE_GROUP);
    umask(old);
    assert_int_equal(mode_of(dir, NULL), 0750);
    for (size_t i = 0; i < sizeof(FILES) / sizeof(FILES[0]); i++)
        assert_int_equal(mode_of(dir, FILES[i]), 0640);
}

static unsigned dir_mode_for(uint32_t flags) { return flags & KVH_DISK_SHARE_GROUP ? 0750 : 0700; }
static unsigned file_mode_for(uint32_t flags) { return flags & KVH_DISK_SHARE_GROUP ? 0640 : 0600; }

static void expect_store_modes(const char *what, const char *dir, uint32_t flags)
{
    if (mode_of(dir, NULL) != dir_mode_for(flags))
        fail_msg("%s: directory has mode %04o, want %04o", what, mode_of(dir, NULL), dir_mode_for(flags));
    for (size_t i = 0; i < sizeof(FILES) / sizeof(FILES[0]); i++)
        if (mode_of(dir, FILES[i]) != file_mode_for(flags))
            fail_msg("%s: %s has mode %04o, want %04o", what, FILES[i], mode_of(dir, FILES[i]), file_mode_for(flags));
}

static mode_t ambient_umask;

/* The umask a test started with, back even when a case failed midway. */
static int restore_umask(void **state)
{
    umask(ambient_umask);
    return dt_teardown(state);
}

/* Hardened umasks trim what mkdir asks for (077 takes the group's r-x of
 * a shared store, 0277 the owner's own write bit, which leaves no room for
 * LOCK): the directory still gets exactly the store's mode, new or not. */
static void test_exact_modes_under_narrow_umasks(void **state)
{
    (void)state;
    char dir[PATH_MAX], what[128];
    dt_scratch("umask", dir, sizeof(dir));
    ambient_umask = umask(022);
    umask(ambient_umask);
    const mode_t umasks[] = {077, 0277};
    const uint32_t flag_sets[] = {0, KVH_DISK_SHARE_GROUP};
    for (size_t u = 0; u < 2; u++)
        for (size_t f = 0; f < 2; f++) {
            snprintf(what, sizeof(what), "new store, umask %04o, flags %u", (unsigned)umasks[u], flag_sets[f]);
            dt_rmrf(dir);
            mode_t old = umask(umasks[u]);
            make_store(dir, flag_sets[f]);
            umask(old);
            expect_store_modes(what, dir, flag_sets[f]);
            /* An existing store made under the other flags, and one a
             * umask of 0277 left read-only to its owner: opened with these
             * flags, it takes their modes. */
            for (size_t g = 0; g < 2; g++)
                for (int was_read_only = 0; was_read_only < 2; was_read_only++) {
                    snprintf(what, sizeof(what), "existing store of flags %u%s, umask %04o, flags %u", flag_sets[g],
                             was_read_only ? " left 0500" : "", (unsigned)umasks[u], flag_sets[f]);
                    make_store(dir, flag_sets[g]);
                    if (was_read_only)
                        assert_int_equal(chmod(dir, 0500), 0);
                    old = umask(umasks[u]);
                    make_store(dir, flag_sets[f]);
                    umask(old);
                    expect_store_modes(what, dir, flag_sets[f]);
                }
        }
    assert_int_equal(chmod(dir, 0700), 0);
}

/* As a user without root's override of the directory's mode, under a
 * umask of 0277: the store opens (it could not create its LOCK in the
 * dr-x------ directory mkdir left) and is 0700 / 0600. */
/* Runs body(dir) in a child process as user nobody, dir being "store" in a
 * scratch directory of that user's; skips the test where that cannot be
 * done (not root, a build tree out of that user's reach). Returns what
 * body returned (0: passed); dir gets the store's path. */
static int as_nobody(const char *name, int (*body)(const char *dir), char *dir, size_t dir_len)
{
    if (geteuid() != 0)
        skip(); /* only root can become another user here */
    const uid_t nobody = 65534;
    char parent[PATH_MAX];
    dt_scratch(name, parent, sizeof(parent));
    assert_int_equal(chown(parent, nobody, nobody), 0);
    dt_path(dir, dir_len, parent, "store");
    pid_t pid = fork();
    assert_true(pid >= 0);
    if (pid == 0) {
        if (setgroups(0, NULL) != 0 || setgid(nobody) != 0 || setuid(nobody) != 0)
            _exit(100);
        if (access(parent, W_OK | X_OK) != 0)
            _exit(77);
        _exit(body(dir));
    }
    int status = 0;
    assert_int_equal(waitpid(pid, &status, 0), pid);
    if (WIFEXITED(status) && WEXITSTATUS(status) == 77)
        skip();
    return WIFEXITED(status) ? WEXITSTATUS(status) : 128 + WTERMSIG(status);
}

static int open_under_umask_0277(const char *dir)
{
    umask(0277);
    kvh_config c = dt_cfg(G, dir, 4, 4, 16, 0);
    kvh_engine *e = NULL;
    kvh_status st = kvh_engine_open(&c, &e);
    if (st != KVH_OK) {
        fprintf(stderr, "open as nobody: %s: %s\n", kvh_status_name(st), kvh_last_error());
        return 101;
    }
    return kvh_engine_close(e) == KVH_OK ? 0 : 102;
}

static void test_unprivileged_open_under_umask_0277(void **state)
{
    (void)state;
    char dir[PATH_MAX];
    int rc = as_nobody("umask_user", open_under_umask_0277, dir, sizeof(dir));
    if (rc != 0)
        fail_msg("the store did not open as user nobody under umask 0277 (%d)", rc);
    assert_int_equal(mode_of(dir, NULL), 0700);
    assert_int_equal(mode_of(dir, "LOCK"), 0600);
    assert_int_equal(mode_of(dir, "index"), 0600);
}

/* A store an older kvh made readable by everyone is narrowed at open,
 * and what it holds is still found. */
static void test_wider_store_is_narrowed(void **state)
{
    (void)state;
    char dir[PATH_MAX], path[PATH_MAX];
    dt_scratch("narrow", dir, sizeof(dir));
    make_store(dir, 0);
    assert_int_equal(chmod(dir, 0755), 0);
    for (size_t i = 0; i < sizeof(FILES) / sizeof(FILES[0]); i++)
        assert_int_equal(chmod(dt_path(path, sizeof(path), dir, FILES[i]), 0644), 0);
    kvh_engine *e;
    dt_assert_ok(open_store(dir, &e));
    size_t m = 0;
    char msg[256] = "";
    if (dt_match_verify(e, G, dt_plain(1), G.bt, &m, msg, sizeof(msg)) != KVH_OK)
        fail_msg("%s", msg);
    assert_int_equal(m, G.bt);
    dt_assert_ok(dt_close(e));
    assert_int_equal(mode_of(dir, NULL), 0700);
    for (size_t i = 0; i < sizeof(FILES) / sizeof(FILES[0]); i++)
        assert_int_equal(mode_of(dir, FILES[i]), 0600);
}

static void test_writable_by_others_is_refused(void **state)
{
    (void)state;
    char dir[PATH_MAX];
    dt_scratch("open_dir", dir, sizeof(dir));
    make_store(dir, 0);
    unsigned modes[] = {0777, 0770, 0702};
    for (size_t i = 0; i < sizeof(modes) / sizeof(modes[0]); i++) {
        assert_int_equal(chmod(dir, modes[i]), 0);
        kvh_engine *e;
        dt_assert_kvh(KVH_ERR_IO, open_store(dir, &e));
        assert_null(e);
        assert_non_null(strstr(kvh_last_error(), "writable by other users"));
    }
    assert_int_equal(chmod(dir, 0700), 0);
    kvh_engine *e;
    dt_assert_ok(open_store(dir, &e));
    dt_assert_ok(dt_close(e));
}

/* Each store file replaced by a link to a file of the attacker's: the
 * open fails and the link's target is neither read nor written. */
static void test_planted_links_are_not_followed(void **state)
{
    (void)state;
    char dir[PATH_MAX], path[PATH_MAX], bait[PATH_MAX];
    dt_scratch("links", dir, sizeof(dir));
    make_store(dir, 0);
    dt_scratch("links_bait", bait, sizeof(bait));
    for (size_t i = 0; i < sizeof(FILES) / sizeof(FILES[0]); i++) {
        char target[PATH_MAX], saved[PATH_MAX + 8];
        dt_path(target, sizeof(target), bait, FILES[i]);
        dt_path(path, sizeof(path), dir, FILES[i]);
        snprintf(saved, sizeof(saved), "%s.saved", path);
        /* The bait holds the real file's bytes, so following the link
         * would look like a good store. */
        size_t len = 0;
        uint8_t *bytes = dt_read_file(path, &len);
        assert_non_null(bytes);
        assert_int_equal(dt_write_file(target, bytes, len), 0);
        free(bytes);
        assert_int_equal(rename(path, saved), 0);
        assert_int_equal(symlink(target, path), 0);
        struct stat before, after;
        assert_int_equal(stat(target, &before), 0);
        kvh_engine *e;
        dt_assert_kvh(KVH_ERR_IO, open_store(dir, &e));
        assert_null(e);
        assert_int_equal(stat(target, &after), 0);
        assert_int_equal(after.st_size, before.st_size);
        assert_int_equal(after.st_mtim.tv_nsec, before.st_mtim.tv_nsec);
        assert_int_equal(unlink(path), 0);
        assert_int_equal(rename(saved, path), 0);
    }
    kvh_engine *e;
    dt_assert_ok(open_store(dir, &e));
    dt_assert_ok(dt_close(e));
}

/* Only root can give a directory to another user. */
static void test_another_users_store_is_refused(void **state)
{
    (void)state;
    if (geteuid() != 0)
        skip();
    char dir[PATH_MAX];
    dt_scratch("foreign", dir, sizeof(dir));
    make_store(dir, 0);
    assert_int_equal(chown(dir, 1, 1), 0);
    kvh_engine *e;
    dt_assert_kvh(KVH_ERR_IO, open_store(dir, &e));
    assert_non_null(strstr(kvh_last_error(), "belongs to user 1"));
    assert_int_equal(chown(dir, 0, 0), 0);
}

/* A directory of someone else's: mode 0755 and a file called `index`
 * holding `theirs` (in *index_path). */
static void plant_foreign_dir(const char *dir, char *index_path, size_t len, const char *theirs, size_t n)
{
    assert_int_equal(chmod(dir, 0755), 0);
    dt_path(index_path, len, dir, "index");
    assert_int_equal(dt_write_file(index_path, theirs, n), 0);
}

/* After an open refused with `reason`: the directory's mode, its index
 * and the absence of a LOCK are as planted. */
static void expect_foreign_dir_untouched(const char *dir, const char *index_path, const char *theirs, size_t n,
                                         const char *reason)
{
    if (!strstr(kvh_last_error(), reason))
        fail_msg("%s", kvh_last_error());
    struct stat st;
    assert_int_equal(stat(dir, &st), 0);
    assert_int_equal(st.st_mode & 07777, 0755);
    size_t len = 0;
    uint8_t *bytes = dt_read_file(index_path, &len);
    assert_non_null(bytes);
    assert_int_equal(len, n);
    assert_memory_equal(bytes, theirs, n);
    free(bytes);
    char lock_path[PATH_MAX];
    dt_path(lock_path, sizeof(lock_path), dir, "LOCK");
    assert_int_equal(access(lock_path, F_OK), -1);
}

/* disk_path itself a link to a directory that is no store (here one with
 * a file named like the index): refused, and the directory's mode and
 * files stay as they were (following it, open narrowed it to 0700, wrote
 * a LOCK and replaced `index` with its own). */
static void test_store_path_through_a_link_is_refused(void **state)
{
    (void)state;
    char victim[PATH_MAX], link_path[PATH_MAX + 8], index_path[PATH_MAX];
    dt_scratch("link_victim", victim, sizeof(victim));
    /* Beside the victim, not a scratch directory of its own: clearing
     * one would follow a link an earlier run left there. */
    snprintf(link_path, sizeof(link_path), "%s.link", victim);
    unlink(link_path);
    static const char theirs[] = "DIRC: not a kvh index";
    plant_foreign_dir(victim, index_path, sizeof(index_path), theirs, sizeof(theirs));
    assert_int_equal(symlink(victim, link_path), 0);
    kvh_engine *e;
    dt_assert_kvh(KVH_ERR_IO, open_store(link_path, &e));
    assert_null(e);
    expect_foreign_dir_untouched(victim, index_path, theirs, sizeof(theirs), "symbolic link");
}

/* disk_path naming a directory of someone else's with a file called
 * `index` (a web root, a build tree): refused before anything in it
 * changes, as through a link. An empty directory is made a store. */
static void test_directory_with_a_foreign_index_is_refused(void **state)
{
    (void)state;
    char dir[PATH_MAX], index_path[PATH_MAX];
    dt_scratch("foreign_index", dir, sizeof(dir));
    static const char theirs[] = "<html>someone's index page</html>";
    plant_foreign_dir(dir, index_path, sizeof(index_path), theirs, sizeof(theirs));
    kvh_engine *e;
    dt_assert_kvh(KVH_ERR_IO, open_store(dir, &e));
    expect_foreign_dir_untouched(dir, index_path, theirs, sizeof(theirs), "not a kvh store");
    /* Files shorter than kvh's 8-byte magic, an index or a journal, are
     * not kvh's either. */
    static const char *const names[] = {"index", "journal"};
    static const char *const short_ones[] = {"todo\n", "x", "KVHIDX"};
    for (size_t f = 0; f < 2; f++)
        for (size_t i = 0; i < 3; i++) {
            assert_int_equal(unlink(index_path), 0);
            dt_path(index_path, sizeof(index_path), dir, names[f]);
            assert_int_equal(dt_write_file(index_path, short_ones[i], strlen(short_ones[i])), 0);
            dt_assert_kvh(KVH_ERR_IO, open_store(dir, &e));
            expect_foreign_dir_untouched(dir, index_path, short_ones[i], strlen(short_ones[i]), "not a kvh store");
        }
    assert_int_equal(unlink(index_path), 0);
    dt_assert_ok(open_store(dir, &e));
    dt_assert_ok(dt_close(e));
}

/* A FIFO named `index` or `journal` where no store is: the check for a
 * foreign file opened it for reading and waited for a writer for ever.
 * Refused as another program's file, as a directory of that name is. */
static void test_fifo_or_directory_named_like_the_index_is_refused(void **state)
{
    (void)state;
    static const char *const names[] = {"index", "journal"};
    for (size_t f = 0; f < 2; f++)
        for (int as_dir = 0; as_dir < 2; as_dir++) {
            char dir[PATH_MAX], path[PATH_MAX];
            dt_scratch(as_dir ? "dir_as_index" : "fifo_as_index", dir, sizeof(dir));
            dt_path(path, sizeof(path), dir, names[f]);
            assert_int_equal(as_dir ? mkdir(path, 0700) : mkfifo(path, 0600), 0);
            alarm(20); /* a hang fails the test instead of the whole run */
            kvh_engine *e = NULL;
            dt_assert_kvh(KVH_ERR_IO, open_store(dir, &e));
            alarm(0);
            assert_null(e);
            if (!strstr(kvh_last_error(), names[f]) || !strstr(kvh_last_error(), "not a kvh store"))
                fail_msg("%s: %s", names[f], kvh_last_error());
            struct stat st;
            assert_int_equal(lstat(path, &st), 0);
            assert_true(as_dir ? S_ISDIR(st.st_mode) : S_ISFIFO(st.st_mode));
            char lock_path[PATH_MAX];
            assert_int_equal(access(dt_path(lock_path, sizeof(lock_path), dir, "LOCK"), F_OK), -1);
        }
}

/* An open refused because another engine holds the store changes
 * nothing of it: not the modes the holder's KVH_DISK_SHARE_GROUP asked
 * for (its group readers would lose the store), nor those of an
 * owner-only one. */
static void test_a_refused_open_changes_no_modes(void **state)
{
    (void)state;
    uint32_t holder_flags[] = {KVH_DISK_SHARE_GROUP, 0};
    for (size_t i = 0; i < 2; i++) {
        char dir[PATH_MAX];
        dt_scratch(i ? "refused-owner" : "refused-group", dir, sizeof(dir));
        make_store(dir, holder_flags[i]);
        kvh_config held = dt_cfg(G, dir, 4, 4, 16, 0);
        held.disk_flags = holder_flags[i];
        kvh_engine *a = dt_open_a(&held);
        kvh_config other = held;
        other.disk_flags = holder_flags[i] ^ KVH_DISK_SHARE_GROUP;
        kvh_engine *b = NULL;
        kvh_status st = kvh_engine_open(&other, &b);
        dt_track(b);
        assert_int_equal(st, KVH_ERR_BUSY);
        expect_store_modes("refused open", dir, holder_flags[i]);
        /* nor a mode the holder's owner set meanwhile */
        assert_int_equal(chmod(dir, 0500), 0);
        b = NULL;
        st = kvh_engine_open(&other, &b);
        dt_track(b);
        assert_int_equal(st, KVH_ERR_BUSY);
        assert_int_equal(mode_of(dir, NULL), 0500);
        assert_int_equal(chmod(dir, dir_mode_for(holder_flags[i])), 0);
        dt_assert_ok(dt_close(dt_untrack(a)));
    }
}

/* disk_path a link with "/", "//", "/." or "/./" after it: O_NOFOLLOW
 * stops no link a trailing slash resolves, so the open narrowed the
 * directory it names to 0700 and wrote its store there. */
static void test_a_link_with_a_trailing_slash_is_refused(void **state)
{
    (void)state;
    static const char *const tails[] = {"/", "//", "/.", "/./"};
    char victim[PATH_MAX], link_path[PATH_MAX + 8], given[PATH_MAX + 16], page[PATH_MAX];
    dt_scratch("slash_victim", victim, sizeof(victim));
    snprintf(link_path, sizeof(link_path), "%s.link", victim);
    unlink(link_path);
    assert_int_equal(chmod(victim, 0755), 0);
    assert_int_equal(dt_write_file(dt_path(page, sizeof(page), victim, "index.html"), "hi", 2), 0);
    assert_int_equal(symlink(victim, link_path), 0);
    for (size_t i = 0; i < sizeof(tails) / sizeof(tails[0]); i++) {
        snprintf(given, sizeof(given), "%s%s", link_path, tails[i]);
        kvh_engine *e;
        kvh_status st = open_store(given, &e);
        if (st != KVH_ERR_IO || !strstr(kvh_last_error(), "symbolic link"))
            fail_msg("%s: %s (%s)", given, kvh_status_name(st), kvh_last_error());
        assert_int_equal(mode_of(victim, NULL), 0755);
        char lock_path[PATH_MAX];
        assert_int_equal(access(dt_path(lock_path, sizeof(lock_path), victim, "LOCK"), F_OK), -1);
    }
    unlink(link_path);
    /* the store's own path with a trailing slash still opens */
    char dir[PATH_MAX];
    dt_scratch("slash_own", dir, sizeof(dir));
    snprintf(given, sizeof(given), "%s/./", dir);
    kvh_engine *e;
    dt_assert_ok(open_store(given, &e));
    dt_assert_ok(dt_close(e));
}

/* A LOCK file (LevelDB and others make one too) passed for a store: the
 * other program's `index` beside it was rebuilt over. */
static void test_a_lock_file_does_not_vouch_for_a_foreign_index(void **state)
{
    (void)state;
    char dir[PATH_MAX], index_path[PATH_MAX], lock_path[PATH_MAX];
    dt_scratch("lock_foreign", dir, sizeof(dir));
    static const char theirs[] = "MANIFEST-000001 of another program";
    plant_foreign_dir(dir, index_path, sizeof(index_path), theirs, sizeof(theirs));
    assert_int_equal(dt_write_file(dt_path(lock_path, sizeof(lock_path), dir, "LOCK"), "", 0), 0);
    kvh_engine *e;
    dt_assert_kvh(KVH_ERR_IO, open_store(dir, &e));
    if (!strstr(kvh_last_error(), "not a kvh store"))
        fail_msg("%s", kvh_last_error());
    size_t len = 0;
    uint8_t *bytes = dt_read_file(index_path, &len);
    assert_non_null(bytes);
    assert_int_equal(len, sizeof(theirs));
    assert_memory_equal(bytes, theirs, sizeof(theirs));
    free(bytes);
    assert_int_equal(mode_of(dir, NULL), 0755);
}

/* A directory that also holds the user's files keeps its mode (narrowed
 * to 0700, other users lost what was theirs to read there); kvh's files
 * still get 0600, and an empty directory is narrowed as before. */
static void test_a_directory_with_other_files_keeps_its_mode(void **state)
{
    (void)state;
    char dir[PATH_MAX], readme[PATH_MAX];
    dt_scratch("shared_dir", dir, sizeof(dir));
    assert_int_equal(chmod(dir, 0755), 0);
    assert_int_equal(dt_write_file(dt_path(readme, sizeof(readme), dir, "README"), "mine", 4), 0);
    for (int round = 0; round < 2; round++) {
        make_store(dir, 0);
        assert_int_equal(mode_of(dir, NULL), 0755);
        for (size_t i = 0; i < sizeof(FILES) / sizeof(FILES[0]); i++)
            if (mode_of(dir, FILES[i]) != 0600)
                fail_msg("%s has mode %04o, want 0600", FILES[i], mode_of(dir, FILES[i]));
    }
    assert_int_equal(unlink(readme), 0);
    make_store(dir, 0);
    assert_int_equal(mode_of(dir, NULL), 0700);
}

/* A store file with a second hard link (LOCK linked to a file outside):
 * the open truncated that file through it. Refused, the file kept. */
static void test_a_store_file_with_another_hard_link_is_refused(void **state)
{
    (void)state;
    char dir[PATH_MAX], outside[PATH_MAX + 8], inside[PATH_MAX];
    dt_scratch("hard_link", dir, sizeof(dir));
    make_store(dir, 0);
    snprintf(outside, sizeof(outside), "%s.keep", dir);
    static const char *const names[] = {"LOCK", "journal", "slab-0000.kvh"};
    for (size_t i = 0; i < sizeof(names) / sizeof(names[0]); i++) {
        dt_path(inside, sizeof(inside), dir, names[i]);
        unlink(outside);
        assert_int_equal(link(inside, outside), 0);
        struct stat before, after;
        assert_int_equal(stat(outside, &before), 0);
        kvh_engine *e;
        kvh_status st = open_store(dir, &e);
        if (st != KVH_ERR_IO || !strstr(kvh_last_error(), "hard links"))
            fail_msg("%s linked: %s (%s)", names[i], kvh_status_name(st), kvh_last_error());
        assert_int_equal(stat(outside, &after), 0);
        assert_int_equal(after.st_size, before.st_size);
        assert_int_equal(unlink(outside), 0);
        dt_assert_ok(open_store(dir, &e));
        dt_assert_ok(dt_close(e));
    }
}

/* An empty directory named index.tmp (or journal.tmp) in the store made
 * every close fail: "cannot write the disk index: File exists". */
static void test_an_empty_directory_in_place_of_a_temporary_file(void **state)
{
    (void)state;
    static const char *const names[] = {"index.tmp", "journal.tmp"};
    for (size_t i = 0; i < 2; i++) {
        char dir[PATH_MAX], tmp[PATH_MAX];
        dt_scratch(i ? "journal_tmp_dir" : "index_tmp_dir", dir, sizeof(dir));
        make_store(dir, 0);
        kvh_engine *e;
        dt_assert_ok(open_store(dir, &e));
        assert_int_equal(mkdir(dt_path(tmp, sizeof(tmp), dir, names[i]), 0700), 0);
        dt_assert_ok(dt_close(e));
        dt_assert_ok(open_store(dir, &e));
        dt_assert_ok(dt_close(e));
    }
}

/* LOCK and a slab file chmod-ed 0400 by their owner (chmod -R a-w): the
 * open failed with EACCES, though kvh.h says an owner's bits taken away
 * are given back. Run as another user: root reads and writes past modes. */
static int open_after_chmod_a_minus_w(const char *dir)
{
    make_store(dir, 0);
    char path[PATH_MAX];
    static const char *const names[] = {"LOCK", "slab-0000.kvh", "journal", "index"};
    for (size_t i = 0; i < sizeof(names) / sizeof(names[0]); i++)
        if (chmod(dt_path(path, sizeof(path), dir, names[i]), 0400) != 0)
            return 103;
    if (chmod(dir, 0500) != 0)
        return 104;
    kvh_config c = dt_cfg(G, dir, 4, 4, 16, 0);
    kvh_engine *e = NULL;
    kvh_status st = kvh_engine_open(&c, &e);
    if (st != KVH_OK) {
        fprintf(stderr, "open after chmod a-w: %s: %s\n", kvh_status_name(st), kvh_last_error());
        return 101;
    }
    return kvh_engine_close(e) == KVH_OK ? 0 : 102;
}

static void test_owner_bits_taken_from_lock_and_slab_are_given_back(void **state)
{
    (void)state;
    char dir[PATH_MAX];
    int rc = as_nobody("owner_bits", open_after_chmod_a_minus_w, dir, sizeof(dir));
    if (rc != 0)
        fail_msg("the store did not open after its owner took the write bits away (%d)", rc);
    assert_int_equal(mode_of(dir, NULL), 0700);
    for (size_t i = 0; i < sizeof(FILES) / sizeof(FILES[0]); i++)
        if (mode_of(dir, FILES[i]) != 0600)
            fail_msg("%s has mode %04o, want 0600", FILES[i], mode_of(dir, FILES[i]));
}

int main(void)
{
    const struct CMUnitTest tests[] = {
        cmocka_unit_test_teardown(test_owner_only_whatever_the_umask, dt_teardown),
        cmocka_unit_test_teardown(test_group_share_when_asked, dt_teardown),
        cmocka_unit_test_teardown(test_exact_modes_under_narrow_umasks, restore_umask),
        cmocka_unit_test_teardown(test_unprivileged_open_under_umask_0277, dt_teardown),
        cmocka_unit_test_teardown(test_wider_store_is_narrowed, dt_teardown),
        cmocka_unit_test_teardown(test_writable_by_others_is_refused, dt_teardown),
        cmocka_unit_test_teardown(test_planted_links_are_not_followed, dt_teardown),
        cmocka_unit_test_teardown(test_store_path_through_a_link_is_refused, dt_teardown),
        cmocka_unit_test_teardown(test_directory_with_a_foreign_index_is_refused, dt_teardown),
        cmocka_unit_test_teardown(test_fifo_or_directory_named_like_the_index_is_refused, dt_teardown),
        cmocka_unit_test_teardown(test_another_users_store_is_refused, dt_teardown),
        cmocka_unit_test_teardown(test_a_refused_open_changes_no_modes, dt_teardown),
        cmocka_unit_test_teardown(test_a_link_with_a_trailing_slash_is_refused, dt_teardown),
        cmocka_unit_test_teardown(test_a_lock_file_does_not_vouch_for_a_foreign_index, dt_teardown),
        cmocka_unit_test_teardown(test_a_directory_with_other_files_keeps_its_mode, dt_teardown),
        cmocka_unit_test_teardown(test_a_store_file_with_another_hard_link_is_refused, dt_teardown),
        cmocka_unit_test_teardown(test_owner_bits_taken_from_lock_and_slab_are_given_back, dt_teardown),
        cmocka_unit_test_teardown(test_an_empty_directory_in_place_of_a_temporary_file, dt_teardown),
    };
    return cmocka_run_group_tests_name("disk_access", tests, NULL, NULL);
}
