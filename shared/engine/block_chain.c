/* The prefix cache's block chain in C: `chain(parent, token_ids, block_size, first_block,
 * num_blocks)` is the list of hashes `block_chain.block_hash` chains, block after block.
 *
 * A block's hash is BLAKE2b with an 8-byte digest (RFC 7693; no key, no salt, no
 * personalization) of its parent's hash as an unsigned 64-bit integer followed by its token ids
 * as signed 64-bit integers, all little-endian, read back as a little-endian integer. Every
 * field is one 8-byte message word of BLAKE2b, so the words are the values themselves (on any
 * host), and the digest is the first word of the state. Python's `hashlib` spends more on
 * building its objects than on the compression; here a block is two compressions (136 bytes
 * for 16 tokens, about 150 ns each) and a read of each token: in place from an int32 buffer
 * (a `TokenArray`, a prompt as the wire decodes it), else from a sequence's int objects.
 * `tests/unit/test_block_chain.py` holds it equal to the Python chain. */

#define PY_SSIZE_T_CLEAN
#include <Python.h>
#include <stdint.h>
#include <string.h>

#define WORDS_PER_BLOCK 16 /* BLAKE2b compresses 128 bytes at a time */
#define DIGEST_BYTES 8

static const uint64_t IV[8] = {
    0x6a09e667f3bcc908ULL, 0xbb67ae8584caa73bULL, 0x3c6ef372fe94f82bULL,
    0xa54ff53a5f1d36f1ULL, 0x510e527fade682d1ULL, 0x9b05688c2b3e6c1fULL,
    0x1f83d9abfb41bd6bULL, 0x5be0cd19137e2179ULL,
};

/* A message word order per round. RFC 7693's round r uses row r mod 10: rows 10 and 11 are
 * rows 0 and 1 written out, since the modulo in the round loop cost a quarter of a block's
 * time (297 against 397 ns). */
static const uint8_t SIGMA[12][16] = {
    {0, 1, 2, 3, 4, 5, 6, 7, 8, 9, 10, 11, 12, 13, 14, 15},
    {14, 10, 4, 8, 9, 15, 13, 6, 1, 12, 0, 2, 11, 7, 5, 3},
    {11, 8, 12, 0, 5, 2, 15, 13, 10, 14, 3, 6, 7, 1, 9, 4},
    {7, 9, 3, 1, 13, 12, 11, 14, 2, 6, 5, 10, 4, 0, 15, 8},
    {9, 0, 5, 7, 2, 4, 10, 15, 14, 1, 11, 12, 6, 8, 3, 13},
    {2, 12, 6, 10, 0, 11, 8, 3, 4, 13, 7, 5, 15, 14, 1, 9},
    {12, 5, 1, 15, 14, 13, 4, 10, 0, 7, 6, 3, 9, 2, 8, 11},
    {13, 11, 7, 14, 12, 1, 3, 9, 5, 0, 15, 4, 8, 6, 2, 10},
    {6, 15, 14, 9, 11, 3, 0, 8, 12, 2, 13, 7, 1, 4, 10, 5},
    {10, 2, 8, 4, 7, 6, 1, 5, 15, 11, 9, 14, 3, 12, 13, 0},
    {0, 1, 2, 3, 4, 5, 6, 7, 8, 9, 10, 11, 12, 13, 14, 15},
    {14, 10, 4, 8, 9, 15, 13, 6, 1, 12, 0, 2, 11, 7, 5, 3},
};

static inline uint64_t rotr64(uint64_t x, int n) { return (x >> n) | (x << (64 - n)); }

#define G(a, b, c, d, x, y)              \
    do {                                 \
        v[a] = v[a] + v[b] + (x);        \
        v[d] = rotr64(v[d] ^ v[a], 32);  \
        v[c] = v[c] + v[d];              \
        v[b] = rotr64(v[b] ^ v[c], 24);  \
        v[a] = v[a] + v[b] + (y);        \
        v[d] = rotr64(v[d] ^ v[a], 16);  \
        v[c] = v[c] + v[d];              \
        v[b] = rotr64(v[b] ^ v[c], 63);  \
    } while (0)

/* RFC 7693's F: one 128-byte block `m` into the state `h`; `bytes_so_far` counts this block's
 * bytes too (the padding of the last one not). */
