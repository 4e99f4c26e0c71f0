/* kvstash.c - libkvstash sessions, sequences and tables; see kvstash.h. */
#include "kvstash.h"

#include <errno.h>
#include <inttypes.h>
#include <pthread.h>
#include <stdarg.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/mman.h>
#include <sys/stat.h>
#include <sys/un.h>
#include <unistd.h>

#ifdef KVSTASH_HAVE_CUDA
#include <cuda_runtime.h>

#include "devmem.h"
#endif
#include "fdsock.h"
#include "kernels.h"
#include "kvstash_map.h"
#include "ops.h"
#include "kvstash/v1/store.pb-c.h"
#include "kvstash_step.h"
#include "pbjson.h"
#include "ring_client.h"
#include "rpc.h"
#include "table_edit.h"

#define KVS_ERRMSG_MAX 512

/* The newest table epoch this session has seen for one of its sequences; it
 * is sent back as ack_epoch (docs/protocol.md, "Tables, epochs and retired
 * blocks"). */
typedef struct seq_epoch {
    uint64_t seq_id;
    uint64_t epoch;
} seq_epoch;

struct kvs_session {
    rpc_channel *ch;
    rpc_stream *lease;
    int fd; /* the fd socket; open for the session's life */
    char token[FDSOCK_TOKEN_LEN + 1];
    uint64_t session_id, pool_id;
    kvs_geometry geom; /* the pool's, defaults filled in */
    kv_layout layout;
    const kv_ops *ops; /* the pool's backend's (session_layout) */
    char backend[16];  /* AttachResponse.backend: "host", "shadow" or "cuda" */
    uint8_t *pool;     /* what the worker sees: a device address */
    uint8_t *pool_map; /* the host mapping behind it (== pool for `host`; NULL for cuda) */
#ifdef KVSTASH_HAVE_CUDA
    kv_devmem_arena dev; /* cuda: the imported arena (kind NONE when none) */
#endif
    size_t pool_bytes, block_bytes;
    uint32_t block_count;
    /* A few sequences per session: a plain array, searched linearly. */
    seq_epoch *epochs;
    size_t nepochs, capepochs;
    ring_client ring; /* the per-step ring: appends and steps skip gRPC */
    /* The last step's cuts (kvs_step_result cut_start, cut), copied out of the ring. */
    uint32_t *cut_start, *cut;
    size_t cut_start_cap, cut_cap;
    float **step_rows; /* kvs_step_in_ring's tables */
    size_t step_rows_cap;
    void *stream; /* kvs_session_set_stream's CUDA stream, or NULL */
    char err[KVS_ERRMSG_MAX];
};

const char *kvs_strerror(int err)
{
    switch (err) {
    case KVS_OK:
        return "success";
    case KVS_ERR_INVALID:
        return "invalid argument";
    case KVS_ERR_NOT_FOUND:
        return "no such sequence or pool";
    case KVS_ERR_PERMISSION:
        return "permission denied";
    case KVS_ERR_PRECONDITION:
        return "failed precondition";
    case KVS_ERR_EXHAUSTED:
        return "pool exhausted";
    case KVS_ERR_UNAVAILABLE:
        return "kvstashd unavailable";
    case KVS_ERR_PROTOCOL:
        return "protocol error";
    case KVS_ERR_SYSTEM:
        return "system error";
    case KVS_ERR_DATA_LOSS:
        return "data lost in the remote tier";
    default:
        return "unknown error";
    }
}

static pthread_once_t default_once = PTHREAD_ONCE_INIT;
static char default_path[4096];

static void default_init(void)
{
    const char *rt = getenv("XDG_RUNTIME_DIR");
    if (rt != NULL && rt[0] == '/' &&
        (size_t)snprintf(default_path, sizeof default_path, "%s/kvstash/kvstashd.sock", rt) <
            sizeof default_path)
        return;
    strcpy(default_path, "/run/kvstash/kvstashd.sock");
}

const char *kvs_default_socket(void)
{
    pthread_once(&default_once, default_init);
    return default_path;
}

/* Set the session's last error message. */
__attribute__((format(printf, 2, 3))) static void fail(kvs_session *s, const char *fmt, ...)
{
    va_list ap;
    va_start(ap, fmt);
    vsnprintf(s->err, sizeof s->err, fmt, ap);
    va_end(ap);
}

const char *kvs_session_error(const kvs_session *s)
{
    return s != NULL ? s->err : "no session";
}

uint64_t kvs_session_id(const kvs_session *s)
{
    return s->session_id;
}

uint64_t kvs_session_pool_id(const kvs_session *s)
{
    return s->pool_id;
}

const kvs_geometry *kvs_session_geometry(const kvs_session *s)
{
    return &s->geom;
}

uint8_t *kvs_session_pool(const kvs_session *s)
{
    return s->pool;
}

const struct kv_ops *kvs_session_ops(const kvs_session *s)
{
    return s->ops;
}

const char *kvs_session_backend(const kvs_session *s)
{
    return s->backend;
}

int kvs_session_device(const kvs_session *s)
{
#ifdef KVSTASH_HAVE_CUDA
    if (s->ops == &kv_ops_cuda)
        return s->dev.device;
#endif
    (void)s;
    return -1;
}

size_t kvs_session_pool_bytes(const kvs_session *s)
{
    return s->pool_bytes;
}

size_t kvs_session_block_bytes(const kvs_session *s)
{
    return s->block_bytes;
}

uint32_t kvs_session_block_count(const kvs_session *s)
{
    return s->block_count;
}

/* ---- the ordering contract (kvstash.h) ---- */

/* Wait for the worker's registered stream: 0, or -1 when the device
 * failed (kv_ops_cuda_last_error says how). */
static int stream_sync(const kvs_session *s)
{
#ifdef KVSTASH_HAVE_CUDA
    if (s->stream != NULL)
        return kv_ops_cuda_synchronize(s->stream);
#else
    (void)s;
#endif
    return 0;
}

/* Every request to the daemon starts here: nothing the worker queued on
 * its registered stream may still touch the pool when the daemon acts. */
static int session_quiesce(kvs_session *s, const char *what)
{
    if (stream_sync(s) == 0)
        return KVS_OK;
#ifdef KVSTASH_HAVE_CUDA
    fail(s, "%s: synchronising the worker's CUDA stream failed: %s", what,
         kv_ops_cuda_last_error());
#else
    fail(s, "%s: synchronising the worker's stream failed", what);
#endif
    return KVS_ERR_SYSTEM;
}

/* A unary call of the Store service on the session's channel and token. */
static int session_rpc(kvs_session *s, const char *method, const ProtobufCMessage *req,
                       const ProtobufCMessageDescriptor *resp_desc, ProtobufCMessage **resp)
{
    char path[64];
    int rc = session_quiesce(s, method);
    if (rc != KVS_OK)
        return rc;
    snprintf(path, sizeof path, RPC_STORE("%s"), method);
    return rpc_unary(s->ch, path, s->token, req, resp_desc, resp, s->err, sizeof s->err);
}

int kvs_session_set_stream(kvs_session *s, void *stream)
{
    if (s == NULL)
        return KVS_ERR_INVALID;
    if (stream != NULL && strcmp(s->backend, "cuda") != 0) {
        fail(s,
             "kvs_session_set_stream: this session's pool is on the \"%s\" backend, which has "
             "no device streams (only a worker of a cuda pool registers a CUDA stream)",
             s->backend);
        return KVS_ERR_PRECONDITION;
    }
    s->stream = stream;
    return KVS_OK;
}

/* ---- the per-session epoch map ---- */

static seq_epoch *epoch_find(kvs_session *s, uint64_t seq_id)
{
    for (size_t i = 0; i < s->nepochs; i++)
        if (s->epochs[i].seq_id == seq_id)
            return &s->epochs[i];
    return NULL;
}

static uint64_t epoch_get(kvs_session *s, uint64_t seq_id)
{
    seq_epoch *e = epoch_find(s, seq_id);
    return e != NULL ? e->epoch : 0;
}

/* Remember `epoch` for the sequence if it is newer. Out of memory only
 * loses the ack (retired blocks then wait for the next one), so it is not an
 * error. */
static void epoch_seen(kvs_session *s, uint64_t seq_id, uint64_t epoch)
{
    seq_epoch *e = epoch_find(s, seq_id);
    if (e != NULL) {
        if (epoch > e->epoch)
            e->epoch = epoch;
        return;
    }
    if (s->nepochs == s->capepochs) {
        size_t cap = s->capepochs ? 2 * s->capepochs : 8;
        seq_epoch *n = realloc(s->epochs, cap * sizeof *n);
        if (n == NULL)
            return;
        s->epochs = n;
        s->capepochs = cap;
    }
    s->epochs[s->nepochs++] = (seq_epoch){seq_id, epoch};
}

static void epoch_forget(kvs_session *s, uint64_t seq_id)
{
    seq_epoch *e = epoch_find(s, seq_id);
    if (e != NULL)
        *e = s->epochs[--s->nepochs];
}

/* ---- attach and detach ---- */

static size_t dtype_size(int dtype)
{
    switch (dtype) {
    case KVS_FP16:
    case KVS_BF16:
        return 2;
    case KVS_FP32:
        return 4;
    default:
        return 0;
    }
}

/* Free everything the session holds; each part may be absent. */
static void session_free(kvs_session *s)
{
    if (s->lease != NULL)
        rpc_stream_close(s->lease, NULL, 0);
#ifdef KVSTASH_HAVE_CUDA
    if (s->dev.kind != KV_DEVMEM_NONE) {
        /* Nothing of ours may still read or write the arena: wait for the
         * device, then release the import, and only then close the fd
         * socket (below), which lets the daemon reuse the blocks. */
        cudaSetDevice(s->dev.device);
        cudaDeviceSynchronize();
        kv_devmem_release(&s->dev, NULL, 0);
        s->pool = NULL;
    }
#endif
    if (s->pool != NULL && s->pool != s->pool_map)
        kv_shadow_unmap(s->pool);
    if (s->pool_map != NULL)
        munmap(s->pool_map, s->pool_bytes);
    ring_client_close(&s->ring);
    if (s->fd >= 0)
        close(s->fd);
    rpc_channel_close(s->ch);
    free(s->epochs);
    free(s->cut_start);
    free(s->cut);
    free(s->step_rows);
    free(s);
}

