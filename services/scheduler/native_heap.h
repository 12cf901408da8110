/* Binary heaps of plain C entries for the scheduler's native indexes (`queue_index.c`,
   `decode_room.c`). `DEFINE_HEAP(NAME, T, LESS)` defines a heap type NAME of entries T ordered by
   `LESS(const T *, const T *)`, with heapq's invariant (data[i] <= its children), so an index
   keeps heapq's answers. Every change counts in `changes`: a walk over the heap (an in-order
   iterator) compares it to know the heap did not move under it. Memory comes from PyMem (the
   caller holds the GIL). */

#ifndef TANDEM_NATIVE_HEAP_H
#define TANDEM_NATIVE_HEAP_H

#include <Python.h>
#include <stdint.h>

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

#endif
