/* The decode workers' room in C: `worker_index.py`'s DecodeRoom, answer for answer.

   Loaded by `native_indexes.py` (compiled on first use, `kernels/native_build.py`). The Python
   DecodeRoom is the reference: `tests/unit/test_decode_room_native.py` drives a registry on each
   with the same changes and asks both every question after each.

   Layout: a worker the room was given (`add`) lives in a slot (reused once `remove` frees it),
   found by its peer id; the slot holds its WorkerState, its registration order, seats and KV
   capacity, and its free-minus-promised blocks and request count as of its last `update`. The
   registry calls `update` after every change of those figures (`registry.py`: every such change
   goes through it), so the slot's figures are the worker's. Three kinds of lazy heaps hold plain
   C entries, never tuples:
   - per block size: (-available blocks, requests, order, slot): the best worker is the smallest;
   - by seats taken: (requests / max seqs, -available blocks, requests, order, slot);
   - by capacity: (-KV capacity in tokens, order, slot).
   An entry is live while its slot holds a worker of that registration order, that worker is
   still the registry's (the workers dict maps its peer id to it) and its figures are the
   entry's (for the seat heap: with a seat free). Registration orders are unique, so every order
   is total across workers and a heap's layout never changes an answer. A heap is rebuilt from
   its live entries, one per worker, when it holds more than twice the registered workers plus
   REBUILD_SLACK, as `lazy_heap.py`.

   Health (`WorkerState.making_progress`) depends on the clock: it is read from the worker
   (`busy`, `last_progress`) as a reader meets it. Reading an attribute runs no Python code for
   a WorkerState; were the heap to change anyway, the read raises RuntimeError instead of
   walking moved memory. The room holds the workers dict and the WorkerStates, none of which
   refer to it, so the type takes no part in the cyclic GC. */

#define PY_SSIZE_T_CLEAN
#include <Python.h>
#include <stdint.h>
#include <string.h>

#include "native_common.h" /* slots, reading values, health, DEFINE_HEAP */

#define REBUILD_SLACK 64

/* -- entries and their orders ------------------------------------------------------------ */

typedef struct {
    int64_t neg_available, num_requests, order;
    Py_ssize_t slot;
} RoomEntry;

typedef struct {
    double busy; /* share of seats taken, as `_busy_entry` computes it */
    int64_t neg_available, num_requests, order;
    Py_ssize_t slot;
} BusyEntry;

typedef struct {
    int64_t neg_capacity, order;
    Py_ssize_t slot;
} CapacityEntry;

static inline int room_less(const RoomEntry *a, const RoomEntry *b) {
    if (a->neg_available != b->neg_available) return a->neg_available < b->neg_available;
    if (a->num_requests != b->num_requests) return a->num_requests < b->num_requests;
    return a->order < b->order;
}

static inline int busy_less(const BusyEntry *a, const BusyEntry *b) {
    if (a->busy != b->busy) return a->busy < b->busy;
    if (a->neg_available != b->neg_available) return a->neg_available < b->neg_available;
    if (a->num_requests != b->num_requests) return a->num_requests < b->num_requests;
    return a->order < b->order;
}

static inline int capacity_less(const CapacityEntry *a, const CapacityEntry *b) {
    if (a->neg_capacity != b->neg_capacity) return a->neg_capacity < b->neg_capacity;
    return a->order < b->order;
}

DEFINE_HEAP(RoomHeap, RoomEntry, room_less)
DEFINE_HEAP(BusyHeap, BusyEntry, busy_less)
DEFINE_HEAP(CapacityHeap, CapacityEntry, capacity_less)

/* -- the room's state ------------------------------------------------------------------------ */

typedef struct {
    PyObject *peer_id; /* owned; NULL: the slot is free */
    PyObject *worker;  /* owned: the WorkerState given to `add` */
    int64_t order, block_size, max_num_seqs, seats, capacity;
    int64_t available, num_requests; /* as of the last `add` or `update` */
    int pushed; /* entries with the figures below are in the heaps (and need no push again) */
    int64_t pushed_available, pushed_num_requests;
    uint64_t kept; /* the rebuild that last kept one of its entries (one per worker) */
} Slot;

