/* firstbyte.router._chunkpath: the relay's per-chunk hot path, compiled.
 *
 * What runs for every token a caught-up stream relays, once its first content is out:
 *
 *   ReadPath(data)  an upstream read of whole HTTP/1.1 chunks, each of whole `data: ...`
 *                   events (one a chunk, or several), cut as the relay cuts them (Relay.feed,
 *                   its framer where a read holds more than one), then handed to
 *                   the store (Stream.add, done here in C where it neither trims nor
 *                   reclaims) and the inter-token metric (GapTimer.tick, here in C). It
 *                   replaces httptools' parse, the sink's on_body/on_read_end and Relay.feed
 *                   for that read. A read of whole chunks of one-line `data:` events that it
 *                   does not take so (the first content, a usage chunk, [DONE], maybe with the
 *                   body's last chunk) is cut here and its events' payloads handed to the
 *                   sink's on_events (the relay from its framer on, in Python), the body's end
 *                   to the connection's on_message_complete, as the parser would. Any other
 *                   read (a partial chunk, an event of another shape, trailers, a decided
 *                   attempt) returns False having changed nothing, and the Python path takes
 *                   the read as before.
 *   ConnReader(conn)(data)
 *                   an upstream connection's data_received (router/upstream_h1.py): the read
 *                   to the connection's `_fast` taker (a ReadPath) if it has one and it takes
 *                   it, else to the connection's `_data_received` (which the taker's False
 *                   leaves without one). A Python data_received only to call the taker cost
 *                   ~750 instructions a read.
 *   StreamAdder(stream, payloads, read_at)
 *                   Stream.add (and Stream.append of an event that does not finish the
 *                   stream) called from Python, done as ReadPath does it for its reads;
 *                   None where Stream.add's Python must (it trims or reclaims).
 *   pack_xadds(batch, start, limit, names, name_of, trim, done, every)
 *                   the Redis writer's per-event packing (router/shared/streams.py,
 *                   _Writer._pack): the XADD operations of a run of plain events, packed
 *                   as the Python loop packs them; it stops at anything else (a stream's
 *                   metadata, a trim, a [DONE]), which the Python loop packs.
 *   Mirror(queue, first)
 *                   a shared stream's mirror: each event queued for the Redis writer
 *                   (_Writer.push), without a Python call per event.
 *   sse_frames(events)
 *                   a reader's batch from the store framed as SSE (SSEFramer.frame), as
 *                   SSEWriter frames a direct reader's events; None for a batch with an
 *                   event of several lines (or a named one), which the Python framer frames.
 *   render_head(...), encode_headers(...), decode_headers(...)
 *                   once a request, not a chunk: the request's header names decoded, the
 *                   response's encoded and its head written (see "HTTP/1.1 heads" below).
 *   receive_now(receive)
 *                   once a request: its receive() begun (router/asgi.py, receive_now), the
 *                   message of a coroutine that answers at once taken without a
 *                   StopIteration.
 *   elapsed_ms(end, start)
 *                   once a request too, twice: an access line's times in ms, rounded to
 *                   hundredths (access.py's hundredths), without its Python frame.
 *   hundredths_text(value)
 *                   a Server-Timing duration's text (format(value, ".2f")) without
 *                   float.__format__'s decimal conversion.
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
#include <math.h>
#include <stddef.h>
#include <string.h>
#include <structmember.h>
#include <time.h>

#define MAX_EVENTS 64 /* more chunks in one read than this: the Python path */

static PyObject *s_done, *s_is_closing, *s_write, *s_transport, *s_flow, *s_add,
    *s_drop_released_taps, *s_wake, *s_on_message_complete, *s_data_received;

static PyTypeObject SSEWriterType;
typedef struct SSEWriter SSEWriter;
static PyObject *sse_write(SSEWriter *, PyObject *const *, Py_ssize_t, PyObject **,
                           PyObject *const *);

/* A new list of `count` items (new references to them); NULL with an exception. */
static PyObject *
list_of(PyObject *const *items, Py_ssize_t count)
{
    PyObject *list = PyList_New(count);
    if (list != NULL)
        for (Py_ssize_t i = 0; i < count; i++)
            PyList_SET_ITEM(list, i, Py_NewRef(items[i]));
    return list;
}

/* ---------------------------------------------------------------- attributes
 *
 * The objects this reads and writes per chunk (the stream, its store, the relay, ...) keep
 * their fields in __slots__. A Slot is one attribute read at one place here: the type it
 * last saw and where that type keeps the attribute (a __slots__ member's offset), so a read
 * or write is a load or a store, as the interpreter's own specialized LOAD_ATTR_SLOT does,
 * not a PyObject_GetAttr (a type lookup, then a dict or descriptor: ~200 instructions).
 * Any other type, or an attribute that is not a plain slot, goes through PyObject_GetAttr /
 * PyObject_SetAttr, so the result is the same either way; only the cost differs. */

typedef struct {
    const char *text;
    PyObject *name;     /* interned */
    PyTypeObject *type; /* the type last seen (held: its address is not reused meanwhile) */
    Py_ssize_t offset;  /* where `type` keeps it, or 0: not a plain slot of `type` */
    int writable;       /* and whether it may be written there (not a frozen struct's) */
} Slot;

static void
slot_learn(Slot *slot, PyTypeObject *type)
{
    Py_INCREF(type);
    Py_XSETREF(slot->type, type);
    slot->offset = 0;
    slot->writable = 0;
    if (type->tp_getattro != PyObject_GenericGetAttr)
        return; /* the type decides what its attributes are */
    PyObject *descr = PyObject_GetAttr((PyObject *)type, slot->name);
    if (descr == NULL) {
        PyErr_Clear();
        return;
    }
    if (Py_IS_TYPE(descr, &PyMemberDescr_Type)) {
        PyMemberDef *member = ((PyMemberDescrObject *)descr)->d_member;
        if (member->type == T_OBJECT_EX && member->offset > 0) {
            slot->offset = member->offset;
            slot->writable = !(member->flags & READONLY) &&
                             type->tp_setattro == PyObject_GenericSetAttr;
        }
    }
    Py_DECREF(descr);
}

/* obj.<slot>, a new reference; NULL with an exception. */
static inline PyObject *
slot_get(PyObject *obj, Slot *slot)
{
    if (Py_TYPE(obj) != slot->type)
        slot_learn(slot, Py_TYPE(obj));
    if (slot->offset) {
        PyObject *value = *(PyObject **)((char *)obj + slot->offset);
        if (value != NULL)
            return Py_NewRef(value);
    }
    return PyObject_GetAttr(obj, slot->name); /* or the AttributeError of an unset slot */
}

/* obj.<slot> = value; 0, or -1 with an exception. */
static inline int
slot_set(PyObject *obj, Slot *slot, PyObject *value)
{
    if (Py_TYPE(obj) != slot->type)
        slot_learn(slot, Py_TYPE(obj));
    if (slot->offset && slot->writable) {
        PyObject **where = (PyObject **)((char *)obj + slot->offset);
        PyObject *old = *where;
        *where = Py_NewRef(value);
        Py_XDECREF(old);
        return 0;
    }
    return PyObject_SetAttr(obj, slot->name, value);
}

/* A call's result dropped: 0, or -1 if the call raised. */
static int
discard(PyObject *result)
{
    if (result == NULL)
        return -1;
    Py_DECREF(result);
    return 0;
}

/* bool(obj.<slot>): 1, 0, or -1 with an exception. */
static int
attr_true(PyObject *obj, Slot *slot)
{
    PyObject *value = slot_get(obj, slot);
    if (value == NULL)
        return -1;
    int truth = value == Py_True                        ? 1
                : value == Py_False || value == Py_None ? 0
                                                        : PyObject_IsTrue(value);
    Py_DECREF(value);
    return truth;
}

/* obj.<slot> is None: 1, 0, or -1 with an exception. */
static int
attr_none(PyObject *obj, Slot *slot)
{
    PyObject *value = slot_get(obj, slot);
    if (value == NULL)
        return -1;
    int none = value == Py_None;
    Py_DECREF(value);
    return none;
}

/* *out = obj.<slot> (an int attribute); 0, or -1 with an exception. */
static int
attr_ll(PyObject *obj, Slot *slot, long long *out)
{
    PyObject *value = slot_get(obj, slot);
    if (value == NULL)
        return -1;
    *out = PyLong_AsLongLong(value);
    Py_DECREF(value);
    return *out == -1 && PyErr_Occurred() ? -1 : 0;
}

/* Where `obj` keeps <slot> (a plain slot of its type it may be written at), or NULL. */
static inline PyObject **
slot_where(PyObject *obj, Slot *slot)
{
    if (Py_TYPE(obj) != slot->type)
        slot_learn(slot, Py_TYPE(obj));
    return slot->offset && slot->writable ? (PyObject **)((char *)obj + slot->offset) : NULL;
}

/* The counters and sums a chunk adds to (the stream's, store's and owner's bytes, the
 * relay's and framer's events, the histogram's count, bucket and total) are ints and
 * floats that only their slot or list holds. Adding to one made a new object and freed the
 * old (~150 instructions, a third of it the allocator). Where nothing else holds it (its
 * reference count is the holder's alone, so no code can see it before or after), its value
 * is changed where it lies: an int of one digit that stays one positive digit (CPython
 * 3.11's layout: Py_SIZE 1, ob_digit[0]; other versions always make a new one), a float.
 * The value read back is the same either way. */

/* *where += delta in place: 1 done, 0 not (a new int must be made). */
static inline int
long_add_in_place(PyObject *value, Py_ssize_t delta)
{
#if PY_VERSION_HEX >= 0x030B0000 && PY_VERSION_HEX < 0x030C0000
    if (Py_REFCNT(value) == 1 && PyLong_CheckExact(value) && Py_SIZE(value) == 1) {
        Py_ssize_t total = (Py_ssize_t)((PyLongObject *)value)->ob_digit[0] + delta;
        if (total > 0 && total < ((Py_ssize_t)1 << PyLong_SHIFT)) {
            ((PyLongObject *)value)->ob_digit[0] = (digit)total;
            return 1;
        }
    }
#else
    (void)value;
    (void)delta;
#endif
    return 0;
}

/* obj.<slot> += delta (an int attribute); 0, or -1 with an exception. */
static int
add_to_attr(PyObject *obj, Slot *slot, Py_ssize_t delta)
{
    PyObject **where = slot_where(obj, slot);
    if (where != NULL && *where != NULL && PyLong_CheckExact(*where)) {
        PyObject *old = *where;
        if (long_add_in_place(old, delta))
            return 0;
        /* else a new int (a small one: CPython's own), put in the slot where it lies */
        Py_ssize_t now = PyLong_AsSsize_t(old);
        if (now == -1 && PyErr_Occurred())
            return -1;
        PyObject *total = PyLong_FromSsize_t(now + delta);
        if (total == NULL)
            return -1;
        *where = total;
        Py_DECREF(old);
        return 0;
    }
    PyObject *value = slot_get(obj, slot);
    if (value == NULL)
        return -1;
    PyObject *total;
    if (PyLong_CheckExact(value)) {
        Py_ssize_t now = PyLong_AsSsize_t(value);
        if (now == -1 && PyErr_Occurred()) {
            Py_DECREF(value);
            return -1;
        }
        total = PyLong_FromSsize_t(now + delta);
    } else {
        PyObject *more = PyLong_FromSsize_t(delta);
        total = more == NULL ? NULL : PyNumber_Add(value, more);
        Py_XDECREF(more);
    }
    Py_DECREF(value);
    if (total == NULL)
        return -1;
    int set = slot_set(obj, slot, total);
    Py_DECREF(total);
    return set;
}

/* ---------------------------------------------------------------- methods
 *
 * A method called per chunk on one object a request holds (its transport's write and
 * is_closing, its attempt's done). Called by name, each call looks it up on the type and
 * in the object (PyObject_VectorcallMethod: ~150 instructions before the call). A Method is
 * the function the type holds, found once where calling it with the object first is what
 * the call by name does: the type is immutable (its methods cannot change), looks
 * attributes up generically and holds a method descriptor by that name. An object's
 * instance dict could shadow it, so a call checks the object has none (tp_dictoffset, as
 * the generic lookup finds it) and its type is still the one seen; else, or where no
 * Method was found, the call goes by name, so the result is the same either way. */

typedef struct {
    PyObject *type; /* the type it was found on (held) */
    PyObject *func; /* the type's method descriptor (held) */
} Method;

