/* asyncrl._hotpath: the end of the group fast path, compiled.

   `finish_group(head, bufs, values)` takes a Group header that msgspec has parsed (group_codec's
   `_Head`) and the message's four frames, and does everything group_codec.finish_group does:
   the length rules, the rules between fields (values=True), array references and frame sizes,
   the value scan, and the Group itself (no __init__). It answers None for anything unusual; the
   generic decoder then decides and names the field. `configure(...)` hands it, once at import,
   what it needs from group_codec (Group's fields, the protocol version, the slack, helpers).

   `values_ok(tokens, loss_mask, behavior_logprobs, slack)` is the value scan alone, for the
   tests: True when every token id is >= 0, every loss-mask byte is 0 or 1 and every behaviour
   logprob is a number in (-inf, slack] (slack rounded to float32, as numpy compares): NaN fails.
   One pass per array, no temporaries; the frames need not be aligned. False otherwise, also
   for a size that is not a whole number of elements.

   `address(buffer)` is where a buffer's bytes start in memory, for the hub's write-ahead log,
   which places large frames so that O_DIRECT writes them from where they lie (replay/direct_io.py).

   tests/unit/test_hotpath.py holds both to the Python and numpy reference. Apart from what
   `configure` gave it, the module keeps no reference to its arguments. */

#define PY_SSIZE_T_CLEAN
#include <Python.h>
#include <math.h>
#include <stdint.h>
#include <string.h>

/* AVX2 where the CPU has it (chosen at load time), SSE2 otherwise */
#if defined(__x86_64__) && defined(__GNUC__) && !defined(__clang__)
#define WIDE __attribute__((target_clones("avx2", "default")))
#else
#define WIDE
#endif

WIDE static int tokens_ok(const unsigned char *p, Py_ssize_t n) {
    uint32_t sign = 0;
    for (Py_ssize_t i = 0; i < n; i++) {
        uint32_t v;
        memcpy(&v, p + 4 * i, 4);
        sign |= v;
    }
    return (sign & 0x80000000u) == 0;
}

WIDE static int mask_ok(const unsigned char *p, Py_ssize_t n) {
    unsigned char bits = 0;
    for (Py_ssize_t i = 0; i < n; i++) {
        bits |= p[i];
    }
    return (bits & 0xFE) == 0;
}

WIDE static int logprobs_ok(const unsigned char *p, Py_ssize_t n, double slack) {
    const float fs = (float)slack; /* compared in float32, as numpy compares a float32 array */
    int good = 1;
    for (Py_ssize_t i = 0; i < n; i++) {
        float v;
        memcpy(&v, p + 4 * i, 4);
        good &= (v <= fs) & (v > -INFINITY); /* NaN fails both */
    }
    return good;
}

#define RELEASE_GIL_FROM (256 * 1024) /* bytes: larger groups let other threads run meanwhile */

static int scan(const Py_buffer *v, double slack) {
    return tokens_ok(v[0].buf, v[0].len / 4) && mask_ok(v[1].buf, v[1].len)
           && logprobs_ok(v[2].buf, v[2].len / 4, slack);
}

static PyObject *values_ok(PyObject *self, PyObject *const *args, Py_ssize_t nargs) {
    (void)self;
    if (nargs != 4) {
        PyErr_Format(PyExc_TypeError,
                     "values_ok(tokens, loss_mask, behavior_logprobs, slack): 4 arguments, got %zd",
                     nargs);
        return NULL;
    }
    double slack = PyFloat_AsDouble(args[3]);
    if (slack == -1.0 && PyErr_Occurred()) {
        return NULL;
    }
    Py_buffer views[3];
    int held = 0, ok = 1;
    for (; held < 3; held++) {
        if (PyObject_GetBuffer(args[held], &views[held], PyBUF_SIMPLE) < 0) {
            for (int i = 0; i < held; i++) {
                PyBuffer_Release(&views[i]);
            }
            return NULL;
        }
    }
    Py_ssize_t nt = views[0].len, nm = views[1].len, nl = views[2].len;
    if (nt % 4 || nl % 4) { /* not whole int32 / float32 elements */
        ok = 0;
    } else {
        if (nt + nm + nl < RELEASE_GIL_FROM) { /* the GIL round trip costs more than the scan */
            ok = scan(views, slack);
        } else {
            Py_BEGIN_ALLOW_THREADS
            ok = scan(views, slack);
            Py_END_ALLOW_THREADS
        }
    }
    for (int i = 0; i < 3; i++) {
        PyBuffer_Release(&views[i]);
    }
    return PyBool_FromLong(ok);
}

