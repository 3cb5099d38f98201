"""Matmul FLOPs of a compiled program, every loop iteration counted.

XLA's cost model (`Compiled.cost_analysis()`) counts the body of a `while`
loop once, so for a model whose layers run under `lax.scan` it reports about
one layer's work, and FLOP ratios between programs are ratios of loop bodies.
`matmul_flops` reads the optimized HLO text instead: it sums the FLOPs of every
`dot` and `convolution` (and of GPU GEMM custom calls, which carry their dot
dimensions in their backend config), inside fusions and called computations,
multiplying the body of each `while` loop by the trip count XLA proved for it
(`known_trip_count`, which the CPU and GPU compilers record). The count is nan
when a loop's trip count is not recorded (as in TPU executables, whose loops
and batched matmuls, rewritten as windowed convolutions, this reader does not
follow) rather than an undercount, and also when the branches of a
conditional differ in matmul FLOPs (which branch runs, and how often, is
decided at run time: a pipeline tick that runs a forward, a backward or
nothing). For those, `branch_flops` gives each branch's FLOPs, for a caller
who knows how often each runs. Elementwise work and custom kernels
(Pallas/Mosaic calls) are not counted.
"""

from __future__ import annotations

import functools
import math
import re

_HEADER = re.compile(r"^(?:ENTRY\s+)?%?([\w.\-]+)\s*\((.*)\)\s*->\s*.*\{\s*$")
_INSTR = re.compile(r"^\s*(?:ROOT\s+)?%?([\w.\-]+)\s*=\s*(.+?)\s+([\w\-]+)\((.*)$")
_SHAPE = re.compile(r"\b([a-z][a-z0-9]*)\[([\d,]*)\]")
_PARAM = re.compile(r"([\w.\-]+):\s*([a-z][a-z0-9]*\[[\d,]*\])")
_CALLEE = re.compile(r"\b(?:calls|to_apply)=%?([\w.\-]+)")
_BRANCHES = re.compile(r"\b(?:branch_computations=\{([^}]*)\}|true_computation=%?([\w.\-]+)|"
                       r"false_computation=%?([\w.\-]+))")
_TRIP = re.compile(r'"known_trip_count"\s*:\s*\{\s*"n"\s*:\s*"(\d+)"')


def _dims(shape_text: str) -> list[int] | None:
    m = _SHAPE.search(shape_text)
    if m is None:
        return None
    return [int(d) for d in m.group(2).split(",") if d]


def _int_list(attrs: str, key: str) -> list[int]:
    m = re.search(key + r"=\{([\d,]*)\}", attrs)
    return [int(d) for d in m.group(1).split(",") if d] if m else []


def _operands(args: str) -> list[str]:
    """The operand list before the closing parenthesis: `%a, f32[2]{0} %b` -> ['%a', 'f32[2]{0} %b']."""
    depth, out, cur = 0, [], ""
    for ch in args:
        if ch in "([{":
            depth += 1
        elif ch in ")]}":
            if depth == 0:
                break
            depth -= 1
        if ch == "," and depth == 0:
            out.append(cur.strip())
            cur = ""
        else:
            cur += ch
    if cur.strip():
        out.append(cur.strip())
    return out


class _Computation:
    def __init__(self, name: str):
        self.name = name
        self.shapes: dict[str, list[int] | None] = {}
        self.flops = 0.0
        self.calls: list[tuple[float, list[str]]] = []  # (multiplier, callees: several for a conditional)


def _operand_dims(comp: _Computation, operand: str) -> list[int] | None:
    if "[" in operand:  # printed with its type
        return _dims(operand)
    return comp.shapes.get(operand.lstrip("%").split()[-1].lstrip("%"))


def _dot_flops(out: list[int], lhs: list[int] | None, contracting: list[int]) -> float:
    if lhs is None:
        return 0.0
    return 2.0 * math.prod(out) * math.prod(lhs[d] for d in contracting)


def _instruction_flops(comp: _Computation, type_text: str, op: str, rest: str) -> float:
    out = _dims(type_text)
    if out is None or op not in ("dot", "convolution", "custom-call"):
        return 0.0
    ops = _operands(rest)
    if op == "dot" and ops:
        return _dot_flops(out, _operand_dims(comp, ops[0]), _int_list(rest, "lhs_contracting_dims"))
    if op == "convolution" and len(ops) >= 2:
        rhs = _operand_dims(comp, ops[1])
        labels = re.search(r"dim_labels=\w+_(\w+)->", rest)
        if rhs is None or labels is None or "o" not in labels.group(1):
            return 0.0
        per_output = math.prod(rhs) // rhs[labels.group(1).index("o")]  # window x input features (per group)
        return 2.0 * math.prod(out) * per_output
    if op == "custom-call" and '"dot_dimension_numbers"' in rest and ops:
        dnums = re.search(r'"lhs_contracting_dimensions"\s*:\s*\[([^\]]*)\]', rest)
        contracting = [int(d) for d in re.findall(r"\d+", dnums.group(1))] if dnums else []
        return _dot_flops(out, _operand_dims(comp, ops[0]), contracting)
    return 0.0


