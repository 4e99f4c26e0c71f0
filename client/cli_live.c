/* cli_live.c - the commands that keep running: `kvstash watch` (the event
 * feed), `kvstash top` (a refreshing view) and the progress line of
 * `kvstash replay` on a terminal (cli.h). */
#include <errno.h>
#include <inttypes.h>
#include <poll.h>
#include <pthread.h>
#include <signal.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/ioctl.h>
#include <sys/stat.h>
#include <termios.h>
#include <time.h>
#include <unistd.h>

#include "cli.h"
#include "kvstash.h"
#include "replay.h"

static volatile sig_atomic_t stop_requested;

static void on_signal(int sig)
{
    (void)sig;
    stop_requested = 1;
}

/* SIGINT/SIGTERM end the command cleanly (no SA_RESTART: waits return EINTR). */
static void catch_signals(void)
{
    struct sigaction sa = {.sa_handler = on_signal};
    sigemptyset(&sa.sa_mask);
    sigaction(SIGINT, &sa, NULL);
    sigaction(SIGTERM, &sa, NULL);
}

static double now_s(void)
{
    struct timespec ts;
    clock_gettime(CLOCK_MONOTONIC, &ts);
    return (double)ts.tv_sec + (double)ts.tv_nsec * 1e-9;
}

/* A duration in seconds ("0.5", "2"); 0 or -1. */
static int parse_seconds(const char *text, double min, double *out)
{
    char *end;
    errno = 0;
    double v = strtod(text, &end);
    if (errno != 0 || end == text || *end != '\0' || !(v >= min) || v > 86400.0 * 365)
        return -1;
    *out = v;
    return 0;
}

/* ---- watch ---------------------------------------------------------------------- */

static void print_event_text(const char *topic, json_t *obj)
{
    struct timespec ts;
    struct tm tm;
    clock_gettime(CLOCK_REALTIME, &ts);
    localtime_r(&ts.tv_sec, &tm);
    printf("%02d:%02d:%02d.%03ld %-17s", tm.tm_hour, tm.tm_min, tm.tm_sec, ts.tv_nsec / 1000000,
           topic);
    const char *key;
    json_t *v;
    json_object_foreach(obj, key, v)
    {
        if (strcmp(key, "n") == 0)
            continue;
        if (json_is_string(v))
            printf(" %s=%s", key, json_string_value(v));
        else if (json_is_integer(v))
            printf(" %s=%" JSON_INTEGER_FORMAT, key, json_integer_value(v));
        else {
            char *t = json_dumps(v, JSON_COMPACT | JSON_ENCODE_ANY);
            printf(" %s=%s", key, t ? t : "?");
            free(t);
        }
    }
    printf(" (n=%" JSON_INTEGER_FORMAT ")\n", json_integer_value(json_object_get(obj, "n")));
}

typedef struct watch_state {
    const cli *c;
    const char *topic;
    uint64_t last_n;
    uint64_t shown;
} watch_state;

/* One "topic {json}" message: a gap note if events were lost, then the event. */
static void show_event(watch_state *w, const char *msg)
{
    const char *sp = strchr(msg, ' ');
    size_t tlen = sp != NULL ? (size_t)(sp - msg) : strlen(msg);
    char topic[64];
    snprintf(topic, sizeof topic, "%.*s", (int)(tlen < 63 ? tlen : 63), msg);
    json_t *obj = sp != NULL ? json_loads(sp + 1, 0, NULL) : NULL;
    if (!json_is_object(obj)) {
        json_decref(obj);
        obj = json_object();
        json_object_set_new(obj, "raw", json_string(sp ? sp + 1 : ""));
    }
    uint64_t n = (uint64_t)json_integer_value(json_object_get(obj, "n"));
    if (w->last_n != 0 && n > w->last_n + 1) {
        /* nanomsg drops under bursts: the truth is in Stats (docs/protocol.md). */
        uint64_t missed = n - w->last_n - 1;
        if (w->c->json)
            cli_print_json(json_pack("{ss sI}", "topic", "gap", "missed", (json_int_t)missed), 0);
        else
            printf("-- missed %" PRIu64 " event(s); `kvstash status` has the current state\n",
                   missed);
    }
    if (n != 0)
        w->last_n = n;
    if (w->topic == NULL || strncmp(topic, w->topic, strlen(w->topic)) == 0) {
        if (w->c->json) {
            json_object_set_new(obj, "topic", json_string(topic));
            cli_print_json(json_incref(obj), 0);
        } else {
            print_event_text(topic, obj);
        }
        w->shown++;
    }
    json_decref(obj);
    fflush(stdout);
}

