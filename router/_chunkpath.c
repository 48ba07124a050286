/* firstbyte.router._chunkpath: the relay's per-chunk hot path, compiled.
 *
 * What runs for every token a caught-up stream relays, once its first content is out:
 *
 *   ReadPath(data)  an upstream read of whole HTTP/1.1 chunks, each one whole `data: ...`
 *                   event, cut as the relay's fast path cuts it (Relay.feed), then handed to
 *                   the store (Stream.add) and the inter-token metric (observer.chunk). It
 *                   replaces httptools' parse, the sink's on_body/on_read_end and Relay.feed
 *                   for that read; any other read (a partial chunk, the last chunk, an event
 *                   of another shape, a decided attempt) returns False having changed nothing,
 *                   and the Python path takes the read as before.
 *   SSEWriter(events)
 *                   a direct reader's write (SSEFramer.writer with uvicorn's body writer):
 *                   `id: SEQ\ndata: DATA\n\n` per event, one HTTP chunk, one transport.write;
 *                   False (nothing written) when uvicorn's send would have had to wait. An
 *                   event with a line end goes to the Python writer given as `fallback`.
 *
 * The Python path (router/pipeline/proxy.py, relay.py, readers.py, hosting/body_writer.py)
 * stays the one definition of what a read means; tests/router/test_chunkpath.py checks this
 * gives the same store, bytes and counters for the same reads. Without the compiled module
 * (no compiler at install) the Python path runs alone (router/chunkpath.py).
 */
#define PY_SSIZE_T_CLEAN
#include <Python.h>
#include <stddef.h>
#include <string.h>
#include <structmember.h>
#include <time.h>

#define MAX_EVENTS 64 /* more chunks in one read than this: the Python path */

static PyObject *s_fast, *s_framer, *s_idle, *s_appended, *s_last_read, *s_done, *s_seq,
    *s_data, *s_write_paused, *s_disconnected, *s_chunked_encoding, *s_response_complete,
    *s_is_closing, *s_write, *s_direct, *s_transport, *s_flow;

/* ---------------------------------------------------------------- ReadPath */

typedef struct {
    PyObject_HEAD
    PyObject *conn;      /* H1Connection: _last_read */
    PyObject *outcome;   /* the attempt's future: a decided attempt takes nothing more */
    PyObject *relay;     /* Relay: _fast, _framer.idle, appended */
    PyObject *add;       /* Stream.add, bound */
    PyObject *chunk;     /* observer.chunk, bound, or None */
    PyObject *ctx;       /* its RequestContext */
    PyObject *loop_time; /* loop.time, bound */
    Py_ssize_t reads;    /* reads taken */
    Py_ssize_t events;   /* events they held */
    vectorcallfunc vectorcall;
} ReadPath;

static PyMemberDef ReadPath_members[] = {
    {"reads", T_PYSSIZET, offsetof(ReadPath, reads), READONLY, "Reads taken."},
    {"events", T_PYSSIZET, offsetof(ReadPath, events), READONLY, "Events those reads held."},
    {NULL},
};

static int
ReadPath_traverse(ReadPath *self, visitproc visit, void *arg)
{
    Py_VISIT(self->conn);
    Py_VISIT(self->outcome);
    Py_VISIT(self->relay);
    Py_VISIT(self->add);
    Py_VISIT(self->chunk);
    Py_VISIT(self->ctx);
    Py_VISIT(self->loop_time);
    return 0;
}

static int
ReadPath_clear(ReadPath *self)
{
    Py_CLEAR(self->conn);
    Py_CLEAR(self->outcome);
    Py_CLEAR(self->relay);
    Py_CLEAR(self->add);
    Py_CLEAR(self->chunk);
    Py_CLEAR(self->ctx);
    Py_CLEAR(self->loop_time);
    return 0;
}

static void
ReadPath_dealloc(ReadPath *self)
{
    PyObject_GC_UnTrack(self);
    ReadPath_clear(self);
    Py_TYPE(self)->tp_free((PyObject *)self);
}

