/* The prefill workers' windows in C: `worker_index.py`'s PrefillRoom, answer for answer.

   Loaded by `native_indexes.py` (compiled on first use, `kernels/native_build.py`). The Python
   PrefillRoom is the reference: `tests/unit/test_prefill_room_native.py` drives a registry on
   each with the same changes and asks both every question after each.

   Layout: a worker the room was given (`add`) lives in a slot (reused once `remove` frees it),
   found by its peer id, with its window (`PrefillWindow`'s figures), the prompts it holds
   (request id -> tokens * 2 + whether a batch line), its measured rate as of its last change,
   and which kinds of prompt it takes (small, big, bulk), kept in one dense list per kind.
   Per kind, one lazy heap per measured rate holds (tokens held, -room, peer id, slot, version)
   entries, the rates in the order their heaps were made (as the Python dict's keys). An entry
   is live while its slot holds the registration of that version, which takes the kind at that
   rate with those figures; a registration's changes all go through the room (`hold`,
   `release`, `rate_changed`), each pushing its entries afresh. A worker's live entries in one
   heap are equal, so a walk yields each worker once (the Python walk skips the same repeats).
   A heap is rebuilt from its live entries, one per worker, when it holds more than twice the
   kind's takers plus REBUILD_SLACK, as `lazy_heap.py`.

   Health (`WorkerState.making_progress`) is read from the worker (`busy`, `last_progress`) as a
   reader meets it. A walk handed out (`takers_by_load`) holds the room; it raises RuntimeError
   if the room changed since, instead of walking moved memory. The room holds WorkerStates and
   peer ids, none of which refer to it, and the walks refer to the room, never the reverse: no
   cycles, so neither type takes part in the cyclic GC. */

#define PY_SSIZE_T_CLEAN
#include <Python.h>
#include <stdint.h>
#include <string.h>

#include "native_common.h" /* slots, reading values, health, DEFINE_HEAP */

#define REBUILD_SLACK 64
#define NUM_KINDS 3 /* what a window may take: */
#define SMALL 0
#define BIG 1
#define BULK 2

/* -- entries ----------------------------------------------------------------------------------- */

typedef struct {
    int64_t held, neg_room;
    PyObject *peer_id; /* owned: ties order by peer id, as the Python tuples do */
    Py_ssize_t slot;
    uint64_t version;
} LoadEntry;

/* Peer ids are str (checked by `add`): PyUnicode_Compare cannot fail. */
static inline int load_less(const LoadEntry *a, const LoadEntry *b) {
    if (a->held != b->held) return a->held < b->held;
    if (a->neg_room != b->neg_room) return a->neg_room < b->neg_room;
    return a->peer_id != b->peer_id && PyUnicode_Compare(a->peer_id, b->peer_id) < 0;
}

DEFINE_HEAP(LoadHeap, LoadEntry, load_less)
DEFINE_WALK(LoadHeap, load_less)

typedef struct {
    double rate;
    LoadHeap heap;
} RateGroup;

typedef struct {
    RateGroup *groups; /* in the order they were made */
    Py_ssize_t len, cap;
    Py_ssize_t *takers; /* the slots taking this kind, in no order */
    Py_ssize_t num_takers, takers_cap;
} Kind;

typedef struct {
    PyObject *peer_id; /* owned; NULL: the slot is free */
    PyObject *worker;  /* owned: the WorkerState given to `add` */
    PyObject *held;    /* owned: request id -> tokens * 2 + bulk */
    uint64_t version;  /* of the registration: its entries carry it */
    double rate;       /* prefill tokens per second, as of its last change */
    int64_t num_big, num_big_bulk, small_tokens, held_tokens, bulk_tokens; /* the window */
    int takes[NUM_KINDS];
    Py_ssize_t taker_at[NUM_KINDS]; /* its place in each kind's takers */
    uint64_t kept;                  /* the rebuild that last kept one of its entries */
} Slot;

typedef struct {
    PyObject_HEAD
    int64_t window_tokens;
    double bulk_share;
    int64_t bulk_limit; /* int(window_tokens * bulk_share): small tokens a bulk taker holds less of */
    PyObject *slot_of;  /* peer id -> slot */
    Slot *slots;
    Py_ssize_t slots_cap, num_free;
    Py_ssize_t *free_slots;
    Kind kinds[NUM_KINDS];
    uint64_t versions, rebuilds;
    uint64_t changes; /* every change of any heap or group list: walks handed out check it */
} PrefillRoom;

