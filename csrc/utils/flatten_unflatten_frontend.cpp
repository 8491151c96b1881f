// Python binding of the multi-tensor flatten / unflatten op (UtilsBuilder, module "utils").
// (Named *_frontend so its object file never collides with flatten_unflatten.cu's in setuptools builds.)
//
// What: flatten_into copies each tensor into a caller-provided flat buffer at a given element
// offset; unflatten_from copies those slices back into the tensors. flatten / unflatten keep the
// old UtilsBuilder contract (new packed buffer; views of a flat buffer).
// Layout: every tensor contiguous, same device and dtype as the flat buffer; offsets are in
// elements of the flat buffer and each [offset, offset + numel) lies inside it.
// Numerics: exact copies. CUDA tensors use the one-launch kernel in flatten_unflatten.cu when the
// module was compiled with DS_WITH_CUDA; CPU tensors are copied with memcpy here.
#include <ATen/Parallel.h>
#include <ATen/core/Tensor.h>
#include <ATen/ops/empty.h>
#include <torch/csrc/utils/pybind.h>

#include <cstring>
#include <vector>

#ifdef DS_WITH_CUDA
#include <c10/cuda/CUDAStream.h>
#include <c10/cuda/CUDAGuard.h>
#endif

#include "../includes/ds_multi_tensor.h"

