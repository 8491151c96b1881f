"""Single-process mixture-of-experts reference: every expert local, routing written out token by token.

Nothing here uses ``deepspeed``: the gating (softmax, argmax choices, first-come slots, capacity,
renormalised top-2 gates, the load-balancing loss) is a direct loop over tokens, so it checks the
vectorised, expert-parallel implementation rather than repeating it. It also holds the shared test
model's definition and deterministic initial values, used by both sides.
"""

from __future__ import annotations

import math

import torch

HIDDEN = 8
NUM_EXPERTS = 4
TOKENS_SHAPE = (2, 6)  # per rank and micro-step: 12 tokens
L_AUX_WEIGHT = 0.1


def expert_values(expert_id: int) -> dict[str, torch.Tensor]:
    """Initial values of expert ``expert_id``: ``fc1`` (H -> 2H) and ``fc2`` (2H -> H), weights and biases."""
    g = torch.Generator().manual_seed(1000 + expert_id)
    return {
        "fc1.weight": torch.randn(2 * HIDDEN, HIDDEN, generator=g) * 0.4,
        "fc1.bias": torch.randn(2 * HIDDEN, generator=g) * 0.1,
        "fc2.weight": torch.randn(HIDDEN, 2 * HIDDEN, generator=g) * 0.4,
        "fc2.bias": torch.randn(HIDDEN, generator=g) * 0.1,
    }


def shared_values() -> dict[str, torch.Tensor]:
    """Initial values of the shared (non-expert) parameters: input projection, router, output head."""
    g = torch.Generator().manual_seed(7)
    return {
        "inp.weight": torch.randn(HIDDEN, HIDDEN, generator=g) * 0.5,
        "inp.bias": torch.randn(HIDDEN, generator=g) * 0.1,
        "wg": torch.randn(NUM_EXPERTS, HIDDEN, generator=g),
        "head.weight": torch.randn(1, HIDDEN, generator=g) * 0.5,
        "head.bias": torch.zeros(1),
    }


def batch(step: int, rank: int) -> tuple[torch.Tensor, torch.Tensor]:
    """The micro-batch rank ``rank`` trains on at ``step``."""
    g = torch.Generator().manual_seed(10_000 * step + rank)
    x = torch.randn(*TOKENS_SHAPE, HIDDEN, generator=g)
    y = torch.randn(*TOKENS_SHAPE, 1, generator=g)
    return x, y


def expert_forward(p: dict[str, torch.Tensor], x: torch.Tensor) -> torch.Tensor:
    """One expert: ``fc2(tanh(fc1(x)))``."""
    h = torch.tanh(x @ p["fc1.weight"].T + p["fc1.bias"])
    return h @ p["fc2.weight"].T + p["fc2.bias"]


def route(probs: torch.Tensor, k: int, cap: int) -> list[list[tuple[int, float]]]:
    """Per token, the ``(expert, weight)`` pairs it is served by after capacity (detached weights' indices).

    Top-1: the argmax expert, slots handed out in token order. Top-2: first choices take slots in token
    order, then second choices queue behind all first choices; the surviving gates are renormalised.
    """
    num_tokens, num_experts = probs.shape
    first = [int(torch.argmax(probs[s])) for s in range(num_tokens)]
    used = [0] * num_experts
    kept1 = []
    for s in range(num_tokens):
        kept1.append(used[first[s]] < cap)
        used[first[s]] += 1
    if k == 1:
        return [[(first[s], 1.0)] if kept1[s] else [] for s in range(num_tokens)]
    second = []
    for s in range(num_tokens):
        order = sorted(range(num_experts), key=lambda e: (-float(probs[s, e]), e))
        second.append(next(e for e in order if e != first[s]))
    kept2 = []
    for s in range(num_tokens):
        kept2.append(used[second[s]] < cap)
        used[second[s]] += 1
    out = []
    for s in range(num_tokens):
        pairs = []
        if kept1[s]:
            pairs.append((first[s], 0.0))
        if kept2[s]:
            pairs.append((second[s], 0.0))
        out.append(pairs)
    return out


