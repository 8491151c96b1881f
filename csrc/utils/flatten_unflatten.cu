// Multi-tensor flatten / unflatten: one launch copies many byte ranges.
//
// What: for every table entry, copy `nbytes` from `src` to `dst`. Flatten uses the tensors as
// sources and slices of a caller-provided flat buffer as destinations; unflatten swaps them.
// The copy is dtype-agnostic (it moves bytes), so fp32/fp16/bf16/fp64 and any other dtype work.
//
// Layout: each entry is split into blocks of kCopyBlockBytes. Inside a block, destination bytes
// are written as aligned 16-byte vectors; the (< 16) leading and trailing bytes are copied one
// byte per thread. When the source has a different 16-byte phase than the destination (odd
// element offsets in the flat buffer), each vector is assembled from two aligned 16-byte source
// loads with a funnel shift, so DRAM traffic stays one read and one write per byte; the second
// load always touches an aligned 16-byte word that holds at least one requested byte.
//
// Numerics: exact (a bit copy).
#include <cuda_runtime.h>

#include <cstdint>

#include "../includes/ds_multi_tensor.h"

namespace ds_lean {
namespace {

constexpr int kUnroll = 4;

__device__ __forceinline__ int find_entry(const CopyEntry* table, int n, int64_t block) {
    int lo = 0;
    int hi = n - 1;
    while (lo < hi) {
        const int mid = (lo + hi + 1) >> 1;
        if (table[mid].first_block <= block) {
            lo = mid;
        } else {
            hi = mid - 1;
        }
    }
    return lo;
}

// Bytes [shift, shift + 16) of the 32-byte little-endian window lo:hi, for 0 < shift < 16.
__device__ __forceinline__ uint4 window16(const uint4& lo, const uint4& hi, int shift) {
    const int q = shift >> 2;
    const unsigned r = static_cast<unsigned>(shift & 3) * 8u;
    const uint32_t w0 = lo.x, w1 = lo.y, w2 = lo.z, w3 = lo.w;
    const uint32_t w4 = hi.x, w5 = hi.y, w6 = hi.z, w7 = hi.w;
    // Selects with constant indices keep the words in registers (a dynamic index would spill).
    const uint32_t a0 = q == 0 ? w0 : q == 1 ? w1 : q == 2 ? w2 : w3;
    const uint32_t a1 = q == 0 ? w1 : q == 1 ? w2 : q == 2 ? w3 : w4;
    const uint32_t a2 = q == 0 ? w2 : q == 1 ? w3 : q == 2 ? w4 : w5;
    const uint32_t a3 = q == 0 ? w3 : q == 1 ? w4 : q == 2 ? w5 : w6;
    const uint32_t a4 = q == 0 ? w4 : q == 1 ? w5 : q == 2 ? w6 : w7;
    uint4 out;
    out.x = __funnelshift_r(a0, a1, r);
    out.y = __funnelshift_r(a1, a2, r);
    out.z = __funnelshift_r(a2, a3, r);
    out.w = __funnelshift_r(a3, a4, r);
    return out;
}

__device__ __forceinline__ void copy_vectors_aligned(const uint4* __restrict__ src,
                                                     uint4* __restrict__ dst, int64_t nvec) {
    const int64_t stride = static_cast<int64_t>(blockDim.x) * kUnroll;
    for (int64_t base = threadIdx.x; base < nvec; base += stride) {
        uint4 v[kUnroll];
#pragma unroll
        for (int k = 0; k < kUnroll; ++k) {
            const int64_t j = base + static_cast<int64_t>(k) * blockDim.x;
            if (j < nvec) v[k] = src[j];
        }
#pragma unroll
        for (int k = 0; k < kUnroll; ++k) {
            const int64_t j = base + static_cast<int64_t>(k) * blockDim.x;
            if (j < nvec) dst[j] = v[k];
        }
    }
}

__device__ __forceinline__ void copy_vectors_shifted(const uint4* __restrict__ src_aligned,
                                                     int shift, uint4* __restrict__ dst,
                                                     int64_t nvec) {
    const int64_t stride = static_cast<int64_t>(blockDim.x) * kUnroll;
    for (int64_t base = threadIdx.x; base < nvec; base += stride) {
        uint4 lo[kUnroll];
        uint4 hi[kUnroll];
#pragma unroll
        for (int k = 0; k < kUnroll; ++k) {
            const int64_t j = base + static_cast<int64_t>(k) * blockDim.x;
            if (j < nvec) {
                lo[k] = src_aligned[j];
                hi[k] = src_aligned[j + 1];
            }
        }
#pragma unroll
        for (int k = 0; k < kUnroll; ++k) {
            const int64_t j = base + static_cast<int64_t>(k) * blockDim.x;
            if (j < nvec) dst[j] = window16(lo[k], hi[k], shift);
        }
    }
}

// Copy len bytes; every thread of the block participates.
__device__ __forceinline__ void copy_span(const uint8_t* __restrict__ src,
                                          uint8_t* __restrict__ dst, int64_t len) {
    const auto dst_addr = reinterpret_cast<uintptr_t>(dst);
    int64_t head = static_cast<int64_t>((16 - (dst_addr & 15)) & 15);
    if (head > len) head = len;
    const int64_t nvec = (len - head) / 16;
    const int64_t tail_start = head + nvec * 16;
    for (int64_t i = threadIdx.x; i < head; i += blockDim.x) dst[i] = src[i];
    for (int64_t i = tail_start + threadIdx.x; i < len; i += blockDim.x) dst[i] = src[i];
    if (nvec == 0) return;
    uint4* dst_vec = reinterpret_cast<uint4*>(dst + head);
    const uint8_t* body_src = src + head;
    const int shift = static_cast<int>(reinterpret_cast<uintptr_t>(body_src) & 15);
    if (shift == 0) {
        copy_vectors_aligned(reinterpret_cast<const uint4*>(body_src), dst_vec, nvec);
    } else {
        copy_vectors_shifted(reinterpret_cast<const uint4*>(body_src - shift), shift, dst_vec,
                             nvec);
    }
}

__global__ void __launch_bounds__(kCopyThreads)
    multi_copy_kernel(const CopyEntry* __restrict__ table, int n_entries) {
    const int64_t block = blockIdx.x;
    const CopyEntry e = table[find_entry(table, n_entries, block)];
    const int64_t start = (block - e.first_block) * kCopyBlockBytes;
    int64_t len = e.nbytes - start;
    if (len > kCopyBlockBytes) len = kCopyBlockBytes;
    if (len <= 0) return;
    copy_span(reinterpret_cast<const uint8_t*>(e.src) + start,
              reinterpret_cast<uint8_t*>(e.dst) + start, len);
}

}  // namespace

cudaError_t launch_multi_copy(const CopyEntry* table, int n_entries, int64_t total_blocks,
                              cudaStream_t stream) {
    if (n_entries <= 0 || total_blocks <= 0) return cudaSuccess;
    if (total_blocks > 0x7fffffffLL) return cudaErrorInvalidConfiguration;
    multi_copy_kernel<<<static_cast<unsigned>(total_blocks), kCopyThreads, 0, stream>>>(table,
                                                                                      n_entries);
    return cudaGetLastError();
}

}  // namespace ds_lean