/* Take the pool's geometry and layout from the AttachResponse, and check
 * that the layout it documents is the one kernels.h computes. */
static int session_layout(kvs_session *s, const Kvstash__V1__AttachResponse *r)
{
    const Kvstash__V1__Geometry *g = r->geometry;
    /* The backends whose pools this libkvstash maps (daemon/backend.h):
     * host memory as it is, or behind a shadow range (tests). */
    if (strcmp(r->backend, "host") == 0) {
        s->ops = &kv_ops_cpu;
    } else if (strcmp(r->backend, "shadow") == 0) {
        s->ops = &kv_ops_shadow;
    } else if (strcmp(r->backend, "cuda") == 0) {
#ifdef KVSTASH_HAVE_CUDA
        s->ops = &kv_ops_cuda;
#else
        fail(s, "kvstashd offers a \"cuda\" pool (GPU memory); this libkvstash was built "
                "without CUDA");
        return KVS_ERR_PRECONDITION;
#endif
    } else {
        fail(s,
             "kvstashd offers a \"%s\" pool; this libkvstash maps only \"host\", "
             "\"shadow\" and \"cuda\" pools",
             r->backend);
        return KVS_ERR_PROTOCOL;
    }
    snprintf(s->backend, sizeof s->backend, "%s", r->backend);
    size_t elt = g != NULL ? dtype_size(g->dtype) : 0;
    if (g == NULL || elt == 0 || g->layers == 0 || g->kv_heads == 0 || g->head_dim == 0 ||
        g->block_tokens == 0) {
        fail(s, "Attach: kvstashd sent no valid pool geometry");
        return KVS_ERR_PROTOCOL;
    }
    s->session_id = r->session_id;
    s->pool_id = r->pool_id;
    s->geom = (kvs_geometry){.layers = g->layers,
                             .q_heads = g->q_heads,
                             .kv_heads = g->kv_heads,
                             .head_dim = g->head_dim,
                             .block_tokens = g->block_tokens,
                             .dtype = (kvs_dtype)g->dtype,
                             .rope_theta = g->rope_theta};
    s->layout = (kv_layout){.kv_heads = g->kv_heads,
                            .block_tokens = g->block_tokens,
                            .head_dim = g->head_dim,
                            .elt_size = (uint32_t)elt};
    uint64_t need = (uint64_t)g->kv_heads * g->block_tokens * g->head_dim * elt * 2;
    if (r->block_bytes != need || r->block_bytes != kv_block_bytes(&s->layout)) {
        fail(s, "Attach: block_bytes %" PRIu64 " does not match the geometry (%" PRIu64 ")",
             r->block_bytes, need);
        return KVS_ERR_PROTOCOL;
    }
    if (r->block_count == 0 || r->pool_bytes > SIZE_MAX ||
        r->pool_bytes / r->block_bytes < r->block_count) {
        fail(s,
             "Attach: %" PRIu32 " blocks of %" PRIu64 " bytes do not fit a %" PRIu64 "-byte pool",
             r->block_count, r->block_bytes, r->pool_bytes);
        return KVS_ERR_PROTOCOL;
    }
    s->pool_bytes = (size_t)r->pool_bytes;
    s->block_bytes = (size_t)r->block_bytes;
    s->block_count = r->block_count;
    return KVS_OK;
}

/* Step 2: the Attach call. */
static int session_rpc_attach(kvs_session *s, const char *tenant, const char *model,
                              const kvs_geometry *geometry, const char *worker_name)
{
    Kvstash__V1__Geometry g = KVSTASH__V1__GEOMETRY__INIT;
    g.layers = geometry->layers;
    g.q_heads = geometry->q_heads;
    g.kv_heads = geometry->kv_heads;
    g.head_dim = geometry->head_dim;
    g.dtype = (Kvstash__V1__DType)geometry->dtype;
    g.block_tokens = geometry->block_tokens;
    g.rope_theta = geometry->rope_theta;
    Kvstash__V1__AttachRequest req = KVSTASH__V1__ATTACH_REQUEST__INIT;
    req.model = (char *)model;
    req.geometry = &g;
    req.worker_name = (char *)(worker_name != NULL ? worker_name : "");
    req.tenant = (char *)tenant;
    ProtobufCMessage *resp;
    int rc = session_rpc(s, "Attach", &req.base, &kvstash__v1__attach_response__descriptor, &resp);
    if (rc != KVS_OK)
        return rc;
    rc = session_layout(s, (Kvstash__V1__AttachResponse *)resp);
    protobuf_c_message_free_unpacked(resp, NULL);
    return rc;
}

#ifdef KVSTASH_HAVE_CUDA
/* This process's ordinal of the GPU with that UUID (devices are renumbered
 * by containers and CUDA_VISIBLE_DEVICES: the daemon's number means nothing
 * here). */
static int cuda_find_device(kvs_session *s, const uint8_t uuid[KVSTASH_GPU_UUID_BYTES], int *device)
{
    char text[KVSTASH_GPU_UUID_TEXT];
    kvstash_gpu_uuid_format(uuid, text);
    int count = 0;
    cudaError_t e = cudaGetDeviceCount(&count);
    if (e != cudaSuccess) {
        fail(s,
             "the pool is in GPU memory (%s) but this process has no usable CUDA device: %s (%s)",
             text, cudaGetErrorName(e), cudaGetErrorString(e));
        return KVS_ERR_PRECONDITION;
    }
    for (int i = 0; i < count; i++) {
        struct cudaDeviceProp prop;
        if (cudaGetDeviceProperties(&prop, i) == cudaSuccess &&
            memcmp(prop.uuid.bytes, uuid, KVSTASH_GPU_UUID_BYTES) == 0) {
            *device = i;
            return KVS_OK;
        }
    }
    fail(s,
         "the pool is on GPU %s, which this process does not see (%d device%s; check "
         "CUDA_VISIBLE_DEVICES and the container's devices)",
         text, count, count == 1 ? "" : "s");
    return KVS_ERR_PRECONDITION;
}

/* Import a cuda pool: the GPU by UUID, kv_devmem_import, the fd closed at
 * once (the import holds the allocation). */
static int session_import(kvs_session *s, const kvstash_map_answer *map, int fd)
{
    int device = -1, rc = KVS_OK;
    if (map->kind != KVSTASH_MAP_CUDA_VMM && map->kind != KVSTASH_MAP_CUDA_LEGACY) {
        fail(s, "MAP: kvstashd sent a %s answer for a cuda pool", kvstash_map_kind_name(map->kind));
        rc = KVS_ERR_PROTOCOL;
    } else if (map->bytes < s->pool_bytes || map->bytes > SIZE_MAX) {
        fail(s, "MAP: kvstashd announced a %" PRIu64 "-byte arena for a %zu-byte pool", map->bytes,
             s->pool_bytes);
        rc = KVS_ERR_PROTOCOL;
    } else {
        rc = cuda_find_device(s, map->gpu_uuid, &device);
    }
    if (rc == KVS_OK && kv_ops_cuda_device() >= 0 && kv_ops_cuda_device() != device) {
        fail(s,
             "this process already uses CUDA device %d for kvstash pools; the pool is on "
             "device %d (kv_ops_cuda serves one device per process)",
             kv_ops_cuda_device(), device);
        rc = KVS_ERR_PRECONDITION;
    }
    if (rc == KVS_OK) {
        kv_devmem_desc d = {.kind = map->kind == KVSTASH_MAP_CUDA_VMM ? KV_DEVMEM_VMM
                                                                      : KV_DEVMEM_LEGACY,
                            .bytes = (size_t)map->bytes,
                            .fd = fd};
        memcpy(d.legacy_handle, map->legacy_handle, sizeof d.legacy_handle);
        char err[512];
        if (kv_devmem_import(&d, device, &s->dev, err, sizeof err) != 0) {
            fail(s, "cannot map the pool's GPU memory: %s", err);
            rc = KVS_ERR_SYSTEM;
        } else {
            kv_ops_cuda_set_device(device);
            s->pool = s->dev.ptr;
        }
    }
    if (fd >= 0)
        close(fd);
    return rc;
}
#endif

/* Step 3: MAP the pool (its memfd, mmapped; or its CUDA arena, imported). */
static int session_map(kvs_session *s)
{
    int memfd;
    kvstash_map_answer map;
    int rc = fdsock_map(s->fd, s->pool_id, &map, &memfd, s->err, sizeof s->err);
    if (rc != KVS_OK)
        return rc;
#ifdef KVSTASH_HAVE_CUDA
    if (s->ops == &kv_ops_cuda)
        return session_import(s, &map, memfd);
#endif
    uint64_t bytes = map.bytes;
    struct stat st;
    if (map.kind != KVSTASH_MAP_MEMFD) {
        fail(s, "MAP: kvstashd sent a CUDA %s arena for a \"%s\" pool",
             kvstash_map_kind_name(map.kind), s->backend);
        rc = KVS_ERR_PROTOCOL;
    } else if (bytes != s->pool_bytes) {
        fail(s, "MAP: kvstashd announced %" PRIu64 " bytes, Attach said %zu", bytes, s->pool_bytes);
        rc = KVS_ERR_PROTOCOL;
    } else if (fstat(memfd, &st) != 0 || (uint64_t)st.st_size < bytes) {
        fail(s, "MAP: the pool's file is smaller than %zu bytes", s->pool_bytes);
        rc = KVS_ERR_PROTOCOL;
    } else {
        void *p =
            mmap(NULL, s->pool_bytes, PROT_READ | PROT_WRITE, MAP_SHARED | MAP_POPULATE, memfd, 0);
        if (p == MAP_FAILED) {
            fail(s, "mmap of the %zu-byte pool: %s", s->pool_bytes, strerror(errno));
            rc = KVS_ERR_SYSTEM;
        } else {
            s->pool_map = p;
            s->pool = s->ops == &kv_ops_shadow ? kv_shadow_map(p, s->pool_bytes) : p;
            if (s->pool == NULL) {
                fail(s, "cannot reserve a %zu-byte shadow range", s->pool_bytes);
                rc = KVS_ERR_SYSTEM;
            }
        }
    }
    if (memfd >= 0)
        close(memfd);
    return rc;
}

