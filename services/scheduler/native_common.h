/* What the scheduler's native indexes (`queue_index.c`, `decode_room.c`, `prefill_room.c`) share:
   slot arrays, reading Python attributes, a WorkerState's health, and binary heaps of plain C
   entries with their in-order walks. Every function is `static inline` (a file that does not
   use one compiles no copy of it, and no warning).

   `DEFINE_HEAP(NAME, T, LESS)` defines a heap type NAME of entries T ordered by
   `LESS(const T *, const T *)`, with heapq's invariant (data[i] <= its children), so an index
   keeps heapq's answers. Every change counts in `changes`: a walk over the heap (an in-order
   iterator) compares it to know the heap did not move under it. Memory comes from PyMem (the
   caller holds the GIL). */

#ifndef TANDEM_NATIVE_COMMON_H
#define TANDEM_NATIVE_COMMON_H

#include <Python.h>
#include <stdint.h>
#include <string.h>

/* -- slots ----------------------------------------------------------------------------------- */

/* A free slot of an array of `size`-byte entries (grown, zeroed, when none is free); -1 with
   MemoryError. */
static inline Py_ssize_t take_slot(void **array, Py_ssize_t *cap, Py_ssize_t **free_list,
                                   Py_ssize_t *num_free, size_t size) {
    if (*num_free == 0) {
        Py_ssize_t old = *cap, grown = old ? old * 2 : 64;
        void *data = PyMem_Realloc(*array, (size_t)grown * size);
        if (data == NULL) return PyErr_NoMemory(), -1;
        Py_ssize_t *free_data = PyMem_Realloc(*free_list, (size_t)grown * sizeof(Py_ssize_t));
        if (free_data == NULL) {
            *array = data;
            return PyErr_NoMemory(), -1;
        }
        memset((char *)data + (size_t)old * size, 0, (size_t)(grown - old) * size);
        *array = data;
        *free_list = free_data;
        for (Py_ssize_t i = grown - 1; i >= old; i--) (*free_list)[(*num_free)++] = i;
        *cap = grown;
    }
    return (*free_list)[--(*num_free)];
}

/* The slot an int in one of the maps names, or -1 (no error set) when the key is absent. */
static inline Py_ssize_t lookup_slot(PyObject *map, PyObject *key) {
    PyObject *found = PyDict_GetItemWithError(map, key);
    if (found == NULL) return -1;
    return PyLong_AsSsize_t(found);
}

static inline int put_slot(PyObject *map, PyObject *key, Py_ssize_t slot) {
    PyObject *value = PyLong_FromSsize_t(slot);
    if (value == NULL) return -1;
    int status = PyDict_SetItem(map, key, value);
    Py_DECREF(value);
    return status;
}

/* A free slot taken for `key` and named by it in `map` (key -> slot); -1 with an exception, the
   slot given back. */
static inline Py_ssize_t claim_slot(void **array, Py_ssize_t *cap, Py_ssize_t **free_list,
                                    Py_ssize_t *num_free, size_t size, PyObject *map,
                                    PyObject *key) {
    Py_ssize_t slot = take_slot(array, cap, free_list, num_free, size);
    if (slot >= 0 && put_slot(map, key, slot) < 0) {
        (*free_list)[(*num_free)++] = slot;
        return -1;
    }
    return slot;
}

/* -- reading Python values ------------------------------------------------------------------- */

static inline int get_int64(PyObject *obj, PyObject *name, int64_t *out) {
    PyObject *value = PyObject_GetAttr(obj, name);
    if (value == NULL) return -1;
    long long v = PyLong_AsLongLong(value);
    Py_DECREF(value);
    if (v == -1 && PyErr_Occurred()) return -1;
    *out = v;
    return 0;
}

static inline int get_double(PyObject *obj, PyObject *name, double *out) {
    PyObject *value = PyObject_GetAttr(obj, name);
    if (value == NULL) return -1;
    double v = PyFloat_AsDouble(value);
    Py_DECREF(value);
    if (v == -1.0 && PyErr_Occurred()) return -1;
    *out = v;
    return 0;
}