static PyTypeObject PrefillRoomType, TakerWalkType;
static PyObject *str_peer_id, *str_prefill_tokens_per_s, *str_busy, *str_last_progress;

/* -- a window's rules (`PrefillWindow`) ------------------------------------------------------ */

static inline int is_big(PrefillRoom *self, int64_t num_tokens) {
    return num_tokens > self->window_tokens / 2; /* window_tokens > 0: floor division */
}

static inline int64_t small_room(PrefillRoom *self, Slot *s) {
    return self->window_tokens - s->small_tokens;
}

/* A big interactive prompt waits only for another big interactive one: the engine takes it
   before a batch line's (`PrefillWindow.takes`). */
static inline int takes_big(Slot *s) { return s->num_big - s->num_big_bulk <= 0; }

static int window_takes(PrefillRoom *self, Slot *s, int64_t num_tokens, int bulk) {
    if (bulk) return s->num_big <= 0 && s->small_tokens < self->bulk_limit;
    if (is_big(self, num_tokens)) return takes_big(s);
    return small_room(self, s) > 0;
}

static int kind_of(PrefillRoom *self, int64_t num_tokens, int bulk) {
    return bulk ? BULK : (is_big(self, num_tokens) ? BIG : SMALL);
}

/* -- reading a WorkerState ------------------------------------------------------------------- */

static int read_rate(PyObject *worker, double *rate) {
    PyObject *value = PyObject_GetAttr(worker, str_prefill_tokens_per_s);
    if (value == NULL) return -1;
    *rate = PyFloat_AsDouble(value);
    Py_DECREF(value);
    return (*rate == -1.0 && PyErr_Occurred()) ? -1 : 0;
}

/* A slot's health, the room checked unchanged by the read (see the top). */
static int healthy(PrefillRoom *self, Slot *s, double now, double timeout_s) {
    uint64_t before = self->changes;
    PyObject *worker = s->worker;
    Py_INCREF(worker);
    int answer = making_progress(worker, now, timeout_s, str_busy, str_last_progress);
    Py_DECREF(worker);
    if (answer >= 0 && self->changes != before) {
        PyErr_SetString(PyExc_RuntimeError, "the prefill room changed while it was read");
        return -1;
    }
    return answer;
}

/* -- liveness and lazy heaps ----------------------------------------------------------------- */

static inline int load_live(PrefillRoom *self, int kind, double rate, const LoadEntry *e) {
    Slot *s = &self->slots[e->slot];
    return s->peer_id != NULL && s->version == e->version && s->takes[kind] &&
           s->rate == rate && s->held_tokens == e->held && -small_room(self, s) == e->neg_room;
}

static void drop_entry(PrefillRoom *self, LoadHeap *h) {
    LoadEntry stale = LoadHeap_pop(h);
    Py_DECREF(stale.peer_id);
    self->changes++;
}

static LoadEntry *live_top(PrefillRoom *self, int kind, RateGroup *g) {
    while (g->heap.len > 0 && !load_live(self, kind, g->rate, &g->heap.data[0]))
        drop_entry(self, &g->heap);
    return g->heap.len > 0 ? &g->heap.data[0] : NULL;
}

static int load_push(PrefillRoom *self, int kind, RateGroup *g, LoadEntry e) {
    Py_INCREF(e.peer_id);
    if (LoadHeap_push(&g->heap, e) < 0) {
        Py_DECREF(e.peer_id);
        return -1;
    }
    self->changes++;
    LoadHeap *h = &g->heap;
    if (h->len > 2 * self->kinds[kind].num_takers + REBUILD_SLACK) {
        uint64_t rebuild = ++self->rebuilds;
        Py_ssize_t kept = 0;
        for (Py_ssize_t i = 0; i < h->len; i++) {
            Slot *s = &self->slots[h->data[i].slot];
            if (load_live(self, kind, g->rate, &h->data[i]) && s->kept != rebuild) {
                s->kept = rebuild;
                h->data[kept++] = h->data[i];
            } else {
                Py_DECREF(h->data[i].peer_id);
            }
        }
        h->len = kept;
        LoadHeap_heapify(h);
    }
    return 0;
}