/* Step 4: open the Lease and wait for "granted". */
static int session_lease(kvs_session *s)
{
    Kvstash__V1__LeaseRequest req = KVSTASH__V1__LEASE_REQUEST__INIT;
    ProtobufCMessage *first;
    int rc = rpc_stream_open(s->ch, RPC_STORE("Lease"), s->token, &req.base,
                             &kvstash__v1__lease_message__descriptor, &first, &s->lease, s->err,
                             sizeof s->err);
    if (rc != KVS_OK)
        return rc;
    const Kvstash__V1__LeaseMessage *m = (const Kvstash__V1__LeaseMessage *)first;
    if (strcmp(m->state, "granted") != 0) {
        fail(s, "Lease: kvstashd answered \"%s\", not \"granted\"", m->state);
        rc = strcmp(m->state, "shutdown") == 0 ? KVS_ERR_UNAVAILABLE : KVS_ERR_PROTOCOL;
    }
    protobuf_c_message_free_unpacked(first, NULL);
    return rc;
}

static int session_ring(kvs_session *s)
{
    int memfd;
    uint64_t bytes;
    int rc = fdsock_ring(s->fd, &memfd, &bytes, s->err, sizeof s->err);
    if (rc == KVS_OK)
        rc = ring_client_open(&s->ring, memfd, bytes, s->fd, s->err, sizeof s->err);
    return rc;
}

int kvs_session_attach(const char *socket_path, const char *model, const kvs_geometry *geometry,
                       const char *worker_name, kvs_session **out, char *err, size_t errlen)
{
    return kvs_session_attach_tenant(socket_path, NULL, model, geometry, worker_name, out, err,
                                     errlen);
}

int kvs_session_attach_tenant(const char *socket_path, const char *tenant, const char *model,
                              const kvs_geometry *geometry, const char *worker_name,
                              kvs_session **out, char *err, size_t errlen)
{
    if (tenant == NULL)
        tenant = getenv("KVSTASH_TENANT");
    if (tenant == NULL)
        tenant = "";
    if (out != NULL)
        *out = NULL;
    if (err != NULL && errlen > 0)
        err[0] = '\0';
    if (out == NULL || model == NULL || geometry == NULL) {
        if (err != NULL && errlen > 0)
            snprintf(err, errlen, "kvs_session_attach: out, model and geometry are required");
        return KVS_ERR_INVALID;
    }
    if (socket_path == NULL)
        socket_path = kvs_default_socket();
    kvs_session *s = calloc(1, sizeof *s);
    if (s == NULL) {
        if (err != NULL && errlen > 0)
            snprintf(err, errlen, "kvs_session_attach: out of memory");
        return KVS_ERR_SYSTEM;
    }
    s->fd = -1;
    int rc = fdsock_connect(socket_path, &s->fd, s->err, sizeof s->err);
    if (rc == KVS_OK)
        rc = fdsock_hello(s->fd, s->token, s->err, sizeof s->err);
    if (rc == KVS_OK) {
        s->ch = rpc_channel_open(socket_path);
        if (s->ch == NULL) {
            fail(s, "cannot create a gRPC channel to unix:%s", socket_path);
            rc = KVS_ERR_SYSTEM;
        }
    }
    if (rc == KVS_OK)
        rc = session_rpc_attach(s, tenant, model, geometry, worker_name);
    if (rc == KVS_OK)
        rc = session_map(s);
    if (rc == KVS_OK)
        rc = session_lease(s);
    if (rc == KVS_OK)
        rc = session_ring(s);
    if (rc != KVS_OK) {
        if (err != NULL && errlen > 0)
            snprintf(err, errlen, "%s", s->err);
        session_free(s);
        return rc;
    }
    *out = s;
    return KVS_OK;
}

int kvs_session_detach(kvs_session *s)
{
    if (s == NULL)
        return KVS_ERR_INVALID;
    Kvstash__V1__DetachRequest req = KVSTASH__V1__DETACH_REQUEST__INIT;
    ProtobufCMessage *resp;
#ifdef KVSTASH_HAVE_CUDA
    /* Not only the registered stream: no kernel of this process may touch
     * the pool once the daemon frees the session's blocks. */
    if (s->ops == &kv_ops_cuda)
        (void)kv_ops_cuda_synchronize(NULL);
#endif
    int rc = session_rpc(s, "Detach", &req.base, &kvstash__v1__detach_response__descriptor, &resp);
    if (rc == KVS_OK)
        protobuf_c_message_free_unpacked(resp, NULL);
    session_free(s);
    return rc;
}

/* ---- sequences ---- */

int kvs_seq_create(kvs_session *s, const char *policy, const kvs_param *params, size_t nparams,
                   const char *label, uint64_t *seq_id)
{
    if (s == NULL)
        return KVS_ERR_INVALID;
    if (policy == NULL || seq_id == NULL || (params == NULL && nparams > 0)) {
        fail(s, "kvs_seq_create: policy and seq_id are required");
        return KVS_ERR_INVALID;
    }
    Kvstash__V1__CreateSequenceRequest req = KVSTASH__V1__CREATE_SEQUENCE_REQUEST__INIT;
    Kvstash__V1__Param *pv = NULL, **pp = NULL;
    if (nparams > 0) {
        pv = calloc(nparams, sizeof *pv);
        pp = calloc(nparams, sizeof *pp);
        if (pv == NULL || pp == NULL) {
            free(pv);
            free(pp);
            fail(s, "kvs_seq_create: out of memory");
            return KVS_ERR_SYSTEM;
        }
    }
    for (size_t i = 0; i < nparams; i++) {
        if (params[i].key == NULL || params[i].value == NULL) {
            free(pv);
            free(pp);
            fail(s, "kvs_seq_create: parameter %zu has no key or value", i);
            return KVS_ERR_INVALID;
        }
        kvstash__v1__param__init(&pv[i]);
        pv[i].key = (char *)params[i].key;
        pv[i].value = (char *)params[i].value;
        pp[i] = &pv[i];
    }
    req.policy = (char *)policy;
    req.n_params = nparams;
    req.params = pp;
    req.label = (char *)(label != NULL ? label : "");
    ProtobufCMessage *resp;
    int rc = session_rpc(s, "CreateSequence", &req.base,
                         &kvstash__v1__create_sequence_response__descriptor, &resp);
    free(pv);
    free(pp);
    if (rc != KVS_OK)
        return rc;
    const Kvstash__V1__CreateSequenceResponse *r =
        (const Kvstash__V1__CreateSequenceResponse *)resp;
    *seq_id = r->seq_id;
    epoch_seen(s, r->seq_id, r->epoch);
    protobuf_c_message_free_unpacked(resp, NULL);
    return KVS_OK;
}

int kvs_seq_export(kvs_session *s, uint64_t seq_id, char uid[KVS_EXPORT_UID_LEN + 1])
{
    if (s == NULL)
        return KVS_ERR_INVALID;
    if (uid == NULL) {
        fail(s, "kvs_seq_export: uid is required");
        return KVS_ERR_INVALID;
    }
    Kvstash__V1__ExportSequenceRequest req = KVSTASH__V1__EXPORT_SEQUENCE_REQUEST__INIT;
    req.seq_id = seq_id;
    ProtobufCMessage *resp;
    int rc = session_rpc(s, "ExportSequence", &req.base,
                         &kvstash__v1__export_sequence_response__descriptor, &resp);
    if (rc != KVS_OK)
        return rc;
    const Kvstash__V1__ExportSequenceResponse *r = (const void *)resp;
    snprintf(uid, KVS_EXPORT_UID_LEN + 1, "%s", r->uid);
    protobuf_c_message_free_unpacked(resp, NULL);
    return KVS_OK;
}

int kvs_seq_import(kvs_session *s, const char *uid, uint64_t *seq_id, uint64_t *appended)
{
    if (s == NULL)
        return KVS_ERR_INVALID;
    if (uid == NULL || seq_id == NULL) {
        fail(s, "kvs_seq_import: uid and seq_id are required");
        return KVS_ERR_INVALID;
    }
    Kvstash__V1__ImportSequenceRequest req = KVSTASH__V1__IMPORT_SEQUENCE_REQUEST__INIT;
    req.uid = (char *)uid;
    ProtobufCMessage *resp;
    int rc = session_rpc(s, "ImportSequence", &req.base,
                         &kvstash__v1__import_sequence_response__descriptor, &resp);
    if (rc != KVS_OK)
        return rc;
    const Kvstash__V1__ImportSequenceResponse *r = (const void *)resp;
    *seq_id = r->seq_id;
    if (appended != NULL)
        *appended = r->appended;
    epoch_seen(s, r->seq_id, r->epoch);
    protobuf_c_message_free_unpacked(resp, NULL);
    return KVS_OK;
}

int kvs_seq_spill(kvs_session *s, uint64_t seq_id, kvs_spill *out)
{
    if (s == NULL)
        return KVS_ERR_INVALID;
    if (out == NULL) {
        fail(s, "kvs_seq_spill: out is required");
        return KVS_ERR_INVALID;
    }
    Kvstash__V1__SpillSequenceRequest req = KVSTASH__V1__SPILL_SEQUENCE_REQUEST__INIT;
    req.seq_id = seq_id;
    ProtobufCMessage *resp;
    int rc = session_rpc(s, "SpillSequence", &req.base,
                         &kvstash__v1__spill_sequence_response__descriptor, &resp);
    if (rc != KVS_OK)
        return rc;
    const Kvstash__V1__SpillSequenceResponse *r = (const void *)resp;
    *out = (kvs_spill){.blocks = r->blocks,
                       .values = r->values,
                       .sketches = r->sketches,
                       .dropped = r->dropped,
                       .tokens = r->tokens,
                       .bytes = r->bytes,
                       .spilled_tokens = r->spilled_tokens};
    snprintf(out->uid, sizeof out->uid, "%s", r->uid);
    protobuf_c_message_free_unpacked(resp, NULL);
    return KVS_OK;
}

int kvs_seq_release(kvs_session *s, uint64_t seq_id)
{
    if (s == NULL)
        return KVS_ERR_INVALID;
    Kvstash__V1__ReleaseSequenceRequest req = KVSTASH__V1__RELEASE_SEQUENCE_REQUEST__INIT;
    req.seq_id = seq_id;
    ProtobufCMessage *resp;
    int rc = session_rpc(s, "ReleaseSequence", &req.base,
                         &kvstash__v1__release_sequence_response__descriptor, &resp);
    if (rc != KVS_OK)
        return rc;
    protobuf_c_message_free_unpacked(resp, NULL);
    epoch_forget(s, seq_id);
    return KVS_OK;
}

