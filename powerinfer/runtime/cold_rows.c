/* Cold FFN rows read from a file into resident slots, several reads in flight (cold_rows.py).
 *
 * pi_read_records: records pos[0..n) (ascending) of one stream, record p at base + p * stride
 * holding parts (offset in the record, bytes, matrix); part k of record pos[i] lands in
 * slabs[mat_k] + slot[i] * row_bytes[mat_k]. Neighbours at most max_gap records apart are
 * merged into one preadv (the records between land in junk), at most IOV_MAX buffers a read.
 * The reads are shared out among n_threads threads (the caller is one of them).
 * Returns the reads issued, out[0] the bytes; -1 on an error or a short read, with out[1] its
 * offset, out[2] errno (0: short read), out[3] the bytes it got, out[4] the bytes it asked for.
 */
#define _GNU_SOURCE
#include <errno.h>
#include <limits.h>
#include <pthread.h>
#include <stdint.h>
#include <stdlib.h>
#include <string.h>
#include <sys/uio.h>
#include <unistd.h>

#ifndef IOV_MAX
#define IOV_MAX 1024
#endif

typedef struct {
    int64_t off, len, got;
    int32_t iov0, n_iov;
    int err;
} job_t;

typedef struct {
    int fd;
    job_t *jobs;
    struct iovec *iov;
    int64_t n_jobs, next;
} queue_t;

static void run_job(int fd, job_t *j, struct iovec *iov) {
    int64_t done = 0;
    struct iovec *v = iov + j->iov0;
    int nv = j->n_iov;
    while (done < j->len) {
        ssize_t r = preadv(fd, v, nv, j->off + done);
        if (r < 0) {
            if (errno == EINTR) continue;
            j->err = errno;
            break;
        }
        if (r == 0) break; /* end of file: short */
        done += r;
        while (nv > 0 && (int64_t)v->iov_len <= r) { r -= (ssize_t)v->iov_len; v++; nv--; }
        if (nv > 0 && r > 0) { /* a partly filled buffer: continue inside it (a private copy of the entry) */
            v->iov_base = (uint8_t *)v->iov_base + r;
            v->iov_len -= (size_t)r;
        }
    }
    j->got = done;
}

static void *worker(void *arg) {
    queue_t *q = (queue_t *)arg;
    for (;;) {
        int64_t k = __atomic_fetch_add(&q->next, 1, __ATOMIC_RELAXED);
        if (k >= q->n_jobs) break;
        run_job(q->fd, &q->jobs[k], q->iov);
    }
    return NULL;
}

int64_t pi_read_records(int fd, int64_t base, int64_t stride, int n_parts, const int64_t *part_off,
                        const int64_t *part_len, const int64_t *part_mat, uint8_t *const *slabs,
                        const int64_t *row_bytes, const int64_t *pos, const int64_t *slot, int64_t n,
                        int64_t max_gap, int n_threads, uint8_t *junk, int64_t junk_len, int64_t *out) {
    memset(out, 0, 5 * sizeof(int64_t));
    if (n <= 0) return 0;
    const int64_t per = 2 * (int64_t)n_parts + 2; /* buffers one record may add (gap, pads, parts) */
    struct iovec *iov = malloc((size_t)(n * per) * sizeof(*iov));
    job_t *jobs = malloc((size_t)n * sizeof(*jobs));
    if (!iov || !jobs) {
        free(iov);
        free(jobs);
        out[2] = ENOMEM;
        return -1;
    }
    int64_t nj = 0, ni = 0, prev = -1;
    for (int64_t i = 0; i < n; i++) {
        const int64_t p = pos[i];
        job_t *j = nj ? &jobs[nj - 1] : NULL;
        const int fits = j && p - prev - 1 <= max_gap && j->n_iov + per <= IOV_MAX && (p - prev - 1) * stride <= junk_len;
        if (!fits) {
            j = &jobs[nj++];
            j->off = base + p * stride;
            j->len = 0;
            j->iov0 = (int32_t)ni;
            j->n_iov = 0;
            j->err = 0;
            j->got = 0;
        } else if (p > prev + 1) {
            iov[ni].iov_base = junk;
            iov[ni++].iov_len = (size_t)((p - prev - 1) * stride);
            j->n_iov++;
            j->len += (p - prev - 1) * stride;
        }
        int64_t o = 0;
        for (int k = 0; k < n_parts; k++) {
            if (part_off[k] > o) {
                iov[ni].iov_base = junk;
                iov[ni++].iov_len = (size_t)(part_off[k] - o);
                j->n_iov++;
            }
            const int64_t m = part_mat[k];
            iov[ni].iov_base = slabs[m] + slot[i] * row_bytes[m];
            iov[ni++].iov_len = (size_t)part_len[k];
            j->n_iov++;
            o = part_off[k] + part_len[k];
        }
        if (stride > o) {
            iov[ni].iov_base = junk;
            iov[ni++].iov_len = (size_t)(stride - o);
            j->n_iov++;
        }
        j->len += stride;
        prev = p;
    }
    queue_t q = {fd, jobs, iov, nj, 0};
    int nt = n_threads < 1 ? 1 : n_threads;
    if (nt > nj) nt = (int)nj;
    pthread_t th[64];
    if (nt > 64) nt = 64;
    int started = 0;
    for (int t = 1; t < nt; t++)
        if (pthread_create(&th[started], NULL, worker, &q) == 0) started++;
    worker(&q);
    for (int t = 0; t < started; t++) pthread_join(th[t], NULL);
    int64_t bytes = 0, rc = nj;
    for (int64_t k = 0; k < nj; k++) {
        bytes += jobs[k].got;
        if (rc >= 0 && (jobs[k].err || jobs[k].got != jobs[k].len)) {
            out[1] = jobs[k].off;
            out[2] = jobs[k].err;
            out[3] = jobs[k].got;
            out[4] = jobs[k].len;
            rc = -1;
        }
    }
    out[0] = bytes;
    free(iov);
    free(jobs);
    return rc;
}
