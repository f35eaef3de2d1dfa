/* The CPU digest's inner loop (coordloader/digest.py, "CPU kernel"), one pass over the
 * data at memory speed.
 *
 *   rows(ptr, width, sizes, strides, colw, roww) -> uint64
 *
 * returns  sum_r roww[r] * sum_c colw[c] * v(x[r, c])  mod 2^64  over the rows of a strided
 * box: `sizes` are the box's extents (leading dims..., columns), `strides` the leading dims'
 * strides in bytes; the columns of a row are contiguous elements of `width` bytes. Rows are
 * numbered row-major over the leading dims, as `roww` is. v is the digest's element value:
 * little-endian bytes read as signed (widths 1, 2, 4; 8-byte elements come as their 4-byte
 * halves). colw and
 * roww hold the weights as uint64 (the hashes are computed once, in Python/torch, so the
 * definition lives in one place); this file only multiplies and adds, in wrapping uint64
 * arithmetic, which is arithmetic mod 2^64.
 *
 * Why C: torch has no fused integer multiply-accumulate over raw bits. Its int8 GEMM route
 * ran 5-8 GB/s per core (oneDNN re-biases signed int8 and packs the data first); these loops
 * vectorise (64-bit multiplies on AVX-512, two 32-bit halves elsewhere) and ran 14-31 GB/s
 * on the same machine. The extension is optional: digest.py falls back to the GEMM route
 * when it is not built.
 */
#define PY_SSIZE_T_CLEAN
#include <Python.h>
#include <stdint.h>
#include <string.h>

/* One build runs everywhere: on x86-64 Linux with GCC, the loops are compiled for three
 * instruction-set levels and the loader picks the best the CPU has. */
#if defined(__x86_64__) && defined(__linux__) && defined(__GNUC__) && !defined(__clang__) && __GNUC__ >= 12
#define CLONES __attribute__((target_clones("arch=x86-64-v4", "arch=x86-64-v3", "default")))
#else
#define CLONES
#endif

/* Columns per block: a block's weights (8 KiB) stay in L1 while every row's segment of the
 * block streams past them (measured: 1024 columns 16-31 GB/s, 8192 columns 6-26). */
#define COL_BLOCK 1024
#define MAX_DIMS 64

static inline uint64_t seg1(const void *p_, int64_t n, const uint64_t *w) {
    uint64_t a = 0;
    const int8_t *p = (const int8_t *)p_;
    for (int64_t j = 0; j < n; j++) a += w[j] * (uint64_t)(int64_t)p[j];
    return a;
}

static inline uint64_t seg2(const void *p_, int64_t n, const uint64_t *w) {
    const uint8_t *p = (const uint8_t *)p_;
    uint64_t a = 0;
    for (int64_t j = 0; j < n; j++) {
        uint16_t u;
        memcpy(&u, p + 2 * j, 2);   /* unaligned-safe; compiles to a load */
        a += w[j] * ((uint64_t)u - 2 * (uint64_t)(u & 0x8080u));
    }
    return a;
}

static inline uint64_t seg4(const void *p_, int64_t n, const uint64_t *w) {
    const uint8_t *p = (const uint8_t *)p_;
    uint64_t a = 0;
    for (int64_t j = 0; j < n; j++) {
        uint32_t u;
        memcpy(&u, p + 4 * j, 4);
        a += w[j] * ((uint64_t)u - 2 * (uint64_t)(u & 0x80808080u));
    }
    return a;
}

/* One loop nest per width, so the width switch and the clone dispatch happen once per
 * call, not once per row (a model's (1024, 128) BF16 slices have 256-byte rows). */
#define DIGEST_ROWS(SEG, ELEM)                                                              \
    for (int64_t c0 = 0; c0 < ncols; c0 += COL_BLOCK) {                                     \
        int64_t n = ncols - c0 < COL_BLOCK ? ncols - c0 : COL_BLOCK;                        \
        const uint64_t *w = colw + c0;                                                      \
        int64_t off = c0 * (ELEM); /* byte offset of the row segment: an integer, so no */  \
        for (int d = 0; d < nlead; d++) idx[d] = 0; /* pointer ever leaves the tensor */     \
        for (int64_t r = 0;; r++) {                                                         \
            acc += roww[r] * SEG((const void *)(base + off), n, w);                         \
            int d = nlead - 1; /* next row: odometer over the leading dims */               \
            for (; d >= 0; d--) {                                                           \
                off += strides[d];                                                          \
                if (++idx[d] < sizes[d]) break;                                             \
                off -= strides[d] * sizes[d];                                               \
                idx[d] = 0;                                                                 \
            }                                                                               \
            if (d < 0) break;                                                               \
        }                                                                                   \
    }

