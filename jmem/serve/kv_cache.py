"""KV-cache manager: which blocks each request holds, prefix hits, capacity (no JAX).

The scheduler asks this manager for room before it schedules tokens; the
manager asks the block pool. Device arrays never appear here: a request's
block list is what the runner turns into a block table.
"""

from __future__ import annotations

from jmem.checks import check_int
from jmem.serve.block_pool import BlockPool, hash_block
from jmem.serve.request import Request


class KVCacheManager:
    """Blocks per request on top of a `BlockPool`.

    Args:
        num_blocks: blocks in the pool.
        block_size: token slots per block.
        enable_prefix_caching: share full blocks between requests with the same prefix.

    Example:
        >>> m = KVCacheManager(num_blocks=4, block_size=16)
        >>> r = Request("a", list(range(20)))
        >>> m.allocate_slots(r, 20) is not None
        True
    """

    def __init__(self, num_blocks: int, block_size: int = 16, enable_prefix_caching: bool = True):
        if block_size < 1:
            raise ValueError(f"block_size={block_size}; need >= 1")
        self.block_size = block_size
        self.pool = BlockPool(num_blocks, enable_prefix_caching)
        self.req_blocks: dict[str, list[int]] = {}
        # Hashes of each request's full blocks, in order (chained, so prefix i covers blocks 0..i).
        self.req_hashes: dict[str, list[bytes]] = {}
        # Full blocks the step being scheduled writes: hash -> (request id, index, block), registered
        # for prefix hits once that step has run (`commit_written`).
        self._unwritten: dict[bytes, tuple[str, int, int]] = {}
        self.prefix_queries = 0  # prompt tokens looked up
        self.prefix_hits = 0  # of those, tokens found cached

    @property
    def capacity_tokens(self) -> int:
        return self.pool.num_blocks * self.block_size

    @property
    def usage(self) -> float:
        return self.pool.usage

    @property
    def prefix_hit_rate(self) -> float:
        return self.prefix_hits / self.prefix_queries if self.prefix_queries else 0.0

    def blocks_of(self, request_id: str) -> list[int]:
        return self.req_blocks.get(request_id, [])

    def _hashes(self, req: Request, num_full_blocks: int) -> list[bytes]:
        hashes = self.req_hashes.setdefault(req.request_id, [])
        toks = req.all_token_ids
        bs = self.block_size
        while len(hashes) < num_full_blocks:
            i = len(hashes)
            parent = hashes[-1] if hashes else None
            hashes.append(hash_block(parent, toks[i * bs : (i + 1) * bs], req.adapter_id, req.adapter_version))
        return hashes

    def get_computed_blocks(self, req: Request) -> tuple[list[int], int]:
        """Longest run of cached full blocks at the start of `req`'s tokens.

        Leaves at least one token uncomputed: the step must produce logits for
        the last prompt token.

        Returns:
            (block ids, number of tokens they hold).
        """
        if not self.pool.enable_prefix_caching:
            return [], 0
        max_blocks = (req.num_tokens - 1) // self.block_size
        hits = []
        for h in self._hashes(req, max_blocks)[:max_blocks]:
            bid = self.pool.lookup(h)
            if bid is None:
                break
            hits.append(bid)
        return hits, len(hits) * self.block_size

    def prefix_in_flight(self, req: Request, num_hit_blocks: int) -> bool:
        """Whether `req`'s next block after its `num_hit_blocks` hits is being computed by the step being
        scheduled (so it becomes a hit once that step has run)."""
        if not self.pool.enable_prefix_caching or num_hit_blocks >= (req.num_tokens - 1) // self.block_size:
            return False
        return self._hashes(req, num_hit_blocks + 1)[num_hit_blocks] in self._unwritten

    def count_prefix_lookup(self, num_tokens: int, num_hit: int) -> None:
        """Add one admitted request's lookup to the hit-rate counters."""
        self.prefix_queries += num_tokens
        self.prefix_hits += num_hit

    def allocate_slots(self, req: Request, num_new_tokens: int, computed_blocks: list[int] | None = None) -> list[int] | None:
        """Make room for `num_new_tokens` more tokens after `req.num_computed_tokens`.

        Args:
            req: the request; when `computed_blocks` are given its
                `num_computed_tokens` must already count their tokens.
            num_new_tokens: tokens this step computes.
            computed_blocks: prefix-hit blocks from `get_computed_blocks` (first allocation only).

        Returns:
            The request's full block list, or None (nothing changed) when the pool is short.
        """
        check_int("num_new_tokens", num_new_tokens, 0)
        computed_blocks = computed_blocks or []
        if computed_blocks:
            self._check_still_cached(req, computed_blocks)
        blocks = self.req_blocks.get(req.request_id, [])
        total = req.num_computed_tokens + num_new_tokens
        need = -(-total // self.block_size) - len(blocks) - len(computed_blocks)
        # Prefix-hit blocks sitting idle in the free queue stop being allocatable once taken.
        idle_hits = sum(1 for b in computed_blocks if self.pool.blocks[b].ref_cnt == 0)
        if max(need, 0) + idle_hits > self.pool.num_free:
            return None
        if computed_blocks:
            self.pool.touch(computed_blocks)
            blocks = blocks + computed_blocks
        if need > 0:
            blocks = blocks + self.pool.allocate(need)
        self.req_blocks[req.request_id] = blocks
        # Blocks full after this step can serve requests scheduled after it, not a request of
        # the same step: the step attends to pages as earlier steps left them.
        num_full = min(total, req.num_tokens) // self.block_size
        for i, h in enumerate(self._hashes(req, num_full)[:num_full]):
            if self.pool.blocks[blocks[i]].block_hash is None:
                self._unwritten.setdefault(h, (req.request_id, i, blocks[i]))
        return blocks

    def _check_still_cached(self, req: Request, computed_blocks: list[int]) -> None:
        """Prefix hits must still hold `req`'s prefix: an allocation between `get_computed_blocks` and
        `allocate_slots` may have evicted them and handed them to another request."""
        hashes = self._hashes(req, len(computed_blocks))
        for i, bid in enumerate(computed_blocks):
            if self.pool.lookup(hashes[i]) != bid:
                raise ValueError(f"computed block {bid} (block {i} of request {req.request_id!r}) no longer holds "
                                 "its prefix (evicted since get_computed_blocks); accepted: the blocks of a "
                                 "get_computed_blocks call with no allocation in between")

    def commit_written(self) -> None:
        """After a step ran: its full blocks become prefix hits (those of requests still holding them)."""
        for h, (rid, i, bid) in self._unwritten.items():
            blocks = self.req_blocks.get(rid, [])
            if i < len(blocks) and blocks[i] == bid:
                self.pool.cache_block(bid, h)
        self._unwritten.clear()

    def discard_unwritten(self) -> None:
        """After a step that failed: the blocks it would have filled never become prefix hits."""
        self._unwritten.clear()

    def free(self, req: Request) -> None:
        """Release every block of `req` (tail first) and forget it."""
        blocks = self.req_blocks.pop(req.request_id, [])
        self.req_hashes.pop(req.request_id, None)
        self.pool.free(reversed(blocks))
