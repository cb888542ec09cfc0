/*
 * Read (or copy) a stored unit's bytes into a caller's buffer and hash them with XXH3-128,
 * piece by piece, without the GIL: the native loops behind vllm_draft_offload.fast_io, for
 * fetches (pread_hash_into, copy_hash_into; pread_hash_layers_into: a spread fetch's run of
 * layers, hashed per layer) and for writes (copy_hash_layers_into: a unit's
 * payload copied into the storage's buffer, hashed whole and per layer on the way).
 *
 * Why native: the Python loop (fast_io's fallback) gives up the GIL and takes it back for
 * every read (or copy) and every hash call. Beside vLLM's engine thread each take can wait
 * out the engine's Python, so its pieces must be large (4 MiB) to take the GIL few times;
 * but with several read threads a 4 MiB piece leaves the CPU cache before it is hashed, and
 * the fetch moves every byte through memory three times where a plain read moves it twice.
 * Here the whole loop runs inside one release of the GIL, so the pieces can be as small
 * as a core's L2 holds: each is hashed right after it landed, while it is still in L2.
 *
 * The digest is xxHash's canonical (big-endian) XXH3-128, the bytes of python-xxhash's
 * xxh3_128().digest(), from the vendored xxhash.h (and, on x86, its runtime dispatcher,
 * which picks SSE2/AVX2/AVX-512 as python-xxhash does).
 *
 * Arguments that cannot be (a piece of 0 bytes, lengths or layer sizes that disagree)
 * raise ValueError before the GIL is released. A read's errors, as exceptions the Python
 * side translates (fast_io, l3_fs_reads.ObjectFile):
 *   EndOfFile(done)       the file ended after `done` bytes of the destination were filled;
 *   DeadlinePassed(done)  CLOCK_MONOTONIC (time.monotonic on Linux) passed the deadline
 *                         before the piece at `done`; checked before every piece, so
 *                         nothing is written into the destination after it raised;
 *   Stopped(done)         the caller's stop flag (the first byte of a buffer it passed,
 *                         set non-zero from another thread) was set before the piece at
 *                         `done`, checked as the deadline is: a fetch given up stops its
 *                         reads in flight within a piece instead of reading the unit out;
 *   OSError               any other failed pread (EINTR is retried).
 *
 * A storage lookup (l3_store) asks of many stored files whether they exist and, for the
 * first ones a fetch would read, whether the page cache holds them whole: files_exist and
 * files_resident answer for a whole list in one release of the GIL. Per file from Python,
 * each stat, open, mmap and mincore gave the GIL up and took it back, and beside vLLM's
 * busy engine thread each take could wait out a switch interval.
 */
#define PY_SSIZE_T_CLEAN
#define _FILE_OFFSET_BITS 64
#include <Python.h>

#include <errno.h>
#include <fcntl.h>
#include <math.h>
#include <pthread.h>
#include <stdlib.h>
#include <string.h>
#include <sys/mman.h>
#include <sys/stat.h>
#include <time.h>
#include <unistd.h>

#define XXH_INLINE_ALL
#include "xxhash.h"
#ifdef FASTREAD_X86_DISPATCH
/* Streaming updates go through the runtime dispatcher (xxh_x86dispatch.c, linked in);
   reset and digest stay inline. */
#include "xxh_x86dispatch.h"
#endif

/* Every release of the GIL by this module's calls, counted while the GIL is still held:
   what gil_releases() returns, so the tests check that a call gives the GIL up once
   whatever its length (a probe of 64 files once, not 64 times) without timing anything. */
static unsigned long long gil_releases_so_far = 0;
#define BEGIN_WITHOUT_GIL                                                                      \
    gil_releases_so_far++;                                                                     \
    Py_BEGIN_ALLOW_THREADS

static PyObject *EndOfFile;
static PyObject *DeadlinePassed;
static PyObject *Stopped;

enum outcome { DONE = 0, ENDED, LATE, FAILED, STOPPED };

/* The stop flag of a read: the first byte of `obj`'s buffer (None or NULL: no flag).
   Returns 0 with *flag set (NULL without one; `view` then holds nothing to release),
   or -1 with an exception set. */
static int stop_flag(PyObject *obj, Py_buffer *view, const volatile unsigned char **flag) {
    *flag = NULL;
    view->obj = NULL;
    if (obj == NULL || obj == Py_None)
        return 0;
    if (PyObject_GetBuffer(obj, view, PyBUF_SIMPLE) < 0)
        return -1;
    if (view->len < 1) {
        PyBuffer_Release(view);
        PyErr_SetString(PyExc_ValueError, "stop must be a buffer of at least one byte");
        return -1;
    }
    *flag = (const volatile unsigned char *)view->buf;
    return 0;
}