int cli_cmd_watch(cli *c)
{
    static const char help[] =
        "usage: kvstash watch [--count N] [--timeout SEC] [--topic PREFIX] [--json]\n"
        "                     [--socket PATH]\n"
        "  Print kvstashd's events as they happen (nanomsg feed PATH.events): workers\n"
        "  attached and reclaimed, sequences created and released, tables changed by\n"
        "  evictions (docs/protocol.md \"Events\"). The feed drops events under bursts;\n"
        "  a gap in the event counter n is reported (`kvstash status` has the truth).\n"
        "  Runs until Ctrl-C, N events (--count), SEC seconds (--timeout), or the\n"
        "  daemon stops (exit 3). --topic PREFIX shows only topics starting with it.\n"
        "  --json: one JSON object per line, the event's fields plus \"topic\"; a gap\n"
        "  is {\"topic\": \"gap\", \"missed\": N}.\n";
    const char *count_s = NULL, *timeout_s = NULL, *topic = NULL;
    const cli_opt opts[] = {{"count", 1, &count_s, NULL, NULL, NULL},
                            {"timeout", 1, &timeout_s, NULL, NULL, NULL},
                            {"topic", 1, &topic, NULL, NULL, NULL}};
    int rc = cli_parse(c, opts, 3, NULL, 0, 0, NULL, help);
    if (rc != CLI_OK)
        return rc < 0 ? CLI_OK : rc;
    uint64_t count = 0;
    double timeout = 0;
    if (count_s != NULL && (cli_uint(count_s, UINT32_MAX, &count) != 0 || count == 0))
        return cli_fail(CLI_USAGE, "watch: --count wants a positive number, got '%s'", count_s);
    if (timeout_s != NULL && parse_seconds(timeout_s, 0.001, &timeout) != 0)
        return cli_fail(CLI_USAGE, "watch: --timeout wants seconds, got '%s'", timeout_s);
    Kvstash__V1__StatsResponse *st; /* is anyone there? (precise errors) */
    if ((rc = cli_stats(c, 0, &st)) != CLI_OK)
        return rc;
    protobuf_c_message_free_unpacked(&st->base, NULL);
    int sock = kvs_events_open(c->socket);
    if (sock < 0)
        return cli_fail(CLI_ERROR, "cannot subscribe to %s.events: %s", c->socket,
                        kvs_strerror(sock));
    catch_signals();
    if (isatty(1) && !c->json)
        printf("watching %s.events (Ctrl-C to stop)\n", c->socket);
    fflush(stdout);
    watch_state w = {.c = c, .topic = topic};
    double end = timeout > 0 ? now_s() + timeout : 0, quiet_since = now_s();
    rc = CLI_OK;
    while (!stop_requested && (count == 0 || w.shown < count)) {
        double left = end > 0 ? end - now_s() : 0.25;
        if (end > 0 && left <= 0)
            break;
        char *ev = NULL;
        int r = kvs_events_next(sock, (int)((left < 0.25 ? left : 0.25) * 1000) + 1, &ev);
        if (r == KVS_OK) {
            show_event(&w, ev);
            free(ev);
            quiet_since = now_s();
        } else if (r != KVS_ERR_UNAVAILABLE) {
            rc = cli_fail(CLI_ERROR, "reading events: %s", kvs_strerror(r));
            break;
        } else if (now_s() - quiet_since > 2.0) {
            /* nanomsg reconnects silently: notice a daemon that went away. */
            struct stat sb;
            if (stat(c->socket, &sb) != 0) {
                rc = cli_fail(CLI_UNREACHABLE, "kvstashd stopped: %s is gone", c->socket);
                break;
            }
            quiet_since = now_s();
        }
    }
    kvs_events_close(sock);
    return rc;
}

/* ---- top -------------------------------------------------------------------------- */

typedef struct top_opts {
    double interval;
    uint64_t iterations;
    const char *sort;
} top_opts;

typedef struct term {
    int tty, raw;
    struct termios saved;
} term;

static void term_enter(term *t)
{
    t->tty = isatty(1);
    if (!t->tty)
        return;
    if (isatty(0) && tcgetattr(0, &t->saved) == 0) {
        struct termios raw = t->saved;
        raw.c_lflag &= (tcflag_t) ~(ICANON | ECHO);
        raw.c_cc[VMIN] = 0;
        raw.c_cc[VTIME] = 0;
        t->raw = tcsetattr(0, TCSANOW, &raw) == 0;
    }
    fputs("\033[?1049h\033[?25l", stdout); /* alternate screen, no cursor */
    fflush(stdout);
}

