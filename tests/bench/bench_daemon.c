/* bench_daemon.c - what the benchmarks that start kvstashd share (a library, not a test: bench_rpc
 * and bench_tiers report; see bench_daemon.h). */
#include "bench_daemon.h"

#include <dirent.h>
#include <errno.h>
#include <fcntl.h>
#include <libgen.h>
#include <limits.h>
#include <signal.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/prctl.h>
#include <sys/stat.h>
#include <sys/wait.h>
#include <time.h>
#include <unistd.h>

static pid_t daemon_pid = -1;
static char tmp_dir[] = "/tmp/kvstash-bench.XXXXXX";
static int tmp_made;
static const char *prog_name = "bench";

double bench_now_us(void)
{
    struct timespec ts;
    clock_gettime(CLOCK_MONOTONIC, &ts);
    return (double)ts.tv_sec * 1e6 + (double)ts.tv_nsec / 1e3;
}

void bench_busy_us(double us)
{
    double until = bench_now_us() + us;
    while (bench_now_us() < until)
        ;
}

static int cmp_double(const void *a, const void *b)
{
    double x = *(const double *)a, y = *(const double *)b;
    return (x > y) - (x < y);
}

double bench_median(double *v, size_t n)
{
    if (n == 0)
        return 0;
    qsort(v, n, sizeof *v, cmp_double);
    return v[n / 2];
}

bench_latency bench_summarize(double *v, size_t n)
{
    bench_latency l = {n, 0, 0, 0};
    double sum = 0;
    for (size_t i = 0; i < n; i++)
        sum += v[i];
    l.p50_us = bench_median(v, n); /* sorts v */
    l.mean_us = n ? sum / (double)n : 0;
    l.p99_us = n ? v[(n - 1) * 99 / 100] : 0;
    return l;
}

const char *bench_default_daemon(void)
{
    const char *env = getenv("KVSTASHD");
    if (env && *env)
        return env;
    static char path[PATH_MAX];
    char self[PATH_MAX];
    ssize_t n = readlink("/proc/self/exe", self, sizeof self - 1);
    if (n <= 0)
        return "kvstashd";
    self[n] = '\0';
    snprintf(path, sizeof path, "%s/../../daemon/kvstashd", dirname(self));
    return path;
}

static void remove_tmp_dir(void)
{
    if (!tmp_made)
        return;
    DIR *d = opendir(tmp_dir);
    if (d) {
        struct dirent *e;
        while ((e = readdir(d)) != NULL) {
            if (strcmp(e->d_name, ".") == 0 || strcmp(e->d_name, "..") == 0)
                continue;
            char p[PATH_MAX];
            snprintf(p, sizeof p, "%s/%s", tmp_dir, e->d_name);
            unlink(p);
        }
        closedir(d);
    }
    rmdir(tmp_dir);
    tmp_made = 0;
}

int bench_daemon_stop(void)
{
    if (daemon_pid <= 0)
        return 0;
    kill(daemon_pid, SIGTERM);
    int status = 0;
    for (int i = 0; i < 1000; i++) {
        pid_t r = waitpid(daemon_pid, &status, WNOHANG);
        if (r == daemon_pid) {
            daemon_pid = -1;
            return WIFEXITED(status) ? WEXITSTATUS(status) : -1;
        }
        usleep(10000);
    }
    fprintf(stderr, "%s: kvstashd ignored SIGTERM for 10 s; killing it\n", prog_name);
    kill(daemon_pid, SIGKILL);
    waitpid(daemon_pid, NULL, 0);
    daemon_pid = -1;
    return -1;
}

void bench_daemon_cleanup(void)
{
    bench_daemon_stop();
    remove_tmp_dir();
}

int bench_daemon_start(const char *prog, const char *path, int pool_mb, const char *const *extra,
                       char *sock, size_t socklen)
{
    prog_name = prog;
    if (mkdtemp(tmp_dir) == NULL) {
        perror("mkdtemp");
        return -1;
    }
    tmp_made = 1;
    snprintf(sock, socklen, "%s/kvstashd.sock", tmp_dir);
    char log[PATH_MAX], pool[16];
    snprintf(log, sizeof log, "%s/kvstashd.log", tmp_dir);
    snprintf(pool, sizeof pool, "%d", pool_mb);
    pid_t pid = fork();
    if (pid < 0) {
        perror("fork");
        return -1;
    }
    if (pid == 0) {
        prctl(PR_SET_PDEATHSIG, SIGTERM); /* never outlive the benchmark */
        int fd = open(log, O_WRONLY | O_CREAT | O_TRUNC, 0600);
        if (fd >= 0) {
            dup2(fd, STDERR_FILENO);
            close(fd);
        }
        const char *argv[BENCH_DAEMON_MAX_EXTRA + 8] = {path, "--socket",    sock,  "--pool-mb",
                                                        pool, "--log-level", "warn"};
        for (size_t i = 0; extra != NULL && extra[i] != NULL && i < BENCH_DAEMON_MAX_EXTRA; i++)
            argv[7 + i] = extra[i];
        execv(path, (char *const *)argv);
        fprintf(stderr, "exec %s: %s\n", path, strerror(errno));
        _exit(127);
    }
    daemon_pid = pid;
    for (int i = 0; i < 1000; i++) {
        struct stat st;
        if (stat(sock, &st) == 0 && S_ISSOCK(st.st_mode))
            return 0;
        int status;
        if (waitpid(pid, &status, WNOHANG) == pid) {
            daemon_pid = -1;
            fprintf(stderr, "%s: %s exited (status %d) before creating %s\n", prog, path,
                    WIFEXITED(status) ? WEXITSTATUS(status) : -1, sock);
            return -1;
        }
        usleep(10000);
    }
    fprintf(stderr, "%s: %s did not create %s within 10 s\n", prog, path, sock);
    return -1;
}