static double monotonic_now(void) {
    struct timespec ts;
    clock_gettime(CLOCK_MONOTONIC, &ts);
    return (double)ts.tv_sec + (double)ts.tv_nsec * 1e-9;
}

static PyObject *canonical_digest(XXH3_state_t *state) {
    XXH128_canonical_t canonical;
    XXH128_canonicalFromHash(&canonical, XXH3_128bits_digest(state));
    return PyBytes_FromStringAndSize((const char *)canonical.digest, sizeof(canonical.digest));
}

static PyObject *raise_outcome(enum outcome outcome, Py_ssize_t done, int err) {
    if (outcome == FAILED) {
        errno = err;
        return PyErr_SetFromErrno(PyExc_OSError);
    }
    PyObject *filled = PyLong_FromSsize_t(done);
    if (filled != NULL) {
        PyErr_SetObject(outcome == ENDED     ? EndOfFile
                        : outcome == STOPPED ? Stopped
                                             : DeadlinePassed,
                        filled);
        Py_DECREF(filled);
    }
    return NULL;
}

/* Hash out[done, end) into each layer it overlaps (layer i ends at ends[i], the last at
   the destination's end); *layer: the first layer not yet wholly hashed. Empty layers are
   passed over (their digest is the empty input's); the last layer ends at the end, so one
   ends past `at`. */
static void hash_layer_parts(const char *out, Py_ssize_t done, Py_ssize_t end,
                             XXH3_state_t *layers, const Py_ssize_t *ends, Py_ssize_t *layer) {
    for (Py_ssize_t at = done, stop; at < end; at = stop) {
        while (ends[*layer] <= at)
            (*layer)++;
        stop = ends[*layer] < end ? ends[*layer] : end;
        XXH3_128bits_update(&layers[*layer], out + at, (size_t)(stop - at));
    }
}

/* The read loop of both reads, to run without the GIL: fill out[0, nbytes) with fd's
   bytes from file_offset, piece_bytes at a time, each piece hashed right after it landed
   into `whole` (unless NULL) and, where `layers` is not NULL, into each layer it overlaps.
   *done: the bytes filled; *err: errno of a FAILED read. */
static enum outcome pread_hash_pieces(int fd, long long file_offset, char *out,
                                      Py_ssize_t nbytes, Py_ssize_t piece_bytes,
                                      double deadline, const volatile unsigned char *stop,
                                      XXH3_state_t *whole, XXH3_state_t *layers,
                                      const Py_ssize_t *ends, Py_ssize_t *done_out, int *err) {
    Py_ssize_t done = 0, layer = 0;
    enum outcome outcome = DONE;
    while (done < nbytes) {
        if (stop != NULL && *stop) {
            outcome = STOPPED;
            break;
        }
        if (monotonic_now() > deadline) {
            outcome = LATE;
            break;
        }
        Py_ssize_t piece = nbytes - done < piece_bytes ? nbytes - done : piece_bytes;
        Py_ssize_t got = 0;
        while (got < piece) {
            ssize_t n = pread(fd, out + done + got, (size_t)(piece - got),
                              (off_t)(file_offset + done + got));
            if (n > 0) {
                got += n;
            } else if (n == 0) {
                outcome = ENDED;
                break;
            } else if (errno != EINTR) {
                outcome = FAILED;
                *err = errno;
                break;
            }
        }
        if (outcome != DONE) {
            done += got;
            break;
        }
        if (whole != NULL)
            XXH3_128bits_update(whole, out + done, (size_t)piece);
        if (layers != NULL)
            hash_layer_parts(out, done, done + piece, layers, ends, &layer);
        done += piece;
    }
    *done_out = done;
    return outcome;
}

PyDoc_STRVAR(pread_hash_into_doc,
"pread_hash_into(fd, file_offset, dest, piece_bytes, deadline, stop=None) -> bytes\n\n"
"Fill dest with fd's bytes from file_offset, piece_bytes at a time, hashing each piece\n"
"right after it landed; returns the 16-byte XXH3-128 digest of dest. Raises\n"
"EndOfFile(done) or DeadlinePassed(done) (checked before each piece against\n"
"time.monotonic), Stopped(done) (stop's first byte non-zero before a piece; stop: a\n"
"buffer another thread sets) or OSError. The GIL is released for the whole call.");

