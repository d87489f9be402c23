"""Split-K paged decode attention with a guarded page table and guarded sequence lengths.

One query token per sequence attends over its cached keys and values (GQA, MQA and MHA)::

    out[b, h] = softmax(scale * q[b, h] . K[b, t, h // G]) @ V[b, t, h // G]   over t < seq_lens[b]

with ``G = Hq // Hkv`` query heads per KV head, token ``t`` of sequence ``b`` stored in page
``block_table[b, t // block_size]`` at slot ``t % block_size``. Caches are ``[num_pages, block_size, Hkv, D]`` (the
paged "NHD" layout of vLLM's and FlashAttention's decode paths), K and V separately; ``q`` and ``out`` are
``[B, Hq, D]``, bfloat16 or float16. Scores, the softmax and the accumulator are float32; the probabilities are
rounded to the cache dtype for the P @ V product (as every flash-attention kernel does).

Work split: one program per (sequence, KV head, split) reads its split's K/V pages of that KV head ONCE for all G
query heads of the group (a ``[G, D] x [D, tokens]`` dot). Splits partition the table's columns into page-aligned
chunks. With a workspace (:func:`alloc_workspace`, ``num_splits > 1``) each split writes its normalised partial
output and log-sum-exp and a reduce kernel combines them; without one, the single split writes ``out`` directly.

Guards (two sites; a launch takes their ``[2, 8]`` counter block):

* ``kernels.decode_attention.page``: each page id of a sequence's USED pages (columns ``< cdiv(seq_len,
  block_size)``; the rest of a row is padding and is neither read nor checked) against ``[0, num_pages)``. A bad
  page contributes nothing: its tokens are left out of the softmax as if they did not exist. Recorded ONCE per bad
  entry, as (row ``b``, value the page id): each entry belongs to one split, is one lane of that split's check, and
  of the KV-head programs reading it only the first one counts (``guard_index(..., count=pid_head == 0)``).
* ``kernels.decode_attention.seq_len``: ``seq_lens[b]`` against ``[0, W * block_size]`` (``W`` = the table's
  width). A bad length masks the whole sequence: its output is zeros and its pages are neither read nor checked.
  Recorded once, as (row ``b``, value the length).

A sequence whose every page is bad (or whose length is 0) gets zeros, never NaN: the softmax's running max starts
at -inf and an all-masked split keeps l = 0 and log-sum-exp = -inf, which the reduce weighs as 0.

Hot path: before its loop a program checks its split's page ids in one vector (one reduction, no atomics); the loop
then runs exactly the unguarded twin's code, reading the same ids again (cache hits: the twin's first DRAM read of
them is the check's). Only a split holding a bad id takes the fault path: it records the split's bad entries and
runs a masked loop (small tiles, not pipelined, so that it needs no more registers than the hot loop). The guard
costs one reduction per program, not a compare-and-mask per tile.

Neither site is fatal: the kernel reads the cache and writes only ``out`` (a wrong answer for that sequence, which
the report calls a masked fault), nothing durable.

Request map (optional): ``requests[b]``, the request of sequence ``b``, kept with the offenders of both sites; read
only on the fault path (a split that holds a bad page, a bad length).
"""

from __future__ import annotations

import math

import torch
import triton
import triton.language as tl

from ..sites import register_site
from ..triton import guard_index, record_hit
from ._common import INDEX_DTYPES, check_fake_ctr, check_requests, check_same_device, check_tensor, pow2, resolve_ctr
from ._decode_splits import Config, Workspace, _block_h, alloc_workspace, default_splits

__all__ = [
    "DTYPES",
    "SITES",
    "SITE_PAGE",
    "SITE_SEQ_LEN",
    "Config",
    "Workspace",
    "decode_attention",
    "decode_attention_reference",
    "default_splits",
    "alloc_workspace",
    "decode_attention_op",
]

SITE_PAGE = register_site(
    "kernels.decode_attention.page",
    description="decode attention: a used page id of the page table vs the KV cache's pages "
    "(row = sequence, value = page id; counted once per entry)",
)
SITE_SEQ_LEN = register_site(
    "kernels.decode_attention.seq_len",
    description="decode attention: a sequence length vs the page table's width x block size "
    "(row = sequence, value = length; the sequence is masked)",
)
# Counter rows in kernel order: ``ctr[k]`` is SITES[k]'s row.
SITES = (SITE_PAGE, SITE_SEQ_LEN)

