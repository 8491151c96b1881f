"""Gathering driven by user code rather than by module hooks: ``GatheredParameters`` and external parameters.

:class:`GatheredContext` holds a set of parameters gathered for the duration of a ``with`` block and, when a
modifier rank is given, makes that rank's values every rank's shards on exit ([Note: zero3-gathered] in
``docs/design/zero3.md``). :func:`register_external` / :func:`unregister_external` (defined with the fetch units in
:mod:`deepspeed._core.params.manager`) are re-exported here.
"""

from __future__ import annotations

from dataclasses import dataclass
from types import TracebackType
from typing import TYPE_CHECKING, Any

from torch import nn

from deepspeed._core.comm.collectives import broadcast_from
from deepspeed._core.params.manager import register_external, unregister_external
from deepspeed._core.params.param import ZeroParam, zero_state

if TYPE_CHECKING:
    from typing_extensions import Self  # typing.Self needs Python 3.11


@dataclass(frozen=True)
class ModifierRank:
    """The group rank whose values win on exit; ``rank=None`` means read-only (changes are discarded)."""

    rank: int | None = None


def collect_states(params: Any) -> list[ZeroParam]:
    """The ZeRO states of ``params`` (one parameter or an iterable), de-duplicated and sorted by ``ds_id``.

    Parameters that are not partitioned are skipped.
    """
    items = [params] if isinstance(params, nn.Parameter) else list(params)
    states = {}
    for item in items:
        state = zero_state(item)
        if state is not None:
            states[state.ds_id] = state
    return [states[key] for key in sorted(states)]


def _by_gatherer(states: list[ZeroParam]) -> list[list[ZeroParam]]:
    groups: dict[int, list[ZeroParam]] = {}
    for state in states:
        groups.setdefault(id(state.gatherer), []).append(state)
    return list(groups.values())


class GatheredContext:
    """Keep ``states`` gathered inside a ``with`` block; publish the modifier rank's values on exit."""

    def __init__(self, states: list[ZeroParam], modifier: ModifierRank) -> None:
        """``states`` as returned by :func:`collect_states`."""
        self.states = states
        self.modifier = modifier
        self._saved: list[tuple[ZeroParam, Any]] = []

    def __enter__(self) -> Self:
        overlapping = [s.ds_id for s in self.states if s.context_holds]
        if overlapping:
            raise RuntimeError(
                f"GatheredParameters: parameters {overlapping} are already gathered by an enclosing "
                "GatheredParameters context; overlapping nested contexts are not supported"
            )
        for state in self.states:
            state.context_holds += 1
        if self.modifier.rank is None:
            # Read-only: changes must be discarded. A gathered tensor that is its own shard (one rank) would keep
            # them, so its values are saved and put back on exit: the copy a separate gather would have cost.
            self._saved = [(s, s.shard.detach().clone()) for s in self.states if s.aliases_shard]
        for batch in _by_gatherer(self.states):
            batch[0].gatherer.gather(batch)
        return self

    def __exit__(
        self, exc_type: type[BaseException] | None, exc: BaseException | None, tb: TracebackType | None
    ) -> None:
        # With an exception in flight other ranks may not reach this point: skip the broadcast, only release.
        if self.modifier.rank is not None and exc_type is None:
            for state in self.states:
                full = state.full_view()
                broadcast_from(full, state.group, self.modifier.rank)
                # A master-view shard keeps its fp32 precision where the modifier left a value unchanged.
                state.write_shard_from(full, keep_unchanged=True)
        for state, values in self._saved:
            state.shard.copy_(values)
        self._saved = []
        for state in self.states:
            state.context_holds -= 1
        for batch in _by_gatherer(self.states):
            batch[0].gatherer.release(batch)


__all__ = ["GatheredContext", "ModifierRank", "collect_states", "register_external", "unregister_external"]