/* The Method of `obj.<name>`, or one of NULLs where it must be called by name. */
static void
method_find(Method *method, PyObject *obj, PyObject *name)
{
    method->type = method->func = NULL;
    PyTypeObject *type = Py_TYPE(obj);
    PyObject *mro = type->tp_mro;
    if (type->tp_getattro != PyObject_GenericGetAttr || type->tp_dictoffset < 0 ||
        mro == NULL || !PyTuple_CheckExact(mro))
        return;
    for (Py_ssize_t i = 0; i < PyTuple_GET_SIZE(mro); i++)
        if (!PyType_HasFeature((PyTypeObject *)PyTuple_GET_ITEM(mro, i),
                               Py_TPFLAGS_IMMUTABLETYPE))
            return;
    /* The type's own attribute (its MRO's, the one an instance's lookup finds, from the
     * type's method cache): a metatype other than `type` could put its own first. A method
     * descriptor read from its type is itself. */
    if (!Py_IS_TYPE(type, &PyType_Type))
        return;
    PyObject *found = PyObject_GetAttr((PyObject *)type, name);
    if (found == NULL) {
        PyErr_Clear();
        return;
    }
    if (!PyType_HasFeature(Py_TYPE(found), Py_TPFLAGS_METHOD_DESCRIPTOR)) {
        Py_DECREF(found);
        return;
    }
    method->type = Py_NewRef((PyObject *)type);
    method->func = found;
}

/* obj.<name>(arg), or obj.<name>() with `arg` NULL: a new reference, NULL with an
 * exception. */
static PyObject *
method_call(Method *method, PyObject *obj, PyObject *name, PyObject *arg)
{
    PyObject *args[3] = {NULL, obj, arg};
    size_t nargsf = (arg == NULL ? 1 : 2) | PY_VECTORCALL_ARGUMENTS_OFFSET;
    if (method->func != NULL && (PyObject *)Py_TYPE(obj) == method->type) {
        Py_ssize_t offset = Py_TYPE(obj)->tp_dictoffset;
        if (offset == 0 || *(PyObject **)((char *)obj + offset) == NULL)
            return PyObject_Vectorcall(method->func, args + 1, nargsf, NULL);
    }
    return PyObject_VectorcallMethod(name, args + 1, nargsf, NULL);
}

static int
method_traverse(Method *method, visitproc visit, void *arg)
{
    Py_VISIT(method->type);
    Py_VISIT(method->func);
    return 0;
}

static void
method_clear(Method *method)
{
    Py_CLEAR(method->type);
    Py_CLEAR(method->func);
}

/* Every attribute read per chunk, by owner and name. */
static Slot stream_finished_at = {"finished_at"};
static Slot stream_store = {"_store"};
static Slot stream_owner = {"owner"};
static Slot stream_events = {"events"};
static Slot stream_trimmed = {"trimmed"};
static Slot stream_size_bytes = {"size_bytes"};
static Slot stream_mirror = {"mirror"};
static Slot stream_taps = {"_taps"};
static Slot stream_waiters = {"_waiters"};
static Slot store_over_share = {"_over_share"};
static Slot store_owners = {"_owners"};
static Slot store_shares = {"_shares"};
static Slot store_max_owner_bytes = {"max_owner_bytes"};
static Slot store_total_bytes = {"total_bytes"};
static Slot store_max_total_bytes = {"max_total_bytes"};
static Slot owner_bytes = {"bytes"};
static Slot tap_write = {"write"};
static Slot tap_seq = {"seq"};
static Slot tap_last_at = {"last_at"};
static Slot tap_released = {"released"};
static Slot relay_fast = {"_fast"};
static Slot relay_framer = {"_framer"};
static Slot relay_appended = {"appended"};
static Slot framer_idle = {"idle"};
static Slot conn_last_read = {"_last_read"};
static Slot conn_fast = {"_fast"};
static Slot flow_write_paused = {"write_paused"};
static Slot cycle_disconnected = {"disconnected"};
static Slot cycle_chunked_encoding = {"chunked_encoding"};
static Slot cycle_response_complete = {"response_complete"};
static Slot event_seq = {"seq"};
static Slot event_data = {"data"};
static Slot stream_id = {"id"};
static Slot framer_direct = {"direct"};
static Slot gaps_last = {"last"};
static Slot gaps_hist = {"hist"};
static Slot hist_bounds = {"bounds"};
static Slot hist_counts = {"counts"};
static Slot hist_total = {"total"};
static Slot hist_count = {"count"};
static Slot *const all_slots[] = {
    &stream_finished_at, &stream_store, &stream_owner, &stream_events, &stream_trimmed,
    &stream_size_bytes, &stream_mirror, &stream_taps, &stream_waiters, &store_over_share,
    &store_owners, &store_shares, &store_max_owner_bytes, &store_total_bytes,
    &store_max_total_bytes, &owner_bytes,
    &tap_write, &tap_seq, &tap_last_at, &tap_released, &relay_fast, &relay_framer,
    &relay_appended, &framer_idle, &conn_last_read, &conn_fast, &flow_write_paused,
    &cycle_disconnected,
    &cycle_chunked_encoding, &cycle_response_complete, &event_seq, &event_data, &framer_direct,
    &gaps_last, &gaps_hist, &hist_bounds, &hist_counts, &hist_total, &hist_count, &stream_id,
    NULL};

/* ---------------------------------------------------------------- ReadPath */

typedef struct {
    PyObject_HEAD
    PyObject *conn;      /* H1Connection: _last_read */
    PyObject *outcome;   /* the attempt's future: a decided attempt takes nothing more */
    PyObject *relay;     /* Relay: _fast, _framer.idle, appended */
    PyObject *stream;    /* Stream: add, or its fields (stream_add) */
    PyObject *event_type; /* StreamEvent */
    Py_ssize_t overhead;  /* EVENT_OVERHEAD_BYTES: the store's charge an event beyond its data */
    PyObject *gaps;      /* the observer's GapTimer (its chunk's work), or None */
    PyObject *loop_time; /* loop.time, bound */
    PyObject *on_events; /* the sink's on_events (a read cut into its events), or None */
    Method done;         /* outcome.done */
    Py_ssize_t reads;    /* reads taken */
    Py_ssize_t events;   /* events they held */
    Py_ssize_t handed;   /* reads cut and handed to on_events */
    vectorcallfunc vectorcall;
} ReadPath;

static PyMemberDef ReadPath_members[] = {
    {"reads", T_PYSSIZET, offsetof(ReadPath, reads), READONLY, "Reads taken."},
    {"events", T_PYSSIZET, offsetof(ReadPath, events), READONLY, "Events those reads held."},
    {"handed", T_PYSSIZET, offsetof(ReadPath, handed), READONLY,
     "Reads cut into their events and handed to on_events (or the body's end only)."},
    {NULL},
};

static int
ReadPath_traverse(ReadPath *self, visitproc visit, void *arg)
{
    Py_VISIT(self->conn);
    Py_VISIT(self->outcome);
    Py_VISIT(self->relay);
    Py_VISIT(self->stream);
    Py_VISIT(self->event_type);
    Py_VISIT(self->gaps);
    Py_VISIT(self->loop_time);
    Py_VISIT(self->on_events);
    return method_traverse(&self->done, visit, arg);
}

static int
ReadPath_clear(ReadPath *self)
{
    Py_CLEAR(self->conn);
    Py_CLEAR(self->outcome);
    Py_CLEAR(self->relay);
    Py_CLEAR(self->stream);
    Py_CLEAR(self->event_type);
    Py_CLEAR(self->gaps);
    Py_CLEAR(self->loop_time);
    Py_CLEAR(self->on_events);
    method_clear(&self->done);
    return 0;
}

static void
ReadPath_dealloc(ReadPath *self)
{
    PyObject_GC_UnTrack(self);
    ReadPath_clear(self);
    Py_TYPE(self)->tp_free((PyObject *)self);
}

/* `p[0:n]` is a line and a blank line, `LINE\n\n` with no LF in LINE (cut_chunks found its
 * first LF and the one after it, so it is not searched again). Is it one whole one-line
 * event, `data: DATA\n\n` with no CR in DATA (what the relay's framer cuts to DATA on its
 * own, at an event boundary)? 2 if it is also one the relay's fast path cuts (Relay.feed's
 * test, byte for byte: not `[DONE]`, not ending with `}}`), 1 if only the former, 0 if
 * neither. */
static int
plain_event(const char *p, Py_ssize_t n)
{
    if (n < 8 || memcmp(p, "data: ", 6) != 0)
        return 0;
    Py_ssize_t end = n - 2;
    if (memchr(p, '\r', (size_t)n) != NULL)
        return 0;
    if (p[6] == '[' || (p[end - 2] == '}' && p[end - 1] == '}'))
        return 1;
    return 2;
}

/* Whole chunks `HEX\r\nPAYLOAD\r\n`, each one or more one-line events (plain_event), then
 * maybe the body's last chunk `0\r\n\r\n` (no trailers) ending the read: the events' data's
 * offsets; -1 if not. `*fast`: every one is an event the fast path cuts; `*ended`: the last
 * chunk came. */
static Py_ssize_t
cut_chunks(const char *buf, Py_ssize_t len, Py_ssize_t *starts, Py_ssize_t *sizes, int *fast,
           int *ended)
{
    Py_ssize_t pos = 0, count = 0;
    *fast = 1;
    *ended = 0;
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
        if (digits == 0 || count == MAX_EVENTS)
            return -1; /* not a size, or too many: the parser's */
        if (size == 0) {
            if (len - pos != 4 || memcmp(buf + pos, "\r\n\r\n", 4) != 0)
                return -1; /* trailers, extensions, or more after it: the parser's */
            *ended = 1;
            return count;
        }
        if (len - pos < 2 || buf[pos] != '\r' || buf[pos + 1] != '\n')
            return -1; /* extensions, a long size, or cut short */
        pos += 2;
        if ((size_t)(len - pos) < size + 2)
            return -1;
        Py_ssize_t n = (Py_ssize_t)size;
        if (buf[pos + n] != '\r' || buf[pos + n + 1] != '\n')
            return -1;
        /* The chunk's payload: one whole one-line event or more (an upstream may write
         * several in one chunk), each ended by its blank line within the chunk. */
        for (Py_ssize_t at = pos, stop = pos + n; at < stop;) {
            if (count == MAX_EVENTS)
                return -1;
            const char *p = buf + at;
            const char *lf = memchr(p, '\n', (size_t)(stop - at));
            if (lf == NULL || lf + 1 >= buf + stop || lf[1] != '\n')
                return -1; /* an event that goes on past the chunk, or of several lines */
            Py_ssize_t e = lf + 2 - p;
            int plain = plain_event(p, e);
            if (plain == 0)
                return -1;
            if (plain == 1)
                *fast = 0;
            starts[count] = at + 6;
            sizes[count] = e - 8;
            count++;
            at += e;
        }
        pos += n + 2;
    }
    return count;
}


static double
perf_counter(void)
{
    /* time.perf_counter's clock on Linux (CLOCK_MONOTONIC), read without a Python call */
    struct timespec ts;
    clock_gettime(CLOCK_MONOTONIC, &ts);
    return (double)ts.tv_sec + (double)ts.tv_nsec * 1e-9;
}




/* Stream.add (router/streams.py) for a read's `count` payloads (`size`: what the store
 * charges for them), with the same effects in the same order: the events stored, the stream, its owner
 * and the store charged, the mirror called per event, the direct readers written (an
 * SSEWriter called here, in C) and the others woken; an owner that these take past its share
 * is marked for trimming, as Stream.add marks it. It runs where Stream.add would not reclaim:
 * every read that leaves the store within its bound, whoever is over a share (one key
 * holding most of a full store stays over its share, and its reads come here too); anywhere
 * else (no store, a finished stream, a store these would take past its bound while an owner
 * is over its share) it returns 0 having changed nothing and Stream.add runs, which stays the
 * definition. 1 done, -1 error. `line_free`: the payloads hold no CR or LF (a direct
 * reader's writer need not look); `read_at` NULL: the idle clock is read if a reader is
 * written to; `last_event`, unless NULL: the last event added, once done. */
