/* Cold FFN rows read from a file into resident slots, several reads in flight (cold_rows.py).
 *
 * pi_read_records: records pos[0..n) (ascending) of one stream, record p at base + p * stride
 * holding parts (offset in the record, bytes, matrix); part k of record pos[i] lands in
 * slabs[mat_k] + slot[i] * row_bytes[mat_k]. Neighbours at most max_gap records apart are
 * merged into one read (the records between are read and dropped), at most max_job bytes and
 * IOV_MAX buffers a read. The reads are shared out among n_threads threads (the caller is one).
 *
 * direct != 0: fd was opened with O_DIRECT (base and stride multiples of 4096): each read lands
 * in the thread's page-aligned staging buffer (stage + t * max_job, n_threads of them, max_job a
 * multiple of 4096) and its parts are copied out, so nothing passes through the page cache. Otherwise one preadv scatters each part straight
 * into its slot (the gaps and pads into a junk buffer).
 *
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
    int64_t i0, i1, off, len, got;
    int err;
} job_t;

typedef struct {
    int fd, direct, n_parts;
    int64_t stride;
    const int64_t *part_off, *part_len, *part_mat, *row_bytes, *pos, *slot;
    uint8_t *const *slabs;
    uint8_t *junk, *stage;
    int64_t junk_len, max_job;
    job_t *jobs;
    int64_t n_jobs, next, tid;
} queue_t;

/* read len bytes at off through the buffers v[0..nv) (entries are advanced on a partial read) */
static int64_t read_all(int fd, struct iovec *v, int nv, int64_t off, int64_t len, int *err) {
    int64_t done = 0;
    while (done < len && nv > 0) {
        ssize_t r = preadv(fd, v, nv, off + done);
        if (r < 0) {
            if (errno == EINTR) continue;
            *err = errno;
            break;
        }
        if (r == 0) break; /* end of file: a short read */
        done += r;
        while (nv > 0 && (int64_t)v->iov_len <= r) { r -= (ssize_t)v->iov_len; v++; nv--; }
        if (nv > 0 && r > 0) {
            v->iov_base = (uint8_t *)v->iov_base + r;
            v->iov_len -= (size_t)r;
        }
    }
    return done;
}

static void run_job(queue_t *q, job_t *j, struct iovec *iov, uint8_t *stage) {
    const int64_t s = q->stride;
    const int64_t p0 = q->pos[j->i0];
    if (q->direct) {
        struct iovec v = {stage, (size_t)j->len};
        j->got = read_all(q->fd, &v, 1, j->off, j->len, &j->err);
        if (j->got != j->len) return;
        for (int64_t i = j->i0; i < j->i1; i++) {
            const uint8_t *rec = stage + (q->pos[i] - p0) * s;
            for (int k = 0; k < q->n_parts; k++) {
                const int64_t m = q->part_mat[k];
                memcpy(q->slabs[m] + q->slot[i] * q->row_bytes[m], rec + q->part_off[k], (size_t)q->part_len[k]);
            }
        }
        return;
    }
    int nv = 0;
    int64_t prev = p0 - 1;
    for (int64_t i = j->i0; i < j->i1; i++) {
        const int64_t p = q->pos[i];
        if (p > prev + 1) {
            iov[nv].iov_base = q->junk;
            iov[nv++].iov_len = (size_t)((p - prev - 1) * s);
        }
        int64_t o = 0;
        for (int k = 0; k < q->n_parts; k++) {
            if (q->part_off[k] > o) {
                iov[nv].iov_base = q->junk;
                iov[nv++].iov_len = (size_t)(q->part_off[k] - o);
            }
            const int64_t m = q->part_mat[k];
            iov[nv].iov_base = q->slabs[m] + q->slot[i] * q->row_bytes[m];
            iov[nv++].iov_len = (size_t)q->part_len[k];
            o = q->part_off[k] + q->part_len[k];
        }
        if (s > o) {
            iov[nv].iov_base = q->junk;
            iov[nv++].iov_len = (size_t)(s - o);
        }
        prev = p;
    }
    j->got = read_all(q->fd, iov, nv, j->off, j->len, &j->err);
}

static void *worker(void *arg) {
    queue_t *q = (queue_t *)arg;
    struct iovec *iov = q->direct ? NULL : malloc(IOV_MAX * sizeof(*iov));
    uint8_t *stage = q->direct ? q->stage + __atomic_fetch_add(&q->tid, 1, __ATOMIC_RELAXED) * q->max_job : NULL;
    for (;;) {
        int64_t k = __atomic_fetch_add(&q->next, 1, __ATOMIC_RELAXED);
        if (k >= q->n_jobs) break;
        if (!q->direct && !iov) {
            q->jobs[k].err = ENOMEM;
            continue;
        }
        run_job(q, &q->jobs[k], iov, stage);
    }
    free(iov);
    return NULL;
}

int64_t pi_read_records(int fd, int direct, int64_t base, int64_t stride, int n_parts, const int64_t *part_off,
                        const int64_t *part_len, const int64_t *part_mat, uint8_t *const *slabs,
                        const int64_t *row_bytes, const int64_t *pos, const int64_t *slot, int64_t n,
                        int64_t max_gap, int64_t max_job, int n_threads, uint8_t *junk, int64_t junk_len,
                        uint8_t *stage, int64_t *out) {
    memset(out, 0, 5 * sizeof(int64_t));
    if (n <= 0) return 0;
    if (max_job < stride) {
        out[2] = EINVAL;
        return -1;
    }
    job_t *jobs = malloc((size_t)n * sizeof(*jobs));
    if (!jobs) {
        out[2] = ENOMEM;
        return -1;
    }
    const int64_t per = 2 * (int64_t)n_parts + 2; /* buffers one record may add (gap, pads, parts) */
    int64_t nj = 0, nv = 0;
    for (int64_t i = 0; i < n; i++) {
        job_t *j = nj ? &jobs[nj - 1] : NULL;
        const int64_t p = pos[i], prev = i ? pos[i - 1] : -1;
        const int64_t gap = p - prev - 1;
        const int fits = j && gap <= max_gap && (direct ? (p + 1) * stride - j->off + base <= max_job
                                                        : nv + per <= IOV_MAX && gap * stride <= junk_len);
        if (!fits) {
            j = &jobs[nj++];
            j->i0 = i;
            j->off = base + p * stride;
            j->err = 0;
            j->got = 0;
            nv = 0;
        }
        j->i1 = i + 1;
        j->len = base + (p + 1) * stride - j->off;
        nv += per;
    }
    queue_t q = {fd, direct, n_parts, stride, part_off, part_len, part_mat, row_bytes, pos, slot, slabs,
                 junk, stage, junk_len, max_job, jobs, nj, 0, 0};
    int nt = n_threads < 1 ? 1 : n_threads;
    if (nt > nj) nt = (int)nj;
    if (nt > 64) nt = 64;
    pthread_t th[64];
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
    free(jobs);
    return rc;
}
