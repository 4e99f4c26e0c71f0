#include "backend.h"

#include <errno.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

static const backend *const backends[] = {&backend_host, &backend_shadow,
#ifdef KVSTASH_HAVE_CUDA
                                          &backend_cuda
#endif
};

const backend *backend_find(const char *name)
{
    for (size_t i = 0; i < sizeof backends / sizeof *backends; i++)
        if (strcmp(backends[i]->name, name) == 0)
            return backends[i];
    return NULL;
}

const char *backend_names(void)
{
#ifdef KVSTASH_HAVE_CUDA
    return "host, shadow, cuda";
#else
    return "host, shadow";
#endif
}

int backend_cuda_ipc_check(const char *v, char *err, size_t errlen)
{
    if (strcmp(v, "auto") == 0 || strcmp(v, "vmm") == 0 || strcmp(v, "legacy") == 0)
        return 0;
    snprintf(err, errlen,
             "cuda-ipc must be auto (VMM where the device supports it, else legacy), vmm or "
             "legacy, got '%.32s'",
             v);
    return -1;
}

int backend_cuda_device_check(const char *v, char *err, size_t errlen)
{
    uint8_t uuid[KVSTASH_GPU_UUID_BYTES];
    if (strncmp(v, "GPU-", 4) == 0) {
        if (kvstash_gpu_uuid_parse(v, uuid) == 0)
            return 0;
    } else if (v[0] >= '0' && v[0] <= '9') {
        char *end;
        errno = 0;
        unsigned long n = strtoul(v, &end, 10);
        if (errno == 0 && *end == '\0' && n <= 1023)
            return 0;
    }
    snprintf(err, errlen,
             "cuda-device must be a device number (0 to 1023) or a GPU UUID as nvidia-smi -L "
             "prints it (GPU-xxxxxxxx-xxxx-xxxx-xxxx-xxxxxxxxxxxx), got '%.48s'",
             v);
    return -1;
}

void backend_cuda_info(const char *uuid_text, const char *device_name, const char *ipc_option,
                       const char *resolved, backend_info *out)
{
    snprintf(out->device, sizeof out->device, "%s", uuid_text[0] ? uuid_text : "unknown");
    snprintf(out->device_name, sizeof out->device_name, "%s", device_name);
    /* An explicit vmm or legacy is what every arena gets (or its creation
     * fails); auto is known only once a first arena tried VMM. */
    const char *ipc = resolved != NULL                  ? resolved
                      : strcmp(ipc_option, "auto") == 0 ? BACKEND_IPC_UNRESOLVED
                                                        : ipc_option;
    snprintf(out->ipc, sizeof out->ipc, "%s", ipc);
}
