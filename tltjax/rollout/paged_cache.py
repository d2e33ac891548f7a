"""The paged KV cache of the rollout engine and its host-side page allocator.

`PagedKVCache` is a pytree with the interface of `tltjax.models.ContiguousKVCache`
(``attend``, ``advance``, ``keep``), so `CausalLM` runs over it unchanged. Memory is
a pool of pages per layer, ``[layers, kv_heads, num_pages, page_size, head_dim]``;
``page_table[b]`` lists row ``b``'s pages in token order (the layout of
`tltjax.kernels.paged`). Rows own pages, not slots: a row holds as many pages as
its tokens need, and re-ordering or compacting rows (`PagedKVCache.select_rows`)
moves page tables and lengths, never pages.

`PageAllocator` runs on the host between device chunks: it hands out pages from a
free list, never the same page to two rows, and builds the page tables that the
device steps read. Page `SCRATCH_PAGE` is never handed out: page-table padding
points there, so the writes of padding rows and of block tokens past a row's
pages land in scratch rather than in another row's tokens.
"""

from __future__ import annotations

from typing import Hashable, Sequence

import jax.numpy as jnp
import numpy as np
from flax import struct
from jaxtyping import Array, Bool, Float, Int

from tltjax.kernels import paged_attention, write_block
from tltjax.kernels.paged import token_slots

SCRATCH_PAGE = 0  # reserved by PageAllocator; padding of every page table


def _check_page_size(page_size) -> None:
    if not isinstance(page_size, (int, np.integer)) or page_size < 1 or page_size & (page_size - 1):
        raise ValueError(f"page_size={page_size!r} must be a positive power of two (e.g. 16)")