/* The kind's heap for this rate, made (last in order) if there is none. */
static RateGroup *group_for(PrefillRoom *self, int kind, double rate) {
    Kind *k = &self->kinds[kind];
    for (Py_ssize_t i = 0; i < k->len; i++)
        if (k->groups[i].rate == rate) return &k->groups[i];
    if (k->len == k->cap) {
        Py_ssize_t cap = k->cap ? 2 * k->cap : 4;
        RateGroup *groups = PyMem_Realloc(k->groups, (size_t)cap * sizeof(RateGroup));
        if (groups == NULL) return PyErr_NoMemory(), NULL;
        k->groups = groups;
        k->cap = cap;
    }
    RateGroup *g = &k->groups[k->len++];
    memset(g, 0, sizeof(RateGroup));
    g->rate = rate;
    self->changes++;
    return g;
}

static void drop_group(PrefillRoom *self, int kind, Py_ssize_t index) {
    Kind *k = &self->kinds[kind];
    LoadHeap *h = &k->groups[index].heap;
    for (Py_ssize_t i = 0; i < h->len; i++) Py_DECREF(h->data[i].peer_id);
    PyMem_Free(h->data);
    memmove(&k->groups[index], &k->groups[index + 1],
            (size_t)(k->len - index - 1) * sizeof(RateGroup));
    k->len--;
    self->changes++;
}

/* -- takers ------------------------------------------------------------------------------------ */

static int set_taker(PrefillRoom *self, Py_ssize_t slot, int kind, int takes) {
    Slot *s = &self->slots[slot];
    Kind *k = &self->kinds[kind];
    if (takes == s->takes[kind]) return 0;
    if (takes) {
        if (k->num_takers == k->takers_cap) {
            Py_ssize_t cap = k->takers_cap ? 2 * k->takers_cap : 64;
            Py_ssize_t *takers = PyMem_Realloc(k->takers, (size_t)cap * sizeof(Py_ssize_t));
            if (takers == NULL) return PyErr_NoMemory(), -1;
            k->takers = takers;
            k->takers_cap = cap;
        }
        s->taker_at[kind] = k->num_takers;
        k->takers[k->num_takers++] = slot;
    } else { /* swapped with the last */
        Py_ssize_t at = s->taker_at[kind], last = k->takers[--k->num_takers];
        k->takers[at] = last;
        self->slots[last].taker_at[kind] = at;
    }
    s->takes[kind] = takes;
    return 0;
}

/* The worker's entries follow its window and rate (`PrefillRoom._sort`). */
static int sort(PrefillRoom *self, Py_ssize_t slot) {
    Slot *s = &self->slots[slot];
    int takes[NUM_KINDS] = {small_room(self, s) > 0, takes_big(s), window_takes(self, s, 0, 1)};
    for (int kind = 0; kind < NUM_KINDS; kind++) {
        if (set_taker(self, slot, kind, takes[kind]) < 0) return -1;
        if (!takes[kind]) continue;
        RateGroup *g = group_for(self, kind, s->rate);
        if (g == NULL) return -1;
        LoadEntry e = {s->held_tokens, -small_room(self, s), s->peer_id, slot, s->version};
        if (load_push(self, kind, g, e) < 0) return -1;
    }
    return 0;
}

/* -- slots ------------------------------------------------------------------------------------- */

/* The slot of a worker's peer id, or -1 (no error set) when the room has no such worker. */
static Py_ssize_t slot_of_worker(PrefillRoom *self, PyObject *worker) {
    PyObject *peer_id = PyObject_GetAttr(worker, str_peer_id);
    if (peer_id == NULL) return -1;
    Py_ssize_t slot = lookup_slot(self->slot_of, peer_id);
    Py_DECREF(peer_id);
    return slot;
}

static int free_slot(PrefillRoom *self, PyObject *peer_id) {
    Py_ssize_t slot = lookup_slot(self->slot_of, peer_id);
    if (slot < 0) return PyErr_Occurred() ? -1 : 0;
    for (int kind = 0; kind < NUM_KINDS; kind++) set_taker(self, slot, kind, 0); /* no alloc */
    if (PyDict_DelItem(self->slot_of, peer_id) < 0) return -1;
    Slot *s = &self->slots[slot];
    Py_CLEAR(s->peer_id); /* its entries are stale from here */
    Py_CLEAR(s->worker);
    Py_CLEAR(s->held);
    self->free_slots[self->num_free++] = slot;
    self->changes++;
    return 0;
}

