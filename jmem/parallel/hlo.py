"""Count collectives in compiled HLO text, in and out of loops.

The compiled (post-SPMD-partitioning) HLO says which collectives a sharded
step really runs: `all-reduce` vs `reduce-scatter` for gradients (TPU's fused
`all-reduce-scatter` computations count as the reduce-scatter they run), the
`all-gather`s of ZeRO-3 parameters, `collective-permute` between pipeline
stages. Collectives inside a `while` body run once per iteration (per layer in
the layer scan, per microbatch in gradient accumulation).

Example:
    >>> text = jax.jit(step).lower(state, batch).compile().as_text()
    >>> collectives(text)  # {'all-gather': ..., 'all-reduce': ...}: the counts depend on the step and backend
    >>> collectives(text, in_loops=True)  # those inside while bodies (run once per iteration)
    >>> collective_shapes(text, "all-gather", in_loops=True)[:1]  # [(1, 64, 32)]: a tiny layer's ZeRO-3 shard

`branch_collectives` finds the collectives inside the run-time branches of a
named `lax.switch` (the 1F1B tick; see `jmem.parallel.check_tick_collectives`).
"""

from __future__ import annotations

import collections
import re

import numpy as np

KINDS = ("all-reduce", "reduce-scatter", "all-gather", "all-to-all", "collective-permute")
_HEADER = re.compile(r"^(?:ENTRY\s+)?%?([\w.\-]+)\s.*\{\s*$")
_OP = re.compile(r"=\s*[^=]*?\b(" + "|".join(KINDS) + r")(?:-start)?\(")
_BODY = re.compile(r"body=%?([\w.\-]+)")
_REF = re.compile(r"%([\w.\-]+)")


def _computations(text: str) -> dict[str, list[str]]:
    if not isinstance(text, str):  # the public functions' one check (a Compiled, not its text, or None)
        shown = f"={text!r}" if text is None else f" is a {type(text).__name__}"
        raise ValueError(f"hlo_text{shown}; accepted: HLO text (a str), e.g. jax.jit(f).lower(x).compile().as_text()")
    comps: dict[str, list[str]] = {}
    current = None
    for line in text.splitlines():
        if current is None:
            m = _HEADER.match(line.strip()) if not line.startswith(" ") else None
            if m:
                current = m.group(1)
                comps[current] = []
        elif line.strip() == "}":
            current = None
        else:
            comps[current].append(line)
    return comps


def _reachable(comps: dict[str, list[str]], roots) -> set[str]:
    """Names of `roots` and every computation they call, transitively."""
    seen: set[str] = set()
    stack = list(roots)
    while stack:
        name = stack.pop()
        if name in seen or name not in comps:
            continue
        seen.add(name)
        stack.extend(r for ln in comps[name] for r in _REF.findall(ln) if r in comps)
    return seen


def _kind(computation: str, op: str) -> str:
    """The collective an `op` line runs: TPU's compiler writes a reduce-scatter as a fusion computation
    `all-reduce-scatter...` whose body all-reduces and slices the result to the shard."""
    return "reduce-scatter" if op == "all-reduce" and computation.startswith("all-reduce-scatter") else op


def collectives(hlo_text: str, *, in_loops: bool | None = None) -> dict[str, int]:
    """Number of collective instructions by kind (`-start` async forms counted as the op).

    Args:
        hlo_text: `compiled.as_text()`.
        in_loops: None: all; True: only those in computations reachable from a while body;
            False: only those outside every loop.
    """
    comps = _computations(hlo_text)
    looped: set[str] = set()
    if in_loops is not None:
        looped = _reachable(comps, [m for lines in comps.values() for ln in lines for m in _BODY.findall(ln)])
    counts: collections.Counter = collections.Counter()
    for name, lines in comps.items():
        if in_loops is True and name not in looped or in_loops is False and name in looped:
            continue
        for ln in lines:
            m = _OP.search(ln)
            if m:
                counts[_kind(name, m.group(1))] += 1
    return dict(counts)


_SHAPE = re.compile(r"=\s*\(?\w+\[([\d,]*)\]")