CLONES static uint64_t digest_rows(const uint8_t *base, int width, int nlead,
                                   const int64_t *sizes, const int64_t *strides, int64_t ncols,
                                   const uint64_t *colw, const uint64_t *roww) {
    uint64_t acc = 0;
    int64_t idx[MAX_DIMS];
    switch (width) {
    case 1: DIGEST_ROWS(seg1, 1) break;
    case 2: DIGEST_ROWS(seg2, 2) break;
    default: DIGEST_ROWS(seg4, 4) break;
    }
    return acc;
}

static int read_i64s(PyObject *seq, const char *what, int64_t *out, Py_ssize_t *n) {
    PyObject *fast = PySequence_Fast(seq, what);
    if (!fast) return -1;
    *n = PySequence_Fast_GET_SIZE(fast);
    if (*n > MAX_DIMS) {
        Py_DECREF(fast);
        PyErr_Format(PyExc_ValueError, "%s: more than %d dims", what, MAX_DIMS);
        return -1;
    }
    for (Py_ssize_t i = 0; i < *n; i++) {
        out[i] = PyLong_AsLongLong(PySequence_Fast_GET_ITEM(fast, i));
        if (out[i] == -1 && PyErr_Occurred()) {
            Py_DECREF(fast);
            return -1;
        }
    }
    Py_DECREF(fast);
    return 0;
}

static PyObject *py_rows(PyObject *self, PyObject *args) {
    unsigned long long ptr, colw, roww;
    int width;
    PyObject *sizes_o, *strides_o;
    int64_t sizes[MAX_DIMS], strides[MAX_DIMS];
    Py_ssize_t nsizes, nstrides;
    (void)self;
    if (!PyArg_ParseTuple(args, "KiOOKK", &ptr, &width, &sizes_o, &strides_o, &colw, &roww))
        return NULL;
    if (width != 1 && width != 2 && width != 4) {
        PyErr_Format(PyExc_ValueError, "element width %d is not 1, 2 or 4", width);
        return NULL;
    }
    if (read_i64s(sizes_o, "sizes", sizes, &nsizes) || read_i64s(strides_o, "strides", strides, &nstrides))
        return NULL;
    if (nsizes < 1 || nstrides != nsizes - 1) {
        PyErr_SetString(PyExc_ValueError, "need sizes (lead..., cols) and one stride per leading dim");
        return NULL;
    }
    for (Py_ssize_t i = 0; i < nsizes; i++) {
        if (sizes[i] < 0) {
            PyErr_SetString(PyExc_ValueError, "negative size");
            return NULL;
        }
        if (sizes[i] == 0) return PyLong_FromUnsignedLongLong(0);
    }
    uint64_t out;
    Py_BEGIN_ALLOW_THREADS
    out = digest_rows((const uint8_t *)(uintptr_t)ptr, width, (int)nsizes - 1, sizes, strides,
                      sizes[nsizes - 1], (const uint64_t *)(uintptr_t)colw,
                      (const uint64_t *)(uintptr_t)roww);
    Py_END_ALLOW_THREADS
    return PyLong_FromUnsignedLongLong(out);
}

static PyMethodDef methods[] = {
    {"rows", py_rows, METH_VARARGS,
     "rows(ptr, width, sizes, strides, colw_ptr, roww_ptr) -> uint64 digest sum of a strided box"},
    {NULL, NULL, 0, NULL},
};

static struct PyModuleDef module = {
    PyModuleDef_HEAD_INIT, "coordloader._digestkernel",
    "The CPU digest's fused multiply-accumulate loop (see digest.py).", -1, methods,
    NULL, NULL, NULL, NULL,
};

PyMODINIT_FUNC PyInit__digestkernel(void) { return PyModule_Create(&module); }
