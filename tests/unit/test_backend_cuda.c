/*
 * Unit tests of the cuda backend's device-free parts (daemon/backend.h,
 * daemon/config.c, kernels/ops.h kv_ops_cuda): the config keys and their
 * refusals, which backends this build has, that the host backends' MAP
 * share is the memfd it always was, and, in CUDA builds on a host without a
 * usable device, that starting the backend fails with kv_devmem_probe's
 * reason and that kv_ops_cuda fails cleanly (-1 and the CUDA error named)
 * rather than crashing. What needs a GPU is tests/gpu's.
 */
#include <fcntl.h>
#include <setjmp.h>
#include <stdarg.h>
#include <stddef.h>
#include <stdint.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/stat.h>
#include <unistd.h>
#include <cmocka.h>

#include "backend.h"
#include "config.h"
#include "ops.h"
#ifdef KVSTASH_HAVE_CUDA
#include "devmem.h"
#endif

static void test_cuda_keys(void **state)
{
    (void)state;
    daemon_config c;
    char err[512];
    config_defaults(&c);
    assert_string_equal(c.cuda_device, "0");
    assert_string_equal(c.cuda_ipc, "auto");
    assert_int_equal(config_set(&c, "cuda-ipc", "vmm", err, sizeof err), 0);
    assert_string_equal(c.cuda_ipc, "vmm");
    assert_int_equal(config_set(&c, "cuda_ipc", "legacy", err, sizeof err), 0);
    assert_string_equal(c.cuda_ipc, "legacy");
    assert_int_equal(config_set(&c, "cuda-device", "3", err, sizeof err), 0);
    assert_string_equal(c.cuda_device, "3");
    assert_int_equal(
        config_set(&c, "cuda-device", "GPU-01234567-89ab-cdef-f0e1-d2c3b4a59687", err, sizeof err),
        0);
    assert_string_equal(c.cuda_device, "GPU-01234567-89ab-cdef-f0e1-d2c3b4a59687");

    static const char *const bad_ipc[] = {"bogus", "", "VMM", "fabric", "auto "};
    for (size_t i = 0; i < sizeof bad_ipc / sizeof *bad_ipc; i++) {
        err[0] = '\0';
        assert_int_equal(config_set(&c, "cuda-ipc", bad_ipc[i], err, sizeof err), -1);
        assert_non_null(strstr(err, "cuda-ipc must be auto"));
    }
    assert_string_equal(c.cuda_ipc, "legacy"); /* unchanged by the refusals */
    static const char *const bad_dev[] = {
        "", "-1", "1024", "x", "1a", "GPU-zz", "GPU-01234567-89ab-cdef-f0e1-d2c3b4a5968", " 1"};
    for (size_t i = 0; i < sizeof bad_dev / sizeof *bad_dev; i++) {
        err[0] = '\0';
        assert_int_equal(config_set(&c, "cuda-device", bad_dev[i], err, sizeof err), -1);
        assert_non_null(strstr(err, "cuda-device must be a device number"));
    }
    assert_string_equal(c.cuda_device, "GPU-01234567-89ab-cdef-f0e1-d2c3b4a59687");
}

/* --print-config writes the keys; config_load reads them back. */
static void test_cuda_keys_round_trip(void **state)
{
    (void)state;
    daemon_config c, back;
    char err[512], path[] = "/tmp/test_backend_cuda_XXXXXX";
    config_defaults(&c);
    assert_int_equal(config_set(&c, "cuda-ipc", "legacy", err, sizeof err), 0);
    assert_int_equal(
        config_set(&c, "cuda-device", "GPU-ffffffff-0000-1111-2222-333344445555", err, sizeof err),
        0);
    int fd = mkstemp(path);
    assert_true(fd >= 0);
    FILE *f = fdopen(fd, "w");
    config_print(&c, "test", f);
    fclose(f);
    config_defaults(&back);
    assert_int_equal(config_load(&back, path, err, sizeof err), 0);
    unlink(path);
    assert_string_equal(back.cuda_ipc, "legacy");
    assert_string_equal(back.cuda_device, "GPU-ffffffff-0000-1111-2222-333344445555");
}

