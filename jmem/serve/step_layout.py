"""One ragged serving step laid out for the device: `build_layout` (host, numpy) gives the
`StepLayout` that `jmem.serve.paged_cache.PagedKVCache` reads inside the jitted step.

A step is a flat run of tokens from many sequences, `[(start position, num tokens, page list),
...]`. Each token gets the page and slot its K/V is written to. A sequence with several tokens (a
prefill chunk) is cut into query tiles of `TILE` rows that belong to it alone, so a tile gathers
only its own sequence's pages; a sequence with one token (a decode) is a decode row whose keys are
read in chunks of pages (`jmem.serve.paged_decode`). The same step is also described for the
ragged kernels (slot mapping, block tables, cumulative query lengths), and, for int8/fp8 pages,
as the list of pages it writes.
"""

from __future__ import annotations

import flax.struct
import jax
import numpy as np

from jmem.serve.paged_decode import chunk_pages

TILE = 8  # query rows per attention tile


@flax.struct.dataclass
class StepLayout:
    """Where each token of a ragged step writes and which tile computes its attention (all int32).

    Shapes: T flat tokens (padded), N tiles, M pages per tile.
        write_page, write_offset: [T] page and slot each token's K/V goes to (padding: a spare page).
        tile_tokens: [N, TILE] flat index of each tile row's token (padding: T, reads zeros).
        tile_positions: [N, TILE] position of each tile row (padding: -1, sees nothing).
        tile_pages: [N, M] the tile's sequence's pages (padding: the spare page).
        tile_kv_len: [N] keys valid in the tile's sequence after this step.
        tile_new_src: [N, M * page_size] flat index of the token of this step whose K/V sits at
            each key position of the tile's sequence (T where the key comes from the pages).
        token_out_row: [T] where each token's output is: `tile * TILE + row` for a tile row,
            `N * TILE + r` for decode row r.

    Decode rows (sequences with one token this step), Rd rows, Nc chunks of Mc pages:
        dec_token: [Rd] flat index of each row's token (padding: T).
        dec_pos: [Rd] its position (padding: 0).
        dec_cur_page: [Rd] the page it writes (padding: the spare page).
        dec_cur_upd: [Rd] the row of `upd_pages` that page is (padding: W).
        dec_chunk_pages: [Nc, Mc] complete pages before the written one (padding: the spare page).
        dec_chunk_len: [Nc] keys of the chunk that hold tokens (padding: 0).
        dec_chunk_row: [Nc] the decode row of each chunk (padding: Rd).

    The same step for the ragged kernels (`jmem.kernels.paged_attention`), R = rows:
        slot_mapping: [T] page * page_size + offset (padding: -1).
        seq_kv_lens: [R] keys of each sequence after this step (padding rows: 0).
        seq_pages: [R, M] block table of each sequence.
        cu_q_lens: [R + 1] prefix sums of the tokens each sequence computes.
        num_seqs: scalar, sequences in use.

    The pages this step writes, for int8/fp8 pages with per-page scales (W = min(T, T // page_size
    + 2R) bounds them: a run of n tokens touches fewer than n / page_size + 2 pages):
        upd_pages: [W] each page written (padding: the spare page).
        upd_kept: [W] its first slot written now; earlier slots hold tokens kept (padding: 0).
        token_upd: [T] the row of `upd_pages` each token's page is (padding: W).
        tile_upd: [N, M] the row of `upd_pages` of each tile page, W when the step does not write it.
    """

    write_page: jax.Array
    write_offset: jax.Array
    tile_tokens: jax.Array
    tile_positions: jax.Array
    tile_pages: jax.Array
    tile_kv_len: jax.Array
    tile_new_src: jax.Array
    token_out_row: jax.Array
    slot_mapping: jax.Array
    seq_kv_lens: jax.Array
    seq_pages: jax.Array
    cu_q_lens: jax.Array
    num_seqs: jax.Array
    upd_pages: jax.Array
    upd_kept: jax.Array
    token_upd: jax.Array
    tile_upd: jax.Array
    dec_token: jax.Array
    dec_pos: jax.Array
    dec_cur_page: jax.Array
    dec_cur_upd: jax.Array
    dec_chunk_pages: jax.Array
    dec_chunk_len: jax.Array
    dec_chunk_row: jax.Array


