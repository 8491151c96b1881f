// CPU Adam / AdamW for ZeRO optimizer offload (CPUAdamBuilder, module "cpu_adam").
//
// What: one in-place Adam step over a flat parameter tensor, its gradient and its two moments:
//   g' = g + wd * p                       (Adam mode: L2 penalty folded into the gradient)
//   m  = lerp(m, g', 1 - beta1)           (same branch choice as torch's lerp)
//   v  = beta2 * v + (1 - beta2) * g'^2
//   p  = p * (1 - lr * wd)                (AdamW mode: decoupled decay)
//   p  = p - step_size * m / (sqrt(v) / sqrt(1 - beta2^t) + eps),  step_size = lr / (1 - beta1^t)
// Bias-correction factors are 1 when bias correction is off.
// adam_update_scaled is the offloaded step's form: fp32 params and moments (or bf16 params and moments: 16-bit
// offloaded states), a gradient kept in its own dtype (fp32, bf16 or fp16; bf16 or fp32 with bf16 params)
// multiplied by one fp32 coefficient (unscale x clip) as it is loaded, and optionally the updated params written
// rounded to a 16-bit dtype into a second buffer (the copy that goes back up to the accelerator). With fp32 params
// it computes exactly what "convert the gradient to fp32, multiply it, adam_update, then copy the params out"
// computes, in one pass over memory instead of three; with bf16 params, what the fp32 form computes on the same
// values, each result rounded once to bf16.
// Layout: param, grad, exp_avg, exp_avg_sq are contiguous CPU tensors of equal numel. Params and
// grads share a dtype (fp32, bf16 or fp16); the moments are fp32 or the param dtype.
// Numerics: all arithmetic in fp32 (the step scalars are computed in double and rounded once,
// as torch does); low-precision params are rounded to nearest-even on store. Threads come from
// torch's intra-op pool (at::parallel_for), so torch.set_num_threads applies; the inner loop is
// a straight-line body the compiler vectorises (AVX2/AVX-512 with -march=native), bf16 included.
#include <ATen/Parallel.h>
#include <ATen/core/Tensor.h>
#include <ATen/ops/empty.h>
#include <torch/csrc/utils/pybind.h>

#include <cmath>
#include <cstdint>
#include <cstring>
#include <mutex>
#include <type_traits>
#include <unordered_map>

