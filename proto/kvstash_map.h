/*
 * kvstash_map.h - the fd socket's answer to `MAP <pool_id>` (and `RING`),
 * written by kvstashd and read by libkvstash (docs/protocol.md): the one
 * definition of its text, so that the two sides cannot drift apart.
 *
 *   OK <bytes>                                  host memory: the memfd
 *                                               travels with SCM_RIGHTS
 *   OK <bytes> cuda vmm GPU-<uuid>              a VMM device arena: its POSIX
 *                                               fd travels with SCM_RIGHTS
 *   OK <bytes> cuda legacy GPU-<uuid> <hex>     a legacy device arena: its
 *                                               cudaIpcMemHandle_t as 128
 *                                               lowercase hex digits, no fd
 *
 * <bytes> is decimal (the arena's size: for VMM, rounded up to the device's
 * granularity, so it may exceed the pool's bytes). The GPU is named by its
 * UUID as nvidia-smi prints it (GPU-xxxxxxxx-xxxx-xxxx-xxxx-xxxxxxxxxxxx),
 * never by ordinal: containers and CUDA_VISIBLE_DEVICES renumber devices.
 * Words are separated by one space; nothing follows the last.
 *
 * Plain C, no CUDA: both sides build it, with or without a GPU toolkit.
 */
#ifndef KVSTASH_MAP_H
#define KVSTASH_MAP_H

#include <stddef.h>
#include <stdint.h>

#ifdef __cplusplus
extern "C" {
#endif

#define KVSTASH_GPU_UUID_BYTES 16
/* "GPU-" + 32 hex digits + 4 dashes, and a NUL. */
#define KVSTASH_GPU_UUID_TEXT (4 + 32 + 4 + 1)
/* Bytes of a legacy cudaIpcMemHandle_t (CUDA_IPC_HANDLE_SIZE). */
#define KVSTASH_MAP_HANDLE_BYTES 64
/* The longest answer kvstashd writes, with its NUL (within the 320 bytes of
 * a datagram). */
#define KVSTASH_MAP_TEXT_MAX 256

typedef enum kvstash_map_kind {
    KVSTASH_MAP_MEMFD = 0,       /* host memory; fd attached */
    KVSTASH_MAP_CUDA_VMM = 1,    /* device arena, VMM; fd attached */
    KVSTASH_MAP_CUDA_LEGACY = 2, /* device arena, legacy IPC handle; no fd */
} kvstash_map_kind;

typedef struct kvstash_map_answer {
    kvstash_map_kind kind;
    uint64_t bytes;
    uint8_t gpu_uuid[KVSTASH_GPU_UUID_BYTES];        /* CUDA kinds */
    uint8_t legacy_handle[KVSTASH_MAP_HANDLE_BYTES]; /* KVSTASH_MAP_CUDA_LEGACY */
} kvstash_map_answer;

/* Whether an answer of this kind carries an fd (SCM_RIGHTS). */
int kvstash_map_has_fd(kvstash_map_kind kind);

/* "memfd", "vmm" or "legacy". */
const char *kvstash_map_kind_name(kvstash_map_kind kind);

/* Write the answer's text into buf[len]; returns its length, or -1 when it
 * does not fit or the kind is unknown. */
int kvstash_map_format(const kvstash_map_answer *a, char *buf, size_t len);

/* Read an answer's text (already known to start with "OK ", say; any text
 * is checked in full). Returns 0 with *a filled, or -1 with the reason in
 * err[errlen]: not OK, bytes missing / not decimal / out of range, an
 * unknown memory or IPC kind, a malformed GPU UUID, a handle that is not
 * 128 hex digits, words missing or extra. */
int kvstash_map_parse(const char *text, kvstash_map_answer *a, char *err, size_t errlen);

/* A GPU UUID (cudaDeviceProp.uuid's 16 bytes) as nvidia-smi writes it:
 * "GPU-" and 8-4-4-4-12 lowercase hex digits, into out[KVSTASH_GPU_UUID_TEXT]. */
void kvstash_gpu_uuid_format(const uint8_t uuid[KVSTASH_GPU_UUID_BYTES],
                             char out[KVSTASH_GPU_UUID_TEXT]);

/* Read that form (hex digits in either case) into uuid; 0, or -1 when the
 * text is anything else (also trailing text). */
int kvstash_gpu_uuid_parse(const char *text, uint8_t uuid[KVSTASH_GPU_UUID_BYTES]);

#ifdef __cplusplus
}
#endif

#endif
