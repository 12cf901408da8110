/* The fair queue's indexes in C: `queue_index.py`'s QueueIndex, decision for decision.

   Loaded by `queue_index_native.py` (compiled on first use, `kernels/native_build.py`), which adds
   the rarely taken merged walks in Python on top of the walks here. The Python QueueIndex is the
   reference: `tests/unit/test_queue_index_native.py` drives both with the same changes and asks
   both the same questions after each.

   Layout: requests and backlogged parties live in slot arrays (a slot is reused once freed);
   Python dicts map request ids and parties to their slots (and keep the queue's order of
   insertion). Every heap holds plain C entries, never tuples:
   - arrivals: (arrival, sequence, request slot), one heap per kind (interactive, bulk) and one
     per kind and prompt-length bucket (lengths of one bit length); lazy: an entry is live while
     its slot holds the request of that sequence (sequences are never reused);
   - a party's requests: (-priority, prompt tokens, arrival, sequence, request slot), exact;
   - a class's backlogged parties: (counter, tenant, class, version, party); lazy: live while the
     party's slot holds that version (versions are never reused). Each entry holds a reference
     to its party, whose tenant and class order ties (as the tuples of the Python index do).
   All orders are total (sequences and versions are unique), so a heap's layout never changes an
   answer, only its cost. Lazy heaps are rebuilt from their live entries when more than twice
   the live ones plus REBUILD_SLACK, as `lazy_heap.py`.

   A walk (an in-order iterator over one heap) must not outlive a change of its heap: every
   heap counts its changes, and a walk that finds the count moved raises RuntimeError instead
   of reading a moved array. The objects held here form no cycles with the index (items and
   parties do not refer to it), so the type takes no part in the cyclic GC. */

#define PY_SSIZE_T_CLEAN
#include <Python.h>
#include <stdint.h>
#include <stdlib.h>
#include <string.h>

#include "native_common.h" /* slots, reading values, DEFINE_HEAP */

#define REBUILD_SLACK 64
#define NUM_BUCKETS 65 /* bit lengths 0..64 */

/* -- entries and their orders ------------------------------------------------------------ */

typedef struct {
    double arrival;
    int64_t seq;
    Py_ssize_t req;
} ArrivalEntry;

typedef struct {
    int64_t neg_priority;
    int64_t tokens;
    double arrival;
    int64_t seq;
    Py_ssize_t req;
} PartyEntry;

typedef struct {
    double counter;
    int64_t version;
    Py_ssize_t party_slot;
    PyObject *party; /* owned: (tenant, class_name), both str */
} CounterEntry;

/* Floats compare as tuples of floats do: the first unequal field decides (so a NaN, unequal to
   itself, decides as `<` does: false). */
static inline int arrival_less(const ArrivalEntry *a, const ArrivalEntry *b) {
    if (a->arrival != b->arrival) return a->arrival < b->arrival;
    return a->seq < b->seq;
}

static inline int party_less(const PartyEntry *a, const PartyEntry *b) {
    if (a->neg_priority != b->neg_priority) return a->neg_priority < b->neg_priority;
    if (a->tokens != b->tokens) return a->tokens < b->tokens;
    if (a->arrival != b->arrival) return a->arrival < b->arrival;
    return a->seq < b->seq;
}

/* The party's fields are str (checked when the party enters): PyUnicode_Compare cannot fail. */
static inline int counter_less(const CounterEntry *a, const CounterEntry *b) {
    if (a->counter != b->counter) return a->counter < b->counter;
    if (a->party != b->party) {
        int by_tenant = PyUnicode_Compare(PyTuple_GET_ITEM(a->party, 0),
                                          PyTuple_GET_ITEM(b->party, 0));
        if (by_tenant != 0) return by_tenant < 0;
        int by_class = PyUnicode_Compare(PyTuple_GET_ITEM(a->party, 1),
                                         PyTuple_GET_ITEM(b->party, 1));
        if (by_class != 0) return by_class < 0;
    }
    return a->version < b->version;
}

DEFINE_HEAP(ArrivalHeap, ArrivalEntry, arrival_less)
DEFINE_HEAP(PartyHeap, PartyEntry, party_less)
DEFINE_HEAP(CounterHeap, CounterEntry, counter_less)

/* -- the index's state ----------------------------------------------------------------------- */

typedef struct {
    PyObject *request_id; /* owned; NULL: the slot is free */
    PyObject *item;       /* owned */
    Py_ssize_t party_slot;
    int64_t seq; /* -1 while free */
    double arrival;
    int64_t tokens;
    int bulk, resumed, bits;
} Request;

typedef struct {
    PyObject *party; /* owned; NULL: the slot is free */
    PartyHeap heap;
    int64_t version;
    int64_t tokens; /* prompt tokens queued */
    int has_lengths;
    int64_t min_len, max_len;
    /* A request at a bound left: the bounds are recomputed before they are next read (kept
       only widening, they went stale; a walk then sorted every party that could no longer
       place anything, 6,000 a choice in the scale bench). */
    int lengths_stale;
    Py_ssize_t class_slot;
} PartySlot;

typedef struct {
    PyObject *name; /* owned */
    CounterHeap heap;
    Py_ssize_t num_parties;
    int has_lengths;
    int64_t min_len, max_len;
    int64_t entered; /* when it last became backlogged: class_names() keeps that order */
    int is_bulk;     /* the bulk class (`queued.BULK_CLASS`) */
} ClassSlot;

typedef struct {
    PyObject_HEAD
    PyObject *slot_of;       /* request id -> slot (int), in the order of queueing */
    PyObject *party_slot_of; /* party -> slot (int) */
    PyObject *class_slot_of; /* class name -> slot (int) */
    PyObject *resumed;       /* request id -> item */
    Request *requests;
    Py_ssize_t num_requests_cap;
    Py_ssize_t *free_requests;
    Py_ssize_t num_free_requests;
    PartySlot *parties;
    Py_ssize_t num_parties_cap;
    Py_ssize_t *free_parties;
    Py_ssize_t num_free_parties;
    ClassSlot *classes;
    Py_ssize_t num_classes;
    ArrivalHeap by_arrival[2];
    ArrivalHeap by_bucket[2][NUM_BUCKETS];
    int bucket_made[2][NUM_BUCKETS];
    Py_ssize_t num_by_bucket[2][NUM_BUCKETS];
    Py_ssize_t num_by_kind[2];
    int64_t tokens_by_kind[2];
    int64_t next_seq, next_version, next_entered;
} QueueIndex;

static PyObject *str_request_id, *str_priority, *str_num_prompt_tokens, *str_arrival, *str_bulk,
    *str_resumed, *str_interactive;
static PyObject *bulk_class_name; /* `queued.BULK_CLASS`, set by the loader */

/* -- slots ----------------------------------------------------------------------------------- */

static Py_ssize_t class_slot(QueueIndex *self, PyObject *name) {
    Py_ssize_t slot = lookup_slot(self->class_slot_of, name);
    if (slot >= 0 || PyErr_Occurred()) return slot;
    ClassSlot *grown = PyMem_Realloc(self->classes, (size_t)(self->num_classes + 1) *
                                                        sizeof(ClassSlot));
    if (grown == NULL) return PyErr_NoMemory(), -1;
    self->classes = grown;
    slot = self->num_classes;
    memset(&grown[slot], 0, sizeof(ClassSlot));
    if (put_slot(self->class_slot_of, name, slot) < 0) return -1;
    Py_INCREF(name);
    grown[slot].name = name;
    grown[slot].is_bulk = bulk_class_name != NULL && PyUnicode_Compare(name, bulk_class_name) == 0;
    self->num_classes++;
    return slot;
}

/* -- liveness and lazy heaps ----------------------------------------------------------------- */

static inline int arrival_live(QueueIndex *self, const ArrivalEntry *e) {
    return self->requests[e->req].seq == e->seq;
}

static inline int counter_live(QueueIndex *self, const CounterEntry *e) {
    PartySlot *p = &self->parties[e->party_slot];
    return p->party != NULL && p->version == e->version;
}

static ArrivalEntry *arrival_live_top(QueueIndex *self, ArrivalHeap *h) {
    while (h->len > 0 && !arrival_live(self, &h->data[0])) ArrivalHeap_pop(h);
    return h->len > 0 ? &h->data[0] : NULL;
}

static CounterEntry *counter_live_top(QueueIndex *self, CounterHeap *h) {
    while (h->len > 0 && !counter_live(self, &h->data[0])) {
        CounterEntry stale = CounterHeap_pop(h);
        Py_DECREF(stale.party);
    }
    return h->len > 0 ? &h->data[0] : NULL;
}

