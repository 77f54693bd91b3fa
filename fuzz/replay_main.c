/* Replays fuzz inputs without libFuzzer: every file named on the command
 * line, or found in a directory named there (sorted), is passed once to
 * LLVMFuzzerTestOneInput. Builds with any C compiler; ctest runs one such
 * program per target over fuzz/corpus/<target>/ (tests/c/CMakeLists.txt). */
#ifndef _GNU_SOURCE
#define _GNU_SOURCE
#endif
#include <dirent.h>
#include <dlfcn.h>
#include <execinfo.h>
#include <stdint.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <signal.h>
#include <sys/stat.h>
#include <sys/syscall.h>
#include <time.h>
#include <unistd.h>

int LLVMFuzzerTestOneInput(const uint8_t *data, size_t size);
int LLVMFuzzerInitialize(int *argc, char ***argv) __attribute__((weak));

/* A watchdog: an input that runs longer than this is a hang (the
 * libFuzzer runs use -timeout=25 the same way). KVH_FUZZ_REPLAY_TIMEOUT
 * overrides (seconds). A hang prints where every thread of the process
 * stands (a hang seen once, on a loaded machine, cannot be rerun). */
static const char *current;
static unsigned limit_s = 30;

#define STACK_DEPTH 24
static void *stack_frames[STACK_DEPTH];
static volatile sig_atomic_t stack_depth = -1;

static void on_stack_request(int sig)
{
    (void)sig;
    stack_depth = backtrace(stack_frames, STACK_DEPTH);
}

static void put(const char *text)
{
    if (write(2, text, strlen(text)) < 0)
        _exit(3);
}

/* One line per thread: its functions, innermost first. The replay links
 * with -rdynamic, so kvh_ and kvhi_ functions have names; static ones
 * print as offsets into the program, for addr2line. */
static void print_stack(long tid, int n)
{
    char line[2048];
    int at = snprintf(line, sizeof(line), "replay: thread %ld:", tid);
    for (int i = 2; i < n && at < (int)sizeof(line) - 80; i++) {
        Dl_info info;
        int found = dladdr(stack_frames[i], &info);
        if (found && info.dli_sname)
            at += snprintf(line + at, sizeof(line) - (size_t)at, " %s+%#lx", info.dli_sname,
                           (unsigned long)((char *)stack_frames[i] - (char *)info.dli_saddr));
        else if (found && info.dli_fname && info.dli_fbase)
            at += snprintf(line + at, sizeof(line) - (size_t)at, " %s@%#lx",
                           strrchr(info.dli_fname, '/') ? strrchr(info.dli_fname, '/') + 1 : info.dli_fname,
                           (unsigned long)((char *)stack_frames[i] - (char *)info.dli_fbase));
        else
            at += snprintf(line + at, sizeof(line) - (size_t)at, " %p", stack_frames[i]);
    }
    snprintf(line + at, sizeof(line) - (size_t)at, "\n");
    put(line);
}

/* Reads a small /proc file into out, its lines joined by " | ". */
static void read_proc(long tid, const char *what, char *out, size_t len)
{
    char path[96];
    snprintf(path, sizeof(path), "/proc/self/task/%ld/%s", tid, what);
    out[0] = '\0';
    FILE *f = fopen(path, "r");
    if (!f)
        return;
    size_t n = fread(out, 1, len - 1, f);
    fclose(f);
    out[n] = '\0';
    while (n && out[n - 1] == '\n')
        out[--n] = '\0';
    for (char *c = out; (c = strchr(c, '\n')) != NULL;)
        *c = '|';
}

/* Where each task waits in the kernel: its name (the kernel's own I/O
 * workers are tasks of the process too, named iou-wrk-*), the function
 * it sleeps in, and its kernel stack where the process may read it. */
static void print_kernel_side(long tid)
{
    char comm[64], wchan[128], stack[1536], line[1900];
    read_proc(tid, "comm", comm, sizeof(comm));
    read_proc(tid, "wchan", wchan, sizeof(wchan));
    read_proc(tid, "stack", stack, sizeof(stack));
    snprintf(line, sizeof(line), "replay: task %ld (%s): sleeps in %s%s%s\n", tid, comm, wchan[0] ? wchan : "-",
             stack[0] ? "; kernel stack: " : "", stack);
    put(line);
}

