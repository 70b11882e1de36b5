/* The library's build facts and its OpenMP thread count. */
#include "common.h"

int nk_width(void) { return VW; }
void nk_set_threads(int n) { omp_set_num_threads(n); } /* the calling thread's later parallel regions */
int nk_threads(void) { return omp_get_max_threads(); }