static void term_leave(term *t)
{
    if (!t->tty)
        return;
    fputs("\033[?25h\033[?1049l", stdout);
    fflush(stdout);
    if (t->raw)
        tcsetattr(0, TCSANOW, &t->saved);
}

static int cmp_sort;

static uint64_t seq_key(const Kvstash__V1__SequenceStats *q)
{
    switch (cmp_sort) {
    case 1:
        return UINT64_MAX - q->seq_id; /* ascending ids */
    case 2:
        return q->bytes;
    case 3:
        return q->appended;
    default:
        return q->tokens;
    }
}

static int seq_cmp(const void *a, const void *b)
{
    const Kvstash__V1__SequenceStats *x = *(Kvstash__V1__SequenceStats *const *)a;
    const Kvstash__V1__SequenceStats *y = *(Kvstash__V1__SequenceStats *const *)b;
    uint64_t kx = seq_key(x), ky = seq_key(y);
    if (kx != ky)
        return kx < ky ? 1 : -1;
    return x->seq_id < y->seq_id ? -1 : x->seq_id > y->seq_id;
}

static uint64_t tier_of(const Kvstash__V1__SequenceStats *q, const char *tier)
{
    for (size_t i = 0; i < q->n_tiers; i++)
        if (strcmp(q->tiers[i]->tier, tier) == 0)
            return q->tiers[i]->tokens;
    return 0;
}

static void frame_header(FILE *f, const cli *c, const Kvstash__V1__StatsResponse *st)
{
    char b1[32], b2[32], clock[16];
    time_t now = time(NULL);
    struct tm tm;
    localtime_r(&now, &tm);
    strftime(clock, sizeof clock, "%H:%M:%S", &tm);
    fprintf(f, "kvstash top - kvstashd %s (pid %d) at %s, up %s, %s   %s\n", st->version, st->pid,
            c->socket, cli_duration(st->uptime_ms, b1, sizeof b1),
            st->serving ? "serving" : "SHUTTING DOWN", clock);
    fprintf(f, "pools %zu, workers %zu, sequences %zu, events %" PRIu64 ";", st->n_pools,
            st->n_sessions, st->n_sequences, st->events_published);
    for (size_t i = 0; i < st->n_tiers; i++)
        fprintf(f, " %s %" PRIu64 " tok (%s)", st->tiers[i]->tier, st->tiers[i]->tokens,
                cli_bytes(st->tiers[i]->bytes, b1, sizeof b1));
    fprintf(f, "\n");
    for (size_t i = 0; i < st->n_pools; i++) {
        const Kvstash__V1__PoolStats *p = st->pools[i];
        fprintf(
            f, "pool %" PRIu64 " \"%s\": blocks %u used, %u retired, %u free of %u; %s of %s\n",
            p->pool_id, p->model, p->blocks_used, p->blocks_retired, p->blocks_free,
            p->blocks_total,
            cli_bytes((uint64_t)(p->blocks_total - p->blocks_free) * p->block_bytes, b1, sizeof b1),
            cli_bytes(p->bytes_total, b2, sizeof b2));
    }
}

static void frame_body(FILE *f, const Kvstash__V1__StatsResponse *st, const top_opts *o)
{
    char b1[32], b2[32];
    fprintf(f, "\nWORKERS\n%7s %8s %6s %5s %5s %6s %10s  %s\n", "SESSION", "PID", "UID", "POOL",
            "SEQS", "LEASE", "LEASE AGE", "NAME");
    for (size_t i = 0; i < st->n_sessions; i++) {
        const Kvstash__V1__SessionStats *s = st->sessions[i];
        fprintf(f, "%7" PRIu64 " %8d %6u %5" PRIu64 " %5u %6s %10s  %s\n", s->session_id, s->pid,
                s->uid, s->pool_id, s->sequences, s->lease_open ? "open" : "closed",
                s->lease_open ? cli_duration(s->lease_ms, b1, sizeof b1) : "-", s->worker_name);
    }
    fprintf(f, "\nSEQUENCES (by %s)\n%6s %7s %-14s %9s %9s %7s %7s %6s %10s %6s  %s\n", o->sort,
            "SEQ", "SESSION", "POLICY", "APPENDED", "TOKENS", "INT8", "SKETCH", "BLOCKS", "BYTES",
            "EPOCH", "LABEL");
    Kvstash__V1__SequenceStats **sorted = malloc((st->n_sequences + 1) * sizeof *sorted);
    if (sorted == NULL)
        return;
    memcpy(sorted, st->sequences, st->n_sequences * sizeof *sorted);
    qsort(sorted, st->n_sequences, sizeof *sorted, seq_cmp);
    for (size_t i = 0; i < st->n_sequences; i++) {
        const Kvstash__V1__SequenceStats *q = sorted[i];
        fprintf(f,
                "%6" PRIu64 " %7" PRIu64 " %-14s %9" PRIu64 " %9" PRIu64 " %7" PRIu64 " %7" PRIu64
                " %6u %10s %6" PRIu64 "  %s\n",
                q->seq_id, q->session_id, q->policy, q->appended, q->tokens, tier_of(q, "int8"),
                tier_of(q, "sketch"), q->blocks, cli_bytes(q->bytes, b2, sizeof b2), q->epoch,
                q->label);
    }
    free(sorted);
}