/* -- changes ----------------------------------------------------------------------------------- */

static PyObject *PrefillRoom_add(PrefillRoom *self, PyObject *worker) {
    PyObject *peer_id = PyObject_GetAttr(worker, str_peer_id);
    if (peer_id == NULL) return NULL;
    double rate;
    if (!PyUnicode_CheckExact(peer_id)) {
        PyErr_Format(PyExc_TypeError, "a worker's peer_id must be a str, got %.100s",
                     Py_TYPE(peer_id)->tp_name);
        goto fail;
    }
    if (read_rate(worker, &rate) < 0) goto fail;
    PyObject *held = PyDict_New();
    if (held == NULL) goto fail;
    if (free_slot(self, peer_id) < 0) { /* registered again: a fresh window */
        Py_DECREF(held);
        goto fail;
    }
    Py_ssize_t slot = claim_slot((void **)&self->slots, &self->slots_cap, &self->free_slots,
                                 &self->num_free, sizeof(Slot), self->slot_of, peer_id);
    if (slot < 0) {
        Py_DECREF(held);
        goto fail;
    }
    Slot *s = &self->slots[slot];
    memset(s, 0, sizeof(Slot));
    s->peer_id = peer_id; /* the reference taken above */
    Py_INCREF(worker);
    s->worker = worker;
    s->held = held;
    s->version = ++self->versions;
    s->rate = rate;
    if (sort(self, slot) < 0) return NULL;
    Py_RETURN_NONE;
fail:
    Py_DECREF(peer_id);
    return NULL;
}

static PyObject *PrefillRoom_remove(PrefillRoom *self, PyObject *peer_id) {
    if (free_slot(self, peer_id) < 0) return NULL;
    Py_RETURN_NONE;
}

static void count(PrefillRoom *self, Slot *s, int64_t num_tokens, int bulk, int sign) {
    s->held_tokens += sign * num_tokens;
    s->bulk_tokens += bulk ? sign * num_tokens : 0;
    if (is_big(self, num_tokens)) {
        s->num_big += sign;
        s->num_big_bulk += bulk ? sign : 0;
    } else
        s->small_tokens += sign * num_tokens;
}

static PyObject *PrefillRoom_hold(PrefillRoom *self, PyObject *const *args, Py_ssize_t nargs) {
    if (nargs != 4) {
        PyErr_Format(PyExc_TypeError, "hold() takes 4 arguments (%zd given)", nargs);
        return NULL;
    }
    PyObject *worker = args[0], *request_id = args[1];
    long long num_tokens = PyLong_AsLongLong(args[2]);
    if (num_tokens == -1 && PyErr_Occurred()) return NULL;
    int bulk = PyObject_IsTrue(args[3]);
    if (bulk < 0) return NULL;
    if (num_tokens < 0 || num_tokens > ((int64_t)1 << 40)) {
        PyErr_Format(PyExc_ValueError, "a prompt of %lld tokens cannot be held", num_tokens);
        return NULL;
    }
    Py_ssize_t slot = slot_of_worker(self, worker);
    if (slot < 0) {
        if (!PyErr_Occurred()) PyErr_SetString(PyExc_KeyError, "a worker the room was not given");
        return NULL;
    }
    Slot *s = &self->slots[slot];
    int known = PyDict_Contains(s->held, request_id);
    if (known < 0) return NULL;
    if (known) Py_RETURN_NONE;
    PyObject *packed = PyLong_FromLongLong(num_tokens * 2 + bulk);
    if (packed == NULL || PyDict_SetItem(s->held, request_id, packed) < 0) {
        Py_XDECREF(packed);
        return NULL;
    }
    Py_DECREF(packed);
    count(self, s, num_tokens, bulk, +1);
    if (sort(self, slot) < 0) return NULL;
    Py_RETURN_NONE;
}

