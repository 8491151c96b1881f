// Python binding of the multi-tensor fused Adam kernel (FusedAdamBuilder, module "fused_adam").
//
// What: multi_tensor_adam(chunk_size, noop_flag, [grads, params, exp_avgs, exp_avg_sqs], lr,
// beta1, beta2, eps, step, mode, bias_correction, weight_decay) applies one Adam (mode 0, L2) or
// AdamW (mode 1, decoupled) step to every tensor in one launch per element type.
// Layout: the four lists have equal length; entry i of each list is a contiguous CUDA tensor with
// the same numel, device and dtype (fp32, fp16 or bf16). chunk_size is accepted for call
// compatibility; the kernel's work split is fixed (kAdamBlockElems per block).
// Numerics: see fused_adam.cu (fp32 arithmetic, scalars precomputed here in double).
#include <ATen/Parallel.h>
#include <ATen/core/Tensor.h>
#include <ATen/ops/empty.h>
#include <torch/csrc/utils/pybind.h>

#include <c10/cuda/CUDAStream.h>
#include <c10/cuda/CUDAGuard.h>

#include <cmath>
#include <cstring>
#include <vector>

#include "../includes/ds_multi_tensor.h"

namespace {

ds_lean::ElemType elem_type_of(at::ScalarType t) {
    switch (t) {
        case at::kFloat: return ds_lean::ElemType::kFloat32;
        case at::kHalf: return ds_lean::ElemType::kFloat16;
        case at::kBFloat16: return ds_lean::ElemType::kBFloat16;
        default:
            TORCH_CHECK_VALUE(false, "multi_tensor_adam: unsupported dtype ", t,
                              " (float32, float16 or bfloat16)");
    }
    return ds_lean::ElemType::kFloat32;
}

void check_lists(const std::vector<std::vector<at::Tensor>>& lists) {
    TORCH_CHECK_VALUE(lists.size() == 4, "multi_tensor_adam: expected 4 tensor lists "
                      "[grads, params, exp_avgs, exp_avg_sqs], got ", lists.size());
    const size_t n = lists[1].size();
    for (const auto& l : lists) {
        TORCH_CHECK_VALUE(l.size() == n, "multi_tensor_adam: tensor lists differ in length");
    }
    for (size_t i = 0; i < n; ++i) {
        const at::Tensor& p = lists[1][i];
        for (const auto& l : lists) {
            const at::Tensor& t = l[i];
            TORCH_CHECK_VALUE(t.is_cuda(), "multi_tensor_adam: tensor ", i, " is not on a CUDA device");
            TORCH_CHECK_VALUE(t.device() == p.device(), "multi_tensor_adam: tensor ", i,
                              " mixes devices ", t.device(), " and ", p.device());
            TORCH_CHECK_VALUE(t.is_contiguous(), "multi_tensor_adam: tensor ", i, " is not contiguous");
            TORCH_CHECK_VALUE(t.scalar_type() == p.scalar_type(), "multi_tensor_adam: tensor ", i,
                              " mixes dtypes ", t.scalar_type(), " and ", p.scalar_type());
            TORCH_CHECK_VALUE(t.numel() == p.numel(), "multi_tensor_adam: tensor ", i,
                              " has mismatched numel");
        }
    }
}

ds_lean::AdamScalars make_scalars(double lr, double beta1, double beta2, double eps, int64_t step,
                                  int64_t mode, bool bias_correction, double weight_decay) {
    TORCH_CHECK_VALUE(step >= 1, "multi_tensor_adam: step must be >= 1, got ", step);
    TORCH_CHECK_VALUE(mode == 0 || mode == 1, "multi_tensor_adam: mode must be 0 (Adam) or 1 (AdamW)");
    const double bc1 = bias_correction ? 1.0 - std::pow(beta1, static_cast<double>(step)) : 1.0;
    const double bc2 = bias_correction ? 1.0 - std::pow(beta2, static_cast<double>(step)) : 1.0;
    ds_lean::AdamScalars s;
    s.lr = static_cast<float>(lr);
    s.beta1 = static_cast<float>(beta1);
    s.beta2 = static_cast<float>(beta2);
    s.eps = static_cast<float>(eps);
    s.weight_decay = static_cast<float>(weight_decay);
    s.step_size = static_cast<float>(lr / bc1);
    s.bias_corr2_sqrt = static_cast<float>(std::sqrt(bc2));
    s.one_minus_beta1 = static_cast<float>(1.0 - beta1);
    s.one_minus_beta2 = static_cast<float>(1.0 - beta2);
    s.decay = static_cast<float>(mode == 1 ? 1.0 - lr * weight_decay : 1.0);
    s.decoupled = static_cast<int>(mode);
    return s;
}

// One launch over the tensors of one dtype (indices `members`).
void launch_group(const std::vector<std::vector<at::Tensor>>& lists, const std::vector<size_t>& members,
                  const ds_lean::AdamScalars& s, const at::Tensor& noop_flag) {
    std::vector<ds_lean::AdamEntry> entries;
    int64_t next_block = 0;
    for (size_t i : members) {
        const int64_t n = lists[1][i].numel();
        if (n == 0) continue;
        ds_lean::AdamEntry e;
        e.grad = reinterpret_cast<int64_t>(lists[0][i].data_ptr());
        e.param = reinterpret_cast<int64_t>(lists[1][i].data_ptr());
        e.exp_avg = reinterpret_cast<int64_t>(lists[2][i].data_ptr());
        e.exp_avg_sq = reinterpret_cast<int64_t>(lists[3][i].data_ptr());
        e.numel = n;
        e.first_block = next_block;
        next_block += ds_lean::blocks_for(n, ds_lean::kAdamBlockElems);
        entries.push_back(e);
    }
    if (entries.empty()) return;
    const at::Tensor& p0 = lists[1][members[0]];
    const int64_t fields = sizeof(ds_lean::AdamEntry) / sizeof(int64_t);
    at::Tensor host = at::empty({static_cast<int64_t>(entries.size()), fields},
                                at::TensorOptions().dtype(at::kLong).pinned_memory(true));
    std::memcpy(host.data_ptr(), entries.data(), sizeof(ds_lean::AdamEntry) * entries.size());
    at::Tensor table = host.to(p0.device(), /*non_blocking=*/true);
    const int* noop = nullptr;
    if (noop_flag.defined() && noop_flag.numel() > 0) {
        TORCH_CHECK_VALUE(noop_flag.is_cuda() && noop_flag.scalar_type() == at::kInt,
                          "multi_tensor_adam: noop_flag must be an int32 CUDA tensor");
        noop = noop_flag.data_ptr<int>();
    }
    const cudaError_t err = ds_lean::launch_fused_adam(
        reinterpret_cast<const ds_lean::AdamEntry*>(table.data_ptr()),
        static_cast<int>(entries.size()), next_block, s, elem_type_of(p0.scalar_type()), noop,
        c10::cuda::getCurrentCUDAStream().stream());
    TORCH_CHECK(err == cudaSuccess, "fused Adam launch failed: ", cudaGetErrorString(err));
}

void multi_tensor_adam(int64_t chunk_size, at::Tensor noop_flag,
                       std::vector<std::vector<at::Tensor>> tensor_lists, double lr, double beta1,
                       double beta2, double epsilon, int64_t step, int64_t mode,
                       int64_t bias_correction, double weight_decay) {
    (void)chunk_size;
    check_lists(tensor_lists);
    if (tensor_lists[1].empty()) return;
    const c10::cuda::CUDAGuard guard(tensor_lists[1][0].device());
    const ds_lean::AdamScalars s = make_scalars(lr, beta1, beta2, epsilon, step, mode,
                                                bias_correction != 0, weight_decay);
    std::vector<size_t> by_type[3];
    for (size_t i = 0; i < tensor_lists[1].size(); ++i) {
        by_type[static_cast<int>(elem_type_of(tensor_lists[1][i].scalar_type()))].push_back(i);
    }
    for (const auto& members : by_type) {
        if (!members.empty()) launch_group(tensor_lists, members, s, noop_flag);
    }
}

}  // namespace

PYBIND11_MODULE(TORCH_EXTENSION_NAME, m) {
    m.def("multi_tensor_adam", &multi_tensor_adam,
          "One fused Adam/AdamW step over lists [grads, params, exp_avgs, exp_avg_sqs]");
}
