"""Data loading helpers with upstream names: ``DeepSpeedDataLoader`` and ``RepeatingLoader``."""

from __future__ import annotations

from collections.abc import Iterator
from typing import Any

from torch.utils.data import DataLoader
from torch.utils.data.distributed import DistributedSampler


class RepeatingLoader:
    """Wraps an iterable so that iteration restarts from the beginning instead of stopping."""

    def __init__(self, loader: Any) -> None:
        self.loader = loader
        self.data_iter = iter(self.loader)

    def __iter__(self) -> RepeatingLoader:
        return self

    def __next__(self) -> Any:
        try:
            return next(self.data_iter)
        except StopIteration:
            self.data_iter = iter(self.loader)
            return next(self.data_iter)


class DeepSpeedDataLoader:
    """A loader of micro-batches that gives each data-parallel rank its own shard of ``dataset``.

    The sampler gets the rank and world size explicitly, so it never queries a process group.
    """

    def __init__(
        self,
        dataset: Any,
        batch_size: int,
        pin_memory: bool,
        local_rank: int,
        tput_timer: Any,
        collate_fn: Any = None,
        num_local_io_workers: int | None = None,
        data_sampler: Any = None,
        data_parallel_world_size: int | None = None,
        data_parallel_rank: int | None = None,
        dataloader_drop_last: bool = False,
        deepspeed_dataloader_config: dict | None = None,
    ) -> None:
        world = data_parallel_world_size or 1
        rank = data_parallel_rank or 0
        if data_sampler is None:
            data_sampler = DistributedSampler(dataset, num_replicas=world, rank=rank, shuffle=True)
        self.data_sampler = data_sampler
        self.batch_size = batch_size
        self.dataloader = DataLoader(
            dataset,
            batch_size=batch_size,
            sampler=data_sampler,
            collate_fn=collate_fn,
            num_workers=num_local_io_workers or 0,
            pin_memory=pin_memory,
            drop_last=dataloader_drop_last,
        )
        self.len = len(self.dataloader)
        self.epoch = 0
        self.post_process_func: Any = None  # set by engine.set_data_post_process_func

    def __len__(self) -> int:
        return self.len

    def __iter__(self) -> Iterator[Any]:
        if hasattr(self.data_sampler, "set_epoch"):
            self.data_sampler.set_epoch(self.epoch)
        self.epoch += 1
        if self.post_process_func is None:
            return iter(self.dataloader)
        return (self.post_process_func(batch) for batch in self.dataloader)


__all__ = ["DeepSpeedDataLoader", "RepeatingLoader"]