typedef struct {
    int64_t block_size;
    RoomHeap heap;
} BlockGroup;

typedef struct {
    PyObject_HEAD
    PyObject *workers; /* the registry's decode workers: peer id -> WorkerState */
    PyObject *slot_of; /* peer id -> slot */
    int has_share;     /* seats: all, or max(1, int(max_num_seqs * seat_share)) */
    double seat_share;
    Slot *slots;
    Py_ssize_t slots_cap, num_free;
    Py_ssize_t *free_slots;
    BlockGroup *groups; /* in the order their block sizes first came */
    Py_ssize_t num_groups;
    BusyHeap by_busy;
    CapacityHeap capacities;
    uint64_t rebuilds;
} DecodeRoom;

static PyObject *str_peer_id, *str_order, *str_block_size, *str_max_num_seqs,
    *str_num_total_blocks, *str_num_free_blocks, *str_num_promised_blocks, *str_request_ids,
    *str_busy, *str_last_progress;

/* -- reading a WorkerState ------------------------------------------------------------------- */

/* The worker's free blocks less those promised since its last heartbeat, and its requests. */
static int read_load(PyObject *worker, int64_t *available, int64_t *num_requests) {
    int64_t free_blocks, promised;
    if (get_int64(worker, str_num_free_blocks, &free_blocks) < 0 ||
        get_int64(worker, str_num_promised_blocks, &promised) < 0 ||
        get_length(worker, str_request_ids, num_requests) < 0)
        return -1;
    if (__builtin_sub_overflow(free_blocks, promised, available)) {
        PyErr_SetString(PyExc_OverflowError, "available blocks out of range");
        return -1;
    }
    return 0;
}

static int64_t seats_of(DecodeRoom *self, int64_t max_num_seqs) {
    if (!self->has_share) return max_num_seqs;
    double share = (double)max_num_seqs * self->seat_share;
    int64_t seats = share >= 9.2e18 ? INT64_MAX : (int64_t)share; /* int() truncates */
    return seats > 1 ? seats : 1;
}

/* -(-n // size) with Python's floor division (size > 0): the blocks n tokens take. */
static int64_t blocks_for(int64_t num_tokens, int64_t block_size) {
    int64_t q = num_tokens / block_size;
    return (num_tokens % block_size != 0 && num_tokens > 0) ? q + 1 : q;
}

/* -- liveness ---------------------------------------------------------------------------------- */

/* Whether the slot's worker is still the registry's. Peer ids are str (checked by `add`), whose
   lookup cannot fail. */
static inline int registered(DecodeRoom *self, Slot *s) {
    return s->peer_id != NULL && PyDict_GetItem(self->workers, s->peer_id) == s->worker;
}

static inline int has_seat(Slot *s) { return s->num_requests < s->seats; }

static inline int room_live(DecodeRoom *self, const RoomEntry *e) {
    Slot *s = &self->slots[e->slot];
    return s->peer_id != NULL && s->order == e->order && -s->available == e->neg_available &&
           s->num_requests == e->num_requests && registered(self, s);
}

static inline double busy_share(Slot *s) {
    return (double)s->num_requests / (double)s->max_num_seqs; /* max_num_seqs > 0 (`add`) */
}

static inline int busy_live(DecodeRoom *self, const BusyEntry *e) {
    Slot *s = &self->slots[e->slot];
    return s->peer_id != NULL && s->order == e->order && has_seat(s) &&
           -s->available == e->neg_available && s->num_requests == e->num_requests &&
           busy_share(s) == e->busy && registered(self, s);
}

static inline int capacity_live(DecodeRoom *self, const CapacityEntry *e) {
    Slot *s = &self->slots[e->slot];
    return s->peer_id != NULL && s->order == e->order && registered(self, s);
}