static PyObject *pread_hash_into(PyObject *self, PyObject *args) {
    int fd;
    long long file_offset;
    Py_buffer dest;
    Py_ssize_t piece_bytes;
    double deadline;
    PyObject *stop_obj = NULL;
    if (!PyArg_ParseTuple(args, "iLw*nd|O:pread_hash_into", &fd, &file_offset, &dest,
                          &piece_bytes, &deadline, &stop_obj))
        return NULL;
    if (piece_bytes <= 0 || file_offset < 0) {
        PyBuffer_Release(&dest);
        PyErr_SetString(PyExc_ValueError, "piece_bytes must be > 0 and file_offset >= 0");
        return NULL;
    }
    Py_buffer stop_view;
    const volatile unsigned char *stop;
    if (stop_flag(stop_obj, &stop_view, &stop) < 0) {
        PyBuffer_Release(&dest);
        return NULL;
    }
    XXH3_state_t state;
    XXH3_128bits_reset(&state);
    Py_ssize_t done = 0;
    enum outcome outcome;
    int err = 0;
    BEGIN_WITHOUT_GIL
    outcome = pread_hash_pieces(fd, file_offset, dest.buf, dest.len, piece_bytes, deadline,
                                stop, &state, NULL, NULL, &done, &err);
    Py_END_ALLOW_THREADS
    if (stop_view.obj != NULL)
        PyBuffer_Release(&stop_view);
    PyBuffer_Release(&dest);
    if (outcome != DONE)
        return raise_outcome(outcome, done, err);
    return canonical_digest(&state);
}

/* Sets a ValueError and returns 1 where a copy's arguments cannot be (fast_io's
   _copy_arrays, with the same messages). */
static int copy_args_error(const Py_buffer *src, const Py_buffer *dest,
                           Py_ssize_t piece_bytes) {
    if (piece_bytes <= 0)
        PyErr_Format(PyExc_ValueError, "piece_bytes must be > 0, not %zd", piece_bytes);
    else if (src->len != dest->len)
        PyErr_Format(PyExc_ValueError, "src has %zd bytes, dest %zd: they must be as many",
                     src->len, dest->len);
    else
        return 0;
    return 1;
}

PyDoc_STRVAR(copy_hash_into_doc,
"copy_hash_into(src, dest, piece_bytes) -> bytes\n\n"
"Copy src into dest (of the same length), piece_bytes at a time, hashing each piece in\n"
"dest right after it was copied; returns the 16-byte XXH3-128 digest. The GIL is\n"
"released for the whole call.");

/* The copy loop of both copies, to run without the GIL: copy in to out piece by piece,
   each piece hashed into `whole` right after it landed and, where `layers` is not NULL,
   into each layer it overlaps (layer i ends at ends[i]; the last at nbytes). Advances
   with `done = end`, so a piece_bytes near the largest Py_ssize_t cannot overflow. */
static void copy_hash_pieces(const char *in, char *out, Py_ssize_t nbytes,
                             Py_ssize_t piece_bytes, XXH3_state_t *whole,
                             XXH3_state_t *layers, const Py_ssize_t *ends) {
    Py_ssize_t layer = 0; /* the first layer not yet wholly hashed */
    for (Py_ssize_t done = 0, end; done < nbytes; done = end) {
        end = nbytes - done < piece_bytes ? nbytes : done + piece_bytes;
        memcpy(out + done, in + done, (size_t)(end - done));
        XXH3_128bits_update(whole, out + done, (size_t)(end - done));
        if (layers != NULL)
            hash_layer_parts(out, done, end, layers, ends, &layer);
    }
}

static PyObject *copy_hash_into(PyObject *self, PyObject *args) {
    Py_buffer src, dest;
    Py_ssize_t piece_bytes;
    if (!PyArg_ParseTuple(args, "y*w*n:copy_hash_into", &src, &dest, &piece_bytes))
        return NULL;
    if (copy_args_error(&src, &dest, piece_bytes)) {
        PyBuffer_Release(&src);
        PyBuffer_Release(&dest);
        return NULL;
    }
    XXH3_state_t state;
    XXH3_128bits_reset(&state);
    BEGIN_WITHOUT_GIL
    copy_hash_pieces(src.buf, dest.buf, dest.len, piece_bytes, &state, NULL, NULL);
    Py_END_ALLOW_THREADS
    PyBuffer_Release(&src);
    PyBuffer_Release(&dest);
    return canonical_digest(&state);
}