/* --- finish_group: what asyncrl/protocol/group_codec.py's fast path does after msgspec parsed a header - */

enum {
    A_SEQ, A_PROMPT, A_LO, A_HI, A_REWARDS, A_TRAJ, A_FINISH, A_FAILED, /* one entry per trajectory */
    A_TURNS, A_TOOL, A_ENV, A_COMPONENTS, A_SPANS, A_TOKENS, A_MASK, A_LP, A_METADATA, A_TYPE,
    A_PROTOCOL, N_ATTRS
};
static const char *const ATTR_NAMES[N_ATTRS] = {
    "seq_lens", "prompt_lens", "min_policy_versions", "max_policy_versions", "rewards",
    "trajectory_ids", "finish_reasons", "reward_failed", "num_turns", "tool_s", "env_s",
    "reward_components", "version_spans", "tokens", "loss_mask", "behavior_logprobs", "metadata",
    "type", "protocol",
};

static struct {
    PyObject *attr[N_ATTRS], *ref_dtype, *ref_shape, *ref_frame; /* interned names */
    PyObject *fields;                   /* Group's field names, in order */
    Py_ssize_t at_array[3], at_metadata; /* their places in `fields` */
    long long protocol;
    double slack;
    PyTypeObject *group;
    PyObject *raw_map, *spans_problem, *frombuffer, *dtype[3];
} G;

static int configured = 0;

static PyObject *configure(PyObject *self, PyObject *args) {
    (void)self;
    PyObject *fields, *group, *raw_map, *spans_problem, *frombuffer, *d0, *d1, *d2;
    long long protocol;
    double slack;
    if (!PyArg_ParseTuple(args, "O!LdO!OOOOOO:configure", &PyTuple_Type, &fields, &protocol,
                          &slack, &PyType_Type, &group, &raw_map, &spans_problem, &frombuffer,
                          &d0, &d1, &d2)) {
        return NULL;
    }
    const char *arrays[3] = {"tokens", "loss_mask", "behavior_logprobs"};
    Py_ssize_t at[3] = {-1, -1, -1}, at_metadata = -1;
    for (Py_ssize_t i = 0; i < PyTuple_GET_SIZE(fields); i++) {
        PyObject *name = PyTuple_GET_ITEM(fields, i);
        if (!PyUnicode_Check(name)) {
            PyErr_SetString(PyExc_TypeError, "configure: field names must be str");
            return NULL;
        }
        for (int k = 0; k < 3; k++) {
            if (PyUnicode_CompareWithASCIIString(name, arrays[k]) == 0) {
                at[k] = i;
            }
        }
        if (PyUnicode_CompareWithASCIIString(name, "metadata") == 0) {
            at_metadata = i;
        }
    }
    if (at[0] < 0 || at[1] < 0 || at[2] < 0 || at_metadata < 0) {
        PyErr_SetString(PyExc_ValueError,
                        "configure: fields lack tokens, loss_mask, behavior_logprobs or metadata");
        return NULL;
    }
    if (!configured) {
        for (int i = 0; i < N_ATTRS; i++) {
            if (!(G.attr[i] = PyUnicode_InternFromString(ATTR_NAMES[i]))) {
                return NULL;
            }
        }
        if (!(G.ref_dtype = PyUnicode_InternFromString("dtype"))
            || !(G.ref_shape = PyUnicode_InternFromString("shape"))
            || !(G.ref_frame = PyUnicode_InternFromString("frame"))) {
            return NULL;
        }
    } else { /* configured again (group_codec reloaded): drop the old references */
        Py_CLEAR(G.fields);
        Py_CLEAR(G.group);
        Py_CLEAR(G.raw_map);
        Py_CLEAR(G.spans_problem);
        Py_CLEAR(G.frombuffer);
        for (int k = 0; k < 3; k++) {
            Py_CLEAR(G.dtype[k]);
        }
    }
    G.fields = Py_NewRef(fields);
    G.group = (PyTypeObject *)Py_NewRef(group);
    G.raw_map = Py_NewRef(raw_map);
    G.spans_problem = Py_NewRef(spans_problem);
    G.frombuffer = Py_NewRef(frombuffer);
    G.dtype[0] = Py_NewRef(d0);
    G.dtype[1] = Py_NewRef(d1);
    G.dtype[2] = Py_NewRef(d2);
    for (int k = 0; k < 3; k++) {
        G.at_array[k] = at[k];
    }
    G.at_metadata = at_metadata;
    G.protocol = protocol;
    G.slack = slack;
    configured = 1;
    Py_RETURN_NONE;
}