/* ---- tables ---- */

void kvs_table_free(kvs_table *t)
{
    if (t == NULL)
        return;
    table_room_free(t); /* the arrays lists grew into (table_edit.c) */
    free(t->layer);     /* one allocation: layers, then segments, then positions */
    memset(t, 0, sizeof *t);
}

static kv_layout row_layout(const kvs_session *s);

/* The slots a segment of each tier (room[tier], KVS_TIER_INT2 + 1 of them)
 * may name in its block, as this side computes them from the list's layout
 * (the table must say the same: a quantised block the daemon claims to be
 * larger would be read past its pool block); 0 for a tier no segment with
 * a block may have. Once per list, not per segment. */
static void tier_rooms(const kvs_session *s, const Kvstash__V1__LayerTable *lt, uint64_t *room)
{
    kv_layout lay = lt->per_head ? row_layout(s) : s->layout;
    lay.quant_group = lt->quant_group;
    memset(room, 0, (KVS_TIER_INT2 + 1) * sizeof *room);
    room[KVS_TIER_FULL] = lay.block_tokens;
    room[KVS_TIER_INT8] =
        lt->int8_block_tokens == kv_int8_tokens_per_block(&lay) ? lt->int8_block_tokens : 0;
    room[KVS_TIER_INT4] =
        lt->int4_block_tokens == kv_lowbit_tokens_per_block(&lay, 4) ? lt->int4_block_tokens : 0;
    room[KVS_TIER_INT2] =
        lt->int2_block_tokens == kv_lowbit_tokens_per_block(&lay, 2) ? lt->int2_block_tokens : 0;
}

/* Check one LayerTable against the pool before anyone writes through it: a
 * bad table from the daemon must not make a worker scribble outside its
 * blocks. */
static int layer_check(kvs_session *s, const Kvstash__V1__LayerTable *lt, const char *what)
{
    if (lt->n_first_slot != lt->n_block || lt->n_count != lt->n_block) {
        fail(s, "%s: layer %" PRIu32 " has %zu blocks, %zu first slots and %zu counts", what,
             lt->layer, lt->n_block, lt->n_first_slot, lt->n_count);
        return KVS_ERR_PROTOCOL;
    }
    uint64_t total = 0;
    if (lt->n_tier != 0 && lt->n_tier != lt->n_block) {
        fail(s, "%s: layer %" PRIu32 " has %zu segments and %zu tiers", what, lt->layer,
             lt->n_block, lt->n_tier);
        return KVS_ERR_PROTOCOL;
    }
    if (lt->per_head && lt->head >= s->geom.kv_heads) {
        fail(s, "%s: layer %" PRIu32 " names KV head %" PRIu32 " of %" PRIu32, what, lt->layer,
             lt->head, s->geom.kv_heads);
        return KVS_ERR_PROTOCOL;
    }
    uint64_t rooms[KVS_TIER_INT2 + 1];
    tier_rooms(s, lt, rooms);
    for (size_t i = 0; i < lt->n_block; i++) {
        uint32_t tier = lt->n_tier ? lt->tier[i] : KVS_TIER_FULL;
        uint64_t room = tier <= KVS_TIER_INT2 ? rooms[tier] : 0;
        if (tier == KVS_TIER_SKETCH && lt->block[i] == KVS_NO_BLOCK && lt->count[i] > 0) {
            total += lt->count[i];
            continue;
        }
        if (room == 0 || lt->block[i] >= s->block_count || lt->count[i] == 0 ||
            (uint64_t)lt->first_slot[i] + lt->count[i] > room) {
            fail(s,
                 "%s: layer %" PRIu32 " segment %zu (block %" PRIu32 ", slots %" PRIu32 "+%" PRIu32
                 ") is outside the pool",
                 what, lt->layer, i, lt->block[i], lt->first_slot[i], lt->count[i]);
            return KVS_ERR_PROTOCOL;
        }
        total += lt->count[i];
    }
    if (total != lt->tokens || (lt->n_positions != 0 && lt->n_positions != lt->tokens)) {
        fail(s,
             "%s: layer %" PRIu32 " says %" PRIu32 " tokens, its segments hold %" PRIu64
             " and it has %zu positions",
             what, lt->layer, lt->tokens, total, lt->n_positions);
        return KVS_ERR_PROTOCOL;
    }
    return KVS_OK;
}

/* Label the entries of a table: entry i is layer i / heads, head i % heads. */
static void list_labels(kvs_layer *ly, uint32_t n, uint32_t heads)
{
    for (uint32_t i = 0; i < n; i++) {
        ly[i].layer = i / heads;
        ly[i].head = heads > 1 ? i % heads : 0;
        ly[i].per_head = heads > 1;
    }
}

/*
 * Build a kvs_table with one entry per layer of the geometry from the
 * daemon's LayerTables (layers it does not mention are empty). Everything is
 * one allocation, owned by out->layer.
 */
static int table_fill(kvs_session *s, Kvstash__V1__LayerTable **lts, size_t n, const char *what,
                      kvs_table *out)
{
    uint32_t heads = n > 0 && lts[0]->per_head ? s->geom.kv_heads : 1;
    uint32_t layers = s->geom.layers * heads;
    size_t nseg = 0, npos = 0;
    for (size_t i = 0; i < n; i++) {
        int rc = layer_check(s, lts[i], what);
        if (rc == KVS_OK && (lts[i]->per_head != 0) != (heads > 1)) {
            fail(s, "%s: a table mixes per-head and all-heads lists", what);
            rc = KVS_ERR_PROTOCOL;
        }
        if (rc != KVS_OK)
            return rc;
        if (lts[i]->layer >= s->geom.layers) {
            fail(s, "%s: layer %" PRIu32 " out of range (%" PRIu32 " layers)", what, lts[i]->layer,
                 s->geom.layers);
            return KVS_ERR_PROTOCOL;
        }
        nseg += lts[i]->n_block;
        npos += lts[i]->n_positions;
    }
    size_t bytes =
        layers * sizeof(kvs_layer) + nseg * sizeof(kvs_segment) + npos * sizeof(uint32_t);
    /* Not calloc: a long table's segments and positions are all written
     * below, and zeroing megabytes first cost as much as their copy. */
    char *mem = malloc(bytes);
    if (mem == NULL) {
        fail(s, "%s: out of memory for a %zu-byte table", what, bytes);
        return KVS_ERR_SYSTEM;
    }
    kvs_layer *ly = (kvs_layer *)mem;
    memset(ly, 0, layers * sizeof *ly);
    kvs_segment *seg = (kvs_segment *)(mem + layers * sizeof(kvs_layer));
    uint32_t *pos = (uint32_t *)(seg + nseg);
    list_labels(ly, layers, heads);
    for (size_t i = 0; i < n; i++) {
        const Kvstash__V1__LayerTable *lt = lts[i];
        kvs_layer *l = &ly[lt->layer * heads + (heads > 1 ? lt->head : 0)];
        if (l->segments != NULL || l->positions != NULL || l->tokens != 0) {
            free(mem);
            fail(s, "%s: layer %" PRIu32 " appears twice", what, lt->layer);
            return KVS_ERR_PROTOCOL;
        }
        l->tokens = lt->tokens;
        l->int8_block_tokens = lt->int8_block_tokens;
        l->int4_block_tokens = lt->int4_block_tokens;
        l->int2_block_tokens = lt->int2_block_tokens;
        l->quant_group = lt->quant_group;
        l->nsegments = lt->n_block;
        l->segments = lt->n_block > 0 ? seg : NULL;
        for (size_t j = 0; j < lt->n_block; j++)
            *seg++ = (kvs_segment){lt->block[j], lt->first_slot[j], lt->count[j],
                                   lt->n_tier ? lt->tier[j] : KVS_TIER_FULL};
        if (lt->n_positions > 0) {
            l->positions = pos;
            memcpy(pos, lt->positions, lt->n_positions * sizeof *pos);
            pos += lt->n_positions;
        }
    }
    out->layers = layers;
    out->heads = heads;
    out->layer = ly;
    return KVS_OK;
}

/* One ring round trip, polling `spins` times before sleeping
 * (ring_client.h); the daemon's status becomes a kvs_err + message. */
static int ring_call_spin(kvs_session *s, const char *what, uint32_t spins, ring_response *resp)
{
    int rc = session_quiesce(s, what);
    if (rc != KVS_OK)
        return rc;
    rc = ring_client_call_spin(&s->ring, spins, resp);
    if (rc != KVS_OK) {
        fail(s,
             "%s: no answer from kvstashd on the session's ring (the session ended, or the "
             "daemon died, is stopped or hung)",
             what);
        return rc;
    }
    if (resp->code != 0) {
        fail(s, "%s: %.*s", what, (int)sizeof resp->msg, resp->msg);
        return rpc_code_to_err(resp->code);
    }
    return KVS_OK;
}

static int ring_call(kvs_session *s, const char *what, ring_response *resp)
{
    return ring_call_spin(s, what, RING_CLIENT_SPIN, resp);
}

/* The moves of a demotion that an APPEND answer carries after its writes,
 * which end at `end` (proto/kvstash_ring.h ring_append_moves), given to
 * *writes for kvs_table_extend. Without the memory for them, none: a table
 * they would have moved is read again. */
static int moves_from_ring(kvs_session *s, const uint8_t *end, kvs_table *writes)
{
    size_t at = ((size_t)(end - s->ring.data) + 7) / 8 * 8;
    ring_append_moves h;
    if (at > s->ring.data_bytes || s->ring.data_bytes - at < sizeof h)
        goto bad;
    memcpy(&h, s->ring.data + at, sizeof h);
    at += sizeof h;
    if (h.nruns > (s->ring.data_bytes - at) / sizeof(ring_moved_run))
        goto bad;
    kvs_moved_run *runs = malloc((h.nruns ? h.nruns : 1) * sizeof *runs);
    if (runs == NULL)
        return KVS_OK;
    for (uint32_t i = 0; i < h.nruns; i++) {
        ring_moved_run m;
        memcpy(&m, s->ring.data + at + (size_t)i * sizeof m, sizeof m);
        runs[i] = (kvs_moved_run){m.list, m.first, {m.block, m.first_slot, m.count, m.tier}};
        if (m.list >= writes->layers || m.block >= s->block_count || m.tier == KVS_TIER_SKETCH ||
            m.tier > KVS_TIER_INT2) {
            free(runs);
            goto bad;
        }
    }
    table_moves_attach(writes, h.from_epoch, h.to_epoch, runs, h.nruns);
    free(runs);
    return KVS_OK;
bad:
    fail(s, "Append: kvstashd's moves on the ring are malformed");
    return KVS_ERR_PROTOCOL;
}