static void print_all_stacks(void)
{
    DIR *d = opendir("/proc/self/task");
    if (!d)
        return;
    struct dirent *de;
    while ((de = readdir(d)) != NULL) {
        long tid = atol(de->d_name);
        if (tid <= 0)
            continue;
        print_kernel_side(tid);
        stack_depth = -1;
        if (syscall(SYS_tgkill, getpid(), (pid_t)tid, SIGUSR2) != 0)
            continue;
        for (int waited = 0; stack_depth < 0 && waited < 200; waited++) {
            struct timespec ms = {0, 1000000};
            nanosleep(&ms, NULL);
        }
        if (stack_depth > 0)
            print_stack(tid, stack_depth);
    }
    closedir(d);
}

static void on_alarm(int sig)
{
    (void)sig;
    put("\nreplay: HANG: this input did not finish in time: ");
    put(current);
    put("\n");
    print_all_stacks();
    signal(SIGABRT, SIG_DFL);
    abort();
}

static int run_file(const char *path)
{
    current = path;
    FILE *f = fopen(path, "rb");
    if (!f) {
        fprintf(stderr, "replay: cannot open %s\n", path);
        return 1;
    }
    fseek(f, 0, SEEK_END);
    long len = ftell(f);
    fseek(f, 0, SEEK_SET);
    uint8_t *buf = malloc(len > 0 ? (size_t)len : 1);
    size_t got = buf ? fread(buf, 1, (size_t)len, f) : 0;
    fclose(f);
    if (!buf || got != (size_t)len) {
        free(buf);
        fprintf(stderr, "replay: cannot read %s\n", path);
        return 1;
    }
    alarm(limit_s);
    LLVMFuzzerTestOneInput(buf, got);
    alarm(0);
    free(buf);
    return 0;
}

static int cmp(const void *a, const void *b) { return strcmp(*(char *const *)a, *(char *const *)b); }

int main(int argc, char **argv)
{
    if (LLVMFuzzerInitialize)
        LLVMFuzzerInitialize(&argc, &argv);
    const char *t = getenv("KVH_FUZZ_REPLAY_TIMEOUT");
    if (t && atoi(t) > 0)
        limit_s = (unsigned)atoi(t);
    signal(SIGALRM, on_alarm);
    signal(SIGUSR2, on_stack_request);
    void *warm[2];
    backtrace(warm, 2); /* loads the unwinder now, not in a signal handler */
    long files = 0;
    int bad = 0;
    for (int i = 1; i < argc; i++) {
        struct stat st;
        if (stat(argv[i], &st) != 0) {
            fprintf(stderr, "replay: %s: not found\n", argv[i]);
            return 2;
        }
        if (!S_ISDIR(st.st_mode)) {
            bad |= run_file(argv[i]);
            files++;
            continue;
        }
        DIR *d = opendir(argv[i]);
        if (!d)
            return 2;
        char **names = NULL;
        size_t n = 0, cap = 0;
        struct dirent *de;
        while ((de = readdir(d)) != NULL) {
            if (de->d_name[0] == '.')
                continue;
            if (n == cap) {
                cap = cap ? cap * 2 : 64;
                names = realloc(names, cap * sizeof(*names));
            }
            size_t len = strlen(argv[i]) + strlen(de->d_name) + 2;
            names[n] = malloc(len);
            snprintf(names[n++], len, "%s/%s", argv[i], de->d_name);
        }
        closedir(d);
        qsort(names, n, sizeof(*names), cmp);
        for (size_t k = 0; k < n; k++) {
            bad |= run_file(names[k]);
            files++;
            free(names[k]);
        }
        free(names);
    }
    printf("replay: %ld input(s) run without a failure\n", files);
    if (files == 0) {
        fprintf(stderr, "replay: no inputs\n");
        return 2;
    }
    return bad;
}