/* Is `p[0:n]` one whole event the relay's fast path cuts (Relay.feed's test, byte for byte)? */
static int
fast_event(const char *p, Py_ssize_t n)
{
    if (n < 8 || memcmp(p, "data: ", 6) != 0)
        return 0;
    Py_ssize_t end = n - 2;
    const char *lf = memchr(p, '\n', (size_t)n);
    if (lf == NULL || lf - p != end || p[n - 1] != '\n')
        return 0;
    if (memchr(p, '\r', (size_t)n) != NULL || p[6] == '[')
        return 0;
    if (p[end - 2] == '}' && p[end - 1] == '}')
        return 0;
    return 1;
}

/* Whole chunks `HEX\r\nPAYLOAD\r\n`, each a fast event: their data's offsets; -1 if not. */
static Py_ssize_t
cut_chunks(const char *buf, Py_ssize_t len, Py_ssize_t *starts, Py_ssize_t *sizes)
{
    Py_ssize_t pos = 0, count = 0;
    while (pos < len) {
        size_t size = 0;
        Py_ssize_t digits = 0;
        while (pos < len && digits < 8) {
            char c = buf[pos];
            int v;
            if (c >= '0' && c <= '9')
                v = c - '0';
            else if (c >= 'a' && c <= 'f')
                v = c - 'a' + 10;
            else if (c >= 'A' && c <= 'F')
                v = c - 'A' + 10;
            else
                break;
            size = size * 16 + (size_t)v;
            digits++;
            pos++;
        }
        if (digits == 0 || size == 0 || count == MAX_EVENTS)
            return -1; /* not a size, the last chunk, or too many: the parser's */
        if (len - pos < 2 || buf[pos] != '\r' || buf[pos + 1] != '\n')
            return -1; /* extensions, a long size, or cut short */
        pos += 2;
        if ((size_t)(len - pos) < size + 2)
            return -1;
        Py_ssize_t n = (Py_ssize_t)size;
        if (buf[pos + n] != '\r' || buf[pos + n + 1] != '\n' || !fast_event(buf + pos, n))
            return -1;
        starts[count] = pos + 6;
        sizes[count] = n - 8;
        count++;
        pos += n + 2;
    }
    return count;
}

static int
attr_true(PyObject *obj, PyObject *name)
{
    PyObject *value = PyObject_GetAttr(obj, name);
    if (value == NULL)
        return -1;
    int truth = PyObject_IsTrue(value);
    Py_DECREF(value);
    return truth;
}

static double
perf_counter(void)
{
    /* time.perf_counter's clock on Linux (CLOCK_MONOTONIC), read without a Python call */
    struct timespec ts;
    clock_gettime(CLOCK_MONOTONIC, &ts);
    return (double)ts.tv_sec + (double)ts.tv_nsec * 1e-9;
}


