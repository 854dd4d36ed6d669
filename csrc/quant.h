/* quant.h: group-wise affine quantisation of a float block (a lossy
 * chain block's form: kvstore/payload/quantizing.py, docs/format.md §20).
 *
 * count elements of dtype (KVS_Q_F32, KVS_Q_F16, KVS_Q_BF16), in groups of
 * group consecutive elements (16, 32 or 64); a group x is stored as the
 * integers q = round((x - bias) * (1 / scale)) clipped to [0, 2^bits - 1], bits 8 or 4
 * (4: two a byte, the earlier in the low nibble), with bias = min(x) and
 * scale = (max(x) - bias) / (2^bits - 1) rounded up into the dtype; scale
 * and bias are stored in the dtype (a 16-bit float as its 16 bits).
 * Arithmetic is float32, each operation rounded on its own (no fused
 * multiply-add), so the results equal NumPy's twin bit for bit
 * (tests/reference.py: quantize).
 */
#ifndef KVS_QUANT_H
#define KVS_QUANT_H

#include <stddef.h>
#include <stdint.h>

enum { KVS_Q_F32 = 0, KVS_Q_F16 = 1, KVS_Q_BF16 = 2 };

/* Quantises src (count elements, count a multiple of group, group even)
 * into q (count * bits / 8 bytes), scales and biases (count / group values
 * of dtype each).  Returns 0, or -1 when a value is not finite or a group's
 * scale does not fit the dtype (nothing useful is then in the outputs). */
int kvs_quantize(const void *src, size_t count, int dtype, int bits, size_t group,
                 uint8_t *q, void *scales, void *biases);

/* kvs_quantize's inverse: dst (count elements of dtype) = q * scale + bias,
 * rounded to the nearest (even) value of dtype. */
void kvs_dequantize(const uint8_t *q, const void *scales, const void *biases, size_t count, int dtype, int bits,
                    size_t group, void *dst);

/* The dequantizer's implementations (dispatch.h's KVS_IMPL_*): portable
 * (the baseline build, vectorised by the compiler) and, on x86-64 with
 * AVX2, KVS_IMPL_X86.  kvs_quant_has says whether impl can run here;
 * kvs_quant_select picks one (KVS_IMPL_AUTO: the fastest), returning -1
 * when it cannot run; kvs_quant_impl_name names the one running. */
int kvs_quant_has(int impl);
int kvs_quant_select(int impl);
const char *kvs_quant_impl_name(void);

#endif