/* The ring's APPEND answer: per layer a segment count, then the segments;
 * every layer gets room for exactly `count` tokens inside the pool. */
static int table_from_ring(kvs_session *s, uint32_t count, const ring_response *r, kvs_table *out)
{
    uint32_t heads = r->lists_per_layer > 1 ? s->geom.kv_heads : 1;
    uint32_t layers = s->geom.layers * heads;
    uint64_t slots = (uint64_t)s->geom.block_tokens * heads;
    if (r->lists_per_layer > 1 && r->lists_per_layer != s->geom.kv_heads) {
        fail(s, "Append: kvstashd answered with %" PRIu32 " lists per layer", r->lists_per_layer);
        return KVS_ERR_PROTOCOL;
    }
    const uint32_t *in = (const uint32_t *)s->ring.data;
    const uint32_t *end = (const uint32_t *)(s->ring.data + s->ring.data_bytes);
    size_t bytes = layers * sizeof(kvs_layer) + (size_t)r->nsegments * sizeof(kvs_segment) +
                   (size_t)layers * count * sizeof(uint32_t);
    char *mem = calloc(1, bytes);
    if (mem == NULL) {
        fail(s, "Append: out of memory for a %zu-byte table", bytes);
        return KVS_ERR_SYSTEM;
    }
    kvs_layer *ly = (kvs_layer *)mem;
    kvs_segment *seg = (kvs_segment *)(mem + layers * sizeof(kvs_layer));
    uint32_t *pos = (uint32_t *)(seg + r->nsegments);
    size_t used = 0;
    list_labels(ly, layers, heads);
    for (uint32_t l = 0; l < layers; l++) {
        uint32_t n = in < end ? *in++ : UINT32_MAX;
        if (n > r->nsegments - used || (size_t)(end - in) < (size_t)n * 3)
            goto bad;
        ly[l].tokens = count;
        ly[l].nsegments = n;
        ly[l].segments = seg + used;
        ly[l].positions = pos + (size_t)l * count;
        uint64_t total = 0;
        for (uint32_t i = 0; i < n; i++, in += 3) {
            kvs_segment g = {in[0], in[1], in[2], KVS_TIER_FULL};
            if (g.block >= s->block_count || g.count == 0 ||
                (uint64_t)g.first_slot + g.count > slots)
                goto bad;
            seg[used++] = g;
            total += g.count;
        }
        if (total != count)
            goto bad;
        for (uint32_t i = 0; i < count; i++)
            ly[l].positions[i] = r->first_position + i;
    }
    *out = (kvs_table){r->epoch, r->first_position, r->evicted, layers, heads, ly, NULL};
    if (r->moves && moves_from_ring(s, (const uint8_t *)in, out) != KVS_OK) {
        kvs_table_free(out);
        return KVS_ERR_PROTOCOL;
    }
    return KVS_OK;
bad:
    free(mem);
    fail(s,
         "Append: kvstashd's answer on the ring describes slots outside the pool or not "
         "exactly %" PRIu32 " tokens per layer",
         count);
    return KVS_ERR_PROTOCOL;
}

int kvs_seq_append(kvs_session *s, uint64_t seq_id, int64_t count, kvs_table *writes)
{
    if (writes != NULL)
        memset(writes, 0, sizeof *writes);
    if (s == NULL)
        return KVS_ERR_INVALID;
    if (writes == NULL) {
        fail(s, "kvs_seq_append: writes is required");
        return KVS_ERR_INVALID;
    }
    ring_request *q = &s->ring.hdr->req;
    memset(q, 0, sizeof *q);
    q->op = RING_OP_APPEND;
    q->seq_id = seq_id;
    q->count = count;
    q->ack_epoch = epoch_get(s, seq_id);
    ring_response r;
    int rc = ring_call(s, "Append", &r);
    if (rc == KVS_OK)
        rc = table_from_ring(s, (uint32_t)count, &r, writes);
    if (rc == KVS_OK)
        epoch_seen(s, seq_id, r.epoch);
    return rc;
}

_Static_assert(KVS_STEP_SCORE == STEP_SCORE && KVS_STEP_LAST_ATTN == STEP_LAST_ATTN &&
                   KVS_STEP_WINDOW_ATTN == STEP_WINDOW_ATTN && KVS_STEP_VNORM == STEP_VNORM,
               "kvstash.h's step bits are proto/kvstash_step.h's");

/* The layout of a step with `arrays` over lists holding tokens (of
 * `heads` lists a layer) in the ring's data area, checked; `who` names
 * the call in errors. */
static int step_shape_of(kvs_session *s, const char *who, uint32_t heads, const uint32_t *tokens,
                         unsigned arrays, step_shape *sh)
{
    uint32_t kv = s->geom.kv_heads;
    heads = heads > 1 ? heads : 1;
    *sh = (step_shape){s->geom.layers, s->geom.q_heads, kv, heads, arrays};
    if (arrays != 0 && tokens == NULL) {
        fail(s, "%s: tokens (per list) is required with statistics", who);
        return KVS_ERR_INVALID;
    }
    if (heads != 1 && heads != kv) {
        fail(s, "%s: heads must be 1 or kv_heads (%" PRIu32 ")", who, kv);
        return KVS_ERR_INVALID;
    }
    size_t floats = arrays != 0 ? step_floats(sh, tokens) : 0;
    if (floats > s->ring.data_bytes / sizeof(float)) {
        fail(s,
             "%s: the statistics (%zu bytes) exceed the ring's data area (%zu bytes): "
             "start kvstashd with a larger --ring-mb",
             who, floats * sizeof(float), s->ring.data_bytes);
        return KVS_ERR_INVALID;
    }
    return KVS_OK;
}

/* Lay the step's arrays out in the ring's data area (proto/kvstash_step.h). */
static int step_write(kvs_session *s, const kvs_step *st, uint32_t *arrays, uint64_t *bytes)
{
    const float *const *const kinds[STEP_KINDS] = {st->score, st->last_attn, st->window_attn,
                                                   st->vnorm};
    unsigned bits = 0;
    for (int k = 0; k < STEP_KINDS; k++)
        bits |= kinds[k] != NULL ? step_kind_bit(k) : 0;
    step_shape sh;
    int rc = step_shape_of(s, "kvs_seq_step", st->heads, st->tokens, bits, &sh);
    if (rc != KVS_OK)
        return rc;
    *arrays = bits;
    size_t used = bits != 0 ? step_pack(&sh, st->tokens, kinds, (float *)s->ring.data,
                                        s->ring.data_bytes / sizeof(float))
                            : 0;
    *bytes = used * sizeof(float);
    return KVS_OK;
}

int kvs_step_in_ring(kvs_session *s, uint32_t heads, const uint32_t *tokens, unsigned arrays,
                     kvs_step_rows *out)
{
    if (s == NULL)
        return KVS_ERR_INVALID;
    if (out == NULL || arrays == 0 || (arrays & ~(unsigned)STEP_ARRAYS) != 0) {
        fail(s, "kvs_step_in_ring: arrays must be KVS_STEP_* bits, at least one, and out is "
                "required");
        return KVS_ERR_INVALID;
    }
    step_shape sh;
    int rc = step_shape_of(s, "kvs_step_in_ring", heads, tokens, arrays, &sh);
    if (rc != KVS_OK)
        return rc;
    /* One table of row pointers, each array's rows a part of it. */
    size_t want = (size_t)sh.layers * step_layer_slots(&sh);
    if (want > s->step_rows_cap) {
        float **grown = realloc(s->step_rows, want * sizeof *grown);
        if (grown == NULL) {
            fail(s, "kvs_step_in_ring: out of memory");
            return KVS_ERR_SYSTEM;
        }
        s->step_rows = grown;
        s->step_rows_cap = want;
    }
    float **kinds[STEP_KINDS];
    size_t at = 0;
    for (int k = 0; k < STEP_KINDS; k++) {
        unsigned bit = step_kind_bit(k);
        kinds[k] = arrays & bit ? s->step_rows + at : NULL;
        at += arrays & bit ? (size_t)sh.layers * step_kind_rows(&sh, bit) : 0;
    }
    float *data = (float *)s->ring.data;
    step_cursor c;
    step_cursor_init(&c, &sh, tokens);
    while (step_cursor_next(&c)) {
        kinds[__builtin_ctz(c.kind)][(size_t)c.layer * step_kind_rows(&sh, c.kind) + c.row] =
            data + c.offset;
    }
    *out = (kvs_step_rows){kinds[0], kinds[1], kinds[2], kinds[3]};
    return KVS_OK;
}

/* Grow *a to hold n uint32s; -1 when out of memory. */
static int u32_reserve(uint32_t **a, size_t *cap, size_t n)
{
    if (n <= *cap)
        return 0;
    size_t c = *cap ? *cap : 64;
    while (c < n)
        c *= 2;
    uint32_t *g = realloc(*a, c * sizeof *g);
    if (g == NULL)
        return -1;
    *a = g;
    *cap = c;
    return 0;
}

/* A STEP answer's cuts (proto/kvstash_ring.h ring_step_cuts), copied out
 * of the ring into the session's arrays for *out. Out of memory, they are
 * left out (the worker reads the table instead). */
