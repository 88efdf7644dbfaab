/* What every pagedllm CPU kernel file shares: vec.h's vector vocabulary for the instruction set
 * the file is compiled for.
 *
 * The *.c files next to this one are compiled together into one library per instruction set
 * level at first use by pagedllm/model_executor/layers/cpu_kernels.py (gcc -O3 -fopenmp with
 * that level's -m flags: AVX-512, AVX2 + FMA, or portable C) and loaded with ctypes. OpenMP:
 * the library links libgomp.so.1, which resolves to the copy torch has already loaded, so
 * both share one thread pool.
 *
 * Tensors are passed as raw pointers; `bf16` flags say whether a float tensor is bfloat16
 * (1) or float32 (0). Accumulation is always float32 (int32 for the integer dot products).
 */
#ifndef PAGEDLLM_COMMON_H
#define PAGEDLLM_COMMON_H

#include <stdlib.h>

#include "kernels.h"
#include "vec.h"

#endif /* PAGEDLLM_COMMON_H */