/* Per heap type: the live top (stale entries above it dropped), and a push that rebuilds the
   heap from its live entries (one per worker) when the stale ones dominate. */
#define DEFINE_LAZY(NAME, HEAP, ENTRY, LESS, LIVE)                                            \
    static ENTRY *NAME##_live_top(DecodeRoom *self, HEAP *h) {                                \
        while (h->len > 0 && !LIVE(self, &h->data[0])) HEAP##_pop(h);                         \
        return h->len > 0 ? &h->data[0] : NULL;                                               \
    }                                                                                         \
    static int NAME##_push(DecodeRoom *self, HEAP *h, ENTRY e) {                              \
        if (HEAP##_push(h, e) < 0) return -1;                                                 \
        if (h->len > 2 * PyDict_GET_SIZE(self->workers) + REBUILD_SLACK) {                    \
            uint64_t rebuild = ++self->rebuilds;                                              \
            Py_ssize_t kept = 0;                                                              \
            for (Py_ssize_t i = 0; i < h->len; i++) {                                         \
                Slot *s = &self->slots[h->data[i].slot];                                      \
                if (LIVE(self, &h->data[i]) && s->kept != rebuild) {                          \
                    s->kept = rebuild;                                                        \
                    h->data[kept++] = h->data[i];                                             \
                }                                                                             \
            }                                                                                 \
            h->len = kept;                                                                    \
            HEAP##_heapify(h);                                                                \
        }                                                                                     \
        return 0;                                                                             \
    }

DEFINE_LAZY(room, RoomHeap, RoomEntry, room_less, room_live)
DEFINE_LAZY(busy, BusyHeap, BusyEntry, busy_less, busy_live)
DEFINE_LAZY(capacity, CapacityHeap, CapacityEntry, capacity_less, capacity_live)
DEFINE_WALK(RoomHeap, room_less)
DEFINE_WALK(BusyHeap, busy_less)
DEFINE_WALK(CapacityHeap, capacity_less)

/* -- slots ------------------------------------------------------------------------------------- */

static int free_slot(DecodeRoom *self, PyObject *peer_id) {
    Py_ssize_t slot = lookup_slot(self->slot_of, peer_id);
    if (slot < 0) return PyErr_Occurred() ? -1 : 0;
    if (PyDict_DelItem(self->slot_of, peer_id) < 0) return -1;
    Slot *s = &self->slots[slot];
    Py_CLEAR(s->peer_id); /* its entries are stale from here */
    Py_CLEAR(s->worker);
    s->pushed = 0;
    self->free_slots[self->num_free++] = slot;
    return 0;
}

static RoomHeap *group_heap(DecodeRoom *self, int64_t block_size) {
    for (Py_ssize_t i = 0; i < self->num_groups; i++)
        if (self->groups[i].block_size == block_size) return &self->groups[i].heap;
    BlockGroup *groups = PyMem_Realloc(self->groups, (size_t)(self->num_groups + 1) *
                                                         sizeof(BlockGroup));
    if (groups == NULL) return PyErr_NoMemory(), NULL;
    self->groups = groups;
    BlockGroup *group = &groups[self->num_groups++];
    memset(group, 0, sizeof(BlockGroup));
    group->block_size = block_size;
    return &group->heap;
}

/* -- changes ----------------------------------------------------------------------------------- */

/* The worker's entries follow its figures (read from it); none while it has no seat free. */
static int follow(DecodeRoom *self, Py_ssize_t slot) {
    Slot *s = &self->slots[slot];
    if (read_load(s->worker, &s->available, &s->num_requests) < 0) return -1;
    if (!has_seat(s)) {
        s->pushed = 0; /* its entries may go stale now */
        return 0;
    }
    if (s->pushed && s->pushed_available == s->available &&
        s->pushed_num_requests == s->num_requests)
        return 0; /* unchanged (a heartbeat with the same figures): its entries are live */
    RoomHeap *heap = group_heap(self, s->block_size);
    if (heap == NULL) return -1;
    RoomEntry entry = {-s->available, s->num_requests, s->order, slot};
    BusyEntry busy = {busy_share(s), -s->available, s->num_requests, s->order, slot};
    if (room_push(self, heap, entry) < 0 || busy_push(self, &self->by_busy, busy) < 0) return -1;
    s->pushed = 1;
    s->pushed_available = s->available;
    s->pushed_num_requests = s->num_requests;
    return 0;
}

