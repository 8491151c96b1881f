// Shared host/device declarations for deepspeed-lean's multi-tensor CUDA kernels.
//
// Both kernels (flatten/unflatten copy and fused Adam) describe their work with a
// device-resident table of entries. Each entry owns a contiguous run of thread blocks
// starting at `first_block`; a block finds its entry by binary search over that column,
// so one launch covers any number of tensors of any sizes without per-tensor launches.
// This header is plain C++/CUDA (no torch) so the .cu files compile with nvcc alone.
#pragma once

#include <cstdint>

#ifdef __CUDACC__
#define DS_HOST_DEVICE __host__ __device__
#else
#define DS_HOST_DEVICE
#endif

namespace ds_lean {

// One byte range copy: nbytes from src to dst (device addresses).
struct CopyEntry {
    int64_t src;
    int64_t dst;
    int64_t nbytes;
    int64_t first_block;
};

// Bytes one thread block moves. A multiple of 16 so every block of an entry sees the same
// 16-byte alignment phase as the entry's first block.
constexpr int64_t kCopyBlockBytes = 64 * 1024;
constexpr int kCopyThreads = 256;

// One tensor of an Adam update: param, grad, first and second moment, all `n` elements.
struct AdamEntry {
    int64_t param;
    int64_t grad;
    int64_t exp_avg;
    int64_t exp_avg_sq;
    int64_t numel;
    int64_t first_block;
};

constexpr int64_t kAdamBlockElems = 16 * 1024;
constexpr int kAdamThreads = 256;

// Scalars of one Adam step, precomputed on the host in double and rounded once.
struct AdamScalars {
    float lr;
    float beta1;
    float beta2;
    float eps;
    float weight_decay;
    float step_size;        // lr / (1 - beta1^t), or lr without bias correction
    float bias_corr2_sqrt;  // sqrt(1 - beta2^t), or 1 without bias correction
    float one_minus_beta1;  // derived scalars are rounded once from double, as torch passes them
    float one_minus_beta2;
    float decay;            // 1 - lr * wd in AdamW mode, else 1
    int decoupled;          // 1: AdamW (decoupled decay), 0: Adam with L2 added to the gradient
};

enum class ElemType : int { kFloat32 = 0, kFloat16 = 1, kBFloat16 = 2 };

// Number of blocks an entry of `units` work units needs when one block handles `per_block`.
DS_HOST_DEVICE inline int64_t blocks_for(int64_t units, int64_t per_block) {
    return (units + per_block - 1) / per_block;
}

}  // namespace ds_lean

#ifdef __CUDACC__
#include <cuda_runtime.h>
#endif

#if defined(__CUDACC__) || defined(DS_WITH_CUDA)
#include <cuda_runtime_api.h>
namespace ds_lean {
// Launch one multi-tensor copy. `table` is device memory holding `n_entries` entries with
// non-zero nbytes sorted by first_block; `total_blocks` is the sum of their block counts.
cudaError_t launch_multi_copy(const CopyEntry* table, int n_entries, int64_t total_blocks,
                              cudaStream_t stream);
// Launch one multi-tensor Adam step over `table` (device memory). `noop_flag` (device, may be
// null) skips the whole update when it holds a non-zero value.
cudaError_t launch_fused_adam(const AdamEntry* table, int n_entries, int64_t total_blocks,
                              AdamScalars scalars, ElemType elem, const int* noop_flag,
                              cudaStream_t stream);
}  // namespace ds_lean
#endif