static int arrival_push(QueueIndex *self, ArrivalHeap *h, ArrivalEntry e, Py_ssize_t num_live) {
    if (ArrivalHeap_push(h, e) < 0) return -1;
    if (h->len > 2 * num_live + REBUILD_SLACK) {
        Py_ssize_t kept = 0;
        for (Py_ssize_t i = 0; i < h->len; i++)
            if (arrival_live(self, &h->data[i])) h->data[kept++] = h->data[i];
        h->len = kept;
        ArrivalHeap_heapify(h);
    }
    return 0;
}

static int counter_push(QueueIndex *self, CounterHeap *h, CounterEntry e, Py_ssize_t num_live) {
    Py_INCREF(e.party);
    if (CounterHeap_push(h, e) < 0) {
        Py_DECREF(e.party);
        return -1;
    }
    if (h->len > 2 * num_live + REBUILD_SLACK) {
        Py_ssize_t kept = 0;
        for (Py_ssize_t i = 0; i < h->len; i++) {
            if (counter_live(self, &h->data[i]))
                h->data[kept++] = h->data[i];
            else
                Py_DECREF(h->data[i].party);
        }
        h->len = kept;
        CounterHeap_heapify(h);
    }
    return 0;
}

/* -- numbers ------------------------------------------------------------------------------- */

static int bit_length(int64_t n) {
    uint64_t magnitude = n < 0 ? (uint64_t)0 - (uint64_t)n : (uint64_t)n;
    return magnitude == 0 ? 0 : 64 - __builtin_clzll(magnitude);
}

static int check_party(PyObject *party) {
    if (!PyTuple_Check(party) || PyTuple_GET_SIZE(party) != 2 ||
        !PyUnicode_Check(PyTuple_GET_ITEM(party, 0)) ||
        !PyUnicode_Check(PyTuple_GET_ITEM(party, 1))) {
        PyErr_SetString(PyExc_TypeError, "a party is a (tenant, class_name) tuple of str");
        return -1;
    }
    return 0;
}

static void widen(int *has, int64_t *low, int64_t *high, int64_t n) {
    if (!*has) {
        *has = 1;
        *low = *high = n;
    } else if (n < *low) {
        *low = n;
    } else if (n > *high) {
        *high = n;
    }
}

/* The party's queued prompt lengths, exact: recomputed if a request at a bound left. */
static PartySlot *party_bounds(PartySlot *p) {
    if (p->lengths_stale && p->heap.len > 0) {
        p->min_len = p->max_len = p->heap.data[0].tokens;
        for (Py_ssize_t i = 1; i < p->heap.len; i++) {
            int64_t tokens = p->heap.data[i].tokens;
            if (tokens < p->min_len) p->min_len = tokens;
            if (tokens > p->max_len) p->max_len = tokens;
        }
        p->lengths_stale = 0;
    }
    return p;
}

/* A backlogged party's slot, or -1 with KeyError. */
static Py_ssize_t backlogged_slot(QueueIndex *self, PyObject *party) {
    Py_ssize_t slot = lookup_slot(self->party_slot_of, party);
    if (slot < 0 && !PyErr_Occurred()) PyErr_SetObject(PyExc_KeyError, party);
    return slot;
}

static Py_ssize_t request_slot(QueueIndex *self, PyObject *request_id) {
    Py_ssize_t slot = lookup_slot(self->slot_of, request_id);
    if (slot < 0 && !PyErr_Occurred()) PyErr_SetObject(PyExc_KeyError, request_id);
    return slot;
}

/* -- changes --------------------------------------------------------------------------------- */

static int set_counter_of(QueueIndex *self, Py_ssize_t pslot, double counter) {
    PartySlot *p = &self->parties[pslot];
    p->version = self->next_version++;
    ClassSlot *c = &self->classes[p->class_slot];
    CounterEntry e = {counter, p->version, pslot, p->party};
    return counter_push(self, &c->heap, e, c->num_parties);
}

static PyObject *QueueIndex_add(QueueIndex *self, PyObject *const *args, Py_ssize_t nargs) {
    if (nargs != 3) {
        PyErr_SetString(PyExc_TypeError, "add(party, item, counter)");
        return NULL;
    }
    PyObject *party = args[0], *item = args[1];
    double counter = PyFloat_AsDouble(args[2]);
    if (counter == -1.0 && PyErr_Occurred()) return NULL;
    if (check_party(party) < 0) return NULL;
    int64_t priority, tokens;
    double arrival;
    int bulk, resumed;
    PyObject *request_id = PyObject_GetAttr(item, str_request_id);
    if (request_id == NULL) return NULL;
    if (get_int64(item, str_priority, &priority) < 0 ||
        get_int64(item, str_num_prompt_tokens, &tokens) < 0 ||
        get_double(item, str_arrival, &arrival) < 0 || get_truth(item, str_bulk, &bulk) < 0 ||
        get_truth(item, str_resumed, &resumed) < 0)
        goto error;
    if (priority == INT64_MIN) {
        PyErr_SetString(PyExc_OverflowError, "priority out of range");
        goto error;
    }
    int contains = PyDict_Contains(self->slot_of, request_id);
    if (contains != 0) {
        if (contains > 0) PyErr_Format(PyExc_ValueError, "request %R is already queued",
                                       request_id);
        goto error;
    }
    /* The party's slot (a new one if it enters: listed in its class, its counter pushed). */
    Py_ssize_t pslot = lookup_slot(self->party_slot_of, party);
    if (pslot < 0) {
        if (PyErr_Occurred()) goto error;
        Py_ssize_t cslot = class_slot(self, PyTuple_GET_ITEM(party, 1));
        if (cslot < 0) goto error;
        pslot = take_slot((void **)&self->parties, &self->num_parties_cap, &self->free_parties,
                          &self->num_free_parties, sizeof(PartySlot));
        if (pslot < 0) goto error;
        if (put_slot(self->party_slot_of, party, pslot) < 0) {
            self->free_parties[self->num_free_parties++] = pslot;
            goto error;
        }
        PartySlot *p = &self->parties[pslot];
        Py_INCREF(party);
        p->party = party;
        p->heap.len = 0;
        p->tokens = 0;
        p->has_lengths = 0;
        p->lengths_stale = 0;
        p->class_slot = cslot;
        ClassSlot *c = &self->classes[cslot];
        if (c->num_parties++ == 0) c->entered = self->next_entered++;
        if (set_counter_of(self, pslot, counter) < 0) goto error;
    }
    Py_ssize_t rslot = take_slot((void **)&self->requests, &self->num_requests_cap,
                                 &self->free_requests, &self->num_free_requests, sizeof(Request));
    if (rslot < 0) goto error;
    if (put_slot(self->slot_of, request_id, rslot) < 0) {
        self->free_requests[self->num_free_requests++] = rslot;
        goto error;
    }
    int64_t seq = self->next_seq++;
    int bits = bit_length(tokens);
    Request *r = &self->requests[rslot];
    r->request_id = request_id; /* the reference taken above */
    Py_INCREF(item);
    r->item = item;
    r->party_slot = pslot;
    r->seq = seq;
    r->arrival = arrival;
    r->tokens = tokens;
    r->bulk = bulk;
    r->resumed = resumed;
    r->bits = bits;
    PartySlot *p = &self->parties[pslot];
    PartyEntry key = {-priority, tokens, arrival, seq, rslot};
    if (PartyHeap_push(&p->heap, key) < 0) return NULL;
    self->num_by_kind[bulk]++;
    self->tokens_by_kind[bulk] += tokens;
    p->tokens += tokens;
    ArrivalEntry when = {arrival, seq, rslot};
    if (arrival_push(self, &self->by_arrival[bulk], when, self->num_by_kind[bulk]) < 0)
        return NULL;
    self->bucket_made[bulk][bits] = 1;
    self->num_by_bucket[bulk][bits]++;
    if (arrival_push(self, &self->by_bucket[bulk][bits], when, self->num_by_bucket[bulk][bits]) <
        0)
        return NULL;
    if (resumed && PyDict_SetItem(self->resumed, request_id, item) < 0) return NULL;
    widen(&p->has_lengths, &p->min_len, &p->max_len, tokens);
    ClassSlot *c = &self->classes[p->class_slot];
    widen(&c->has_lengths, &c->min_len, &c->max_len, tokens);
    Py_RETURN_NONE;
error:
    Py_DECREF(request_id);
    return NULL;
}

