/* What this build of the kernels was compiled for, so start-up can say which paths run
   (engine/kernels/cpu_kernel.py's `Kernels.paths`): one bit per instruction set the code was built to use. */

#include "pdserve_kernels.h"

enum { PD_ISA_AVX2 = 1, PD_ISA_AVX512 = 2, PD_ISA_AVX512_BF16 = 4, PD_ISA_AMX = 8 };

int pd_isa(void) {
    int isa = 0;
#if defined(__AVX2__) && defined(__FMA__)
    isa |= PD_ISA_AVX2;
#endif
#if defined(__AVX512F__)
    isa |= PD_ISA_AVX512;
#endif
#if defined(__AVX512BF16__)
    isa |= PD_ISA_AVX512_BF16;
#endif
#if defined(__AMX_TILE__) && defined(__AMX_BF16__) && defined(__linux__)
    isa |= PD_ISA_AMX;
#endif
    return isa;
}
