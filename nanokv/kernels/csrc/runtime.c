/* The library's build facts. */
#include "common.h"

int nk_width(void) { return VW; }