static void remove_from_party(PartySlot *p, Py_ssize_t rslot, int64_t tokens) {
    if (tokens == p->min_len || tokens == p->max_len) p->lengths_stale = 1;
    if (p->heap.data[0].req == rslot) { /* the usual case: the party's first is served */
        PartyHeap_pop(&p->heap);
        return;
    }
    Py_ssize_t kept = 0;
    for (Py_ssize_t i = 0; i < p->heap.len; i++)
        if (p->heap.data[i].req != rslot) p->heap.data[kept++] = p->heap.data[i];
    p->heap.len = kept;
    PartyHeap_heapify(&p->heap);
}

static PyObject *QueueIndex_discard(QueueIndex *self, PyObject *request_id) {
    Py_ssize_t rslot = lookup_slot(self->slot_of, request_id);
    if (rslot < 0) {
        if (PyErr_Occurred()) return NULL;
        Py_RETURN_NONE;
    }
    if (PyDict_DelItem(self->slot_of, request_id) < 0) return NULL;
    Request *r = &self->requests[rslot];
    if (r->resumed && PyDict_DelItem(self->resumed, request_id) < 0) PyErr_Clear();
    PartySlot *p = &self->parties[r->party_slot];
    self->num_by_kind[r->bulk]--;
    self->tokens_by_kind[r->bulk] -= r->tokens;
    p->tokens -= r->tokens;
    self->num_by_bucket[r->bulk][r->bits]--;
    remove_from_party(p, rslot, r->tokens);
    PyObject *found = PyTuple_Pack(2, p->party, r->item);
    Py_CLEAR(r->request_id);
    Py_CLEAR(r->item);
    r->seq = -1; /* its entries in the arrival heaps are stale now */
    self->free_requests[self->num_free_requests++] = rslot;
    return found;
}

static PyObject *QueueIndex_drop_party(QueueIndex *self, PyObject *party) {
    Py_ssize_t pslot = backlogged_slot(self, party);
    if (pslot < 0) return NULL;
    PartySlot *p = &self->parties[pslot];
    if (p->heap.len > 0) {
        PyErr_Format(PyExc_ValueError, "party %R still has requests queued", party);
        return NULL;
    }
    if (PyDict_DelItem(self->party_slot_of, party) < 0) return NULL;
    ClassSlot *c = &self->classes[p->class_slot];
    if (--c->num_parties == 0) c->has_lengths = 0;
    Py_CLEAR(p->party); /* its counter entries are stale now */
    self->free_parties[self->num_free_parties++] = pslot;
    Py_RETURN_NONE;
}

static PyObject *QueueIndex_set_counter(QueueIndex *self, PyObject *const *args,
                                        Py_ssize_t nargs) {
    if (nargs != 2) {
        PyErr_SetString(PyExc_TypeError, "set_counter(party, counter)");
        return NULL;
    }
    double counter = PyFloat_AsDouble(args[1]);
    if (counter == -1.0 && PyErr_Occurred()) return NULL;
    Py_ssize_t pslot = backlogged_slot(self, args[0]);
    if (pslot < 0) return NULL;
    if (set_counter_of(self, pslot, counter) < 0) return NULL;
    Py_RETURN_NONE;
}

/* -- views ----------------------------------------------------------------------------------- */

static int kind_of(PyObject *arg) { return PyObject_IsTrue(arg); }

static Py_ssize_t QueueIndex_len(QueueIndex *self) { return PyDict_GET_SIZE(self->slot_of); }

static int QueueIndex_contains(QueueIndex *self, PyObject *request_id) {
    return PyDict_Contains(self->slot_of, request_id);
}

static PyObject *QueueIndex_sequence_of(QueueIndex *self, PyObject *request_id) {
    Py_ssize_t rslot = request_slot(self, request_id);
    if (rslot < 0) return NULL;
    return PyLong_FromLongLong(self->requests[rslot].seq);
}

static PyObject *QueueIndex_party_of(QueueIndex *self, PyObject *request_id) {
    Py_ssize_t rslot = request_slot(self, request_id);
    if (rslot < 0) return NULL;
    PyObject *party = self->parties[self->requests[rslot].party_slot].party;
    Py_INCREF(party);
    return party;
}

static PyObject *QueueIndex_num_queued(QueueIndex *self, PyObject *bulk) {
    int kind = kind_of(bulk);
    if (kind < 0) return NULL;
    return PyLong_FromSsize_t(self->num_by_kind[kind]);
}

static PyObject *QueueIndex_num_queued_tokens(QueueIndex *self, PyObject *bulk) {
    int kind = kind_of(bulk);
    if (kind < 0) return NULL;
    return PyLong_FromLongLong(self->tokens_by_kind[kind]);
}

static PyObject *QueueIndex_num_parties(QueueIndex *self, PyObject *name) {
    Py_ssize_t cslot = lookup_slot(self->class_slot_of, name);
    if (cslot < 0 && PyErr_Occurred()) return NULL;
    return PyLong_FromSsize_t(cslot < 0 ? 0 : self->classes[cslot].num_parties);
}

static PyObject *QueueIndex_backlogged(QueueIndex *self, PyObject *party) {
    int found = PyDict_Contains(self->party_slot_of, party);
    if (found < 0) return NULL;
    return PyBool_FromLong(found);
}

static PyObject *QueueIndex_party_size(QueueIndex *self, PyObject *party) {
    Py_ssize_t pslot = backlogged_slot(self, party);
    if (pslot < 0) return NULL;
    return PyLong_FromSsize_t(self->parties[pslot].heap.len);
}

static PyObject *QueueIndex_queued_tokens_of(QueueIndex *self, PyObject *party) {
    Py_ssize_t pslot = lookup_slot(self->party_slot_of, party);
    if (pslot < 0 && PyErr_Occurred()) return NULL;
    return PyLong_FromLongLong(pslot < 0 ? 0 : self->parties[pslot].tokens);
}

static PyObject *QueueIndex_party_lengths(QueueIndex *self, PyObject *party) {
    Py_ssize_t pslot = backlogged_slot(self, party);
    if (pslot < 0) return NULL;
    PartySlot *p = party_bounds(&self->parties[pslot]);
    return Py_BuildValue("(LL)", (long long)p->min_len, (long long)p->max_len);
}

static PyObject *QueueIndex_class_lengths(QueueIndex *self, PyObject *name) {
    Py_ssize_t cslot = lookup_slot(self->class_slot_of, name);
    if (cslot < 0 && PyErr_Occurred()) return NULL;
    if (cslot < 0 || !self->classes[cslot].has_lengths) Py_RETURN_NONE;
    ClassSlot *c = &self->classes[cslot];
    return Py_BuildValue("(LL)", (long long)c->min_len, (long long)c->max_len);
}

static PyObject *QueueIndex_oldest(QueueIndex *self, PyObject *bulk) {
    int kind = kind_of(bulk);
    if (kind < 0) return NULL;
    ArrivalEntry *top = arrival_live_top(self, &self->by_arrival[kind]);
    if (top == NULL) Py_RETURN_NONE;
    PyObject *item = self->requests[top->req].item;
    Py_INCREF(item);
    return item;
}

static PyObject *QueueIndex_first_of(QueueIndex *self, PyObject *party) {
    Py_ssize_t pslot = backlogged_slot(self, party);
    if (pslot < 0) return NULL;
    PartyHeap *h = &self->parties[pslot].heap;
    if (h->len == 0) {
        PyErr_Format(PyExc_IndexError, "party %R has no request queued", party);
        return NULL;
    }
    PyObject *item = self->requests[h->data[0].req].item;
    Py_INCREF(item);
    return item;
}

static int party_entry_order(const void *a, const void *b) {
    return party_less(a, b) ? -1 : (party_less(b, a) ? 1 : 0);
}

static PyObject *QueueIndex_party_in_order(QueueIndex *self, PyObject *party) {
    Py_ssize_t pslot = backlogged_slot(self, party);
    if (pslot < 0) return NULL;
    PartyHeap *h = &self->parties[pslot].heap;
    PartyEntry *sorted = PyMem_Malloc((size_t)(h->len ? h->len : 1) * sizeof(PartyEntry));
    if (sorted == NULL) return PyErr_NoMemory();
    memcpy(sorted, h->data, (size_t)h->len * sizeof(PartyEntry));
    qsort(sorted, (size_t)h->len, sizeof(PartyEntry), party_entry_order);
    PyObject *items = PyList_New(h->len);
    if (items != NULL) {
        for (Py_ssize_t i = 0; i < h->len; i++) {
            PyObject *item = self->requests[sorted[i].req].item;
            Py_INCREF(item);
            PyList_SET_ITEM(items, i, item);
        }
    }
    PyMem_Free(sorted);
    return items;
}