static PyObject *PrefillRoom_release(PrefillRoom *self, PyObject *const *args,
                                     Py_ssize_t nargs) {
    if (nargs != 2) {
        PyErr_Format(PyExc_TypeError, "release() takes 2 arguments (%zd given)", nargs);
        return NULL;
    }
    Py_ssize_t slot = slot_of_worker(self, args[0]);
    if (slot < 0) {
        if (PyErr_Occurred()) return NULL;
        Py_RETURN_NONE;
    }
    Slot *s = &self->slots[slot];
    PyObject *packed = PyDict_GetItemWithError(s->held, args[1]);
    if (packed == NULL) {
        if (PyErr_Occurred()) return NULL;
        Py_RETURN_NONE;
    }
    long long value = PyLong_AsLongLong(packed);
    if (PyDict_DelItem(s->held, args[1]) < 0) return NULL;
    count(self, s, value >> 1, (int)(value & 1), -1);
    if (sort(self, slot) < 0) return NULL;
    Py_RETURN_NONE;
}

static PyObject *PrefillRoom_rate_changed(PrefillRoom *self, PyObject *worker) {
    Py_ssize_t slot = slot_of_worker(self, worker);
    if (slot < 0) {
        if (PyErr_Occurred()) return NULL;
        Py_RETURN_NONE;
    }
    if (read_rate(worker, &self->slots[slot].rate) < 0 || sort(self, slot) < 0) return NULL;
    Py_RETURN_NONE;
}

/* -- questions --------------------------------------------------------------------------------- */

typedef struct {
    int64_t num_tokens;
    int bulk;
    double now, timeout_s;
} Question;

/* (num_prompt_tokens, bulk, now, timeout_s) */
static int read_question(PyObject *const *args, Py_ssize_t nargs, const char *name, Question *q) {
    if (nargs != 4) {
        PyErr_Format(PyExc_TypeError, "%s() takes 4 arguments (%zd given)", name, nargs);
        return -1;
    }
    long long n = PyLong_AsLongLong(args[0]);
    if (n == -1 && PyErr_Occurred()) return -1;
    q->num_tokens = n;
    if ((q->bulk = PyObject_IsTrue(args[1])) < 0) return -1;
    q->now = PyFloat_AsDouble(args[2]);
    if (q->now == -1.0 && PyErr_Occurred()) return -1;
    q->timeout_s = PyFloat_AsDouble(args[3]);
    if (q->timeout_s == -1.0 && PyErr_Occurred()) return -1;
    return 0;
}

static PyObject *PrefillRoom_takes_any(PrefillRoom *self, PyObject *const *args,
                                       Py_ssize_t nargs) {
    Question q;
    if (read_question(args, nargs, "takes_any", &q) < 0) return NULL;
    Kind *k = &self->kinds[kind_of(self, q.num_tokens, q.bulk)];
    for (Py_ssize_t i = 0; i < k->num_takers; i++) {
        int answer = healthy(self, &self->slots[k->takers[i]], q.now, q.timeout_s);
        if (answer < 0) return NULL;
        if (answer) Py_RETURN_TRUE;
    }
    Py_RETURN_FALSE;
}

/* Whether a healthy worker takes a small prompt, a big one, a batch line: one call where a
   dispatch asks all three. */
static PyObject *PrefillRoom_kinds_taken(PrefillRoom *self, PyObject *const *args,
                                         Py_ssize_t nargs) {
    if (nargs != 2) {
        PyErr_Format(PyExc_TypeError, "kinds_taken() takes 2 arguments (%zd given)", nargs);
        return NULL;
    }
    double now = PyFloat_AsDouble(args[0]);
    if (now == -1.0 && PyErr_Occurred()) return NULL;
    double timeout_s = PyFloat_AsDouble(args[1]);
    if (timeout_s == -1.0 && PyErr_Occurred()) return NULL;
    PyObject *answers = PyTuple_New(NUM_KINDS);
    if (answers == NULL) return NULL;
    for (int kind = 0; kind < NUM_KINDS; kind++) {
        Kind *k = &self->kinds[kind];
        int taken = 0;
        for (Py_ssize_t i = 0; i < k->num_takers && !taken; i++) {
            taken = healthy(self, &self->slots[k->takers[i]], now, timeout_s);
            if (taken < 0) {
                Py_DECREF(answers);
                return NULL;
            }
        }
        PyTuple_SET_ITEM(answers, kind, PyBool_FromLong(taken));
    }
    return answers;
}