/* A Python int as a long long; 0 (and *ok = 0) for anything else or out of range. */
static long long as_ll(PyObject *o, int *ok) {
    if (!PyLong_Check(o)) {
        *ok = 0;
        return 0;
    }
    int overflow = 0;
    long long v = PyLong_AsLongLongAndOverflow(o, &overflow);
    if (overflow || (v == -1 && PyErr_Occurred())) {
        PyErr_Clear();
        *ok = 0;
        return 0;
    }
    return v;
}

/* Is `ref` (an array reference: dtype, shape, frame) frame `frame`, `dtype`, shape [length]? */
static int ref_ok(PyObject *ref, long long frame, const char *dtype, long long length) {
    int ok = 1;
    PyObject *f = PyObject_GetAttr(ref, G.ref_frame), *d = PyObject_GetAttr(ref, G.ref_dtype),
             *s = PyObject_GetAttr(ref, G.ref_shape);
    if (!f || !d || !s) {
        PyErr_Clear();
        ok = 0;
    } else {
        ok = as_ll(f, &ok) == frame && ok && PyUnicode_Check(d)
             && PyUnicode_CompareWithASCIIString(d, dtype) == 0 && PyList_Check(s)
             && PyList_GET_SIZE(s) == 1;
        if (ok) {
            ok = as_ll(PyList_GET_ITEM(s, 0), &ok) == length && ok;
        }
    }
    Py_XDECREF(f);
    Py_XDECREF(d);
    Py_XDECREF(s);
    return ok;
}

/* The rules between a group's fields that parsing did not check (values=True only). 1: they
   hold; 0: they do not; -1: a Python error. */
static int rules_ok(PyObject **a, Py_ssize_t n) {
    int ok = 1;
    for (Py_ssize_t i = 0; i < n && ok; i++) {
        long long s = as_ll(PyList_GET_ITEM(a[A_SEQ], i), &ok);
        long long p = as_ll(PyList_GET_ITEM(a[A_PROMPT], i), &ok);
        long long lo = as_ll(PyList_GET_ITEM(a[A_LO], i), &ok);
        long long hi = as_ll(PyList_GET_ITEM(a[A_HI], i), &ok);
        ok = ok && s >= p && lo <= hi;
    }
    for (int k = A_TURNS; k <= A_ENV && ok; k++) { /* empty (not recorded) or one per trajectory */
        Py_ssize_t len = PyObject_Length(a[k]);
        if (len < 0) {
            return -1;
        }
        ok = len == 0 || len == n;
    }
    if (!ok) {
        return 0;
    }
    if (!PyDict_Check(a[A_COMPONENTS])) {
        return 0;
    }
    Py_ssize_t pos = 0;
    PyObject *key, *value;
    while (PyDict_Next(a[A_COMPONENTS], &pos, &key, &value)) {
        Py_ssize_t len = PyObject_Length(value);
        if (len < 0) {
            return -1;
        }
        if (len != n) {
            return 0;
        }
    }
    Py_ssize_t spans = PyObject_Length(a[A_SPANS]);
    if (spans <= 0) {
        return spans < 0 ? -1 : 1;
    }
    PyObject *completion = PyList_New(n); /* only groups that record versions pay for this */
    if (!completion) {
        return -1;
    }
    for (Py_ssize_t i = 0; i < n; i++) {
        long long s = as_ll(PyList_GET_ITEM(a[A_SEQ], i), &ok);
        long long p = as_ll(PyList_GET_ITEM(a[A_PROMPT], i), &ok);
        PyObject *c = PyLong_FromLongLong(s - p);
        if (!c) {
            Py_DECREF(completion);
            return -1;
        }
        PyList_SET_ITEM(completion, i, c);
    }
    PyObject *problem =
        PyObject_CallFunctionObjArgs(G.spans_problem, a[A_SPANS], a[A_LO], a[A_HI], completion, NULL);
    Py_DECREF(completion);
    if (!problem) {
        return -1;
    }
    int fine = PyUnicode_Check(problem) && PyUnicode_GET_LENGTH(problem) == 0;
    Py_DECREF(problem);
    return fine;
}