static PyObject *QueueIndex_queued(QueueIndex *self, PyObject *unused) {
    PyObject *items = PyList_New(PyDict_GET_SIZE(self->slot_of));
    if (items == NULL) return NULL;
    Py_ssize_t pos = 0, i = 0;
    PyObject *key, *value;
    while (PyDict_Next(self->slot_of, &pos, &key, &value)) {
        PyObject *item = self->requests[PyLong_AsSsize_t(value)].item;
        Py_INCREF(item);
        PyList_SET_ITEM(items, i++, item);
    }
    return items;
}

static PyObject *QueueIndex_num_queued_by_party(QueueIndex *self, PyObject *unused) {
    PyObject *counts = PyDict_New();
    if (counts == NULL) return NULL;
    Py_ssize_t pos = 0;
    PyObject *party, *value;
    while (PyDict_Next(self->party_slot_of, &pos, &party, &value)) {
        PyObject *count = PyLong_FromSsize_t(self->parties[PyLong_AsSsize_t(value)].heap.len);
        if (count == NULL || PyDict_SetItem(counts, party, count) < 0) {
            Py_XDECREF(count);
            Py_DECREF(counts);
            return NULL;
        }
        Py_DECREF(count);
    }
    return counts;
}

static PyObject *QueueIndex_resumed_items(QueueIndex *self, PyObject *unused) {
    return PyDict_Values(self->resumed);
}

static PyObject *QueueIndex_class_names(QueueIndex *self, PyObject *unused) {
    /* The backlogged classes in the order they became backlogged (few: a sort by hand). */
    PyObject *names = PyList_New(0);
    if (names == NULL) return NULL;
    int64_t after = -1;
    for (;;) {
        Py_ssize_t next = -1;
        for (Py_ssize_t i = 0; i < self->num_classes; i++) {
            ClassSlot *c = &self->classes[i];
            if (c->num_parties > 0 && c->entered > after &&
                (next < 0 || c->entered < self->classes[next].entered))
                next = i;
        }
        if (next < 0) return names;
        if (PyList_Append(names, self->classes[next].name) < 0) {
            Py_DECREF(names);
            return NULL;
        }
        after = self->classes[next].entered;
    }
}

/* The live top of a named class's counter heap (NULL: none; -1 in *error on failure). */
static CounterEntry *class_top(QueueIndex *self, PyObject *name, int *error) {
    Py_ssize_t cslot = lookup_slot(self->class_slot_of, name);
    if (cslot < 0) {
        if (PyErr_Occurred()) *error = -1;
        return NULL;
    }
    return counter_live_top(self, &self->classes[cslot].heap);
}

static PyObject *QueueIndex_min_counter(QueueIndex *self, PyObject *class_names) {
    PyObject *names = PySequence_Fast(class_names, "class_names must be a sequence");
    if (names == NULL) return NULL;
    int error = 0, found = 0;
    double least = 0.0;
    for (Py_ssize_t i = 0; i < PySequence_Fast_GET_SIZE(names); i++) {
        CounterEntry *top = class_top(self, PySequence_Fast_GET_ITEM(names, i), &error);
        if (error) break;
        if (top != NULL && (!found || top->counter < least)) {
            least = top->counter;
            found = 1;
        }
    }
    Py_DECREF(names);
    if (error) return NULL;
    if (!found) Py_RETURN_NONE;
    return PyFloat_FromDouble(least);
}

/* lengths_meet(class_name, low, high): 1, 0, or -1 on error. */
static int lengths_meet(PyObject *meet, PyObject *name, int64_t low, int64_t high) {
    PyObject *answer = PyObject_CallFunction(meet, "OLL", name, (long long)low, (long long)high);
    if (answer == NULL) return -1;
    int truth = PyObject_IsTrue(answer);
    Py_DECREF(answer);
    return truth;
}

static PyObject *QueueIndex_least_served_party(QueueIndex *self, PyObject *const *args,
                                               Py_ssize_t nargs) {
    if (nargs != 2) {
        PyErr_SetString(PyExc_TypeError, "least_served_party(class_names, lengths_meet)");
        return NULL;
    }
    PyObject *names = PySequence_Fast(args[0], "class_names must be a sequence");
    if (names == NULL) return NULL;
    PyObject *meet = args[1];
    CounterEntry best = {0.0, 0, 0, NULL}; /* a copy: the callback runs between the reads */
    int found = 0;
    for (Py_ssize_t i = 0; i < PySequence_Fast_GET_SIZE(names); i++) {
        PyObject *name = PySequence_Fast_GET_ITEM(names, i);
        Py_ssize_t cslot = lookup_slot(self->class_slot_of, name);
        if (cslot < 0) {
            if (PyErr_Occurred()) goto error;
            continue;
        }
        ClassSlot *c = &self->classes[cslot];
        if (!c->has_lengths) continue;
        int meets = lengths_meet(meet, name, c->min_len, c->max_len);
        if (meets < 0) goto error;
        if (!meets) continue;
        CounterEntry *top = counter_live_top(self, &c->heap);
        if (top != NULL && (!found || counter_less(top, &best))) {
            best = *top;
            found = 1;
        }
    }
    Py_DECREF(names);
    if (!found) Py_RETURN_NONE;
    PartySlot *p = party_bounds(&self->parties[best.party_slot]);
    PyObject *party = p->party;
    Py_INCREF(party);
    int meets = lengths_meet(meet, PyTuple_GET_ITEM(party, 1), p->min_len, p->max_len);
    if (meets > 0) return party;
    Py_DECREF(party);
    if (meets < 0) return NULL;
    Py_RETURN_NONE;
error:
    Py_DECREF(names);
    return NULL;
}

/* -- walks: a heap's live entries smallest first, the heap left as it is ------------------- */

enum { WALK_ARRIVALS, WALK_COUNTERS };

typedef struct {
    PyObject_HEAD
    QueueIndex *index; /* owned */
    int what;
    int kind, bits;        /* arrivals: bits < 0 for the kind's heap, else a bucket's */
    Py_ssize_t class_slot; /* counters */
    uint64_t changes;      /* the heap's count of changes when the walk began */
    Py_ssize_t *frontier;  /* positions in the heap, itself a heap by their entries */
    Py_ssize_t len, cap;
} Walk;

static PyTypeObject WalkType;

static ArrivalHeap *walk_arrivals(Walk *w) {
    return w->bits < 0 ? &w->index->by_arrival[w->kind] : &w->index->by_bucket[w->kind][w->bits];
}

static CounterHeap *walk_counters(Walk *w) { return &w->index->classes[w->class_slot].heap; }

static int walk_less(Walk *w, Py_ssize_t a, Py_ssize_t b) {
    if (w->what == WALK_ARRIVALS) {
        ArrivalHeap *h = walk_arrivals(w);
        return arrival_less(&h->data[a], &h->data[b]);
    }
    CounterHeap *h = walk_counters(w);
    return counter_less(&h->data[a], &h->data[b]);
}

static int walk_push(Walk *w, Py_ssize_t position) {
    if (w->len == w->cap) {
        Py_ssize_t cap = w->cap ? 2 * w->cap : 16;
        Py_ssize_t *grown = PyMem_Realloc(w->frontier, (size_t)cap * sizeof(Py_ssize_t));
        if (grown == NULL) return PyErr_NoMemory(), -1;
        w->frontier = grown;
        w->cap = cap;
    }
    Py_ssize_t pos = w->len++;
    while (pos > 0) {
        Py_ssize_t parent = (pos - 1) >> 1;
        if (!walk_less(w, position, w->frontier[parent])) break;
        w->frontier[pos] = w->frontier[parent];
        pos = parent;
    }
    w->frontier[pos] = position;
    return 0;
}

static Py_ssize_t walk_pop(Walk *w) {
    Py_ssize_t top = w->frontier[0], last = w->frontier[--w->len], pos = 0;
    for (;;) {
        Py_ssize_t child = 2 * pos + 1;
        if (child >= w->len) break;
        if (child + 1 < w->len && walk_less(w, w->frontier[child + 1], w->frontier[child]))
            child++;
        if (!walk_less(w, w->frontier[child], last)) break;
        w->frontier[pos] = w->frontier[child];
        pos = child;
    }
    if (w->len > 0) w->frontier[pos] = last;
    return top;
}

static PyObject *walk_new(QueueIndex *index, int what, int kind, int bits, Py_ssize_t cslot) {
    Walk *w = PyObject_New(Walk, &WalkType);
    if (w == NULL) return NULL;
    Py_INCREF(index);
    w->index = index;
    w->what = what;
    w->kind = kind;
    w->bits = bits;
    w->class_slot = cslot;
    w->frontier = NULL;
    w->len = w->cap = 0;
    Py_ssize_t size;
    if (what == WALK_ARRIVALS) {
        ArrivalHeap *h = walk_arrivals(w);
        arrival_live_top(index, h);
        w->changes = h->changes;
        size = h->len;
    } else {
        CounterHeap *h = walk_counters(w);
        counter_live_top(index, h);
        w->changes = h->changes;
        size = h->len;
    }
    if (size > 0 && walk_push(w, 0) < 0) {
        Py_DECREF(w);
        return NULL;
    }
    return (PyObject *)w;
}