PyDoc_STRVAR(copy_hash_layers_into_doc,
"copy_hash_layers_into(src, dest, layer_sizes, piece_bytes) -> (bytes, list[bytes])\n\n"
"Copy src into dest (of the same length), piece_bytes at a time, hashing each piece in\n"
"dest right after it was copied, for the whole and for each layer it overlaps (layers:\n"
"back-to-back byte ranges of layer_sizes bytes, in order, covering dest); returns the\n"
"16-byte XXH3-128 digests of the whole and of each layer. The GIL is released for the\n"
"whole copy.");

/* layer_sizes as the ends of the layers in dest (a PyMem array of *count, NULL for none),
   each size checked to be >= 0 and the sizes to add up to nbytes (fast_io's
   _layer_ends, with the same errors). */
static int layer_ends_of(PyObject *layer_sizes, Py_ssize_t nbytes, Py_ssize_t **ends,
                         Py_ssize_t *count) {
    PyObject *seq = PySequence_Fast(layer_sizes, "layer_sizes must be an iterable of ints");
    if (seq == NULL)
        return -1;
    Py_ssize_t n = PySequence_Fast_GET_SIZE(seq);
    Py_ssize_t *out = n > 0 ? PyMem_New(Py_ssize_t, n) : NULL;
    if (n > 0 && out == NULL) {
        Py_DECREF(seq);
        PyErr_NoMemory();
        return -1;
    }
    Py_ssize_t end = 0;
    for (Py_ssize_t i = 0; i < n; i++) {
        /* An int out of range is clipped: too large or negative either way. */
        Py_ssize_t size = PyNumber_AsSsize_t(PySequence_Fast_GET_ITEM(seq, i), NULL);
        if (size == -1 && PyErr_Occurred())
            goto fail;
        if (size < 0) {
            PyErr_Format(PyExc_ValueError, "layer_sizes[%zd] is negative", i);
            goto fail;
        }
        if (size > nbytes - end) {
            PyErr_Format(PyExc_ValueError,
                         "layer_sizes add up to more than dest's %zd bytes (at layer %zd)",
                         nbytes, i);
            goto fail;
        }
        end += size;
        out[i] = end;
    }
    if (end != nbytes) {
        PyErr_Format(PyExc_ValueError, "layer_sizes add up to %zd bytes, dest has %zd", end,
                     nbytes);
        goto fail;
    }
    Py_DECREF(seq);
    *ends = out;
    *count = n;
    return 0;
fail:
    Py_DECREF(seq);
    PyMem_Free(out);
    return -1;
}

/* The digests of `count` layers' states, as a list of bytes. */
static PyObject *layer_digest_list(XXH3_state_t *layers, Py_ssize_t count) {
    PyObject *digests = PyList_New(count);
    if (digests == NULL)
        return NULL;
    for (Py_ssize_t i = 0; i < count; i++) {
        PyObject *digest = canonical_digest(&layers[i]);
        if (digest == NULL) {
            Py_DECREF(digests);
            return NULL;
        }
        PyList_SET_ITEM(digests, i, digest);
    }
    return digests;
}

/* The result of copy_hash_layers_into: (whole digest, [layer digests]). */
static PyObject *layer_digests_result(XXH3_state_t *whole, XXH3_state_t *layers,
                                      Py_ssize_t count) {
    PyObject *digests = layer_digest_list(layers, count);
    if (digests == NULL)
        return NULL;
    PyObject *whole_digest = canonical_digest(whole);
    if (whole_digest == NULL) {
        Py_DECREF(digests);
        return NULL;
    }
    PyObject *result = PyTuple_Pack(2, whole_digest, digests);
    Py_DECREF(whole_digest);
    Py_DECREF(digests);
    return result;
}

/* Reset hash states for `count` layers, in *layers (NULL for none; free() it), and the
   ends of the layers of layer_sizes in a destination of nbytes, in *ends (PyMem_Free it).
   -1 with an exception set on bad sizes or no memory. */
static int layer_states(PyObject *layer_sizes, Py_ssize_t nbytes, XXH3_state_t **layers,
                        Py_ssize_t **ends, Py_ssize_t *count) {
    *layers = NULL;
    if (layer_ends_of(layer_sizes, nbytes, ends, count) < 0)
        return -1; /* its ValueError (or TypeError) is set */
    if (*count == 0)
        return 0;
    /* XXH3_state_t must be 64-byte aligned (its size is a multiple of 64) */
    if (posix_memalign((void **)layers, 64, (size_t)*count * sizeof(**layers)) != 0) {
        *layers = NULL;
        PyErr_NoMemory();
        return -1;
    }
    for (Py_ssize_t i = 0; i < *count; i++)
        XXH3_128bits_reset(&(*layers)[i]);
    return 0;
}