/* The read's outcome: 1 taken, 0 for the Python path (nothing changed), -1 error. */
static int
read_path(ReadPath *self, PyObject *data)
{
    if (!PyBytes_CheckExact(data))
        return 0;
    const char *buf = PyBytes_AS_STRING(data);
    Py_ssize_t len = PyBytes_GET_SIZE(data);
    Py_ssize_t starts[MAX_EVENTS], sizes[MAX_EVENTS];
    Py_ssize_t count = cut_chunks(buf, len, starts, sizes);
    if (count <= 0)
        return 0;

    PyObject *done = PyObject_CallMethodNoArgs(self->outcome, s_done);
    if (done == NULL)
        return -1;
    int decided = PyObject_IsTrue(done);
    Py_DECREF(done);
    if (decided != 0)
        return decided < 0 ? -1 : 0;
    int fast = attr_true(self->relay, s_fast);
    if (fast <= 0)
        return fast;
    PyObject *framer = PyObject_GetAttr(self->relay, s_framer);
    if (framer == NULL)
        return -1;
    int idle = attr_true(framer, s_idle);
    Py_DECREF(framer);
    if (idle <= 0)
        return idle;

    /* From here the read is taken, as Relay.feed would (same payloads, same counters). */
    double now = perf_counter();
    PyObject *payloads = PyList_New(count);
    if (payloads == NULL)
        return -1;
    for (Py_ssize_t i = 0; i < count; i++) {
        PyObject *payload = PyBytes_FromStringAndSize(buf + starts[i], sizes[i]);
        if (payload == NULL) {
            Py_DECREF(payloads);
            return -1;
        }
        PyList_SET_ITEM(payloads, i, payload);
    }
    int status = -1;
    PyObject *read_at = NULL, *result = NULL, *appended = NULL, *more = NULL, *total = NULL;
    PyObject *loop_now = PyObject_CallNoArgs(self->loop_time);
    if (loop_now == NULL || PyObject_SetAttr(self->conn, s_last_read, loop_now) < 0)
        goto out;
    appended = PyObject_GetAttr(self->relay, s_appended);
    more = PyLong_FromSsize_t(count);
    if (appended == NULL || more == NULL)
        goto out;
    total = PyNumber_Add(appended, more);
    if (total == NULL || PyObject_SetAttr(self->relay, s_appended, total) < 0)
        goto out;
    read_at = PyFloat_FromDouble(now);
    if (read_at == NULL)
        goto out;
    PyObject *args[2] = {payloads, read_at};
    result = PyObject_Vectorcall(self->add, args, 2, NULL);
    if (result == NULL)
        goto out;
    if (self->chunk != Py_None) {
        Py_DECREF(result);
        PyObject *chunk_args[2] = {self->ctx, read_at};
        result = PyObject_Vectorcall(self->chunk, chunk_args, 2, NULL);
        if (result == NULL)
            goto out;
    }
    status = 1;
    self->reads++;
    self->events += count;
out:
    Py_XDECREF(result);
    Py_XDECREF(read_at);
    Py_XDECREF(total);
    Py_XDECREF(more);
    Py_XDECREF(appended);
    Py_XDECREF(loop_now);
    Py_DECREF(payloads);
    return status;
}

static PyObject *
ReadPath_vectorcall(PyObject *callable, PyObject *const *args, size_t nargsf, PyObject *kwnames)
{
    if (PyVectorcall_NARGS(nargsf) != 1 || kwnames != NULL) {
        PyErr_SetString(PyExc_TypeError, "ReadPath takes one argument: the read's bytes");
        return NULL;
    }
    int status = read_path((ReadPath *)callable, args[0]);
    if (status < 0)
        return NULL;
    return Py_NewRef(status ? Py_True : Py_False);
}

static PyObject *
ReadPath_new(PyTypeObject *type, PyObject *args, PyObject *kwds)
{
    static char *kwlist[] = {"conn", "outcome", "relay", "add", "chunk", "ctx", "loop_time", NULL};
    PyObject *conn, *outcome, *relay, *add, *chunk, *ctx, *loop_time;
    if (!PyArg_ParseTupleAndKeywords(args, kwds, "OOOOOOO:ReadPath", kwlist, &conn, &outcome,
                                     &relay, &add, &chunk, &ctx, &loop_time))
        return NULL;
    ReadPath *self = (ReadPath *)type->tp_alloc(type, 0);
    if (self == NULL)
        return NULL;
    self->conn = Py_NewRef(conn);
    self->outcome = Py_NewRef(outcome);
    self->relay = Py_NewRef(relay);
    self->add = Py_NewRef(add);
    self->chunk = Py_NewRef(chunk);
    self->ctx = Py_NewRef(ctx);
    self->loop_time = Py_NewRef(loop_time);
    self->vectorcall = ReadPath_vectorcall;
    return (PyObject *)self;
}

static PyTypeObject ReadPathType = {
    PyVarObject_HEAD_INIT(NULL, 0)
    .tp_name = "firstbyte.router._chunkpath.ReadPath",
    .tp_doc = "ReadPath(conn, outcome, relay, add, chunk, ctx, loop_time)(data) -> bool: "
              "take an upstream read of whole chunks of whole events, or leave it (False).",
    .tp_basicsize = sizeof(ReadPath),
    .tp_flags = Py_TPFLAGS_DEFAULT | Py_TPFLAGS_HAVE_GC | Py_TPFLAGS_HAVE_VECTORCALL,
    .tp_new = ReadPath_new,
    .tp_members = ReadPath_members,
    .tp_dealloc = (destructor)ReadPath_dealloc,
    .tp_traverse = (traverseproc)ReadPath_traverse,
    .tp_clear = (inquiry)ReadPath_clear,
    .tp_vectorcall_offset = offsetof(ReadPath, vectorcall),
    .tp_call = PyVectorcall_Call,
};