static void Walk_dealloc(Walk *w) {
    Py_XDECREF(w->index);
    PyMem_Free(w->frontier);
    PyObject_Free(w);
}

static PyObject *Walk_next(Walk *w) {
    uint64_t changes;
    Py_ssize_t size;
    if (w->what == WALK_ARRIVALS) {
        changes = walk_arrivals(w)->changes;
        size = walk_arrivals(w)->len;
    } else {
        changes = walk_counters(w)->changes;
        size = walk_counters(w)->len;
    }
    if (changes != w->changes) {
        PyErr_SetString(PyExc_RuntimeError, "the queue changed during a walk over it");
        return NULL;
    }
    while (w->len > 0) {
        Py_ssize_t position = walk_pop(w);
        Py_ssize_t child = 2 * position + 1;
        if (child < size && walk_push(w, child) < 0) return NULL;
        if (child + 1 < size && walk_push(w, child + 1) < 0) return NULL;
        if (w->what == WALK_ARRIVALS) {
            ArrivalEntry *e = &walk_arrivals(w)->data[position];
            if (arrival_live(w->index, e))
                return Py_BuildValue("(dLO)", e->arrival, (long long)e->seq,
                                     w->index->requests[e->req].item);
        } else {
            CounterEntry *e = &walk_counters(w)->data[position];
            if (counter_live(w->index, e))
                return Py_BuildValue("(dOOLO)", e->counter, PyTuple_GET_ITEM(e->party, 0),
                                     PyTuple_GET_ITEM(e->party, 1), (long long)e->version,
                                     e->party);
        }
    }
    return NULL; /* StopIteration */
}

static PyTypeObject WalkType = {
    PyVarObject_HEAD_INIT(NULL, 0).tp_name = "_tandem_queue_index.Walk",
    .tp_basicsize = sizeof(Walk),
    .tp_dealloc = (destructor)Walk_dealloc,
    .tp_flags = Py_TPFLAGS_DEFAULT,
    .tp_iter = PyObject_SelfIter,
    .tp_iternext = (iternextfunc)Walk_next,
};

static PyObject *QueueIndex_arrival_walk(QueueIndex *self, PyObject *const *args,
                                         Py_ssize_t nargs) {
    if (nargs != 2) {
        PyErr_SetString(PyExc_TypeError, "arrival_walk(bulk, bits): bits -1 for every length");
        return NULL;
    }
    int kind = kind_of(args[0]);
    if (kind < 0) return NULL;
    long bits = PyLong_AsLong(args[1]);
    if (bits == -1 && PyErr_Occurred()) return NULL;
    if (bits < -1 || bits >= NUM_BUCKETS) {
        PyErr_Format(PyExc_ValueError, "bits must be -1 to %d, got %ld", NUM_BUCKETS - 1, bits);
        return NULL;
    }
    return walk_new(self, WALK_ARRIVALS, kind, (int)bits, 0);
}

static PyObject *QueueIndex_counter_walk(QueueIndex *self, PyObject *name) {
    Py_ssize_t cslot = lookup_slot(self->class_slot_of, name);
    if (cslot < 0) {
        if (PyErr_Occurred()) return NULL;
        PyObject *none = PyTuple_New(0); /* no such class: an empty walk */
        if (none == NULL) return NULL;
        PyObject *walk = PyObject_GetIter(none);
        Py_DECREF(none);
        return walk;
    }
    return walk_new(self, WALK_COUNTERS, 0, 0, cslot);
}

static PyObject *QueueIndex_bucket_bits(QueueIndex *self, PyObject *bulk) {
    int kind = kind_of(bulk);
    if (kind < 0) return NULL;
    PyObject *found = PyList_New(0);
    if (found == NULL) return NULL;
    for (int bits = 0; bits < NUM_BUCKETS; bits++) {
        if (!self->bucket_made[kind][bits]) continue;
        PyObject *value = PyLong_FromLong(bits);
        if (value == NULL || PyList_Append(found, value) < 0) {
            Py_XDECREF(value);
            Py_DECREF(found);
            return NULL;
        }
        Py_DECREF(value);
    }
    return found;
}

/* -- the fair choice (`FairQueue._choose_with_bulk` and what it calls) ----------------------

   The policy's choice made here in one call, step for step as `fair_share.py` makes it with the
   Python index, which stays its reference (the core's twin test runs both). `admissible` is
   checked here when it is the `LengthRanges` given as `lengths` (as the core's dispatch passes
   it), else called. */

#define MAX_RANGES 16

typedef struct {
    int64_t lo, hi;
} Range;

typedef struct {
    QueueIndex *index;
    double now, max_wait, bulk_max_wait;
    int fcfs;
    PyObject *admissible; /* NULL: checked here against the ranges */
    int has_lengths;      /* `lengths` given: whole parties, classes, buckets passed over */
    Range ranges[2][MAX_RANGES];
    Py_ssize_t num_ranges[2];
} Choice;

static int read_ranges(PyObject *pairs, Range *out, Py_ssize_t *num) {
    PyObject *seq = PySequence_Fast(pairs, "LengthRanges holds tuples of (low, high)");
    if (seq == NULL) return -1;
    Py_ssize_t n = PySequence_Fast_GET_SIZE(seq);
    if (n > MAX_RANGES) {
        PyErr_Format(PyExc_ValueError, "at most %d length ranges per kind", MAX_RANGES);
        Py_DECREF(seq);
        return -1;
    }
    for (Py_ssize_t i = 0; i < n; i++) {
        long long lo, hi;
        if (!PyArg_ParseTuple(PySequence_Fast_GET_ITEM(seq, i), "LL", &lo, &hi)) {
            Py_DECREF(seq);
            return -1;
        }
        out[i].lo = lo;
        out[i].hi = hi;
    }
    *num = n;
    Py_DECREF(seq);
    return 0;
}

/* `LengthRanges.meet`: whether some range of the kind meets [low, high]. */
static int ranges_meet(Choice *c, int bulk, int64_t low, int64_t high) {
    if (!c->has_lengths) return 1;
    for (Py_ssize_t i = 0; i < c->num_ranges[bulk]; i++)
        if (c->ranges[bulk][i].lo <= high && low <= c->ranges[bulk][i].hi) return 1;
    return 0;
}

/* A length bucket's lengths: those of bit length `bits` (64: INT64_MIN's alone). */
static void bucket_lengths(int bits, int64_t *low, int64_t *high) {
    *low = bits == 0 ? 0 : (bits >= 64 ? INT64_MAX : (int64_t)1 << (bits - 1));
    *high = bits == 0 ? 0 : (bits >= 63 ? INT64_MAX : ((int64_t)1 << bits) - 1);
}

/* 1, 0, or -1 on error. */
static int admissible(Choice *c, Py_ssize_t rslot) {
    Request *r = &c->index->requests[rslot];
    if (c->admissible == NULL) {
        for (Py_ssize_t i = 0; i < c->num_ranges[r->bulk]; i++)
            if (c->ranges[r->bulk][i].lo <= r->tokens && r->tokens <= c->ranges[r->bulk][i].hi)
                return 1;
        return 0;
    }
    PyObject *answer = PyObject_CallOneArg(c->admissible, r->item);
    if (answer == NULL) return -1;
    int truth = PyObject_IsTrue(answer);
    Py_DECREF(answer);
    return truth;
}

static int eligible(Choice *c, Py_ssize_t rslot) {
    Request *r = &c->index->requests[rslot];
    return !r->bulk || c->now - r->arrival >= c->bulk_max_wait;
}

static int earlier(QueueIndex *self, Py_ssize_t a, Py_ssize_t b) {
    Request *x = &self->requests[a], *y = &self->requests[b];
    ArrivalEntry ex = {x->arrival, x->seq, a}, ey = {y->arrival, y->seq, b};
    return !arrival_less(&ey, &ex); /* ties: the first (a) */
}

