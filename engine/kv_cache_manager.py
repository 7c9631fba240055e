"""Turns the scheduler's decisions ("this request gets n more tokens") into blocks.

A facade over the block pool: per-request block tables, prefix-cache lookups by chained
block hashes, and the check/act pair `can_allocate` / `allocate_slots` so the scheduler never
has to roll back. Pure Python.
"""

from __future__ import annotations

import hashlib
import struct

from engine.block_pool import Block, BlockPool
from engine.request import Request

_ROOT_HASH = b"mini-infer-kv-v1"


def hash_block(parent_hash: bytes, token_ids: list[int]) -> bytes:
    """Chain hash of a full block: the hash of its parent block's hash and its own tokens, so
    equal hashes mean equal whole prefixes. A cryptographic hash (not Python's `hash`) because
    a collision would silently serve one tenant's cached prefix to another."""
    payload = struct.pack(f"<{len(token_ids)}q", *token_ids)
    return hashlib.blake2b(parent_hash + payload, digest_size=16).digest()


def cdiv(a: int, b: int) -> int:
    return -(-a // b)


class KVCacheManager:
    def __init__(self, num_blocks: int, block_size: int, enable_caching: bool = True) -> None:
        self.block_size = block_size
        self.enable_caching = enable_caching
        self.pool = BlockPool(num_blocks, enable_caching)
        self._blocks: dict[str, list[Block]] = {}
        self._hashes: dict[str, list[bytes]] = {}  # chain hashes of the request's full blocks
        self._num_registered: dict[str, int] = {}  # leading blocks already offered to the cache

    @property
    def num_blocks(self) -> int:
        return self.pool.num_blocks

    @property
    def num_free_blocks(self) -> int:
        return self.pool.num_free_blocks

    def block_ids(self, request_id: str) -> list[int]:
        return [b.block_id for b in self._blocks.get(request_id, ())]

    def num_blocks_of(self, request_id: str) -> int:
        return len(self._blocks.get(request_id, ()))

    def _full_block_hashes(self, req: Request, num_tokens: int) -> list[bytes]:
        """Chain hashes of the first `num_tokens // block_size` blocks of the request (memoised)."""
        hashes = self._hashes.setdefault(req.request_id, [])
        bs = self.block_size
        while len(hashes) < num_tokens // bs:
            i = len(hashes)
            parent = hashes[-1] if hashes else _ROOT_HASH
            hashes.append(hash_block(parent, req.all_token_ids[i * bs : (i + 1) * bs]))
        return hashes

    def full_block_hashes(self, req: Request, num_tokens: int) -> list[bytes]:
        """Chain hashes of the request's first `num_tokens // block_size` blocks."""
        return self._full_block_hashes(req, num_tokens)[: num_tokens // self.block_size]

    def can_take_cached(self, req: Request) -> bool:
        """Whether `req` may take blocks from the prefix cache."""
        if not self.enable_caching:
            return False
        # Cached prompt tokens would have no logits (vLLM does the same).
        return req.params.prompt_logprobs is None or req.num_output_tokens > 0

    def get_computed_blocks(self, req: Request) -> list[Block]:
        """The longest run of cached full blocks that prefixes the request's tokens.

        At least one token is always left to compute: the model must run on the last token to
        produce logits, so a fully cached prompt gives back its last block."""
        if not self.can_take_cached(req):
            return []
        max_hit_tokens = req.num_tokens - 1
        hits = []
        for h in self._full_block_hashes(req, max_hit_tokens):
            block = self.pool.lookup(h)
            if block is None:
                break
            hits.append(block)
        return hits

    def num_blocks_needed(self, req: Request, num_new_tokens: int, num_computed_blocks: int = 0) -> int:
        total_tokens = req.num_computed_tokens + num_computed_blocks * self.block_size + num_new_tokens
        have = self.num_blocks_of(req.request_id) + num_computed_blocks
        return max(0, cdiv(total_tokens, self.block_size) - have)

    def can_allocate(
        self, req: Request, num_new_tokens: int, computed: list[Block] = (), num_reserved: int = 0
    ) -> bool:
        """Whether the pool can hold `num_new_tokens` more tokens and still keep `num_reserved`
        blocks free. Free blocks among the prefix hits leave the free queue when touched, so
        they can't count twice."""
        num_hits_free = sum(1 for b in computed if b.ref_count == 0)
        need = self.num_blocks_needed(req, num_new_tokens, len(computed))
        return need + num_reserved <= self.pool.num_free_blocks - num_hits_free

    def allocate_slots(self, req: Request, num_new_tokens: int, computed: list[Block] = ()) -> bool:
        """Make room for `num_new_tokens` more tokens after the computed ones (and after the
        prefix hits `computed`, which join the request's block table). False, with nothing
        changed, when the pool cannot hold them."""
        if not self.can_allocate(req, num_new_tokens, computed):
            return False
        need = self.num_blocks_needed(req, num_new_tokens, len(computed))
        table = self._blocks.setdefault(req.request_id, [])
        if computed:
            assert not table, "prefix hits only apply to a request with no blocks"
            self.pool.touch(list(computed))
            table.extend(computed)
            self._num_registered[req.request_id] = len(computed)
        table.extend(self.pool.allocate(need))
        return True

    def cache_computed_blocks(self, req: Request) -> None:
        """Offer the request's newly full, computed blocks to the prefix cache."""
        if not self.enable_caching:
            return
        num_full = req.num_computed_tokens // self.block_size
        start = self._num_registered.get(req.request_id, 0)
        if num_full <= start:
            return
        table = self._blocks[req.request_id]
        hashes = self._full_block_hashes(req, num_full * self.block_size)
        for i in range(start, num_full):
            self.pool.cache(table[i], hashes[i])
        self._num_registered[req.request_id] = num_full

    def free(self, req: Request) -> None:
        """Return all of a request's blocks at once (finish, abort or preemption)."""
        table = self._blocks.pop(req.request_id, [])
        self.pool.free(list(reversed(table)))
        self._num_registered.pop(req.request_id, None)
        # Hashes of the prompt stay valid for a preempted request; drop them only when it leaves.

    def forget(self, req: Request) -> None:
        self.free(req)
        self._hashes.pop(req.request_id, None)