/* ---------------------------------------------------------------- SSEWriter */

typedef struct {
    PyObject_HEAD
    PyObject *cycle;     /* uvicorn's RequestResponseCycle */
    PyObject *transport; /* its transport */
    PyObject *flow;      /* its FlowControl */
    PyObject *framer;    /* the SSEFramer: direct */
    PyObject *fallback;  /* the Python writer, for events with line ends */
    vectorcallfunc vectorcall;
} SSEWriter;

static int
SSEWriter_traverse(SSEWriter *self, visitproc visit, void *arg)
{
    Py_VISIT(self->cycle);
    Py_VISIT(self->transport);
    Py_VISIT(self->flow);
    Py_VISIT(self->framer);
    Py_VISIT(self->fallback);
    return 0;
}

static int
SSEWriter_clear(SSEWriter *self)
{
    Py_CLEAR(self->cycle);
    Py_CLEAR(self->transport);
    Py_CLEAR(self->flow);
    Py_CLEAR(self->framer);
    Py_CLEAR(self->fallback);
    return 0;
}

static void
SSEWriter_dealloc(SSEWriter *self)
{
    PyObject_GC_UnTrack(self);
    SSEWriter_clear(self);
    Py_TYPE(self)->tp_free((PyObject *)self);
}

/* `value` in decimal at `p` (a sequence number: not negative); returns the end. */
static char *
write_decimal(char *p, long long value)
{
    char digits[24];
    int n = 0;
    unsigned long long v = value < 0 ? 0 : (unsigned long long)value;
    do {
        digits[n++] = (char)('0' + v % 10);
        v /= 10;
    } while (v);
    while (n)
        *p++ = digits[--n];
    return p;
}

/* `value` in lowercase hex at `p` (an HTTP chunk's size); returns the end. */
static char *
write_hex(char *p, size_t value)
{
    char digits[24];
    int n = 0;
    do {
        digits[n++] = "0123456789abcdef"[value & 15];
        value >>= 4;
    } while (value);
    while (n)
        *p++ = digits[--n];
    return p;
}

/* Can the connection take a part now (uvicorn_writer's test)? 1 yes, 0 no, -1 error. */
static int
writable(SSEWriter *self)
{
    int paused = attr_true(self->flow, s_write_paused);
    if (paused != 0)
        return paused < 0 ? -1 : 0;
    int gone = attr_true(self->cycle, s_disconnected);
    if (gone != 0)
        return gone < 0 ? -1 : 0;
    PyObject *chunked = PyObject_GetAttr(self->cycle, s_chunked_encoding);
    if (chunked == NULL)
        return -1;
    int is_chunked = chunked == Py_True;
    Py_DECREF(chunked);
    if (!is_chunked)
        return 0;
    int complete = attr_true(self->cycle, s_response_complete);
    if (complete != 0)
        return complete < 0 ? -1 : 0;
    PyObject *closing = PyObject_CallMethodNoArgs(self->transport, s_is_closing);
    if (closing == NULL)
        return -1;
    int is_closing = PyObject_IsTrue(closing);
    Py_DECREF(closing);
    if (is_closing != 0)
        return is_closing < 0 ? -1 : 0;
    return 1;
}

