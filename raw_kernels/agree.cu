// The plan agreement as a kernel of its own (agree.cuh says what it does): for transfers
// that compile their plan afterwards, the plan they must compile.
//
//! kernels: agree_plan

#include "agree.cuh"

// One block of AGREE_THREADS. Writes gated_count[E]: replica_count, or all ones when the
// plan is refused (a plan whose transfer writes nothing); null where the transfer reads the
// verdict from the status instead (a weight sync agreed just before its one launch).
extern "C" __global__ void agree_plan(const int* __restrict__ log_to_phys, const int* __restrict__ replica_count,
                                      int E, int K, int op, u64 layer, const u64* __restrict__ peer_bases, int rank,
                                      int world, u64 pad, u64* calls, u64 timeout_ns, u64* hashes, u64* status,
                                      int* __restrict__ gated_count) {
    const int refused = agree_on_plan(log_to_phys, replica_count, E, K, op, layer, peer_bases, rank, world, pad, calls,
                                      timeout_ns, hashes, status);
    if (gated_count == nullptr) return;
    for (int e = threadIdx.x; e < E; e += blockDim.x) gated_count[e] = refused ? 1 : replica_count[e];
}
