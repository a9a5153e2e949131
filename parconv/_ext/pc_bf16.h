/* bfloat16 kernels (see _bf16.pyx). */
#ifndef PC_BF16_H
#define PC_BF16_H
#endif