@struct.dataclass
class PagedKVCache:
    """A paged cache: row ``b``'s token ``i`` is at page ``page_table[b, i // page_size]``, offset ``i % page_size``.

    Invariants (kept by the engine through `PageAllocator`): rows being written
    own disjoint pages; ``page_table[b]`` covers ``lengths[b] + new`` tokens
    whenever a block of ``new`` tokens is written; tokens ``[0, lengths[b])`` are
    committed, everything past them is scratch. Unused table entries point to
    `SCRATCH_PAGE`. ``impl`` names the `tltjax.kernels.paged_attention`
    implementation ("auto": Pallas on GPU, the XLA reference elsewhere).
    """

    k_pages: Float[Array, "layers kv_heads pages page dim"]
    v_pages: Float[Array, "layers kv_heads pages page dim"]
    page_table: Int[Array, "batch pages_per_seq"]
    lengths: Int[Array, " batch"]
    impl: str = struct.field(pytree_node=False, default="auto")

    @classmethod
    def init(
        cls,
        config,
        batch: int,
        num_pages: int,
        page_size: int,
        pages_per_seq: int,
        dtype=None,
        impl: str = "auto",
    ) -> "PagedKVCache":
        """An empty cache: ``num_pages`` zeroed pages, ``batch`` rows of length 0 whose tables point to scratch."""
        _check_page_size(page_size)
        if num_pages < 2:
            raise ValueError(f"num_pages={num_pages}: need at least 2 (page {SCRATCH_PAGE} is scratch)")
        if batch < 1 or pages_per_seq < 1:
            raise ValueError(f"batch={batch} and pages_per_seq={pages_per_seq} must both be >= 1")
        dtype = dtype or config.jnp_dtype
        shape = (config.num_hidden_layers, config.num_key_value_heads, num_pages, page_size, config.head_dim)
        return cls(
            k_pages=jnp.zeros(shape, dtype),
            v_pages=jnp.zeros(shape, dtype),
            page_table=jnp.full((batch, pages_per_seq), SCRATCH_PAGE, jnp.int32),
            lengths=jnp.zeros((batch,), jnp.int32),
            impl=impl,
        )

    @property
    def num_pages(self) -> int:
        return self.k_pages.shape[2]

    @property
    def page_size(self) -> int:
        return self.k_pages.shape[3]

    @property
    def pages_per_seq(self) -> int:
        return self.page_table.shape[1]

    @property
    def capacity(self) -> int:
        """Most tokens (committed + block) a row's table can address."""
        return self.pages_per_seq * self.page_size

    def attend(
        self,
        layer: int,
        q: Float[Array, "batch new heads dim"],
        k_new: Float[Array, "batch new kv_heads dim"],
        v_new: Float[Array, "batch new kv_heads dim"],
        new_mask: Bool[Array, "batch new new"],
    ) -> tuple[Float[Array, "batch new heads dim"], "PagedKVCache"]:
        """Writes the new block at ``lengths`` into layer ``layer``'s pages and attends over committed + visible new.

        Same semantics as `ContiguousKVCache.attend`; the committed length is not
        changed here. The caller guarantees ``lengths + new <= capacity``.
        """
        # written and read in the whole pool: slicing a layer out and back would copy the cache every step
        k_pages, v_pages = write_block(
            self.k_pages, self.v_pages, self.page_table, self.lengths, k_new, v_new, layer=layer
        )
        out = paged_attention(q, k_pages, v_pages, self.page_table, self.lengths, new_mask, impl=self.impl,
                              layer=layer)
        return out, self.replace(k_pages=k_pages, v_pages=v_pages)

    def advance(self, n: Int[Array, " batch"] | int) -> "PagedKVCache":
        """Commits the first ``n`` tokens of the block just written (per row)."""
        return self.replace(lengths=self.lengths + jnp.asarray(n, jnp.int32))

    def keep(self, idx: Int[Array, "batch n"], count: Int[Array, " batch"] | int) -> "PagedKVCache":
        """Commits the block tokens ``idx[b, :count[b]]`` (indices into the block just written).

        Used after tree verification: entry ``idx[b, j]`` moves from position
        ``lengths + idx[b, j]`` to ``lengths + j`` (across page boundaries as
        needed), in every layer; entries past ``count`` are ignored and the rest
        of the block becomes scratch. All entries are read before any is written,
        so any order of ``idx`` is exact.
        """
        n = idx.shape[1]
        count = jnp.broadcast_to(jnp.asarray(count, jnp.int32), self.lengths.shape)
        j = jnp.arange(n, dtype=jnp.int32)[None, :]
        src_page, src_off = token_slots(self.page_table, self.lengths[:, None] + idx.astype(jnp.int32), self.page_size)
        dst_page, dst_off = token_slots(self.page_table, self.lengths[:, None] + j, self.page_size)
        # Entries not kept are sent out of range and dropped, so they cannot race a kept write.
        dst_page = jnp.where(j < count[:, None], dst_page, self.num_pages)

        def move(pages):  # [L, KV, N, P, D]; pages[:, :, page, off] is [L, KV, B, n, D]
            return pages.at[:, :, dst_page, dst_off].set(pages[:, :, src_page, src_off], mode="drop")

        return self.replace(k_pages=move(self.k_pages), v_pages=move(self.v_pages), lengths=self.lengths + count)

    def select_rows(self, rows: Int[Array, " new_batch"] | Sequence[int]) -> "PagedKVCache":
        """A cache whose row ``i`` is this cache's row ``rows[i]``; a negative entry gives an empty row.

        Only page tables and lengths move; the pages stay put (the returned
        cache shares them). This is how the engine compacts live rows into a
        smaller bucket, or pads a bucket with empty rows (length 0, all pages
        scratch). Selecting a row twice would make two rows write the same
        pages: don't.
        """
        rows = jnp.asarray(rows, jnp.int32)
        if rows.ndim != 1:
            raise ValueError(f"rows must be 1-D, got shape {rows.shape}")
        empty = rows < 0
        safe = jnp.where(empty, 0, rows)
        table = jnp.where(empty[:, None], SCRATCH_PAGE, self.page_table[safe])
        lengths = jnp.where(empty, 0, self.lengths[safe])
        return self.replace(page_table=table, lengths=lengths)

    def with_table(self, page_table: Int[Array, "batch pages_per_seq"] | np.ndarray) -> "PagedKVCache":
        """This cache with the page table that `PageAllocator.table` built for its rows (same shape)."""
        page_table = jnp.asarray(page_table, jnp.int32)
        if page_table.shape != self.page_table.shape:
            raise ValueError(
                f"page table of shape {page_table.shape} does not fit the cache's {self.page_table.shape}; "
                "build it with PageAllocator.table(row_ids, pages_per_seq) for the cache's rows"
            )
        return self.replace(page_table=page_table)