static void test_backends_of_this_build(void **state)
{
    (void)state;
    daemon_config c;
    char err[512];
    config_defaults(&c);
    assert_non_null(backend_find("host"));
    assert_non_null(backend_find("shadow"));
    assert_null(backend_find("gpu"));
    assert_null(backend_find("host")->start);
    assert_null(backend_find("shadow")->start);
    err[0] = '\0';
#ifdef KVSTASH_HAVE_CUDA
    const backend *b = backend_find("cuda");
    assert_non_null(b);
    assert_ptr_equal(b->ops, &kv_ops_cuda);
    assert_ptr_equal(kv_ops_find("cuda"), &kv_ops_cuda);
    assert_string_equal(kv_ops_cuda.name, "cuda");
    assert_non_null(strstr(backend_names(), "cuda"));
    assert_int_equal(config_set(&c, "backend", "cuda", err, sizeof err), 0);
    assert_string_equal(c.backend, "cuda");
#else
    assert_null(backend_find("cuda"));
    assert_null(kv_ops_find("cuda"));
    assert_null(strstr(backend_names(), "cuda"));
    assert_int_equal(config_set(&c, "backend", "cuda", err, sizeof err), -1);
    assert_non_null(strstr(err, "this kvstashd was built without CUDA"));
    assert_string_equal(c.backend, "host");
#endif
    assert_int_equal(config_set(&c, "backend", "nope", err, sizeof err), -1);
    assert_non_null(strstr(err, backend_names()));
}

/* The host backends answer MAP as they always did: a memfd of the pool's
 * bytes, nothing else. */
static void test_host_share_is_a_memfd(void **state)
{
    (void)state;
    const backend *names[] = {&backend_host, &backend_shadow};
    for (size_t i = 0; i < 2; i++) {
        backend_arena a;
        backend_share sh;
        status st;
        assert_int_equal(names[i]->arena_create("m", 3 * 4096, &a, &st), ST_OK);
        memset(&sh, 0x5a, sizeof sh);
        assert_int_equal(names[i]->arena_share(&a, &sh, &st), ST_OK);
        assert_int_equal(sh.map.kind, KVSTASH_MAP_MEMFD);
        assert_true(sh.map.bytes == 3 * 4096);
        assert_true(sh.fd >= 0);
        struct stat sb;
        assert_int_equal(fstat(sh.fd, &sb), 0);
        assert_int_equal(sb.st_size, 3 * 4096);
        char text[KVSTASH_MAP_TEXT_MAX];
        assert_true(kvstash_map_format(&sh.map, text, sizeof text) > 0);
        assert_string_equal(text, "OK 12288");
        close(sh.fd);
        names[i]->arena_destroy(&a);
    }
}

/* What Stats, `kvstash status` and the metrics say (backend_info): host
 * memory is device none, mapped as a memfd; the cuda text comes from
 * backend_cuda_info, which needs no device. */
