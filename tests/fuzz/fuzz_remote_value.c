/*
 * fuzz_remote_value - the remote tier's value decoder (daemon/remote_value.c)
 * on arbitrary bytes: what the remote store hands back may be anything.
 *
 * Input: [mode] then the value. mode bit 0 set: the value's checksum is
 * recomputed first (when it is long enough to have one), so that the
 * fuzzer gets past the CRC to the field and position checks it would
 * otherwise almost never reach. Whatever decodes must encode back to the
 * same bytes exactly (the decoder accepts only what the encoder writes):
 * a difference aborts. ASan (the fuzz build) catches any read outside the
 * value; it is copied into a buffer of exactly its length.
 */
#include <stddef.h>
#include <stdint.h>
#include <stdlib.h>
#include <string.h>
#include <zlib.h>

#include "remote_value.h"

int LLVMFuzzerTestOneInput(const uint8_t *data, size_t size);

/* The checksum field (remote_value.h): bytes 60..64, CRC-32 of the whole
 * value with those as zeros. */
static void reseal(uint8_t *v, size_t len)
{
    if (len < REMOTE_VALUE_HEADER_LEN)
        return;
    memset(v + 60, 0, 4);
    uint32_t c = (uint32_t)crc32_z(0L, v, len);
    for (int i = 0; i < 4; i++)
        v[60 + i] = (uint8_t)(c >> (8 * i));
}

int LLVMFuzzerTestOneInput(const uint8_t *data, size_t size)
{
    if (size == 0)
        return 0;
    size_t len = size - 1;
    uint8_t *v = malloc(len > 0 ? len : 1);
    if (v == NULL)
        abort();
    if (len > 0)
        memcpy(v, data + 1, len);
    if (data[0] & 1)
        reseal(v, len);

    remote_value_header h;
    const uint8_t *pos_le = NULL, *payload = NULL;
    status st;
    if (remote_value_decode(v, len, &h, &pos_le, &payload, &st) != ST_OK) {
        if (st.code != ST_DATA_LOSS || st.msg[0] == '\0')
            abort();
        free(v);
        return 0;
    }
    if (remote_value_size(&h) != len || payload != v + remote_value_payload_offset(&h))
        abort();
    uint32_t *pos = malloc(((size_t)h.ntokens + 1) * sizeof *pos);
    uint8_t *out = malloc(len);
    if (pos == NULL || out == NULL)
        abort();
    for (uint32_t i = 0; i < h.ntokens; i++)
        pos[i] = remote_value_position(pos_le, i);
    if (remote_value_encode(&h, pos, payload, out, len, &st) != ST_OK || memcmp(out, v, len) != 0)
        abort();
    free(out);
    free(pos);
    free(v);
    return 0;
}