static PyObject *finish_group(PyObject *self, PyObject *const *args, Py_ssize_t nargs) {
    (void)self;
    if (nargs != 3) {
        PyErr_Format(PyExc_TypeError, "finish_group(head, bufs, values): 3 arguments, got %zd",
                     nargs);
        return NULL;
    }
    if (!configured) {
        PyErr_SetString(PyExc_RuntimeError, "finish_group: configure() first");
        return NULL;
    }
    PyObject *h = args[0], *bufs = args[1];
    int values = PyObject_IsTrue(args[2]);
    if (values < 0) {
        return NULL;
    }
    PyObject *a[N_ATTRS] = {NULL}, *metadata = NULL, *arrays[3] = {NULL}, *dict = NULL;
    PyObject *result = NULL; /* NULL with an error set, or the Group, or None (bail) */
    Py_buffer view[3];
    int views = 0, ok = 1;
    for (int i = 0; i < N_ATTRS; i++) {
        if (!(a[i] = PyObject_GetAttr(h, G.attr[i]))) {
            goto done;
        }
    }
    if (!PyUnicode_Check(a[A_TYPE]) || PyUnicode_CompareWithASCIIString(a[A_TYPE], "Group") != 0
        || as_ll(a[A_PROTOCOL], &ok) != G.protocol || !ok || !PyList_Check(bufs)
        || PyList_GET_SIZE(bufs) != 4) {
        goto bail;
    }
    for (int k = A_SEQ; k <= A_FAILED; k++) {
        if (!PyList_Check(a[k])) {
            goto bail;
        }
    }
    Py_ssize_t n = PyList_GET_SIZE(a[A_SEQ]);
    for (int k = A_PROMPT; k <= A_FAILED; k++) {
        if (PyList_GET_SIZE(a[k]) != n) {
            goto bail;
        }
    }
    if (n == 0) {
        goto bail;
    }
    Py_buffer raw;
    if (PyObject_GetBuffer(a[A_METADATA], &raw, PyBUF_SIMPLE) < 0) {
        goto done;
    }
    int empty = raw.len == 1 && ((const unsigned char *)raw.buf)[0] == 0x80; /* msgpack {} */
    PyBuffer_Release(&raw);
    metadata = empty ? PyDict_New() : PyObject_CallOneArg(G.raw_map, a[A_METADATA]);
    if (!metadata) {
        goto done;
    }
    if (metadata == Py_None) {
        goto bail;
    }
    if (values) {
        int r = rules_ok(a, n);
        if (r < 0) {
            goto done;
        }
        if (!r) {
            goto bail;
        }
    }
    long long num_tokens = 0, prompt_tokens = 0;
    for (Py_ssize_t i = 0; i < n; i++) {
        long long s = as_ll(PyList_GET_ITEM(a[A_SEQ], i), &ok);
        long long p = as_ll(PyList_GET_ITEM(a[A_PROMPT], i), &ok);
        if (!ok || __builtin_add_overflow(num_tokens, s, &num_tokens)
            || __builtin_add_overflow(prompt_tokens, p, &prompt_tokens)) {
            goto bail;
        }
    }
    long long num_completion = num_tokens - prompt_tokens;
    if (!ref_ok(a[A_TOKENS], 1, "int32", num_tokens) || !ref_ok(a[A_MASK], 2, "uint8", num_completion)
        || !ref_ok(a[A_LP], 3, "float32", num_completion)) {
        goto bail;
    }
    for (; views < 3; views++) {
        if (PyObject_GetBuffer(PyList_GET_ITEM(bufs, views + 1), &view[views], PyBUF_SIMPLE) < 0) {
            goto done;
        }
    }
    if (num_tokens > PY_SSIZE_T_MAX / 4 || view[0].len != 4 * num_tokens
        || view[1].len != num_completion || view[2].len != 4 * num_completion) {
        goto bail;
    }
    if (values) {
        int fine;
        if (view[0].len + view[1].len + view[2].len < RELEASE_GIL_FROM) {
            fine = scan(view, G.slack);
        } else {
            Py_BEGIN_ALLOW_THREADS
            fine = scan(view, G.slack);
            Py_END_ALLOW_THREADS
        }
        if (!fine) {
            goto bail;
        }
    }
    for (int k = 0; k < 3; k++) {
        PyObject *call[2] = {PyList_GET_ITEM(bufs, k + 1), G.dtype[k]};
        if (!(arrays[k] = PyObject_Vectorcall(G.frombuffer, call, 2, NULL))) {
            goto done;
        }
    }
    if (!(dict = PyDict_New())) {
        goto done;
    }
    for (Py_ssize_t i = 0; i < PyTuple_GET_SIZE(G.fields); i++) {
        PyObject *name = PyTuple_GET_ITEM(G.fields, i), *value = NULL;
        int own = 0;
        if (i == G.at_metadata) {
            value = metadata;
        } else if (i == G.at_array[0] || i == G.at_array[1] || i == G.at_array[2]) {
            value = arrays[i == G.at_array[0] ? 0 : i == G.at_array[1] ? 1 : 2];
        } else if (!(value = PyObject_GetAttr(h, name))) {
            goto done;
        } else {
            own = 1;
        }
        int err = PyDict_SetItem(dict, name, value);
        if (own) {
            Py_DECREF(value);
        }
        if (err < 0) {
            goto done;
        }
    }
    PyObject *group = G.group->tp_alloc(G.group, 0); /* object.__new__(Group): no __init__ */
    if (!group) {
        goto done;
    }
    if (PyObject_GenericSetDict(group, dict, NULL) < 0) {
        Py_DECREF(group);
        goto done;
    }
    result = group;
    goto done;
bail:
    result = Py_NewRef(Py_None);
done:
    for (int i = 0; i < views; i++) {
        PyBuffer_Release(&view[i]);
    }
    for (int i = 0; i < N_ATTRS; i++) {
        Py_XDECREF(a[i]);
    }
    for (int k = 0; k < 3; k++) {
        Py_XDECREF(arrays[k]);
    }
    Py_XDECREF(metadata);
    Py_XDECREF(dict);
    return result;
}