static int step_cuts_read(kvs_session *s, kvs_step_result *out)
{
    ring_step_cuts h;
    memcpy(&h, s->ring.data, sizeof h);
    uint64_t words = (uint64_t)h.nlists + h.total;
    if ((h.nlists != s->geom.layers && h.nlists != s->geom.layers * s->geom.kv_heads) ||
        words > (s->ring.data_bytes - sizeof h) / sizeof(uint32_t)) {
        fail(s, "Step: kvstashd's cuts on the ring say %" PRIu32 " lists and %" PRIu32 " tokens",
             h.nlists, h.total);
        return KVS_ERR_PROTOCOL;
    }
    if (u32_reserve(&s->cut_start, &s->cut_start_cap, (size_t)h.nlists + 1) != 0 ||
        u32_reserve(&s->cut, &s->cut_cap, h.total ? h.total : 1) != 0)
        return KVS_OK;
    const uint32_t *count = (const uint32_t *)(s->ring.data + sizeof h);
    uint64_t at = 0;
    for (uint32_t i = 0; i < h.nlists; i++) {
        s->cut_start[i] = (uint32_t)at;
        at += count[i];
        if (at > h.total) {
            fail(s, "Step: kvstashd's cuts on the ring count more than their %" PRIu32 " tokens",
                 h.total);
            return KVS_ERR_PROTOCOL;
        }
    }
    s->cut_start[h.nlists] = (uint32_t)at;
    memcpy(s->cut, count + h.nlists, (size_t)at * sizeof *s->cut);
    out->cut_epoch = h.from_epoch;
    out->cut_lists = h.nlists;
    out->cut_start = s->cut_start;
    out->cut = s->cut;
    return KVS_OK;
}

int kvs_seq_step(kvs_session *s, uint64_t seq_id, const kvs_step *step, kvs_step_result *out)
{
    if (s == NULL)
        return KVS_ERR_INVALID;
    if (step == NULL) {
        fail(s, "kvs_seq_step: step is required");
        return KVS_ERR_INVALID;
    }
    ring_request *q = &s->ring.hdr->req;
    uint32_t arrays;
    uint64_t bytes;
    int rc = step_write(s, step, &arrays, &bytes);
    if (rc != KVS_OK)
        return rc;
    memset(q, 0, sizeof *q);
    q->op = RING_OP_STEP;
    q->arrays = arrays;
    q->seq_id = seq_id;
    q->ack_epoch = epoch_get(s, seq_id);
    q->new_tokens = step->new_tokens;
    q->prefill = step->prefill != 0;
    q->score_queries = step->score_queries;
    q->window_queries = step->window_queries;
    q->confidence = step->confidence;
    q->data_bytes = bytes;
    ring_response r;
    rc = ring_call(s, "Step", &r);
    if (rc == KVS_OK) {
        epoch_seen(s, seq_id, r.epoch);
        if (out != NULL) {
            *out = (kvs_step_result){.epoch = r.epoch, .evicted = r.evicted};
            if (r.cuts)
                rc = step_cuts_read(s, out);
        }
    }
    return rc;
}

int kvs_seq_epoch(kvs_session *s, uint64_t seq_id, uint64_t *epoch)
{
    if (s == NULL || epoch == NULL)
        return KVS_ERR_INVALID;
    ring_request *q = &s->ring.hdr->req;
    memset(q, 0, sizeof *q);
    q->op = RING_OP_EPOCH;
    q->seq_id = seq_id;
    q->ack_epoch = epoch_get(s, seq_id);
    ring_response r;
    int rc = ring_call(s, "Epoch", &r);
    if (rc == KVS_OK)
        *epoch = r.epoch;
    return rc;
}

int kvs_ring_ping(kvs_session *s)
{
    if (s == NULL)
        return KVS_ERR_INVALID;
    s->ring.hdr->req.op = RING_OP_PING;
    ring_response r;
    return ring_call(s, "Ping", &r);
}

static int table_grpc(kvs_session *s, uint64_t seq_id, int with_positions, kvs_table *out)
{
    Kvstash__V1__GetBlockTableRequest req = KVSTASH__V1__GET_BLOCK_TABLE_REQUEST__INIT;
    req.seq_id = seq_id;
    req.with_positions = with_positions != 0;
    req.ack_epoch = epoch_get(s, seq_id);
    ProtobufCMessage *resp;
    int rc = session_rpc(s, "GetBlockTable", &req.base,
                         &kvstash__v1__get_block_table_response__descriptor, &resp);
    if (rc != KVS_OK)
        return rc;
    const Kvstash__V1__GetBlockTableResponse *r = (const Kvstash__V1__GetBlockTableResponse *)resp;
    rc = table_fill(s, r->layers, r->n_layers, "GetBlockTable", out);
    if (rc == KVS_OK)
        out->epoch = r->epoch;
    protobuf_c_message_free_unpacked(resp, NULL);
    return rc;
}

/* A ring TABLE answer (proto/kvstash_ring.h) of `bytes` at a, in the
 * shared ring, as LayerTables lts[nlists] for table_fill's checks. What is
 * checked (headers, segments, tiers) is copied out first, into u[3 *
 * nsegments] and tier[nsegments]; the positions, which are data, not
 * checked, are read once, straight from the ring into the caller's table.
 * -1 when it is malformed. */
static int table_ring_parse(const uint8_t *a, uint64_t bytes, uint32_t nlists, uint64_t nsegments,
                            Kvstash__V1__LayerTable *lts, uint32_t *u, uint32_t *tier)
{
    uint64_t at = sizeof(ring_table_reply), seen = 0;
    for (uint32_t l = 0; l < nlists; l++) {
        ring_table_list h;
        if (bytes - at < sizeof h)
            return -1;
        memcpy(&h, a + at, sizeof h);
        at += sizeof h;
        uint64_t n = h.nsegments, words = 3 * n + h.npositions;
        uint64_t need = words * sizeof(uint32_t) + (n + 3) / 4 * 4;
        if (bytes - at < need || n > nsegments - seen)
            return -1;
        const uint8_t *t8 = a + at + words * sizeof(uint32_t);
        uint32_t *seg = u + 3 * seen;
        memcpy(seg, a + at, 3 * n * sizeof *seg);
        Kvstash__V1__LayerTable *lt = &lts[l];
        kvstash__v1__layer_table__init(lt);
        lt->layer = h.layer;
        lt->head = h.head;
        lt->per_head = h.per_head != 0;
        lt->tokens = h.tokens;
        lt->int8_block_tokens = h.int8_block_tokens;
        lt->int4_block_tokens = h.int4_block_tokens;
        lt->int2_block_tokens = h.int2_block_tokens;
        lt->quant_group = h.quant_group;
        lt->n_block = lt->n_first_slot = lt->n_count = lt->n_tier = n;
        lt->block = seg;
        lt->first_slot = seg + n;
        lt->count = seg + 2 * n;
        lt->n_positions = h.npositions;
        lt->positions = (uint32_t *)(a + at + 3 * n * sizeof(uint32_t));
        lt->tier = tier + seen;
        for (uint64_t i = 0; i < n; i++)
            lt->tier[i] = t8[i];
        seen += n;
        at += need;
    }
    return seen == nsegments ? 0 : -1;
}

/* GetBlockTable through the ring (RING_OP_TABLE): a memcpy where gRPC
 * packs and unpacks a varint a position. KVS_ERR_EXHAUSTED when the table
 * would not fit the data area: the caller asks gRPC. */
static int table_ring(kvs_session *s, uint64_t seq_id, int with_positions, kvs_table *out)
{
    ring_request *q = &s->ring.hdr->req;
    ring_table_request in = {with_positions != 0, 0};
    memset(q, 0, sizeof *q);
    q->op = RING_OP_TABLE;
    q->seq_id = seq_id;
    q->ack_epoch = epoch_get(s, seq_id);
    q->data_bytes = sizeof in;
    memcpy(s->ring.data, &in, sizeof in);
    ring_response r;
    int rc = ring_call(s, "GetBlockTable", &r);
    if (rc != KVS_OK)
        return rc;
    ring_table_reply h;
    memcpy(&h, s->ring.data, sizeof h);
    if (h.bytes < sizeof h || h.bytes > s->ring.data_bytes ||
        h.nlists > (h.bytes - sizeof h) / sizeof(ring_table_list) ||
        r.nsegments > (h.bytes - sizeof h) / 13) {
        fail(s,
             "GetBlockTable: kvstashd's answer on the ring says %" PRIu64 " bytes, %" PRIu32
             " lists and %" PRIu32 " segments",
             h.bytes, h.nlists, r.nsegments);
        return KVS_ERR_PROTOCOL;
    }
    Kvstash__V1__LayerTable *lts = malloc((h.nlists ? h.nlists : 1) * sizeof *lts);
    Kvstash__V1__LayerTable **ptrs = malloc((h.nlists ? h.nlists : 1) * sizeof *ptrs);
    uint32_t *u = malloc((4 * (size_t)r.nsegments + 1) * sizeof *u); /* segments, then tiers */
    if (lts == NULL || ptrs == NULL || u == NULL) {
        fail(s, "GetBlockTable: out of memory for a %" PRIu64 "-byte table", h.bytes);
        rc = KVS_ERR_SYSTEM;
    } else if (table_ring_parse(s->ring.data, h.bytes, h.nlists, r.nsegments, lts, u,
                                u + 3 * (size_t)r.nsegments) != 0) {
        fail(s, "GetBlockTable: kvstashd's answer on the ring is malformed");
        rc = KVS_ERR_PROTOCOL;
    } else {
        for (uint32_t l = 0; l < h.nlists; l++)
            ptrs[l] = &lts[l];
        rc = table_fill(s, ptrs, h.nlists, "GetBlockTable", out);
        if (rc == KVS_OK)
            out->epoch = r.epoch;
    }
    free(lts);
    free(ptrs);
    free(u);
    return rc;
}

int kvs_seq_table(kvs_session *s, uint64_t seq_id, int with_positions, kvs_table *out)
{
    if (out != NULL)
        memset(out, 0, sizeof *out);
    if (s == NULL)
        return KVS_ERR_INVALID;
    if (out == NULL) {
        fail(s, "kvs_seq_table: out is required");
        return KVS_ERR_INVALID;
    }
    /* The ring, unless the table does not fit its data area (or the daemon
     * lacked the memory to build it): then gRPC, whose answer stands. */
    int rc = table_ring(s, seq_id, with_positions, out);
    if (rc == KVS_ERR_EXHAUSTED)
        rc = table_grpc(s, seq_id, with_positions, out);
    if (rc != KVS_OK)
        return rc;
    epoch_seen(s, seq_id, out->epoch);
    for (uint32_t l = 0; with_positions && l < out->layers; l++) {
        if (out->layer[l].tokens == 0 && out->layer[l].positions == NULL)
            out->layer[l].positions = table_no_positions; /* for kvs_table_extend */
        if (out->layer[l].tokens > 0 && out->layer[l].positions == NULL) {
            fail(s, "GetBlockTable: layer %" PRIu32 " came without positions", l);
            kvs_table_free(out);
            return KVS_ERR_PROTOCOL;
        }
    }
    return KVS_OK;
}

