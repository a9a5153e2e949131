/* int8 kernels (see _int8.pyx). */
#ifndef PC_INT8_H
#define PC_INT8_H
#endif
