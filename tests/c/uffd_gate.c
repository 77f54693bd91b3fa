#include "uffd_gate.h"

#include <fcntl.h>
#include <linux/userfaultfd.h>
#include <poll.h>
#include <stdlib.h>
#include <sys/ioctl.h>
#include <sys/mman.h>
#include <sys/syscall.h>
#include <unistd.h>

#include "test_util.h"

bool uffd_gate_arm(kvh_engine *e, uffd_gate *g, uffd_gate_geometry geo, int32_t first_token)
{
    *g = (uffd_gate){.fd = (int)syscall(SYS_userfaultfd, O_CLOEXEC | O_NONBLOCK), .mem = MAP_FAILED};
    if (g->fd < 0)
        return false;
    /* One slot: layer l's K at 2l, V at 2l + 1 (block_tokens rows each). */
    size_t row = (size_t)geo.kv_heads * geo.head_dim * sizeof(float), part = geo.block_tokens * row;
    size_t page = (size_t)sysconf(_SC_PAGESIZE), need = 2 * geo.layers * part;
    g->len = (need + page - 1) / page * page;
    g->mem = mmap(NULL, g->len, PROT_READ | PROT_WRITE, MAP_PRIVATE | MAP_ANONYMOUS, -1, 0);
    struct uffdio_api api = {.api = UFFD_API};
    struct uffdio_register reg = {.range = {(uintptr_t)g->mem, g->len}, .mode = UFFDIO_REGISTER_MODE_MISSING};
    if (g->mem == MAP_FAILED || ioctl(g->fd, UFFDIO_API, &api) != 0 || ioctl(g->fd, UFFDIO_REGISTER, &reg) != 0) {
        uffd_gate_free(g);
        return false;
    }
    void **kb = tu_alloc(sizeof(void *) * geo.layers), **vb = tu_alloc(sizeof(void *) * geo.layers);
    for (uint32_t l = 0; l < geo.layers; l++) {
        kb[l] = (char *)g->mem + 2 * l * part;
        vb[l] = (char *)g->mem + (2 * l + 1) * part;
    }
    kvh_pool_layout lay = {.struct_size = sizeof(lay),
                           .memory = KVH_MEMORY_HOST,
                           .num_slots = 1,
                           .k_base = kb,
                           .v_base = vb,
                           .slot_stride = need,
                           .token_stride = row,
                           .head_stride = geo.head_dim * sizeof(float)};
    assert_ok(kvh_pool_register(e, &lay, &g->pool));
    tu_free(kb);
    tu_free(vb);
    g->tokens = tu_alloc(sizeof(int32_t) * geo.block_tokens);
    for (uint32_t p = 0; p < geo.block_tokens; p++)
        g->tokens[p] = first_token + (int32_t)p;
    g->x = (kvh_pool_xfer){.struct_size = sizeof(kvh_pool_xfer), .slot = 0, .tokens = g->tokens};
    assert_ok(kvh_pool_offload_batch(e, g->pool, &g->x, 1, 0, &g->fence));
    /* Wait for the worker's fault: from then on it is stuck in the gather. */
    struct pollfd pfd = {.fd = g->fd, .events = POLLIN};
    if (poll(&pfd, 1, 10000) != 1)
        fail_msg("the offload batch never read its pool slot");
    struct uffd_msg msg;
    assert_true(read(g->fd, &msg, sizeof(msg)) == (ssize_t)sizeof(msg));
    assert_int_equal(msg.event, UFFD_EVENT_PAGEFAULT);
    return true;
}

void uffd_gate_open(uffd_gate *g)
{
    struct uffdio_zeropage z = {.range = {(uintptr_t)g->mem, g->len}};
    assert_int_equal(ioctl(g->fd, UFFDIO_ZEROPAGE, &z), 0);
}

void uffd_gate_free(uffd_gate *g)
{
    if (g->fd >= 0)
        close(g->fd);
    if (g->mem != MAP_FAILED)
        munmap(g->mem, g->len);
    tu_free(g->tokens);
    *g = (uffd_gate){.fd = -1, .mem = MAP_FAILED};
}
