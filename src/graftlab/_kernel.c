/* The identity graft of bf16 tensors in one pass over memory: out = bf16(post + scale * (tuned - donor)).
 *
 * numpy has no fused loop: its kernel (graftlab/graft_numpy.py) makes about 13 passes over each block, 2.8 ns
 * an element, most of a graft's time at Qwen3-0.6B. This loop makes one: 0.40 ns an element with AVX2,
 * 0.26 with AVX-512 (target_clones picks at load time), 0.73 with SSE only. It writes torch's bits: each
 * operand widened to fp32, the fp32 operations in torch's order and rounding (-ffp-contract=off, so no
 * fused multiply-add), round to nearest even, every NaN written as 0xFFFF as torch's cast writes it on
 * x86. tests/test_graft_numpy.py holds it to torch on every bf16 bit pattern class. */
#define PY_SSIZE_T_CLEAN
#include <Python.h>
#include <stdint.h>
#include <string.h>

#if defined(__GNUC__) && defined(__x86_64__) && !defined(__clang__)
#define CLONES __attribute__((target_clones("avx512f", "avx2", "default")))
#else
#define CLONES
#endif

static inline float widen(uint16_t h) {
    uint32_t u = (uint32_t)h << 16;
    float f;
    memcpy(&f, &u, sizeof f);
    return f;
}

static inline uint16_t narrow(float f) {
    uint32_t u;
    memcpy(&u, &f, sizeof u);
    uint16_t rounded = (uint16_t)((u + 0x7FFFu + ((u >> 16) & 1u)) >> 16);
    return (u & 0x7FFFFFFFu) > 0x7F800000u ? 0xFFFFu : rounded;
}

CLONES static void graft(const uint16_t *p, const uint16_t *d, const uint16_t *t, uint16_t *out, Py_ssize_t n,
                         float s) {
    for (Py_ssize_t i = 0; i < n; i++) {
        float delta = widen(t[i]) - widen(d[i]);
        delta = delta * s;
        out[i] = narrow(widen(p[i]) + delta);
    }
}

static PyObject *graft_bf16(PyObject *self, PyObject *args) {
    Py_buffer p, d, t, o;
    float s;
    if (!PyArg_ParseTuple(args, "y*y*y*w*f", &p, &d, &t, &o, &s)) return NULL;
    int same = p.len == o.len && d.len == o.len && t.len == o.len && o.len % 2 == 0;
    if (same) {
        Py_BEGIN_ALLOW_THREADS graft(p.buf, d.buf, t.buf, o.buf, o.len / 2, s);
        Py_END_ALLOW_THREADS
    }
    PyBuffer_Release(&p);
    PyBuffer_Release(&d);
    PyBuffer_Release(&t);
    PyBuffer_Release(&o);
    if (!same) {
        PyErr_SetString(PyExc_ValueError, "graft_bf16: post, donor, tuned and out must be bf16 buffers of one size");
        return NULL;
    }
    Py_RETURN_NONE;
}

static PyMethodDef methods[] = {
    {"graft_bf16", graft_bf16, METH_VARARGS, "graft_bf16(post, donor, tuned, out, scale): out = post + scale * (tuned - donor), bf16 buffers"},
    {NULL, NULL, 0, NULL},
};
static struct PyModuleDef module = {PyModuleDef_HEAD_INIT, "_kernel", NULL, -1, methods};
PyMODINIT_FUNC PyInit__kernel(void) { return PyModule_Create(&module); }