DTYPES = (torch.bfloat16, torch.float16)
_LOG2E = 1.4426950408889634
# Tokens per tile on the fault path (the smallest N of a tensor-core dot; see _decode_split).
_FAULT_BLOCK_N = 16


@triton.jit
def _attend(
    acc,
    m_i,
    l_i,
    q,
    k_ptr,
    v_ptr,
    row_ptr,
    tok_lo,
    tok_hi,
    hk,
    Hkv,
    N,
    qk_scale,
    BS: tl.constexpr,
    BLOCK_N: tl.constexpr,
    D: tl.constexpr,
    STAGES: tl.constexpr,
    MASKED: tl.constexpr,
    DOT_F32: tl.constexpr,
):
    """Online softmax over tokens [tok_lo, tok_hi) of one sequence and KV head, for a [BLOCK_H, D] query tile.
    MASKED=False trusts every page id (the twin, and the guarded hot path after its check); MASKED=True masks the
    tokens of bad pages (the fault path)."""
    offs_n = tl.arange(0, BLOCK_N)
    offs_d = tl.arange(0, D)
    for start in tl.range(tok_lo, tok_hi, BLOCK_N, num_stages=STAGES):
        tok = start + offs_n
        live = tok < tok_hi
        page = tl.load(row_ptr + tok // BS, mask=live, other=0).to(tl.int64)
        if MASKED:
            live = live & (page >= 0) & (page < N)
            page = tl.where(live, page, 0)
        # Element offset of (page, slot, KV head): int64, since it exceeds int32 for caches over 2**31 elements (and
        # for the twin's wild ids); scaled by the constexpr D last, so the compiler sees every row start aligned to
        # D elements and vectorises the loads (16-byte copies into shared memory) whatever the runtime strides.
        kv = (((page * BS + tok % BS) * Hkv + hk) * D)[:, None] + offs_d[None, :]
        k = tl.load(k_ptr + kv, mask=live[:, None], other=0.0)
        if DOT_F32:
            # CPU only: the interpreter's tl.dot mis-reads bfloat16 operands; widening them to float32 is exact.
            s = tl.dot(q.to(tl.float32), tl.trans(k.to(tl.float32)))
        else:
            s = tl.dot(q, tl.trans(k))
        s = tl.where(live[None, :], s * qk_scale, float("-inf"))
        m_new = tl.maximum(m_i, tl.max(s, 1))
        if MASKED:
            # A tile (and everything before it) fully masked leaves m at -inf: subtract 0 instead, so that
            # exp2(-inf - -inf) = NaN never happens; p and alpha are then exp2(-inf) = 0.
            m_use = tl.where(m_new == float("-inf"), 0.0, m_new)
        else:
            # Every tile holds at least one live token (start < tok_hi), so m_new is finite here.
            m_use = m_new
        alpha = tl.exp2(m_i - m_use)
        p = tl.exp2(s - m_use[:, None])
        l_i = l_i * alpha + tl.sum(p, 1)
        v = tl.load(v_ptr + kv, mask=live[:, None], other=0.0)
        if DOT_F32:
            pv = tl.dot(p.to(v.dtype).to(tl.float32), v.to(tl.float32))
        else:
            pv = tl.dot(p.to(v.dtype), v)
        acc = acc * alpha[:, None] + pv
        m_i = m_new
    return acc, m_i, l_i


@triton.jit
def _record_pages(ctr_ptr, row_ptr, b, pid_h, first_page, end_page, N, req, BLOCK_P: tl.constexpr):
    """Count the bad ids among page columns [first_page, end_page) of a sequence's row (a split's used pages): one
    lane per entry, and of the KV-head programs reading them only the first counts; splits partition the columns,
    so each bad entry counts once (row = the sequence, value = the id, request = ``req``: the sequence's or None)."""
    for c in tl.range(first_page, end_page, BLOCK_P, num_stages=1):
        cols = c + tl.arange(0, BLOCK_P)
        cm = cols < end_page
        ids = tl.load(row_ptr + cols, mask=cm, other=0)
        guard_index(ids, 0, N, ctr_ptr, b, mask=cm, count=pid_h == 0, req=req)


@triton.jit
def _decode_split(
    q_ptr,
    k_ptr,
    v_ptr,
    table_ptr,
    lens_ptr,
    out_ptr,
    pout_ptr,
    plse_ptr,
    ctr_ptr,
    req_ptr,
    W,
    N,
    Hq,
    S,
    pages_per_split,
    qk_scale,
    Hkv,
    G: tl.constexpr,
    BLOCK_H: tl.constexpr,
    HEAD_TILES: tl.constexpr,
    BS: tl.constexpr,
    BLOCK_N: tl.constexpr,
    BLOCK_P: tl.constexpr,
    D: tl.constexpr,
    STAGES: tl.constexpr,
    SPLIT: tl.constexpr,
    GUARD: tl.constexpr,
    DOT_F32: tl.constexpr,
    FAULT_BLOCK_N: tl.constexpr,
    HAS_REQ: tl.constexpr,
):
    b = tl.program_id(0)
    pid_h = tl.program_id(1)  # KV head * HEAD_TILES + head tile
    s = tl.program_id(2)
    hk = pid_h // HEAD_TILES
    ht = pid_h % HEAD_TILES
    n = tl.load(lens_ptr + b).to(tl.int64)
    if GUARD:
        len_ok = (n >= 0) & (n <= W * BS)
        # Every (head, split) program of the sequence sees the bad length; one of them records it.
        if (len_ok == 0) & (pid_h == 0) & (s == 0):
            req = None  # the request is read on the fault path only
            if HAS_REQ:
                req = tl.load(req_ptr + b)
            record_hit(ctr_ptr + 8, b, n, req)
        n = tl.where(len_ok, n, 0)
    n32 = n.to(tl.int32)  # guarded: n <= W * BS < 2**31 (the launcher checks the product)
    tok_lo = s * pages_per_split * BS
    tok_hi = tl.minimum(tok_lo + pages_per_split * BS, n32)

    g = ht * BLOCK_H + tl.arange(0, BLOCK_H)  # query head within the KV group
    hm = g < G
    head = hk * G + g
    offs_d = tl.arange(0, D)
    q_rows = (b * Hq + head).to(tl.int64)
    q = tl.load(q_ptr + q_rows[:, None] * D + offs_d[None, :], mask=hm[:, None], other=0.0)
    acc = tl.zeros([BLOCK_H, D], dtype=tl.float32)
    m_i = tl.full([BLOCK_H], float("-inf"), dtype=tl.float32)
    l_i = tl.zeros([BLOCK_H], dtype=tl.float32)
    row_ptr = table_ptr + b.to(tl.int64) * W

    hot = True
    if GUARD:
        # The split's used page ids, checked as one vector (an entry per lane) with one reduction, before the loop
        # reads them again (cache hits: no extra DRAM traffic). No atomics and no recording here: that is the
        # fault path's.
        n_bad = tl.zeros([], dtype=tl.int32)
        pg_hi = (tok_hi + BS - 1) // BS
        for c in tl.range(s * pages_per_split, pg_hi, BLOCK_P, num_stages=1):
            cols = c + tl.arange(0, BLOCK_P)
            cm = cols < pg_hi
            ids = tl.load(row_ptr + cols, mask=cm, other=0)
            n_bad += tl.sum((cm & ((ids < 0) | (ids >= N))).to(tl.int32), axis=0)
        hot = n_bad == 0
        if not hot:
            # The fault path: count the split's bad entries once, then attend with their tokens masked. Small tiles,
            # not pipelined: registers are allocated for the kernel's worst path, so a fault loop shaped like the
            # hot one would raise the guarded kernel's count above the twin's and cost the hot path occupancy
            # (tests/kernels/test_decode_attention.py checks the sm_90 build).
            req = None
            if HAS_REQ:
                req = tl.load(req_ptr + b)
            _record_pages(ctr_ptr, row_ptr, b, pid_h, s * pages_per_split, pg_hi, N, req, BLOCK_P)
            acc, m_i, l_i = _attend(acc, m_i, l_i, q, k_ptr, v_ptr, row_ptr, tok_lo, tok_hi, hk, Hkv, N, qk_scale,
                                    BS, FAULT_BLOCK_N, D, 1, True, DOT_F32)  # fmt: skip
    if hot:
        # The twin's loop, and the guarded hot path once its pages checked out.
        acc, m_i, l_i = _attend(acc, m_i, l_i, q, k_ptr, v_ptr, row_ptr, tok_lo, tok_hi, hk, Hkv, N, qk_scale,
                                BS, BLOCK_N, D, STAGES, False, DOT_F32)  # fmt: skip

    # l = 0: nothing attended (empty split, masked sequence, every page bad): output 0, log-sum-exp -inf.
    seen = l_i > 0
    o = acc / tl.where(seen, l_i, 1.0)[:, None]
    if SPLIT:
        part = q_rows * S + s
        tl.store(pout_ptr + part[:, None] * D + offs_d[None, :], o, mask=hm[:, None])
        tl.store(plse_ptr + part, tl.where(seen, m_i + tl.log2(tl.where(seen, l_i, 1.0)), float("-inf")), mask=hm)
    else:
        tl.store(out_ptr + q_rows[:, None] * D + offs_d[None, :], o.to(out_ptr.dtype.element_ty), mask=hm[:, None])


@triton.jit
def _decode_reduce(pout_ptr, plse_ptr, out_ptr, S, D: tl.constexpr, BLOCK_S: tl.constexpr):
    """out[row] = the splits' partial outputs weighted by exp2(lse - max lse); rows with no split attended: 0."""
    row = tl.program_id(0).to(tl.int64)  # b * Hq + h
    offs_s = tl.arange(0, BLOCK_S)
    sm = offs_s < S
    lse = tl.load(plse_ptr + row * S + offs_s, mask=sm, other=float("-inf"))
    mx = tl.max(lse, 0)
    mx = tl.where(mx == float("-inf"), 0.0, mx)  # every split empty: weights exp2(-inf) = 0, not NaN
    w = tl.exp2(lse - mx)
    den = tl.sum(w, 0)
    offs_d = tl.arange(0, D)
    used = sm & (w > 0)
    part = tl.load(pout_ptr + (row * S + offs_s)[:, None] * D + offs_d[None, :], mask=used[:, None], other=0.0)
    o = tl.sum(part * w[:, None], 0) / tl.where(den > 0, den, 1.0)
    tl.store(out_ptr + row * D + offs_d, o.to(out_ptr.dtype.element_ty))


def decode_attention(
    q: torch.Tensor,
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    block_table: torch.Tensor,
    seq_lens: torch.Tensor,
    out: torch.Tensor,
    *,
    workspace: Workspace | None = None,
    scale: float | None = None,
    guard: bool = True,
    ctr: torch.Tensor | None = None,
    config: Config | None = None,
    requests: torch.Tensor | None = None,
) -> torch.Tensor:
    """Paged decode attention of one query token per sequence into ``out`` (see the module docstring).

    Args:
        q: bfloat16/float16 ``[B, Hq, D]``, ``D`` a power of two in [16, 256].
        k_cache, v_cache: ``q``'s dtype, ``[num_pages, block_size, Hkv, D]``, ``Hq % Hkv == 0``, ``block_size`` a
            power of two.
        block_table: int32/int64 ``[B, W]``: sequence ``b``'s pages; columns past its length are not read.
        seq_lens: int32/int64 ``[B]``, tokens per sequence (``0 <= len <= W * block_size``).
        out: ``q``'s dtype and shape; fully written.
        workspace: the split-K partials from :func:`alloc_workspace` (their split count is the launch's); None = one
            split per sequence, written straight into ``out``.
        scale: the softmax scale (default ``1 / sqrt(D)``).
        guard: False launches the unguarded twin (benchmarks and the sanitizer control only).
        ctr: int64 ``[2, 8]``, the counter rows of :data:`SITES` (default: the default monitor's).
        config: the split kernel's :class:`Config` (default ``Config()``).
        requests: int32/int64 ``[B]``, the request id of each sequence (row ``b``), kept with its offenders; None:
            requests not known.

    No sync, no allocation: capture-safe once the counters and the workspace exist.
    """
    check_tensor("q", q, dtypes=DTYPES, ndim=3)
    B, Hq, D = q.shape
    check_tensor("k_cache", k_cache, dtypes=(q.dtype,), ndim=4)
    N, BS, Hkv, Dk = k_cache.shape
    if Dk != D:
        raise ValueError(f"k_cache's head size {Dk} differs from q's {D}")
    check_tensor("v_cache", v_cache, dtypes=(q.dtype,), shape=tuple(k_cache.shape))
    if D < 16 or D > 256 or D & (D - 1):
        raise ValueError(f"the head size must be a power of two in [16, 256], got {D}")
    if BS < 1 or BS & (BS - 1):
        raise ValueError(f"the block size (k_cache.shape[1]) must be a power of two, got {BS}")
    if Hkv < 1 or Hq % Hkv:
        raise ValueError(f"q's {Hq} heads must be a multiple of the caches' {Hkv} KV heads")
    check_tensor("block_table", block_table, dtypes=INDEX_DTYPES, ndim=2)
    if block_table.shape[0] != B:
        raise ValueError(f"block_table must have one row per sequence ({B}), got shape {list(block_table.shape)}")
    W = block_table.shape[1]
    check_tensor("seq_lens", seq_lens, dtypes=INDEX_DTYPES, shape=(B,))
    check_tensor("out", out, dtypes=(q.dtype,), shape=(B, Hq, D))
    if W * BS >= 2**31:
        raise ValueError(f"the page table covers {W} x {BS} tokens per sequence; at most 2**31 - 1 are supported")
    if scale is None:
        scale = 1.0 / math.sqrt(D)
    if isinstance(scale, bool) or not isinstance(scale, (int, float)) or not math.isfinite(scale):
        raise ValueError(f"scale must be a finite float, got {scale!r}")
    cfg = Config() if config is None else config
    if not isinstance(cfg, Config):
        raise TypeError(f"config must be a decode_attention.Config, got {type(cfg).__name__}")
    tensors = dict(q=q, k_cache=k_cache, v_cache=v_cache, block_table=block_table, seq_lens=seq_lens, out=out)
    if workspace is not None:
        if not isinstance(workspace, tuple) or len(workspace) != 2:
            raise TypeError("workspace must be a decode_attention.Workspace (out, lse), from alloc_workspace()")
        pout, plse = workspace
        check_tensor("workspace.out", pout, dtypes=(torch.float32,), ndim=4)
        S = pout.shape[2]
        check_tensor("workspace.out", pout, dtypes=(torch.float32,), shape=(B, Hq, S, D))
        check_tensor("workspace.lse", plse, dtypes=(torch.float32,), shape=(B, Hq, S))
        tensors.update(workspace_out=pout, workspace_lse=plse)
    else:
        S = 1
        pout = plse = out  # never touched when SPLIT is off; any pointer of the device will do
    dev = check_same_device(**tensors)
    c = resolve_ctr("ctr", SITES, ctr, dev)
    req = check_requests(requests, B, "sequence", dev)
    if B == 0:
        return out
    G = Hq // Hkv
    block_h = _block_h(G)
    head_tiles = triton.cdiv(G, block_h)
    tile_pages = max(1, cfg.block_n // BS)
    # Page-aligned splits, whole tiles each: every page belongs to exactly one split (so it is checked, and
    # counted, once), and only a sequence's last tile is partial.
    pages_per_split = triton.cdiv(triton.cdiv(max(W, 1), S), tile_pages) * tile_pages
    _decode_split[(B, Hkv * head_tiles, S)](
        q,
        k_cache,
        v_cache,
        block_table,
        seq_lens,
        out,
        pout,
        plse,
        c,
        c if req is None else req,  # never read without HAS_REQ
        W,
        N,
        Hq,
        S,
        pages_per_split,
        float(scale) * _LOG2E,
        Hkv,
        G=G,
        BLOCK_H=block_h,
        HEAD_TILES=head_tiles,
        BS=BS,
        BLOCK_N=cfg.block_n,
        BLOCK_P=pow2(pages_per_split, hi=256),
        D=D,
        STAGES=cfg.num_stages,
        SPLIT=workspace is not None,
        GUARD=bool(guard),
        # Tensors on the CPU run in the interpreter (see _attend).
        DOT_F32=dev.type == "cpu",
        FAULT_BLOCK_N=_FAULT_BLOCK_N,
        HAS_REQ=req is not None,
        num_warps=cfg.num_warps,
    )
    if workspace is not None:
        _decode_reduce[(B * Hq,)](pout, plse, out, S, D=D, BLOCK_S=pow2(S), num_warps=4)
    return out


def decode_attention_reference(
    q: torch.Tensor,
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    block_table: torch.Tensor,
    seq_lens: torch.Tensor,
    scale: float | None = None,
) -> tuple[torch.Tensor, list[tuple[int, int]], list[tuple[int, int]]]:
    """Torch reference in float32 (tests): ``(out, page_hits, len_hits)``, hits as (sequence, value) pairs in
    (sequence, column) order. Bad pages' tokens are left out; a bad length or an empty sequence gives zeros."""
    B, Hq, D = q.shape
    _, BS, Hkv, _ = k_cache.shape
    G = Hq // Hkv
    W = block_table.shape[1]
    scale = 1.0 / math.sqrt(D) if scale is None else scale
    qf, kf, vf = (x.detach().cpu().float() for x in (q, k_cache, v_cache))
    table = block_table.cpu().tolist()
    out = torch.zeros(B, Hq, D)
    page_hits: list[tuple[int, int]] = []
    len_hits: list[tuple[int, int]] = []
    for b, n in enumerate(seq_lens.cpu().tolist()):
        if not 0 <= n <= W * BS:
            len_hits.append((b, n))
            continue
        toks = []
        for p in range(-(-n // BS)):
            page = table[b][p]
            if not 0 <= page < k_cache.shape[0]:
                page_hits.append((b, page))
                continue
            toks += [(page, t % BS) for t in range(p * BS, min(n, (p + 1) * BS))]
        if not toks:
            continue
        pages = torch.tensor([pg for pg, _ in toks])
        slots = torch.tensor([sl for _, sl in toks])
        k = kf[pages, slots].repeat_interleave(G, dim=1)  # [T, Hq, D]
        v = vf[pages, slots].repeat_interleave(G, dim=1)
        scores = torch.einsum("hd,thd->ht", qf[b], k) * scale
        out[b] = torch.einsum("ht,thd->hd", torch.softmax(scores, dim=-1), v)
    return out.to(q.dtype), page_hits, len_hits


# The custom op (torch.ops.tripwire.decode_attention, for torch.compile: tripwire.kernels.ops has the contract).
@torch.library.custom_op("tripwire::decode_attention", mutates_args=("out", "partial_out", "partial_lse", "ctr"))
def decode_attention_op(
    q: torch.Tensor,
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    block_table: torch.Tensor,
    seq_lens: torch.Tensor,
    out: torch.Tensor,
    partial_out: torch.Tensor | None,
    partial_lse: torch.Tensor | None,
    ctr: torch.Tensor,
    scale: float = -1.0,
    guard: bool = True,
    requests: torch.Tensor | None = None,
) -> None:
    decode_attention(
        q,
        k_cache,
        v_cache,
        block_table,
        seq_lens,
        out,
        workspace=_workspace(partial_out, partial_lse),
        scale=None if scale < 0 else scale,
        guard=guard,
        ctr=ctr,
        requests=requests,
    )


def _workspace(partial_out: torch.Tensor | None, partial_lse: torch.Tensor | None) -> Workspace | None:
    if (partial_out is None) != (partial_lse is None):
        raise ValueError("partial_out and partial_lse are the workspace's two tensors: pass both or neither")
    return None if partial_out is None else Workspace(partial_out, partial_lse)  # type: ignore[arg-type]


@decode_attention_op.register_fake
def _(
    q,
    k_cache,
    v_cache,
    block_table,
    seq_lens,
    out,
    partial_out,
    partial_lse,
    ctr,
    scale=-1.0,
    guard=True,
    requests=None,
):  # type: ignore[no-untyped-def]
    if tuple(out.shape) != tuple(q.shape) or out.dtype != q.dtype:
        raise ValueError(f"out must be {q.dtype} {list(q.shape)}")
    ws = _workspace(partial_out, partial_lse)
    if ws is not None and (tuple(ws.out.shape[:2]) != tuple(q.shape[:2]) or ws.out.dtype != torch.float32):
        raise ValueError(f"partial_out must be float32 [{q.shape[0]}, {q.shape[1]}, splits, {q.shape[2]}]")
    check_fake_ctr(ctr, len(SITES))