static PyObject *DecodeRoom_add(DecodeRoom *self, PyObject *worker) {
    PyObject *peer_id = PyObject_GetAttr(worker, str_peer_id);
    if (peer_id == NULL) return NULL;
    if (!PyUnicode_CheckExact(peer_id)) {
        PyErr_Format(PyExc_TypeError, "a worker's peer_id must be a str, got %.100s",
                     Py_TYPE(peer_id)->tp_name);
        Py_DECREF(peer_id);
        return NULL;
    }
    /* Everything read and checked before anything changes: wrong input changes nothing. */
    int64_t order, block_size, max_num_seqs, num_total_blocks, capacity, available, num_requests;
    if (get_int64(worker, str_order, &order) < 0 ||
        get_int64(worker, str_block_size, &block_size) < 0 ||
        get_int64(worker, str_max_num_seqs, &max_num_seqs) < 0 ||
        get_int64(worker, str_num_total_blocks, &num_total_blocks) < 0 ||
        read_load(worker, &available, &num_requests) < 0)
        goto fail;
    if (block_size <= 0 || max_num_seqs <= 0 || num_total_blocks < 0) {
        PyErr_Format(PyExc_ValueError,
                     "a decode worker needs block_size > 0, max_num_seqs > 0 and "
                     "num_total_blocks >= 0, got %lld, %lld, %lld",
                     (long long)block_size, (long long)max_num_seqs, (long long)num_total_blocks);
        goto fail;
    }
    if (__builtin_mul_overflow(num_total_blocks, block_size, &capacity)) {
        PyErr_SetString(PyExc_OverflowError, "a decode worker's KV capacity is out of range");
        goto fail;
    }
    if (free_slot(self, peer_id) < 0) goto fail; /* registered again: a fresh slot */
    Py_ssize_t slot = claim_slot((void **)&self->slots, &self->slots_cap, &self->free_slots,
                                 &self->num_free, sizeof(Slot), self->slot_of, peer_id);
    if (slot < 0) goto fail;
    Slot *s = &self->slots[slot];
    s->peer_id = peer_id; /* the reference taken above */
    Py_INCREF(worker);
    s->worker = worker;
    s->order = order;
    s->block_size = block_size;
    s->max_num_seqs = max_num_seqs;
    s->seats = seats_of(self, max_num_seqs);
    s->capacity = capacity;
    s->pushed = 0;
    CapacityEntry entry = {-capacity, order, slot};
    if (capacity_push(self, &self->capacities, entry) < 0 || follow(self, slot) < 0) return NULL;
    Py_RETURN_NONE;
fail:
    Py_DECREF(peer_id);
    return NULL;
}

static PyObject *DecodeRoom_update(DecodeRoom *self, PyObject *worker) {
    PyObject *peer_id = PyObject_GetAttr(worker, str_peer_id);
    if (peer_id == NULL) return NULL;
    Py_ssize_t slot = lookup_slot(self->slot_of, peer_id);
    Py_DECREF(peer_id);
    if (slot < 0) {
        if (PyErr_Occurred()) return NULL;
        Py_RETURN_NONE; /* a worker the room was not given */
    }
    if (self->slots[slot].worker != worker) Py_RETURN_NONE; /* an earlier registration's */
    if (follow(self, slot) < 0) return NULL;
    Py_RETURN_NONE;
}