static PyObject *address(PyObject *self, PyObject *arg) {
    Py_buffer view;
    if (PyObject_GetBuffer(arg, &view, PyBUF_SIMPLE) < 0) {
        return NULL;
    }
    PyObject *result = PyLong_FromVoidPtr(view.buf);
    PyBuffer_Release(&view);
    return result;
}

static PyMethodDef methods[] = {
    {"address", address, METH_O,
     "address(buffer) -> int: the memory address of a contiguous buffer's first byte."},
    {"values_ok", (PyCFunction)(void (*)(void))values_ok, METH_FASTCALL,
     "values_ok(tokens, loss_mask, behavior_logprobs, slack) -> bool: token ids >= 0, mask bytes "
     "0 or 1, logprobs in (-inf, slack] (no NaN); buffers of int32, uint8, float32."},
    {"configure", configure, METH_VARARGS,
     "configure(fields, protocol, slack, Group, raw_map, spans_problem, frombuffer, int32, uint8, "
     "float32): what finish_group needs from asyncrl/protocol/group_codec.py (called once at import)."},
    {"finish_group", (PyCFunction)(void (*)(void))finish_group, METH_FASTCALL,
     "finish_group(head, bufs, values) -> Group | None: a parsed Group header and its four "
     "frames as a Group, or None when anything about them is unusual."},
    {NULL, NULL, 0, NULL},
};

static struct PyModuleDef module = {
    PyModuleDef_HEAD_INIT, "asyncrl._hotpath",
    "The end of the group fast path, compiled (asyncrl/protocol/_hotpath.c).", -1, methods,
};

PyMODINIT_FUNC PyInit__hotpath(void) { return PyModule_Create(&module); }