static inline int get_truth(PyObject *obj, PyObject *name, int *out) {
    PyObject *value = PyObject_GetAttr(obj, name);
    if (value == NULL) return -1;
    int v = PyObject_IsTrue(value);
    Py_DECREF(value);
    if (v < 0) return -1;
    *out = v;
    return 0;
}

static inline int get_length(PyObject *obj, PyObject *name, int64_t *out) {
    PyObject *value = PyObject_GetAttr(obj, name);
    if (value == NULL) return -1;
    Py_ssize_t n = PyObject_Size(value);
    Py_DECREF(value);
    if (n < 0) return -1;
    *out = n;
    return 0;
}

/* `WorkerState.making_progress(now, timeout_s)`, its attributes named by `busy` and
   `last_progress` (interned): 1, 0, or -1 with an exception. */
static inline int making_progress(PyObject *worker, double now, double timeout_s, PyObject *busy,
                                  PyObject *last_progress) {
    int is_busy;
    double last;
    if (get_truth(worker, busy, &is_busy) < 0) return -1;
    if (!is_busy) return 1;
    if (get_double(worker, last_progress, &last) < 0) return -1;
    return now - last <= timeout_s;
}

/* -- binary heaps ---------------------------------------------------------------------------- */

#define DEFINE_HEAP(NAME, T, LESS)                                                            \
    typedef struct {                                                                          \
        T *data;                                                                              \
        Py_ssize_t len, cap;                                                                  \
        uint64_t changes;                                                                     \
    } NAME;                                                                                   \
    static int NAME##_reserve(NAME *h, Py_ssize_t need) {                                     \
        if (need <= h->cap) return 0;                                                         \
        Py_ssize_t cap = h->cap ? h->cap : 8;                                                 \
        while (cap < need) cap *= 2;                                                          \
        T *data = PyMem_Realloc(h->data, (size_t)cap * sizeof(T));                            \
        if (data == NULL) {                                                                   \
            PyErr_NoMemory();                                                                 \
            return -1;                                                                        \
        }                                                                                     \
        h->data = data;                                                                       \
        h->cap = cap;                                                                         \
        return 0;                                                                             \
    }                                                                                         \
    static void NAME##_sift_up(NAME *h, Py_ssize_t pos) {                                     \
        T entry = h->data[pos];                                                               \
        while (pos > 0) {                                                                     \
            Py_ssize_t parent = (pos - 1) >> 1;                                               \
            if (!LESS(&entry, &h->data[parent])) break;                                       \
            h->data[pos] = h->data[parent];                                                   \
            pos = parent;                                                                     \
        }                                                                                     \
        h->data[pos] = entry;                                                                 \
    }                                                                                         \
    static void NAME##_sift_down(NAME *h, Py_ssize_t pos) {                                   \
        T entry = h->data[pos];                                                               \
        for (;;) {                                                                            \
            Py_ssize_t child = 2 * pos + 1;                                                   \
            if (child >= h->len) break;                                                       \
            if (child + 1 < h->len && LESS(&h->data[child + 1], &h->data[child])) child++;    \
            if (!LESS(&h->data[child], &entry)) break;                                        \
            h->data[pos] = h->data[child];                                                    \
            pos = child;                                                                      \
        }                                                                                     \
        h->data[pos] = entry;                                                                 \
    }                                                                                         \
    static int NAME##_push(NAME *h, T entry) {                                                \
        if (NAME##_reserve(h, h->len + 1) < 0) return -1;                                     \
        h->data[h->len++] = entry;                                                            \
        NAME##_sift_up(h, h->len - 1);                                                        \
        h->changes++;                                                                         \
        return 0;                                                                             \
    }                                                                                         \
    static T NAME##_pop(NAME *h) { /* h->len > 0 */                                           \
        T top = h->data[0];                                                                   \
        h->data[0] = h->data[--h->len];                                                       \
        if (h->len > 0) NAME##_sift_down(h, 0);                                               \
        h->changes++;                                                                         \
        return top;                                                                           \
    }                                                                                         \
    static void NAME##_heapify(NAME *h) {                                                     \
        for (Py_ssize_t i = h->len / 2 - 1; i >= 0; i--) NAME##_sift_down(h, i);              \
        h->changes++;                                                                         \
    }