namespace {

struct StepScalars {
    float lr;
    float beta1;
    float beta2;
    float eps;
    float weight_decay;
    float step_size;
    float bias_corr2_sqrt;
    float one_minus_beta1;  // derived scalars rounded once from double, as torch passes them
    float one_minus_beta2;
    float decay;            // 1 - lr * wd in AdamW mode, else 1
    bool decoupled;
};

struct AdamDefaults {
    bool adamw_mode;
};

std::mutex registry_mutex;
std::unordered_map<int, AdamDefaults> registry;

constexpr int64_t kGrain = 16 * 1024;

// Element storage and its fp32 conversions. bf16 is handled on its raw 16 bits with integer operations the
// compiler vectorises (c10::BFloat16's conversions keep the loop scalar: about 4x slower than fp32 here); the
// rounding is c10's, round-to-nearest-even with NaN stored as 0x7FC0, so results are the same bits.
inline float bits_to_float(uint32_t u) {
    float f;
    std::memcpy(&f, &u, sizeof(f));
    return f;
}

inline uint32_t float_to_bits(float f) {
    uint32_t u;
    std::memcpy(&u, &f, sizeof(u));
    return u;
}

template <typename T>
struct Io {
    using raw = T;
    static inline float load(T x) { return static_cast<float>(x); }
    static inline T store(float x) { return static_cast<T>(x); }
};

template <>
struct Io<at::BFloat16> {
    using raw = uint16_t;
    static inline float load(uint16_t b) { return bits_to_float(static_cast<uint32_t>(b) << 16); }
    static inline uint16_t store(float f) {
        const uint32_t u = float_to_bits(f);
        const uint32_t rounded = (u + 0x7FFFu + ((u >> 16) & 1u)) >> 16;
        return (u & 0x7FFFFFFFu) > 0x7F800000u ? static_cast<uint16_t>(0x7FC0) : static_cast<uint16_t>(rounded);
    }
};

// fp16 on its raw 16 bits as well, with selects instead of branches so that the loop stays vectorised (c10::Half's
// conversions kept it scalar: an fp16 gradient made the offloaded step about 3.5x slower than a bf16 one). Both
// directions are exact IEEE conversions, rounding to nearest-even on store, so the bits are c10's; a NaN is stored
// as the quiet NaN 0x7E00 with its sign, as c10 stores it.
template <>
struct Io<at::Half> {
    using raw = uint16_t;
    // Signed 32-bit arithmetic throughout (every value fits): the compilers vectorise signed compares and
    // int-to-float conversions, not their unsigned forms.
    static inline float load(uint16_t h) {
        const uint32_t sign = static_cast<uint32_t>(h & 0x8000u) << 16;
        const int32_t magnitude = h & 0x7FFF;
        // Normal numbers: move exponent and mantissa into place and rebias the exponent (127 - 15 = 112).
        int32_t bits = (magnitude << 13) + (112 << 23);
        // Infinity and NaN: the exponent must become 255; a NaN keeps its payload and is made quiet.
        bits = magnitude >= 0x7C00 ? bits + (112 << 23) : bits;
        bits = magnitude > 0x7C00 ? (bits | 0x00400000) : bits;
        // Zero and subnormals: the mantissa counts units of 2^-24, exactly representable in fp32.
        const float small = static_cast<float>(magnitude) * 5.9604644775390625e-08f;
        const int32_t out = magnitude < 0x0400 ? static_cast<int32_t>(float_to_bits(small)) : bits;
        return bits_to_float(static_cast<uint32_t>(out) | sign);
    }
    static inline uint16_t store(float f) {
        const uint32_t u = float_to_bits(f);
        const int32_t sign = static_cast<int32_t>((u >> 16) & 0x8000u);
        const int32_t a = static_cast<int32_t>(u & 0x7FFFFFFFu);
        // Below 2^-14 the result is subnormal (or zero): adding 0.5 aligns the fp32 mantissa's last bit with
        // 2^-24, so the hardware addition rounds to nearest-even at the right place.
        const int32_t small =
            static_cast<int32_t>(float_to_bits(bits_to_float(static_cast<uint32_t>(a)) + 0.5f)) - 0x3F000000;
        // Normal range: rebias the exponent and round the 13 dropped bits to nearest-even; a carry out of the
        // exponent gives infinity (65520 and up).
        const int32_t odd = (a >> 13) & 1;
        const int32_t normal = (a - (112 << 23) + 0x0FFF + odd) >> 13;
        int32_t h = a < (113 << 23) ? small : normal;
        h = a >= (143 << 23) ? 0x7C00 : h;  // 65536 and up, and infinity
        h = a > 0x7F800000 ? 0x7E00 : h;    // NaN
        return static_cast<uint16_t>(h | sign);
    }
};

template <typename P, typename S>
void adam_range(typename Io<P>::raw* __restrict__ param, const typename Io<P>::raw* __restrict__ grad,
                typename Io<S>::raw* __restrict__ exp_avg, typename Io<S>::raw* __restrict__ exp_avg_sq,
                int64_t begin, int64_t end, const StepScalars k) {
    const float one_minus_beta1 = k.one_minus_beta1;
    const float one_minus_beta2 = k.one_minus_beta2;
    const bool small_weight = std::abs(one_minus_beta1) < 0.5f;
    const float l2 = k.decoupled ? 0.0f : k.weight_decay;
    const bool has_l2 = l2 != 0.0f;  // 0 * inf would turn an infinite weight into NaN where torch keeps it
    const float decay = k.decay;
    const float neg_step = -k.step_size;
#pragma omp simd
    for (int64_t i = begin; i < end; ++i) {
        float p = Io<P>::load(param[i]);
        const float g = Io<P>::load(grad[i]) + (has_l2 ? l2 * p : 0.0f);
        float m = Io<S>::load(exp_avg[i]);
        float v = Io<S>::load(exp_avg_sq[i]);
        m = small_weight ? m + one_minus_beta1 * (g - m) : g - (g - m) * k.beta1;
        v = v * k.beta2 + one_minus_beta2 * (g * g);
        const float denom = std::sqrt(v) / k.bias_corr2_sqrt + k.eps;
        p = p * decay;
        p = p + neg_step * (m / denom);
        param[i] = Io<P>::store(p);
        exp_avg[i] = Io<S>::store(m);
        exp_avg_sq[i] = Io<S>::store(v);
    }
}

// The scaled form: param and moments of one dtype P (fp32, or bf16 for 16-bit offloaded states), gradient of dtype
// G scaled on load, optional copy of the updated params of type O. All arithmetic is fp32; a bf16 param and its
// moments are loaded exactly and rounded once on store, so the bits are those of the fp32 form on the same values
// followed by one rounding of each result.
template <typename P, typename G, typename O, bool kCopy>
void adam_scaled_range(typename Io<P>::raw* __restrict__ param, const typename Io<G>::raw* __restrict__ grad,
                       typename Io<P>::raw* __restrict__ exp_avg, typename Io<P>::raw* __restrict__ exp_avg_sq,
                       typename Io<O>::raw* __restrict__ copy_out, int64_t begin, int64_t end,
                       const StepScalars k, const float scale) {
    const float one_minus_beta1 = k.one_minus_beta1;
    const float one_minus_beta2 = k.one_minus_beta2;
    const bool small_weight = std::abs(one_minus_beta1) < 0.5f;
    const float l2 = k.decoupled ? 0.0f : k.weight_decay;
    const bool has_l2 = l2 != 0.0f;
    const float decay = k.decay;
    const float neg_step = -k.step_size;
#pragma omp simd
    for (int64_t i = begin; i < end; ++i) {
        float p = Io<P>::load(param[i]);
        const float scaled = Io<G>::load(grad[i]) * scale;
        const float g = scaled + (has_l2 ? l2 * p : 0.0f);
        float m = Io<P>::load(exp_avg[i]);
        float v = Io<P>::load(exp_avg_sq[i]);
        m = small_weight ? m + one_minus_beta1 * (g - m) : g - (g - m) * k.beta1;
        v = v * k.beta2 + one_minus_beta2 * (g * g);
        const float denom = std::sqrt(v) / k.bias_corr2_sqrt + k.eps;
        p = p * decay;
        p = p + neg_step * (m / denom);
        const typename Io<P>::raw stored = Io<P>::store(p);
        param[i] = stored;
        exp_avg[i] = Io<P>::store(m);
        exp_avg_sq[i] = Io<P>::store(v);
        if constexpr (kCopy) {
            if constexpr (std::is_same_v<P, O>) {
                copy_out[i] = stored;  // the same rounding of the same value
            } else {
                copy_out[i] = Io<O>::store(p);
            }
        }
    }
}

template <typename T>
typename Io<T>::raw* raw_ptr(const at::Tensor& t) {
    return reinterpret_cast<typename Io<T>::raw*>(t.data_ptr<T>());
}

template <typename P, typename S>
void adam_tensor(at::Tensor& params, const at::Tensor& grads, at::Tensor& exp_avg,
                 at::Tensor& exp_avg_sq, const StepScalars& k) {
    auto* p = raw_ptr<P>(params);
    const auto* g = raw_ptr<P>(grads);
    auto* m = raw_ptr<S>(exp_avg);
    auto* v = raw_ptr<S>(exp_avg_sq);
    at::parallel_for(0, params.numel(), kGrain, [&](int64_t b, int64_t e) {
        adam_range<P, S>(p, g, m, v, b, e, k);
    });
}

void check_tensors(const at::Tensor& params, const at::Tensor& grads, const at::Tensor& exp_avg,
                   const at::Tensor& exp_avg_sq) {
    const at::Tensor* all[] = {&params, &grads, &exp_avg, &exp_avg_sq};
    const char* names[] = {"params", "grads", "exp_avg", "exp_avg_sq"};
    for (int i = 0; i < 4; ++i) {
        TORCH_CHECK_VALUE(all[i]->device().is_cpu(), "cpu_adam: ", names[i], " must be a CPU tensor");
        TORCH_CHECK_VALUE(all[i]->is_contiguous(), "cpu_adam: ", names[i], " must be contiguous");
        TORCH_CHECK_VALUE(all[i]->numel() == params.numel(), "cpu_adam: ", names[i], " has ",
                          all[i]->numel(), " elements, params has ", params.numel());
    }
    TORCH_CHECK_VALUE(grads.scalar_type() == params.scalar_type(), "cpu_adam: grads dtype ",
                      grads.scalar_type(), " differs from params dtype ", params.scalar_type());
    TORCH_CHECK_VALUE(exp_avg.scalar_type() == exp_avg_sq.scalar_type(),
                      "cpu_adam: exp_avg and exp_avg_sq must share a dtype");
    const auto s = exp_avg.scalar_type();
    TORCH_CHECK_VALUE(s == at::kFloat || s == params.scalar_type(),
                      "cpu_adam: optimizer states must be float32 or the param dtype, got ", s);
}

template <typename P>
void dispatch_states(at::Tensor& params, const at::Tensor& grads, at::Tensor& exp_avg,
                     at::Tensor& exp_avg_sq, const StepScalars& k) {
    if (exp_avg.scalar_type() == at::kFloat) {
        adam_tensor<P, float>(params, grads, exp_avg, exp_avg_sq, k);
    } else {
        adam_tensor<P, P>(params, grads, exp_avg, exp_avg_sq, k);
    }
}

StepScalars make_scalars(int64_t step, double lr, double beta1, double beta2, double eps,
                         double weight_decay, bool bias_correction, bool decoupled) {
    TORCH_CHECK_VALUE(step >= 1, "cpu_adam: step must be >= 1, got ", step);
    const double bc1 = bias_correction ? 1.0 - std::pow(beta1, static_cast<double>(step)) : 1.0;
    const double bc2 = bias_correction ? 1.0 - std::pow(beta2, static_cast<double>(step)) : 1.0;
    StepScalars k;
    k.lr = static_cast<float>(lr);
    k.beta1 = static_cast<float>(beta1);
    k.beta2 = static_cast<float>(beta2);
    k.eps = static_cast<float>(eps);
    k.weight_decay = static_cast<float>(weight_decay);
    k.step_size = static_cast<float>(lr / bc1);
    k.bias_corr2_sqrt = static_cast<float>(std::sqrt(bc2));
    k.one_minus_beta1 = static_cast<float>(1.0 - beta1);
    k.one_minus_beta2 = static_cast<float>(1.0 - beta2);
    k.decay = static_cast<float>(decoupled ? 1.0 - lr * weight_decay : 1.0);
    k.decoupled = decoupled;
    return k;
}

int create_adam(int optimizer_id, double alpha, double beta1, double beta2, double eps,
                double weight_decay, bool adamw_mode, bool should_log) {
    (void)alpha; (void)beta1; (void)beta2; (void)eps; (void)weight_decay; (void)should_log;
    const std::lock_guard<std::mutex> lock(registry_mutex);
    registry[optimizer_id] = AdamDefaults{adamw_mode};
    return 0;
}

int destroy_adam(int optimizer_id) {
    const std::lock_guard<std::mutex> lock(registry_mutex);
    registry.erase(optimizer_id);
    return 0;
}

bool lookup_adamw_mode(int optimizer_id) {
    const std::lock_guard<std::mutex> lock(registry_mutex);
    auto it = registry.find(optimizer_id);
    TORCH_CHECK_VALUE(it != registry.end(), "cpu_adam: optimizer id ", optimizer_id,
                      " was not created (call create_adam first)");
    return it->second.adamw_mode;
}

int adam_update(int optimizer_id, int64_t step, double lr, double beta1, double beta2,
                double eps, double weight_decay, bool bias_correction, at::Tensor params,
                at::Tensor grads, at::Tensor exp_avg, at::Tensor exp_avg_sq) {
    const bool decoupled = lookup_adamw_mode(optimizer_id);
    check_tensors(params, grads, exp_avg, exp_avg_sq);
    const StepScalars k =
        make_scalars(step, lr, beta1, beta2, eps, weight_decay, bias_correction, decoupled);
    switch (params.scalar_type()) {
        case at::kFloat:
            TORCH_CHECK_VALUE(exp_avg.scalar_type() == at::kFloat, "cpu_adam: fp32 params need fp32 states");
            adam_tensor<float, float>(params, grads, exp_avg, exp_avg_sq, k);
            break;
        case at::kBFloat16:
            dispatch_states<at::BFloat16>(params, grads, exp_avg, exp_avg_sq, k);
            break;
        case at::kHalf:
            dispatch_states<at::Half>(params, grads, exp_avg, exp_avg_sq, k);
            break;
        default:
            TORCH_CHECK_VALUE(false, "cpu_adam: unsupported param dtype ", params.scalar_type(),
                              " (float32, bfloat16 or float16)");
    }
    return 0;
}

template <typename P, typename G, typename O, bool kCopy>
void adam_scaled_tensor(at::Tensor& params, const at::Tensor& grads, at::Tensor& exp_avg, at::Tensor& exp_avg_sq,
                        const at::Tensor& copy_out, const StepScalars& k, float scale) {
    auto* p = raw_ptr<P>(params);
    const auto* g = raw_ptr<G>(grads);
    auto* m = raw_ptr<P>(exp_avg);
    auto* v = raw_ptr<P>(exp_avg_sq);
    typename Io<O>::raw* out = kCopy ? raw_ptr<O>(copy_out) : nullptr;
    at::parallel_for(0, params.numel(), kGrain, [&](int64_t b, int64_t e) {
        adam_scaled_range<P, G, O, kCopy>(p, g, m, v, out, b, e, k, scale);
    });
}

void check_copy_out(const at::Tensor& out, const at::Tensor& params) {
    TORCH_CHECK_VALUE(out.device().is_cpu() && out.is_contiguous() && out.numel() == params.numel(),
                      "cpu_adam: copy_out must be a contiguous CPU tensor of ", params.numel(), " elements");
}

// fp32 params: any gradient dtype, a copy in any of the three dtypes.
template <typename G>
void dispatch_copy(at::Tensor& params, const at::Tensor& grads, at::Tensor& exp_avg, at::Tensor& exp_avg_sq,
                   const c10::optional<at::Tensor>& copy_out, const StepScalars& k, float scale) {
    if (!copy_out.has_value()) {
        adam_scaled_tensor<float, G, float, false>(params, grads, exp_avg, exp_avg_sq, at::Tensor(), k, scale);
        return;
    }
    const at::Tensor& out = *copy_out;
    check_copy_out(out, params);
    switch (out.scalar_type()) {
        case at::kBFloat16:
            adam_scaled_tensor<float, G, at::BFloat16, true>(params, grads, exp_avg, exp_avg_sq, out, k, scale);
            break;
        case at::kHalf:
            adam_scaled_tensor<float, G, at::Half, true>(params, grads, exp_avg, exp_avg_sq, out, k, scale);
            break;
        case at::kFloat:
            adam_scaled_tensor<float, G, float, true>(params, grads, exp_avg, exp_avg_sq, out, k, scale);
            break;
        default:
            TORCH_CHECK_VALUE(false, "cpu_adam: copy_out dtype ", out.scalar_type(),
                              " (float32, bfloat16 or float16)");
    }
}

// bf16 params and moments (16-bit offloaded states): a bf16 or fp32 gradient, a bf16 copy.
template <typename G>
void dispatch_bf16(at::Tensor& params, const at::Tensor& grads, at::Tensor& exp_avg, at::Tensor& exp_avg_sq,
                   const c10::optional<at::Tensor>& copy_out, const StepScalars& k, float scale) {
    using B = at::BFloat16;
    if (!copy_out.has_value()) {
        adam_scaled_tensor<B, G, B, false>(params, grads, exp_avg, exp_avg_sq, at::Tensor(), k, scale);
        return;
    }
    check_copy_out(*copy_out, params);
    TORCH_CHECK_VALUE(copy_out->scalar_type() == at::kBFloat16, "cpu_adam: with bfloat16 params copy_out must be "
                      "bfloat16, got ", copy_out->scalar_type());
    adam_scaled_tensor<B, G, B, true>(params, grads, exp_avg, exp_avg_sq, *copy_out, k, scale);
}

int adam_update_scaled(int optimizer_id, int64_t step, double lr, double beta1, double beta2, double eps,
                       double weight_decay, bool bias_correction, at::Tensor params, at::Tensor grads,
                       at::Tensor exp_avg, at::Tensor exp_avg_sq, double grad_scale,
                       c10::optional<at::Tensor> copy_out) {
    const bool decoupled = lookup_adamw_mode(optimizer_id);
    const at::Tensor* all[] = {&params, &grads, &exp_avg, &exp_avg_sq};
    const char* names[] = {"params", "grads", "exp_avg", "exp_avg_sq"};
    for (int i = 0; i < 4; ++i) {
        TORCH_CHECK_VALUE(all[i]->device().is_cpu() && all[i]->is_contiguous(), "cpu_adam: ", names[i],
                          " must be a contiguous CPU tensor");
        TORCH_CHECK_VALUE(all[i]->numel() == params.numel(), "cpu_adam: ", names[i], " has ", all[i]->numel(),
                          " elements, params has ", params.numel());
    }
    const auto dtype = params.scalar_type();
    TORCH_CHECK_VALUE((dtype == at::kFloat || dtype == at::kBFloat16) && exp_avg.scalar_type() == dtype &&
                          exp_avg_sq.scalar_type() == dtype,
                      "cpu_adam: adam_update_scaled needs float32 params and states, or bfloat16 params and "
                      "states; got params ", dtype, ", states ", exp_avg.scalar_type());
    const StepScalars k = make_scalars(step, lr, beta1, beta2, eps, weight_decay, bias_correction, decoupled);
    const float scale = static_cast<float>(grad_scale);
    if (dtype == at::kBFloat16) {
        switch (grads.scalar_type()) {
            case at::kBFloat16:
                dispatch_bf16<at::BFloat16>(params, grads, exp_avg, exp_avg_sq, copy_out, k, scale);
                break;
            case at::kFloat:
                dispatch_bf16<float>(params, grads, exp_avg, exp_avg_sq, copy_out, k, scale);
                break;
            default:
                TORCH_CHECK_VALUE(false, "cpu_adam: with bfloat16 params the gradient must be bfloat16 or float32, "
                                  "got ", grads.scalar_type());
        }
        return 0;
    }
    switch (grads.scalar_type()) {
        case at::kFloat:
            dispatch_copy<float>(params, grads, exp_avg, exp_avg_sq, copy_out, k, scale);
            break;
        case at::kBFloat16:
            dispatch_copy<at::BFloat16>(params, grads, exp_avg, exp_avg_sq, copy_out, k, scale);
            break;
        case at::kHalf:
            dispatch_copy<at::Half>(params, grads, exp_avg, exp_avg_sq, copy_out, k, scale);
            break;
        default:
            TORCH_CHECK_VALUE(false, "cpu_adam: unsupported grads dtype ", grads.scalar_type(),
                              " (float32, bfloat16 or float16)");
    }
    return 0;
}

}  // namespace

PYBIND11_MODULE(TORCH_EXTENSION_NAME, m) {
    m.def("create_adam", &create_adam, "Register an optimizer id and its Adam/AdamW mode");
    m.def("destroy_adam", &destroy_adam, "Forget an optimizer id");
    // The updates run without the GIL: an offloaded step calls them from a host worker thread while the
    // training thread runs the backward (its autograd hooks are Python). Holding the GIL for a chunk's whole
    // update stalled that thread for as long, and the accelerator with it. They touch no Python object; the
    // registry has its own mutex.
    m.def("adam_update", &adam_update, "One in-place Adam/AdamW step over CPU tensors",
          py::call_guard<py::gil_scoped_release>());
    m.def("adam_update_scaled", &adam_update_scaled,
          "One in-place Adam/AdamW step over fp32 (or bf16, with bf16 states) CPU params with a scaled gradient "
          "of its own dtype and an optional rounded copy of the updated params",
          py::call_guard<py::gil_scoped_release>());
}
