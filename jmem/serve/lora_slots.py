"""More LoRA adapters than device slots: every adapter waits in host memory, the ones a step uses sit on the device.

The stacked `MultiLoRA` leaves hold `max_loras` slots. `AdapterSlots` (plain
Python) keeps which adapter sits in which slot: the adapters a step needs are
made resident before it runs, each new one into a free slot or into the least
recently used slot whose adapter no request of this step uses. The scheduler
never runs more distinct adapters in one step than there are slots
(`Scheduler`'s `max_loras`), so a slot is always found.

`state_with_adapters` writes adapters' host arrays into slots and returns a
new state; the old one stays valid (nothing is donated), so a reader holding
it (an echo-scoring pass on another thread) never sees a slot change under it.
"""

from __future__ import annotations

import collections
from typing import Iterable

import jax

from jmem.serve.lora import MultiLoRA, target_of


class AdapterSlots:
    """Adapter name -> device slot, for `num_slots` slots; the first adapters start resident.

    Example:
        >>> slots = AdapterSlots(["sql", "chat", "code"], num_slots=2)
        >>> slots.assign({"code"})          # [('code', 0)]: evicts sql, the least recently used
    """

    def __init__(self, names: Iterable[str], num_slots: int, resident: dict[str, int] | None = None):
        """`resident`: name -> slot of the adapters already in slots (None: the first names, in order)."""
        self.names = list(names)
        self.num_slots = num_slots
        if resident is None:
            resident = {name: slot for slot, name in enumerate(self.names[:num_slots])}
        self._resident: collections.OrderedDict[str, int] = collections.OrderedDict(
            sorted(resident.items(), key=lambda kv: kv[1]))  # least recently used first
        self._free = sorted(set(range(num_slots)) - set(resident.values()))
        self.num_loads = 0  # adapters written into a slot after startup

    def slot_of(self, name: str) -> int | None:
        """The slot holding `name` now, None if it waits in host memory."""
        return self._resident.get(name)

    @property
    def resident(self) -> dict[str, int]:
        return dict(self._resident)

    def add(self, name: str) -> None:
        """A new adapter, waiting in host memory until a step needs it."""
        if name in self.names:
            raise ValueError(f"LoRA adapter {name!r} is already loaded; accepted: a new name")
        self.names.append(name)

    def remove(self, name: str) -> None:
        """Forget `name`; its slot, if it had one, is free again."""
        self.names.remove(name)
        slot = self._resident.pop(name, None)
        if slot is not None:
            self._free = sorted([*self._free, slot])

    def assign(self, names: Iterable[str]) -> list[tuple[str, int]]:
        """Make every adapter in `names` resident; returns the (name, slot) pairs that must be written.

        Raises:
            ValueError: more distinct names than slots, or a name that is not an adapter.
        """
        need = list(dict.fromkeys(names))
        unknown = [n for n in need if n not in self.names]
        if unknown:
            raise ValueError(f"unknown LoRA adapter {unknown[0]!r}; accepted: {', '.join(self.names)}")
        if len(need) > self.num_slots:
            raise ValueError(f"{len(need)} LoRA adapters in one step; accepted: at most --max-loras={self.num_slots}")
        for name in need:
            if name in self._resident:
                self._resident.move_to_end(name)
        loads = []
        for name in need:
            if name in self._resident:
                continue
            if self._free:
                slot = self._free.pop(0)
            else:
                victim = next(n for n in self._resident if n not in need)
                slot = self._resident.pop(victim)
            self._resident[name] = slot
            loads.append((name, slot))
        self.num_loads += len(loads)
        return loads


def state_with_adapters(state, loads: list[tuple[int, dict]]):
    """`state` with adapters written into slots: `loads` holds (slot, {target: (a, b)}) pairs, the host
    arrays of `AdapterInfo.arrays`. A new state; `state` itself and its variables are unchanged."""
    def write(path, leaf):
        if not isinstance(leaf, MultiLoRA):
            return leaf
        target = target_of(path)
        a_all, b_all = leaf.lora_a, leaf.lora_b
        for slot, arrays in loads:
            a, b = arrays[target]
            a_all, b_all = _write_slot(a_all, b_all, slot, a, b)
        return MultiLoRA(leaf.base, jax.device_put(a_all, leaf.lora_a.sharding),
                         jax.device_put(b_all, leaf.lora_b.sharding), leaf.slots, leaf.impl)

    return jax.tree_util.tree_map_with_path(write, state, is_leaf=lambda x: isinstance(x, MultiLoRA))


@jax.jit
def _write_slot(a_all, b_all, slot, a, b):
    """Slot `slot` of stacked A [..., S, in, R] and B [..., S, R, out] replaced by a [..., in, R], b [..., R, out]."""
    axis = a_all.ndim - 3
    return (jax.lax.dynamic_update_index_in_dim(a_all, a.astype(a_all.dtype), slot, axis),
            jax.lax.dynamic_update_index_in_dim(b_all, b.astype(b_all.dtype), slot, axis))


__all__ = ["AdapterSlots", "state_with_adapters"]