static void compress(uint64_t h[8], const uint64_t m[16], uint64_t bytes_so_far, int last) {
    uint64_t v[16];
    for (int i = 0; i < 8; i++) {
        v[i] = h[i];
        v[i + 8] = IV[i];
    }
    v[12] ^= bytes_so_far; /* the counter's high word stays 0: a block is far below 2^64 bytes */
    if (last) v[14] = ~v[14];
    for (int round = 0; round < 12; round++) {
        const uint8_t *s = SIGMA[round];
        G(0, 4, 8, 12, m[s[0]], m[s[1]]);
        G(1, 5, 9, 13, m[s[2]], m[s[3]]);
        G(2, 6, 10, 14, m[s[4]], m[s[5]]);
        G(3, 7, 11, 15, m[s[6]], m[s[7]]);
        G(0, 5, 10, 15, m[s[8]], m[s[9]]);
        G(1, 6, 11, 12, m[s[10]], m[s[11]]);
        G(2, 7, 8, 13, m[s[12]], m[s[13]]);
        G(3, 4, 9, 14, m[s[14]], m[s[15]]);
    }
    for (int i = 0; i < 8; i++) h[i] ^= v[i] ^ v[i + 8];
}

/* The 8-byte BLAKE2b digest of `num_words` 8-byte words (at least one), as an integer.
 * `words` has room for whole blocks: the words past `num_words` are zero (the padding). */
static uint64_t digest_words(const uint64_t *words, Py_ssize_t num_words) {
    uint64_t h[8];
    memcpy(h, IV, sizeof h);
    h[0] ^= 0x01010000ULL ^ DIGEST_BYTES; /* fanout 1, depth 1, no key, 8-byte digest */
    Py_ssize_t num_blocks = (num_words + WORDS_PER_BLOCK - 1) / WORDS_PER_BLOCK;
    for (Py_ssize_t i = 0; i + 1 < num_blocks; i++)
        compress(h, words + i * WORDS_PER_BLOCK, (uint64_t)(i + 1) * 128, 0);
    compress(h, words + (num_blocks - 1) * WORDS_PER_BLOCK, (uint64_t)num_words * 8, 1);
    return h[0];
}

/* The token ids `chain` reads: an int32 buffer's (a `TokenArray`, as the wire decodes a prompt:
 * read in place, no int objects at all), else a sequence's int objects. */
typedef struct {
    Py_buffer view;      /* with `ints`: the exported buffer, released by `tokens_release` */
    const int32_t *ints; /* NULL: read `items` */
    PyObject *sequence;  /* PySequence_Fast's list or tuple, when not a buffer */
    PyObject **items;
    Py_ssize_t length;
} Tokens;

static int tokens_open(Tokens *tokens, PyObject *object) {
    memset(tokens, 0, sizeof(*tokens));
    if (PyObject_CheckBuffer(object)) {
        if (PyObject_GetBuffer(object, &tokens->view, PyBUF_FORMAT | PyBUF_C_CONTIGUOUS) != 0)
            return -1;
        const char *format = tokens->view.format;
        if (tokens->view.ndim == 1 && tokens->view.itemsize == (Py_ssize_t)sizeof(int32_t) &&
            sizeof(int) == sizeof(int32_t) && format != NULL && strcmp(format, "i") == 0) {
            tokens->ints = (const int32_t *)tokens->view.buf;
            tokens->length = tokens->view.len / (Py_ssize_t)sizeof(int32_t);
            return 0;
        }
        PyBuffer_Release(&tokens->view); /* bytes and other buffers: read as a sequence */
    }
    tokens->sequence = PySequence_Fast(object, "token_ids must be a sequence");
    if (tokens->sequence == NULL) return -1;
    tokens->items = PySequence_Fast_ITEMS(tokens->sequence);
    tokens->length = PySequence_Fast_GET_SIZE(tokens->sequence);
    return 0;
}

static void tokens_release(Tokens *tokens) {
    if (tokens->ints != NULL) PyBuffer_Release(&tokens->view);
    Py_XDECREF(tokens->sequence);
}

/* Token ids [start, start + count) as message words (int64, two's complement). 1: read; 0: one
 * is outside int64 (no hash); -1: one is not an int (an exception is set). */
