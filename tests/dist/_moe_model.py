"""The engine-side MoE test model (``deepspeed.moe.layer.MoE``) loaded with the reference's initial values."""

from __future__ import annotations

import torch

from tests.reference import moe_reference as ref


class Expert(torch.nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.fc1 = torch.nn.Linear(ref.HIDDEN, 2 * ref.HIDDEN)
        self.fc2 = torch.nn.Linear(2 * ref.HIDDEN, ref.HIDDEN)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.fc2(torch.tanh(self.fc1(x)))


class MoEModel(torch.nn.Module):
    def __init__(self, ep_size: int, k: int, capacity_factor: float, min_capacity: int, **moe_kwargs: object):
        super().__init__()
        from deepspeed.moe.layer import MoE

        self.inp = torch.nn.Linear(ref.HIDDEN, ref.HIDDEN)
        self.moe = MoE(
            ref.HIDDEN,
            Expert(),
            num_experts=ref.NUM_EXPERTS,
            ep_size=ep_size,
            k=k,
            capacity_factor=capacity_factor,
            eval_capacity_factor=capacity_factor,
            min_capacity=min_capacity,
            use_rts=False,
            top2_2nd_expert_sampling=False,
            **moe_kwargs,
        )
        self.head = torch.nn.Linear(ref.HIDDEN, 1)

    def forward(self, x: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
        h = torch.tanh(self.inp(x))
        m, l_aux, _ = self.moe(h)
        pred = self.head(h + m)
        return torch.mean((pred.float() - y.float()) ** 2) + ref.L_AUX_WEIGHT * l_aux


def local_experts(model: MoEModel) -> torch.nn.ModuleList:
    return model.moe.deepspeed_moe.experts.deepspeed_experts


def build(ep_size: int, ep_rank: int, k: int, capacity_factor: float, min_capacity: int) -> MoEModel:
    """The model with shared values and, for local expert ``i``, the values of global expert ``ep_rank * L + i``."""
    model = MoEModel(ep_size, k, capacity_factor, min_capacity)
    shared = ref.shared_values()
    with torch.no_grad():
        model.inp.weight.copy_(shared["inp.weight"])
        model.inp.bias.copy_(shared["inp.bias"])
        model.moe.deepspeed_moe.gate.wg.weight.copy_(shared["wg"])
        model.head.weight.copy_(shared["head.weight"])
        model.head.bias.copy_(shared["head.bias"])
        n_local = ref.NUM_EXPERTS // ep_size
        for i, expert in enumerate(local_experts(model)):
            for name, value in ref.expert_values(ep_rank * n_local + i).items():
                expert.get_parameter(name).copy_(value)
    return model


def shared_state(model: MoEModel) -> dict[str, torch.Tensor]:
    """Current shared values under the reference's names (fp32 copies)."""
    return {
        "inp.weight": model.inp.weight.detach().float().clone(),
        "inp.bias": model.inp.bias.detach().float().clone(),
        "wg": model.moe.deepspeed_moe.gate.wg.weight.detach().float().clone(),
        "head.weight": model.head.weight.detach().float().clone(),
        "head.bias": model.head.bias.detach().float().clone(),
    }


def expert_states(model: MoEModel, ep_rank: int) -> dict[int, dict[str, torch.Tensor]]:
    """``{global expert id: values}`` of this rank's experts."""
    experts = local_experts(model)
    return {
        ep_rank * len(experts) + i: {n: p.detach().float().clone() for n, p in e.named_parameters()}
        for i, e in enumerate(experts)
    }
