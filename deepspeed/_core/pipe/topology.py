"""Process topologies (a rank <-> coordinate bijection over named axes) and the pipeline grid of process groups.

A topology is pure data: ``ProcessTopology(axes=['pipe', 'data'], dims=[2, 3])`` numbers the six ranks so that the
*last* axis varies fastest (rank = row-major index of the coordinate), which puts the data-parallel replicas of
one stage on neighbouring ranks. :class:`PipelineParallelGrid` turns a topology into process groups through
``deepspeed.comm`` and answers the Megatron-style ``get_*_parallel_{rank,world_size,group}`` queries.

[Note: pipeline groups] Every rank creates every group, in one fixed order (data groups, pipe groups, model
groups, slice groups), because ``new_group`` is collective over the world: a rank that skipped a group it is not a
member of would leave the others waiting.
"""

from __future__ import annotations

import itertools
from collections import namedtuple
from typing import Any

from deepspeed._core.comm import dist


def _coord_type(axes: list[str]) -> Any:
    # The fields are the axis names, known only at run time (so the type checker sees Any).
    return namedtuple("ProcessCoord", axes)


class ProcessTopology:
    """A Cartesian arrangement of ranks over named axes; the last axis varies fastest."""

    def __init__(self, axes: list[str], dims: list[int]) -> None:
        if len(axes) != len(dims):
            raise ValueError(f"ProcessTopology: {len(axes)} axes {axes} but {len(dims)} dims {dims}")
        if len(set(axes)) != len(axes):
            raise ValueError(f"ProcessTopology: axis names must be distinct, got {axes}")
        bad = [d for d in dims if not isinstance(d, int) or d < 1]
        if bad:
            raise ValueError(f"ProcessTopology: every dim must be a positive int, got {dims}")
        self.axes = list(axes)
        self.dims = list(dims)
        # Named tuple type so coordinates read as coord.pipe, coord.data.
        self.ProcessCoord = _coord_type(self.axes)
        self.mapping: dict[Any, int] = {}
        for rank, values in enumerate(itertools.product(*[range(d) for d in self.dims])):
            self.mapping[self.ProcessCoord(*values)] = rank
        self._coords = {rank: coord for coord, rank in self.mapping.items()}

    def get_rank(self, **coord_kwargs: int) -> int:
        """The rank at the coordinate given for every axis, e.g. ``get_rank(pipe=1, data=0)``."""
        if set(coord_kwargs) != set(self.axes):
            raise ValueError(f"get_rank needs exactly the axes {self.axes}, got {sorted(coord_kwargs)}")
        key = self.ProcessCoord(**coord_kwargs)
        if key not in self.mapping:
            raise ValueError(
                f"coordinate {coord_kwargs} is outside the topology {dict(zip(self.axes, self.dims, strict=True))}"
            )
        return self.mapping[key]

    def get_axis_names(self) -> list[str]:
        """The axis names, outermost first."""
        return list(self.axes)

    def get_rank_repr(
        self,
        rank: int,
        omit_axes: list[str] | tuple[str, ...] = ("data", "pipe"),
        inner_sep: str = "_",
        outer_sep: str = "-",
    ) -> str:
        """A file-name fragment for ``rank`` over the axes not omitted, e.g. ``'model_01'`` ('' when none are left)."""
        coord = self.get_coord(rank)
        parts = [f"{axis}{inner_sep}{getattr(coord, axis):02d}" for axis in self.axes if axis not in omit_axes]
        return outer_sep.join(parts)

    def get_dim(self, axis: str) -> int:
        """The size of ``axis`` (0 when the topology has no such axis)."""
        return self.dims[self.axes.index(axis)] if axis in self.axes else 0

    def get_coord(self, rank: int) -> Any:
        """The coordinate (a ``ProcessCoord`` named tuple) of ``rank``."""
        if rank not in self._coords:
            raise ValueError(f"rank {rank} is outside the topology of {self.world_size()} ranks")
        return self._coords[rank]

    def get_axis_comm_lists(self, axis: str) -> list[list[int]]:
        """The rank lists along ``axis``: one list per combination of the other axes, each ordered along ``axis``.

        These are the members of the groups that communicate over ``axis`` (an empty list when the axis is absent).
        """
        if axis not in self.axes:
            return []
        others = [a for a in self.axes if a != axis]
        lists = []
        for values in itertools.product(*[range(self.get_dim(a)) for a in others]):
            fixed = dict(zip(others, values, strict=True))
            lists.append([self.get_rank(**fixed, **{axis: i}) for i in range(self.get_dim(axis))])
        return lists

    def filter_match(self, **filter_kwargs: int) -> list[int]:
        """Ranks (ascending) whose coordinate matches every given ``axis=value``."""
        unknown = set(filter_kwargs) - set(self.axes)
        if unknown:
            raise ValueError(f"filter_match: unknown axes {sorted(unknown)}; the topology has {self.axes}")
        return sorted(
            rank
            for coord, rank in self.mapping.items()
            if all(getattr(coord, k) == v for k, v in filter_kwargs.items())
        )

    def get_axis_list(self, axis: str, idx: int) -> list[int]:
        """Ranks whose coordinate along ``axis`` is ``idx``."""
        return self.filter_match(**{axis: idx}) if axis in self.axes else []

    def world_size(self) -> int:
        """The number of ranks the topology describes."""
        return len(self.mapping)

    def __str__(self) -> str:
        return str(self.mapping)