/* The first admissible resuming request (eligible ones only, if asked), oldest first. */
static int first_resuming(Choice *c, int only_eligible, Py_ssize_t *found) {
    *found = -1;
    QueueIndex *self = c->index;
    Py_ssize_t n = PyDict_GET_SIZE(self->resumed);
    if (n == 0) return 0;
    ArrivalEntry *order = PyMem_Malloc((size_t)n * sizeof(ArrivalEntry));
    if (order == NULL) return PyErr_NoMemory(), -1;
    Py_ssize_t pos = 0, count = 0;
    PyObject *key, *value;
    while (PyDict_Next(self->resumed, &pos, &key, &value)) {
        Py_ssize_t rslot = lookup_slot(self->slot_of, key);
        if (rslot < 0) {
            PyMem_Free(order);
            if (!PyErr_Occurred()) PyErr_SetObject(PyExc_KeyError, key);
            return -1;
        }
        if (only_eligible && !eligible(c, rslot)) continue;
        Request *r = &self->requests[rslot];
        ArrivalEntry e = {r->arrival, r->seq, rslot};
        order[count++] = e;
    }
    /* few: insertion sort */
    for (Py_ssize_t i = 1; i < count; i++) {
        ArrivalEntry e = order[i];
        Py_ssize_t j = i;
        for (; j > 0 && arrival_less(&e, &order[j - 1]); j--) order[j] = order[j - 1];
        order[j] = e;
    }
    int status = 0;
    for (Py_ssize_t i = 0; i < count; i++) {
        int ok = admissible(c, order[i].req);
        if (ok < 0) {
            status = -1;
            break;
        }
        if (ok) {
            *found = order[i].req;
            break;
        }
    }
    PyMem_Free(order);
    return status;
}

/* A cursor: one lazy heap's live entries smallest first, the heap left as it is. */
typedef struct {
    Py_ssize_t *frontier;
    Py_ssize_t len, cap;
} Cursor;