def decode_shape(seqs, page_size: int) -> tuple[int, int]:
    """(decode rows, chunks) of `seqs` = [(start, num tokens, pages), ...]."""
    mc = chunk_pages(page_size)
    chunks = [-(-(start // page_size) // mc) for start, n, _ in seqs if n == 1]
    return len(chunks), sum(chunks)


def build_layout(seqs, num_tokens_padded: int, num_tiles: int, pages_per_tile: int, page_size: int,
                 spare_page: int, max_seqs: int | None = None, pages_per_seq: int | None = None,
                 decode_rows: int | None = None, decode_chunks: int | None = None,
                 tiled: bool = True) -> StepLayout:
    """Host side: the layout (numpy arrays) for `seqs` = [(start position, num tokens, page list), ...] in flat order.

    Sizes (static shapes of the step; None: the least `seqs` needs): `num_tiles` and `pages_per_tile`
    for the sequences with several tokens, `pages_per_seq` (default `pages_per_tile`) for the block
    tables of all, and `decode_rows`, `decode_chunks` for the one-token sequences (`decode_shape`).
    `tiled=False` leaves the prefill tiles and decode rows as padding, for the kernel path, which
    reads only the writes and the block tables (pass sizes of 1 there).
    """
    need_rows, need_chunks = decode_shape(seqs, page_size)
    T, N, M = num_tokens_padded, num_tiles, pages_per_tile
    Rd, Nc = max(1, decode_rows or need_rows), max(1, decode_chunks or need_chunks)
    Mc = chunk_pages(page_size)
    R = max_seqs or len(seqs)
    slot_mapping = np.full(T, -1, np.int32)
    seq_kv_lens = np.zeros(R, np.int32)
    seq_pages = np.full((R, max(M, pages_per_seq or M)), spare_page, np.int32)
    cu_q_lens = np.zeros(R + 1, np.int32)
    write_page = np.full(T, spare_page, np.int32)
    write_offset = np.zeros(T, np.int32)
    tile_tokens = np.full((N, TILE), T, np.int32)
    tile_positions = np.full((N, TILE), -1, np.int32)
    tile_pages = np.full((N, M), spare_page, np.int32)
    tile_kv_len = np.zeros(N, np.int32)
    tile_new_src = np.full((N, M * page_size), T, np.int32)
    token_out_row = np.zeros(T, np.int32)
    W = max(1, min(T, T // page_size + 2 * R))
    upd_pages = np.full(W, spare_page, np.int32)
    upd_kept = np.zeros(W, np.int32)
    token_upd = np.full(T, W, np.int32)
    tile_upd = np.full((N, M), W, np.int32)
    dec_token = np.full(Rd, T, np.int32)
    dec_pos = np.zeros(Rd, np.int32)
    dec_cur_page = np.full(Rd, spare_page, np.int32)
    dec_cur_upd = np.full(Rd, W, np.int32)
    dec_chunk_pages = np.full((Nc, Mc), spare_page, np.int32)
    dec_chunk_len = np.zeros(Nc, np.int32)
    dec_chunk_row = np.full(Nc, Rd, np.int32)
    if tiled and (need_rows > Rd or need_chunks > Nc):
        raise ValueError(f"decode sizes ({Rd}, {Nc}) too small for the step's ({need_rows}, {need_chunks})")
    t = tile = w = d = c = 0
    for i, (start, n, pages) in enumerate(seqs):
        pos = np.arange(start, start + n)
        pages = np.asarray(pages, np.int32)
        n_pages = -(-(start + n) // page_size)
        if n:
            first, last = start // page_size, (start + n - 1) // page_size
            rows = np.arange(w, w + last - first + 1)
            upd_pages[rows] = pages[first : last + 1]
            upd_kept[w] = start % page_size
            token_upd[t : t + n] = w + pos // page_size - first
            w += len(rows)
        write_page[t : t + n] = pages[pos // page_size]
        write_offset[t : t + n] = pos % page_size
        slot_mapping[t : t + n] = write_page[t : t + n] * page_size + write_offset[t : t + n]
        seq_kv_lens[i] = start + n
        seq_pages[i, :n_pages] = pages[:n_pages]
        cu_q_lens[i + 1] = cu_q_lens[i] + n
        if tiled and n == 1:
            dec_token[d], dec_pos[d] = t, start
            dec_cur_page[d], dec_cur_upd[d] = write_page[t], token_upd[t]
            complete = pages[: start // page_size]
            for j in range(0, len(complete), Mc):
                part = complete[j : j + Mc]
                dec_chunk_pages[c, : len(part)] = part
                dec_chunk_len[c] = len(part) * page_size
                dec_chunk_row[c] = d
                c += 1
            token_out_row[t] = N * TILE + d
            d += 1
        elif tiled and n:
            seq_upd = np.full(M, W, np.int32)
            seq_upd[first : last + 1] = rows
            for j in range(0, n, TILE):
                k = min(TILE, n - j)
                tile_tokens[tile, :k] = np.arange(t + j, t + j + k)
                tile_positions[tile, :k] = pos[j : j + k]
                tile_pages[tile, :n_pages] = pages[:n_pages]
                tile_upd[tile] = seq_upd
                tile_kv_len[tile] = start + n
                token_out_row[t + j : t + j + k] = tile * TILE + np.arange(k)
                tile_new_src[tile, start : start + n] = np.arange(t, t + n)
                tile += 1
        t += n
    cu_q_lens[len(seqs) + 1 :] = cu_q_lens[len(seqs)]
    # numpy arrays: the jitted step moves them to the device in one batched transfer, where one
    # jnp.asarray per field cost a dispatch each (2.7 ms a step for the 24 fields on a CPU).
    return StepLayout(
        write_page, write_offset, tile_tokens, tile_positions, tile_pages, tile_kv_len, tile_new_src, token_out_row,
        slot_mapping, seq_kv_lens, seq_pages, cu_q_lens, np.int32(len(seqs)), upd_pages, upd_kept, token_upd,
        tile_upd, dec_token, dec_pos, dec_cur_page, dec_cur_upd, dec_chunk_pages, dec_chunk_len, dec_chunk_row)


def tiles_needed(seq_lens) -> int:
    """Query tiles of the sequences with several tokens (one-token sequences are decode rows)."""
    return sum(-(-n // TILE) for n in seq_lens if n > 1)
