/*
 * log.h - structured log lines on stderr.
 *
 * One line per event: `ts=<RFC3339 ms> level=<lvl> msg=<word> key=value ...`.
 * Values with spaces or quotes are quoted by the caller's format (use %s only
 * for words, "%s" with log_quote-safe text otherwise). Thread-safe: each line
 * is written with one write(2).
 */
#ifndef KVSTASH_LOG_H
#define KVSTASH_LOG_H

#include <stddef.h>

typedef enum log_level { LOG_DEBUG = 0, LOG_INFO = 1, LOG_WARN = 2, LOG_ERROR = 3 } log_level;

/* Lines below `min` are dropped. Default LOG_INFO. */
void log_set_level(log_level min);

/* Parse "debug", "info", "warn" or "error"; returns -1 if unknown. */
int log_parse_level(const char *name);

/* Copy `in` to `out` so that it can stand inside a quoted value: quotes and
 * backslashes are escaped, control bytes become \xNN. Text from clients
 * goes through this, so that no client can forge or split a log line. */
void log_escape(const char *in, char *out, size_t len);

/* Write one line: msg is a short event word, fmt appends `key=value` fields. */
void log_emit(log_level level, const char *msg, const char *fmt, ...)
    __attribute__((format(printf, 3, 4)));

#define log_debug(msg, ...) log_emit(LOG_DEBUG, msg, __VA_ARGS__)
#define log_info(msg, ...) log_emit(LOG_INFO, msg, __VA_ARGS__)
#define log_warn(msg, ...) log_emit(LOG_WARN, msg, __VA_ARGS__)
#define log_error(msg, ...) log_emit(LOG_ERROR, msg, __VA_ARGS__)

#endif
