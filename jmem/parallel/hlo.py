"""Count collectives in compiled HLO text, in and out of loops.

The compiled (post-SPMD-partitioning) HLO says which collectives a sharded
step really runs: `all-reduce` vs `reduce-scatter` for gradients, the
`all-gather`s of ZeRO-3 parameters, `collective-permute` between pipeline
stages. Collectives inside a `while` body run once per iteration (per layer in
the layer scan, per microbatch in gradient accumulation).

Example:
    >>> text = jax.jit(step).lower(state, batch).compile().as_text()
    >>> collectives(text)
    {'all-gather': 12, 'reduce-scatter': 9}
    >>> collectives(text, in_loops=True)
    {'all-gather': 12}
"""

from __future__ import annotations

import collections
import re

KINDS = ("all-reduce", "reduce-scatter", "all-gather", "all-to-all", "collective-permute")
_HEADER = re.compile(r"^(?:ENTRY\s+)?%?([\w.\-]+)\s.*\{\s*$")
_OP = re.compile(r"=\s*[^=]*?\b(" + "|".join(KINDS) + r")(?:-start)?\(")
_BODY = re.compile(r"body=%?([\w.\-]+)")
_REF = re.compile(r"%([\w.\-]+)")


def _computations(text: str) -> dict[str, list[str]]:
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
        stack = [m for lines in comps.values() for ln in lines for m in _BODY.findall(ln)]
        while stack:
            name = stack.pop()
            if name in looped or name not in comps:
                continue
            looped.add(name)
            stack.extend(r for ln in comps[name] for r in _REF.findall(ln) if r in comps)
    counts: collections.Counter = collections.Counter()
    for name, lines in comps.items():
        if in_loops is True and name not in looped or in_loops is False and name in looped:
            continue
        for ln in lines:
            m = _OP.search(ln)
            if m:
                counts[m.group(1)] += 1
    return dict(counts)
