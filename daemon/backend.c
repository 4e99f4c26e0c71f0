#include "backend.h"

#include <string.h>

static const backend *const backends[] = {&backend_host, &backend_shadow};

const backend *backend_find(const char *name)
{
    for (size_t i = 0; i < sizeof backends / sizeof *backends; i++)
        if (strcmp(backends[i]->name, name) == 0)
            return backends[i];
    return NULL;
}

const char *backend_names(void)
{
    return "host, shadow";
}