static int
stream_add(PyObject *stream, PyObject *event_type, PyObject *const *payloads, Py_ssize_t count,
           int line_free, Py_ssize_t size, PyObject *read_at, PyObject **last_event)
{
    int open = attr_none(stream, &stream_finished_at);
    if (open <= 0)
        return open;
    PyObject *store = slot_get(stream, &stream_store);
    if (store == NULL)
        return -1;
    int status = 0;
    PyObject *owners = NULL, *owner = NULL, *usage = NULL, *events = NULL, *trimmed = NULL;
    PyObject *added = NULL, *last = NULL, *mirror = NULL, *taps = NULL, *waiters = NULL;
    PyObject *marked = NULL, *idle_now = NULL;
    /* The events made, in an array: a list of them (`added`) is made only for a reader's
     * writer that is not an SSEWriter (or its Python fallback). */
    PyObject *local_made[MAX_EVENTS];
    PyObject **made = local_made;
    Py_ssize_t made_n = 0;
    if (store == Py_None)
        goto out;
    status = -1;
    marked = slot_get(store, &store_over_share);
    if (marked == NULL)
        goto out;
    if (!PyDict_CheckExact(marked)) {
        status = 0;
        goto out;
    }
    owners = slot_get(store, &store_owners);
    owner = slot_get(stream, &stream_owner);
    if (owners == NULL || owner == NULL)
        goto out;
    if (!PyDict_CheckExact(owners)) {
        status = 0;
        goto out;
    }
    usage = PyDict_GetItemWithError(owners, owner);
    if (usage == NULL) {
        status = PyErr_Occurred() ? -1 : 0; /* Stream.add says what is wrong */
        goto out;
    }
    Py_INCREF(usage);
    int shares = attr_true(store, &store_shares);
    if (shares < 0)
        goto out;
    int over = 0; /* these take the owner past its share: it is marked, as Stream.add does */
    if (shares) {
        long long held_n, limit_n;
        if (attr_ll(usage, &owner_bytes, &held_n) < 0 ||
            attr_ll(store, &store_max_owner_bytes, &limit_n) < 0)
            goto out;
        over = held_n + (long long)size > limit_n;
    }
    if (over || PyDict_GET_SIZE(marked) > 0) {
        /* Past the store's bound with an owner over its share: Stream.add reclaims. */
        long long total_n, bound_n;
        if (attr_ll(store, &store_total_bytes, &total_n) < 0 ||
            attr_ll(store, &store_max_total_bytes, &bound_n) < 0)
            goto out;
        if (total_n + (long long)size > bound_n) {
            status = 0;
            goto out;
        }
    }

    /* From here the read is added. */
    events = slot_get(stream, &stream_events);
    trimmed = slot_get(stream, &stream_trimmed);
    if (events == NULL || trimmed == NULL)
        goto out;
    if (!PyList_CheckExact(events)) {
        PyErr_SetString(PyExc_TypeError, "Stream.events is not a list");
        goto out;
    }
    long long seq = PyLong_AsLongLong(trimmed);
    if (seq == -1 && PyErr_Occurred())
        goto out;
    seq += PyList_GET_SIZE(events);
    if (count > MAX_EVENTS) {
        made = PyMem_Malloc((size_t)count * sizeof(PyObject *));
        if (made == NULL) {
            made = local_made;
            PyErr_NoMemory();
            goto out;
        }
    }
    for (; made_n < count; made_n++) {
        PyObject *number = PyLong_FromLongLong(++seq);
        if (number == NULL)
            goto out;
        PyObject *args[2] = {number, payloads[made_n]};
        PyObject *event = PyObject_Vectorcall(event_type, args, 2, NULL);
        Py_XSETREF(last, number); /* the last one: the readers' seq once written, not made anew */
        if (event == NULL)
            goto out;
        made[made_n] = event;
    }
    for (Py_ssize_t i = 0; i < count; i++)
        if (PyList_Append(events, made[i]) < 0)
            goto out;
    if (add_to_attr(stream, &stream_size_bytes, size) < 0 ||
        add_to_attr(store, &store_total_bytes, size) < 0 ||
        add_to_attr(usage, &owner_bytes, size) < 0)
        goto out;
    if (over && discard(Py_XNewRef(PyDict_SetDefault(marked, owner, usage))) < 0)
        goto out;
    mirror = slot_get(stream, &stream_mirror);
    if (mirror == NULL)
        goto out;
    if (mirror != Py_None) {
        for (Py_ssize_t i = 0; i < count; i++) {
            PyObject *args[2] = {stream, made[i]};
            if (discard(PyObject_Vectorcall(mirror, args, 2, NULL)) < 0)
                goto out;
        }
    }
    taps = slot_get(stream, &stream_taps);
    if (taps == NULL)
        goto out;
    if (!PyList_CheckExact(taps)) {
        PyErr_SetString(PyExc_TypeError, "Stream._taps is not a list");
        goto out;
    }
    if (PyList_GET_SIZE(taps) > 0) {
        if (last == NULL && (last = PyLong_FromLongLong(seq)) == NULL)
            goto out; /* no event made */
        if (read_at == NULL) { /* the idle clock, read only for readers to write to */
            read_at = idle_now = PyFloat_FromDouble(perf_counter());
            if (read_at == NULL)
                goto out;
        }
        int refused = 0;
        for (Py_ssize_t i = 0; i < PyList_GET_SIZE(taps); i++) {
            PyObject *tap = Py_NewRef(PyList_GET_ITEM(taps, i));
            PyObject *write = slot_get(tap, &tap_write);
            PyObject *written = NULL;
            if (write != NULL) {
                if (Py_IS_TYPE(write, &SSEWriterType))
                    written = sse_write((SSEWriter *)write, made, count, &added,
                                        line_free ? payloads : NULL);
                else if (added != NULL || (added = list_of(made, count)) != NULL)
                    written = PyObject_Vectorcall(write, &added, 1, NULL);
                Py_DECREF(write);
            }
            int ok = written == NULL ? -1 : PyObject_IsTrue(written);
            Py_XDECREF(written);
            if (ok > 0)
                ok = slot_set(tap, &tap_seq, last) < 0 ||
                             slot_set(tap, &tap_last_at, read_at) < 0
                         ? -1
                         : 1;
            else if (ok == 0) {
                refused = 1;
                ok = slot_set(tap, &tap_released, Py_True) < 0 ? -1 : 0;
            }
            Py_DECREF(tap);
            if (ok < 0)
                goto out;
        }
        if (refused && discard(PyObject_CallMethodNoArgs(stream, s_drop_released_taps)) < 0)
            goto out;
    }
    waiters = slot_get(stream, &stream_waiters);
    if (waiters == NULL)
        goto out;
    int waiting = PyObject_IsTrue(waiters);
    if (waiting < 0)
        goto out;
    if (waiting && discard(PyObject_CallMethodNoArgs(stream, s_wake)) < 0)
        goto out;
    status = 1;
    if (last_event != NULL && count > 0)
        *last_event = Py_NewRef(made[count - 1]);
out:
    while (made_n)
        Py_DECREF(made[--made_n]);
    if (made != local_made)
        PyMem_Free(made);
    Py_XDECREF(idle_now);
    Py_XDECREF(marked);
    Py_XDECREF(waiters);
    Py_XDECREF(taps);
    Py_XDECREF(mirror);
    Py_XDECREF(last);
    Py_XDECREF(added);
    Py_XDECREF(trimmed);
    Py_XDECREF(events);
    Py_XDECREF(usage);
    Py_XDECREF(owner);
    Py_XDECREF(owners);
    Py_DECREF(store);
    return status;
}

/* float(obj) for a float (PyFloat_AsDouble's value), read in line where it is exactly one:
 * the bisect reads ~4 bounds a chunk. -1.0 with an exception for what is no number. */
static inline double
as_double(PyObject *obj)
{
    return PyFloat_CheckExact(obj) ? PyFloat_AS_DOUBLE(obj) : PyFloat_AsDouble(obj);
}

/* GapTimer.tick(now) (router/hosting/prometheus.py), the same work: the gap since the last
 * chunk into its histogram (bounds, counts, total, count). 0, or -1 with an exception. */
static int
gap_tick(PyObject *gaps, PyObject *read_at, double now)
{
    PyObject *last = slot_get(gaps, &gaps_last);
    if (last == NULL)
        return -1;
    int status = -1;
    PyObject *hist = NULL, *bounds = NULL, *counts = NULL, *total = NULL;
    if (slot_set(gaps, &gaps_last, read_at) < 0)
        goto out;
    if (last == Py_None) {
        status = 0;
        goto out;
    }
    double value = now - as_double(last);
    if (PyErr_Occurred())
        goto out;
    hist = slot_get(gaps, &gaps_hist);
    if (hist == NULL)
        goto out;
    bounds = slot_get(hist, &hist_bounds);
    counts = slot_get(hist, &hist_counts);
    total = slot_get(hist, &hist_total);
    if (bounds == NULL || counts == NULL || total == NULL)
        goto out;
    if (!PyTuple_CheckExact(bounds) || !PyList_CheckExact(counts) ||
        PyList_GET_SIZE(counts) != PyTuple_GET_SIZE(bounds) + 1) {
        PyErr_SetString(PyExc_TypeError, "GapTimer.hist is not a Histogram");
        goto out;
    }
    /* bisect_left: the first bound not below the value */
    Py_ssize_t low = 0, high = PyTuple_GET_SIZE(bounds);
    while (low < high) {
        Py_ssize_t mid = (low + high) / 2;
        double bound = as_double(PyTuple_GET_ITEM(bounds, mid));
        if (bound == -1.0 && PyErr_Occurred())
            goto out;
        if (bound < value)
            low = mid + 1;
        else
            high = mid;
    }
    PyObject *bucket = PyList_GET_ITEM(counts, low);
    if (!long_add_in_place(bucket, 1)) {
        Py_ssize_t seen = PyLong_AsSsize_t(bucket);
        if (seen == -1 && PyErr_Occurred())
            goto out;
        PyObject *more = PyLong_FromSsize_t(seen + 1);
        if (more == NULL)
            goto out;
        PyList_SetItem(counts, low, more); /* steals `more`, drops the old count */
    }
    double sum = as_double(total);
    if (sum == -1.0 && PyErr_Occurred())
        goto out;
    /* `total` is ours and the slot's (2 references) where nothing else holds it */
    PyObject **where = slot_where(hist, &hist_total);
    if (where != NULL && *where == total && Py_REFCNT(total) == 2 && PyFloat_CheckExact(total)) {
        ((PyFloatObject *)total)->ob_fval = sum + value;
    } else {
        PyObject *new_total = PyFloat_FromDouble(sum + value);
        if (new_total == NULL)
            goto out;
        int set = slot_set(hist, &hist_total, new_total);
        Py_DECREF(new_total);
        if (set < 0)
            goto out;
    }
    if (add_to_attr(hist, &hist_count, 1) < 0)
        goto out;
    status = 0;
out:
    Py_XDECREF(total);
    Py_XDECREF(counts);
    Py_XDECREF(bounds);
    Py_XDECREF(hist);
    Py_DECREF(last);
    return status;
}

/* loop.time(): a bound method's call is its function's with the object first, made here
 * without the method object's own call in between (~30 instructions a read). */
static inline PyObject *
loop_time_now(ReadPath *self)
{
    PyObject *time = self->loop_time;
    if (PyMethod_Check(time)) {
        PyObject *args[2] = {NULL, PyMethod_GET_SELF(time)};
        return PyObject_Vectorcall(PyMethod_GET_FUNCTION(time), args + 1,
                                   1 | PY_VECTORCALL_ARGUMENTS_OFFSET, NULL);
    }
    return PyObject_CallNoArgs(time);
}

/* A read of whole one-line events that the fast path does not take (the first content, a
 * usage chunk, [DONE], a relay not on its fast path), maybe ending with the body's last
 * chunk: its events' payloads, as the relay's framer would cut them, to the sink's
 * `on_events` (router/pipeline/proxy.py: Relay.feed_events from there on, the Python path
 * past the framer), then the parser's `on_message_complete` if the body ended. 1 taken,
 * -1 error. */