static PyObject *copy_hash_layers_into(PyObject *self, PyObject *args) {
    Py_buffer src, dest;
    PyObject *layer_sizes;
    Py_ssize_t piece_bytes;
    if (!PyArg_ParseTuple(args, "y*w*On:copy_hash_layers_into", &src, &dest, &layer_sizes,
                          &piece_bytes))
        return NULL;
    PyObject *result = NULL;
    Py_ssize_t *ends = NULL, count = 0;
    XXH3_state_t whole, *layers = NULL;
    if (copy_args_error(&src, &dest, piece_bytes)) {
        /* its ValueError is set */
    } else if (layer_states(layer_sizes, dest.len, &layers, &ends, &count) == 0) {
        XXH3_128bits_reset(&whole);
        BEGIN_WITHOUT_GIL
        copy_hash_pieces(src.buf, dest.buf, dest.len, piece_bytes, &whole, layers, ends);
        Py_END_ALLOW_THREADS
        result = layer_digests_result(&whole, layers, count);
    }
    free(layers);
    PyMem_Free(ends);
    PyBuffer_Release(&src);
    PyBuffer_Release(&dest);
    return result;
}

/* Most threads one layered read may use: a unit is read by a handful at once. */
#define MAX_READ_THREADS 64

/* One thread's share of a layered read: dest bytes [begin, end), whole layers
   [first_layer, ...), their ends relative to begin. */
struct layer_group {
    int fd;
    long long file_offset;
    char *out;
    Py_ssize_t begin, end, piece_bytes;
    double deadline;
    const volatile unsigned char *stop;
    XXH3_state_t *layers;
    Py_ssize_t *ends;
    enum outcome outcome;
    Py_ssize_t done;
    int err;
};

static void *read_layer_group(void *arg) {
    struct layer_group *g = arg;
    g->outcome = pread_hash_pieces(g->fd, g->file_offset + g->begin, g->out + g->begin,
                                   g->end - g->begin, g->piece_bytes, g->deadline, g->stop,
                                   NULL, g->layers, g->ends, &g->done, &g->err);
    return NULL;
}

/* Split layers (ends[count - 1] == nbytes) into at most `threads` groups of whole layers
   of about equal bytes; returns how many, each group's first layer in first[] and
   its byte range in begins[] / stops[]. Every group holds at least one byte. */
static Py_ssize_t split_layers(const Py_ssize_t *ends, Py_ssize_t count, Py_ssize_t nbytes,
                               int threads, Py_ssize_t *first, Py_ssize_t *begins,
                               Py_ssize_t *stops) {
    Py_ssize_t groups = 0, layer = 0, begin = 0;
    for (int g = 0; g < threads && layer < count && begin < nbytes; g++) {
        Py_ssize_t target = (Py_ssize_t)((double)nbytes * (g + 1) / threads);
        Py_ssize_t start = layer;
        while (layer < count - 1 && (ends[layer] <= begin || ends[layer] < target))
            layer++;
        first[groups] = start;
        begins[groups] = begin;
        stops[groups] = ends[layer];
        begin = ends[layer];
        layer++;
        groups++;
    }
    return groups;
}

/* Read dest [0, nbytes) as in pread_hash_pieces, the layers split over up to `threads`
   threads (the caller's among them), each hashing its own layers; runs without the
   GIL. The outcome of the earliest group in dest that failed, with *done its end of
   filled bytes from dest's start (other groups may have filled bytes past it). */