static PyObject *
SSEWriter_vectorcall(PyObject *callable, PyObject *const *args, size_t nargsf, PyObject *kwnames)
{
    SSEWriter *self = (SSEWriter *)callable;
    if (PyVectorcall_NARGS(nargsf) != 1 || kwnames != NULL || !PyList_CheckExact(args[0])) {
        PyErr_SetString(PyExc_TypeError, "SSEWriter takes one argument: a list of events");
        return NULL;
    }
    PyObject *events = args[0];
    Py_ssize_t count = PyList_GET_SIZE(events);
    if (count == 0 || count > MAX_EVENTS)
        return PyObject_Vectorcall(self->fallback, args, 1, NULL);
    PyObject *datas[MAX_EVENTS];
    long long seqs[MAX_EVENTS];
    Py_ssize_t body = 0;
    Py_ssize_t i;
    for (i = 0; i < count; i++) {
        PyObject *event = PyList_GET_ITEM(events, i);
        PyObject *seq = PyObject_GetAttr(event, s_seq);
        if (seq == NULL)
            goto fail;
        seqs[i] = PyLong_AsLongLong(seq);
        Py_DECREF(seq);
        if (seqs[i] == -1 && PyErr_Occurred())
            goto fail;
        datas[i] = PyObject_GetAttr(event, s_data);
        if (datas[i] == NULL)
            goto fail;
        if (!PyBytes_CheckExact(datas[i])) {
            i++;
            goto fall_back;
        }
        const char *d = PyBytes_AS_STRING(datas[i]);
        Py_ssize_t n = PyBytes_GET_SIZE(datas[i]);
        if (memchr(d, '\n', (size_t)n) || memchr(d, '\r', (size_t)n)) {
            i++;
            goto fall_back; /* several lines, or a named event: the Python framer */
        }
        body += n + 40; /* "id: " + 20 digits + "\ndata: " + "\n\n" is 33 at most */
    }
    int ok = writable(self);
    if (ok <= 0) {
        for (Py_ssize_t j = 0; j < count; j++)
            Py_DECREF(datas[j]);
        if (ok < 0)
            return NULL;
        Py_RETURN_FALSE;
    }
    /* One HTTP chunk: "%x\r\n" body "\r\n", as uvicorn_writer frames it. */
    PyObject *part = PyBytes_FromStringAndSize(NULL, body + 16 + 4);
    if (part == NULL) {
        i = count;
        goto fail;
    }
    char *out = PyBytes_AS_STRING(part);
    char *p = out + 16; /* room for the size line, moved down once the body's size is known */
    for (Py_ssize_t j = 0; j < count; j++) {
        memcpy(p, "id: ", 4);
        p = write_decimal(p + 4, seqs[j]);
        memcpy(p, "\ndata: ", 7);
        p += 7;
        Py_ssize_t n = PyBytes_GET_SIZE(datas[j]);
        memcpy(p, PyBytes_AS_STRING(datas[j]), (size_t)n);
        p += n;
        *p++ = '\n';
        *p++ = '\n';
        Py_DECREF(datas[j]);
    }
    Py_ssize_t size = p - (out + 16);
    char head[20];
    int head_len = (int)(write_hex(head, (size_t)size) - head);
    head[head_len++] = '\r';
    head[head_len++] = '\n';
    memmove(out + head_len, out + 16, (size_t)size);
    memcpy(out, head, (size_t)head_len);
    out[head_len + size] = '\r';
    out[head_len + size + 1] = '\n';
    if (_PyBytes_Resize(&part, head_len + size + 2) < 0)
        return NULL;
    PyObject *written = PyObject_CallMethodOneArg(self->transport, s_write, part);
    Py_DECREF(part);
    if (written == NULL) {
        /* whatever a dying transport raises: its reader's send will say (uvicorn_writer) */
        if (!PyErr_ExceptionMatches(PyExc_Exception))
            return NULL;
        PyErr_Clear();
        Py_RETURN_FALSE;
    }
    Py_DECREF(written);
    PyObject *direct = PyObject_GetAttr(self->framer, s_direct);
    if (direct == NULL)
        return NULL;
    PyObject *more = PyLong_FromSsize_t(count);
    PyObject *total = more == NULL ? NULL : PyNumber_Add(direct, more);
    Py_DECREF(direct);
    Py_XDECREF(more);
    if (total == NULL)
        return NULL;
    int set = PyObject_SetAttr(self->framer, s_direct, total);
    Py_DECREF(total);
    if (set < 0)
        return NULL;
    Py_RETURN_TRUE;

fall_back:
    for (Py_ssize_t j = 0; j < i; j++)
        Py_DECREF(datas[j]);
    return PyObject_Vectorcall(self->fallback, args, 1, NULL);
fail:
    for (Py_ssize_t j = 0; j < i; j++)
        Py_XDECREF(datas[j]);
    return NULL;
}

