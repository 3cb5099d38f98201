"""Block pool: the KV cache's pages as host-side bookkeeping (no JAX).

The pool owns `num_blocks` fixed-size blocks, each holding `block_size` token
slots of every layer's K and V. A block is either in use (ref count > 0) or in
the free queue. Freed blocks keep their prefix hash, so a later request with
the same prefix can take them back (a prefix hit) until allocation evicts them
in least-recently-freed order.

Prefix hashes chain: `hash_block(parent, tokens, adapter)` covers the whole
prefix up to and including this block, so two requests share a block only if
every token before it matches too (and they use the same adapter).
"""

from __future__ import annotations

import hashlib
from array import array
from collections import OrderedDict
from dataclasses import dataclass

from jmem.checks import is_int


class NoFreeBlocksError(RuntimeError):
    """Raised when an allocation asks for more blocks than are free."""


def hash_block(parent: bytes | None, tokens, adapter_id: str | None = None, adapter_version: int = 0) -> bytes:
    """Hash of one full block, chained on the hash of the block before it.

    Args:
        parent: hash of the previous block of the same sequence, None for the first.
        tokens: the block's `block_size` token ids.
        adapter_id: the LoRA adapter the KV was computed with (None for the base model).
        adapter_version: which load of `adapter_id` (an adapter unloaded and loaded again under the same
            name is another adapter).

    Example:
        >>> h0 = hash_block(None, [1, 2, 3, 4]); h1 = hash_block(h0, [5, 6, 7, 8])
    """
    h = hashlib.blake2b(digest_size=16)
    h.update(parent or b"\0" * 16)
    h.update(array("q", tokens).tobytes())
    # The base model (None) is marked apart from every adapter name, "" included.
    h.update(b"\0" if adapter_id is None else b"|%d|" % adapter_version + adapter_id.encode())
    return h.digest()


@dataclass
class Block:
    """One block: its index in the device page arrays, ref count, and prefix hash."""

    block_id: int
    ref_cnt: int = 0
    block_hash: bytes | None = None


class BlockPool:
    """Preallocated blocks with reference counts, an LRU free queue and a prefix-hash map.

    Args:
        num_blocks: blocks in the pool (device pages `0..num_blocks-1`).
        enable_prefix_caching: keep freed blocks' hashes so later requests can reuse them.

    Example:
        >>> pool = BlockPool(8)
        >>> ids = pool.allocate(3); pool.free(ids); pool.num_free
        8
    """

    def __init__(self, num_blocks: int, enable_prefix_caching: bool = True):
        if not is_int(num_blocks) or num_blocks < 1:
            raise ValueError(f"BlockPool num_blocks={num_blocks!r}; accepted: an integer >= 1")
        self.num_blocks = num_blocks
        self.enable_prefix_caching = enable_prefix_caching
        self.blocks = [Block(i) for i in range(num_blocks)]
        # Front of the queue is evicted first; freed blocks go to the back.
        self._free: OrderedDict[int, None] = OrderedDict((i, None) for i in range(num_blocks))
        self._cached: dict[bytes, int] = {}
        self.num_evictions = 0

    @property
    def num_free(self) -> int:
        """Blocks that an allocation can take now (free, cached or not)."""
        return len(self._free)

    @property
    def num_used(self) -> int:
        return self.num_blocks - len(self._free)

    @property
    def usage(self) -> float:
        """Fraction of blocks referenced by some request."""
        return self.num_used / self.num_blocks

    def allocate(self, n: int) -> list[int]:
        """Take `n` blocks from the front of the free queue, evicting their cached hashes."""
        if not is_int(n) or n < 0:
            raise ValueError(f"allocate n={n!r}; accepted: an integer >= 0")
        if n > len(self._free):
            raise NoFreeBlocksError(f"asked for {n} blocks, {len(self._free)} free")
        out = []
        for _ in range(n):
            bid, _ = self._free.popitem(last=False)
            blk = self.blocks[bid]
            if blk.block_hash is not None:
                if self._cached.get(blk.block_hash) == bid:
                    del self._cached[blk.block_hash]
                blk.block_hash = None
                self.num_evictions += 1
            blk.ref_cnt = 1
            out.append(bid)
        return out

    def touch(self, block_ids) -> None:
        """Add one reference to each block (a prefix hit); takes idle ones off the free queue."""
        for bid in block_ids:
            blk = self._block(bid)
            if blk.ref_cnt == 0:
                del self._free[bid]
            blk.ref_cnt += 1

    def free(self, block_ids) -> None:
        """Drop one reference from each block; blocks reaching zero join the back of the queue.

        Pass a sequence's blocks tail first, so its last blocks (least likely to be
        shared) are evicted before its first ones.
        """
        for bid in block_ids:
            blk = self._block(bid)
            if blk.ref_cnt <= 0:
                raise ValueError(f"block {bid} freed while not in use (ref count 0); accepted: blocks held "
                                 "by a request, each freed once per reference")
            blk.ref_cnt -= 1
            if blk.ref_cnt == 0:
                if blk.block_hash is None or not self.enable_prefix_caching:
                    blk.block_hash = None
                    # Blocks with no reusable content go to the front: evict them first.
                    self._free[bid] = None
                    self._free.move_to_end(bid, last=False)
                else:
                    self._free[bid] = None

    def cache_block(self, block_id: int, block_hash: bytes) -> None:
        """Record that `block_id` holds the full block with `block_hash`."""
        if not self.enable_prefix_caching:
            return
        blk = self._block(block_id)
        if blk.block_hash is not None:
            return
        blk.block_hash = block_hash
        # If another block already holds this content keep the first: both stay valid.
        self._cached.setdefault(block_hash, block_id)

    def lookup(self, block_hash: bytes) -> int | None:
        """The block holding `block_hash`, or None."""
        if not self.enable_prefix_caching:
            return None
        return self._cached.get(block_hash)

    def _block(self, bid) -> Block:
        """Block `bid`, checked: -1 (a block table's empty slot) or an id past the pool is an error,
        not a Python index into another request's block."""
        if not is_int(bid) or not 0 <= bid < self.num_blocks:
            raise ValueError(f"block id {bid!r}; accepted: an integer in [0, {self.num_blocks})")
        return self.blocks[bid]

    def reset_prefix_cache(self) -> None:
        """Forget every cached hash (for example after the weights change)."""
        for blk in self.blocks:
            blk.block_hash = None
        self._cached.clear()