/* ---- K/V access ---- */

void *kvs_key_ptr(const kvs_session *s, uint32_t block, uint32_t head, uint32_t slot)
{
    return s->pool + kv_key_offset(&s->layout, block, head, slot);
}

void *kvs_value_ptr(const kvs_session *s, uint32_t block, uint32_t head, uint32_t slot)
{
    return s->pool + kv_key_offset(&s->layout, block, head, slot) + s->block_bytes / 2;
}

/* A per-head list's blocks are the same bytes seen as one head of
 * kv_heads * block_tokens rows. */
static kv_layout row_layout(const kvs_session *s)
{
    kv_layout l = s->layout;
    l.block_tokens *= l.kv_heads;
    l.kv_heads = 1;
    return l;
}

void *kvs_row_key_ptr(const kvs_session *s, uint32_t block, uint32_t row)
{
    kv_layout l = row_layout(s);
    return s->pool + kv_key_offset(&l, block, 0, row);
}

void *kvs_row_value_ptr(const kvs_session *s, uint32_t block, uint32_t row)
{
    return (uint8_t *)kvs_row_key_ptr(s, block, row) + s->block_bytes / 2;
}

/* Copy the K and V rows of one full-precision segment between the pool
 * and a worker's contiguous buffers, starting at token `tok` of them: per
 * half, one strided copy of kv_heads runs (the head stride differs on the
 * two sides). */
static int segment_copy(const kvs_session *s, const kv_layout *lay, const kvs_layer *layer,
                        const kvs_segment *g, size_t tok, uint8_t *k, uint8_t *v, int to_pool,
                        int dev)
{
    size_t row = (size_t)lay->head_dim * lay->elt_size, width = g->count * row;
    size_t pitch_pool = (size_t)lay->block_tokens * row, pitch_buf = layer->tokens * row;
    uint8_t *pk = s->pool + kv_key_offset(lay, g->block, 0, g->first_slot);
    uint8_t *pv = pk + s->block_bytes / 2;
    uint8_t *bk = k + tok * row, *bv = v + tok * row;
    const kv_ops *ops = s->ops;
    if (to_pool) {
        kv_copy_dir dir = dev ? KV_DEVICE_TO_DEVICE : KV_HOST_TO_DEVICE;
        return ops->copy_2d(dir, pk, pitch_pool, bk, pitch_buf, width, lay->kv_heads) ||
               ops->copy_2d(dir, pv, pitch_pool, bv, pitch_buf, width, lay->kv_heads);
    }
    kv_copy_dir dir = dev ? KV_DEVICE_TO_DEVICE : KV_DEVICE_TO_HOST;
    return ops->copy_2d(dir, bk, pitch_buf, pk, pitch_pool, width, lay->kv_heads) ||
           ops->copy_2d(dir, bv, pitch_buf, pv, pitch_pool, width, lay->kv_heads);
}

/* The layout of a quantised segment's block (INT8, INT4, INT2) in a
 * layer of layout lay. */
static kv_layout quant_layout(const kv_layout *lay, const kvs_layer *layer, uint32_t tier)
{
    kv_layout q = *lay;
    q.quant_group = layer->quant_group;
    q.block_tokens = tier == KVS_TIER_INT8   ? layer->int8_block_tokens
                     : tier == KVS_TIER_INT4 ? layer->int4_block_tokens
                                             : layer->int2_block_tokens;
    return q;
}

/* Dequantise one quantised segment into a device staging block of its
 * tier's layout, then copy its rows out like a full-precision segment's. */
static int segment_read_quantised(const kvs_session *s, const kv_layout *lay,
                                  const kvs_layer *layer, const kvs_segment *g, size_t tok,
                                  uint8_t *stage, uint8_t *k, uint8_t *v, int dev)
{
    kv_layout l8 = quant_layout(lay, layer, g->tier);
    kv_segment q = {0, g->first_slot, g->count}, d = {0, 0, g->count};
    const uint8_t *qb = s->pool + (size_t)g->block * s->block_bytes;
    kv_dtype t = (kv_dtype)s->geom.dtype;
    int rc = g->tier == KVS_TIER_INT8
                 ? s->ops->int8_dequantize(&l8, qb, &q, 1, t, &l8, stage, &d, 1)
                 : s->ops->lowbit_dequantize(&l8, g->tier == KVS_TIER_INT4 ? 4 : 2, qb, &q, 1, t,
                                             &l8, stage, &d, 1);
    if (rc != 0)
        return -1;
    size_t row = (size_t)lay->head_dim * lay->elt_size, width = g->count * row;
    size_t pitch8 = (size_t)l8.block_tokens * row, pitch_buf = layer->tokens * row;
    kv_copy_dir dir = dev ? KV_DEVICE_TO_DEVICE : KV_DEVICE_TO_HOST;
    return s->ops->copy_2d(dir, k + tok * row, pitch_buf, stage, pitch8, width, lay->kv_heads) ||
           s->ops->copy_2d(dir, v + tok * row, pitch_buf, stage + kv_block_bytes(&l8) / 2, pitch8,
                           width, lay->kv_heads);
}

static int layer_tiered(const kvs_layer *layer, uint32_t *sketch)
{
    int tiered = 0;
    *sketch = 0;
    for (size_t i = 0; i < layer->nsegments; i++) {
        tiered |= layer->segments[i].tier != KVS_TIER_FULL;
        *sketch += layer->segments[i].tier == KVS_TIER_SKETCH ? layer->segments[i].count : 0;
    }
    return tiered;
}

/* A layer of full-precision segments between the pool and device buffers
 * k, v in one kernel call: kv_gather and kv_scatter lay the buffers out as
 * a layer's ([kv_heads][tokens][head_dim]). On a GPU two copies a segment,
 * each a synchronous call, cost a hundred times more. 1 when the layer
 * has another tier or its segments do not add up to its tokens (the
 * caller goes a segment at a time), else 0 or -1. */
static int layer_io_kernel(const kvs_session *s, const kv_layout *lay, const kvs_layer *layer,
                           uint8_t *k, uint8_t *v, int to_pool)
{
    size_t n = layer->nsegments, tokens = 0;
    for (size_t i = 0; i < n; i++) {
        if (layer->segments[i].tier != KVS_TIER_FULL)
            return 1;
        tokens += layer->segments[i].count;
    }
    if (tokens != layer->tokens)
        return 1;
    kv_segment *segs = malloc((n ? n : 1) * sizeof *segs);
    if (segs == NULL)
        return -1;
    for (size_t i = 0; i < n; i++) {
        const kvs_segment *g = &layer->segments[i];
        segs[i] = (kv_segment){g->block, g->first_slot, g->count};
    }
    int rc = to_pool ? s->ops->scatter(lay, s->pool, segs, n, k, v)
                     : s->ops->gather(lay, s->pool, segs, n, k, v);
    free(segs);
    return rc == 0 ? 0 : -1;
}

/* Move a layer between the pool and contiguous k, v (device memory of the
 * backend when `dev`): through device buffers in one kernel call where it
 * can, else a segment at a time; quantised segments (reads only) through
 * one staging block, as large as the largest tier's. */
static int layer_io(const kvs_session *s, const kvs_layer *layer, uint8_t *k, uint8_t *v,
                    int to_pool, int dev)
{
    kv_layout lay = layer->per_head ? row_layout(s) : s->layout;
    uint8_t *stage = NULL;
    int rc = dev ? stream_sync(s) : 0;
    if (rc == 0 && dev) {
        int whole = layer_io_kernel(s, &lay, layer, k, v, to_pool);
        if (whole != 1)
            return whole == 0 ? KVS_OK : KVS_ERR_SYSTEM;
    }
    size_t tok = 0;
    for (size_t i = 0; rc == 0 && i < layer->nsegments; i++) {
        const kvs_segment *g = &layer->segments[i];
        if (g->tier == KVS_TIER_FULL) {
            rc = segment_copy(s, &lay, layer, g, tok, k, v, to_pool, dev);
        } else {
            if (stage == NULL) {
                size_t most = 0;
                static const uint32_t quantised[] = {KVS_TIER_INT8, KVS_TIER_INT4, KVS_TIER_INT2};
                for (size_t t = 0; t < sizeof quantised / sizeof quantised[0]; t++) {
                    kv_layout lq = quant_layout(&lay, layer, quantised[t]);
                    most = kv_block_bytes(&lq) > most ? kv_block_bytes(&lq) : most;
                }
                if ((stage = s->ops->alloc(most)) == NULL)
                    return KVS_ERR_SYSTEM;
            }
            rc = segment_read_quantised(s, &lay, layer, g, tok, stage, k, v, dev);
        }
        tok += g->count;
    }
    s->ops->free(stage);
    return rc == 0 ? KVS_OK : KVS_ERR_SYSTEM;
}

static int layer_write(const kvs_session *s, const kvs_layer *layer, const void *k, const void *v,
                       int dev)
{
    uint32_t sketch;
    if (layer_tiered(layer, &sketch))
        return KVS_ERR_PRECONDITION; /* INT8 blocks are written once, by the daemon */
    return layer_io(s, layer, (uint8_t *)k, (uint8_t *)v, 1, dev);
}

static int layer_read(const kvs_session *s, const kvs_layer *layer, void *k, void *v, int dev)
{
    uint32_t sketch;
    if (layer_tiered(layer, &sketch) && sketch > 0)
        return KVS_ERR_PRECONDITION;
    return layer_io(s, layer, k, v, 0, dev);
}

int kvs_layer_write(const kvs_session *s, const kvs_layer *layer, const void *k, const void *v)
{
    return layer_write(s, layer, k, v, 0);
}

int kvs_layer_read(const kvs_session *s, const kvs_layer *layer, void *k, void *v)
{
    return layer_read(s, layer, k, v, 0);
}

int kvs_layer_write_dev(const kvs_session *s, const kvs_layer *layer, const void *k, const void *v)
{
    return layer_write(s, layer, k, v, 1);
}

int kvs_layer_read_dev(const kvs_session *s, const kvs_layer *layer, void *k, void *v)
{
    return layer_read(s, layer, k, v, 1);
}

/* ---- revive ---- */

