/* The functions of rel_util.h that every reliability test may use (see
 * there for what each does), compiled once into the test library
 * (tests/c/CMakeLists.txt). The wrappers of the C library calls are
 * rel_wrap.c's. */
#include "rel_util.h"

/* ---- counters ---- */

int rl_counters_add_up(kvh_engine *e, bool has_disk, char *msg, size_t len)
{
    kvh_stats s = dt_stats(e);
    uint64_t bb = 0;
    kvh_engine_block_bytes(e, &bb);
    uint64_t used[KVH_TIER_COUNT], disk_copies = 0;
    for (uint32_t t = 0; t < KVH_TIER_COUNT; t++) {
        kvh_tier_info ti = dt_tier(e, t);
        used[t] = ti.used_blocks;
        if (t == KVH_TIER_DISK)
            disk_copies = ti.clean_copies;
        if (ti.used_bytes != ti.used_blocks * bb || (ti.capacity_blocks && ti.block_bytes != bb) ||
            ti.used_blocks > ti.capacity_blocks || ti.pinned_blocks > ti.used_blocks) {
            snprintf(msg, len,
                     "tier %u: used_bytes %" PRIu64 " != used_blocks %" PRIu64 " x %" PRIu64 " (capacity %" PRIu64
                     ", pinned %" PRIu64 ")",
                     t, ti.used_bytes, ti.used_blocks, bb, ti.capacity_blocks, ti.pinned_blocks);
            return 1;
        }
    }
    if (s.blocks_freed > s.blocks_allocated) {
        snprintf(msg, len, "blocks_freed %" PRIu64 " > blocks_allocated %" PRIu64, s.blocks_freed, s.blocks_allocated);
        return 1;
    }
    uint64_t live = s.blocks_allocated - s.blocks_freed, mem = used[0] + used[1];
    /* Each live block holds one slot in its tier; with a disk tier a block
     * in memory may also keep a clean copy in a disk slot, which the disk
     * tier counts apart (has_disk no longer changes the rule). */
    (void)has_disk;
    if (disk_copies > used[2] || live != mem + used[2] - disk_copies) {
        snprintf(msg, len,
                 "live blocks (allocated %" PRIu64 " - freed %" PRIu64 " = %" PRIu64 ") do not match the slots in "
                 "use (device %" PRIu64 ", host %" PRIu64 ", disk %" PRIu64 " of which clean copies %" PRIu64 ")",
                 s.blocks_allocated, s.blocks_freed, live, used[0], used[1], used[2], disk_copies);
        return 1;
    }
    struct {
        const char *name;
        uint64_t blocks, bytes;
    } legs[] = {{"device_to_host", s.blocks_device_to_host, s.bytes_device_to_host},
                {"host_to_device", s.blocks_host_to_device, s.bytes_host_to_device},
                {"host_to_disk", s.blocks_host_to_disk, s.bytes_host_to_disk},
                {"disk_to_host", s.blocks_disk_to_host, s.bytes_disk_to_host}};
    for (size_t i = 0; i < sizeof(legs) / sizeof(legs[0]); i++)
        if (legs[i].bytes != legs[i].blocks * bb) {
            snprintf(msg, len, "bytes_%s %" PRIu64 " != blocks_%s %" PRIu64 " x %" PRIu64, legs[i].name, legs[i].bytes,
                     legs[i].name, legs[i].blocks, bb);
            return 1;
        }
    if (s.hits_device + s.hits_host + s.hits_disk != s.lookups) {
        snprintf(msg, len, "hits (%" PRIu64 " + %" PRIu64 " + %" PRIu64 ") != lookups %" PRIu64, s.hits_device,
                 s.hits_host, s.hits_disk, s.lookups);
        return 1;
    }
    if (s.prefix_hit_tokens < s.prefix_hit_blocks) {
        snprintf(msg, len, "prefix_hit_tokens %" PRIu64 " < prefix_hit_blocks %" PRIu64, s.prefix_hit_tokens,
                 s.prefix_hit_blocks);
        return 1;
    }
    return 0;
}

/* ---- fast scratch directories ---- */

bool rl_fast_scratch(const char *name, char *out, size_t len)
{
    const char *root = getenv("KVH_REL_FAST_DIR");
    if (!root || !*root)
        root = "/dev/shm";
    struct stat st;
    char dir[256];
    snprintf(dir, sizeof(dir), "%s/kvh-rel.%ld", root, (long)getpid());
    if (stat(root, &st) != 0 || !S_ISDIR(st.st_mode) || access(root, W_OK) != 0 ||
        (mkdir(dir, 0755) != 0 && errno != EEXIST)) {
        dt_scratch(name, out, len);
        return false;
    }
    snprintf(out, len, "%s/%s", dir, name);
    dt_rmrf(out);
    mkdir(out, 0755);
    return true;
}

void rl_fast_cleanup_pid(long pid)
{
    const char *root = getenv("KVH_REL_FAST_DIR");
    char dir[256];
    snprintf(dir, sizeof(dir), "%s/kvh-rel.%ld", root && *root ? root : "/dev/shm", pid);
    dt_rmrf(dir);
}

void rl_fast_cleanup(void) { rl_fast_cleanup_pid((long)getpid()); }

int rl_teardown(void **state)
{
    dt_teardown(state);
    rl_fast_cleanup();
    return 0;
}

/* ---- memory use ---- */

uint64_t rl_rss_bytes(void)
{
    FILE *f = fopen("/proc/self/statm", "r");
    unsigned long long size = 0, res = 0;
    if (f) {
        if (fscanf(f, "%llu %llu", &size, &res) != 2)
            res = 0;
        fclose(f);
    }
    return (uint64_t)res * (uint64_t)sysconf(_SC_PAGESIZE);
}