static PyObject *DecodeRoom_remove(DecodeRoom *self, PyObject *peer_id) {
    if (free_slot(self, peer_id) < 0) return NULL;
    Py_RETURN_NONE;
}

/* -- questions --------------------------------------------------------------------------------- */

static int read_now(PyObject *const *args, Py_ssize_t nargs, Py_ssize_t first, Py_ssize_t want,
                    const char *name, double *now, double *timeout_s) {
    if (nargs != want) {
        PyErr_Format(PyExc_TypeError, "%s() takes %zd arguments (%zd given)", name, want, nargs);
        return -1;
    }
    *now = PyFloat_AsDouble(args[first]);
    if (*now == -1.0 && PyErr_Occurred()) return -1;
    *timeout_s = PyFloat_AsDouble(args[first + 1]);
    if (*timeout_s == -1.0 && PyErr_Occurred()) return -1;
    return 0;
}

static int read_tokens(PyObject *arg, int64_t *num_tokens) {
    long long n = PyLong_AsLongLong(arg);
    if (n == -1 && PyErr_Occurred()) return -1;
    *num_tokens = n;
    return 0;
}

/* The slot's health, the heap it was met in checked unchanged by the read (see the top). */
static int healthy_in(Slot *s, double now, double timeout_s, uint64_t *changes, uint64_t before) {
    PyObject *worker = s->worker;
    Py_INCREF(worker);
    int healthy = making_progress(worker, now, timeout_s, str_busy, str_last_progress);
    Py_DECREF(worker);
    if (healthy >= 0 && *changes != before) {
        PyErr_SetString(PyExc_RuntimeError, "the decode room changed while it was read");
        return -1;
    }
    return healthy;
}

/* Per block size, the first healthy worker with a seat free (the one that can hold the most
   tokens of its block size), its slot written to out[i]; returns how many, -1 on error. */
static Py_ssize_t tops_into(DecodeRoom *self, double now, double timeout_s, Py_ssize_t *out) {
    Py_ssize_t found = 0;
    for (Py_ssize_t g = 0; g < self->num_groups; g++) {
        RoomHeap *heap = &self->groups[g].heap;
        RoomEntry *top = room_live_top(self, heap);
        if (top == NULL) continue;
        Slot *s = &self->slots[top->slot];
        uint64_t before = heap->changes;
        Py_ssize_t top_slot = top->slot;
        if (has_seat(s)) { /* the usual case: the top has a seat and is healthy */
            int healthy = healthy_in(s, now, timeout_s, &heap->changes, before);
            if (healthy < 0) return -1;
            if (healthy) {
                out[found++] = top_slot;
                continue;
            }
        }
        RoomHeapWalk walk;
        RoomHeapWalk_start(&walk, heap);
        for (;;) {
            Py_ssize_t position = RoomHeapWalk_next(&walk);
            if (position == -1) break;
            if (position == -2) return RoomHeapWalk_end(&walk), -1;
            RoomEntry *e = &heap->data[position];
            s = &self->slots[e->slot];
            if (!room_live(self, e) || !has_seat(s)) continue;
            Py_ssize_t slot = e->slot;
            int healthy = healthy_in(s, now, timeout_s, &heap->changes, walk.changes);
            if (healthy < 0) return RoomHeapWalk_end(&walk), -1;
            if (healthy) {
                out[found++] = slot;
                break;
            }
        }
        RoomHeapWalk_end(&walk);
    }
    return found;
}

/* Whether a ranks before b in the room's order: more available blocks, fewer requests, the
   first registered. */
static int better(Slot *a, Slot *b) {
    RoomEntry x = {-a->available, a->num_requests, a->order, 0};
    RoomEntry y = {-b->available, b->num_requests, b->order, 0};
    return room_less(&x, &y);
}

/* The tops' slots (`tops_into`), on the stack when there are few block sizes. */
#define MAX_LOCAL_GROUPS 8
typedef struct {
    Py_ssize_t *slots, len;
    Py_ssize_t local[MAX_LOCAL_GROUPS];
} Tops;

