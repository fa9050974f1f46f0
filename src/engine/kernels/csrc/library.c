/* What this build of the library holds (engine_kernels.h). Its tests ask it whether a build forced onto
 * the portable paths (engine/kernels/library.py, portable=True) left the AVX-512 and AMX ones out. */
#include "amx.h"

int engine_kernels_isa(void) {
    int isa = 0;
#if defined(__AVX512F__)
    isa |= 1;
#endif
#if defined(__AVX512BF16__)
    isa |= 2;
#endif
#if defined(HAVE_AMX)
    isa |= 4;
#endif
#if defined(__AVX512VNNI__)
    isa |= 8;
#endif
#if defined(HAVE_AMX) && defined(__AMX_INT8__)
    isa |= 16;
#endif
    return isa;
}
