/*
 * Read (or copy) a stored unit's bytes into a caller's buffer and hash them with XXH3-128,
 * piece by piece, without the GIL: the native loop behind vllm_draft_offload.fast_io.
 *
 * Why native: the Python loop (fast_io's fallback) gives up the GIL and takes it back for
 * every read and every hash call. Beside vLLM's engine thread each take can wait out the
 * engine's Python, so its pieces must be large (4 MiB) to take the GIL few times; but with
 * several read threads a 4 MiB piece leaves the CPU cache before it is hashed, and the fetch
 * moves every byte through memory three times where a plain read moves it twice. Here the
 * whole loop runs inside one Py_BEGIN_ALLOW_THREADS, so the pieces can be as small as a
 * core's L2 holds: each is hashed right after it landed, while it is still in L2.
 *
 * The digest is xxHash's canonical (big-endian) XXH3-128, the bytes of python-xxhash's
 * xxh3_128().digest(), from the vendored xxhash.h (and, on x86, its runtime dispatcher,
 * which picks SSE2/AVX2/AVX-512 as python-xxhash does).
 *
 * Errors, as exceptions the Python side translates (fast_io, l3_fs_reads.ObjectFile):
 *   EndOfFile(done)       the file ended after `done` bytes of the destination were filled;
 *   DeadlinePassed(done)  CLOCK_MONOTONIC (time.monotonic on Linux) passed the deadline
 *                         before the piece at `done`; checked before every piece, so
 *                         nothing is written into the destination after it raised;
 *   OSError               any other failed pread (EINTR is retried).
 */
#define PY_SSIZE_T_CLEAN
#define _FILE_OFFSET_BITS 64
#include <Python.h>

#include <errno.h>
#include <string.h>
#include <time.h>
#include <unistd.h>

#define XXH_INLINE_ALL
#include "xxhash.h"
#ifdef FASTREAD_X86_DISPATCH
/* Streaming updates go through the runtime dispatcher (xxh_x86dispatch.c, linked in);
   reset and digest stay inline. */
#include "xxh_x86dispatch.h"
#endif

static PyObject *EndOfFile;
static PyObject *DeadlinePassed;

enum outcome { DONE = 0, ENDED, LATE, FAILED };

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
        PyErr_SetObject(outcome == ENDED ? EndOfFile : DeadlinePassed, filled);
        Py_DECREF(filled);
    }
    return NULL;
}

PyDoc_STRVAR(pread_hash_into_doc,
"pread_hash_into(fd, file_offset, dest, piece_bytes, deadline) -> bytes\n\n"
"Fill dest with fd's bytes from file_offset, piece_bytes at a time, hashing each piece\n"
"right after it landed; returns the 16-byte XXH3-128 digest of dest. Raises\n"
"EndOfFile(done) or DeadlinePassed(done) (checked before each piece against\n"
"time.monotonic) or OSError. The GIL is released for the whole call.");

static PyObject *pread_hash_into(PyObject *self, PyObject *args) {
    int fd;
    long long file_offset;
    Py_buffer dest;
    Py_ssize_t piece_bytes;
    double deadline;
    if (!PyArg_ParseTuple(args, "iLw*nd:pread_hash_into", &fd, &file_offset, &dest,
                          &piece_bytes, &deadline))
        return NULL;
    if (piece_bytes <= 0 || file_offset < 0) {
        PyBuffer_Release(&dest);
        PyErr_SetString(PyExc_ValueError, "piece_bytes must be > 0 and file_offset >= 0");
        return NULL;
    }
    XXH3_state_t state;
    XXH3_128bits_reset(&state);
    char *out = dest.buf;
    Py_ssize_t nbytes = dest.len, done = 0;
    enum outcome outcome = DONE;
    int err = 0;
    Py_BEGIN_ALLOW_THREADS
    while (done < nbytes) {
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
                err = errno;
                break;
            }
        }
        if (outcome != DONE) {
            done += got;
            break;
        }
        XXH3_128bits_update(&state, out + done, (size_t)piece);
        done += piece;
    }
    Py_END_ALLOW_THREADS
    PyBuffer_Release(&dest);
    if (outcome != DONE)
        return raise_outcome(outcome, done, err);
    return canonical_digest(&state);
}

PyDoc_STRVAR(copy_hash_into_doc,
"copy_hash_into(src, dest, piece_bytes) -> bytes\n\n"
"Copy src into dest (of the same length), piece_bytes at a time, hashing each piece in\n"
"dest right after it was copied; returns the 16-byte XXH3-128 digest. The GIL is\n"
"released for the whole call.");

static PyObject *copy_hash_into(PyObject *self, PyObject *args) {
    Py_buffer src, dest;
    Py_ssize_t piece_bytes;
    if (!PyArg_ParseTuple(args, "y*w*n:copy_hash_into", &src, &dest, &piece_bytes))
        return NULL;
    if (piece_bytes <= 0 || src.len != dest.len) {
        PyErr_Format(PyExc_ValueError,
                     "piece_bytes must be > 0 and src (%zd bytes) as long as dest (%zd)",
                     src.len, dest.len);
        PyBuffer_Release(&src);
        PyBuffer_Release(&dest);
        return NULL;
    }
    XXH3_state_t state;
    XXH3_128bits_reset(&state);
    const char *in = src.buf;
    char *out = dest.buf;
    Py_ssize_t nbytes = dest.len;
    Py_BEGIN_ALLOW_THREADS
    for (Py_ssize_t done = 0; done < nbytes; done += piece_bytes) {
        size_t piece = (size_t)(nbytes - done < piece_bytes ? nbytes - done : piece_bytes);
        memcpy(out + done, in + done, piece);
        XXH3_128bits_update(&state, out + done, piece);
    }
    Py_END_ALLOW_THREADS
    PyBuffer_Release(&src);
    PyBuffer_Release(&dest);
    return canonical_digest(&state);
}

static PyMethodDef methods[] = {
    {"pread_hash_into", pread_hash_into, METH_VARARGS, pread_hash_into_doc},
    {"copy_hash_into", copy_hash_into, METH_VARARGS, copy_hash_into_doc},
    {NULL, NULL, 0, NULL},
};

static struct PyModuleDef module = {
    PyModuleDef_HEAD_INIT,
    .m_name = "vllm_draft_offload._fastread",
    .m_doc = "GIL-free read-and-hash loops of unit fetches (see fast_io).",
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
    if (EndOfFile == NULL || DeadlinePassed == NULL ||
        PyModule_AddObjectRef(m, "EndOfFile", EndOfFile) < 0 ||
        PyModule_AddObjectRef(m, "DeadlinePassed", DeadlinePassed) < 0 ||
        PyModule_AddIntConstant(m, "XXHASH_VERSION", XXH_VERSION_NUMBER) < 0) {
        Py_DECREF(m);
        return NULL;
    }
    return m;
}
