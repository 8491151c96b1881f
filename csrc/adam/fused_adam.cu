// Multi-tensor fused Adam / AdamW for the GPU (FusedAdamBuilder, module "fused_adam").
//
// What: one launch applies an Adam or AdamW step to every tensor of a list:
//   g' = g + wd * p (Adam/L2 mode);  m = m + (1 - beta1)(g' - m);  v = beta2 v + (1 - beta2) g'^2
//   p = p (1 - lr wd) (AdamW mode);  p = p - step_size * m / (sqrt(v) / sqrt(1 - beta2^t) + eps)
// Layout: a device table holds (param, grad, exp_avg, exp_avg_sq, numel, first_block) per tensor;
// all four arrays of an entry share the element type (fp32, fp16 or bf16) and are contiguous.
// Each block owns kAdamBlockElems consecutive elements of one entry. When all four pointers are
// aligned to 4 elements, a thread moves 4 elements per access (16 bytes for fp32), else 1.
// Numerics: arithmetic in fp32 whatever the storage type; results rounded to nearest on store.
// The bias-corrected step size and sqrt(1 - beta2^t) come precomputed (host double -> float).
#include <cuda_bf16.h>
#include <cuda_fp16.h>
#include <cuda_runtime.h>

#include <cstdint>

#include "../includes/ds_multi_tensor.h"

namespace ds_lean {
namespace {

constexpr int kVec = 4;

__device__ __forceinline__ float to_float(float x) { return x; }
__device__ __forceinline__ float to_float(__half x) { return __half2float(x); }
__device__ __forceinline__ float to_float(__nv_bfloat16 x) { return __bfloat162float(x); }

template <typename T>
__device__ __forceinline__ T from_float(float x);
template <>
__device__ __forceinline__ float from_float<float>(float x) { return x; }
template <>
__device__ __forceinline__ __half from_float<__half>(float x) { return __float2half_rn(x); }
template <>
__device__ __forceinline__ __nv_bfloat16 from_float<__nv_bfloat16>(float x) {
    return __float2bfloat16_rn(x);
}

template <typename T>
struct alignas(sizeof(T) * kVec) Pack {
    T v[kVec];
};

__device__ __forceinline__ int find_entry(const AdamEntry* table, int n, int64_t block) {
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

__device__ __forceinline__ void adam_math(float& p, float g, float& m, float& v,
                                          const AdamScalars& s) {
    if (!s.decoupled) g = fmaf(s.weight_decay, p, g);
    m = fmaf(s.one_minus_beta1, g - m, m);
    v = fmaf(s.one_minus_beta2, g * g, s.beta2 * v);
    const float denom = sqrtf(v) / s.bias_corr2_sqrt + s.eps;
    p = p * s.decay;
    p = p - s.step_size * (m / denom);
}

template <typename T>
__device__ __forceinline__ void adam_vectorized(T* p, const T* g, T* m, T* v, int64_t n,
                                                const AdamScalars& s) {
    const int64_t npack = n / kVec;
    for (int64_t j = threadIdx.x; j < npack; j += blockDim.x) {
        Pack<T> pp = reinterpret_cast<const Pack<T>*>(p)[j];
        const Pack<T> gp = reinterpret_cast<const Pack<T>*>(g)[j];
        Pack<T> mp = reinterpret_cast<const Pack<T>*>(m)[j];
        Pack<T> vp = reinterpret_cast<const Pack<T>*>(v)[j];
#pragma unroll
        for (int k = 0; k < kVec; ++k) {
            float pf = to_float(pp.v[k]), mf = to_float(mp.v[k]), vf = to_float(vp.v[k]);
            adam_math(pf, to_float(gp.v[k]), mf, vf, s);
            pp.v[k] = from_float<T>(pf);
            mp.v[k] = from_float<T>(mf);
            vp.v[k] = from_float<T>(vf);
        }
        reinterpret_cast<Pack<T>*>(p)[j] = pp;
        reinterpret_cast<Pack<T>*>(m)[j] = mp;
        reinterpret_cast<Pack<T>*>(v)[j] = vp;
    }
    for (int64_t i = npack * kVec + threadIdx.x; i < n; i += blockDim.x) {
        float pf = to_float(p[i]), mf = to_float(m[i]), vf = to_float(v[i]);
        adam_math(pf, to_float(g[i]), mf, vf, s);
        p[i] = from_float<T>(pf);
        m[i] = from_float<T>(mf);
        v[i] = from_float<T>(vf);
    }
}

template <typename T>
__device__ __forceinline__ void adam_scalar(T* p, const T* g, T* m, T* v, int64_t n,
                                            const AdamScalars& s) {
    for (int64_t i = threadIdx.x; i < n; i += blockDim.x) {
        float pf = to_float(p[i]), mf = to_float(m[i]), vf = to_float(v[i]);
        adam_math(pf, to_float(g[i]), mf, vf, s);
        p[i] = from_float<T>(pf);
        m[i] = from_float<T>(mf);
        v[i] = from_float<T>(vf);
    }
}

template <typename T>
__global__ void __launch_bounds__(kAdamThreads)
    fused_adam_kernel(const AdamEntry* __restrict__ table, int n_entries, AdamScalars s,
                      const int* __restrict__ noop_flag) {
    if (noop_flag != nullptr && *noop_flag != 0) return;
    const int64_t block = blockIdx.x;
    const AdamEntry e = table[find_entry(table, n_entries, block)];
    const int64_t start = (block - e.first_block) * kAdamBlockElems;
    int64_t n = e.numel - start;
    if (n > kAdamBlockElems) n = kAdamBlockElems;
    if (n <= 0) return;
    T* p = reinterpret_cast<T*>(e.param) + start;
    const T* g = reinterpret_cast<const T*>(e.grad) + start;
    T* m = reinterpret_cast<T*>(e.exp_avg) + start;
    T* v = reinterpret_cast<T*>(e.exp_avg_sq) + start;
    constexpr uintptr_t mask = sizeof(T) * kVec - 1;
    const uintptr_t any = reinterpret_cast<uintptr_t>(p) | reinterpret_cast<uintptr_t>(g) |
                          reinterpret_cast<uintptr_t>(m) | reinterpret_cast<uintptr_t>(v);
    if ((any & mask) == 0) {
        adam_vectorized(p, g, m, v, n, s);
    } else {
        adam_scalar(p, g, m, v, n, s);
    }
}

}  // namespace

cudaError_t launch_fused_adam(const AdamEntry* table, int n_entries, int64_t total_blocks,
                              AdamScalars scalars, ElemType elem, const int* noop_flag,
                              cudaStream_t stream) {
    if (n_entries <= 0 || total_blocks <= 0) return cudaSuccess;
    if (total_blocks > 0x7fffffffLL) return cudaErrorInvalidConfiguration;
    const dim3 grid(static_cast<unsigned>(total_blocks));
    switch (elem) {
        case ElemType::kFloat32:
            fused_adam_kernel<float><<<grid, kAdamThreads, 0, stream>>>(table, n_entries, scalars, noop_flag);
            break;
        case ElemType::kFloat16:
            fused_adam_kernel<__half><<<grid, kAdamThreads, 0, stream>>>(table, n_entries, scalars, noop_flag);
            break;
        case ElemType::kBFloat16:
            fused_adam_kernel<__nv_bfloat16>
                <<<grid, kAdamThreads, 0, stream>>>(table, n_entries, scalars, noop_flag);
            break;
        default:
            return cudaErrorInvalidValue;
    }
    return cudaGetLastError();
}

}  // namespace ds_lean