/* A walk over one rate's takers of one kind: the healthy ones, by tokens held, then room (most
   first), then peer id; each worker once. */
typedef struct {
    PyObject_HEAD
    PrefillRoom *room; /* owned */
    int kind;
    Py_ssize_t group;
    double rate;
    uint64_t changes; /* the room's, when the walk was made */
    double now, timeout_s;
    Py_ssize_t last_slot; /* the slot last yielded: its equal entries follow it */
    LoadHeapWalk walk;
} TakerWalk;

static PyObject *walk_new(PrefillRoom *self, int kind, Py_ssize_t group, Question *q) {
    TakerWalk *w = PyObject_New(TakerWalk, &TakerWalkType);
    if (w == NULL) return NULL;
    Py_INCREF(self);
    w->room = self;
    w->kind = kind;
    w->group = group;
    w->rate = self->kinds[kind].groups[group].rate;
    w->now = q->now;
    w->timeout_s = q->timeout_s;
    w->last_slot = -1;
    LoadHeapWalk_start(&w->walk, &self->kinds[kind].groups[group].heap);
    w->changes = self->changes;
    return (PyObject *)w;
}

static void TakerWalk_dealloc(TakerWalk *w) {
    LoadHeapWalk_end(&w->walk);
    Py_DECREF(w->room);
    PyObject_Free(w);
}

static PyObject *TakerWalk_next(TakerWalk *w) {
    PrefillRoom *room = w->room;
    for (;;) {
        if (room->changes != w->changes) {
            PyErr_SetString(PyExc_RuntimeError, "the prefill room changed while it was read");
            return NULL;
        }
        Py_ssize_t position = LoadHeapWalk_next(&w->walk);
        if (position == -2) return NULL;
        if (position == -1) return NULL; /* StopIteration */
        LoadEntry *e = &w->walk.heap->data[position];
        if (e->slot == w->last_slot || !load_live(room, w->kind, w->rate, e)) continue;
        w->last_slot = e->slot;
        Slot *s = &room->slots[e->slot];
        int answer = healthy(room, s, w->now, w->timeout_s);
        if (answer < 0) return NULL;
        if (answer) {
            Py_INCREF(s->worker);
            return s->worker;
        }
    }
}

static PyObject *PrefillRoom_takers_by_load(PrefillRoom *self, PyObject *const *args,
                                            Py_ssize_t nargs) {
    Question q;
    if (read_question(args, nargs, "takers_by_load", &q) < 0) return NULL;
    int kind = kind_of(self, q.num_tokens, q.bulk);
    Kind *k = &self->kinds[kind];
    for (Py_ssize_t i = 0; i < k->len;) { /* the rates with no live entry go */
        if (live_top(self, kind, &k->groups[i]) == NULL)
            drop_group(self, kind, i);
        else
            i++;
    }
    PyObject *walks = PyList_New(k->len);
    if (walks == NULL) return NULL;
    for (Py_ssize_t i = 0; i < k->len; i++) {
        PyObject *walk = walk_new(self, kind, i, &q);
        if (walk == NULL) {
            Py_DECREF(walks);
            return NULL;
        }
        PyList_SET_ITEM(walks, i, walk);
    }
    return walks;
}

/* A figure of the window of the worker with this peer id (KeyError: no such worker). */
static Slot *window_of(PrefillRoom *self, PyObject *peer_id) {
    Py_ssize_t slot = lookup_slot(self->slot_of, peer_id);
    if (slot < 0) {
        if (!PyErr_Occurred()) PyErr_SetObject(PyExc_KeyError, peer_id);
        return NULL;
    }
    return &self->slots[slot];
}

static PyObject *PrefillRoom_held_tokens(PrefillRoom *self, PyObject *peer_id) {
    Slot *s = window_of(self, peer_id);
    return s == NULL ? NULL : PyLong_FromLongLong(s->held_tokens);
}

static PyObject *PrefillRoom_small_room(PrefillRoom *self, PyObject *peer_id) {
    Slot *s = window_of(self, peer_id);
    return s == NULL ? NULL : PyLong_FromLongLong(small_room(self, s));
}