static int find_tops(DecodeRoom *self, double now, double timeout_s, Tops *t) {
    t->slots = t->local;
    if (self->num_groups > MAX_LOCAL_GROUPS &&
        (t->slots = PyMem_Malloc((size_t)self->num_groups * sizeof(Py_ssize_t))) == NULL)
        return PyErr_NoMemory(), -1;
    t->len = tops_into(self, now, timeout_s, t->slots);
    if (t->len >= 0) return 0;
    if (t->slots != t->local) PyMem_Free(t->slots);
    return -1;
}

static void tops_end(Tops *t) {
    if (t->slots != t->local) PyMem_Free(t->slots);
}

static PyObject *DecodeRoom_best(DecodeRoom *self, PyObject *const *args, Py_ssize_t nargs) {
    double now, timeout_s;
    int64_t num_tokens;
    Tops tops;
    if (read_now(args, nargs, 1, 3, "best", &now, &timeout_s) < 0 ||
        read_tokens(args[0], &num_tokens) < 0 || find_tops(self, now, timeout_s, &tops) < 0)
        return NULL;
    Slot *best = NULL;
    for (Py_ssize_t i = 0; i < tops.len; i++) {
        Slot *s = &self->slots[tops.slots[i]];
        if (s->available >= blocks_for(num_tokens, s->block_size) &&
            (best == NULL || better(s, best)))
            best = s;
    }
    tops_end(&tops);
    PyObject *result = best ? best->worker : Py_None;
    Py_INCREF(result);
    return result;
}

static PyObject *DecodeRoom_max_tokens(DecodeRoom *self, PyObject *const *args,
                                       Py_ssize_t nargs) {
    double now, timeout_s;
    Tops tops;
    if (read_now(args, nargs, 0, 2, "max_tokens", &now, &timeout_s) < 0 ||
        find_tops(self, now, timeout_s, &tops) < 0)
        return NULL;
    int64_t most = 0, tokens;
    int overflow = 0;
    for (Py_ssize_t i = 0; i < tops.len; i++) {
        Slot *s = &self->slots[tops.slots[i]];
        overflow |= __builtin_mul_overflow(s->available, s->block_size, &tokens);
        if (i == 0 || tokens > most) most = tokens;
    }
    tops_end(&tops);
    if (overflow) {
        PyErr_SetString(PyExc_OverflowError, "a decode worker's room is out of range");
        return NULL;
    }
    return PyLong_FromLongLong(most);
}

static PyObject *DecodeRoom_max_capacity(DecodeRoom *self, PyObject *const *args,
                                         Py_ssize_t nargs) {
    double now, timeout_s;
    if (read_now(args, nargs, 0, 2, "max_capacity", &now, &timeout_s) < 0) return NULL;
    CapacityHeap *heap = &self->capacities;
    capacity_live_top(self, heap);
    CapacityHeapWalk walk;
    CapacityHeapWalk_start(&walk, heap);
    for (;;) {
        Py_ssize_t position = CapacityHeapWalk_next(&walk);
        if (position == -1) break;
        if (position == -2) return CapacityHeapWalk_end(&walk), NULL;
        CapacityEntry *e = &heap->data[position];
        if (!capacity_live(self, e)) continue;
        int64_t capacity = -e->neg_capacity;
        int healthy = healthy_in(&self->slots[e->slot], now, timeout_s, &heap->changes,
                                 walk.changes);
        if (healthy < 0) return CapacityHeapWalk_end(&walk), NULL;
        if (healthy) {
            CapacityHeapWalk_end(&walk);
            return PyLong_FromLongLong(capacity);
        }
    }
    CapacityHeapWalk_end(&walk);
    Py_RETURN_NONE;
}

