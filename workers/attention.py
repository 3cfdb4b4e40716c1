"""Paged attention over a flat, variable-length batch, in plain torch.

A step's tokens are laid out flat: first the single-token chunks (decodes), then the
multi-token chunks (prefill pieces) one after another. Every token's K/V is written into
its cache slot (slot = block * block_size + offset). Decodes attend in one batched call over
their gathered, padded contexts; each prefill chunk attends causally to its earlier context
(read back from the cache) plus itself.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import torch
import torch.nn.functional as F


@dataclass
class PrefillSpan:
    start: int  # first flat token index of the chunk
    end: int
    context_slots: torch.Tensor | None  # slots of all ctx tokens incl. this chunk, or None
    mask: torch.Tensor | None  # [n, ctx] bool, True = attend; None = plain causal


@dataclass
class AttentionMetadata:
    slot_mapping: torch.Tensor  # [T] cache slot of every token in the batch
    num_decode_tokens: int = 0
    decode_blocks: torch.Tensor | None = None  # [Nd * nb] block ids to gather (padded)
    decode_num_blocks: int = 0  # nb: blocks gathered per decode sequence
    decode_mask: torch.Tensor | None = None  # [Nd, 1, 1, nb * block_size] bool
    prefills: list[PrefillSpan] = field(default_factory=list)


def build_metadata(
    chunks: list[tuple[list[int], int, int]], block_size: int, device: torch.device
) -> AttentionMetadata:
    """chunks: (block table, start position, num tokens), decodes (num tokens 1) first."""
    slot_mapping: list[int] = []
    decode_ctx: list[int] = []
    decode_tables: list[list[int]] = []
    prefills: list[PrefillSpan] = []
    flat = 0
    for table, start, n in chunks:
        slot_mapping.extend(
            table[p // block_size] * block_size + p % block_size for p in range(start, start + n)
        )
        if n == 1:
            decode_ctx.append(start + 1)
            decode_tables.append(table)
        else:
            ctx = start + n
            if start == 0:
                prefills.append(PrefillSpan(flat, flat + n, None, None))
            else:
                t = torch.tensor(table[: (ctx + block_size - 1) // block_size], dtype=torch.long)
                pos = torch.arange(ctx)
                slots = (t[pos // block_size] * block_size + pos % block_size).to(device)
                q_pos = torch.arange(start, ctx).unsqueeze(1)
                mask = (pos.unsqueeze(0) <= q_pos).to(device)
                prefills.append(PrefillSpan(flat, flat + n, slots, mask))
        flat += n
    meta = AttentionMetadata(
        slot_mapping=torch.tensor(slot_mapping, dtype=torch.long, device=device),
        num_decode_tokens=len(decode_ctx),
        prefills=prefills,
    )
    if decode_ctx:
        nb = (max(decode_ctx) + block_size - 1) // block_size
        flat_blocks: list[int] = []
        for t in decode_tables:
            row = t[:nb]
            flat_blocks.extend(row + [0] * (nb - len(row)))
        pos = torch.arange(nb * block_size)
        lens = torch.tensor(decode_ctx, dtype=torch.long)
        mask = pos.unsqueeze(0) < lens.unsqueeze(1)
        meta.decode_blocks = torch.tensor(flat_blocks, dtype=torch.long, device=device)
        meta.decode_num_blocks = nb
        meta.decode_mask = mask[:, None, None, :].to(device)
    return meta


def paged_attention(
    q: torch.Tensor,  # [T, H, D]
    k: torch.Tensor,  # [T, Hkv, D]
    v: torch.Tensor,
    k_cache: torch.Tensor,  # [slots, Hkv, D], slot = block * block_size + offset
    v_cache: torch.Tensor,
    block_size: int,
    meta: AttentionMetadata,
    scale: float,
    compute_dtype: torch.dtype | None = None,
) -> torch.Tensor:
    """Write this step's K/V into the cache, then attend; returns [T, H, D].

    compute_dtype (e.g. float32 for bfloat16 caches on CPUs without BF16 instructions) is the
    dtype attention runs in; the cache keeps its own dtype."""
    k_cache.index_copy_(0, meta.slot_mapping, k)
    v_cache.index_copy_(0, meta.slot_mapping, v)
    out = torch.empty_like(q)
    cd = compute_dtype or q.dtype

    def sdpa(qs, ks, vs, **kw):
        o = F.scaled_dot_product_attention(qs.to(cd), ks.to(cd), vs.to(cd), scale=scale,
                                           enable_gqa=True, **kw)
        return o.to(q.dtype)

    nd = meta.num_decode_tokens
    if nd:
        hkv, d = k_cache.shape[1], k_cache.shape[2]
        shape = (nd, meta.decode_num_blocks * block_size, hkv, d)
        # Whole blocks with index_select: contiguous copies, far cheaper than per-slot indexing.
        kd = k_cache.view(-1, block_size, hkv, d).index_select(0, meta.decode_blocks)
        vd = v_cache.view(-1, block_size, hkv, d).index_select(0, meta.decode_blocks)
        kd = kd.view(shape).transpose(1, 2)  # [Nd, Hkv, L, D]
        vd = vd.view(shape).transpose(1, 2)
        out[:nd] = sdpa(q[:nd].unsqueeze(2), kd, vd, attn_mask=meta.decode_mask).squeeze(2)
    for span in meta.prefills:
        qs = q[span.start:span.end].transpose(0, 1).unsqueeze(0)  # [1, H, n, D]
        if span.context_slots is None:
            ks = k[span.start:span.end].transpose(0, 1).unsqueeze(0)
            vs = v[span.start:span.end].transpose(0, 1).unsqueeze(0)
            o = sdpa(qs, ks, vs, is_causal=True)
        else:
            ks = k_cache.index_select(0, span.context_slots).transpose(0, 1).unsqueeze(0)
            vs = v_cache.index_select(0, span.context_slots).transpose(0, 1).unsqueeze(0)
            o = sdpa(qs, ks, vs, attn_mask=span.mask)
        out[span.start:span.end] = o.squeeze(0).transpose(0, 1)
    return out
