/*
 * fuzz_config - kvstashd's configuration parser (daemon/config.c): INI file
 * text through config_load, and flag values through config_set, the call
 * kvstashd makes for every --key value it is given (main.c apply_flags; the
 * splitting of argv itself is glibc's getopt_long).
 *
 * Input: [mode] then text. mode bit 0 clear: the text is a config file;
 * set: the text is lines "key=value", each given to config_set as a flag
 * would be. Either way, whatever was accepted must survive config_print
 * then config_load unchanged (config.h: "a config file that config_load
 * reads back to the same values"): a difference aborts.
 */
#include <stddef.h>
#include <stdint.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/mman.h>
#include <unistd.h>

#include "config.h"

int LLVMFuzzerTestOneInput(const uint8_t *data, size_t size);

/* config_load reads a path: text goes to a memfd named by /proc. */
static int load_text(daemon_config *c, const char *text, size_t len, char *err, size_t errlen)
{
    int fd = memfd_create("kvs-fuzz-config", MFD_CLOEXEC);
    if (fd < 0)
        abort();
    if (len > 0 && write(fd, text, len) != (ssize_t)len)
        abort();
    char path[64];
    snprintf(path, sizeof path, "/proc/self/fd/%d", fd);
    int rc = config_load(c, path, err, errlen);
    close(fd);
    return rc;
}

/* config_print's text (the caller frees). */
static char *printed(const daemon_config *c, size_t *len)
{
    char *buf = NULL;
    FILE *f = open_memstream(&buf, len);
    if (f == NULL)
        abort();
    config_print(c, "fuzz", f);
    fclose(f);
    return buf;
}

static void set_flags(daemon_config *c, char *text)
{
    char err[512];
    char *save = NULL;
    for (char *line = strtok_r(text, "\n", &save); line != NULL;
         line = strtok_r(NULL, "\n", &save)) {
        char *eq = strchr(line, '=');
        if (eq == NULL)
            continue;
        *eq = '\0';
        config_set(c, line, eq + 1, err, sizeof err);
    }
}

int LLVMFuzzerTestOneInput(const uint8_t *data, size_t size)
{
    if (size < 1)
        return 0;
    int flags = data[0] & 1;
    char *text = malloc(size);
    if (text == NULL)
        return 0;
    memcpy(text, data + 1, size - 1);
    text[size - 1] = '\0';
    daemon_config c;
    config_defaults(&c);
    char err[512];
    if (flags)
        set_flags(&c, text);
    else
        load_text(&c, text, size - 1, err, sizeof err);
    /* Round trip: what was accepted prints, and reads back, the same. */
    size_t len1, len2;
    char *first = printed(&c, &len1);
    daemon_config back;
    config_defaults(&back);
    if (load_text(&back, first, len1, err, sizeof err) != 0) {
        fprintf(stderr, "config_print wrote what config_load refuses: %s\n%s", err, first);
        abort();
    }
    char *second = printed(&back, &len2);
    if (len1 != len2 || memcmp(first, second, len1) != 0) {
        fprintf(stderr, "config round trip differs:\n%s\n--- read back as ---\n%s", first, second);
        abort();
    }
    free(first);
    free(second);
    free(text);
    return 0;
}