/* Write a frame: on a terminal from the top-left corner, each line cut to
 * the width and cleared to its end, at most the screen's height. */
static void frame_write(const char *text, const term *t)
{
    if (!t->tty) {
        fputs(text, stdout);
        fputs("\n", stdout);
        fflush(stdout);
        return;
    }
    struct winsize ws = {0};
    unsigned cols = 80, rows = 24;
    if (ioctl(1, TIOCGWINSZ, &ws) == 0 && ws.ws_col > 0 && ws.ws_row > 0) {
        cols = ws.ws_col;
        rows = ws.ws_row;
    }
    fputs("\033[H", stdout);
    unsigned row = 0;
    for (const char *p = text; *p && row + 1 < rows; row++) {
        const char *nl = strchr(p, '\n');
        size_t len = nl != NULL ? (size_t)(nl - p) : strlen(p);
        fwrite(p, 1, len < cols ? len : cols, stdout);
        fputs("\033[K\r\n", stdout);
        p = nl != NULL ? nl + 1 : p + len;
    }
    fputs("\033[J", stdout);
    fflush(stdout);
}

/* Wait for the next refresh; 1 when the user asked to quit ('q'). */
static int wait_key(const term *t, double seconds)
{
    double end = now_s() + seconds;
    while (!stop_requested) {
        double left = end - now_s();
        if (left <= 0)
            return 0;
        struct pollfd pf = {.fd = t->raw ? 0 : -1, .events = POLLIN};
        int r = poll(&pf, 1, (int)(left * 1000) + 1);
        if (r > 0 && (pf.revents & POLLIN)) {
            char ch;
            if (read(0, &ch, 1) == 1 && (ch == 'q' || ch == 'Q'))
                return 1;
            return 0; /* any other key: refresh now */
        }
    }
    return 1;
}

static int parse_top(cli *c, top_opts *o)
{
    static const char help[] =
        "usage: kvstash top [--interval SEC] [--iterations N] [--sort tokens|seq|bytes|appended]\n"
        "                   [--json] [--socket PATH]\n"
        "  A refreshing view of kvstashd: pools and memory, workers (pid, uid, lease\n"
        "  age) and sequences (policy, length, tokens per tier, blocks, bytes, epoch),\n"
        "  every SEC seconds (default 1). On a terminal: q quits, any other key\n"
        "  refreshes. --iterations N stops after N refreshes (default: until q or\n"
        "  Ctrl-C). Without a terminal, frames follow each other on stdout.\n"
        "  --json: one Stats reply (with per-sequence tiers) per line and refresh.\n";
    const char *interval = NULL, *iterations = NULL, *sort = NULL;
    const cli_opt opts[] = {{"interval", 1, &interval, NULL, NULL, NULL},
                            {"iterations", 1, &iterations, NULL, NULL, NULL},
                            {"sort", 1, &sort, NULL, NULL, NULL}};
    int rc = cli_parse(c, opts, 3, NULL, 0, 0, NULL, help);
    if (rc != CLI_OK)
        return rc;
    *o = (top_opts){.interval = 1.0, .sort = sort != NULL ? sort : "tokens"};
    if (interval != NULL && parse_seconds(interval, 0.05, &o->interval) != 0)
        return cli_fail(CLI_USAGE, "top: --interval wants seconds (at least 0.05), got '%s'",
                        interval);
    if (iterations != NULL && cli_uint(iterations, UINT32_MAX, &o->iterations) != 0)
        return cli_fail(CLI_USAGE, "top: --iterations wants a number, got '%s'", iterations);
    static const char *const sorts[] = {"tokens", "seq", "bytes", "appended"};
    cmp_sort = -1;
    for (int i = 0; i < 4; i++)
        if (strcmp(o->sort, sorts[i]) == 0)
            cmp_sort = i;
    if (cmp_sort < 0)
        return cli_fail(CLI_USAGE, "top: --sort wants tokens, seq, bytes or appended, got '%s'",
                        o->sort);
    return CLI_OK;
}