#define DEFINE_CURSOR(NAME, HEAP, ENTRY, LESS, LIVE)                                          \
    static int NAME##_push(Cursor *k, HEAP *h, Py_ssize_t position) {                         \
        if (k->len == k->cap) {                                                               \
            Py_ssize_t cap = k->cap ? 2 * k->cap : 16;                                        \
            Py_ssize_t *grown = PyMem_Realloc(k->frontier, (size_t)cap * sizeof(Py_ssize_t)); \
            if (grown == NULL) return PyErr_NoMemory(), -1;                                   \
            k->frontier = grown;                                                              \
            k->cap = cap;                                                                     \
        }                                                                                     \
        Py_ssize_t pos = k->len++;                                                            \
        while (pos > 0) {                                                                     \
            Py_ssize_t parent = (pos - 1) >> 1;                                               \
            if (!LESS(&h->data[position], &h->data[k->frontier[parent]])) break;              \
            k->frontier[pos] = k->frontier[parent];                                           \
            pos = parent;                                                                     \
        }                                                                                     \
        k->frontier[pos] = position;                                                          \
        return 0;                                                                             \
    }                                                                                         \
    /* The next live entry, or NULL (at the end, or on error: -1 in *error). */               \
    static ENTRY *NAME##_next(QueueIndex *self, Cursor *k, HEAP *h, int *error) {             \
        while (k->len > 0) {                                                                  \
            Py_ssize_t top = k->frontier[0], last = k->frontier[--k->len], pos = 0;           \
            for (;;) {                                                                        \
                Py_ssize_t child = 2 * pos + 1;                                               \
                if (child >= k->len) break;                                                   \
                if (child + 1 < k->len &&                                                     \
                    LESS(&h->data[k->frontier[child + 1]], &h->data[k->frontier[child]]))     \
                    child++;                                                                  \
                if (!LESS(&h->data[k->frontier[child]], &h->data[last])) break;               \
                k->frontier[pos] = k->frontier[child];                                        \
                pos = child;                                                                  \
            }                                                                                 \
            if (k->len > 0) k->frontier[pos] = last;                                          \
            Py_ssize_t child = 2 * top + 1;                                                   \
            if ((child < h->len && NAME##_push(k, h, child) < 0) ||                           \
                (child + 1 < h->len && NAME##_push(k, h, child + 1) < 0)) {                   \
                *error = -1;                                                                  \
                return NULL;                                                                  \
            }                                                                                 \
            if (LIVE(self, &h->data[top])) return &h->data[top];                              \
        }                                                                                     \
        return NULL;                                                                          \
    }

DEFINE_CURSOR(arrival_cursor, ArrivalHeap, ArrivalEntry, arrival_less, arrival_live)
DEFINE_CURSOR(counter_cursor, CounterHeap, CounterEntry, counter_less, counter_live)

#define MAX_STREAMS (2 * NUM_BUCKETS)

/* Several heaps' walks merged (arrivals: the overdue; counters: the parties by counter). */
typedef struct {
    Cursor cursor;
    void *heap;
    void *head; /* its next live entry; NULL: done */
    int kind;
} Stream;

static void free_streams(Stream *streams, int n) {
    for (int i = 0; i < n; i++) PyMem_Free(streams[i].cursor.frontier);
}

/* The first admissible overdue request, oldest first (ties: the first queued), in `found`;
   of the lengths `lengths` may place, if given. */
static int oldest_overdue(Choice *c, Py_ssize_t *found) {
    *found = -1;
    QueueIndex *self = c->index;
    Stream streams[MAX_STREAMS];
    int n = 0, error = 0, done[2] = {0, 0}, status = 0;
    for (int kind = 0; kind < 2; kind++) {
        for (int bits = -1; bits < NUM_BUCKETS; bits++) {
            ArrivalHeap *h;
            if (!c->has_lengths) {
                if (bits >= 0) break;
                h = &self->by_arrival[kind];
            } else {
                if (bits < 0) continue;
                int64_t low, high;
                bucket_lengths(bits, &low, &high);
                if (!self->bucket_made[kind][bits] || !ranges_meet(c, kind, low, high)) continue;
                h = &self->by_bucket[kind][bits];
            }
            arrival_live_top(self, h);
            Stream *s = &streams[n++];
            memset(s, 0, sizeof(Stream));
            s->heap = h;
            s->kind = kind;
            if (h->len > 0 && arrival_cursor_push(&s->cursor, h, 0) < 0) goto fail;
            s->head = arrival_cursor_next(self, &s->cursor, h, &error);
            if (error) goto fail;
        }
    }
    for (;;) {
        int best = -1;
        for (int i = 0; i < n; i++)
            if (streams[i].head != NULL && !done[streams[i].kind] &&
                (best < 0 || arrival_less(streams[i].head, streams[best].head)))
                best = i;
        if (best < 0) break;
        Stream *s = &streams[best];
        ArrivalEntry *e = s->head;
        double age = c->now - e->arrival;
        if (age < c->max_wait || (s->kind && age < c->bulk_max_wait)) {
            done[s->kind] = 1; /* the rest of its kind came later still */
            continue;
        }
        int ok = admissible(c, e->req);
        if (ok < 0) goto fail;
        if (ok) {
            *found = e->req;
            break;
        }
        s->head = arrival_cursor_next(self, &s->cursor, s->heap, &error);
        if (error) goto fail;
    }
    free_streams(streams, n);
    return status;
fail:
    free_streams(streams, n);
    return -1;
}

/* Whether a request passes the choice's filter: eligible (if asked) and admissible. */
static int passes(Choice *c, Py_ssize_t rslot, int only_eligible) {
    if (only_eligible && !eligible(c, rslot)) return 0;
    return admissible(c, rslot);
}

/* A party's first passing request in its order (sorted only past the first). */
static int party_pick(Choice *c, PartySlot *p, int only_eligible, Py_ssize_t *found) {
    *found = -1;
    PartyHeap *h = &p->heap;
    if (h->len == 0) return 0;
    int ok = passes(c, h->data[0].req, only_eligible);
    if (ok != 0) {
        if (ok > 0) *found = h->data[0].req;
        return ok < 0 ? -1 : 0;
    }
    PartyEntry *sorted = PyMem_Malloc((size_t)h->len * sizeof(PartyEntry));
    if (sorted == NULL) return PyErr_NoMemory(), -1;
    memcpy(sorted, h->data, (size_t)h->len * sizeof(PartyEntry));
    qsort(sorted, (size_t)h->len, sizeof(PartyEntry), party_entry_order);
    int status = 0;
    for (Py_ssize_t i = 1; i < h->len; i++) {
        ok = passes(c, sorted[i].req, only_eligible);
        if (ok < 0) {
            status = -1;
            break;
        }
        if (ok) {
            *found = sorted[i].req;
            break;
        }
    }
    PyMem_Free(sorted);
    return status;
}

static int class_meets(Choice *c, ClassSlot *k) {
    return k->has_lengths && ranges_meet(c, k->is_bulk, k->min_len, k->max_len);
}

static int party_meets(Choice *c, PartySlot *p) {
    party_bounds(p);
    return ranges_meet(c, c->index->classes[p->class_slot].is_bulk, p->min_len, p->max_len);
}

/* Whether some queued request's length may lie in the choice's ranges (by the buckets'
   counts, which removals keep exact). When none can, the walk over every party is spared:
   a full decode pool asks for prompts shorter than any queued, at every dispatch. */
static int some_length_fits(Choice *c) {
    for (int kind = 0; kind < 2; kind++)
        for (int bits = 0; bits < NUM_BUCKETS; bits++) {
            int64_t low, high;
            bucket_lengths(bits, &low, &high);
            if (c->index->num_by_bucket[kind][bits] > 0 && ranges_meet(c, kind, low, high))
                return 1;
        }
    return 0;
}

/* The fair choice: the first passing request of the least-served backlogged party (ties: by
   tenant, then class) among the classes in `wanted` (a flag per class slot). */
static int least_served(Choice *c, const char *wanted, int only_eligible, Py_ssize_t *found) {
    *found = -1;
    QueueIndex *self = c->index;
    CounterEntry *best = NULL;
    for (Py_ssize_t i = 0; i < self->num_classes; i++) {
        ClassSlot *k = &self->classes[i];
        if (!wanted[i] || !class_meets(c, k)) continue;
        CounterEntry *top = counter_live_top(self, &k->heap);
        if (top != NULL && (best == NULL || counter_less(top, best))) best = top;
    }
    if (best == NULL) return 0; /* no class both wanted and meeting the lengths */
    PartySlot *p = &self->parties[best->party_slot];
    if (p->heap.len > 0 && party_meets(c, p)) { /* the usual case at once */
        int ok = passes(c, p->heap.data[0].req, only_eligible);
        if (ok < 0) return -1;
        if (ok) {
            *found = p->heap.data[0].req;
            return 0;
        }
    }
    /* (lengths given promise that no request outside them is admissible) */
    if (c->has_lengths && !some_length_fits(c)) return 0;
    Stream *streams = PyMem_Calloc((size_t)self->num_classes, sizeof(Stream));
    if (streams == NULL) return PyErr_NoMemory(), -1;
    int n = 0, error = 0;
    for (Py_ssize_t i = 0; i < self->num_classes; i++) {
        ClassSlot *k = &self->classes[i];
        if (!wanted[i] || !class_meets(c, k)) continue;
        Stream *s = &streams[n++];
        memset(s, 0, sizeof(Stream));
        s->heap = &k->heap;
        if (k->heap.len > 0 && counter_cursor_push(&s->cursor, &k->heap, 0) < 0) goto fail;
        s->head = counter_cursor_next(self, &s->cursor, &k->heap, &error);
        if (error) goto fail;
    }
    for (;;) {
        int at = -1;
        for (int i = 0; i < n; i++)
            if (streams[i].head != NULL && (at < 0 || counter_less(streams[i].head, streams[at].head)))
                at = i;
        if (at < 0) break;
        Stream *s = &streams[at];
        PartySlot *party = &self->parties[((CounterEntry *)s->head)->party_slot];
        if (party_meets(c, party)) {
            if (party_pick(c, party, only_eligible, found) < 0) goto fail;
            if (*found >= 0) break;
        }
        s->head = counter_cursor_next(self, &s->cursor, s->heap, &error);
        if (error) goto fail;
    }
    free_streams(streams, n);
    PyMem_Free(streams);
    return 0;
fail:
    free_streams(streams, n);
    PyMem_Free(streams);
    return -1;
}

static int choose_interactive(Choice *c, int someone_overdue, Py_ssize_t oldest, Py_ssize_t aged,
                              int last_was_aged, Py_ssize_t *found, int *by_aging) {
    *found = -1;
    *by_aging = 0;
    if (oldest < 0 && aged < 0) return 0;
    if (first_resuming(c, 1, found) < 0) return -1;
    if (*found >= 0) return 0;
    QueueIndex *self = c->index;
    if (c->fcfs) { /* strict: the oldest, or no one (head-of-line blocking) */
        Py_ssize_t first = oldest < 0 ? aged : (aged < 0 || earlier(self, oldest, aged) ? oldest : aged);
        int ok = admissible(c, first);
        if (ok > 0) *found = first;
        return ok < 0 ? -1 : 0;
    }
    Py_ssize_t overdue = -1;
    if (someone_overdue && oldest_overdue(c, &overdue) < 0) return -1;
    if (overdue >= 0 && !last_was_aged) {
        *found = overdue;
        *by_aging = 1;
        return 0;
    }
    char wanted[self->num_classes + 1];
    for (Py_ssize_t i = 0; i < self->num_classes; i++)
        wanted[i] = self->classes[i].num_parties > 0 && (!self->classes[i].is_bulk || aged >= 0);
    Py_ssize_t fair;
    if (least_served(c, wanted, 1, &fair) < 0) return -1;
    if (fair < 0) {
        *found = overdue;
        *by_aging = overdue >= 0;
        return 0;
    }
    *found = fair;
    *by_aging = fair == overdue;
    return 0;
}

static int choose_bulk(Choice *c, Py_ssize_t *found) {
    *found = -1;
    QueueIndex *self = c->index;
    if (PyDict_GET_SIZE(self->slot_of) == 0) return 0;
    if (first_resuming(c, 0, found) < 0) return -1;
    if (*found >= 0) return 0;
    if (c->fcfs) {
        ArrivalEntry *a = arrival_live_top(self, &self->by_arrival[0]);
        ArrivalEntry *b = arrival_live_top(self, &self->by_arrival[1]);
        Py_ssize_t first = a == NULL ? b->req : (b == NULL || earlier(self, a->req, b->req) ? a->req : b->req);
        int ok = admissible(c, first);
        if (ok > 0) *found = first;
        return ok < 0 ? -1 : 0;
    }
    char wanted[self->num_classes + 1];
    for (Py_ssize_t i = 0; i < self->num_classes; i++)
        wanted[i] = self->classes[i].num_parties > 0 && self->classes[i].is_bulk;
    return least_served(c, wanted, 0, found);
}

/* choose(now, admissible, lengths, last_was_aged, max_wait_s, bulk_max_wait_s, fcfs)
   -> (request or None, chosen by aging, no one overdue) */
static PyObject *QueueIndex_choose(QueueIndex *self, PyObject *const *args, Py_ssize_t nargs) {
    if (nargs != 7) {
        PyErr_SetString(PyExc_TypeError, "choose(now, admissible, lengths, last_was_aged, "
                                         "max_wait_s, bulk_max_wait_s, fcfs)");
        return NULL;
    }
    Choice c;
    memset(&c, 0, sizeof(Choice));
    c.index = self;
    c.now = PyFloat_AsDouble(args[0]);
    c.max_wait = PyFloat_AsDouble(args[4]);
    c.bulk_max_wait = PyFloat_AsDouble(args[5]);
    if (PyErr_Occurred()) return NULL;
    int last_was_aged = PyObject_IsTrue(args[3]), fcfs = PyObject_IsTrue(args[6]);
    if (last_was_aged < 0 || fcfs < 0) return NULL;
    c.fcfs = fcfs;
    PyObject *lengths = args[2];
    c.has_lengths = lengths != Py_None;
    if (c.has_lengths) {
        PyObject *interactive = PyObject_GetAttr(lengths, str_interactive);
        if (interactive == NULL) return NULL;
        int status = read_ranges(interactive, c.ranges[0], &c.num_ranges[0]);
        Py_DECREF(interactive);
        if (status < 0) return NULL;
        PyObject *bulk = PyObject_GetAttr(lengths, str_bulk);
        if (bulk == NULL) return NULL;
        status = read_ranges(bulk, c.ranges[1], &c.num_ranges[1]);
        Py_DECREF(bulk);
        if (status < 0) return NULL;
    }
    c.admissible = (c.has_lengths && args[1] == lengths) ? NULL : args[1];
    ArrivalEntry *top = arrival_live_top(self, &self->by_arrival[0]);
    Py_ssize_t oldest = top ? top->req : -1;
    top = arrival_live_top(self, &self->by_arrival[1]);
    Py_ssize_t aged = top ? top->req : -1;
    if (aged >= 0 && c.now - self->requests[aged].arrival < c.bulk_max_wait) aged = -1;
    int someone_overdue =
        (oldest >= 0 && c.now - self->requests[oldest].arrival >= c.max_wait) ||
        (aged >= 0 && c.now - self->requests[aged].arrival >= c.max_wait);
    if (!someone_overdue) last_was_aged = 0;
    Py_ssize_t found = -1;
    int by_aging = 0;
    if (!(c.has_lengths && c.num_ranges[0] == 0 && c.num_ranges[1] == 0)) {
        if (choose_interactive(&c, someone_overdue, oldest, aged, last_was_aged, &found,
                               &by_aging) < 0)
            return NULL;
        if (found < 0) { /* work conservation: what interactive work leaves goes to bulk */
            by_aging = 0;
            if (choose_bulk(&c, &found) < 0) return NULL;
        }
    }
    return Py_BuildValue("(OOO)", found >= 0 ? self->requests[found].item : Py_None,
                         by_aging ? Py_True : Py_False, someone_overdue ? Py_False : Py_True);
}

static PyObject *set_bulk_class(PyObject *module, PyObject *name) {
    if (!PyUnicode_Check(name)) {
        PyErr_SetString(PyExc_TypeError, "the bulk class is a str");
        return NULL;
    }
    Py_INCREF(name);
    Py_XSETREF(bulk_class_name, name);
    Py_RETURN_NONE;
}

/* -- the type -------------------------------------------------------------------------------- */

static PyObject *QueueIndex_new(PyTypeObject *type, PyObject *args, PyObject *kwargs) {
    if (PyTuple_GET_SIZE(args) != 0 || (kwargs != NULL && PyDict_GET_SIZE(kwargs) != 0)) {
        PyErr_SetString(PyExc_TypeError, "QueueIndex() takes no arguments");
        return NULL;
    }
    QueueIndex *self = (QueueIndex *)type->tp_alloc(type, 0); /* zeroed */
    if (self == NULL) return NULL;
    self->slot_of = PyDict_New();
    self->party_slot_of = PyDict_New();
    self->class_slot_of = PyDict_New();
    self->resumed = PyDict_New();
    if (!self->slot_of || !self->party_slot_of || !self->class_slot_of || !self->resumed) {
        Py_DECREF(self);
        return NULL;
    }
    return (PyObject *)self;
}

static void QueueIndex_dealloc(QueueIndex *self) {
    for (Py_ssize_t i = 0; i < self->num_requests_cap; i++) {
        Py_XDECREF(self->requests[i].request_id);
        Py_XDECREF(self->requests[i].item);
    }
    for (Py_ssize_t i = 0; i < self->num_parties_cap; i++) {
        Py_XDECREF(self->parties[i].party);
        PyMem_Free(self->parties[i].heap.data);
    }
    for (Py_ssize_t i = 0; i < self->num_classes; i++) {
        CounterHeap *h = &self->classes[i].heap;
        for (Py_ssize_t j = 0; j < h->len; j++) Py_DECREF(h->data[j].party);
        PyMem_Free(h->data);
        Py_DECREF(self->classes[i].name);
    }
    for (int kind = 0; kind < 2; kind++) {
        PyMem_Free(self->by_arrival[kind].data);
        for (int bits = 0; bits < NUM_BUCKETS; bits++) PyMem_Free(self->by_bucket[kind][bits].data);
    }
    PyMem_Free(self->requests);
    PyMem_Free(self->free_requests);
    PyMem_Free(self->parties);
    PyMem_Free(self->free_parties);
    PyMem_Free(self->classes);
    Py_XDECREF(self->slot_of);
    Py_XDECREF(self->party_slot_of);
    Py_XDECREF(self->class_slot_of);
    Py_XDECREF(self->resumed);
    Py_TYPE(self)->tp_free((PyObject *)self);
}

#define FAST (METH_FASTCALL)
static PyMethodDef QueueIndex_methods[] = {
    {"add", (PyCFunction)(void (*)(void))QueueIndex_add, FAST, "add(party, item, counter)"},
    {"discard", (PyCFunction)QueueIndex_discard, METH_O, "(party, item), or None"},
    {"drop_party", (PyCFunction)QueueIndex_drop_party, METH_O, "an emptied party leaves"},
    {"set_counter", (PyCFunction)(void (*)(void))QueueIndex_set_counter, FAST,
     "set_counter(party, counter)"},
    {"sequence_of", (PyCFunction)QueueIndex_sequence_of, METH_O, NULL},
    {"party_of", (PyCFunction)QueueIndex_party_of, METH_O, NULL},
    {"num_queued", (PyCFunction)QueueIndex_num_queued, METH_O, NULL},
    {"num_queued_tokens", (PyCFunction)QueueIndex_num_queued_tokens, METH_O, NULL},
    {"num_parties", (PyCFunction)QueueIndex_num_parties, METH_O, NULL},
    {"backlogged", (PyCFunction)QueueIndex_backlogged, METH_O, NULL},
    {"party_size", (PyCFunction)QueueIndex_party_size, METH_O, NULL},
    {"queued_tokens_of", (PyCFunction)QueueIndex_queued_tokens_of, METH_O, NULL},
    {"party_lengths", (PyCFunction)QueueIndex_party_lengths, METH_O, NULL},
    {"class_lengths", (PyCFunction)QueueIndex_class_lengths, METH_O, NULL},
    {"oldest", (PyCFunction)QueueIndex_oldest, METH_O, NULL},
    {"first_of", (PyCFunction)QueueIndex_first_of, METH_O, NULL},
    {"party_in_order", (PyCFunction)QueueIndex_party_in_order, METH_O, NULL},
    {"queued", (PyCFunction)QueueIndex_queued, METH_NOARGS, NULL},
    {"num_queued_by_party", (PyCFunction)QueueIndex_num_queued_by_party, METH_NOARGS, NULL},
    {"resumed_items", (PyCFunction)QueueIndex_resumed_items, METH_NOARGS, NULL},
    {"class_names", (PyCFunction)QueueIndex_class_names, METH_NOARGS, NULL},
    {"min_counter", (PyCFunction)QueueIndex_min_counter, METH_O, NULL},
    {"least_served_party", (PyCFunction)(void (*)(void))QueueIndex_least_served_party, FAST,
     NULL},
    {"arrival_walk", (PyCFunction)(void (*)(void))QueueIndex_arrival_walk, FAST, NULL},
    {"counter_walk", (PyCFunction)QueueIndex_counter_walk, METH_O, NULL},
    {"bucket_bits", (PyCFunction)QueueIndex_bucket_bits, METH_O, NULL},
    {"choose", (PyCFunction)(void (*)(void))QueueIndex_choose, FAST,
     "the fair choice: (request or None, by aging, no one overdue)"},
    {NULL, NULL, 0, NULL},
};

static PySequenceMethods QueueIndex_as_sequence = {
    .sq_length = (lenfunc)QueueIndex_len,
    .sq_contains = (objobjproc)QueueIndex_contains,
};

static PyTypeObject QueueIndexType = {
    PyVarObject_HEAD_INIT(NULL, 0).tp_name = "_tandem_queue_index.QueueIndex",
    .tp_basicsize = sizeof(QueueIndex),
    .tp_dealloc = (destructor)QueueIndex_dealloc,
    .tp_flags = Py_TPFLAGS_DEFAULT | Py_TPFLAGS_BASETYPE,
    .tp_doc = "The fair queue's indexes (see queue_index.py)",
    .tp_methods = QueueIndex_methods,
    .tp_as_sequence = &QueueIndex_as_sequence,
    .tp_new = QueueIndex_new,
};

static PyMethodDef module_functions[] = {
    {"set_bulk_class", set_bulk_class, METH_O, "the bulk class's name (before any index is used)"},
    {NULL, NULL, 0, NULL},
};

static struct PyModuleDef module = {
    PyModuleDef_HEAD_INIT, "_tandem_queue_index", NULL, -1, module_functions,
    NULL, NULL, NULL, NULL,
};

PyMODINIT_FUNC PyInit__tandem_queue_index(void) {
    if (PyType_Ready(&QueueIndexType) < 0 || PyType_Ready(&WalkType) < 0) return NULL;
#define INTERN(var, text) \
    if ((var = PyUnicode_InternFromString(text)) == NULL) return NULL;
    INTERN(str_request_id, "request_id")
    INTERN(str_priority, "priority")
    INTERN(str_num_prompt_tokens, "num_prompt_tokens")
    INTERN(str_arrival, "arrival")
    INTERN(str_bulk, "bulk")
    INTERN(str_resumed, "resumed")
    INTERN(str_interactive, "interactive")
    PyObject *m = PyModule_Create(&module);
    if (m == NULL) return NULL;
    Py_INCREF(&QueueIndexType);
    if (PyModule_AddObject(m, "QueueIndex", (PyObject *)&QueueIndexType) < 0) {
        Py_DECREF(&QueueIndexType);
        Py_DECREF(m);
        return NULL;
    }
    return m;
}