static enum outcome pread_hash_layer_groups(int fd, long long file_offset, char *out,
                                            Py_ssize_t nbytes, Py_ssize_t piece_bytes,
                                            double deadline, const volatile unsigned char *stop,
                                            XXH3_state_t *layers, const Py_ssize_t *ends,
                                            Py_ssize_t count, int threads, Py_ssize_t *done,
                                            int *err) {
    if (threads <= 1 || count <= 1)
        return pread_hash_pieces(fd, file_offset, out, nbytes, piece_bytes, deadline, stop,
                                 NULL, layers, ends, done, err);
    Py_ssize_t first[MAX_READ_THREADS], begins[MAX_READ_THREADS], stops[MAX_READ_THREADS];
    Py_ssize_t groups = split_layers(ends, count, nbytes, threads, first, begins, stops);
    struct layer_group group[MAX_READ_THREADS];
    pthread_t tid[MAX_READ_THREADS];
    int started[MAX_READ_THREADS] = {0};
    Py_ssize_t *relative = malloc((size_t)count * sizeof(*relative));
    if (relative == NULL) /* no memory for the split: read it on this thread alone */
        return pread_hash_pieces(fd, file_offset, out, nbytes, piece_bytes, deadline, stop,
                                 NULL, layers, ends, done, err);
    for (Py_ssize_t g = 0; g < groups; g++) {
        Py_ssize_t last = g + 1 < groups ? first[g + 1] : count;
        for (Py_ssize_t i = first[g]; i < last; i++)
            relative[i] = ends[i] - begins[g];
        group[g] = (struct layer_group){fd,
                                        file_offset,
                                        out,
                                        begins[g],
                                        stops[g],
                                        piece_bytes,
                                        deadline,
                                        stop,
                                        layers + first[g],
                                        relative + first[g],
                                        DONE,
                                        0,
                                        0};
    }
    /* Groups 1.. on threads of their own, group 0 here; a thread that cannot be made
       reads its group here too, after. */
    for (Py_ssize_t g = 1; g < groups; g++)
        started[g] = pthread_create(&tid[g], NULL, read_layer_group, &group[g]) == 0;
    read_layer_group(&group[0]);
    for (Py_ssize_t g = 1; g < groups; g++) {
        if (started[g])
            pthread_join(tid[g], NULL);
        else
            read_layer_group(&group[g]);
    }
    free(relative);
    for (Py_ssize_t g = 0; g < groups; g++) {
        if (group[g].outcome != DONE) {
            *done = group[g].begin + group[g].done;
            *err = group[g].err;
            return group[g].outcome;
        }
    }
    *done = nbytes;
    return DONE;
}

PyDoc_STRVAR(pread_hash_layers_into_doc,
"pread_hash_layers_into(fd, file_offset, dest, layer_sizes, piece_bytes, deadline,\n"
"                       threads=1, stop=None) -> list[bytes]\n\n"
"Fill dest with fd's bytes from file_offset, piece_bytes at a time, hashing each piece\n"
"right after it landed into each layer it overlaps (layers: back-to-back byte ranges of\n"
"layer_sizes bytes, in order, covering dest); returns the 16-byte XXH3-128 digest of\n"
"each layer. threads > 1: the layers are split into up to that many groups of whole\n"
"layers of about equal bytes, each read on a thread of its own (the caller's among them).\n"
"Raises as pread_hash_into (EndOfFile / DeadlinePassed / Stopped: `done` is where the\n"
"earliest group that failed stopped; other groups may have filled bytes past it; every\n"
"group checks stop before each of its pieces). The GIL is\n"
"released for the whole read, and every thread has ended when it returns.");

static PyObject *pread_hash_layers_into(PyObject *self, PyObject *args) {
    int fd, threads = 1;
    long long file_offset;
    Py_buffer dest;
    PyObject *layer_sizes;
    Py_ssize_t piece_bytes;
    double deadline;
    PyObject *stop_obj = NULL;
    if (!PyArg_ParseTuple(args, "iLw*Ond|iO:pread_hash_layers_into", &fd, &file_offset, &dest,
                          &layer_sizes, &piece_bytes, &deadline, &threads, &stop_obj))
        return NULL;
    if (piece_bytes <= 0 || file_offset < 0 || threads < 1 || threads > MAX_READ_THREADS) {
        PyBuffer_Release(&dest);
        PyErr_Format(PyExc_ValueError,
                     "piece_bytes must be > 0 and file_offset >= 0, threads in 1..%d",
                     MAX_READ_THREADS);
        return NULL;
    }
    Py_buffer stop_view;
    const volatile unsigned char *stop;
    if (stop_flag(stop_obj, &stop_view, &stop) < 0) {
        PyBuffer_Release(&dest);
        return NULL;
    }
    PyObject *result = NULL;
    Py_ssize_t *ends = NULL, count = 0, done = 0;
    XXH3_state_t *layers = NULL;
    if (layer_states(layer_sizes, dest.len, &layers, &ends, &count) == 0) {
        enum outcome outcome;
        int err = 0;
        BEGIN_WITHOUT_GIL
        outcome = pread_hash_layer_groups(fd, file_offset, dest.buf, dest.len, piece_bytes,
                                          deadline, stop, layers, ends, count, threads, &done,
                                          &err);
        Py_END_ALLOW_THREADS
        result = outcome == DONE ? layer_digest_list(layers, count)
                                 : raise_outcome(outcome, done, err);
    }
    free(layers);
    PyMem_Free(ends);
    if (stop_view.obj != NULL)
        PyBuffer_Release(&stop_view);
    PyBuffer_Release(&dest);
    return result;
}

