/* CUDA paged attention (attention.cu), used by backend_cuda.cu to fill the
 * attention entries of the backend table. Internal to libkvh_cuda.so. The
 * caller (backend_cuda.cu) has made the context's device current. */
#ifndef KVH_KERNELS_CUDA_ATTENTION_CUDA_H
#define KVH_KERNELS_CUDA_ATTENTION_CUDA_H

#include <stddef.h>
#include <stdint.h>

#include "kernels/attention_plan.h"

struct kvhc_attn;

/* Per-context state: device limits and a pool of per-call workspaces
 * (pinned plan staging + device plan and split-K partials). NULL with msg
 * filled on failure. */
kvhc_attn *kvhc_attn_create(int device, char *msg, size_t msg_len);
/* Frees every workspace; no call may be in flight (engine close). */
void kvhc_attn_destroy(kvhc_attn *st);
void kvhc_attn_plan_opts(const kvhc_attn *st, uint32_t threads, kvhi_attn_plan_opts *opts);
/* As kvhi_backend_ops.attention_run. */
int kvhc_attn_run(kvhc_attn *st, const kvhi_attn_plan *plan, const void *q, void *out, void *stream,
                  void (*done)(void *), void *done_arg, char *msg, size_t msg_len);

/* Persistent plans (kvhi_backend_ops.attention_plan_upload & co.). */
int kvhc_attn_plan_upload(kvhc_attn *st, const kvhi_attn_plan *plan, void **handle, char *msg, size_t msg_len);
int kvhc_attn_run_uploaded(kvhc_attn *st, void *handle, const void *q, void *out, void *stream, char *msg,
                           size_t msg_len);
void kvhc_attn_plan_free(kvhc_attn *st, void *handle);

#endif
