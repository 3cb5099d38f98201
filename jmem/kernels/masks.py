"""Attention masks: dense semantics plus block metadata for the sparse kernel.

A mask says which keys each query sees. Query i sees key j when:

- `Causal()`: j <= i
- `LocalWindow(w)`: |i - j| < w
- `Strided(s)`: (i - j) % s == 0
- `BlockSparse(layout, block_q, block_k)`: layout[i // block_q, j // block_k]
- `BigBird(num_global, window, num_random, seed, block)`: i or j is one of the
  first `num_global` tokens, or |i - j| < window, or key block j // block is
  one of `num_random` blocks drawn (seeded) for query block i // block.

Masks combine with `&` and `|`, so `Causal() & LocalWindow(256)` is the usual
causal sliding window and `Causal() & (LocalWindow(w) | Strided(w))` the
strided pattern of Child et al. (2019).

Block metadata (`block_info`) classifies each (q_block, k_block) tile as empty,
partial or full, computed once per shape in numpy, one row of query blocks at
a time so the host never holds the whole [q_len, kv_len] matrix.
"""

from __future__ import annotations

import dataclasses
import functools

import numpy as np

from jmem.checks import is_int

EMPTY, PARTIAL, FULL = 0, 1, 2


class Mask:
    """Base class: subclasses define `_eval(i, j, q_len, kv_len)` on broadcast index arrays."""

    def _eval(self, i, j, q_len: int, kv_len: int) -> np.ndarray:
        raise NotImplementedError

    def check(self, q_len: int, kv_len: int) -> None:
        """Raise ValueError when the mask cannot describe a [q_len, kv_len] attention."""
        if not (is_int(q_len) and is_int(kv_len)) or q_len < 1 or kv_len < 1:
            raise ValueError(f"mask needs integers q_len >= 1 and kv_len >= 1; got q_len={q_len!r}, kv_len={kv_len!r}")

    def mask(self, q_len: int, kv_len: int) -> np.ndarray:
        """Dense mask bool[q_len, kv_len]: True where query i sees key j.

        Example:
            >>> (Causal() & LocalWindow(2)).mask(3, 3).astype(int).tolist()
            [[1, 0, 0], [1, 1, 0], [0, 1, 1]]
        """
        self.check(q_len, kv_len)
        i = np.arange(q_len)[:, None]
        j = np.arange(kv_len)[None, :]
        return np.broadcast_to(self._eval(i, j, q_len, kv_len), (q_len, kv_len)).copy()

    def __and__(self, other: Mask) -> Mask:
        return And(self, _operand("&", other))

    def __or__(self, other: Mask) -> Mask:
        return Or(self, _operand("|", other))

    def block_info(self, q_len: int, kv_len: int, block_q: int, block_k: int) -> BlockInfo:
        """Per-tile metadata for a [q_len, kv_len] attention cut into block_q x block_k tiles."""
        return _block_info(self, q_len, kv_len, block_q, block_k)


def _operand(op: str, other) -> Mask:
    if not isinstance(other, Mask):
        raise ValueError(f"Mask {op} {type(other).__name__}: accepted: a jmem.kernels.masks.Mask (Causal, LocalWindow, "
                         "Strided, BlockSparse, BigBird, or & / | of them); a dense bool array is BlockSparse(array, 1, 1)")
    return other


@dataclasses.dataclass(frozen=True)
class Causal(Mask):
    """Query i sees key j when j <= i (top-left aligned, as in the dispatcher)."""

    def _eval(self, i, j, q_len, kv_len):
        return j <= i


@dataclasses.dataclass(frozen=True)
class LocalWindow(Mask):
    """Query i sees key j when |i - j| < size."""

    size: int

    def __post_init__(self):
        if not is_int(self.size) or self.size < 1:
            raise ValueError(f"LocalWindow size must be an int >= 1; got {self.size!r}")

    def _eval(self, i, j, q_len, kv_len):
        return np.abs(i - j) < self.size


@dataclasses.dataclass(frozen=True)
class Strided(Mask):
    """Query i sees key j when (i - j) % stride == 0."""

    stride: int

    def __post_init__(self):
        if not is_int(self.stride) or self.stride < 1:
            raise ValueError(f"Strided stride must be an int >= 1; got {self.stride!r}")

    def _eval(self, i, j, q_len, kv_len):
        return (i - j) % self.stride == 0