@functools.lru_cache(maxsize=2)  # callers total one module in several ways (matmul_flops, branch_flops)
def _parse(hlo_text: str) -> tuple[dict[str, _Computation], str | None]:
    comps: dict[str, _Computation] = {}
    entry = None
    comp = None
    for line in hlo_text.splitlines():
        header = _HEADER.match(line)
        if header and not line.startswith((" ", "\t")):
            comp = comps.setdefault(header.group(1), _Computation(header.group(1)))
            if line.startswith("ENTRY"):
                entry = comp.name
            for pname, ptype in _PARAM.findall(header.group(2)):
                comp.shapes[pname] = _dims(ptype)
            continue
        if comp is None:
            continue
        if line.strip() == "}":
            comp = None
            continue
        m = _INSTR.match(line)
        if m is None:
            continue
        name, type_text, op, rest = m.groups()
        comp.shapes[name] = _dims(type_text) if not type_text.startswith("(") else None
        comp.flops += _instruction_flops(comp, type_text, op, rest)
        if op == "while":
            trip = _TRIP.search(rest)
            body = re.search(r"\bbody=%?([\w.\-]+)", rest)
            if body:
                comp.calls.append((float(trip.group(1)) if trip else math.nan, [body.group(1)]))
        elif op == "conditional":
            branches = []
            for listed, true_c, false_c in _BRANCHES.findall(rest):
                branches += [b.strip().lstrip("%") for b in listed.split(",") if b.strip()] if listed else []
                branches += [c for c in (true_c, false_c) if c]
            if branches:
                comp.calls.append((1.0, branches))
        else:  # fusions, async computations, calls (and reducers, which hold no dots)
            comp.calls += [(1.0, [callee]) for callee in _CALLEE.findall(rest)]
    return comps, entry


def _flops_of(comps: dict[str, _Computation], differing: str):
    """`name -> matmul FLOPs` of a computation and everything it calls; `differing` says what a
    conditional whose branches differ counts: "nan" (unknown), "max" (its costliest branch) or
    "zero" (nothing: what runs outside such conditionals)."""
    memo: dict[str, float] = {}

    def total(name: str) -> float:  # HLO computations call each other without cycles
        if name in memo:
            return memo[name]
        comp = comps.get(name)
        if comp is None:
            return 0.0
        value = comp.flops
        for mult, callees in comp.calls:
            costs = {total(c) for c in callees}
            # Branches of a conditional that differ: which one runs is decided at run time.
            inner = costs.pop() if len(costs) == 1 else {"max": max(costs), "zero": 0.0}.get(differing, math.nan)
            value += mult * inner if inner else 0.0  # a loop of no matmuls adds none, known trip count or not
        memo[name] = value
        return value

    return total


def matmul_flops(hlo_text: str, *, differing: str = "nan") -> float:
    """FLOPs of every dot and convolution in an optimized HLO module, loop iterations counted.

    Args:
        hlo_text: `jax.stages.Compiled.as_text()` (the module after XLA's passes,
            where `while` loops carry `known_trip_count`).
        differing: what a conditional whose branches differ in matmul FLOPs counts:
            "nan" (the total is unknown), or "zero" (the total is what runs outside
            such conditionals; `branch_flops` gives the branches).

    Returns:
        2 x multiply-adds of all dots/convolutions, each counted as often as it runs;
        nan if the text holds no ENTRY computation, a loop without a known trip count,
        or (by default) a conditional whose branches differ in matmul FLOPs.

    Example:
        >>> f = jax.jit(lambda x, w: jax.lax.scan(lambda h, w: (h @ w, None), x, w)[0])
        >>> matmul_flops(f.lower(jnp.ones((64, 256)), jnp.ones((8, 256, 256))).compile().as_text())
        67108864.0   # 8 x 2 x 64 x 256 x 256; cost_analysis() says 1/8 of it
    """
    if differing not in ("nan", "zero"):
        raise ValueError(f"differing={differing!r}; accepted: 'nan', 'zero'")
    comps, entry = _parse(hlo_text)
    if entry is None:
        return float("nan")
    return _flops_of(comps, differing)(entry)


def branch_flops(hlo_text: str) -> list[tuple[float, ...]]:
    """Matmul FLOPs of each branch of every conditional in an optimized HLO module.

    What `matmul_flops` cannot total: a conditional chooses a branch at run time
    (a pipeline tick runs a forward, a backward or nothing), so the caller, who
    knows how often each branch runs, weighs them. Loops inside a branch count
    every iteration; a conditional nested in a branch whose own branches differ
    counts its costliest branch (an upper bound).

    Returns:
        one tuple per conditional (in the order of the text: nested ones first), its branches' FLOPs in the
        order XLA lists them: branch index order (`lax.switch`; false, true for `lax.cond`).

    Example:
        >>> f = jax.jit(lambda i, x, w: jax.lax.switch(i, [lambda x: x, lambda x: x @ w], x))
        >>> branch_flops(f.lower(0, jnp.ones((64, 256)), jnp.ones((256, 256))).compile().as_text())
        [(0.0, 8388608.0)]
    """
    comps, _ = _parse(hlo_text)
    total = _flops_of(comps, "max")
    return [tuple(total(c) for c in callees)
            for comp in comps.values() for _, callees in comp.calls if len(callees) > 1]
