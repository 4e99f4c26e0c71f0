/*
 * Unit tests of the fd socket's MAP answer (proto/kvstash_map.h), the one
 * format kvstashd writes and libkvstash reads: every kind round-trips
 * through format and parse, the GPU UUID reads back as nvidia-smi prints
 * it, and every malformed answer a broken or hostile daemon could send
 * (truncated, bad hex, bad UUID, wrong kind, stray words) is refused with a
 * reason. No device needed.
 */
#include <setjmp.h>
#include <stdarg.h>
#include <stddef.h>
#include <stdint.h>
#include <stdio.h>
#include <string.h>
#include <cmocka.h>

#include "kvstash_map.h"

/* A UUID with every nibble value, as cudaDeviceProp.uuid holds it. */
static const uint8_t uuid_bytes[16] = {0x01, 0x23, 0x45, 0x67, 0x89, 0xab, 0xcd, 0xef,
                                       0xf0, 0xe1, 0xd2, 0xc3, 0xb4, 0xa5, 0x96, 0x87};
static const char uuid_text[] = "GPU-01234567-89ab-cdef-f0e1-d2c3b4a59687";

static void test_uuid_format_and_parse(void **state)
{
    (void)state;
    char text[KVSTASH_GPU_UUID_TEXT];
    kvstash_gpu_uuid_format(uuid_bytes, text);
    assert_string_equal(text, uuid_text);
    assert_int_equal(strlen(text), KVSTASH_GPU_UUID_TEXT - 1);
    uint8_t back[16];
    assert_int_equal(kvstash_gpu_uuid_parse(uuid_text, back), 0);
    assert_memory_equal(back, uuid_bytes, 16);
    /* Upper-case hex digits read the same. */
    memset(back, 0, sizeof back);
    assert_int_equal(kvstash_gpu_uuid_parse("GPU-01234567-89AB-CDEF-F0E1-D2C3B4A59687", back), 0);
    assert_memory_equal(back, uuid_bytes, 16);
    /* Every byte value survives the round trip. */
    for (int v = 0; v < 256; v++) {
        uint8_t u[16], r[16];
        for (int i = 0; i < 16; i++)
            u[i] = (uint8_t)(v + 17 * i);
        kvstash_gpu_uuid_format(u, text);
        assert_int_equal(kvstash_gpu_uuid_parse(text, r), 0);
        assert_memory_equal(r, u, 16);
    }
}

static void test_uuid_refused(void **state)
{
    (void)state;
    static const char *const bad[] = {
        "",
        "GPU-",
        "01234567-89ab-cdef-f0e1-d2c3b4a59687",      /* no GPU- */
        "gpu-01234567-89ab-cdef-f0e1-d2c3b4a59687",  /* lower-case prefix */
        "MIG-01234567-89ab-cdef-f0e1-d2c3b4a59687",  /* a MIG instance, not a GPU */
        "GPU-01234567-89ab-cdef-f0e1-d2c3b4a5968",   /* one digit short */
        "GPU-01234567-89ab-cdef-f0e1-d2c3b4a596870", /* one digit more */
        "GPU-0123456789ab-cdef-f0e1-d2c3b4a59687",   /* a dash missing */
        "GPU-01234567-89ab-cdef-f0e1d2c3-b4a59687",  /* a dash misplaced */
        "GPU-0123456g-89ab-cdef-f0e1-d2c3b4a59687",  /* not hex */
        "GPU-01234567-89ab-cdef-f0e1-d2c3b4a59687 ", /* trailing blank */
        "0",
    };
    uint8_t out[16];
    memset(out, 0x5a, sizeof out);
    for (size_t i = 0; i < sizeof bad / sizeof *bad; i++)
        assert_int_equal(kvstash_gpu_uuid_parse(bad[i], out), -1);
    for (int i = 0; i < 16; i++)
        assert_int_equal(out[i], 0x5a); /* untouched on failure */
}