static PyObject *PrefillRoom_interactive_tokens(PrefillRoom *self, PyObject *peer_id) {
    Slot *s = window_of(self, peer_id);
    return s == NULL ? NULL : PyLong_FromLongLong(s->held_tokens - s->bulk_tokens);
}

static PyObject *PrefillRoom_takes(PrefillRoom *self, PyObject *const *args, Py_ssize_t nargs) {
    if (nargs != 3) {
        PyErr_Format(PyExc_TypeError, "takes() takes 3 arguments (%zd given)", nargs);
        return NULL;
    }
    Slot *s = window_of(self, args[0]);
    if (s == NULL) return NULL;
    long long n = PyLong_AsLongLong(args[1]);
    if (n == -1 && PyErr_Occurred()) return NULL;
    int bulk = PyObject_IsTrue(args[2]);
    if (bulk < 0) return NULL;
    return PyBool_FromLong(window_takes(self, s, n, bulk));
}

static PyObject *PrefillRoom_num_entries(PrefillRoom *self, PyObject *unused) {
    Py_ssize_t total = 0;
    for (int kind = 0; kind < NUM_KINDS; kind++)
        for (Py_ssize_t i = 0; i < self->kinds[kind].len; i++)
            total += self->kinds[kind].groups[i].heap.len;
    return PyLong_FromSsize_t(total);
}

static PyObject *PrefillRoom_get_window_tokens(PrefillRoom *self, void *unused) {
    return PyLong_FromLongLong(self->window_tokens);
}

static PyObject *PrefillRoom_get_bulk_share(PrefillRoom *self, void *unused) {
    return PyFloat_FromDouble(self->bulk_share);
}

/* -- the types --------------------------------------------------------------------------------- */

static PyObject *PrefillRoom_new(PyTypeObject *type, PyObject *args, PyObject *kwargs) {
    static char *keywords[] = {"window_tokens", "bulk_share", NULL};
    long long window_tokens;
    double bulk_share = 0.5;
    if (!PyArg_ParseTupleAndKeywords(args, kwargs, "L|d:PrefillRoom", keywords, &window_tokens,
                                     &bulk_share))
        return NULL;
    if (window_tokens < 1 || window_tokens > ((int64_t)1 << 40)) {
        PyErr_Format(PyExc_ValueError, "window_tokens must be a positive count, got %lld",
                     window_tokens);
        return NULL;
    }
    if (!(bulk_share > 0.0 && bulk_share <= 1.0)) {
        PyObject *shown = PyFloat_FromDouble(bulk_share);
        if (shown != NULL) {
            PyErr_Format(PyExc_ValueError, "bulk_share must be in (0, 1], got %R", shown);
            Py_DECREF(shown);
        }
        return NULL;
    }
    PrefillRoom *self = (PrefillRoom *)type->tp_alloc(type, 0); /* zeroed */
    if (self == NULL) return NULL;
    self->window_tokens = window_tokens;
    self->bulk_share = bulk_share;
    self->bulk_limit = (int64_t)((double)window_tokens * bulk_share); /* int() truncates */
    self->slot_of = PyDict_New();
    if (self->slot_of == NULL) {
        Py_DECREF(self);
        return NULL;
    }
    return (PyObject *)self;
}

static void PrefillRoom_dealloc(PrefillRoom *self) {
    for (Py_ssize_t i = 0; i < self->slots_cap; i++) {
        Py_XDECREF(self->slots[i].peer_id);
        Py_XDECREF(self->slots[i].worker);
        Py_XDECREF(self->slots[i].held);
    }
    for (int kind = 0; kind < NUM_KINDS; kind++) {
        Kind *k = &self->kinds[kind];
        while (k->len > 0) drop_group(self, kind, k->len - 1);
        PyMem_Free(k->groups);
        PyMem_Free(k->takers);
    }
    PyMem_Free(self->slots);
    PyMem_Free(self->free_slots);
    Py_XDECREF(self->slot_of);
    Py_TYPE(self)->tp_free((PyObject *)self);
}