class PageAllocator:
    """Host-side free-list allocator of cache pages to rows (any hashable row id).

    Page `SCRATCH_PAGE` is reserved, so ``num_pages - 1`` pages can be handed
    out. A page belongs to at most one row at a time. ``seed`` shuffles the
    initial free list (tests use it to show nothing depends on page order).
    """

    def __init__(self, num_pages: int, page_size: int, *, seed: int | None = None):
        _check_page_size(page_size)
        if not isinstance(num_pages, (int, np.integer)) or num_pages < 2:
            raise ValueError(f"num_pages={num_pages!r}: need an int >= 2 (page {SCRATCH_PAGE} is reserved as scratch)")
        self.num_pages = int(num_pages)
        self.page_size = int(page_size)
        free = [p for p in range(self.num_pages) if p != SCRATCH_PAGE]
        if seed is not None:
            free = list(np.random.default_rng(seed).permutation(free))
        self._free = [int(p) for p in reversed(free)]  # pop() takes from the end
        self._rows: dict[Hashable, list[int]] = {}
        self._in_use = np.zeros(self.num_pages, bool)
        self._in_use[SCRATCH_PAGE] = True

    @staticmethod
    def page_bytes(config, page_size: int, dtype=None) -> int:
        """Bytes of one page index across the cache: k and v, all layers and kv heads."""
        _check_page_size(page_size)
        itemsize = jnp.dtype(dtype or config.jnp_dtype).itemsize
        return 2 * config.num_hidden_layers * config.num_key_value_heads * page_size * config.head_dim * itemsize

    @classmethod
    def from_budget(cls, budget_bytes: int, config, page_size: int, dtype=None, **kw) -> "PageAllocator":
        """An allocator over as many pages as ``budget_bytes`` of k+v cache holds (scratch page included)."""
        per_page = cls.page_bytes(config, page_size, dtype)
        num_pages = int(budget_bytes) // per_page
        if num_pages < 2:
            raise ValueError(
                f"a budget of {budget_bytes} bytes holds {num_pages} pages of {per_page} bytes "
                f"(page_size={page_size}); need at least 2: raise the budget or lower page_size"
            )
        return cls(num_pages, page_size, **kw)

    @property
    def num_free(self) -> int:
        return len(self._free)

    def __contains__(self, row_id: Hashable) -> bool:
        return row_id in self._rows

    def _row(self, row_id: Hashable) -> list[int]:
        if row_id not in self._rows:
            raise KeyError(f"row {row_id!r} holds no pages here; known rows: {sorted(map(repr, self._rows))[:8]}")
        return self._rows[row_id]

    def pages_needed(self, tokens: int) -> int:
        return -(-int(tokens) // self.page_size)

    def ensure(self, row_id: Hashable, tokens_needed: int) -> bool:
        """Grows ``row_id``'s pages (registering a new row) until they hold ``tokens_needed`` tokens.

        Returns False, allocating nothing, when the free pages do not suffice; the
        caller then queues or preempts the row. Never shrinks a row.
        """
        if isinstance(tokens_needed, bool) or not isinstance(tokens_needed, (int, np.integer)) or tokens_needed < 0:
            raise ValueError(f"tokens_needed={tokens_needed!r} must be a non-negative int (row {row_id!r})")
        have = self._rows.get(row_id, [])
        extra = self.pages_needed(tokens_needed) - len(have)
        if extra > len(self._free):
            return False
        if extra > 0:
            new = [self._free.pop() for _ in range(extra)]
            assert not self._in_use[new].any(), f"allocator bug: pages {new} handed out twice"
            self._in_use[new] = True
            have = have + new
        self._rows[row_id] = have
        return True

    def free(self, row_id: Hashable) -> int:
        """Returns all of ``row_id``'s pages to the free list and forgets the row; the count freed."""
        pages = self._row(row_id)
        del self._rows[row_id]
        self._in_use[pages] = False
        self._free.extend(reversed(pages))
        return len(pages)

    def pages(self, row_id: Hashable) -> tuple[int, ...]:
        """``row_id``'s pages in token order."""
        return tuple(self._row(row_id))

    def table(self, row_ids: Sequence[Hashable | None], pages_per_seq: int) -> np.ndarray:
        """int32 ``[len(row_ids), pages_per_seq]`` page table, padded with `SCRATCH_PAGE`; ``None`` is an empty row."""
        out = np.full((len(row_ids), pages_per_seq), SCRATCH_PAGE, np.int32)
        for i, row_id in enumerate(row_ids):
            if row_id is None:
                continue
            pages = self._row(row_id)
            if len(pages) > pages_per_seq:
                raise ValueError(
                    f"row {row_id!r} holds {len(pages)} pages but the table has {pages_per_seq} per row; "
                    f"use pages_per_seq >= {len(pages)} (a longer bucket)"
                )
            out[i, : len(pages)] = pages
        return out