static void test_memfd_answer_unchanged(void **state)
{
    (void)state;
    /* The host backends' answer is what it always was: "OK <bytes>". */
    kvstash_map_answer a = {.kind = KVSTASH_MAP_MEMFD, .bytes = 268435456};
    char buf[KVSTASH_MAP_TEXT_MAX];
    assert_int_equal(kvstash_map_format(&a, buf, sizeof buf), (int)strlen("OK 268435456"));
    assert_string_equal(buf, "OK 268435456");
    kvstash_map_answer r;
    char err[160];
    assert_int_equal(kvstash_map_parse(buf, &r, err, sizeof err), 0);
    assert_int_equal(r.kind, KVSTASH_MAP_MEMFD);
    assert_true(r.bytes == 268435456u);
    assert_true(kvstash_map_has_fd(KVSTASH_MAP_MEMFD));
    assert_int_equal(kvstash_map_parse("OK 18446744073709551615", &r, err, sizeof err), 0);
    assert_true(r.bytes == UINT64_MAX);
}

static void test_vmm_answer(void **state)
{
    (void)state;
    kvstash_map_answer a = {.kind = KVSTASH_MAP_CUDA_VMM, .bytes = 2097152};
    memcpy(a.gpu_uuid, uuid_bytes, 16);
    char buf[KVSTASH_MAP_TEXT_MAX], want[128];
    snprintf(want, sizeof want, "OK 2097152 cuda vmm %s", uuid_text);
    assert_true(kvstash_map_format(&a, buf, sizeof buf) > 0);
    assert_string_equal(buf, want);
    kvstash_map_answer r;
    memset(&r, 0xff, sizeof r);
    assert_int_equal(kvstash_map_parse(buf, &r, NULL, 0), 0);
    assert_int_equal(r.kind, KVSTASH_MAP_CUDA_VMM);
    assert_true(r.bytes == 2097152u);
    assert_memory_equal(r.gpu_uuid, uuid_bytes, 16);
    assert_true(kvstash_map_has_fd(KVSTASH_MAP_CUDA_VMM));
    assert_string_equal(kvstash_map_kind_name(r.kind), "vmm");
}

static void test_legacy_answer(void **state)
{
    (void)state;
    kvstash_map_answer a = {.kind = KVSTASH_MAP_CUDA_LEGACY, .bytes = 67108864};
    memcpy(a.gpu_uuid, uuid_bytes, 16);
    for (int i = 0; i < KVSTASH_MAP_HANDLE_BYTES; i++)
        a.legacy_handle[i] = (uint8_t)(255 - 3 * i);
    char buf[KVSTASH_MAP_TEXT_MAX];
    int n = kvstash_map_format(&a, buf, sizeof buf);
    /* "OK 67108864 cuda legacy " + UUID + " " + 128 hex digits. */
    assert_int_equal(n, (int)(strlen("OK 67108864 cuda legacy ") + 40 + 1 + 128));
    assert_true(n < 320); /* one fd-socket datagram */
    assert_non_null(strstr(buf, uuid_text));
    assert_non_null(strstr(buf, " fffcf9f6"));
    kvstash_map_answer r;
    assert_int_equal(kvstash_map_parse(buf, &r, NULL, 0), 0);
    assert_int_equal(r.kind, KVSTASH_MAP_CUDA_LEGACY);
    assert_true(r.bytes == 67108864u);
    assert_memory_equal(r.gpu_uuid, uuid_bytes, 16);
    assert_memory_equal(r.legacy_handle, a.legacy_handle, KVSTASH_MAP_HANDLE_BYTES);
    assert_false(kvstash_map_has_fd(KVSTASH_MAP_CUDA_LEGACY));
    /* Upper-case handle digits are read too. */
    for (char *p = strrchr(buf, ' ') + 1; *p; p++)
        if (*p >= 'a' && *p <= 'f')
            *p = (char)(*p - 'a' + 'A');
    memset(&r, 0, sizeof r);
    assert_int_equal(kvstash_map_parse(buf, &r, NULL, 0), 0);
    assert_memory_equal(r.legacy_handle, a.legacy_handle, KVSTASH_MAP_HANDLE_BYTES);
}

static void test_format_refuses(void **state)
{
    (void)state;
    kvstash_map_answer a = {.kind = KVSTASH_MAP_CUDA_LEGACY, .bytes = 1};
    char small[64];
    assert_int_equal(kvstash_map_format(&a, small, sizeof small), -1); /* does not fit */
    a.kind = (kvstash_map_kind)7;
    char buf[KVSTASH_MAP_TEXT_MAX];
    assert_int_equal(kvstash_map_format(&a, buf, sizeof buf), -1);
}

