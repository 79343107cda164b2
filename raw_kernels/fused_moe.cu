// Fused MoE layer (UniEP): dispatch + up-projection and down-projection + combine as two
// persistent kernels. ultraep/integration/fused.py states the task semantics in NumPy
// (task order, scoreboard, flags) and is the reference these kernels are held to.

#include <cuda_bf16.h>

// Task granularity, shared with the host (kernel_constant).
#define FM_SEND_TOKENS 16        // tokens per send task
#define FM_REDUCE_TOKENS 16      // tokens per reduce task (times one down-projection column block)
#define FM_BM 128                // rows per relay task and per GEMM tile (GH_BM)
#define FM_UP_COLS 128           // act columns per up tile: GH_BN accumulators, gate half | up half
#define FM_DOWN_COLS 256         // output columns per down tile and per reduce task (GH_BN)