#define FAST (METH_FASTCALL)
static PyMethodDef PrefillRoom_methods[] = {
    {"add", (PyCFunction)PrefillRoom_add, METH_O, "a worker registered: an empty window"},
    {"remove", (PyCFunction)PrefillRoom_remove, METH_O, "the worker of this peer id left"},
    {"hold", (PyCFunction)(void (*)(void))PrefillRoom_hold, FAST,
     "hold(worker, request_id, num_prompt_tokens, bulk)"},
    {"release", (PyCFunction)(void (*)(void))PrefillRoom_release, FAST,
     "release(worker, request_id)"},
    {"rate_changed", (PyCFunction)PrefillRoom_rate_changed, METH_O, NULL},
    {"takes_any", (PyCFunction)(void (*)(void))PrefillRoom_takes_any, FAST,
     "takes_any(num_prompt_tokens, bulk, now, timeout_s): a healthy worker takes such a prompt"},
    {"kinds_taken", (PyCFunction)(void (*)(void))PrefillRoom_kinds_taken, FAST,
     "kinds_taken(now, timeout_s): (small, big, bulk), whether a healthy worker takes each"},
    {"takers_by_load", (PyCFunction)(void (*)(void))PrefillRoom_takers_by_load, FAST,
     "takers_by_load(num_prompt_tokens, bulk, now, timeout_s): per rate, a walk"},
    {"held_tokens", (PyCFunction)PrefillRoom_held_tokens, METH_O, NULL},
    {"small_room", (PyCFunction)PrefillRoom_small_room, METH_O, NULL},
    {"interactive_tokens", (PyCFunction)PrefillRoom_interactive_tokens, METH_O, NULL},
    {"takes", (PyCFunction)(void (*)(void))PrefillRoom_takes, FAST,
     "takes(peer_id, num_prompt_tokens, bulk): the worker's window takes such a prompt"},
    {"num_entries", (PyCFunction)PrefillRoom_num_entries, METH_NOARGS,
     "the entries in all heaps, live or stale"},
    {NULL, NULL, 0, NULL},
};

static PyGetSetDef PrefillRoom_getset[] = {
    {"window_tokens", (getter)PrefillRoom_get_window_tokens, NULL, NULL, NULL},
    {"bulk_share", (getter)PrefillRoom_get_bulk_share, NULL, NULL, NULL},
    {NULL, NULL, NULL, NULL, NULL},
};

static PyTypeObject PrefillRoomType = {
    PyVarObject_HEAD_INIT(NULL, 0).tp_name = "_tandem_prefill_room.PrefillRoom",
    .tp_basicsize = sizeof(PrefillRoom),
    .tp_dealloc = (destructor)PrefillRoom_dealloc,
    .tp_flags = Py_TPFLAGS_DEFAULT,
    .tp_doc = "The prefill workers' windows (see worker_index.py)",
    .tp_methods = PrefillRoom_methods,
    .tp_getset = PrefillRoom_getset,
    .tp_new = PrefillRoom_new,
};

static PyTypeObject TakerWalkType = {
    PyVarObject_HEAD_INIT(NULL, 0).tp_name = "_tandem_prefill_room.TakerWalk",
    .tp_basicsize = sizeof(TakerWalk),
    .tp_dealloc = (destructor)TakerWalk_dealloc,
    .tp_flags = Py_TPFLAGS_DEFAULT,
    .tp_iter = PyObject_SelfIter,
    .tp_iternext = (iternextfunc)TakerWalk_next,
};

static struct PyModuleDef module = {
    PyModuleDef_HEAD_INIT, "_tandem_prefill_room", NULL, -1, NULL, NULL, NULL, NULL, NULL,
};

PyMODINIT_FUNC PyInit__tandem_prefill_room(void) {
    if (PyType_Ready(&PrefillRoomType) < 0 || PyType_Ready(&TakerWalkType) < 0) return NULL;
#define INTERN(var, text) \
    if ((var = PyUnicode_InternFromString(text)) == NULL) return NULL;
    INTERN(str_peer_id, "peer_id")
    INTERN(str_prefill_tokens_per_s, "prefill_tokens_per_s")
    INTERN(str_busy, "busy")
    INTERN(str_last_progress, "last_progress")
    PyObject *m = PyModule_Create(&module);
    if (m == NULL) return NULL;
    Py_INCREF(&PrefillRoomType);
    if (PyModule_AddObject(m, "PrefillRoom", (PyObject *)&PrefillRoomType) < 0) {
        Py_DECREF(&PrefillRoomType);
        Py_DECREF(m);
        return NULL;
    }
    return m;
}