/* The paths of a sequence of str/bytes/os.PathLike, as file-system bytes: `held` keeps the
   bytes objects alive, `paths` points into them. NULL with an exception set on bad input. */
static const char **fs_paths(PyObject *seq, PyObject **held, Py_ssize_t *count) {
    PyObject *fast = PySequence_Fast(seq, "paths must be a sequence of paths");
    if (fast == NULL)
        return NULL;
    Py_ssize_t n = PySequence_Fast_GET_SIZE(fast);
    PyObject *list = PyList_New(n);
    const char **paths = PyMem_Calloc(n > 0 ? (size_t)n : 1, sizeof(*paths));
    if (list == NULL || paths == NULL) {
        Py_XDECREF(list);
        PyMem_Free(paths);
        Py_DECREF(fast);
        if (paths == NULL)
            PyErr_NoMemory();
        return NULL;
    }
    for (Py_ssize_t i = 0; i < n; i++) {
        PyObject *encoded = NULL;
        if (!PyUnicode_FSConverter(PySequence_Fast_GET_ITEM(fast, i), &encoded)) {
            Py_DECREF(list);
            PyMem_Free(paths);
            Py_DECREF(fast);
            return NULL;
        }
        PyList_SET_ITEM(list, i, encoded); /* steals the reference */
        paths[i] = PyBytes_AS_STRING(encoded);
    }
    Py_DECREF(fast);
    *held = list;
    *count = n;
    return paths;
}

/* One answer byte per path, probe(path, state) each, in one release of the GIL: the
   loop of files_exist and files_resident. NULL with DeadlinePassed(done) set when
   time.monotonic passed the deadline before path `done`, or with the error of bad input. */
typedef char (*file_probe)(const char *path, void *state);

static PyObject *probe_files(PyObject *seq, double deadline, file_probe probe, void *state) {
    PyObject *held = NULL;
    Py_ssize_t count = 0, done = 0;
    const char **paths = fs_paths(seq, &held, &count);
    if (paths == NULL)
        return NULL;
    PyObject *result = PyBytes_FromStringAndSize(NULL, count);
    if (result != NULL) {
        char *answers = PyBytes_AS_STRING(result);
        BEGIN_WITHOUT_GIL
        for (; done < count; done++) {
            if (monotonic_now() > deadline)
                break;
            answers[done] = probe(paths[done], state);
        }
        Py_END_ALLOW_THREADS
        if (done < count) {
            Py_CLEAR(result);
            raise_outcome(LATE, done, 0);
        }
    }
    PyMem_Free(paths);
    Py_DECREF(held);
    return result;
}

static char file_exists(const char *path, void *state) {
    struct stat st;
    return stat(path, &st) == 0;
}

PyDoc_STRVAR(files_exist_doc,
"files_exist(paths, deadline) -> bytes\n\n"
"For each path, 1 if stat() succeeds (os.path.exists), else 0. Raises\n"
"DeadlinePassed(done) when time.monotonic passed the deadline before path `done`.\n"
"The GIL is released for the whole call.");

static PyObject *files_exist(PyObject *self, PyObject *args) {
    PyObject *seq;
    double deadline;
    if (!PyArg_ParseTuple(args, "Od:files_exist", &seq, &deadline))
        return NULL;
    return probe_files(seq, deadline, file_exists, NULL);
}

enum residency { NOT_RESIDENT = 0, RESIDENT = 1, UNKNOWN = 2 };

/* mincore's answer vector, grown as larger files come, reused across a call's files. */
struct residency_state {
    unsigned char *vec;
    size_t len;
};

/* As l3_residency.file_resident: a missing file is not resident (a fetch of it would
   fail); one that cannot be opened, is empty, or cannot be mapped or asked is unknown. */