/* Each malformed answer is refused, and the reason names what is wrong. */
static void expect_refused(const char *text, const char *reason_part)
{
    kvstash_map_answer r;
    char err[256] = "";
    memset(&r, 0x77, sizeof r);
    kvstash_map_answer before = r;
    if (kvstash_map_parse(text, &r, err, sizeof err) != -1)
        fail_msg("accepted: \"%s\"", text);
    if (strstr(err, reason_part) == NULL)
        fail_msg("\"%s\": reason \"%s\" lacks \"%s\"", text, err, reason_part);
    assert_memory_equal(&r, &before, sizeof r); /* untouched */
}

static void test_malformed_refused(void **state)
{
    (void)state;
    char hex[129];
    for (int i = 0; i < 128; i++)
        hex[i] = "0123456789abcdef"[i % 16];
    hex[128] = '\0';
    char buf[400];

    expect_refused("", "does not start");
    expect_refused("ERR no such pool", "does not start");
    expect_refused("OK", "does not start");
    expect_refused("OK ", "stray spaces");
    expect_refused("OK  12", "stray spaces");
    expect_refused("OK 12 ", "stray spaces");
    expect_refused("OK -1", "not a decimal");
    expect_refused("OK 0x10", "not a decimal");
    expect_refused("OK 12abc", "not a decimal");
    expect_refused("OK 18446744073709551616", "out of range");
    expect_refused("OK 99999999999999999999999", "out of range");
    /* Wrong memory or IPC kind. */
    expect_refused("OK 4096 rocm vmm GPU-01234567-89ab-cdef-f0e1-d2c3b4a59687", "memory kind");
    expect_refused("OK 4096 CUDA vmm GPU-01234567-89ab-cdef-f0e1-d2c3b4a59687", "memory kind");
    expect_refused("OK 4096 cuda fabric GPU-01234567-89ab-cdef-f0e1-d2c3b4a59687", "IPC kind");
    expect_refused("OK 4096 cuda", "no CUDA IPC kind");
    /* Truncated or bad UUIDs. */
    expect_refused("OK 4096 cuda vmm", "GPU UUID");
    expect_refused("OK 4096 cuda vmm GPU-01234567-89ab-cdef-f0e1-d2c3b4a5968", "GPU UUID");
    expect_refused("OK 4096 cuda vmm 0", "GPU UUID");
    expect_refused("OK 4096 cuda vmm GPU-01234567-89ab-cdef-f0e1-d2c3b4a5968z", "GPU UUID");
    /* VMM carries nothing after the UUID. */
    snprintf(buf, sizeof buf, "OK 4096 cuda vmm %s %s", uuid_text, hex);
    expect_refused(buf, "after the GPU UUID");
    /* Legacy: the handle is exactly 128 hex digits. */
    snprintf(buf, sizeof buf, "OK 4096 cuda legacy %s", uuid_text);
    expect_refused(buf, "128 hex digits");
    snprintf(buf, sizeof buf, "OK 4096 cuda legacy %s %.127s", uuid_text, hex);
    expect_refused(buf, "128 hex digits");
    snprintf(buf, sizeof buf, "OK 4096 cuda legacy %s %s0", uuid_text, hex);
    expect_refused(buf, "128 hex digits");
    snprintf(buf, sizeof buf, "OK 4096 cuda legacy %s %.60sxz%s", uuid_text, hex, hex + 62);
    expect_refused(buf, "non-hex digit at 60");
    snprintf(buf, sizeof buf, "OK 4096 cuda legacy %s %s extra", uuid_text, hex);
    expect_refused(buf, "after the legacy IPC handle");
    /* The same, well formed, is accepted: the refusals above are for their flaw. */
    snprintf(buf, sizeof buf, "OK 4096 cuda legacy %s %s", uuid_text, hex);
    kvstash_map_answer r;
    assert_int_equal(kvstash_map_parse(buf, &r, NULL, 0), 0);
    assert_int_equal(r.legacy_handle[0], 0x01);
    assert_int_equal(r.legacy_handle[63], 0xef);
}

int main(void)
{
    const struct CMUnitTest tests[] = {
        cmocka_unit_test(test_uuid_format_and_parse),  cmocka_unit_test(test_uuid_refused),
        cmocka_unit_test(test_memfd_answer_unchanged), cmocka_unit_test(test_vmm_answer),
        cmocka_unit_test(test_legacy_answer),          cmocka_unit_test(test_format_refuses),
        cmocka_unit_test(test_malformed_refused),
    };
    return cmocka_run_group_tests(tests, NULL, NULL);
}