def moe_forward(
    params: dict, experts: list[dict], h: torch.Tensor, k: int, capacity_factor: float, min_capacity: int
) -> tuple[torch.Tensor, torch.Tensor]:
    """MoE output and load-balancing loss for tokens ``h`` of shape ``(S, H)``."""
    num_tokens = h.shape[0]
    probs = torch.softmax(h @ params["wg"].T, dim=1)
    cap = max(math.ceil(num_tokens / NUM_EXPERTS * capacity_factor * k), min_capacity)
    routes = route(probs.detach(), k, cap)
    rows = []
    for s in range(num_tokens):
        pairs = routes[s]
        if not pairs:
            rows.append(torch.zeros(HIDDEN))
            continue
        gates = [probs[s, e] for e, _ in pairs]
        total = sum(gates) if k == 2 else 1.0
        if k == 2:
            total = torch.clamp(total, min=torch.finfo(probs.dtype).eps)
        rows.append(sum(g / total * expert_forward(experts[e], h[s]) for g, (e, _) in zip(gates, pairs, strict=True)))
    chosen = torch.zeros(NUM_EXPERTS)
    for s in range(num_tokens):
        chosen[int(torch.argmax(probs[s].detach()))] += 1.0
    l_aux = NUM_EXPERTS * sum(probs[:, e].mean() * chosen[e] / num_tokens for e in range(NUM_EXPERTS))
    return torch.stack(rows), l_aux


def model_loss(
    params: dict,
    experts: list[dict],
    x: torch.Tensor,
    y: torch.Tensor,
    k: int,
    capacity_factor: float,
    min_capacity: int,
) -> torch.Tensor:
    """The test model's loss: ``mse(head(h + moe(h)), y) + L_AUX_WEIGHT * l_aux`` with ``h = tanh(inp(x))``."""
    h = torch.tanh(x.reshape(-1, HIDDEN) @ params["inp.weight"].T + params["inp.bias"])
    moe, l_aux = moe_forward(params, experts, h, k, capacity_factor, min_capacity)
    pred = (h + moe) @ params["head.weight"].T + params["head.bias"]
    return torch.mean((pred - y.reshape(-1, 1)) ** 2) + L_AUX_WEIGHT * l_aux


def reference_train(
    world: int, steps: int, k: int, capacity_factor: float, min_capacity: int, lr: float, clip: float
) -> dict:
    """Train the reference on every rank's batches (mean of the ranks' losses) with AdamW and global clipping.

    Returns the per-step mean losses, the per-step pre-clip global gradient norms and the final values
    (``shared``: name -> tensor, ``experts``: list of name -> tensor).
    """
    shared = {n: v.clone().requires_grad_(True) for n, v in shared_values().items()}
    experts = [{n: v.clone().requires_grad_(True) for n, v in expert_values(e).items()} for e in range(NUM_EXPERTS)]
    leaves = list(shared.values()) + [v for ex in experts for v in ex.values()]
    opt = torch.optim.AdamW(leaves, lr=lr, weight_decay=0.01)
    losses, norms = [], []
    for step in range(steps):
        opt.zero_grad()
        per_rank = [
            model_loss(shared, experts, *batch(step, r), k, capacity_factor, min_capacity) for r in range(world)
        ]
        loss = sum(per_rank) / world
        loss.backward()
        for p in leaves:  # an expert no token reached still ran on its empty slots: a zero gradient, not none
            if p.grad is None:
                p.grad = torch.zeros_like(p)
        norm = math.sqrt(sum(float((p.grad.double() ** 2).sum()) for p in leaves if p.grad is not None))
        if clip > 0 and norm > clip:
            for p in leaves:
                if p.grad is not None:
                    p.grad.mul_(clip / (norm + 1e-6))
        opt.step()
        losses.append(float(loss.detach()))
        norms.append(norm)
    return {
        "losses": losses,
        "norms": norms,
        "shared": {n: v.detach().clone() for n, v in shared.items()},
        "experts": [{n: v.detach().clone() for n, v in ex.items()} for ex in experts],
    }