static PyObject *
SSEWriter_new(PyTypeObject *type, PyObject *args, PyObject *kwds)
{
    static char *kwlist[] = {"cycle", "framer", "fallback", NULL};
    PyObject *cycle, *framer, *fallback;
    if (!PyArg_ParseTupleAndKeywords(args, kwds, "OOO:SSEWriter", kwlist, &cycle, &framer,
                                     &fallback))
        return NULL;
    PyObject *transport = PyObject_GetAttr(cycle, s_transport);
    if (transport == NULL)
        return NULL;
    PyObject *flow = PyObject_GetAttr(cycle, s_flow);
    if (flow == NULL) {
        Py_DECREF(transport);
        return NULL;
    }
    SSEWriter *self = (SSEWriter *)type->tp_alloc(type, 0);
    if (self == NULL) {
        Py_DECREF(transport);
        Py_DECREF(flow);
        return NULL;
    }
    self->cycle = Py_NewRef(cycle);
    self->transport = transport;
    self->flow = flow;
    self->framer = Py_NewRef(framer);
    self->fallback = Py_NewRef(fallback);
    self->vectorcall = SSEWriter_vectorcall;
    return (PyObject *)self;
}

static PyTypeObject SSEWriterType = {
    PyVarObject_HEAD_INIT(NULL, 0)
    .tp_name = "firstbyte.router._chunkpath.SSEWriter",
    .tp_doc = "SSEWriter(cycle, framer, fallback)(events) -> bool: write events as SSE on "
              "uvicorn's request cycle if it can take them now.",
    .tp_basicsize = sizeof(SSEWriter),
    .tp_flags = Py_TPFLAGS_DEFAULT | Py_TPFLAGS_HAVE_GC | Py_TPFLAGS_HAVE_VECTORCALL,
    .tp_new = SSEWriter_new,
    .tp_dealloc = (destructor)SSEWriter_dealloc,
    .tp_traverse = (traverseproc)SSEWriter_traverse,
    .tp_clear = (inquiry)SSEWriter_clear,
    .tp_vectorcall_offset = offsetof(SSEWriter, vectorcall),
    .tp_call = PyVectorcall_Call,
};

/* ---------------------------------------------------------------- module */

static struct PyModuleDef chunkpath_module = {
    PyModuleDef_HEAD_INIT,
    .m_name = "firstbyte.router._chunkpath",
    .m_doc = "The relay's per-chunk hot path, compiled (see router/chunkpath.py).",
    .m_size = -1,
};

#define INTERN(var, text)                                                                      \
    if ((var = PyUnicode_InternFromString(text)) == NULL)                                      \
        return NULL;

PyMODINIT_FUNC
PyInit__chunkpath(void)
{
    INTERN(s_fast, "_fast");
    INTERN(s_framer, "_framer");
    INTERN(s_idle, "idle");
    INTERN(s_appended, "appended");
    INTERN(s_last_read, "_last_read");
    INTERN(s_done, "done");
    INTERN(s_seq, "seq");
    INTERN(s_data, "data");
    INTERN(s_write_paused, "write_paused");
    INTERN(s_disconnected, "disconnected");
    INTERN(s_chunked_encoding, "chunked_encoding");
    INTERN(s_response_complete, "response_complete");
    INTERN(s_is_closing, "is_closing");
    INTERN(s_write, "write");
    INTERN(s_direct, "direct");
    INTERN(s_transport, "transport");
    INTERN(s_flow, "flow");
    if (PyType_Ready(&ReadPathType) < 0 || PyType_Ready(&SSEWriterType) < 0)
        return NULL;
    PyObject *module = PyModule_Create(&chunkpath_module);
    if (module == NULL)
        return NULL;
    if (PyModule_AddObjectRef(module, "ReadPath", (PyObject *)&ReadPathType) < 0 ||
        PyModule_AddObjectRef(module, "SSEWriter", (PyObject *)&SSEWriterType) < 0) {
        Py_DECREF(module);
        return NULL;
    }
    return module;
}