/* `DEFINE_WALK(HEAP, LESS)` defines HEAP##Walk: the heap's entries smallest first, found as
   they are asked for (a frontier of positions ordered by their entries: k entries cost
   O(k log k)), the heap left as it is, as `lazy_heap.in_order`. `_next` gives the next
   entry's position, -1 when done, or -2 with RuntimeError set when the heap changed since the
   walk started (its array may have moved). `_end` frees what `_start` and `_next` took. */
#define DEFINE_WALK(HEAP, LESS)                                                               \
    typedef struct {                                                                          \
        HEAP *heap;                                                                           \
        uint64_t changes;                                                                     \
        Py_ssize_t *front, len, cap;                                                          \
        Py_ssize_t local[32];                                                                 \
    } HEAP##Walk;                                                                             \
    static inline int HEAP##Walk_less(HEAP##Walk *w, Py_ssize_t a, Py_ssize_t b) {            \
        return LESS(&w->heap->data[w->front[a]], &w->heap->data[w->front[b]]);                \
    }                                                                                         \
    static int HEAP##Walk_push(HEAP##Walk *w, Py_ssize_t position) {                          \
        if (w->len == w->cap) {                                                               \
            Py_ssize_t cap = 2 * w->cap;                                                      \
            Py_ssize_t *front = PyMem_Malloc((size_t)cap * sizeof(Py_ssize_t));               \
            if (front == NULL) return PyErr_NoMemory(), -1;                                   \
            memcpy(front, w->front, (size_t)w->len * sizeof(Py_ssize_t));                     \
            if (w->front != w->local) PyMem_Free(w->front);                                   \
            w->front = front;                                                                 \
            w->cap = cap;                                                                     \
        }                                                                                     \
        Py_ssize_t pos = w->len++;                                                            \
        w->front[pos] = position;                                                             \
        while (pos > 0) {                                                                     \
            Py_ssize_t parent = (pos - 1) >> 1;                                               \
            if (!HEAP##Walk_less(w, pos, parent)) break;                                      \
            Py_ssize_t held = w->front[pos];                                                  \
            w->front[pos] = w->front[parent];                                                 \
            w->front[parent] = held;                                                          \
            pos = parent;                                                                     \
        }                                                                                     \
        return 0;                                                                             \
    }                                                                                         \
    static void HEAP##Walk_start(HEAP##Walk *w, HEAP *h) {                                    \
        w->heap = h;                                                                          \
        w->changes = h->changes;                                                              \
        w->front = w->local;                                                                  \
        w->cap = 32;                                                                          \
        w->len = 0;                                                                           \
        if (h->len > 0) w->front[w->len++] = 0;                                               \
    }                                                                                         \
    static Py_ssize_t HEAP##Walk_next(HEAP##Walk *w) {                                        \
        if (w->changes != w->heap->changes) {                                                 \
            PyErr_SetString(PyExc_RuntimeError, "the index changed while it was read");       \
            return -2;                                                                        \
        }                                                                                     \
        if (w->len == 0) return -1;                                                           \
        Py_ssize_t top = w->front[0];                                                         \
        w->front[0] = w->front[--w->len];                                                     \
        for (Py_ssize_t pos = 0;;) {                                                          \
            Py_ssize_t child = 2 * pos + 1, least = pos;                                      \
            if (child < w->len && HEAP##Walk_less(w, child, least)) least = child;            \
            if (child + 1 < w->len && HEAP##Walk_less(w, child + 1, least)) least = child + 1; \
            if (least == pos) break;                                                          \
            Py_ssize_t held = w->front[pos];                                                  \
            w->front[pos] = w->front[least];                                                  \
            w->front[least] = held;                                                           \
            pos = least;                                                                      \
        }                                                                                     \
        Py_ssize_t child = 2 * top + 1;                                                       \
        if (child < w->heap->len && HEAP##Walk_push(w, child) < 0) return -2;                 \
        if (child + 1 < w->heap->len && HEAP##Walk_push(w, child + 1) < 0) return -2;         \
        return top;                                                                           \
    }                                                                                         \
    static void HEAP##Walk_end(HEAP##Walk *w) {                                               \
        if (w->front != w->local) PyMem_Free(w->front);                                       \
        w->front = w->local;                                                                  \
    }

#endif
