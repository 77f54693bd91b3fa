/* KV codec utilities: the engine's codecs on caller buffers, for measuring
 * their error and for front-ends that quantise KV themselves. */
#include "abi/api_common.h"
#include "kernels/cpu/kv_codec.h"

static kvh_status vector_bytes(uint32_t codec, uint32_t dtype, uint32_t head_dim, size_t *out)
{
    size_t n = kvhi_codec_vector_bytes(codec, dtype, head_dim);
    if (n == 0)
        return kvhi_fail(KVH_ERR_INVALID_ARG, "codec %u, dtype %u and head_dim %u do not fit together", codec, dtype,
                         head_dim);
    *out = n;
    return KVH_OK;
}

kvh_status kvh_codec_vector_bytes(uint32_t codec, uint32_t dtype, uint32_t head_dim, uint64_t *bytes)
{
    kvhi_clear_error();
    KVHI_REQUIRE(bytes, "bytes is NULL");
    size_t n = 0;
    kvh_status st = vector_bytes(codec, dtype, head_dim, &n);
    if (st == KVH_OK)
        *bytes = n;
    return st;
}

/* The checks encode and decode share: a known format, and buffers. */
static kvh_status check_transcode(uint32_t codec, uint32_t dtype, uint32_t head_dim, const void *src, size_t n_vectors,
                                  const void *dst)
{
    kvhi_clear_error();
    size_t n = 0;
    kvh_status st = vector_bytes(codec, dtype, head_dim, &n);
    if (st != KVH_OK)
        return st;
    KVHI_REQUIRE(n_vectors == 0 || (src && dst), "src and dst must not be NULL");
    /* No buffer of that many vectors fits in the address space. */
    size_t raw = (size_t)head_dim * (dtype == KVH_DTYPE_F32 ? 4 : 2), widest = n > raw ? n : raw;
    KVHI_REQUIRE(n_vectors <= PTRDIFF_MAX / widest, "%zu vectors of %zu bytes pass the address space", n_vectors,
                 widest);
    return KVH_OK;
}

kvh_status kvh_codec_encode(uint32_t codec, uint32_t dtype, uint32_t head_dim, const void *src, size_t n_vectors,
                            void *dst)
{
    kvh_status st = check_transcode(codec, dtype, head_dim, src, n_vectors, dst);
    if (st == KVH_OK)
        kvhi_codec_encode(codec, dtype, head_dim, src, n_vectors, dst);
    return st;
}

kvh_status kvh_codec_decode(uint32_t codec, uint32_t dtype, uint32_t head_dim, const void *src, size_t n_vectors,
                            void *dst)
{
    kvh_status st = check_transcode(codec, dtype, head_dim, src, n_vectors, dst);
    if (st == KVH_OK)
        kvhi_codec_decode(codec, dtype, head_dim, src, n_vectors, dst);
    return st;
}
