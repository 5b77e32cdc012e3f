/* The signals log's columns, located and converted in one pass, without the GIL.
 *
 * Why: `megatron-ext plot` reads every line of logs of millions of iterations. The numpy path
 * (signals_columns._vectorised) makes a dozen passes over each block's bytes, and numpy's
 * bytes-to-float cast calls Python's float parser per value with the GIL held: ~6 us a line on
 * a 2-core login node, 25 s for a 5 M-iteration log. This file does the same work in one pass
 * over the bytes, with glibc's correctly rounded strtod_l in the C locale (the same double as
 * Python's float() for every decimal it accepts), and lets the other parse threads run.
 *
 * It accepts exactly the lines the numpy path accepts and gives the same values, or answers -1
 * and changes nothing the caller keeps: then signals_columns falls back to the numpy path,
 * which reports what is wrong (or accepts a spelling this parser does not, such as a number
 * with a '+' sign). tests/unit/test_signals_columns.py checks both paths agree.
 *
 * A line qualifies when the k-th `":` of the line (counted from the line's end for the fields
 * after the nested objects) is preceded by the k-th field's key, and the value after it ends at
 * a ',' or '}' within WIDTH bytes.
 */
#define PY_SSIZE_T_CLEAN
#include <Python.h>

#include <locale.h>
#include <math.h>
#include <stdint.h>
#include <stdlib.h>
#include <string.h>

#define WIDTH 24 /* bytes of the longest number token */

enum kind { KIND_INT = 0, KIND_FLOAT = 1, KIND_BOOL = 2 };

typedef struct {
    Py_ssize_t index; /* the field's place in SignalRecord's order */
    const char *key;  /* "name" with its quotes */
    Py_ssize_t key_len;
    int kind;
    char *values; /* int64, double or uint8 per line */
    uint8_t *present;
} column;

static locale_t c_locale;

/* A JSON number: -?digits(.digits)?([eE][-+]?digits)? */
static int is_json_number(const char *s, Py_ssize_t n) {
    Py_ssize_t i = 0;
    if (i < n && s[i] == '-') i++;
    Py_ssize_t digits = i;
    while (i < n && s[i] >= '0' && s[i] <= '9') i++;
    if (i == digits) return 0;
    if (i < n && s[i] == '.') {
        digits = ++i;
        while (i < n && s[i] >= '0' && s[i] <= '9') i++;
        if (i == digits) return 0;
    }
    if (i < n && (s[i] == 'e' || s[i] == 'E')) {
        i++;
        if (i < n && (s[i] == '-' || s[i] == '+')) i++;
        digits = i;
        while (i < n && s[i] >= '0' && s[i] <= '9') i++;
        if (i == digits) return 0;
    }
    return i == n;
}

/* The quoted non-finite spellings (json_safe's and Python json's). */
static int non_finite(const char *s, Py_ssize_t n, double *out) {
    static const struct { const char *text; double value; } known[] = {
        {"\"nan\"", NAN}, {"\"inf\"", INFINITY}, {"\"-inf\"", -INFINITY},
        {"\"NaN\"", NAN}, {"\"Infinity\"", INFINITY}, {"\"-Infinity\"", -INFINITY},
    };
    for (size_t k = 0; k < sizeof known / sizeof known[0]; k++) {
        if ((Py_ssize_t)strlen(known[k].text) == n && memcmp(s, known[k].text, n) == 0) {
            *out = known[k].value;
            return 1;
        }
    }
    return 0;
}

/* One value into line `row` of `c`; 0 where the numpy path must decide. */
static int convert(const column *c, const char *token, Py_ssize_t n, Py_ssize_t row) {
    if (c->kind == KIND_BOOL) {
        c->values[row] = (n == 4 && memcmp(token, "true", 4) == 0);
        return 1;
    }
    if (c->kind == KIND_INT) {
        if (n < 1 || n > 18) return 0;
        int64_t v = 0;
        for (Py_ssize_t i = 0; i < n; i++) {
            if (token[i] < '0' || token[i] > '9') return 0;
            v = v * 10 + (token[i] - '0');
        }
        ((int64_t *)c->values)[row] = v;
        return 1;
    }
    double *values = (double *)c->values;
    c->present[row] = 1;
    if (n >= 1 && token[0] == 'n') { /* null: the numpy path reads the first byte only */
        values[row] = NAN;
        c->present[row] = 0;
        return 1;
    }
    if (n >= 1 && token[0] == '"') return non_finite(token, n, &values[row]);
    if (!is_json_number(token, n)) return 0;
    char text[WIDTH + 1];
    memcpy(text, token, n);
    text[n] = '\0';
    char *stop;
    values[row] = strtod_l(text, &stop, c_locale);
    return stop == text + n;
}