static char file_residency(const char *path, void *state) {
    struct residency_state *pages_of = state;
    int fd = open(path, O_RDONLY | O_CLOEXEC);
    if (fd < 0)
        return errno == ENOENT ? NOT_RESIDENT : UNKNOWN;
    enum residency answer = UNKNOWN;
    struct stat st;
    if (fstat(fd, &st) == 0 && st.st_size > 0) {
        size_t size = (size_t)st.st_size;
        long page = sysconf(_SC_PAGESIZE);
        size_t pages = (size + (size_t)page - 1) / (size_t)page;
        if (pages > pages_of->len) {
            unsigned char *grown = realloc(pages_of->vec, pages);
            if (grown != NULL) {
                pages_of->vec = grown;
                pages_of->len = pages;
            }
        }
        void *addr = pages <= pages_of->len ? mmap(NULL, size, PROT_READ, MAP_SHARED, fd, 0)
                                            : MAP_FAILED;
        if (addr != MAP_FAILED) {
            if (mincore(addr, size, pages_of->vec) == 0) {
                answer = RESIDENT;
                /* only the lowest bit of each byte is defined (resident) */
                for (size_t i = 0; i < pages; i++)
                    if (!(pages_of->vec[i] & 1)) {
                        answer = NOT_RESIDENT;
                        break;
                    }
            }
            munmap(addr, size);
        }
    }
    close(fd);
    return (char)answer;
}

PyDoc_STRVAR(files_resident_doc,
"files_resident(paths) -> bytes\n\n"
"For each path, whether the page cache holds the whole file (mincore on a mapping of\n"
"it, nothing read): 1 resident, 0 not (or the file is missing), 2 cannot tell.\n"
"The GIL is released for the whole call.");

static PyObject *files_resident(PyObject *self, PyObject *args) {
    PyObject *seq;
    if (!PyArg_ParseTuple(args, "O:files_resident", &seq))
        return NULL;
    struct residency_state pages_of = {NULL, 0};
    PyObject *result = probe_files(seq, INFINITY, file_residency, &pages_of);
    free(pages_of.vec);
    return result;
}

PyDoc_STRVAR(gil_releases_doc,
"gil_releases() -> int\n\n"
"How many times this module's calls have given up the GIL since it was loaded.");

static PyObject *gil_releases(PyObject *self, PyObject *unused) {
    return PyLong_FromUnsignedLongLong(gil_releases_so_far);
}

static PyMethodDef methods[] = {
    {"pread_hash_into", pread_hash_into, METH_VARARGS, pread_hash_into_doc},
    {"copy_hash_into", copy_hash_into, METH_VARARGS, copy_hash_into_doc},
    {"copy_hash_layers_into", copy_hash_layers_into, METH_VARARGS, copy_hash_layers_into_doc},
    {"pread_hash_layers_into", pread_hash_layers_into, METH_VARARGS,
     pread_hash_layers_into_doc},
    {"files_exist", files_exist, METH_VARARGS, files_exist_doc},
    {"files_resident", files_resident, METH_VARARGS, files_resident_doc},
    {"gil_releases", gil_releases, METH_NOARGS, gil_releases_doc},
    {NULL, NULL, 0, NULL},
};

static struct PyModuleDef module = {
    PyModuleDef_HEAD_INIT,
    .m_name = "vllm_draft_offload._fastread",
    .m_doc = "GIL-free copy-and-hash loops of unit fetches and writes, and batch file probes "
             "of storage lookups (see fast_io).",
    .m_size = -1,
    .m_methods = methods,
};

PyMODINIT_FUNC PyInit__fastread(void) {
    PyObject *m = PyModule_Create(&module);
    if (m == NULL)
        return NULL;
    EndOfFile = PyErr_NewExceptionWithDoc(
        "vllm_draft_offload._fastread.EndOfFile",
        "The file ended early; args[0]: the destination's bytes filled.", NULL, NULL);
    DeadlinePassed = PyErr_NewExceptionWithDoc(
        "vllm_draft_offload._fastread.DeadlinePassed",
        "The deadline passed before a piece; args[0]: the destination's bytes filled.", NULL,
        NULL);
    Stopped = PyErr_NewExceptionWithDoc(
        "vllm_draft_offload._fastread.Stopped",
        "The caller's stop flag was set before a piece; args[0]: the destination's bytes "
        "filled.",
        NULL, NULL);
    if (EndOfFile == NULL || DeadlinePassed == NULL || Stopped == NULL ||
        PyModule_AddObjectRef(m, "EndOfFile", EndOfFile) < 0 ||
        PyModule_AddObjectRef(m, "DeadlinePassed", DeadlinePassed) < 0 ||
        PyModule_AddObjectRef(m, "Stopped", Stopped) < 0 ||
        PyModule_AddIntConstant(m, "XXHASH_VERSION", XXH_VERSION_NUMBER) < 0) {
        Py_DECREF(m);
        return NULL;
    }
    return m;
}