static void test_backend_info_text(void **state)
{
    (void)state;
    const backend *host[] = {&backend_host, &backend_shadow};
    for (size_t i = 0; i < 2; i++) {
        backend_info bi;
        memset(&bi, 0x5a, sizeof bi);
        assert_non_null(host[i]->describe);
        host[i]->describe(&bi);
        assert_string_equal(bi.device, "none");
        assert_string_equal(bi.device_name, "");
        assert_string_equal(bi.ipc, "memfd");
    }
    static const char uuid[] = "GPU-01234567-89ab-cdef-f0e1-d2c3b4a59687";
    static const struct {
        const char *uuid, *name, *option, *resolved;
        const char *device, *ipc;
    } cases[] = {
        /* auto before the first arena, and after it resolved either way */
        {uuid, "NVIDIA H100 80GB HBM3", "auto", NULL, uuid, "auto (unresolved)"},
        {uuid, "NVIDIA H100 80GB HBM3", "auto", "vmm", uuid, "vmm"},
        {uuid, "Tesla T4", "auto", "legacy", uuid, "legacy"},
        /* an explicit kind is what every arena gets */
        {uuid, "", "legacy", NULL, uuid, "legacy"},
        {uuid, "", "vmm", NULL, uuid, "vmm"},
        /* not started: no device looked up yet */
        {"", "", "auto", NULL, "unknown", "auto (unresolved)"},
    };
    for (size_t i = 0; i < sizeof cases / sizeof *cases; i++) {
        backend_info bi;
        backend_cuda_info(cases[i].uuid, cases[i].name, cases[i].option, cases[i].resolved, &bi);
        assert_string_equal(bi.device, cases[i].device);
        assert_string_equal(bi.device_name, cases[i].name);
        assert_string_equal(bi.ipc, cases[i].ipc);
    }
    assert_string_equal(BACKEND_IPC_UNRESOLVED, "auto (unresolved)");
#ifdef KVSTASH_HAVE_CUDA
    /* The backend's own describe, whatever state an earlier test left. */
    backend_info bi;
    backend_cuda.describe(&bi);
    assert_true(strcmp(bi.ipc, "auto (unresolved)") == 0 || strcmp(bi.ipc, "vmm") == 0 ||
                strcmp(bi.ipc, "legacy") == 0);
    char why[256];
    if (!kv_devmem_probe(why, sizeof why))
        assert_string_equal(bi.device, "unknown"); /* never started */
#endif
}

#ifdef KVSTASH_HAVE_CUDA
/* Without a usable device (this test's host, CI): the backend does not
 * start, with the probe's reason; kv_ops_cuda fails cleanly. With one, the
 * device checks belong to tests/gpu and this test checks only the
 * argument errors. */
static void test_cuda_without_device(void **state)
{
    (void)state;
    char why[256];
    int have = kv_devmem_probe(why, sizeof why);
    status st = {ST_OK, ""};
    backend_options o = {"0", "auto"};
    if (have) {
        backend_options bad = {"1023", "auto"};
        assert_int_equal(backend_cuda.start(&bad, &st), ST_INVALID_ARGUMENT);
        assert_non_null(strstr(st.msg, "CUDA device"));
        skip();
    }
    assert_int_equal(backend_cuda.start(&o, &st), ST_UNAVAILABLE);
    assert_non_null(strstr(st.msg, "no usable CUDA device"));
    assert_non_null(strstr(st.msg, why)); /* the probe's own words */
    /* Not started: no arena. */
    backend_arena a;
    assert_int_equal(backend_cuda.arena_create("m", 4096, &a, &st), ST_INTERNAL);
    assert_null(a.base);
    /* Every operation reports the CUDA failure instead of crashing. */
    kv_ops_cuda_set_device(0);
    assert_int_equal(kv_ops_cuda_device(), 0);
    assert_null(kv_ops_cuda.alloc(64));
    assert_non_null(strstr(kv_ops_cuda_last_error(), "kv_ops_cuda alloc"));
    uint8_t host[64] = {0};
    assert_int_equal(kv_ops_cuda.copy(KV_HOST_TO_DEVICE, (void *)0x1000, host, 64), -1);
    assert_non_null(strstr(kv_ops_cuda_last_error(), "kv_ops_cuda copy"));
    assert_int_equal(kv_ops_cuda.fill((void *)0x1000, 0, 64), -1);
    kv_diff d = {0};
    assert_int_equal(kv_ops_cuda.diff((void *)0x1000, (void *)0x2000, KV_FP16, 8, &d), -1);
    kv_ops_cuda.free(NULL); /* nothing to do, no CUDA call */
    kv_ops_cuda_set_device(-1);
}
#endif

int main(void)
{
    const struct CMUnitTest tests[] = {
        cmocka_unit_test(test_cuda_keys),
        cmocka_unit_test(test_cuda_keys_round_trip),
        cmocka_unit_test(test_backends_of_this_build),
        cmocka_unit_test(test_host_share_is_a_memfd),
        cmocka_unit_test(test_backend_info_text),
#ifdef KVSTASH_HAVE_CUDA
        cmocka_unit_test(test_cuda_without_device),
#endif
    };
    return cmocka_run_group_tests(tests, NULL, NULL);
}