static PyObject *DecodeRoom_least_busy(DecodeRoom *self, PyObject *const *args,
                                       Py_ssize_t nargs) {
    double now, timeout_s;
    int64_t num_tokens;
    if (read_now(args, nargs, 1, 4, "least_busy", &now, &timeout_s) < 0 ||
        read_tokens(args[0], &num_tokens) < 0)
        return NULL;
    PyObject *excluded = args[3];
    BusyHeap *heap = &self->by_busy;
    busy_live_top(self, heap);
    BusyHeapWalk walk;
    BusyHeapWalk_start(&walk, heap);
    for (;;) {
        Py_ssize_t position = BusyHeapWalk_next(&walk);
        if (position == -1) break;
        if (position == -2) return BusyHeapWalk_end(&walk), NULL;
        BusyEntry *e = &heap->data[position];
        if (!busy_live(self, e)) continue;
        Slot *s = &self->slots[e->slot];
        if (s->available < blocks_for(num_tokens, s->block_size)) continue;
        PyObject *peer_id = s->peer_id, *worker = s->worker;
        Py_INCREF(peer_id);
        int is_excluded = PySequence_Contains(excluded, peer_id);
        Py_DECREF(peer_id);
        if (is_excluded < 0) return BusyHeapWalk_end(&walk), NULL;
        if (heap->changes != walk.changes) { /* (a container's own __contains__ ran) */
            PyErr_SetString(PyExc_RuntimeError, "the decode room changed while it was read");
            return BusyHeapWalk_end(&walk), NULL;
        }
        if (is_excluded) continue;
        int healthy = healthy_in(s, now, timeout_s, &heap->changes, walk.changes);
        if (healthy < 0) return BusyHeapWalk_end(&walk), NULL;
        if (healthy) {
            BusyHeapWalk_end(&walk);
            Py_INCREF(worker);
            return worker;
        }
    }
    BusyHeapWalk_end(&walk);
    Py_RETURN_NONE;
}

static PyObject *DecodeRoom_has_seat(DecodeRoom *self, PyObject *worker) {
    int64_t max_num_seqs, num_requests;
    if (get_int64(worker, str_max_num_seqs, &max_num_seqs) < 0 ||
        get_length(worker, str_request_ids, &num_requests) < 0)
        return NULL;
    return PyBool_FromLong(num_requests < seats_of(self, max_num_seqs));
}

static PyObject *DecodeRoom_num_entries(DecodeRoom *self, PyObject *unused) {
    Py_ssize_t total = self->by_busy.len + self->capacities.len;
    for (Py_ssize_t g = 0; g < self->num_groups; g++) total += self->groups[g].heap.len;
    return PyLong_FromSsize_t(total);
}

/* -- the type ---------------------------------------------------------------------------------- */

static PyObject *DecodeRoom_new(PyTypeObject *type, PyObject *args, PyObject *kwargs) {
    static char *keywords[] = {"workers", "seat_share", NULL};
    PyObject *workers, *share = Py_None;
    if (!PyArg_ParseTupleAndKeywords(args, kwargs, "O!|O:DecodeRoom", keywords, &PyDict_Type,
                                     &workers, &share))
        return NULL;
    double seat_share = 0.0;
    if (share != Py_None) {
        seat_share = PyFloat_AsDouble(share);
        if (seat_share == -1.0 && PyErr_Occurred()) return NULL;
        if (!(seat_share > 0.0 && seat_share <= 1.0)) {
            PyErr_Format(PyExc_ValueError, "seat_share must be in (0, 1], got %R", share);
            return NULL;
        }
    }
    DecodeRoom *self = (DecodeRoom *)type->tp_alloc(type, 0); /* zeroed */
    if (self == NULL) return NULL;
    Py_INCREF(workers);
    self->workers = workers;
    self->has_share = share != Py_None;
    self->seat_share = seat_share;
    self->slot_of = PyDict_New();
    if (self->slot_of == NULL) {
        Py_DECREF(self);
        return NULL;
    }
    return (PyObject *)self;
}