namespace {

enum class Direction { kFlatten, kUnflatten };

std::vector<int64_t> resolve_offsets(const std::vector<at::Tensor>& tensors,
                                     const std::vector<int64_t>& offsets) {
    if (!offsets.empty()) return offsets;
    std::vector<int64_t> packed(tensors.size());
    int64_t next = 0;
    for (size_t i = 0; i < tensors.size(); ++i) {
        packed[i] = next;
        next += tensors[i].numel();
    }
    return packed;
}

void check_inputs(const char* op, const std::vector<at::Tensor>& tensors, const at::Tensor& flat,
                  const std::vector<int64_t>& offsets) {
    TORCH_CHECK_VALUE(flat.defined(), op, ": the flat buffer is undefined");
    TORCH_CHECK_VALUE(flat.is_contiguous(), op, ": the flat buffer must be contiguous");
    TORCH_CHECK_VALUE(offsets.size() == tensors.size(), op, ": got ", offsets.size(),
                      " offsets for ", tensors.size(), " tensors");
    const int64_t capacity = flat.numel();
    for (size_t i = 0; i < tensors.size(); ++i) {
        const at::Tensor& t = tensors[i];
        TORCH_CHECK_VALUE(t.defined(), op, ": tensor ", i, " is undefined");
        TORCH_CHECK_VALUE(t.device() == flat.device(), op, ": tensor ", i, " is on ", t.device(),
                          " but the flat buffer is on ", flat.device(), " (mixed devices)");
        TORCH_CHECK_VALUE(t.scalar_type() == flat.scalar_type(), op, ": tensor ", i, " has dtype ",
                          t.scalar_type(), " but the flat buffer has ", flat.scalar_type());
        TORCH_CHECK_VALUE(t.is_contiguous(), op, ": tensor ", i, " is not contiguous");
        TORCH_CHECK_VALUE(offsets[i] >= 0 && offsets[i] + t.numel() <= capacity, op, ": tensor ",
                          i, " with ", t.numel(), " elements at offset ", offsets[i],
                          " does not fit in a flat buffer of ", capacity, " elements");
    }
}

// Byte ranges (src, dst, nbytes) of every non-empty tensor, in direction order.
std::vector<ds_lean::CopyEntry> build_entries(Direction dir, const std::vector<at::Tensor>& tensors,
                                              const at::Tensor& flat,
                                              const std::vector<int64_t>& offsets) {
    std::vector<ds_lean::CopyEntry> entries;
    entries.reserve(tensors.size());
    auto* base = static_cast<char*>(flat.data_ptr());
    const int64_t elem = flat.element_size();
    int64_t next_block = 0;
    for (size_t i = 0; i < tensors.size(); ++i) {
        const int64_t nbytes = tensors[i].numel() * elem;
        if (nbytes == 0) continue;
        auto tensor_addr = reinterpret_cast<int64_t>(tensors[i].data_ptr());
        auto flat_addr = reinterpret_cast<int64_t>(base + offsets[i] * elem);
        ds_lean::CopyEntry e;
        e.src = dir == Direction::kFlatten ? tensor_addr : flat_addr;
        e.dst = dir == Direction::kFlatten ? flat_addr : tensor_addr;
        e.nbytes = nbytes;
        e.first_block = next_block;
        next_block += ds_lean::blocks_for(nbytes, ds_lean::kCopyBlockBytes);
        entries.push_back(e);
    }
    return entries;
}

void copy_on_cpu(const std::vector<ds_lean::CopyEntry>& entries) {
    at::parallel_for(0, static_cast<int64_t>(entries.size()), 1, [&](int64_t b, int64_t e) {
        for (int64_t i = b; i < e; ++i) {
            std::memcpy(reinterpret_cast<void*>(entries[i].dst),
                        reinterpret_cast<const void*>(entries[i].src), entries[i].nbytes);
        }
    });
}

#ifdef DS_WITH_CUDA
void copy_on_cuda(const std::vector<ds_lean::CopyEntry>& entries, const at::Tensor& flat) {
    if (entries.empty()) return;
    const c10::cuda::CUDAGuard guard(flat.device());
    const int64_t n = static_cast<int64_t>(entries.size());
    const int64_t fields = sizeof(ds_lean::CopyEntry) / sizeof(int64_t);
    // Pinned staging lets the table upload run asynchronously; the caching host allocator keeps
    // the staging block alive until the copy on this stream has finished.
    at::Tensor host = at::empty({n, fields}, at::TensorOptions().dtype(at::kLong).pinned_memory(true));
    std::memcpy(host.data_ptr(), entries.data(), sizeof(ds_lean::CopyEntry) * entries.size());
    at::Tensor table = host.to(flat.device(), /*non_blocking=*/true);
    const ds_lean::CopyEntry& last = entries.back();
    const int64_t total_blocks = last.first_block + ds_lean::blocks_for(last.nbytes, ds_lean::kCopyBlockBytes);
    const cudaError_t err = ds_lean::launch_multi_copy(
        reinterpret_cast<const ds_lean::CopyEntry*>(table.data_ptr()), static_cast<int>(n),
        total_blocks, c10::cuda::getCurrentCUDAStream().stream());
    TORCH_CHECK(err == cudaSuccess, "multi-tensor copy launch failed: ", cudaGetErrorString(err));
}
#endif

void run_copy(const char* op, Direction dir, const std::vector<at::Tensor>& tensors,
              const at::Tensor& flat, const std::vector<int64_t>& offsets_in) {
    const std::vector<int64_t> offsets = resolve_offsets(tensors, offsets_in);
    check_inputs(op, tensors, flat, offsets);
    const auto entries = build_entries(dir, tensors, flat, offsets);
    if (flat.device().is_cpu()) {
        copy_on_cpu(entries);
        return;
    }
#ifdef DS_WITH_CUDA
    if (flat.device().is_cuda()) {
        copy_on_cuda(entries, flat);
        return;
    }
#endif
    TORCH_CHECK_VALUE(false, op, ": this build has no kernel for device ", flat.device());
}

at::Tensor flatten_into(const std::vector<at::Tensor>& tensors, at::Tensor out,
                        const std::vector<int64_t>& offsets) {
    run_copy("flatten_into", Direction::kFlatten, tensors, out, offsets);
    return out;
}

void unflatten_from(const at::Tensor& flat, const std::vector<at::Tensor>& tensors,
                    const std::vector<int64_t>& offsets) {
    run_copy("unflatten_from", Direction::kUnflatten, tensors, flat, offsets);
}

at::Tensor flatten(const std::vector<at::Tensor>& tensors) {
    TORCH_CHECK_VALUE(!tensors.empty(), "flatten: needs at least one tensor");
    std::vector<at::Tensor> dense;
    dense.reserve(tensors.size());
    int64_t total = 0;
    for (const auto& t : tensors) {
        dense.push_back(t.contiguous());
        total += t.numel();
    }
    at::Tensor out = at::empty({total}, tensors[0].options());
    return flatten_into(dense, out, {});
}

std::vector<at::Tensor> unflatten(const at::Tensor& flat, const std::vector<at::Tensor>& tensors) {
    std::vector<at::Tensor> views;
    views.reserve(tensors.size());
    const at::Tensor flat1d = flat.view(-1);
    int64_t offset = 0;
    for (const auto& t : tensors) {
        TORCH_CHECK_VALUE(offset + t.numel() <= flat.numel(), "unflatten: the flat buffer has ",
                          flat.numel(), " elements, fewer than the tensors need");
        views.push_back(flat1d.narrow(0, offset, t.numel()).view(t.sizes()));
        offset += t.numel();
    }
    return views;
}

bool has_cuda_kernel() {
#ifdef DS_WITH_CUDA
    return true;
#else
    return false;
#endif
}

}  // namespace

PYBIND11_MODULE(TORCH_EXTENSION_NAME, m) {
    m.def("flatten_into", &flatten_into, "Copy tensors into a flat buffer at element offsets",
          py::arg("tensors"), py::arg("out"), py::arg("offsets") = std::vector<int64_t>{});
    m.def("unflatten_from", &unflatten_from, "Copy slices of a flat buffer back into tensors",
          py::arg("flat"), py::arg("tensors"), py::arg("offsets") = std::vector<int64_t>{});
    m.def("flatten", &flatten, "Pack tensors into a new flat buffer", py::arg("tensors"));
    m.def("unflatten", &unflatten, "Views of a packed flat buffer shaped like tensors",
          py::arg("flat"), py::arg("tensors"));
    m.def("has_cuda_kernel", &has_cuda_kernel, "True when built with the CUDA kernel");
}
