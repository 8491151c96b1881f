"""Feed sequence-parallel ranks: each batch of an SP group's ranks becomes that many batches of sequence shards.

Every rank of a sequence-parallel group draws its own batch from its own loader. The adapter gathers the group's
batches and serves them one after the other, each cut into ``sp_world_size`` consecutive chunks of the sequence of
which this rank keeps chunk ``sp_rank``: the ranks together train on rank ``j``'s batch in turn, and no rank's data is
dropped. Labels become ``shift_labels`` (labels shifted one token left, ``-100`` after the last token) before they are
cut, so the token predicted from a shard's last position is the next shard's first, as on the whole sequence.
"""

from __future__ import annotations

from collections import deque
from collections.abc import Iterable, Iterator
from typing import Any

import torch
import torch.nn.functional as F

from deepspeed._core.comm import dist
from deepspeed._core.comm.collectives import gather_list

IGNORE_INDEX = -100


class UlyssesSPDataLoaderAdapter:
    """Wrap ``dl`` (batches of ``input_ids``, ``position_ids``, ``labels``, ``[bs, seq]``) for sequence parallelism.

    ``len()`` is ``len(dl) * sp_world_size``; iteration ends with the inner loader's epoch and starts a new one on
    the next ``iter()``.
    """

    def __init__(self, dl: Iterable, sp_rank: int, sp_group: Any, sp_world_size: int, device: Any) -> None:
        self.dl = dl
        self.sp_rank = sp_rank
        self.sp_group = sp_group
        self.sp_world_size = sp_world_size
        self.device = device
        self.micro_batches: deque[dict] = deque()
        self.iter: Iterator = iter(dl)

    def __len__(self) -> int:
        return len(self.dl) * self.sp_world_size  # type: ignore[arg-type]

    def __iter__(self) -> UlyssesSPDataLoaderAdapter:
        return self

    def __next__(self) -> dict:
        if not self.micro_batches:
            try:
                batch = next(self.iter)
            except StopIteration:
                self.iter = iter(self.dl)  # the next epoch starts from a fresh inner iterator
                raise
            self.refill(batch)
        return self.micro_batches.popleft()

    def refill(self, batch: dict) -> None:
        """Gather the SP group's batches and queue this rank's shard of each."""
        if "input_ids" not in batch or "position_ids" not in batch:
            missing = [k for k in ("input_ids", "position_ids") if k not in batch]
            raise ValueError(
                f"UlyssesSPDataLoaderAdapter: the batch has no {missing}; batches need input_ids, position_ids and "
                "labels of shape [batch, seq]"
            )
        seqlen = batch["input_ids"].shape[1]
        for key, value in batch.items():
            if torch.is_tensor(value) and value.dim() >= 2 and value.shape[1] != seqlen:
                raise ValueError(
                    f"UlyssesSPDataLoaderAdapter: {key} has sequence length {value.shape[1]} but input_ids has {seqlen}"
                )
        lengths = self._gather_lengths(seqlen)
        bad = [(rank, n) for rank, n in enumerate(lengths) if n % self.sp_world_size]
        if bad:
            # Every rank sees the same gathered lengths, so every rank raises here together.
            raise ValueError(
                f"sequence lengths {[n for _, n in bad]} (from SP ranks {[r for r, _ in bad]}) are not divisible by "
                f"the sequence parallel size {self.sp_world_size}; pad each batch to a multiple of it"
            )
        gathered = self._gather_batches(batch, lengths)
        for sample in gathered:
            self.micro_batches.append(self._shard(sample))

    def _gather_lengths(self, seqlen: int) -> list[int]:
        mine = torch.tensor([seqlen], dtype=torch.int64, device=self.device)
        parts = [torch.empty_like(mine) for _ in range(self.sp_world_size)]
        gather_list(parts, mine, self.sp_group)
        return [int(p.item()) for p in parts]

    def _gather_batches(self, batch: dict, lengths: list[int]) -> list[dict]:
        gathered: list[dict] = [{} for _ in lengths]
        for key in sorted(batch):  # the same order on every rank: the gathers pair up
            value = batch[key]
            if torch.is_tensor(value):
                value = value.to(self.device)
                parts = [value.new_empty((value.shape[0], n, *value.shape[2:])) for n in lengths]
                gather_list(parts, value.contiguous(), self.sp_group)
            else:
                parts = [None] * self.sp_world_size  # type: ignore[list-item]  # filled by all_gather_object
                dist.all_gather_object(parts, value, group=self.sp_group)
            for sample, part in zip(gathered, parts, strict=True):
                sample[key] = part
        return gathered

    def _shard(self, sample: dict) -> dict:
        if "labels" in sample:
            labels = sample.pop("labels")
            sample["shift_labels"] = F.pad(labels, (0, 1), value=IGNORE_INDEX)[:, 1:].contiguous()
        chunk = sample["input_ids"].shape[1] // self.sp_world_size
        lo, hi = chunk * self.sp_rank, chunk * (self.sp_rank + 1)
        return {
            key: value[:, lo:hi].contiguous().cpu() if torch.is_tensor(value) and value.dim() >= 2 else value
            for key, value in sample.items()
        }
