/* test_pbjson.c - unit tests of the protobuf-c -> JSON walker (pbjson.h). */
#include <setjmp.h>
#include <stdarg.h>
#include <stddef.h>
#include <stdint.h>
#include <stdlib.h>
#include <string.h>

#include <cmocka.h>

#include "kvstash/v1/store.pb-c.h"
#include "pbjson.h"

static void test_scalars_enums_nested_repeated(void **state)
{
    (void)state;
    Kvstash__V1__Geometry g = KVSTASH__V1__GEOMETRY__INIT;
    g.layers = 32;
    g.dtype = KVSTASH__V1__DTYPE__DTYPE_BF16;
    g.rope_theta = 500000.0f;
    Kvstash__V1__PoolStats p = KVSTASH__V1__POOL_STATS__INIT;
    p.pool_id = UINT64_C(1) << 40;
    p.model = "llama";
    p.geometry = &g;
    p.blocks_free = 7;
    Kvstash__V1__PoolStats *pools[] = {&p};
    char *policies[] = {"full", "streaming"};
    Kvstash__V1__StatsResponse r = KVSTASH__V1__STATS_RESPONSE__INIT;
    r.version = "0.1.0";
    r.uptime_ms = 1234;
    r.n_pools = 1;
    r.pools = pools;
    r.n_policies = 2;
    r.policies = policies;

    json_t *j = pbjson_from_message(&r.base);
    assert_non_null(j);
    assert_string_equal(json_string_value(json_object_get(j, "version")), "0.1.0");
    assert_int_equal(json_integer_value(json_object_get(j, "uptime_ms")), 1234);
    /* proto3 defaults are present */
    assert_string_equal(json_string_value(json_object_get(j, "backend")), "");
    assert_int_equal(json_integer_value(json_object_get(j, "events_published")), 0);
    assert_int_equal(json_array_size(json_object_get(j, "sessions")), 0);
    json_t *pj = json_array_get(json_object_get(j, "pools"), 0);
    assert_true(json_is_integer(json_object_get(pj, "pool_id")));
    assert_int_equal(json_integer_value(json_object_get(pj, "pool_id")), (json_int_t)1 << 40);
    assert_int_equal(json_integer_value(json_object_get(pj, "blocks_free")), 7);
    json_t *gj = json_object_get(pj, "geometry");
    assert_int_equal(json_integer_value(json_object_get(gj, "layers")), 32);
    assert_string_equal(json_string_value(json_object_get(gj, "dtype")), "DTYPE_BF16");
    assert_true(json_real_value(json_object_get(gj, "rope_theta")) == 500000.0);
    json_t *pol = json_object_get(j, "policies");
    assert_int_equal(json_array_size(pol), 2);
    assert_string_equal(json_string_value(json_array_get(pol, 1)), "streaming");
    json_decref(j);
}

static void test_absent_message_and_big_u64(void **state)
{
    (void)state;
    Kvstash__V1__PoolStats p = KVSTASH__V1__POOL_STATS__INIT;
    p.bytes_total = UINT64_MAX;
    json_t *j = pbjson_from_message(&p.base);
    assert_non_null(j);
    assert_null(json_object_get(j, "geometry")); /* unset sub-message: omitted */
    json_t *b = json_object_get(j, "bytes_total");
    assert_true(json_is_real(b)); /* above INT64_MAX: a real, not a wrapped negative */
    assert_true(json_real_value(b) > 1.8e19);
    json_decref(j);
}

static void test_unknown_enum_and_nan(void **state)
{
    (void)state;
    Kvstash__V1__Geometry g = KVSTASH__V1__GEOMETRY__INIT;
    g.dtype = (Kvstash__V1__DType)77;
    g.rope_theta = __builtin_nanf("");
    json_t *j = pbjson_from_message(&g.base);
    assert_int_equal(json_integer_value(json_object_get(j, "dtype")), 77);
    assert_string_equal(json_string_value(json_object_get(j, "rope_theta")), "NaN");
    json_decref(j);
}

static void test_dumps(void **state)
{
    (void)state;
    Kvstash__V1__Param prm = KVSTASH__V1__PARAM__INIT;
    prm.key = "window";
    prm.value = "32";
    char *s = pbjson_dumps(&prm.base, JSON_COMPACT);
    assert_non_null(s);
    assert_string_equal(s, "{\"key\":\"window\",\"value\":\"32\"}");
    free(s);
}

int main(void)
{
    const struct CMUnitTest tests[] = {
        cmocka_unit_test(test_scalars_enums_nested_repeated),
        cmocka_unit_test(test_absent_message_and_big_u64),
        cmocka_unit_test(test_unknown_enum_and_nan),
        cmocka_unit_test(test_dumps),
    };
    return cmocka_run_group_tests(tests, NULL, NULL);
}