class PipeDataParallelTopology(ProcessTopology):
    """Pipeline stages x data-parallel replicas (axes ``['pipe', 'data']``)."""

    def __init__(self, num_pp: int, num_dp: int) -> None:
        super().__init__(axes=["pipe", "data"], dims=[num_pp, num_dp])


class PipeModelDataParallelTopology(ProcessTopology):
    """Pipeline x data x tensor(model)-parallel (axes ``['pipe', 'data', 'model']``), the 3D layout."""

    def __init__(self, num_pp: int, num_mp: int, num_dp: int) -> None:
        super().__init__(axes=["pipe", "data", "model"], dims=[num_pp, num_dp, num_mp])


def _groups_along(lists: list[list[int]], rank: int) -> tuple[list[int], Any]:
    """Create one group per rank list (every rank creates all of them); return this rank's list and group."""
    mine: tuple[list[int], Any] = ([], None)
    for ranks in lists:
        group = dist.new_group(ranks=ranks)
        if rank in ranks:
            mine = (list(ranks), group)
    return mine


class PipelineParallelGrid:
    """Process groups of a pipeline topology and the ``mpu`` queries Megatron-style code makes.

    Vocabulary (upstream's): the *model-parallel* group is everything one model replica spans (all stages and
    tensor slices that share a data-parallel index); the *slice* group is the tensor-parallel ``model`` axis alone.
    ``get_tensor_model_parallel_*`` answer for the slice group, so activation partitioning given this grid as its
    ``mpu`` splits across tensor slices only, never across stages (which hold different activations).
    """

    def __init__(self, topology: ProcessTopology | None = None, process_group: Any = None) -> None:
        if process_group is not None:
            raise ValueError("PipelineParallelGrid: process_group is not supported; groups are built over the world")
        self.global_rank = dist.get_rank()
        self.world_size = dist.get_world_size()
        self._topo = topology if topology is not None else PipeDataParallelTopology(self.world_size, 1)
        if self._topo.world_size() != self.world_size:
            raise ValueError(
                f"PipelineParallelGrid: the topology has {self._topo.world_size()} ranks "
                f"({dict(zip(self._topo.axes, self._topo.dims, strict=True))}) but the world has {self.world_size}"
            )
        self.data_parallel_size = max(self._topo.get_dim("data"), 1)
        self.pipe_parallel_size = max(self._topo.get_dim("pipe"), 1)
        self.model_parallel_size = max(self._topo.get_dim("model"), 1)
        self.slice_parallel_size = self.model_parallel_size
        coord = self._topo.get_coord(self.global_rank)
        self.stage_id = getattr(coord, "pipe", 0)
        self.data_parallel_id = getattr(coord, "data", 0)
        self.is_first_stage = self.stage_id == 0
        self.is_last_stage = self.stage_id == self.pipe_parallel_size - 1
        self._build_groups()

    def _build_groups(self) -> None:
        # [Note: pipeline groups] the order below is the same on every rank.
        rank = self.global_rank
        self.dp_group, self.dp_proc_group = self._axis_groups("data")
        self.pp_group, self.pp_proc_group = self._axis_groups("pipe")
        replicas = [
            self._topo.filter_match(data=d) if "data" in self._topo.axes else list(range(self.world_size))
            for d in range(self.data_parallel_size)
        ]
        self.ds_model_group, self.ds_model_proc_group = _groups_along(replicas, rank)
        self.ds_model_rank = self.ds_model_group.index(rank)
        self.ds_model_world_size = len(self.ds_model_group)
        self.slice_group, self.slice_proc_group = self._axis_groups("model")

    def _axis_groups(self, axis: str) -> tuple[list[int], Any]:
        lists = self._topo.get_axis_comm_lists(axis)
        if not lists:  # axis absent: each rank is alone along it
            lists = [[r] for r in range(self.world_size)]
        return _groups_along(lists, self.global_rank)

    # ------------------------------------------------------------------ stages
    def get_stage_id(self) -> int:
        """This rank's pipeline stage."""
        return self.stage_id

    def get_data_parallel_id(self) -> int:
        """This rank's index along the data axis."""
        return self.data_parallel_id

    @property
    def prev_stage(self) -> int:
        """The stage before this one (``-1`` at the first stage)."""
        return self.stage_id - 1

    @property
    def next_stage(self) -> int:
        """The stage after this one (``pipe_parallel_size`` at the last stage)."""
        return self.stage_id + 1

    def stage_to_global(self, stage_id: int, **kwargs: int) -> int:
        """Global rank of ``stage_id`` at this rank's other coordinates (overridable by keyword, e.g. ``data=0``)."""
        coord = self._topo.get_coord(self.global_rank)._replace(pipe=stage_id, **kwargs)
        return self._topo.get_rank(**coord._asdict())

    def topology(self) -> ProcessTopology:
        """The topology the grid was built from."""
        return self._topo

    def get_global_rank(self) -> int:
        """This process's world rank."""
        return self.global_rank

    # ------------------------------------------------------------------ mpu queries
    def get_pipe_parallel_rank(self) -> int:
        """Rank within the pipeline group (the stage id)."""
        return self.stage_id

    def get_pipe_parallel_world_size(self) -> int:
        """Number of pipeline stages."""
        return self.pipe_parallel_size

    def get_pipe_parallel_group(self) -> Any:
        """Group of the stages of this rank's pipeline."""
        return self.pp_proc_group

    def get_data_parallel_rank(self) -> int:
        """Rank within the data-parallel group."""
        return self.data_parallel_id

    def get_data_parallel_world_size(self) -> int:
        """Number of data-parallel replicas."""
        return self.data_parallel_size

    def get_data_parallel_group(self) -> Any:
        """Group of the ranks holding the same stage and slice in every replica."""
        return self.dp_proc_group

    def get_data_parallel_group_ranks(self) -> list[int]:
        """Global ranks of this rank's data-parallel group."""
        return list(self.dp_group)

    def get_model_parallel_rank(self) -> int:
        """Rank within the model replica (stages x slices); ``mp_rank_XX`` checkpoint files use it."""
        return self.ds_model_rank

    def get_model_parallel_world_size(self) -> int:
        """Number of ranks one model replica spans."""
        return self.ds_model_world_size

    def get_model_parallel_group(self) -> Any:
        """Group of the ranks of this rank's model replica."""
        return self.ds_model_proc_group

    def get_slice_parallel_rank(self) -> int:
        """Rank along the tensor-parallel ``model`` axis (0 without one)."""
        coord = self._topo.get_coord(self.global_rank)
        return getattr(coord, "model", 0)

    def get_slice_parallel_world_size(self) -> int:
        """Size of the tensor-parallel ``model`` axis."""
        return self.slice_parallel_size

    def get_slice_parallel_group(self) -> Any:
        """Group along the tensor-parallel ``model`` axis."""
        return self.slice_proc_group

    def get_tensor_model_parallel_rank(self) -> int:
        """Same as :meth:`get_slice_parallel_rank` (Megatron's newer spelling)."""
        return self.get_slice_parallel_rank()

    def get_tensor_model_parallel_world_size(self) -> int:
        """Same as :meth:`get_slice_parallel_world_size`."""
        return self.slice_parallel_size

    def get_tensor_model_parallel_group(self) -> Any:
        """Same as :meth:`get_slice_parallel_group`."""
        return self.slice_proc_group