static int
hand_over(ReadPath *self, const char *buf, const Py_ssize_t *starts, const Py_ssize_t *sizes,
          Py_ssize_t count, int ended)
{
    PyObject *loop_now = loop_time_now(self);
    if (loop_now == NULL)
        return -1;
    int set = slot_set(self->conn, &conn_last_read, loop_now);
    Py_DECREF(loop_now);
    if (set < 0)
        return -1;
    if (count > 0) {
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
        PyObject *result = PyObject_CallOneArg(self->on_events, payloads);
        Py_DECREF(payloads);
        if (discard(result) < 0)
            return -1;
    }
    if (ended && discard(PyObject_CallMethodNoArgs(self->conn, s_on_message_complete)) < 0)
        return -1;
    self->handed++;
    return 1;
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
    int all_fast, ended;
    Py_ssize_t count = cut_chunks(buf, len, starts, sizes, &all_fast, &ended);
    if (count < 0 || (count == 0 && !ended))
        return 0;
    if (!(all_fast && !ended) && self->on_events == Py_None)
        return 0;

    PyObject *done = method_call(&self->done, self->outcome, s_done, NULL);
    if (done == NULL)
        return -1;
    int decided = PyObject_IsTrue(done);
    Py_DECREF(done);
    if (decided != 0)
        return decided < 0 ? -1 : 0;
    int fast = 0;
    if (all_fast && !ended) {
        fast = attr_true(self->relay, &relay_fast);
        if (fast < 0)
            return -1;
        if (!fast && self->on_events == Py_None)
            return 0;
    }
    if (count > 0) {
        PyObject *framer = slot_get(self->relay, &relay_framer);
        if (framer == NULL)
            return -1;
        int idle = attr_true(framer, &framer_idle);
        Py_DECREF(framer);
        if (idle <= 0)
            return idle;
    }
    if (!fast)
        return hand_over(self, buf, starts, sizes, count, ended);

    /* From here the read is taken, as Relay.feed would (same payloads, same counters). */
    double now = perf_counter();
    PyObject *payloads[MAX_EVENTS]; /* a list only if Stream.add must take them */
    Py_ssize_t size = 0;            /* what the store charges for them */
    for (Py_ssize_t i = 0; i < count; i++) {
        size += sizes[i] + self->overhead;
        payloads[i] = PyBytes_FromStringAndSize(buf + starts[i], sizes[i]);
        if (payloads[i] == NULL) {
            while (i--)
                Py_DECREF(payloads[i]);
            return -1;
        }
    }
    int status = -1;
    PyObject *read_at = NULL, *result = NULL, *listed = NULL;
    PyObject *loop_now = loop_time_now(self);
    if (loop_now == NULL || slot_set(self->conn, &conn_last_read, loop_now) < 0)
        goto out;
    if (add_to_attr(self->relay, &relay_appended, count) < 0)
        goto out;
    read_at = PyFloat_FromDouble(now);
    if (read_at == NULL)
        goto out;
    int added = stream_add(self->stream, self->event_type, payloads, count, 1, size, read_at,
                           NULL); /* cut_chunks' payloads: no CR or LF in them */
    if (added < 0)
        goto out;
    if (added == 0) {
        listed = PyList_New(count);
        if (listed == NULL)
            goto out;
        for (Py_ssize_t i = 0; i < count; i++)
            PyList_SET_ITEM(listed, i, Py_NewRef(payloads[i]));
        PyObject *args[3] = {self->stream, listed, read_at};
        result = PyObject_VectorcallMethod(s_add, args, 3 | PY_VECTORCALL_ARGUMENTS_OFFSET, NULL);
        if (result == NULL)
            goto out;
    }
    if (self->gaps != Py_None && gap_tick(self->gaps, read_at, now) < 0)
        goto out;
    status = 1;
    self->reads++;
    self->events += count;
out:
    Py_XDECREF(result);
    Py_XDECREF(listed);
    Py_XDECREF(read_at);
    Py_XDECREF(loop_now);
    for (Py_ssize_t i = 0; i < count; i++)
        Py_DECREF(payloads[i]);
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
ReadPath_make(PyTypeObject *type, PyObject *conn, PyObject *outcome, PyObject *relay,
              PyObject *stream, PyObject *event_type, Py_ssize_t overhead, PyObject *gaps,
              PyObject *loop_time, PyObject *on_events)
{
    ReadPath *self = (ReadPath *)type->tp_alloc(type, 0);
    if (self == NULL)
        return NULL;
    self->conn = Py_NewRef(conn);
    self->outcome = Py_NewRef(outcome);
    self->relay = Py_NewRef(relay);
    self->stream = Py_NewRef(stream);
    self->event_type = Py_NewRef(event_type);
    self->overhead = overhead;
    self->gaps = Py_NewRef(gaps);
    self->loop_time = Py_NewRef(loop_time);
    self->on_events = Py_NewRef(on_events);
    method_find(&self->done, outcome, s_done);
    self->vectorcall = ReadPath_vectorcall;
    return (PyObject *)self;
}

static PyObject *
ReadPath_new(PyTypeObject *type, PyObject *args, PyObject *kwds)
{
    static char *kwlist[] = {"conn",           "outcome", "relay",     "stream",    "event_type",
                             "event_overhead", "gaps",    "loop_time", "on_events", NULL};
    PyObject *conn, *outcome, *relay, *stream, *event_type, *gaps, *loop_time;
    PyObject *on_events = Py_None;
    Py_ssize_t overhead;
    if (!PyArg_ParseTupleAndKeywords(args, kwds, "OOOOOnOO|O:ReadPath", kwlist, &conn, &outcome,
                                     &relay, &stream, &event_type, &overhead, &gaps, &loop_time,
                                     &on_events))
        return NULL;
    return ReadPath_make(type, conn, outcome, relay, stream, event_type, overhead, gaps,
                         loop_time, on_events);
}

/* A type's tp_new called with a vectorcall's arguments, as type.__call__ calls it (the
 * tp_init these types inherit, object's, does nothing with arguments when tp_new is
 * overridden): the way for any call but the common one. */
static PyObject *
new_from_vectorcall(newfunc new, PyObject *type, PyObject *const *args, size_t nargsf,
                    PyObject *kwnames)
{
    Py_ssize_t nargs = PyVectorcall_NARGS(nargsf);
    PyObject *tuple = PyTuple_New(nargs);
    if (tuple == NULL)
        return NULL;
    for (Py_ssize_t i = 0; i < nargs; i++)
        PyTuple_SET_ITEM(tuple, i, Py_NewRef(args[i]));
    PyObject *kwargs = NULL;
    if (kwnames != NULL && PyTuple_GET_SIZE(kwnames)) {
        kwargs = PyDict_New();
        if (kwargs == NULL) {
            Py_DECREF(tuple);
            return NULL;
        }
        for (Py_ssize_t i = 0; i < PyTuple_GET_SIZE(kwnames); i++) {
            if (PyDict_SetItem(kwargs, PyTuple_GET_ITEM(kwnames, i), args[nargs + i]) < 0) {
                Py_DECREF(tuple);
                Py_DECREF(kwargs);
                return NULL;
            }
        }
    }
    PyObject *made = new((PyTypeObject *)type, tuple, kwargs);
    Py_DECREF(tuple);
    Py_XDECREF(kwargs);
    return made;
}

/* ReadPath(...) as the relay calls it, once a request: 8 or 9 positional arguments, the
 * overhead an int, without PyArg_ParseTupleAndKeywords' format and keyword parsing (~1.2k
 * instructions); any other call through ReadPath_new. */
static PyObject *
ReadPath_type_vectorcall(PyObject *type, PyObject *const *args, size_t nargsf,
                         PyObject *kwnames)
{
    Py_ssize_t nargs = PyVectorcall_NARGS(nargsf);
    if ((nargs == 8 || nargs == 9) && (kwnames == NULL || !PyTuple_GET_SIZE(kwnames)) &&
        PyLong_CheckExact(args[5])) {
        Py_ssize_t overhead = PyLong_AsSsize_t(args[5]);
        if (overhead == -1 && PyErr_Occurred())
            return NULL; /* as "n" says it: OverflowError */
        return ReadPath_make((PyTypeObject *)type, args[0], args[1], args[2], args[3],
                             args[4], overhead, args[6], args[7],
                             nargs == 9 ? args[8] : Py_None);
    }
    return new_from_vectorcall(ReadPath_new, type, args, nargsf, kwnames);
}

static PyTypeObject ReadPathType = {
    PyVarObject_HEAD_INIT(NULL, 0)
    .tp_name = "firstbyte.router._chunkpath.ReadPath",
    .tp_doc = "ReadPath(conn, outcome, relay, stream, event_type, event_overhead, gaps, "
              "loop_time, on_events=None)(data) -> bool: "
              "take an upstream read of whole chunks of whole events, or leave it (False).",
    .tp_basicsize = sizeof(ReadPath),
    .tp_flags = Py_TPFLAGS_DEFAULT | Py_TPFLAGS_HAVE_GC | Py_TPFLAGS_HAVE_VECTORCALL,
    .tp_new = ReadPath_new,
    .tp_vectorcall = ReadPath_type_vectorcall,
    .tp_members = ReadPath_members,
    .tp_dealloc = (destructor)ReadPath_dealloc,
    .tp_traverse = (traverseproc)ReadPath_traverse,
    .tp_clear = (inquiry)ReadPath_clear,
    .tp_vectorcall_offset = offsetof(ReadPath, vectorcall),
    .tp_call = PyVectorcall_Call,
};

/* ---------------------------------------------------------------- ConnReader
 *
 * H1Connection.data_received: the connection's read taker (its `_fast`, a ReadPath or
 * None) first; a read it leaves (False: nothing changed) drops the taker, as the Python
 * did, and goes to the connection's `_data_received`, as does every read without one. */

typedef struct {
    PyObject_HEAD
    PyObject *conn; /* the H1Connection (a cycle: it holds this; the GC sees both) */
    vectorcallfunc vectorcall;
} ConnReader;

static PyObject *
ConnReader_vectorcall(PyObject *callable, PyObject *const *args, size_t nargsf,
                      PyObject *kwnames)
{
    ConnReader *self = (ConnReader *)callable;
    if (PyVectorcall_NARGS(nargsf) != 1 || kwnames != NULL) {
        PyErr_SetString(PyExc_TypeError, "ConnReader takes one argument: the read's bytes");
        return NULL;
    }
    PyObject *conn = self->conn;
    if (conn == NULL) {
        PyErr_SetString(PyExc_RuntimeError, "ConnReader cleared");
        return NULL;
    }
    Py_INCREF(conn); /* the taker may drop the connection's last other reference */
    PyObject *result = NULL;
    PyObject *fast = slot_get(conn, &conn_fast);
    if (fast == NULL)
        goto out;
    if (fast != Py_None) {
        int yes;
        if (Py_IS_TYPE(fast, &ReadPathType)) { /* its read_path, without the call's checks */
            yes = read_path((ReadPath *)fast, args[0]);
            Py_DECREF(fast);
        } else {
            PyObject *taken = PyObject_Vectorcall(fast, args, 1, NULL);
            Py_DECREF(fast);
            if (taken == NULL)
                goto out;
            yes = taken == Py_True ? 1 : taken == Py_False ? 0 : PyObject_IsTrue(taken);
            Py_DECREF(taken);
        }
        if (yes < 0)
            goto out;
        if (yes) {
            result = Py_NewRef(Py_None);
            goto out;
        }
        /* the parser's read: fast again at its next chunk boundary */
        if (slot_set(conn, &conn_fast, Py_None) < 0)
            goto out;
    } else {
        Py_DECREF(fast);
    }
    PyObject *call_args[2] = {conn, args[0]};
    result = PyObject_VectorcallMethod(s_data_received, call_args, 2, NULL);
out:
    Py_DECREF(conn);
    return result;
}

static int
ConnReader_traverse(ConnReader *self, visitproc visit, void *arg)
{
    Py_VISIT(self->conn);
    return 0;
}

static int
ConnReader_clear(ConnReader *self)
{
    Py_CLEAR(self->conn);
    return 0;
}

static void
ConnReader_dealloc(ConnReader *self)
{
    PyObject_GC_UnTrack(self);
    ConnReader_clear(self);
    Py_TYPE(self)->tp_free((PyObject *)self);
}

static PyObject *
ConnReader_new(PyTypeObject *type, PyObject *args, PyObject *kwds)
{
    static char *kwlist[] = {"conn", NULL};
    PyObject *conn;
    if (!PyArg_ParseTupleAndKeywords(args, kwds, "O:ConnReader", kwlist, &conn))
        return NULL;
    ConnReader *self = (ConnReader *)type->tp_alloc(type, 0);
    if (self == NULL)
        return NULL;
    self->conn = Py_NewRef(conn);
    self->vectorcall = ConnReader_vectorcall;
    return (PyObject *)self;
}

static PyTypeObject ConnReaderType = {
    PyVarObject_HEAD_INIT(NULL, 0)
    .tp_name = "firstbyte.router._chunkpath.ConnReader",
    .tp_doc = "ConnReader(conn)(data) -> None: conn._fast(data) if it has a taker and it takes "
              "the read, else conn._data_received(data) (the taker dropped if it left it).",
    .tp_basicsize = sizeof(ConnReader),
    .tp_flags = Py_TPFLAGS_DEFAULT | Py_TPFLAGS_HAVE_GC | Py_TPFLAGS_HAVE_VECTORCALL,
    .tp_new = ConnReader_new,
    .tp_dealloc = (destructor)ConnReader_dealloc,
    .tp_traverse = (traverseproc)ConnReader_traverse,
    .tp_clear = (inquiry)ConnReader_clear,
    .tp_vectorcall_offset = offsetof(ConnReader, vectorcall),
    .tp_call = PyVectorcall_Call,
};

/* ---------------------------------------------------------------- StreamAdder
 *
 * Stream.add and Stream.append (router/streams.py) of events that do not finish the stream,
 * called from Python (the reads the producer relays itself: a stream's first events, its
 * first content): stream_add above, the same work ReadPath does for the reads it takes. */

typedef struct {
    PyObject_HEAD
    PyObject *event_type; /* StreamEvent */
    Py_ssize_t overhead;  /* EVENT_OVERHEAD_BYTES */
    vectorcallfunc vectorcall;
} StreamAdder;

static PyObject *
StreamAdder_vectorcall(PyObject *callable, PyObject *const *args, size_t nargsf,
                       PyObject *kwnames)
{
    StreamAdder *self = (StreamAdder *)callable;
    if (PyVectorcall_NARGS(nargsf) != 3 || kwnames != NULL) {
        PyErr_SetString(PyExc_TypeError, "StreamAdder takes (stream, payloads, read_at)");
        return NULL;
    }
    PyObject *stream = args[0], *payloads = args[1], *read_at = args[2];
    if (!PyList_CheckExact(payloads) || PyList_GET_SIZE(payloads) == 0)
        Py_RETURN_NONE;
    Py_ssize_t size = 0;
    for (Py_ssize_t i = 0; i < PyList_GET_SIZE(payloads); i++) {
        PyObject *payload = PyList_GET_ITEM(payloads, i);
        if (!PyBytes_CheckExact(payload))
            Py_RETURN_NONE; /* Stream.add says what it makes of it */
        size += PyBytes_GET_SIZE(payload) + self->overhead;
    }
    PyObject *last = NULL;
    int added = stream_add(stream, self->event_type, PySequence_Fast_ITEMS(payloads),
                           PyList_GET_SIZE(payloads), 0, size,
                           read_at == Py_None ? NULL : read_at, &last);
    if (added < 0)
        return NULL;
    if (added == 0 || last == NULL)
        Py_RETURN_NONE;
    return last;
}

static int
StreamAdder_traverse(StreamAdder *self, visitproc visit, void *arg)
{
    Py_VISIT(self->event_type);
    return 0;
}

static int
StreamAdder_clear(StreamAdder *self)
{
    Py_CLEAR(self->event_type);
    return 0;
}

static void
StreamAdder_dealloc(StreamAdder *self)
{
    PyObject_GC_UnTrack(self);
    StreamAdder_clear(self);
    Py_TYPE(self)->tp_free((PyObject *)self);
}

static PyObject *
StreamAdder_new(PyTypeObject *type, PyObject *args, PyObject *kwds)
{
    static char *kwlist[] = {"event_type", "event_overhead", NULL};
    PyObject *event_type;
    Py_ssize_t overhead;
    if (!PyArg_ParseTupleAndKeywords(args, kwds, "On:StreamAdder", kwlist, &event_type,
                                     &overhead))
        return NULL;
    StreamAdder *self = (StreamAdder *)type->tp_alloc(type, 0);
    if (self == NULL)
        return NULL;
    self->event_type = Py_NewRef(event_type);
    self->overhead = overhead;
    self->vectorcall = StreamAdder_vectorcall;
    return (PyObject *)self;
}

static PyTypeObject StreamAdderType = {
    PyVarObject_HEAD_INIT(NULL, 0)
    .tp_name = "firstbyte.router._chunkpath.StreamAdder",
    .tp_doc = "StreamAdder(event_type, event_overhead)(stream, payloads, read_at) -> the last "
              "event added, or None (nothing done: Stream.add's Python does it).",
    .tp_basicsize = sizeof(StreamAdder),
    .tp_flags = Py_TPFLAGS_DEFAULT | Py_TPFLAGS_HAVE_GC | Py_TPFLAGS_HAVE_VECTORCALL,
    .tp_new = StreamAdder_new,
    .tp_dealloc = (destructor)StreamAdder_dealloc,
    .tp_traverse = (traverseproc)StreamAdder_traverse,
    .tp_clear = (inquiry)StreamAdder_clear,
    .tp_vectorcall_offset = offsetof(StreamAdder, vectorcall),
    .tp_call = PyVectorcall_Call,
};

/* ---------------------------------------------------------------- SSEWriter */

struct SSEWriter {
    PyObject_HEAD
    PyObject *cycle;     /* uvicorn's RequestResponseCycle */
    PyObject *transport; /* its transport */
    PyObject *flow;      /* its FlowControl */
    PyObject *framer;    /* the SSEFramer: direct */
    PyObject *fallback;  /* the Python writer, for events with line ends */
    Method write;        /* transport.write */
    Method is_closing;   /* transport.is_closing */
    vectorcallfunc vectorcall;
};

static int
SSEWriter_traverse(SSEWriter *self, visitproc visit, void *arg)
{
    Py_VISIT(self->cycle);
    Py_VISIT(self->transport);
    Py_VISIT(self->flow);
    Py_VISIT(self->framer);
    Py_VISIT(self->fallback);
    int err = method_traverse(&self->write, visit, arg);
    return err ? err : method_traverse(&self->is_closing, visit, arg);
}

static int
SSEWriter_clear(SSEWriter *self)
{
    Py_CLEAR(self->cycle);
    Py_CLEAR(self->transport);
    Py_CLEAR(self->flow);
    Py_CLEAR(self->framer);
    Py_CLEAR(self->fallback);
    method_clear(&self->write);
    method_clear(&self->is_closing);
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

/* How many decimal digits write_decimal writes for `value`. */
static int
decimal_digits(long long value)
{
    unsigned long long v = value < 0 ? 0 : (unsigned long long)value;
    int n = 1;
    while (v >= 10) {
        v /= 10;
        n++;
    }
    return n;
}

/* How many hex digits write_hex writes for `value`. */
static int
hex_digits(size_t value)
{
    int n = 1;
    while (value >= 16) {
        value >>= 4;
        n++;
    }
    return n;
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
    int paused = attr_true(self->flow, &flow_write_paused);
    if (paused != 0)
        return paused < 0 ? -1 : 0;
    int gone = attr_true(self->cycle, &cycle_disconnected);
    if (gone != 0)
        return gone < 0 ? -1 : 0;
    PyObject *chunked = slot_get(self->cycle, &cycle_chunked_encoding);
    if (chunked == NULL)
        return -1;
    int is_chunked = chunked == Py_True;
    Py_DECREF(chunked);
    if (!is_chunked)
        return 0;
    int complete = attr_true(self->cycle, &cycle_response_complete);
    if (complete != 0)
        return complete < 0 ? -1 : 0;
    PyObject *closing = method_call(&self->is_closing, self->transport, s_is_closing, NULL);
    if (closing == NULL)
        return -1;
    int is_closing = PyObject_IsTrue(closing);
    Py_DECREF(closing);
    if (is_closing != 0)
        return is_closing < 0 ? -1 : 0;
    return 1;
}

/* The Python writer's write of the events: `*list` is them as a list, made here (for the
 * caller to drop) if it is NULL. */
static PyObject *
sse_fall_back(SSEWriter *self, PyObject *const *events, Py_ssize_t count, PyObject **list)
{
    if (*list == NULL && (*list = list_of(events, count)) == NULL)
        return NULL;
    return PyObject_Vectorcall(self->fallback, list, 1, NULL);
}

/* The write of `count` events: the SSEWriter's call, and stream_add's for a reader's batch
 * it holds in an array (`*list` NULL: no list of them made, unless the fallback takes it).
 * `line_free`, unless NULL: bytes known to hold no CR or LF (a read's payloads, as cut); an
 * event whose data is the same object is not searched for line ends again. */
static PyObject *
sse_write(SSEWriter *self, PyObject *const *events, Py_ssize_t count, PyObject **list,
          PyObject *const *line_free)
{
    if (count == 0 || count > MAX_EVENTS)
        return sse_fall_back(self, events, count, list);
    PyObject *datas[MAX_EVENTS];
    long long seqs[MAX_EVENTS];
    Py_ssize_t body = 0;
    Py_ssize_t i;
    for (i = 0; i < count; i++) {
        PyObject *event = events[i];
        PyObject *seq = slot_get(event, &event_seq);
        if (seq == NULL)
            goto fail;
        seqs[i] = PyLong_AsLongLong(seq);
        Py_DECREF(seq);
        if (seqs[i] == -1 && PyErr_Occurred())
            goto fail;
        datas[i] = slot_get(event, &event_data);
        if (datas[i] == NULL)
            goto fail;
        if (!PyBytes_CheckExact(datas[i])) {
            i++;
            goto fall_back;
        }
        const char *d = PyBytes_AS_STRING(datas[i]);
        Py_ssize_t n = PyBytes_GET_SIZE(datas[i]);
        if ((line_free == NULL || line_free[i] != datas[i]) &&
            (memchr(d, '\n', (size_t)n) || memchr(d, '\r', (size_t)n))) {
            i++;
            goto fall_back; /* several lines, or a named event: the Python framer */
        }
        body += 4 + decimal_digits(seqs[i]) + 7 + n + 2; /* "id: " SEQ "\ndata: " DATA "\n\n" */
    }
    int ok = writable(self);
    if (ok <= 0) {
        for (Py_ssize_t j = 0; j < count; j++)
            Py_DECREF(datas[j]);
        if (ok < 0)
            return NULL;
        Py_RETURN_FALSE;
    }
    /* One HTTP chunk: "%x\r\n" body "\r\n", as uvicorn_writer frames it, made at its size. */
    int head_len = hex_digits((size_t)body) + 2;
    PyObject *part = PyBytes_FromStringAndSize(NULL, head_len + body + 2);
    if (part == NULL) {
        i = count;
        goto fail;
    }
    char *p = write_hex(PyBytes_AS_STRING(part), (size_t)body);
    *p++ = '\r';
    *p++ = '\n';
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
    *p++ = '\r';
    *p++ = '\n';
    PyObject *written = method_call(&self->write, self->transport, s_write, part);
    Py_DECREF(part);
    if (written == NULL) {
        /* whatever a dying transport raises: its reader's send will say (uvicorn_writer) */
        if (!PyErr_ExceptionMatches(PyExc_Exception))
            return NULL;
        PyErr_Clear();
        Py_RETURN_FALSE;
    }
    Py_DECREF(written);
    if (add_to_attr(self->framer, &framer_direct, count) < 0)
        return NULL;
    Py_RETURN_TRUE;

fall_back:
    for (Py_ssize_t j = 0; j < i; j++)
        Py_DECREF(datas[j]);
    return sse_fall_back(self, events, count, list);
fail:
    for (Py_ssize_t j = 0; j < i; j++)
        Py_XDECREF(datas[j]);
    return NULL;
}

static PyObject *
SSEWriter_vectorcall(PyObject *callable, PyObject *const *args, size_t nargsf, PyObject *kwnames)
{
    if (PyVectorcall_NARGS(nargsf) != 1 || kwnames != NULL || !PyList_CheckExact(args[0])) {
        PyErr_SetString(PyExc_TypeError, "SSEWriter takes one argument: a list of events");
        return NULL;
    }
    PyObject *list = args[0]; /* borrowed: sse_write makes none where it is given one */
    return sse_write((SSEWriter *)callable, PySequence_Fast_ITEMS(list), PyList_GET_SIZE(list),
                     &list, NULL);
}

static PyObject *
SSEWriter_make(PyTypeObject *type, PyObject *cycle, PyObject *framer, PyObject *fallback)
{
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
    method_find(&self->write, transport, s_write);
    method_find(&self->is_closing, transport, s_is_closing);
    self->vectorcall = SSEWriter_vectorcall;
    return (PyObject *)self;
}

static PyObject *
SSEWriter_new(PyTypeObject *type, PyObject *args, PyObject *kwds)
{
    static char *kwlist[] = {"cycle", "framer", "fallback", NULL};
    PyObject *cycle, *framer, *fallback;
    if (!PyArg_ParseTupleAndKeywords(args, kwds, "OOO:SSEWriter", kwlist, &cycle, &framer,
                                     &fallback))
        return NULL;
    return SSEWriter_make(type, cycle, framer, fallback);
}

/* SSEWriter(cycle, framer, fallback) as the reader calls it, once a request: three
 * positional arguments without PyArg_ParseTupleAndKeywords; any other call through
 * SSEWriter_new (ReadPath_type_vectorcall's way). */
static PyObject *
SSEWriter_type_vectorcall(PyObject *type, PyObject *const *args, size_t nargsf,
                          PyObject *kwnames)
{
    if (PyVectorcall_NARGS(nargsf) == 3 && (kwnames == NULL || !PyTuple_GET_SIZE(kwnames)))
        return SSEWriter_make((PyTypeObject *)type, args[0], args[1], args[2]);
    return new_from_vectorcall(SSEWriter_new, type, args, nargsf, kwnames);
}

static PyTypeObject SSEWriterType = {
    PyVarObject_HEAD_INIT(NULL, 0)
    .tp_name = "firstbyte.router._chunkpath.SSEWriter",
    .tp_doc = "SSEWriter(cycle, framer, fallback)(events) -> bool: write events as SSE on "
              "uvicorn's request cycle if it can take them now.",
    .tp_basicsize = sizeof(SSEWriter),
    .tp_flags = Py_TPFLAGS_DEFAULT | Py_TPFLAGS_HAVE_GC | Py_TPFLAGS_HAVE_VECTORCALL,
    .tp_new = SSEWriter_new,
    .tp_vectorcall = SSEWriter_type_vectorcall,
    .tp_dealloc = (destructor)SSEWriter_dealloc,
    .tp_traverse = (traverseproc)SSEWriter_traverse,
    .tp_clear = (inquiry)SSEWriter_clear,
    .tp_vectorcall_offset = offsetof(SSEWriter, vectorcall),
    .tp_call = PyVectorcall_Call,
};

/* ---------------------------------------------------------------- sse_frames
 *
 * A reader's batch from the store (readers.py, SSEFramer.frame): `id: SEQ\ndata: DATA\n\n`
 * per event, what encode_event(data, id=seq) makes of an event without a line end, in one
 * call instead of two Python calls and four joins an event. None for any other batch (an
 * event whose data has a line end or is not bytes, a sequence number that is not an int
 * of at least 0): the Python framer frames it. */

static PyObject *
sse_frames(PyObject *module, PyObject *events)
{
    if (!PyList_CheckExact(events)) {
        PyErr_SetString(PyExc_TypeError, "sse_frames() takes a list of events");
        return NULL;
    }
    Py_ssize_t count = PyList_GET_SIZE(events);
    PyObject *local[MAX_EVENTS];
    long long local_seqs[MAX_EVENTS];
    PyObject **datas = local;
    long long *seqs = local_seqs;
    if (count > MAX_EVENTS) {
        datas = PyMem_Malloc((size_t)count * sizeof(PyObject *));
        seqs = PyMem_Malloc((size_t)count * sizeof(long long));
        if (datas == NULL || seqs == NULL) {
            PyMem_Free(datas);
            PyMem_Free(seqs);
            return PyErr_NoMemory();
        }
    }
    PyObject *result = NULL;
    Py_ssize_t held = 0, body = 0;
    for (; held < count; held++) {
        PyObject *event = PyList_GET_ITEM(events, held);
        PyObject *seq = slot_get(event, &event_seq);
        if (seq == NULL)
            goto out;
        int overflow = 0;
        seqs[held] = PyLong_CheckExact(seq) ? PyLong_AsLongLongAndOverflow(seq, &overflow) : -1;
        Py_DECREF(seq);
        if (seqs[held] == -1 && PyErr_Occurred())
            goto out;
        if (overflow || seqs[held] < 0) {
            result = Py_NewRef(Py_None);
            goto out;
        }
        PyObject *data = slot_get(event, &event_data);
        if (data == NULL)
            goto out;
        datas[held] = data;
        if (!PyBytes_CheckExact(data)) {
            held++;
            result = Py_NewRef(Py_None);
            goto out;
        }
        const char *d = PyBytes_AS_STRING(data);
        Py_ssize_t n = PyBytes_GET_SIZE(data);
        if (memchr(d, '\n', (size_t)n) || memchr(d, '\r', (size_t)n)) {
            held++;
            result = Py_NewRef(Py_None);
            goto out;
        }
        long long width = 1;
        for (long long rest = seqs[held] / 10; rest; rest /= 10)
            width++;
        body += n + width + 13; /* "id: " SEQ "\ndata: " DATA "\n\n" */
    }
    result = PyBytes_FromStringAndSize(NULL, body);
    if (result == NULL)
        goto out;
    char *p = PyBytes_AS_STRING(result);
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
    }
out:
    for (Py_ssize_t j = 0; j < held; j++)
        Py_DECREF(datas[j]);
    if (datas != local) {
        PyMem_Free(datas);
        PyMem_Free(seqs);
    }
    return result;
}

/* ---------------------------------------------------------------- Mirror
 *
 * A shared stream's mirror (Stream.mirror, called with every event the stream gets, by
 * stream_add above and by Stream.append): (stream, event) appended to the Redis writer's
 * queue, and `first()` called when the queue was empty (the writer wakes), as
 * _Writer.push does in Python, without a Python call per event. */

typedef struct {
    PyObject_HEAD
    PyObject *queue; /* list */
    PyObject *first;
    vectorcallfunc vectorcall;
} Mirror;

static PyObject *
Mirror_vectorcall(PyObject *op, PyObject *const *args, size_t nargsf, PyObject *kwnames)
{
    Mirror *self = (Mirror *)op;
    if (PyVectorcall_NARGS(nargsf) != 2 || (kwnames != NULL && PyTuple_GET_SIZE(kwnames))) {
        PyErr_SetString(PyExc_TypeError, "Mirror takes (stream, event)");
        return NULL;
    }
    PyObject *item = PyTuple_Pack(2, args[0], args[1]);
    if (item == NULL)
        return NULL;
    int failed = PyList_Append(self->queue, item);
    Py_DECREF(item);
    if (failed)
        return NULL;
    if (PyList_GET_SIZE(self->queue) == 1)
        return PyObject_CallNoArgs(self->first);
    Py_RETURN_NONE;
}

static int
Mirror_traverse(Mirror *self, visitproc visit, void *arg)
{
    Py_VISIT(self->queue);
    Py_VISIT(self->first);
    return 0;
}

static int
Mirror_clear(Mirror *self)
{
    Py_CLEAR(self->queue);
    Py_CLEAR(self->first);
    return 0;
}

static void
Mirror_dealloc(Mirror *self)
{
    PyObject_GC_UnTrack(self);
    Mirror_clear(self);
    Py_TYPE(self)->tp_free((PyObject *)self);
}

static PyObject *
Mirror_new(PyTypeObject *type, PyObject *args, PyObject *kwds)
{
    PyObject *queue, *first;
    static char *names[] = {"queue", "first", NULL};
    if (!PyArg_ParseTupleAndKeywords(args, kwds, "O!O:Mirror", names, &PyList_Type, &queue,
                                     &first))
        return NULL;
    if (!PyCallable_Check(first)) {
        PyErr_SetString(PyExc_TypeError, "Mirror: first must be callable");
        return NULL;
    }
    Mirror *self = (Mirror *)type->tp_alloc(type, 0);
    if (self == NULL)
        return NULL;
    self->queue = Py_NewRef(queue);
    self->first = Py_NewRef(first);
    self->vectorcall = Mirror_vectorcall;
    return (PyObject *)self;
}

static PyTypeObject MirrorType = {
    PyVarObject_HEAD_INIT(NULL, 0)
    .tp_name = "firstbyte.router._chunkpath.Mirror",
    .tp_doc = "Mirror(queue, first)(stream, event): queue.append((stream, event)); first() "
              "if the queue was empty.",
    .tp_basicsize = sizeof(Mirror),
    .tp_flags = Py_TPFLAGS_DEFAULT | Py_TPFLAGS_HAVE_GC | Py_TPFLAGS_HAVE_VECTORCALL,
    .tp_new = Mirror_new,
    .tp_dealloc = (destructor)Mirror_dealloc,
    .tp_traverse = (traverseproc)Mirror_traverse,
    .tp_clear = (inquiry)Mirror_clear,
    .tp_vectorcall_offset = offsetof(Mirror, vectorcall),
    .tp_call = PyVectorcall_Call,
};

/* ---------------------------------------------------------------- pack_xadds
 *
 * With shared state every relayed event is packed into the Redis writer's next script call
 * (router/shared/streams.py, _Writer._pack): the event's key, a RESP bulk string kept per
 * stream id, and its three arguments, "X" for a stream's first event ("y" for each
 * `every`-th after, whose XADD bounds the stream's length; "x" for the others), the entry
 * id "SEQ-0" and the payload. ~2 us an event in Python under load, a sixth of what Redis
 * mode adds to a relayed chunk. */

typedef struct {
    char *bytes;
    Py_ssize_t size, room;
} Buffer;

/* Append `size` bytes; 0, or -1 with MemoryError. */
static int
buffer_add(Buffer *buffer, const char *bytes, Py_ssize_t size)
{
    if (buffer->size + size > buffer->room) {
        Py_ssize_t room = (buffer->room ? buffer->room : 4096);
        while (room < buffer->size + size)
            room *= 2;
        char *grown = PyMem_Realloc(buffer->bytes, room);
        if (grown == NULL) {
            PyErr_NoMemory();
            return -1;
        }
        buffer->bytes = grown;
        buffer->room = room;
    }
    memcpy(buffer->bytes + buffer->size, bytes, size);
    buffer->size += size;
    return 0;
}

/* pack_xadds(batch, start, limit, names, name_of, trim, done, every)
 *     -> (end, names_packed, values_packed, streams)
 *
 * From batch[start] (a list of (stream, event) tuples), at most `limit` plain events: each
 * event's key from `names` (a dict by stream id; `name_of(stream_id)` makes and adds a
 * missing one) appended to `names_packed`, its arguments to `values_packed`, its stream to
 * `streams`. Stops before anything else (an event that is None, `trim`, or whose data is
 * `done` or not bytes, an entry id beyond 64 bits); `end` is where it stopped. */
static PyObject *
pack_xadds(PyObject *module, PyObject *const *args, Py_ssize_t nargs)
{
    if (nargs != 8) {
        PyErr_SetString(PyExc_TypeError, "pack_xadds() takes 8 arguments");
        return NULL;
    }
    PyObject *batch = args[0], *names = args[3], *name_of = args[4], *trim = args[5],
             *done = args[6];
    if (!PyList_CheckExact(batch) || !PyDict_CheckExact(names) || !PyBytes_CheckExact(done)) {
        PyErr_SetString(PyExc_TypeError, "pack_xadds(list, int, int, dict, callable, ?, bytes)");
        return NULL;
    }
    Py_ssize_t start = PyLong_AsSsize_t(args[1]);
    Py_ssize_t limit = PyLong_AsSsize_t(args[2]);
    Py_ssize_t every = PyLong_AsSsize_t(args[7]);
    if ((start == -1 || limit == -1 || every == -1) && PyErr_Occurred())
        return NULL;
    if (every < 1) {
        PyErr_SetString(PyExc_ValueError, "pack_xadds(): every must be at least 1");
        return NULL;
    }
    PyObject *streams = PyList_New(0);
    if (streams == NULL)
        return NULL;
    Buffer keys = {NULL, 0, 0}, values = {NULL, 0, 0};
    Py_ssize_t end = start < 0 ? 0 : start, count = PyList_GET_SIZE(batch);
    for (; end < count && end - start < limit; end++) {
        PyObject *item = PyList_GET_ITEM(batch, end);
        if (!PyTuple_CheckExact(item) || PyTuple_GET_SIZE(item) != 2)
            break;
        PyObject *stream = PyTuple_GET_ITEM(item, 0), *event = PyTuple_GET_ITEM(item, 1);
        if (event == Py_None || event == trim)
            break;
        PyObject *data = slot_get(event, &event_data);
        if (data == NULL)
            goto error;
        Py_ssize_t size = PyBytes_CheckExact(data) ? PyBytes_GET_SIZE(data) : -1;
        int plain = size >= 0 && !(size == PyBytes_GET_SIZE(done) &&
                                   memcmp(PyBytes_AS_STRING(data), PyBytes_AS_STRING(done),
                                          size) == 0);
        if (!plain) {
            Py_DECREF(data);
            break;
        }
        PyObject *seq_object = slot_get(event, &event_seq);
        if (seq_object == NULL) {
            Py_DECREF(data);
            goto error;
        }
        int overflow = 0;
        long long seq = PyLong_Check(seq_object)
                            ? PyLong_AsLongLongAndOverflow(seq_object, &overflow)
                            : (overflow = 1, 0);
        Py_DECREF(seq_object);
        if (overflow || seq < 0 || (seq == -1 && PyErr_Occurred())) {
            PyErr_Clear();
            Py_DECREF(data);
            break; /* not an int the Python loop formats the same: it packs this one */
        }
        PyObject *id = slot_get(stream, &stream_id);
        if (id == NULL) {
            Py_DECREF(data);
            goto error;
        }
        PyObject *name = PyDict_GetItemWithError(names, id); /* borrowed */
        if (name != NULL) {
            Py_INCREF(name);
        } else if (!PyErr_Occurred()) {
            name = PyObject_CallOneArg(name_of, id);
            if (name != NULL && PyDict_SetItem(names, id, name) < 0)
                Py_CLEAR(name);
        }
        Py_DECREF(id);
        if (name == NULL) {
            Py_DECREF(data);
            goto error;
        }
        if (!PyBytes_CheckExact(name)) {
            Py_DECREF(name);
            Py_DECREF(data);
            PyErr_SetString(PyExc_TypeError, "name_of() must return bytes");
            goto error;
        }
        /* "$1\r\nX\r\n$<n>\r\n<seq>-0\r\n$<size>\r\n" (snprintf was half this loop's time) */
        char entry[32], head[96];
        char *entry_end = write_decimal(entry, seq);
        memcpy(entry_end, "-0", 2);
        Py_ssize_t entry_size = entry_end + 2 - entry;
        char *p = head;
        memcpy(p, seq == 1           ? "$1\r\nX\r\n$"
                  : seq % every == 0 ? "$1\r\ny\r\n$"
                                     : "$1\r\nx\r\n$",
               8);
        p = write_decimal(p + 8, entry_size);
        memcpy(p, "\r\n", 2);
        memcpy(p + 2, entry, entry_size);
        p += 2 + entry_size;
        memcpy(p, "\r\n$", 3);
        p = write_decimal(p + 3, size);
        memcpy(p, "\r\n", 2);
        Py_ssize_t head_size = p + 2 - head;
        int failed = buffer_add(&keys, PyBytes_AS_STRING(name), PyBytes_GET_SIZE(name)) < 0 ||
                     buffer_add(&values, head, head_size) < 0 ||
                     buffer_add(&values, PyBytes_AS_STRING(data), size) < 0 ||
                     buffer_add(&values, "\r\n", 2) < 0 || PyList_Append(streams, stream) < 0;
        Py_DECREF(name);
        Py_DECREF(data);
        if (failed)
            goto error;
    }
    PyObject *result = Py_BuildValue("(ny#y#N)", end, keys.bytes ? keys.bytes : "", keys.size,
                                     values.bytes ? values.bytes : "", values.size, streams);
    PyMem_Free(keys.bytes);
    PyMem_Free(values.bytes);
    return result;
error:
    PyMem_Free(keys.bytes);
    PyMem_Free(values.bytes);
    Py_DECREF(streams);
    return NULL;
}

/* ---------------------------------------------------------------- HTTP/1.1 heads
 *
 * Once a request, not a chunk, the work on its headers that the Python did a header at a time
 * in a loop (~7-16k instructions each, ~1-1.5k here): the request's header names decoded
 * (router/asgi.py, header_dict), the response's encoded (asgi.py, _encode_headers) and its
 * head written as uvicorn's HTTP/1.1 writes it (router/hosting/uvicorn_send.py, _render).
 * Each takes only what its Python function takes in the same way, names it already knows
 * and values of exact types in lists or tuples of pairs, and returns None for anything else,
 * having changed nothing: the Python, which stays the one definition, then does its work
 * (learns a new name, raises its error, leaves the head to uvicorn's send). So either gives
 * the same result (tests/router/hosting/test_uvicorn_send.py, tests/router/test_asgi.py). */

/* The size of `seq`, an exact list or tuple: read again at each step, as a list's iterator
 * does (a lookup below may run Python code, an __eq__, which may change a list). */
static inline Py_ssize_t
pairs_size(PyObject *seq)
{
    return PyList_CheckExact(seq) ? PyList_GET_SIZE(seq) : PyTuple_GET_SIZE(seq);
}

/* Item `i` of `seq`, an exact list or tuple, `i` below pairs_size(seq): a new reference. */
static inline PyObject *
pairs_item(PyObject *seq, Py_ssize_t i)
{
    return Py_NewRef(PyList_CheckExact(seq) ? PyList_GET_ITEM(seq, i) : PyTuple_GET_ITEM(seq, i));
}

/* An exact list or tuple. */
static inline int
pairs_ok(PyObject *seq)
{
    return PyList_CheckExact(seq) || PyTuple_CheckExact(seq);
}

/* An exact 2-tuple of two objects of exact type `type`. */
static inline int
pair_of(PyObject *pair, PyTypeObject *type)
{
    return PyTuple_CheckExact(pair) && PyTuple_GET_SIZE(pair) == 2 &&
           Py_IS_TYPE(PyTuple_GET_ITEM(pair, 0), type) &&
           Py_IS_TYPE(PyTuple_GET_ITEM(pair, 1), type);
}

#define HEAD_LISTS 2
#define MAX_HEAD_LINES 64 /* more header lines than this: the Python's */

/* render_head(status_line, defaults, headers, names, refused, tail, first) -> bytes | None:
 * status_line, then a line "START VALUE\r\n" for each (name, value) of `defaults` and then of
 * `headers`, START being names[name] (the name as sent, then ": "), then `tail`, then, if
 * `first` is not empty, `first` as a chunk of the chunked coding. None (nothing made) if a
 * list is not an exact list or tuple of exact 2-tuples of bytes, a name is not in `names`,
 * a value holds a byte whose entry in `refused` (256 bytes) is not zero, there are more than
 * MAX_HEAD_LINES lines, or `first` is not None or bytes. */
static PyObject *
render_head(PyObject *module, PyObject *const *args, Py_ssize_t nargs)
{
    if (nargs != 7) {
        PyErr_SetString(PyExc_TypeError, "render_head takes 7 arguments");
        return NULL;
    }
    PyObject *status_line = args[0], *names = args[3], *refused = args[4], *tail = args[5],
             *first = args[6];
    if (!PyBytes_CheckExact(status_line) || !PyDict_CheckExact(names) ||
        !PyBytes_CheckExact(refused) || PyBytes_GET_SIZE(refused) != 256 ||
        !PyBytes_CheckExact(tail)) {
        PyErr_SetString(PyExc_TypeError, "render_head: bytes, _, _, dict, 256 bytes, bytes, _");
        return NULL;
    }
    Py_ssize_t first_size = 0;
    if (first != Py_None) {
        if (!PyBytes_Check(first))
            Py_RETURN_NONE;
        first_size = PyBytes_GET_SIZE(first);
    }
    const unsigned char *bad = (const unsigned char *)PyBytes_AS_STRING(refused);
    PyObject *pairs[MAX_HEAD_LINES], *starts[MAX_HEAD_LINES]; /* held until the end */
    Py_ssize_t lines = 0;
    Py_ssize_t size = PyBytes_GET_SIZE(status_line) + PyBytes_GET_SIZE(tail);
    PyObject *head = Py_None; /* None unless made */
    for (int l = 0; l < HEAD_LISTS; l++) {
        PyObject *seq = args[1 + l];
        if (!pairs_ok(seq))
            goto done;
        for (Py_ssize_t i = 0; i < pairs_size(seq); i++) {
            if (lines == MAX_HEAD_LINES)
                goto done;
            PyObject *pair = pairs_item(seq, i);
            if (!pair_of(pair, &PyBytes_Type)) {
                Py_DECREF(pair);
                goto done;
            }
            PyObject *start = PyDict_GetItemWithError(names, PyTuple_GET_ITEM(pair, 0));
            if (start == NULL || !PyBytes_CheckExact(start)) {
                Py_DECREF(pair);
                if (PyErr_Occurred())
                    head = NULL;
                goto done; /* a name not learnt yet (or refused): the Python's */
            }
            pairs[lines] = pair;
            starts[lines++] = Py_NewRef(start);
            PyObject *value = PyTuple_GET_ITEM(pair, 1);
            const unsigned char *v = (const unsigned char *)PyBytes_AS_STRING(value);
            Py_ssize_t n = PyBytes_GET_SIZE(value);
            for (Py_ssize_t j = 0; j < n; j++)
                if (bad[v[j]])
                    goto done;
            size += PyBytes_GET_SIZE(start) + n + 2;
        }
    }
    char size_line[24];
    int size_line_len = 0;
    if (first_size) {
        size_line_len = (int)(write_hex(size_line, (size_t)first_size) - size_line);
        size_line[size_line_len++] = '\r';
        size_line[size_line_len++] = '\n';
        size += size_line_len + first_size + 2;
    }
    head = PyBytes_FromStringAndSize(NULL, size);
    if (head == NULL)
        goto done;
    char *p = PyBytes_AS_STRING(head);
    memcpy(p, PyBytes_AS_STRING(status_line), PyBytes_GET_SIZE(status_line));
    p += PyBytes_GET_SIZE(status_line);
    for (Py_ssize_t i = 0; i < lines; i++) {
        PyObject *value = PyTuple_GET_ITEM(pairs[i], 1);
        memcpy(p, PyBytes_AS_STRING(starts[i]), PyBytes_GET_SIZE(starts[i]));
        p += PyBytes_GET_SIZE(starts[i]);
        memcpy(p, PyBytes_AS_STRING(value), PyBytes_GET_SIZE(value));
        p += PyBytes_GET_SIZE(value);
        *p++ = '\r';
        *p++ = '\n';
    }
    memcpy(p, PyBytes_AS_STRING(tail), PyBytes_GET_SIZE(tail));
    p += PyBytes_GET_SIZE(tail);
    if (first_size) {
        memcpy(p, size_line, size_line_len);
        p += size_line_len;
        memcpy(p, PyBytes_AS_STRING(first), first_size);
        p += first_size;
        *p++ = '\r';
        *p++ = '\n';
    }
done:
    for (Py_ssize_t i = 0; i < lines; i++) {
        Py_DECREF(pairs[i]);
        Py_DECREF(starts[i]);
    }
    return head == Py_None ? Py_NewRef(Py_None) : head;
}

/* encode_headers(encoded, headers, names) -> list | None: the pairs of `encoded`, then for
 * each (name, value) of `headers` (str) the pair (names[name], value in latin-1). None
 * (nothing made) if `encoded` or `headers` is not an exact list or tuple, a header not an
 * exact 2-tuple of str, its name not in `names`, or its value not latin-1. */
static PyObject *
encode_headers(PyObject *module, PyObject *const *args, Py_ssize_t nargs)
{
    if (nargs != 3 || !PyDict_CheckExact(args[2])) {
        PyErr_SetString(PyExc_TypeError, "encode_headers(encoded, headers, names: dict)");
        return NULL;
    }
    PyObject *encoded = args[0], *headers = args[1], *names = args[2];
    if (!pairs_ok(encoded) || !pairs_ok(headers))
        Py_RETURN_NONE;
    PyObject *out = PyList_New(0);
    if (out == NULL)
        return NULL;
    for (Py_ssize_t i = 0; i < pairs_size(encoded); i++) {
        PyObject *item = pairs_item(encoded, i);
        int failed = PyList_Append(out, item);
        Py_DECREF(item);
        if (failed < 0)
            goto error;
    }
    for (Py_ssize_t i = 0; i < pairs_size(headers); i++) {
        PyObject *pair = pairs_item(headers, i);
        if (!pair_of(pair, &PyUnicode_Type)) {
            Py_DECREF(pair);
            goto none;
        }
        PyObject *name = PyDict_GetItemWithError(names, PyTuple_GET_ITEM(pair, 0));
        if (name == NULL) {
            Py_DECREF(pair);
            if (PyErr_Occurred())
                goto error;
            goto none; /* a name not seen yet: the Python's */
        }
        Py_INCREF(name);
        PyObject *value = PyUnicode_AsLatin1String(PyTuple_GET_ITEM(pair, 1));
        Py_DECREF(pair);
        if (value == NULL) {
            Py_DECREF(name);
            if (!PyErr_ExceptionMatches(PyExc_UnicodeEncodeError))
                goto error;
            PyErr_Clear();
            goto none; /* the Python raises it */
        }
        PyObject *made = PyTuple_New(2);
        if (made == NULL) {
            Py_DECREF(name);
            Py_DECREF(value);
            goto error;
        }
        PyTuple_SET_ITEM(made, 0, name);
        PyTuple_SET_ITEM(made, 1, value);
        int failed = PyList_Append(out, made);
        Py_DECREF(made);
        if (failed < 0)
            goto error;
    }
    return out;
none:
    Py_DECREF(out);
    Py_RETURN_NONE;
error:
    Py_DECREF(out);
    return NULL;
}

/* receive_now(receive) -> message | (steps, yielded): `receive()` begun, as router/asgi.py's
 * receive_now begins it: its return value if its first step returned, else its `__await__`
 * iterator and what that first step yielded. A coroutine (every server's receive() here) is
 * stepped with PyIter_Send, which returns its value with no StopIteration made and caught;
 * any other awaitable as `next(awaitable.__await__())`, with its errors. */
static PyObject *
receive_now(PyObject *module, PyObject *receive)
{
    PyObject *awaitable = PyObject_CallNoArgs(receive);
    if (awaitable == NULL)
        return NULL;
    PyObject *steps, *result = NULL;
    if (PyCoro_CheckExact(awaitable)) {
        PySendResult sent = PyIter_Send(awaitable, Py_None, &result);
        if (sent == PYGEN_RETURN) {
            Py_DECREF(awaitable);
            return result;
        }
        if (sent == PYGEN_ERROR) {
            Py_DECREF(awaitable);
            return NULL;
        }
        /* it waits: the rest through its __await__ iterator, as the Python function has it */
        steps = Py_TYPE(awaitable)->tp_as_async->am_await(awaitable);
        Py_DECREF(awaitable);
        if (steps == NULL) {
            Py_DECREF(result);
            return NULL;
        }
    }
    else {
        steps = PyObject_CallMethod(awaitable, "__await__", NULL);
        Py_DECREF(awaitable);
        if (steps == NULL)
            return NULL;
        if (!PyIter_Check(steps)) {
            PyErr_Format(PyExc_TypeError, "'%.200s' object is not an iterator",
                         Py_TYPE(steps)->tp_name);
            Py_DECREF(steps);
            return NULL;
        }
        result = Py_TYPE(steps)->tp_iternext(steps);
        if (result == NULL) {
            Py_DECREF(steps);
            /* answered without waiting: StopIteration's value (None if none) */
            if (!PyErr_Occurred())
                Py_RETURN_NONE;
            if (!PyErr_ExceptionMatches(PyExc_StopIteration))
                return NULL;
            PyObject *type, *value, *traceback;
            PyErr_Fetch(&type, &value, &traceback);
            PyErr_NormalizeException(&type, &value, &traceback);
            PyObject *answered = value == NULL ? NULL : PyObject_GetAttrString(value, "value");
            Py_XDECREF(type);
            Py_XDECREF(value);
            Py_XDECREF(traceback);
            return answered;
        }
    }
    PyObject *started = PyTuple_Pack(2, steps, result);
    Py_DECREF(steps);
    Py_DECREF(result);
    return started;
}

/* decode_headers(headers, names) -> dict | None: for each (name, value) of `headers` (bytes),
 * names[name] -> the value decoded from latin-1, in order (the last of a repeated name wins).
 * None (nothing made) if `headers` is not an exact list or tuple, a header not an exact
 * 2-tuple of bytes, or its name not in `names`. */
static PyObject *
decode_headers(PyObject *module, PyObject *const *args, Py_ssize_t nargs)
{
    if (nargs != 2 || !PyDict_CheckExact(args[1])) {
        PyErr_SetString(PyExc_TypeError, "decode_headers(headers, names: dict)");
        return NULL;
    }
    PyObject *headers = args[0], *names = args[1];
    if (!pairs_ok(headers))
        Py_RETURN_NONE;
    PyObject *out = PyDict_New();
    if (out == NULL)
        return NULL;
    for (Py_ssize_t i = 0; i < pairs_size(headers); i++) {
        PyObject *pair = pairs_item(headers, i);
        if (!pair_of(pair, &PyBytes_Type)) {
            Py_DECREF(pair);
            goto none;
        }
        PyObject *name = PyDict_GetItemWithError(names, PyTuple_GET_ITEM(pair, 0));
        if (name == NULL) {
            Py_DECREF(pair);
            if (PyErr_Occurred())
                goto error;
            goto none; /* a name not seen yet: the Python's */
        }
        Py_INCREF(name);
        PyObject *raw = PyTuple_GET_ITEM(pair, 1);
        PyObject *value = PyUnicode_DecodeLatin1(PyBytes_AS_STRING(raw), PyBytes_GET_SIZE(raw),
                                                 NULL);
        Py_DECREF(pair);
        int failed = value == NULL || PyDict_SetItem(out, name, value) < 0;
        Py_DECREF(name);
        Py_XDECREF(value);
        if (failed)
            goto error;
    }
    return out;
none:
    Py_DECREF(out);
    Py_RETURN_NONE;
error:
    Py_DECREF(out);
    return NULL;
}

/* ---------------------------------------------------------------- access line */

/* round(value, 2) as access.py's hundredths shortcut takes it: 1 and the float (a whole
 * number of hundredths, exactly) where value * 100 is in (0, 1e11) and its fraction clear of
 * a half by 1e-4; 0 where only round() itself can say. */
static inline int
hundredths_shortcut(double value, double *hundredths)
{
    double scaled = value * 100;
    if (0.0 < scaled && scaled < 1e11) {
        double fraction = fmod(scaled, 1.0);
        if (fraction < 0.4999) {
            *hundredths = scaled - fraction;
            return 1;
        }
        if (fraction > 0.5001) {
            *hundredths = scaled - fraction + 1;
            return 1;
        }
    }
    return 0;
}

/* elapsed_ms(end, start) -> float | None: round((end - start) * 1000, 2), the access line's
 * ttft_ms and duration_ms (router/observability/access.py, hundredths), for two exact floats
 * where hundredths' shortcut answers; None otherwise (the Python does it, round() included).
 * The same double operations in the same order as the Python's (no multiply feeds an add:
 * nothing for the compiler to fuse), so the same float. */
static PyObject *
elapsed_ms(PyObject *module, PyObject *const *args, Py_ssize_t nargs)
{
    double hundredths;
    if (nargs != 2 || !PyFloat_CheckExact(args[0]) || !PyFloat_CheckExact(args[1]))
        Py_RETURN_NONE;
    if (hundredths_shortcut((PyFloat_AS_DOUBLE(args[0]) - PyFloat_AS_DOUBLE(args[1])) * 1000,
                            &hundredths))
        return PyFloat_FromDouble(hundredths / 100);
    Py_RETURN_NONE;
}

/* hundredths_text(value) -> str | None: format(value, ".2f") (a Server-Timing duration,
 * router/pipeline/context.py), for an exact float where hundredths' shortcut answers: ".2f"
 * is the exact value rounded to two places, the integer that shortcut finds (value * 100
 * is off the exact product by less than the 1e-4 it keeps from a half), written as its
 * hundreds, a point and its last two digits. None otherwise (format() does it). */
static PyObject *
hundredths_text(PyObject *module, PyObject *value)
{
    double hundredths;
    if (!PyFloat_CheckExact(value) || !hundredths_shortcut(PyFloat_AS_DOUBLE(value), &hundredths))
        Py_RETURN_NONE;
    long long whole = (long long)hundredths; /* exact: a whole number below 1e11 */
    char text[24];
    char *end = text + sizeof(text), *at = end;
    *--at = (char)('0' + whole % 10);
    whole /= 10;
    *--at = (char)('0' + whole % 10);
    whole /= 10;
    *--at = '.';
    do {
        *--at = (char)('0' + whole % 10);
        whole /= 10;
    } while (whole);
    return PyUnicode_FromStringAndSize(at, end - at);
}

static PyMethodDef chunkpath_functions[] = {
    {"sse_frames", (PyCFunction)sse_frames, METH_O,
     "sse_frames(events) -> bytes | None: the SSE frames (`id: SEQ\\ndata: DATA\\n\\n`) of a "
     "batch of events without line ends, else None."},
    {"pack_xadds", (PyCFunction)(void (*)(void))pack_xadds, METH_FASTCALL,
     "pack_xadds(batch, start, limit, names, name_of, trim, done, every) -> (end, names_packed, "
     "values_packed, streams): the Redis writer's XADD operations for a run of plain events."},
    {"render_head", (PyCFunction)(void (*)(void))render_head, METH_FASTCALL,
     "render_head(status_line, defaults, headers, names, refused, tail, first) -> bytes | None:"
     " a response head as sent (router/hosting/uvicorn_send.py, _render), or None."},
    {"encode_headers", (PyCFunction)(void (*)(void))encode_headers, METH_FASTCALL,
     "encode_headers(encoded, headers, names) -> list | None: response headers in bytes"
     " (router/asgi.py, _encode_headers), or None."},
    {"receive_now", (PyCFunction)receive_now, METH_O,
     "receive_now(receive) -> message | (steps, yielded): receive() begun"
     " (router/asgi.py, receive_now)."},
    {"decode_headers", (PyCFunction)(void (*)(void))decode_headers, METH_FASTCALL,
     "decode_headers(headers, names) -> dict | None: request headers by their names"
     " (router/asgi.py, header_dict), or None."},
    {"elapsed_ms", (PyCFunction)(void (*)(void))elapsed_ms, METH_FASTCALL,
     "elapsed_ms(end, start) -> float | None: round((end - start) * 1000, 2) for two floats"
     " where router/observability/access.py's hundredths takes its shortcut, or None."},
    {"hundredths_text", (PyCFunction)hundredths_text, METH_O,
     "hundredths_text(value) -> str | None: format(value, '.2f') for a float where"
     " router/observability/access.py's hundredths takes its shortcut, or None."},
    {NULL, NULL, 0, NULL},
};

/* ---------------------------------------------------------------- module */

static struct PyModuleDef chunkpath_module = {
    PyModuleDef_HEAD_INIT,
    .m_name = "firstbyte.router._chunkpath",
    .m_doc = "The relay's per-chunk hot path, compiled (see router/chunkpath.py).",
    .m_size = -1,
    .m_methods = chunkpath_functions,
};

#define INTERN(var, text)                                                                      \
    if ((var = PyUnicode_InternFromString(text)) == NULL)                                      \
        return NULL;

PyMODINIT_FUNC
PyInit__chunkpath(void)
{
    INTERN(s_done, "done");
    INTERN(s_is_closing, "is_closing");
    INTERN(s_write, "write");
    INTERN(s_transport, "transport");
    INTERN(s_flow, "flow");
    INTERN(s_add, "add");
    INTERN(s_drop_released_taps, "_drop_released_taps");
    INTERN(s_wake, "_wake");
    INTERN(s_on_message_complete, "on_message_complete");
    INTERN(s_data_received, "_data_received");
    for (Slot *const *slot = all_slots; *slot != NULL; slot++)
        INTERN((*slot)->name, (*slot)->text);
    if (PyType_Ready(&ReadPathType) < 0 || PyType_Ready(&SSEWriterType) < 0 ||
        PyType_Ready(&MirrorType) < 0 || PyType_Ready(&StreamAdderType) < 0 ||
        PyType_Ready(&ConnReaderType) < 0)
        return NULL;
    PyObject *module = PyModule_Create(&chunkpath_module);
    if (module == NULL)
        return NULL;
    if (PyModule_AddObjectRef(module, "ReadPath", (PyObject *)&ReadPathType) < 0 ||
        PyModule_AddObjectRef(module, "SSEWriter", (PyObject *)&SSEWriterType) < 0 ||
        PyModule_AddObjectRef(module, "Mirror", (PyObject *)&MirrorType) < 0 ||
        PyModule_AddObjectRef(module, "StreamAdder", (PyObject *)&StreamAdderType) < 0 ||
        PyModule_AddObjectRef(module, "ConnReader", (PyObject *)&ConnReaderType) < 0) {
        Py_DECREF(module);
        return NULL;
    }
    return module;
}