int cli_cmd_top(cli *c)
{
    top_opts o;
    int rc = parse_top(c, &o);
    if (rc != CLI_OK)
        return rc < 0 ? CLI_OK : rc;
    Kvstash__V1__StatsResponse *st;
    if ((rc = cli_stats(c, 1, &st)) != CLI_OK) /* fail before taking the screen */
        return rc;
    catch_signals();
    term t = {0};
    if (!c->json)
        term_enter(&t);
    for (uint64_t n = 1;; n++) {
        if (c->json) {
            cli_print_message(&st->base, 0);
        } else {
            char *text = NULL;
            size_t len = 0;
            FILE *f = open_memstream(&text, &len);
            if (f != NULL) {
                frame_header(f, c, st);
                frame_body(f, st, &o);
                fprintf(f, "\n%s refresh every %.2gs\n", t.raw ? "q quits;" : "Ctrl-C quits;",
                        o.interval);
                fclose(f);
                frame_write(text, &t);
            }
            free(text);
        }
        protobuf_c_message_free_unpacked(&st->base, NULL);
        st = NULL;
        if ((o.iterations != 0 && n >= o.iterations) || wait_key(&t, o.interval))
            break;
        cli_defer_errors(t.tty); /* reported once the screen is back */
        rc = cli_stats(c, 1, &st);
        cli_defer_errors(0);
        if (rc != CLI_OK)
            break;
    }
    term_leave(&t);
    if (rc != CLI_OK && t.tty)
        fprintf(stderr, "kvstash: %s\n", cli_deferred_error());
    return rc;
}

/* ---- replay, with progress on a terminal ------------------------------------------ */

typedef struct progress {
    pthread_t thread;
    pthread_mutex_t lock;
    pthread_cond_t cond;
    int done;
    off_t size;
} progress;

static void progress_line(off_t at, off_t size)
{
    char b1[32], b2[32];
    fprintf(stderr, "\r\033[Kkvstash replay: read %s of %s (%d%%)",
            cli_bytes((uint64_t)at, b1, sizeof b1), cli_bytes((uint64_t)size, b2, sizeof b2),
            (int)(size > 0 ? (double)at * 100 / (double)size : 100));
}

static void *progress_thread(void *arg)
{
    progress *p = arg;
    pthread_mutex_lock(&p->lock);
    while (!p->done) {
        struct timespec ts;
        clock_gettime(CLOCK_REALTIME, &ts);
        ts.tv_nsec += 200 * 1000000L;
        if (ts.tv_nsec >= 1000000000L) {
            ts.tv_sec++;
            ts.tv_nsec -= 1000000000L;
        }
        pthread_cond_timedwait(&p->cond, &p->lock, &ts);
        if (!p->done) {
            off_t at = lseek(0, 0, SEEK_CUR); /* how far replay's stdio has read */
            if (at >= 0)
                progress_line(at < p->size ? at : p->size, p->size);
        }
    }
    pthread_mutex_unlock(&p->lock);
    return NULL;
}

int cli_cmd_replay(int argc, char **argv)
{
    struct stat sb;
    /* Progress only where someone watches and the length is known. */
    int show = isatty(2) && fstat(0, &sb) == 0 && S_ISREG(sb.st_mode) && sb.st_size > 0;
    for (int i = 1; i < argc && show; i++)
        show = strcmp(argv[i], "--help") != 0 && strcmp(argv[i], "-h") != 0;
    progress p = {.size = show ? sb.st_size : 0};
    if (show) {
        pthread_mutex_init(&p.lock, NULL);
        pthread_cond_init(&p.cond, NULL);
        if (pthread_create(&p.thread, NULL, progress_thread, &p) != 0)
            show = 0;
    }
    int rc = replay_main(argc, argv);
    if (show) {
        pthread_mutex_lock(&p.lock);
        p.done = 1;
        pthread_cond_signal(&p.cond);
        pthread_mutex_unlock(&p.lock);
        pthread_join(p.thread, NULL);
        off_t at = lseek(0, 0, SEEK_CUR);
        progress_line(at >= 0 && at < p.size ? at : p.size, p.size);
        fputs(rc == 0 ? ", done\n" : ", stopped\n", stderr);
        pthread_mutex_destroy(&p.lock);
        pthread_cond_destroy(&p.cond);
    }
    return rc;
}
