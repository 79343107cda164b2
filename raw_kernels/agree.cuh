// Plan agreement on the device: before a transfer, every rank hashes the plan it was given,
// publishes the hash to every peer's signal pad and compares all of them, with no host
// round trip. When the ranks disagree (or a peer does not answer in time) the plan is
// refused and the transfer writes nothing: agree.cu's kernel hands a gated plan to the
// compile after it; a weight sync runs the agreement, its compile and its copy in one launch
// (transfer.cu), the copy reading the status instead -- or, where ranks share a GPU, agree.cu's
// kernel just before that launch, with no gated plan. The host reads the recorded failure
// when it synchronises.
//
// The hash is a sum over the plan's words of a 64-bit mix of (position, value), so threads
// can add their shares in any order; ultraep/transfer/agreement.py (plan_hash) is its NumPy
// twin and must stay bit-for-bit equal. Columns of log_to_phys past an expert's instance
// count are read as -1: a transfer never reads them, so what they hold cannot split ranks.
//
#pragma once

#include "sync.cuh"

#define AGREE_THREADS 256
// status[]: what the first failure since the host last read it was, then each rank's hash
#define STATUS_KIND 0     // AGREE_OK, AGREE_MISMATCH or AGREE_TIMEOUT
#define STATUS_CALL 1     // the call it happened in
#define STATUS_OP 2       // that call's operation code (the host names it)
#define STATUS_LAYER 3    // that call's layer on this rank
#define STATUS_WAITED 4   // a timeout: the rank waited for
#define STATUS_SEEN 5     // a timeout: the last call that rank had published
#define STATUS_HASHES 6   // a mismatch: world hashes, in rank order
#define AGREE_OK 0
#define AGREE_MISMATCH 1
#define AGREE_TIMEOUT 2
// Signal slots per rank in each pad: the call each rank published last, then two hash
// slots per rank by the call's parity (a peer can be at most one call ahead, so the
// slot it writes is never the one this rank is still reading).
#define AGREE_SLOTS_PER_RANK 3

__device__ __forceinline__ u64 mix64(u64 z) {
    z += 0x9E3779B97F4A7C15ull;
    z = (z ^ (z >> 30)) * 0xBF58476D1CE4E5B9ull;
    z = (z ^ (z >> 27)) * 0x94D049BB133111EBull;
    return z ^ (z >> 31);
}

// The word at `position` of the hashed plan: log_to_phys[E*K] from 1, then replica_count[E]
// (position 0 is the layer, mixed whole).
__device__ __forceinline__ u64 hashed_word(u64 position, unsigned value) {
    return mix64((position << 32) | value);
}

// The whole block of AGREE_THREADS calls it; it returns to every thread whether the plan
// is refused. `pad` is the byte offset of this engine's signal block in every heap; `calls`
// counts the engine's transfers on the device (the same on every rank; kept here, not
// passed in, so a captured CUDA graph numbers its replays too); `op` and `layer` are
// recorded with a failure (the layer is hashed too); `hashes` is world words of scratch.
// While a failure waits in status[] for the host, later calls publish nothing and are
// refused at once: every transfer after it writes nothing until it is reported.
__device__ int agree_on_plan(const int* __restrict__ log_to_phys, const int* __restrict__ replica_count, int E,
                             int K, int op, u64 layer, const u64* __restrict__ peer_bases, int rank, int world, u64 pad,
                             u64* calls, u64 timeout_ns, u64* hashes, u64* status) {
    __shared__ u64 partial[AGREE_THREADS];
    __shared__ u64 this_call;
    __shared__ int failed;
    if (threadIdx.x == 0) {
        this_call = *calls + 1;
        *calls = this_call;
        failed = static_cast<int>(status[STATUS_KIND]);
    }
    __syncthreads();
    const u64 call = this_call;
    if (!failed) {
        const u64 words = static_cast<u64>(E) * K;
        u64 sum = threadIdx.x == 0 ? mix64(layer) : 0;
        for (u64 i = threadIdx.x; i < words; i += blockDim.x) {
            const int used = static_cast<int>(i % K) < replica_count[i / K];
            sum += hashed_word(1 + i, static_cast<unsigned>(used ? log_to_phys[i] : -1));
        }
        for (u64 e = threadIdx.x; e < static_cast<u64>(E); e += blockDim.x)
            sum += hashed_word(1 + words + e, static_cast<unsigned>(replica_count[e]));
        partial[threadIdx.x] = sum;
        __syncthreads();
        for (int half = blockDim.x / 2; half > 0; half /= 2) {
            if (threadIdx.x < half) partial[threadIdx.x] += partial[threadIdx.x + half];
            __syncthreads();
        }
        const u64 mine = partial[0];
        const int parity = static_cast<int>(call & 1);
        for (int peer = threadIdx.x; peer < world; peer += blockDim.x) {
            u64* slots = reinterpret_cast<u64*>(peer_bases[peer] + pad);
            slots[world * (1 + parity) + rank] = mine;
            store_release_sys(slots + rank, call);  // the hash before the call number that announces it
        }
        const u64* own = reinterpret_cast<const u64*>(peer_bases[rank] + pad);
        for (int peer = threadIdx.x; peer < world; peer += blockDim.x) {
            const u64 start = global_timer_ns();
            u64 seen;
            while ((seen = load_acquire_sys(own + peer)) < call) {
                if (global_timer_ns() - start > timeout_ns) break;
                __nanosleep(256);
            }
            if (seen < call) {
                if (atomicCAS(status + STATUS_KIND, 0ull, static_cast<u64>(AGREE_TIMEOUT)) == 0ull) {
                    status[STATUS_CALL] = call;
                    status[STATUS_OP] = static_cast<u64>(op);
                    status[STATUS_LAYER] = layer;
                    status[STATUS_WAITED] = static_cast<u64>(peer);
                    status[STATUS_SEEN] = seen;
                }
                hashes[peer] = 0;
            } else {
                hashes[peer] = own[world * (1 + parity) + peer];
            }
        }
        __syncthreads();  // every peer's hash (or a timeout) is in hashes[] and status[]
        if (threadIdx.x == 0) {
            volatile u64* kind = status + STATUS_KIND;  // other threads' atomics may have set it
            if (*kind == AGREE_OK) {
                const volatile u64* seen_hashes = hashes;
                bool same = true;
                for (int peer = 0; peer < world; ++peer) same = same && seen_hashes[peer] == mine;
                if (!same) {
                    status[STATUS_CALL] = call;
                    status[STATUS_OP] = static_cast<u64>(op);
                    status[STATUS_LAYER] = layer;
                    for (int peer = 0; peer < world; ++peer) status[STATUS_HASHES + peer] = seen_hashes[peer];
                    *kind = AGREE_MISMATCH;
                }
            }
            failed = static_cast<int>(*kind);  // a mismatch or this call's timeout gates the plan
        }
        __syncthreads();
    }
    return failed;  // written before a barrier every thread has passed, as agree.cu's loop read it before
}