/* Lines of data[0:size] into the columns; the line count, or -1 (see the top). */
static Py_ssize_t scan_lines(const char *data, Py_ssize_t size, Py_ssize_t fields,
                             Py_ssize_t nested, column *columns, Py_ssize_t count,
                             Py_ssize_t capacity) {
    Py_ssize_t room = 64, row = 0;
    const char **colons = malloc(room * sizeof *colons);
    if (!colons) return -2;
    const char *line = data, *end = data + size;
    while (line < end) {
        const char *newline = memchr(line, '\n', end - line);
        if (!newline || row >= capacity) goto refuse;
        Py_ssize_t found = 0;
        for (const char *at = line; (at = memchr(at, ':', newline - at)) != NULL; at++) {
            if (at == data || at[-1] != '"') continue;
            if (found == room) {
                const char **grown = realloc(colons, 2 * room * sizeof *colons);
                if (!grown) { free(colons); return -2; }
                colons = grown;
                room *= 2;
            }
            colons[found++] = at;
        }
        if (found < fields) goto refuse;
        for (Py_ssize_t k = 0; k < count; k++) {
            const column *c = &columns[k];
            Py_ssize_t which = c->index <= nested ? c->index : found - (fields - c->index);
            const char *colon = colons[which];
            if (colon - data < c->key_len || memcmp(colon - c->key_len, c->key, c->key_len))
                goto refuse;
            const char *token = colon + 1;
            Py_ssize_t n = 0; /* the stop: within WIDTH + 1 bytes, in any line (as numpy) */
            while (n <= WIDTH && token + n < end && token[n] != ',' && token[n] != '}') n++;
            if (n > WIDTH || token + n >= end) goto refuse;
            if (!convert(c, token, n, row)) goto refuse;
        }
        row++;
        line = newline + 1;
    }
    free(colons);
    return row;
refuse:
    free(colons);
    return -1;
}

static PyObject *scan(PyObject *self, PyObject *args) {
    Py_buffer data;
    Py_ssize_t fields, nested, capacity;
    PyObject *specs;
    if (!PyArg_ParseTuple(args, "y*nnO!n", &data, &fields, &nested, &PyTuple_Type, &specs,
                          &capacity))
        return NULL;
    Py_ssize_t count = PyTuple_GET_SIZE(specs);
    column *columns = calloc(count ? count : 1, sizeof *columns);
    Py_buffer *held = calloc(2 * (count ? count : 1), sizeof *held);
    Py_ssize_t taken = 0, result = -1;
    if (!columns || !held) {
        PyErr_NoMemory();
        goto done;
    }
    for (Py_ssize_t k = 0; k < count; k++) {
        column *c = &columns[k];
        PyObject *key, *values, *present;
        if (!PyArg_ParseTuple(PyTuple_GET_ITEM(specs, k), "nSiOO", &c->index, &key, &c->kind,
                              &values, &present))
            goto done;
        static const Py_ssize_t item[] = {8, 8, 1};
        if (c->index < 0 || c->index >= fields || c->kind < 0 || c->kind > 2) {
            PyErr_SetString(PyExc_ValueError, "scan: a column outside the record");
            goto done;
        }
        c->key = PyBytes_AS_STRING(key);
        c->key_len = PyBytes_GET_SIZE(key);
        if (PyObject_GetBuffer(values, &held[taken], PyBUF_WRITABLE) < 0) goto done;
        c->values = held[taken++].buf;
        if (held[taken - 1].len < capacity * item[c->kind]) {
            PyErr_SetString(PyExc_ValueError, "scan: a values buffer below capacity");
            goto done;
        }
        if (c->kind == KIND_FLOAT) {
            if (PyObject_GetBuffer(present, &held[taken], PyBUF_WRITABLE) < 0) goto done;
            c->present = held[taken++].buf;
            if (held[taken - 1].len < capacity) {
                PyErr_SetString(PyExc_ValueError, "scan: a present buffer below capacity");
                goto done;
            }
        }
    }
    Py_BEGIN_ALLOW_THREADS
    result = scan_lines(data.buf, data.len, fields, nested, columns, count, capacity);
    Py_END_ALLOW_THREADS
    if (result == -2) PyErr_NoMemory();
done:
    for (Py_ssize_t k = 0; k < taken; k++) PyBuffer_Release(&held[k]);
    PyBuffer_Release(&data);
    free(columns);
    free(held);
    if (PyErr_Occurred()) return NULL;
    return PyLong_FromSsize_t(result);
}

static PyMethodDef methods[] = {
    {"scan", scan, METH_VARARGS,
     "scan(data, fields, nested, columns, capacity) -> lines, or -1: the numpy path decides.\n"
     "columns: ((index, key, kind, values, present), ...); kind 0 int64, 1 float64, 2 bool."},
    {NULL, NULL, 0, NULL},
};

static struct PyModuleDef module = {PyModuleDef_HEAD_INIT, "_scan", NULL, -1, methods};

PyMODINIT_FUNC PyInit__scan(void) {
    c_locale = newlocale(LC_NUMERIC_MASK, "C", (locale_t)0);
    if (!c_locale) return PyErr_NoMemory();
    return PyModule_Create(&module);
}