/* What kvs_seq_revive allocated in *r, freed; *r zeroed. */
static void revive_free(kvs_revive *r)
{
    kvs_table_free(&r->table);
    free(r->source_tier);
    memset(r, 0, sizeof *r);
}

/* A Revive's answer, from gRPC or the ring, into *out: its table checked
 * as any (table_fill), each token's source tier (src32 or src8), the
 * counts by tier. */
static int revive_fill(kvs_session *s, Kvstash__V1__LayerTable *lt, uint64_t scratch_id,
                       uint64_t epoch, const uint32_t *src32, const uint8_t *src8, kvs_revive *out)
{
    int rc = table_fill(s, &lt, 1, "Revive", &out->table);
    if (rc != KVS_OK)
        return rc;
    out->layer = &out->table.layer[lt->layer * out->table.heads + (lt->per_head ? lt->head : 0)];
    out->source_tier = malloc(lt->tokens ? lt->tokens : 1);
    if (out->source_tier == NULL) {
        fail(s, "Revive: out of memory");
        return KVS_ERR_SYSTEM;
    }
    out->scratch_id = scratch_id;
    out->epoch = epoch;
    for (size_t i = 0; i < lt->tokens; i++) {
        uint32_t t = src32 != NULL ? src32[i] : src8[i];
        out->source_tier[i] = (uint8_t)t;
        out->from_full += t == KVS_TIER_FULL;
        out->from_int8 += t == KVS_TIER_INT8;
        out->from_sketch += t == KVS_TIER_SKETCH;
    }
    return KVS_OK;
}

/* Revive through gRPC (any size). */
static int revive_grpc(kvs_session *s, uint64_t seq_id, const ring_revive_request *in,
                       kvs_revive *out)
{
    Kvstash__V1__ReviveRequest req = KVSTASH__V1__REVIVE_REQUEST__INIT;
    req.seq_id = seq_id;
    req.layer = in->layer;
    req.head = in->head;
    req.first = in->first;
    req.count = in->count;
    req.skip_evicted = in->skip_evicted != 0;
    req.in_place = in->in_place != 0;
    ProtobufCMessage *resp;
    int rc = session_rpc(s, "Revive", &req.base, &kvstash__v1__revive_response__descriptor, &resp);
    if (rc != KVS_OK)
        return rc;
    const Kvstash__V1__ReviveResponse *r = (const Kvstash__V1__ReviveResponse *)resp;
    Kvstash__V1__LayerTable *lt = r->table;
    if (lt == NULL || lt->n_positions != lt->tokens || r->n_source_tier != lt->tokens) {
        fail(s, "Revive: the reply's table, positions and source tiers do not match");
        rc = KVS_ERR_PROTOCOL;
    } else {
        rc = revive_fill(s, lt, r->scratch_id, r->epoch, r->source_tier, NULL, out);
    }
    protobuf_c_message_free_unpacked(resp, NULL);
    return rc;
}

/* The most bytes a ring REVIVE answer of n tokens takes (each token its
 * own segment at worst). */
static size_t revive_ring_bytes(uint64_t n)
{
    return sizeof(ring_revive_reply) + (size_t)n * (3 * sizeof(uint32_t) + sizeof(uint32_t) + 1);
}

/* Revive through the ring (proto/kvstash_ring.h RING_OP_REVIVE): a few
 * microseconds where gRPC takes about 100. An answer that would not fit
 * the data area is refused by kvstashd (KVS_ERR_EXHAUSTED); one that
 * claims to fit but does not is a protocol error. */
static int revive_ring(kvs_session *s, uint64_t seq_id, const ring_revive_request *in,
                       kvs_revive *out)
{
    ring_request *q = &s->ring.hdr->req;
    memset(q, 0, sizeof *q);
    q->op = RING_OP_REVIVE;
    q->seq_id = seq_id;
    q->data_bytes = sizeof *in;
    memcpy(s->ring.data, in, sizeof *in);
    ring_response r;
    int rc = ring_call_spin(s, "Revive", RING_CLIENT_SPIN_SHORT, &r);
    if (rc != KVS_OK)
        return rc;
    ring_revive_reply h;
    memcpy(&h, s->ring.data, sizeof h);
    uint64_t need = sizeof h + 12 * (uint64_t)h.nsegments + 5 * (uint64_t)h.tokens;
    if ((in->count > 0 && h.tokens > in->count) || h.nsegments > h.tokens ||
        r.nsegments != h.nsegments || need > s->ring.data_bytes) {
        fail(s,
             "Revive: kvstashd's answer on the ring names %" PRIu32 " tokens in %" PRIu32
             " segments for %" PRIu32 " asked (0: to the end), in %zu bytes",
             h.tokens, h.nsegments, in->count, s->ring.data_bytes);
        return KVS_ERR_PROTOCOL;
    }
    /* Copied out of the shared ring before they are checked. */
    size_t words = 3 * (size_t)h.nsegments + h.tokens;
    uint32_t *u = malloc((words ? words : 1) * sizeof *u);
    uint8_t *src = malloc(h.tokens ? h.tokens : 1);
    if (u == NULL || src == NULL) {
        free(u);
        free(src);
        fail(s, "Revive: out of memory");
        return KVS_ERR_SYSTEM;
    }
    memcpy(u, s->ring.data + sizeof h, words * sizeof *u);
    memcpy(src, s->ring.data + sizeof h + words * sizeof *u, h.tokens);
    Kvstash__V1__LayerTable lt = KVSTASH__V1__LAYER_TABLE__INIT;
    lt.layer = h.layer;
    lt.head = h.head;
    lt.per_head = h.per_head != 0;
    lt.tokens = h.tokens;
    lt.n_block = lt.n_first_slot = lt.n_count = h.nsegments;
    lt.block = u;
    lt.first_slot = u + h.nsegments;
    lt.count = u + 2 * (size_t)h.nsegments;
    lt.n_positions = h.tokens;
    lt.positions = u + 3 * (size_t)h.nsegments;
    rc = revive_fill(s, &lt, h.scratch_id, h.epoch, NULL, src, out);
    free(u);
    free(src);
    return rc;
}

int kvs_seq_revive(kvs_session *s, uint64_t seq_id, uint32_t layer, uint32_t head, uint32_t first,
                   uint32_t count, unsigned flags, kvs_revive *out)
{
    if (out != NULL)
        memset(out, 0, sizeof *out);
    if (s == NULL)
        return KVS_ERR_INVALID;
    if (out == NULL) {
        fail(s, "kvs_seq_revive: out is required");
        return KVS_ERR_INVALID;
    }
    if ((flags & ~(KVS_REVIVE_SKIP_EVICTED | KVS_REVIVE_IN_PLACE)) != 0) {
        fail(s,
             "kvs_seq_revive: unknown flags 0x%x (KVS_REVIVE_SKIP_EVICTED | "
             "KVS_REVIVE_IN_PLACE)",
             flags);
        return KVS_ERR_INVALID;
    }
    ring_revive_request in = {layer,
                              head,
                              first,
                              count,
                              (flags & KVS_REVIVE_SKIP_EVICTED) != 0,
                              (flags & KVS_REVIVE_IN_PLACE) != 0};
    /* The ring unless the answer surely does not fit its data area. The
     * rest of a list (count 0) is of a length this side does not know:
     * kvstashd refuses an answer too large for the ring (and gives its
     * scratch back), and gRPC carries it. A whole layer of 4,096 tokens
     * then costs tens of microseconds, not the hundreds of a gRPC call. */
    int rc;
    if (count > 0 && revive_ring_bytes(count) > s->ring.data_bytes) {
        rc = revive_grpc(s, seq_id, &in, out);
    } else {
        rc = revive_ring(s, seq_id, &in, out);
        if (rc == KVS_ERR_EXHAUSTED && count == 0)
            rc = revive_grpc(s, seq_id, &in, out);
    }
    if (rc != KVS_OK)
        revive_free(out);
    return rc;
}

int kvs_revive_release(kvs_session *s, kvs_revive *r)
{
    if (s == NULL || r == NULL)
        return KVS_ERR_INVALID;
    if (r->scratch_id == 0) { /* in place: nothing of the daemon's to give back */
        revive_free(r);
        return KVS_OK;
    }
    ring_request *q = &s->ring.hdr->req;
    memset(q, 0, sizeof *q);
    q->op = RING_OP_RELEASE_SCRATCH;
    q->data_bytes = sizeof r->scratch_id;
    memcpy(s->ring.data, &r->scratch_id, sizeof r->scratch_id);
    ring_response resp;
    int rc = ring_call(s, "ReleaseScratch", &resp);
    revive_free(r);
    return rc;
}

/* ---- stats ---- */

int kvs_stats_json(const char *socket_path, char **json, char *err, size_t errlen)
{
    char msg[KVS_ERRMSG_MAX] = "";
    if (json == NULL)
        return KVS_ERR_INVALID;
    *json = NULL;
    if (socket_path == NULL)
        socket_path = kvs_default_socket();
    rpc_channel *ch = NULL;
    int rc;
    if (strlen(socket_path) >= sizeof(((struct sockaddr_un *)0)->sun_path)) {
        snprintf(msg, sizeof msg, "socket path too long for a Unix socket: %s", socket_path);
        rc = KVS_ERR_INVALID;
        goto out;
    }
    ch = rpc_channel_open(socket_path);
    if (ch == NULL) {
        snprintf(msg, sizeof msg, "cannot create a gRPC channel to unix:%s", socket_path);
        rc = KVS_ERR_SYSTEM;
        goto out;
    }
    Kvstash__V1__StatsRequest req = KVSTASH__V1__STATS_REQUEST__INIT;
    req.with_tiers = 1; /* per-sequence tokens and bytes by storage tier */
    ProtobufCMessage *resp;
    rc = rpc_unary(ch, RPC_STORE("Stats"), NULL, &req.base,
                   &kvstash__v1__stats_response__descriptor, &resp, msg, sizeof msg);
    rpc_channel_close(ch);
    if (rc != KVS_OK)
        goto out;
    *json = pbjson_dumps(resp, 0);
    protobuf_c_message_free_unpacked(resp, NULL);
    if (*json == NULL) {
        snprintf(msg, sizeof msg, "Stats: out of memory converting to JSON");
        rc = KVS_ERR_SYSTEM;
    }
out:
    if (err != NULL && errlen > 0)
        snprintf(err, errlen, "%s", msg);
    return rc;
}