@dataclasses.dataclass(frozen=True)
class BlockSparse(Mask):
    """Query i sees key j when layout[i // block_q][j // block_k].

    Args:
        layout: bool[n_q_blocks, n_k_blocks] (nested tuples or an array; stored as tuples
            so the mask stays hashable). It must cover the sequence exactly:
            n_q_blocks == ceil(q_len / block_q), n_k_blocks == ceil(kv_len / block_k).
        block_q, block_k: tokens per layout row / column.
    """

    layout: tuple
    block_q: int = 128
    block_k: int = 128

    def __post_init__(self):
        try:
            raw = np.asarray(self.layout)
        except (TypeError, ValueError):  # ragged rows
            raw = None
        if raw is None or raw.ndim != 2 or 0 in raw.shape:
            got = "ragged rows" if raw is None else f"shape {raw.shape}"
            raise ValueError(f"BlockSparse layout must be a non-empty 2-D bool array; got {got}")
        # Text or objects ("0", None) would count as True or False; bfloat16 and the like are numbers of kind "V".
        if raw.dtype.kind not in "biuf" and "float" not in raw.dtype.name:
            raise ValueError(f"BlockSparse layout holds {raw.dtype} values ({str(raw.ravel()[0])!r}, ...); accepted: "
                             "booleans, or numbers 0 and 1")
        if raw.dtype != bool and not np.isin(raw, (0, 1)).all():  # NaN or -1 would count as True
            raise ValueError(f"BlockSparse layout holds the value {raw[~np.isin(raw, (0, 1))][0]}; accepted: "
                             "booleans, or numbers 0 and 1")
        arr = raw.astype(bool)
        if not (is_int(self.block_q) and is_int(self.block_k)) or self.block_q < 1 or self.block_k < 1:
            raise ValueError(f"BlockSparse block sizes must be integers >= 1; got {self.block_q!r}, {self.block_k!r}")
        object.__setattr__(self, "layout", tuple(map(tuple, arr.tolist())))
        object.__setattr__(self, "_array", arr)  # not a field: what `_eval` indexes, built once

    def check(self, q_len, kv_len):
        super().check(q_len, kv_len)
        want = (-(-q_len // self.block_q), -(-kv_len // self.block_k))
        got = (len(self.layout), len(self.layout[0]))
        if got != want:
            raise ValueError(
                f"BlockSparse layout {got} does not match q_len={q_len}, kv_len={kv_len} with blocks "
                f"({self.block_q}, {self.block_k}); expected layout shape {want}"
            )

    def _eval(self, i, j, q_len, kv_len):
        return self._array[i // self.block_q, j // self.block_k]


@dataclasses.dataclass(frozen=True)
class BigBird(Mask):
    """Global tokens + sliding window + seeded random key blocks (Zaheer et al., 2020).

    Args:
        num_global: the first num_global tokens see everything and are seen by everyone.
        window: query i sees key j when |i - j| < window.
        num_random: random key blocks per query block (drawn without replacement; at most the
            number of key blocks, ceil(kv_len / block): a larger value draws all of them). They are
            drawn over all key blocks, so `Causal() & BigBird(...)` keeps only those at or below the
            diagonal: fewer than num_random per row on average.
        seed: seed of the random draw; the draw depends only on (seed, q_len, kv_len, block).
        block: tokens per random block.
    """

    num_global: int
    window: int
    num_random: int
    seed: int = 0
    block: int = 64

    def __post_init__(self):
        for name in ("num_global", "window", "num_random", "seed"):
            if not is_int(getattr(self, name)) or getattr(self, name) < 0:
                raise ValueError(f"BigBird {name} must be an integer >= 0; got {getattr(self, name)!r}")
        if not is_int(self.block) or self.block < 1:
            raise ValueError(f"BigBird block must be an integer >= 1; got {self.block!r}")

    def check(self, q_len, kv_len):
        super().check(q_len, kv_len)
        if self.num_global > kv_len:
            raise ValueError(f"BigBird num_global={self.num_global} is larger than the sequence kv_len={kv_len}")

    def random_layout(self, q_len: int, kv_len: int) -> np.ndarray:
        """bool[ceil(q_len/block), ceil(kv_len/block)]: the drawn random key blocks (read-only)."""
        return _random_layout(self.seed, self.num_random, self.block, q_len, kv_len)

    def _eval(self, i, j, q_len, kv_len):
        rand = self.random_layout(q_len, kv_len)[i // self.block, j // self.block]
        glob = (i < self.num_global) | (j < self.num_global)
        return glob | (np.abs(i - j) < self.window) | rand


@functools.lru_cache(maxsize=32)
def _random_layout(seed: int, num_random: int, block: int, q_len: int, kv_len: int) -> np.ndarray:
    nq, nk = -(-q_len // block), -(-kv_len // block)
    rng = np.random.default_rng(seed)
    layout = np.zeros((nq, nk), bool)
    r = min(num_random, nk)
    for row in range(nq):
        layout[row, rng.choice(nk, size=r, replace=False)] = True
    layout.setflags(write=False)
    return layout


@dataclasses.dataclass(frozen=True)
class And(Mask):
    a: Mask
    b: Mask

    def check(self, q_len, kv_len):
        self.a.check(q_len, kv_len)
        self.b.check(q_len, kv_len)

    def _eval(self, i, j, q_len, kv_len):
        return self.a._eval(i, j, q_len, kv_len) & self.b._eval(i, j, q_len, kv_len)


@dataclasses.dataclass(frozen=True)
class Or(Mask):
    a: Mask
    b: Mask

    def check(self, q_len, kv_len):
        self.a.check(q_len, kv_len)
        self.b.check(q_len, kv_len)

    def _eval(self, i, j, q_len, kv_len):
        return self.a._eval(i, j, q_len, kv_len) | self.b._eval(i, j, q_len, kv_len)


@dataclasses.dataclass(frozen=True, eq=False)
class BlockInfo:
    """Block metadata of one mask at one shape and tiling.

    Attributes:
        status: int8[n_q_blocks, n_k_blocks], EMPTY / PARTIAL / FULL per tile. Keys past
            kv_len count as masked, so a tile holding padding is at most PARTIAL; query
            rows past q_len are ignored (their outputs are discarded).
        tiles: bool[num_unique, block_q, block_k], the distinct masks of PARTIAL tiles
            (identical tiles, e.g. every causal diagonal, are stored once).
        tile_id: int32[n_q_blocks, n_k_blocks], index into `tiles` for PARTIAL tiles, -1 elsewhere.
    """

    status: np.ndarray
    tiles: np.ndarray
    tile_id: np.ndarray

    @property
    def num_blocks(self) -> int:
        return self.status.size

    @property
    def num_nonempty(self) -> int:
        return int((self.status != EMPTY).sum())

    @property
    def num_partial(self) -> int:
        return int((self.status == PARTIAL).sum())

    @property
    def num_full(self) -> int:
        return int((self.status == FULL).sum())


@functools.lru_cache(maxsize=64)
def _block_info(mask: Mask, q_len: int, kv_len: int, block_q: int, block_k: int) -> BlockInfo:
    mask.check(q_len, kv_len)
    for name, value in (("block_q", block_q), ("block_k", block_k)):
        if not is_int(value) or value < 1:
            raise ValueError(f"{type(mask).__name__}.block_info: {name}={value!r}; accepted: an integer >= 1")
    nq, nk = -(-q_len // block_q), -(-kv_len // block_k)
    status = np.zeros((nq, nk), np.int8)
    tile_id = np.full((nq, nk), -1, np.int32)
    tiles: list[np.ndarray] = []
    seen: dict[bytes, int] = {}
    cols = np.arange(nk * block_k)[None, :]
    for qb in range(nq):
        rows = np.arange(qb * block_q, min((qb + 1) * block_q, q_len))[:, None]
        m = np.broadcast_to(mask._eval(rows, np.minimum(cols, kv_len - 1), q_len, kv_len), (rows.shape[0], cols.shape[1]))
        m = m & (cols < kv_len)
        m_RKC = m.reshape(rows.shape[0], nk, block_k)
        any_K = m_RKC.any(axis=(0, 2))
        all_K = m_RKC.all(axis=(0, 2))
        status[qb] = np.where(all_K, FULL, np.where(any_K, PARTIAL, EMPTY))
        for kb in np.nonzero(any_K & ~all_K)[0]:
            tile = np.zeros((block_q, block_k), bool)
            tile[: rows.shape[0]] = m_RKC[:, kb]
            key = np.packbits(tile).tobytes()
            if key not in seen:
                seen[key] = len(tiles)
                tiles.append(tile)
            tile_id[qb, kb] = seen[key]
    tiles_arr = np.stack(tiles) if tiles else np.zeros((1, block_q, block_k), bool)
    for a in (status, tile_id, tiles_arr):
        a.setflags(write=False)
    return BlockInfo(status=status, tiles=tiles_arr, tile_id=tile_id)