static int read_words(const Tokens *tokens, Py_ssize_t start, Py_ssize_t count,
                      uint64_t *words) {
    if (tokens->ints != NULL) {
        for (Py_ssize_t i = 0; i < count; i++)
            words[i] = (uint64_t)(int64_t)tokens->ints[start + i];
        return 1;
    }
    for (Py_ssize_t i = 0; i < count; i++) {
        PyObject *item = tokens->items[start + i];
        if (!PyLong_Check(item)) { /* no __index__ call: it could change the list */
            PyErr_Format(PyExc_TypeError, "token ids must be ints, got %.50s",
                         Py_TYPE(item)->tp_name);
            return -1;
        }
        int overflow;
        long long token = PyLong_AsLongLongAndOverflow(item, &overflow);
        if (overflow) return 0;
        words[i] = (uint64_t)token;
    }
    return 1;
}

static PyObject *chain(PyObject *module, PyObject *args) {
    PyObject *parent_object, *tokens_object;
    Py_ssize_t block_size, first_block, num_blocks;
    if (!PyArg_ParseTuple(args, "OOnnn:chain", &parent_object, &tokens_object, &block_size,
                          &first_block, &num_blocks))
        return NULL;
    uint64_t parent = PyLong_AsUnsignedLongLong(parent_object);
    if (parent == (uint64_t)-1 && PyErr_Occurred()) return NULL;
    if (block_size < 1 || first_block < 0 || num_blocks < 0) {
        PyErr_Format(PyExc_ValueError,
                     "block_size must be positive, first_block and num_blocks not negative "
                     "(got %zd, %zd, %zd)",
                     block_size, first_block, num_blocks);
        return NULL;
    }
    Tokens tokens;
    if (tokens_open(&tokens, tokens_object) != 0) return NULL;
    /* (Compared, and said, without the sum where it would overflow.) */
    if (num_blocks > 0 && first_block > tokens.length / block_size - num_blocks) {
        if (first_block > PY_SSIZE_T_MAX - num_blocks)
            PyErr_Format(PyExc_ValueError, "blocks %zd and %zd more of %zd tokens in blocks of %zd",
                         first_block, num_blocks, tokens.length, block_size);
        else
            PyErr_Format(PyExc_ValueError, "blocks %zd to %zd of %zd tokens in blocks of %zd",
                         first_block, first_block + num_blocks, tokens.length, block_size);
        tokens_release(&tokens);
        return NULL;
    }
    Py_ssize_t num_words = block_size + 1;
    Py_ssize_t room = (num_words + WORDS_PER_BLOCK - 1) / WORDS_PER_BLOCK * WORDS_PER_BLOCK;
    uint64_t *words = PyMem_Calloc((size_t)room, sizeof(uint64_t));
    uint64_t *chained = PyMem_Malloc((size_t)(num_blocks > 0 ? num_blocks : 1) * sizeof(uint64_t));
    PyObject *hashes = NULL;
    if (words == NULL || chained == NULL) {
        PyErr_NoMemory();
        goto done;
    }
    Py_ssize_t num_hashed = 0;
    for (; num_hashed < num_blocks; num_hashed++) {
        words[0] = parent;
        int read = read_words(&tokens, (first_block + num_hashed) * block_size, block_size,
                              words + 1);
        if (read < 0) goto done;
        if (read == 0) break; /* outside int64: no hash, the chain ends (see block_chain.py) */
        parent = chained[num_hashed] = digest_words(words, num_words);
    }
    hashes = PyList_New(num_hashed);
    for (Py_ssize_t i = 0; hashes != NULL && i < num_hashed; i++) {
        PyObject *value = PyLong_FromUnsignedLongLong(chained[i]);
        if (value == NULL) Py_CLEAR(hashes);
        else PyList_SET_ITEM(hashes, i, value);
    }
done:
    PyMem_Free(words);
    PyMem_Free(chained);
    tokens_release(&tokens);
    return hashes;
}

static PyMethodDef METHODS[] = {
    {"chain", chain, METH_VARARGS,
     "chain(parent, token_ids, block_size, first_block, num_blocks): the hashes of the blocks "
     "token_ids[first_block * block_size:(first_block + num_blocks) * block_size], each "
     "chained on the one before, the first on `parent`; it ends before a block holding a token "
     "id outside int64."},
    {NULL, NULL, 0, NULL},
};

static struct PyModuleDef MODULE = {
    PyModuleDef_HEAD_INIT, "_tandem_block_chain", "The prefix cache's block chain in C.", -1,
    METHODS,
};

PyMODINIT_FUNC PyInit__tandem_block_chain(void) { return PyModule_Create(&MODULE); }