def collective_shapes(hlo_text: str, kind: str, *, in_loops: bool | None = None) -> list[tuple[int, ...]]:
    """Result shapes of the `kind` collectives (e.g. "all-gather"), chosen as in `collectives`
    (the first result of a tuple-shaped one).

    Example:
        >>> collective_shapes(text, "all-gather", in_loops=True)   # ZeRO-3: one layer's slices
        [(1, 64, 32), (1, 64, 64), ...]
    """
    comps = _computations(hlo_text)
    looped = _reachable(comps, [m for lines in comps.values() for ln in lines for m in _BODY.findall(ln)])
    out = []
    for name, lines in comps.items():
        if in_loops is True and name not in looped or in_loops is False and name in looped:
            continue
        for ln in lines:
            m = _OP.search(ln)
            if m and _kind(name, m.group(1)) == kind:
                if m.group(1) != kind:  # a fused reduce-scatter's result is its computation's (the slice)
                    ln = next(x for x in lines if x.lstrip().startswith("ROOT "))
                shape = _SHAPE.search(ln)
                if shape:
                    out.append(tuple(int(d) for d in shape.group(1).split(",") if d))
    return out


_BRANCHES = re.compile(r"branch_computations=\{([^}]*)\}")
_TRUE_FALSE = re.compile(r"(?:true|false)_computation=%?([\w.\-]+)")
_OP_NAME = re.compile(r'op_name="([^"]*)"')
_GROUP_LIST = re.compile(r"replica_groups=\{((?:\s*\{[\d,\s]*\}\s*,?)*)\}")
_GROUP_IOTA = re.compile(r"replica_groups=\[([\d,]+)\]<=\[([\d,]+)\](?:T\(([\d,]+)\))?")
_PAIRS = re.compile(r"source_target_pairs=\{((?:\s*\{\d+,\d+\}\s*,?)*)\}")


def branch_collectives(hlo_text: str, scope: str) -> list[tuple[str, str]]:
    """`(kind, instruction line)` of every collective inside the branches of the
    `conditional`s whose `op_name` contains `scope` (a `jax.named_scope` around a
    `lax.switch`/`lax.cond`), nested calls included.

    Devices that take different branches of such a conditional at run time never
    meet in a collective that one branch holds, unless every device of its group
    takes the same branch.
    """
    comps = _computations(hlo_text)
    roots = []
    for lines in comps.values():
        for ln in lines:
            if "conditional(" not in ln:
                continue
            op = _OP_NAME.search(ln)
            if op is None or scope not in op.group(1):
                continue
            m = _BRANCHES.search(ln)
            if m:
                roots += [b.strip().lstrip("%") for b in m.group(1).split(",") if b.strip()]
            roots += _TRUE_FALSE.findall(ln)
    out = []
    for name in sorted(_reachable(comps, roots)):
        for ln in comps[name]:
            m = _OP.search(ln)
            if m:
                out.append((m.group(1), ln.strip()))
    return out


def device_groups(line: str, n_devices: int) -> list[list[int]]:
    """The device groups of one collective instruction (logical device ids).

    `replica_groups={{0,1},{2,3}}`, the iota form `replica_groups=[2,4]<=[4,2]T(1,0)`,
    and a collective-permute's `source_target_pairs` (each pair a group); no or empty
    groups: all `n_devices` in one.
    """
    m = _GROUP_IOTA.search(line)
    if m:
        shape = [int(v) for v in m.group(1).split(",")]
        dims = [int(v) for v in m.group(2).split(",")]
        ids = np.arange(int(np.prod(dims))).reshape(dims)
        if m.group(3):
            ids = ids.transpose([int(v) for v in m.group(3).split(",")])
        return ids.reshape(shape[0], -1).tolist()
    for pattern in (_GROUP_LIST, _PAIRS):
        m = pattern.search(line)
        if m:
            groups = [[int(v) for v in g.split(",") if v.strip()] for g in re.findall(r"\{([\d,\s]*)\}", m.group(1))]
            groups = [g for g in groups if g]
            if groups:
                return groups
    return [list(range(n_devices))]