static void DecodeRoom_dealloc(DecodeRoom *self) {
    for (Py_ssize_t i = 0; i < self->slots_cap; i++) {
        Py_XDECREF(self->slots[i].peer_id);
        Py_XDECREF(self->slots[i].worker);
    }
    for (Py_ssize_t g = 0; g < self->num_groups; g++) PyMem_Free(self->groups[g].heap.data);
    PyMem_Free(self->groups);
    PyMem_Free(self->by_busy.data);
    PyMem_Free(self->capacities.data);
    PyMem_Free(self->slots);
    PyMem_Free(self->free_slots);
    Py_XDECREF(self->workers);
    Py_XDECREF(self->slot_of);
    Py_TYPE(self)->tp_free((PyObject *)self);
}

#define FAST (METH_FASTCALL)
static PyMethodDef DecodeRoom_methods[] = {
    {"add", (PyCFunction)DecodeRoom_add, METH_O, "a worker registered: it enters the room"},
    {"update", (PyCFunction)DecodeRoom_update, METH_O, "the worker's room or seats changed"},
    {"remove", (PyCFunction)DecodeRoom_remove, METH_O, "the worker of this peer id left"},
    {"best", (PyCFunction)(void (*)(void))DecodeRoom_best, FAST,
     "best(num_tokens, now, timeout_s): the worker with the most room that holds them"},
    {"max_tokens", (PyCFunction)(void (*)(void))DecodeRoom_max_tokens, FAST,
     "max_tokens(now, timeout_s)"},
    {"max_capacity", (PyCFunction)(void (*)(void))DecodeRoom_max_capacity, FAST,
     "max_capacity(now, timeout_s)"},
    {"least_busy", (PyCFunction)(void (*)(void))DecodeRoom_least_busy, FAST,
     "least_busy(num_tokens, now, timeout_s, excluded)"},
    {"has_seat", (PyCFunction)DecodeRoom_has_seat, METH_O, NULL},
    {"num_entries", (PyCFunction)DecodeRoom_num_entries, METH_NOARGS,
     "the entries in all heaps, live or stale"},
    {NULL, NULL, 0, NULL},
};

static PyTypeObject DecodeRoomType = {
    PyVarObject_HEAD_INIT(NULL, 0).tp_name = "_tandem_decode_room.DecodeRoom",
    .tp_basicsize = sizeof(DecodeRoom),
    .tp_dealloc = (destructor)DecodeRoom_dealloc,
    .tp_flags = Py_TPFLAGS_DEFAULT,
    .tp_doc = "The decode workers with a seat free (see worker_index.py)",
    .tp_methods = DecodeRoom_methods,
    .tp_new = DecodeRoom_new,
};

static struct PyModuleDef module = {
    PyModuleDef_HEAD_INIT, "_tandem_decode_room", NULL, -1, NULL, NULL, NULL, NULL, NULL,
};

PyMODINIT_FUNC PyInit__tandem_decode_room(void) {
    if (PyType_Ready(&DecodeRoomType) < 0) return NULL;
#define INTERN(var, text) \
    if ((var = PyUnicode_InternFromString(text)) == NULL) return NULL;
    INTERN(str_peer_id, "peer_id")
    INTERN(str_order, "order")
    INTERN(str_block_size, "block_size")
    INTERN(str_max_num_seqs, "max_num_seqs")
    INTERN(str_num_total_blocks, "num_total_blocks")
    INTERN(str_num_free_blocks, "num_free_blocks")
    INTERN(str_num_promised_blocks, "num_promised_blocks")
    INTERN(str_request_ids, "request_ids")
    INTERN(str_busy, "busy")
    INTERN(str_last_progress, "last_progress")
    PyObject *m = PyModule_Create(&module);
    if (m == NULL) return NULL;
    Py_INCREF(&DecodeRoomType);
    if (PyModule_AddObject(m, "DecodeRoom", (PyObject *)&DecodeRoomType) < 0) {
        Py_DECREF(&DecodeRoomType);
        Py_DECREF(m);
        return NULL;
    }
    return m;
}
