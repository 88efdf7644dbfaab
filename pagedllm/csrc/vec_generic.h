/* vec.h's vocabulary in portable C: 8 lanes of GCC vector extensions, which the compiler maps
 * to SSE2 on x86-64 without AVX2 and to NEON on aarch64. */
#define PL_GENERIC 1
#define VL 8
typedef float vf __attribute__((vector_size(32)));
typedef int32_t vi __attribute__((vector_size(32)));
typedef vi vm;

INLINE vf vzero(void) { return (vf){0}; }
INLINE vf vset1(float f) { return (vf){f, f, f, f, f, f, f, f}; }
INLINE vf vadd(vf a, vf b) { return a + b; }
INLINE vf vsub(vf a, vf b) { return a - b; }
INLINE vf vmul(vf a, vf b) { return a * b; }
INLINE vf vfmadd(vf a, vf b, vf c) { return a * b + c; }
INLINE vf vfnmadd(vf a, vf b, vf c) { return c - a * b; }
INLINE vf vsel(vm m, vf a, vf b) { return (vf)((m & (vi)a) | (~m & (vi)b)); }
INLINE vf vmax(vf a, vf b) { return vsel(a > b, a, b); }  /* NaN in b passes, as x86 max */
INLINE vf vabs(vf a) { return (vf)((vi)a & (vi){0x7FFFFFFF, 0x7FFFFFFF, 0x7FFFFFFF, 0x7FFFFFFF, 0x7FFFFFFF, 0x7FFFFFFF, 0x7FFFFFFF, 0x7FFFFFFF}); }
INLINE float vhsum(vf a) { return ((a[0] + a[4]) + (a[1] + a[5])) + ((a[2] + a[6]) + (a[3] + a[7])); }
INLINE float vhmax(vf a) {
    float m = a[0];
    for (int j = 1; j < 8; j++) m = a[j] > m ? a[j] : m;
    return m;
}

INLINE vf vload(const void *p, int bf16, int64_t i, int64_t left) {
    vf v = vzero();
    if (!bf16 && left >= 8) {
        memcpy(&v, (const float *)p + i, sizeof v);
        return v;
    }
    for (int j = 0; j < 8 && j < left; j++) v[j] = load1(p, bf16, i + j);
    return v;
}

INLINE void vstore(void *p, int bf16, int64_t i, vf v, int64_t left) {
    if (!bf16 && left >= 8) {
        memcpy((float *)p + i, &v, sizeof v);
        return;
    }
    for (int j = 0; j < 8 && j < left; j++) store1(p, bf16, i + j, v[j]);
}

INLINE vf vloadf(const float *p, int64_t left) { return vload(p, 0, 0, left); }
INLINE void vstoref(float *p, vf v, int64_t left) { vstore(p, 0, 0, v, left); }
INLINE vf vround_bf16(vf v) {
    for (int j = 0; j < 8; j++) v[j] = bf16_scalar(bf16_round(v[j]));
    return v;
}

INLINE vf vround(vf x) {
    for (int j = 0; j < 8; j++) x[j] = nearbyintf(x[j]);
    return x;
}
INLINE vf vclamp_keep_nan(vf x, float lo, float hi) {
    for (int j = 0; j < 8; j++) x[j] = x[j] < lo ? lo : x[j] > hi ? hi : x[j];
    return x;
}
INLINE vf vscale2(vf p, vf n) {
    for (int j = 0; j < 8; j++) p[j] = ldexpf(p[j], (int)n[j]);
    return p;
}
INLINE vf vrcp(vf d) { return vset1(1.0f) / d; }

INLINE vm vlt(vf a, vf b) { return a < b; }
INLINE vm vgt(vf a, vf b) { return a > b; }
INLINE vm vge_or_nan(vf a, vf b) { return ~(a < b); }
INLINE vm visnan(vf a) { return a != a; }
INLINE vm veq(vf a, vf b) { return a == b; }
INLINE vm vm_and(vm a, vm b) { return a & b; }
INLINE vm vm_or(vm a, vm b) { return a | b; }
INLINE vm vm_tail(int64_t left) {
    vm m = {0};
    for (int j = 0; j < 8 && j < left; j++) m[j] = -1;
    return m;
}
INLINE vm vm_none(void) { return (vm){0}; }
INLINE unsigned vm_bits(vm m) {
    unsigned bits = 0;
    for (int j = 0; j < 8; j++) bits |= (unsigned)(m[j] != 0) << j;
    return bits;
}

INLINE vi vi_iota(int32_t start) { return (vi){start, start + 1, start + 2, start + 3, start + 4, start + 5, start + 6, start + 7}; }
INLINE vi vi_zero(void) { return (vi){0}; }
INLINE vi vi_sel(vm m, vi a, vi b) { return (m & a) | (~m & b); }
INLINE int32_t vi_min_where(vm m, vi v) {
    int32_t best = INT32_MAX;
    for (int j = 0; j < 8; j++)
        if (m[j] && v[j] < best) best = v[j];
    return best;
}
INLINE void vstore_i16(int16_t *p, vf v, int64_t left) {
    for (int j = 0; j < 8 && j < left; j++) {
        float r = nearbyintf(v[j]);
        p[j] = (int16_t)(r > 32767.0f ? 32767 : r < -32768.0f ? -32768 : r);
    }
}

/* VL stored KV bytes as floats, before their scale. */
INLINE vf vload_kv8(const uint8_t *p, int kind) {
    vf v;
    for (int j = 0; j < 8; j++) v[j] = kv8_to_f32(p[j], kind);
    return v;
}
