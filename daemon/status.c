#include "status.h"

#include <stdarg.h>
#include <stdio.h>

status_code status_set(status *st, status_code code, const char *fmt, ...)
{
    st->code = code;
    va_list ap;
    va_start(ap, fmt);
    vsnprintf(st->msg, sizeof st->msg, fmt, ap);
    va_end(ap);
    return code;
}

const char *status_name(status_code code)
{
    switch (code) {
    case ST_OK:
        return "OK";
    case ST_CANCELLED:
        return "CANCELLED";
    case ST_UNKNOWN:
        return "UNKNOWN";
    case ST_INVALID_ARGUMENT:
        return "INVALID_ARGUMENT";
    case ST_DEADLINE_EXCEEDED:
        return "DEADLINE_EXCEEDED";
    case ST_NOT_FOUND:
        return "NOT_FOUND";
    case ST_ALREADY_EXISTS:
        return "ALREADY_EXISTS";
    case ST_PERMISSION_DENIED:
        return "PERMISSION_DENIED";
    case ST_RESOURCE_EXHAUSTED:
        return "RESOURCE_EXHAUSTED";
    case ST_FAILED_PRECONDITION:
        return "FAILED_PRECONDITION";
    case ST_UNIMPLEMENTED:
        return "UNIMPLEMENTED";
    case ST_INTERNAL:
        return "INTERNAL";
    case ST_UNAVAILABLE:
        return "UNAVAILABLE";
    case ST_DATA_LOSS:
        return "DATA_LOSS";
    case ST_UNAUTHENTICATED:
        return "UNAUTHENTICATED";
    }
    return "UNKNOWN";
}
