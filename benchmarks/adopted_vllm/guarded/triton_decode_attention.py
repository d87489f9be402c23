# SPDX-License-Identifier: Apache-2.0
# SPDX-FileCopyrightText: Copyright contributors to the vLLM project

# Adapted from
# https://github.com/sgl-project/sglang/blob/9f635ea50de920aa507f486daafba26a5b837574/python/sglang/srt/layers/attention/triton_ops/decode_attention.py
# which was originally adapted from
# https://github.com/ModelTC/lightllm/blob/96353e868a840db4d103138caf15ed9dbea8c186/lightllm/models/deepseek2/triton_kernel/gqa_flash_decoding_stage1.py
# https://github.com/ModelTC/lightllm/blob/96353e868a840db4d103138caf15ed9dbea8c186/lightllm/models/deepseek2/triton_kernel/gqa_flash_decoding_stage2.py

# Changes:
# - Add support for page size >= 1.

# Copyright 2025 vLLM Team
# Copyright 2023-2024 SGLang Team
# Licensed under the Apache License, Version 2.0 (the "License");
# you may not use this file except in compliance with the License.
# You may obtain a copy of the License at
#
#     http://www.apache.org/licenses/LICENSE-2.0
#
# Unless required by applicable law or agreed to in writing, software
# distributed under the License is distributed on an "AS IS" BASIS,
# WITHOUT WARRANTIES OR CONDITIONS OF ANY KIND, either express or implied.
# See the License for the specific language governing permissions and
# limitations under the License.
# ==============================================================================
"""Memory-efficient attention for decoding.
It supports page size >= 1.

tripwire: vLLM's kernels guarded by following docs/guarding.md: derived from vLLM 0.32.0's
vllm/v1/attention/ops/triton_decode_attention.py (Apache-2.0: ../LICENSE-vllm, ../NOTICE), changed where marked
"tripwire" (the diff against that file is the guard). The
page ids read from the block table are checked against the KV pool and each sequence length against the table's
width; a bad entry is masked (its tokens take no weight), counted once per entry (not per token lane, head program
or split). Each split's page ids are checked once before its loop (tripwire.triton.any_outside); the kernels then
run vLLM's own loop for a clean split and a masking copy for a split with a bad id (the MHA kernel's out of line,
_masked_split). The fault path (one out-of-line call at the end of the program) reads the block table again to
record.
"""

import logging

import torch
from packaging import version

from vllm.platforms import current_platform
from vllm.triton_utils import tl, triton

import tripwire
from tripwire.kernels import counters
from tripwire.triton import any_outside, record_hit

# Adjacent rows (the kernels reach the length site at Ctr + 8).
SITE_PAGE = tripwire.register_site(
    "adopted.vllm_decode.page", description="decode attention: a used page id vs the KV pool (row = the sequence)"
)
SITE_LEN = tripwire.register_site(
    "adopted.vllm_decode.seq_len",
    description="decode attention: a sequence length vs the block table's width x page size (row = the sequence)",
)
SITES = (SITE_PAGE, SITE_LEN)

is_hip_ = current_platform.is_rocm()

logger = logging.getLogger(__name__)

# Only print the following warnings when triton version < 3.2.0.
# The issue won't affect performance or accuracy.
if version.parse(triton.__version__) < version.parse("3.2.0"):
    logger.warning(
        "The following error message 'operation scheduled before its operands' "
        "can be ignored."
    )


@triton.jit
def tanh(x):
    # Tanh is just a scaled sigmoid
    return 2 * tl.sigmoid(2 * x) - 1


@triton.jit(noinline=True)
def _record_faults(Ctr, Req, Req_to_tokens, stride_req_to_tokens_b, B_Seqlen, max_len, num_pages, cur_batch, cur_head,
                   split_kv_id, NUM_KV_SPLITS: tl.constexpr, PAGE_SIZE: tl.constexpr, HAS_REQ: tl.constexpr):
    """The fault path: one call at the end of the program, out of line as a whole. Its arguments are the kernel's
    own parameters and program ids, and it re-reads the length and the page ids itself, so the kernel keeps nothing
    of the guard live across its loop (kept for the call, a length, a split range and a row base raised a kernel's
    registers by a program per SM). A bad length is recorded by program (head 0, split 0) of its sequence. The
    split's page ids are read again one at a time (scalars: no per-lane state) and the bad ones recorded: a page
    counts in the split that holds its FIRST token (token splits are not page-aligned: a page straddling two splits
    is read by both and counted by one), and only by the head-0 program (head programs read the same pages).
    Requests are read here only."""
    req = None
    if HAS_REQ:
        req = tl.load(Req + cur_batch)
    raw_len = tl.load(B_Seqlen + cur_batch)
    if (raw_len < 0) | (raw_len > max_len):
        if (cur_head == 0) & (split_kv_id == 0):
            record_hit(Ctr + 8, cur_batch, raw_len, req)
    elif cur_head == 0:
        kv_len_per_split = tl.cdiv(raw_len, NUM_KV_SPLITS)
        split_kv_start = kv_len_per_split * split_kv_id
        split_kv_end = tl.minimum(split_kv_start + kv_len_per_split, raw_len)
        row = Req_to_tokens + stride_req_to_tokens_b * cur_batch
        for p in range(tl.cdiv(split_kv_start, PAGE_SIZE), tl.cdiv(split_kv_end, PAGE_SIZE)):
            page = tl.load(row + p)
            if (page < 0) | (page >= num_pages):
                record_hit(Ctr, cur_batch, page, req)


@triton.jit(noinline=True)
def _masked_split(Q, K_Buffer, V_Buffer, sm_scale, Req_to_tokens, Att_Out, k_scale, v_scale, stride_req_to_tokens_b,
                  stride_qbs, stride_qh, stride_buf_kpbs, stride_buf_kbs, stride_buf_kh, stride_buf_vpbs,
                  stride_buf_vbs, stride_buf_vh, stride_mid_ob, stride_mid_oh, stride_mid_os, num_pages, cur_batch,
                  cur_head, split_kv_id, split_kv_start, split_kv_end, kv_group_num: tl.constexpr,
                  BLOCK_DMODEL: tl.constexpr, BLOCK_DV: tl.constexpr, BLOCK_N: tl.constexpr, PAGE_SIZE: tl.constexpr,
                  logit_cap: tl.constexpr, Lk: tl.constexpr, Lv: tl.constexpr):
    """tripwire: stage 1 of one split with a bad page id: vLLM's loop with each token of a bad page masked out of
    the loads and the softmax, and its outputs. Out of line, called with scalars only (the kernel's arguments and
    program ids): a clean split runs vLLM's own loop, and this copy's registers are not allocated beside it (two
    loops in one kernel cost it a program per SM)."""
    cur_kv_head = cur_head // kv_group_num
    cur_batch_req_idx = cur_batch
    offs_d = tl.arange(0, BLOCK_DMODEL)
    offs_dv = tl.arange(0, BLOCK_DV)
    mask_d = offs_d < Lk
    mask_dv = offs_dv < Lv
    q = tl.load(Q + cur_batch * stride_qbs + cur_head * stride_qh + offs_d, mask=mask_d, other=0.0)
    ks = tl.load(k_scale)
    vs = tl.load(v_scale)
    e_max = -float("inf")
    e_sum = 0.0
    acc = tl.zeros([BLOCK_DV], dtype=tl.float32)
    for start_n in range(split_kv_start, split_kv_end, BLOCK_N):
        offs_n = start_n + tl.arange(0, BLOCK_N)
        kv_page_number = tl.load(
            Req_to_tokens
            + stride_req_to_tokens_b * cur_batch_req_idx
            + offs_n // PAGE_SIZE,
            mask=offs_n < split_kv_end,
            other=0,
        ).to(tl.int64)  # page_number * page stride overflows int32
        # tripwire: one compare; a bad page's tokens are masked out of the loads and the softmax.
        page_ok = (kv_page_number >= 0) & (kv_page_number < num_pages)
        live = (offs_n < split_kv_end) & page_ok
        kv_in_page = offs_n % PAGE_SIZE
        offs_buf_k = (
            (kv_page_number * stride_buf_kpbs + kv_in_page * stride_buf_kbs)[
                :, None
            ]
            + cur_kv_head * stride_buf_kh
            + offs_d[None, :]
        )
        k = tl.load(
            K_Buffer + offs_buf_k,
            mask=(live[:, None]) & (mask_d[None, :]),
            other=0.0,
        )
        if k.dtype.is_fp8():
            k = (k.to(tl.float32) * ks).to(q.dtype)
        qk = tl.sum(q[None, :] * k, 1)
        qk *= sm_scale

        if logit_cap > 0:
            qk = logit_cap * tanh(qk / logit_cap)

        qk = tl.where(live, qk, float("-inf"))

        offs_buf_v = (
            (kv_page_number * stride_buf_vpbs + kv_in_page * stride_buf_vbs)[
                :, None
            ]
            + cur_kv_head * stride_buf_vh
            + offs_dv[None, :]
        )
        v = tl.load(
            V_Buffer + offs_buf_v,
            mask=(live[:, None]) & (mask_dv[None, :]),
            other=0.0,
        )
        if v.dtype.is_fp8():
            v = (v.to(tl.float32) * vs).to(q.dtype)

        n_e_max = tl.maximum(tl.max(qk, 0), e_max)
        # tripwire: a tile of masked tokens only: subtract 0, not -inf (exp(-inf - -inf) is NaN).
        m_use = tl.where(n_e_max == float("-inf"), 0.0, n_e_max)
        re_scale = tl.exp(e_max - m_use)
        p = tl.exp(qk - m_use)
        acc *= re_scale
        acc += tl.sum(p[:, None] * v, 0)

        e_sum = e_sum * re_scale + tl.sum(p, 0)
        e_max = n_e_max
    offs_mid_o = (
        cur_batch * stride_mid_ob
        + cur_head * stride_mid_oh
        + split_kv_id * stride_mid_os
        + offs_dv
    )

    tl.store(
        Att_Out + offs_mid_o,
        acc / tl.where(e_sum > 0, e_sum, 1.0),  # tripwire: all tokens masked: 0, not 0/0
        mask=(mask_dv),
    )

    offs_mid_o_1 = (
        cur_batch * stride_mid_ob
        + cur_head * stride_mid_oh
        + split_kv_id * stride_mid_os
        + Lv
    )

    tl.store(
        Att_Out + offs_mid_o_1,
        e_max + tl.log(e_sum),
    )


def _page_stride(buf, page_size):
    # Stride between pages. 4D buffers have a page dim; 3D buffers pack pages
    # along the token dim, so split it out first. Read the real stride (a
    # cross-layer view has gaps), don't assume PAGE_SIZE * token stride.
    if buf.ndim == 3:
        buf = buf.unflatten(-3, (-1, page_size))
    return buf.stride(-4)


@triton.jit
def _fwd_kernel_stage1(
    Q,
    K_Buffer,
    V_Buffer,
    sm_scale,
    Req_to_tokens,
    B_Seqlen,
    Att_Out,
    stride_req_to_tokens_b,
    stride_qbs,
    stride_qh,
    stride_buf_kpbs,
    stride_buf_kbs,
    stride_buf_kh,
    stride_buf_vpbs,
    stride_buf_vbs,
    stride_buf_vh,
    stride_mid_ob,
    stride_mid_oh,
    stride_mid_os,
    k_scale,
    v_scale,
    Ctr,
    Req,
    num_pages,
    max_len,
    kv_group_num: tl.constexpr,
    BLOCK_DMODEL: tl.constexpr,
    BLOCK_DV: tl.constexpr,
    BLOCK_N: tl.constexpr,
    NUM_KV_SPLITS: tl.constexpr,
    PAGE_SIZE: tl.constexpr,
    logit_cap: tl.constexpr,
    Lk: tl.constexpr,
    Lv: tl.constexpr,
    HAS_REQ: tl.constexpr,
):
    cur_batch = tl.program_id(0)
    cur_head = tl.program_id(1)
    split_kv_id = tl.program_id(2)

    cur_kv_head = cur_head // kv_group_num

    offs_d = tl.arange(0, BLOCK_DMODEL)
    offs_dv = tl.arange(0, BLOCK_DV)
    mask_d = offs_d < Lk
    mask_dv = offs_dv < Lv
    cur_batch_seq_len = tl.load(B_Seqlen + cur_batch)
    cur_batch_req_idx = cur_batch
    # tripwire: a bad length masks the whole sequence (recorded at the end, by one of its programs).
    faulty = (cur_batch_seq_len < 0) | (cur_batch_seq_len > max_len)
    cur_batch_seq_len = tl.where(faulty, 0, cur_batch_seq_len)

    off_q = cur_batch * stride_qbs + cur_head * stride_qh + offs_d
    q = tl.load(Q + off_q, mask=mask_d, other=0.0)

    kv_len_per_split = tl.cdiv(cur_batch_seq_len, NUM_KV_SPLITS)
    split_kv_start = kv_len_per_split * split_kv_id
    split_kv_end = tl.minimum(split_kv_start + kv_len_per_split, cur_batch_seq_len)

    e_max = -float("inf")
    e_sum = 0.0
    acc = tl.zeros([BLOCK_DV], dtype=tl.float32)

    if split_kv_end > split_kv_start:
        ks = tl.load(k_scale)
        vs = tl.load(v_scale)
        # tripwire: the split's page ids checked once, before its loop (each warp reads them and votes: no warp
        # waits for another): a clean split runs vLLM's own loop, a split with a bad id the masking copy, out of
        # line (_masked_split).
        bad_pages = any_outside(
            Req_to_tokens + stride_req_to_tokens_b * cur_batch_req_idx, split_kv_start // PAGE_SIZE,
            tl.cdiv(split_kv_end, PAGE_SIZE), 0, num_pages, 128,
        )
        faulty = faulty | bad_pages
        if bad_pages:
            _masked_split(Q, K_Buffer, V_Buffer, sm_scale, Req_to_tokens, Att_Out, k_scale, v_scale,
                          stride_req_to_tokens_b, stride_qbs, stride_qh, stride_buf_kpbs, stride_buf_kbs, stride_buf_kh,
                          stride_buf_vpbs, stride_buf_vbs, stride_buf_vh, stride_mid_ob, stride_mid_oh, stride_mid_os,
                          num_pages, cur_batch, cur_head, split_kv_id, split_kv_start, split_kv_end, kv_group_num,
                          BLOCK_DMODEL, BLOCK_DV, BLOCK_N, PAGE_SIZE, logit_cap, Lk, Lv)
        else:
            for start_n in range(split_kv_start, split_kv_end, BLOCK_N):
                offs_n = start_n + tl.arange(0, BLOCK_N)
                kv_page_number = tl.load(
                    Req_to_tokens
                    + stride_req_to_tokens_b * cur_batch_req_idx
                    + offs_n // PAGE_SIZE,
                    mask=offs_n < split_kv_end,
                    other=0,
                ).to(tl.int64)  # page_number * page stride overflows int32
                kv_in_page = offs_n % PAGE_SIZE
                offs_buf_k = (
                    (kv_page_number * stride_buf_kpbs + kv_in_page * stride_buf_kbs)[
                        :, None
                    ]
                    + cur_kv_head * stride_buf_kh
                    + offs_d[None, :]
                )
                k = tl.load(
                    K_Buffer + offs_buf_k,
                    mask=(offs_n[:, None] < split_kv_end) & (mask_d[None, :]),
                    other=0.0,
                )
                if k.dtype.is_fp8():
                    k = (k.to(tl.float32) * ks).to(q.dtype)
                qk = tl.sum(q[None, :] * k, 1)
                qk *= sm_scale

                if logit_cap > 0:
                    qk = logit_cap * tanh(qk / logit_cap)

                qk = tl.where(offs_n < split_kv_end, qk, float("-inf"))

                offs_buf_v = (
                    (kv_page_number * stride_buf_vpbs + kv_in_page * stride_buf_vbs)[
                        :, None
                    ]
                    + cur_kv_head * stride_buf_vh
                    + offs_dv[None, :]
                )
                v = tl.load(
                    V_Buffer + offs_buf_v,
                    mask=(offs_n[:, None] < split_kv_end) & (mask_dv[None, :]),
                    other=0.0,
                )
                if v.dtype.is_fp8():
                    v = (v.to(tl.float32) * vs).to(q.dtype)

                n_e_max = tl.maximum(tl.max(qk, 0), e_max)
                re_scale = tl.exp(e_max - n_e_max)
                p = tl.exp(qk - n_e_max)
                acc *= re_scale
                acc += tl.sum(p[:, None] * v, 0)

                e_sum = e_sum * re_scale + tl.sum(p, 0)
                e_max = n_e_max

            offs_mid_o = (
                cur_batch * stride_mid_ob
                + cur_head * stride_mid_oh
                + split_kv_id * stride_mid_os
                + offs_dv
            )

            tl.store(
                Att_Out + offs_mid_o,
                acc / e_sum,
                mask=(mask_dv),
            )

            offs_mid_o_1 = (
                cur_batch * stride_mid_ob
                + cur_head * stride_mid_oh
                + split_kv_id * stride_mid_os
                + Lv
            )

            tl.store(
                Att_Out + offs_mid_o_1,
                e_max + tl.log(e_sum),
            )

    # tripwire: the fault path, one call site.
    if faulty:
        _record_faults(Ctr, Req, Req_to_tokens, stride_req_to_tokens_b, B_Seqlen, max_len, num_pages, cur_batch,
                       cur_head, split_kv_id, NUM_KV_SPLITS, PAGE_SIZE, HAS_REQ)


def _guard_args(q, k_buffer, req_to_tokens, page_size, ctr, requests):
    """tripwire: the counter rows, the request map (or any tensor when there is none: HAS_REQ is off), the KV
    pool's page count and the longest length the block table holds."""
    if ctr is None:
        ctr = counters(SITES, q.device)
    num_pages = k_buffer.shape[0] if k_buffer.ndim == 4 else k_buffer.shape[0] // page_size
    return ctr, requests if requests is not None else ctr, num_pages, req_to_tokens.shape[1] * page_size


def _decode_att_m_fwd(
    q,
    k_buffer,
    v_buffer,
    att_out,
    Req_to_tokens,
    B_Seqlen,
    num_kv_splits,
    sm_scale,
    page_size,
    logit_cap,
    k_scale,
    v_scale,
    ctr=None,
    requests=None,
):
    BLOCK = 64 if not is_hip_ else 8

    NUM_KV_SPLITS = num_kv_splits
    Lk = k_buffer.shape[-1]
    Lv = v_buffer.shape[-1]

    batch, head_num = q.shape[0], q.shape[1]

    grid = (batch, head_num, NUM_KV_SPLITS)
    kv_group_num = q.shape[1] // k_buffer.shape[-2]

    num_warps = 4
    if kv_group_num != 1:
        num_warps = 1 if is_hip_ else 2

    BLOCK_DMODEL = triton.next_power_of_2(Lk)
    BLOCK_DV = triton.next_power_of_2(Lv)

    _fwd_kernel_stage1[grid](
        q,
        k_buffer,
        v_buffer,
        sm_scale,
        Req_to_tokens,
        B_Seqlen,
        att_out,
        Req_to_tokens.stride(0),
        q.stride(0),
        q.stride(1),
        _page_stride(k_buffer, page_size),
        k_buffer.stride(-3),  # Assume (..., PAGE_SIZE, NUM_HEADS, HEAD_DIM)
        k_buffer.stride(-2),  # Assume (..., PAGE_SIZE, NUM_HEADS, HEAD_DIM)
        _page_stride(v_buffer, page_size),
        v_buffer.stride(-3),  # Assume (..., PAGE_SIZE, NUM_HEADS, HEAD_DIM)
        v_buffer.stride(-2),  # Assume (..., PAGE_SIZE, NUM_HEADS, HEAD_DIM)
        att_out.stride(0),
        att_out.stride(1),
        att_out.stride(2),
        k_scale,
        v_scale,
        *_guard_args(q, k_buffer, Req_to_tokens, page_size, ctr, requests),
        kv_group_num=kv_group_num,
        BLOCK_DMODEL=BLOCK_DMODEL,
        BLOCK_DV=BLOCK_DV,
        BLOCK_N=BLOCK,
        NUM_KV_SPLITS=NUM_KV_SPLITS,
        PAGE_SIZE=page_size,
        logit_cap=logit_cap,
        num_warps=num_warps,
        num_stages=2,
        Lk=Lk,
        Lv=Lv,
        HAS_REQ=requests is not None,
    )


@triton.jit
def _fwd_grouped_kernel_stage1(
    Q,
    K_Buffer,
    V_Buffer,
    sm_scale,
    Req_to_tokens,
    B_Seqlen,
    Att_Out,
    stride_req_to_tokens_b,
    stride_qbs,
    stride_qh,
    stride_buf_kpbs,
    stride_buf_kbs,
    stride_buf_kh,
    stride_buf_vpbs,
    stride_buf_vbs,
    stride_buf_vh,
    stride_mid_ob,
    stride_mid_oh,
    stride_mid_os,
    k_scale,
    v_scale,
    Ctr,
    Req,
    num_pages,
    max_len,
    kv_group_num: tl.constexpr,
    q_head_num: tl.constexpr,
    BLOCK_DMODEL: tl.constexpr,
    BLOCK_DPE: tl.constexpr,
    BLOCK_DV: tl.constexpr,
    BLOCK_N: tl.constexpr,
    BLOCK_H: tl.constexpr,
    NUM_KV_SPLITS: tl.constexpr,
    PAGE_SIZE: tl.constexpr,
    logit_cap: tl.constexpr,
    Lk: tl.constexpr,
    Lv: tl.constexpr,
    HAS_REQ: tl.constexpr,
    IS_MLA: tl.constexpr = False,
):
    cur_batch = tl.program_id(0)
    cur_head_id = tl.program_id(1)
    cur_kv_head = cur_head_id // tl.cdiv(kv_group_num, BLOCK_H)
    split_kv_id = tl.program_id(2)

    VALID_BLOCK_H: tl.constexpr = BLOCK_H if kv_group_num > BLOCK_H else kv_group_num
    cur_head = cur_head_id * VALID_BLOCK_H + tl.arange(0, BLOCK_H)
    mask_h = cur_head < (cur_head_id + 1) * VALID_BLOCK_H
    mask_h = mask_h & (cur_head < q_head_num)

    offs_d = tl.arange(0, BLOCK_DMODEL)
    offs_dv = tl.arange(0, BLOCK_DV)
    mask_d = offs_d < Lk
    mask_dv = offs_dv < Lv
    cur_batch_seq_len = tl.load(B_Seqlen + cur_batch)
    cur_batch_req_idx = cur_batch
    # tripwire: a bad length masks the whole sequence (recorded at the end, by one of its programs).
    faulty = (cur_batch_seq_len < 0) | (cur_batch_seq_len > max_len)
    cur_batch_seq_len = tl.where(faulty, 0, cur_batch_seq_len)

    offs_q = cur_batch * stride_qbs + cur_head[:, None] * stride_qh + offs_d[None, :]
    q = tl.load(
        Q + offs_q,
        mask=(mask_h[:, None]) & (mask_d[None, :]),
        other=0.0,
        cache_modifier=".ca",
    )

    if BLOCK_DPE > 0:
        offs_dpe = BLOCK_DMODEL + tl.arange(0, BLOCK_DPE)
        mask_dpe = offs_dpe < Lk
        off_qpe = (
            cur_batch * stride_qbs + cur_head[:, None] * stride_qh + offs_dpe[None, :]
        )
        qpe = tl.load(
            Q + off_qpe,
            mask=(mask_h[:, None]) & (mask_dpe[None, :]),
            other=0.0,
            cache_modifier=".ca",
        )

    kv_len_per_split = tl.cdiv(cur_batch_seq_len, NUM_KV_SPLITS)
    split_kv_start = kv_len_per_split * split_kv_id
    split_kv_end = tl.minimum(split_kv_start + kv_len_per_split, cur_batch_seq_len)

    e_max = tl.zeros([BLOCK_H], dtype=tl.float32) - float("inf")
    e_sum = tl.zeros([BLOCK_H], dtype=tl.float32)
    acc = tl.zeros([BLOCK_H, BLOCK_DV], dtype=tl.float32)

    if split_kv_end > split_kv_start:
        base_offs_k = cur_kv_head * stride_buf_kh + offs_d[:, None]
        base_offs_v = cur_kv_head * stride_buf_vh + offs_dv[None, :]
        if BLOCK_DPE > 0:
            base_offs_kpe = cur_kv_head * stride_buf_kh + offs_dpe[:, None]

        ks = tl.load(k_scale)
        vs = tl.load(v_scale)
        # tripwire: the split's page ids checked once, before its loop, in a 1-D pass (each warp reads them and
        # votes: no warp waits for another). In the loop a check would run on every replica of a page id in the
        # tile's layout and put a data-dependent mask on the pipelined loads. A clean split runs vLLM's own loop;
        # a split with a bad page the masking one.
        bad_pages = any_outside(
            Req_to_tokens + stride_req_to_tokens_b * cur_batch_req_idx, split_kv_start // PAGE_SIZE,
            tl.cdiv(split_kv_end, PAGE_SIZE), 0, num_pages, 128,
        )
        faulty = faulty | bad_pages
        if bad_pages:
            for start_n in tl.range(split_kv_start, split_kv_end, BLOCK_N):
                offs_n = start_n + tl.arange(0, BLOCK_N)
                kv_page_number = tl.load(
                    Req_to_tokens
                    + stride_req_to_tokens_b * cur_batch_req_idx
                    + offs_n // PAGE_SIZE,
                    mask=offs_n < split_kv_end,
                    other=0,
                    cache_modifier=".ca",
                ).to(tl.int64)  # page_number * page stride overflows int32
                # tripwire: one compare; a bad page's tokens are masked out of the loads and the softmax.
                page_ok = (kv_page_number >= 0) & (kv_page_number < num_pages)
                live = (offs_n < split_kv_end) & page_ok
                kv_off_k = (
                    kv_page_number * stride_buf_kpbs + (offs_n % PAGE_SIZE) * stride_buf_kbs
                )

                # explicitly facilitate overlapping load/compute
                offs_buf_k = kv_off_k[None, :] + base_offs_k
                k = tl.load(
                    K_Buffer + offs_buf_k,
                    mask=(live[None, :]) & (mask_d[:, None]),
                    other=0.0,
                    cache_modifier=".cg",
                )

                if k.dtype.is_fp8():
                    k = (k.to(tl.float32) * ks).to(q.dtype)
                qk = tl.dot(q, k.to(q.dtype))
                if BLOCK_DPE > 0:
                    offs_buf_kpe = kv_off_k[None, :] + base_offs_kpe
                    kpe = tl.load(
                        K_Buffer + offs_buf_kpe,
                        mask=(offs_n[None, :] < split_kv_end) & (mask_dpe[:, None]),
                        other=0.0,
                        cache_modifier=".cg",
                    )
                    if kpe.dtype.is_fp8():
                        kpe = (kpe.to(tl.float32) * ks).to(qpe.dtype)
                    qk += tl.dot(qpe, kpe.to(qpe.dtype))
                qk *= sm_scale

                if logit_cap > 0:
                    qk = logit_cap * tanh(qk / logit_cap)

                qk = tl.where(
                    mask_h[:, None] & (live[None, :]), qk, float("-inf")
                )

                if not IS_MLA:
                    kv_off_v = (
                        kv_page_number * stride_buf_vpbs
                        + (offs_n % PAGE_SIZE) * stride_buf_vbs
                    )
                    offs_buf_v = kv_off_v[:, None] + base_offs_v
                    v = tl.load(
                        V_Buffer + offs_buf_v,
                        mask=(live[:, None]) & (mask_dv[None, :]),
                        other=0.0,
                    )
                    if v.dtype.is_fp8():
                        v = (v.to(tl.float32) * vs).to(q.dtype)
                else:
                    # MLA uses a single c_kv.
                    # loading the same c_kv to interpret it as v is not necessary.
                    # transpose the existing c_kv (aka k) for the dot product.
                    v = tl.trans(k)

                n_e_max = tl.maximum(tl.max(qk, 1), e_max)
                # tripwire: a tile of masked tokens only: subtract 0, not -inf (exp(-inf - -inf) is NaN).
                m_use = tl.where(n_e_max == float("-inf"), 0.0, n_e_max)
                re_scale = tl.exp(e_max - m_use)
                p = tl.exp(qk - m_use[:, None])
                acc *= re_scale[:, None]
                acc += tl.dot(p.to(v.dtype), v)

                e_sum = e_sum * re_scale + tl.sum(p, 1)
                e_max = n_e_max
        else:
            # vLLM's loop, as it ships (the split's pages are all good)
            for start_n in tl.range(split_kv_start, split_kv_end, BLOCK_N):
                offs_n = start_n + tl.arange(0, BLOCK_N)
                kv_page_number = tl.load(
                    Req_to_tokens
                    + stride_req_to_tokens_b * cur_batch_req_idx
                    + offs_n // PAGE_SIZE,
                    mask=offs_n < split_kv_end,
                    other=0,
                    cache_modifier=".ca",
                ).to(tl.int64)  # page_number * page stride overflows int32
                kv_off_k = (
                    kv_page_number * stride_buf_kpbs + (offs_n % PAGE_SIZE) * stride_buf_kbs
                )

                # explicitly facilitate overlapping load/compute
                offs_buf_k = kv_off_k[None, :] + base_offs_k
                k = tl.load(
                    K_Buffer + offs_buf_k,
                    mask=(offs_n[None, :] < split_kv_end) & (mask_d[:, None]),
                    other=0.0,
                    cache_modifier=".cg",
                )

                if k.dtype.is_fp8():
                    k = (k.to(tl.float32) * ks).to(q.dtype)
                qk = tl.dot(q, k.to(q.dtype))
                if BLOCK_DPE > 0:
                    offs_buf_kpe = kv_off_k[None, :] + base_offs_kpe
                    kpe = tl.load(
                        K_Buffer + offs_buf_kpe,
                        mask=(offs_n[None, :] < split_kv_end) & (mask_dpe[:, None]),
                        other=0.0,
                        cache_modifier=".cg",
                    )
                    if kpe.dtype.is_fp8():
                        kpe = (kpe.to(tl.float32) * ks).to(qpe.dtype)
                    qk += tl.dot(qpe, kpe.to(qpe.dtype))
                qk *= sm_scale

                if logit_cap > 0:
                    qk = logit_cap * tanh(qk / logit_cap)

                qk = tl.where(
                    mask_h[:, None] & (offs_n[None, :] < split_kv_end), qk, float("-inf")
                )

                if not IS_MLA:
                    kv_off_v = (
                        kv_page_number * stride_buf_vpbs
                        + (offs_n % PAGE_SIZE) * stride_buf_vbs
                    )
                    offs_buf_v = kv_off_v[:, None] + base_offs_v
                    v = tl.load(
                        V_Buffer + offs_buf_v,
                        mask=(offs_n[:, None] < split_kv_end) & (mask_dv[None, :]),
                        other=0.0,
                    )
                    if v.dtype.is_fp8():
                        v = (v.to(tl.float32) * vs).to(q.dtype)
                else:
                    # MLA uses a single c_kv.
                    # loading the same c_kv to interpret it as v is not necessary.
                    # transpose the existing c_kv (aka k) for the dot product.
                    v = tl.trans(k)

                n_e_max = tl.maximum(tl.max(qk, 1), e_max)
                re_scale = tl.exp(e_max - n_e_max)
                p = tl.exp(qk - n_e_max[:, None])
                acc *= re_scale[:, None]
                acc += tl.dot(p.to(v.dtype), v)

                e_sum = e_sum * re_scale + tl.sum(p, 1)
                e_max = n_e_max

        offs_mid_o = (
            cur_batch * stride_mid_ob
            + cur_head[:, None] * stride_mid_oh
            + split_kv_id * stride_mid_os
            + offs_dv[None, :]
        )

        tl.store(
            Att_Out + offs_mid_o,
            acc / tl.where(e_sum > 0, e_sum, 1.0)[:, None],  # tripwire: all tokens masked: 0, not 0/0
            mask=(mask_h[:, None]) & (mask_dv[None, :]),
        )

        offs_mid_o_1 = (
            cur_batch * stride_mid_ob
            + cur_head * stride_mid_oh
            + split_kv_id * stride_mid_os
            + Lv
        )

        tl.store(
            Att_Out + offs_mid_o_1,
            e_max + tl.log(e_sum),
            mask=mask_h,
        )

    # tripwire: the fault path, one call site.
    if faulty:
        _record_faults(Ctr, Req, Req_to_tokens, stride_req_to_tokens_b, B_Seqlen, max_len, num_pages, cur_batch,
                       cur_head_id, split_kv_id, NUM_KV_SPLITS, PAGE_SIZE, HAS_REQ)


def _decode_grouped_att_m_fwd(
    q,
    k_buffer,
    v_buffer,
    att_out,
    Req_to_tokens,
    B_Seqlen,
    num_kv_splits,
    sm_scale,
    page_size,
    logit_cap,
    k_scale,
    v_scale,
    is_mla=False,
    ctr=None,
    requests=None,
):
    # with is_mla there is only a single c_kv in smem.
    # could increase BLOCK or num_stages.
    Lk = k_buffer.shape[-1]
    Lv = v_buffer.shape[-1]

    # Align tile dimensions with latent rank for MLA to avoid shape mismatch.
    if is_mla:
        if not is_hip_ and Lk == 576:
            BLOCK_DMODEL = 512
            BLOCK_DPE = 64
        elif not is_hip_ and Lk == 288:
            BLOCK_DMODEL = 256
            BLOCK_DPE = 32
        else:
            BLOCK_DMODEL = triton.next_power_of_2(Lv)
            BLOCK_DPE = triton.next_power_of_2(Lk - Lv) if Lk > Lv else 0
    else:
        BLOCK_DMODEL = triton.next_power_of_2(Lk)
        BLOCK_DPE = 0
    BLOCK_DV = triton.next_power_of_2(Lv)

    BLOCK = 32
    if is_hip_:
        BLOCK = 16

    batch, head_num = q.shape[0], q.shape[1]
    kv_group_num = q.shape[1] // k_buffer.shape[-2]

    BLOCK_H = 16
    NUM_KV_SPLITS = num_kv_splits
    grid = (
        batch,
        triton.cdiv(head_num, min(BLOCK_H, kv_group_num)),
        NUM_KV_SPLITS,
    )

    extra_kargs = {}
    num_stages = 2
    if is_hip_:
        # https://rocm.docs.amd.com/en/latest/how-to/rocm-for-ai/inference-optimization/workload.html#mi300x-triton-kernel-performance-optimization
        # https://github.com/triton-lang/triton/blob/main/third_party/amd/backend/compiler.py
        extra_kargs = {"waves_per_eu": 1, "matrix_instr_nonkdim": 16, "kpack": 2}
        num_stages = 1
    elif not is_hip_ and BLOCK_DMODEL >= 1024:
        # Avoid shared memory overflow on NVIDIA when BLOCK_DMODEL is large
        # like non-MLA D_QK=576, BLOCK_DMODEL=1024, BLOCK_H=16
        # exceeds 101376 bytes limit
        num_stages = 1

    _fwd_grouped_kernel_stage1[grid](
        q,
        k_buffer,
        v_buffer,
        sm_scale,
        Req_to_tokens,
        B_Seqlen,
        att_out,
        Req_to_tokens.stride(0),
        q.stride(0),
        q.stride(1),
        _page_stride(k_buffer, page_size),
        k_buffer.stride(-3),  # Assume (..., PAGE_SIZE, NUM_HEADS, HEAD_DIM)
        k_buffer.stride(-2),  # Assume (..., PAGE_SIZE, NUM_HEADS, HEAD_DIM)
        _page_stride(v_buffer, page_size),
        v_buffer.stride(-3),  # Assume (..., PAGE_SIZE, NUM_HEADS, HEAD_DIM)
        v_buffer.stride(-2),  # Assume (..., PAGE_SIZE, NUM_HEADS, HEAD_DIM)
        att_out.stride(0),
        att_out.stride(1),
        att_out.stride(2),
        k_scale,
        v_scale,
        *_guard_args(q, k_buffer, Req_to_tokens, page_size, ctr, requests),
        kv_group_num=kv_group_num,
        q_head_num=head_num,
        BLOCK_DMODEL=BLOCK_DMODEL,
        BLOCK_DPE=BLOCK_DPE,
        BLOCK_DV=BLOCK_DV,
        BLOCK_N=BLOCK,
        BLOCK_H=BLOCK_H,
        NUM_KV_SPLITS=NUM_KV_SPLITS,
        PAGE_SIZE=page_size,
        logit_cap=logit_cap,
        num_warps=4,
        num_stages=num_stages,
        Lk=Lk,
        Lv=Lv,
        HAS_REQ=requests is not None,
        IS_MLA=is_mla,
        **extra_kargs,
    )


@triton.jit
def _fwd_kernel_stage2(
    Mid_O,
    o,
    lse,
    B_Seqlen,
    stride_mid_ob,
    stride_mid_oh,
    stride_mid_os,
    stride_obs,
    stride_oh,
    stride_lse_bs,
    max_len,
    NUM_KV_SPLITS: tl.constexpr,
    BLOCK_DV: tl.constexpr,
    Lv: tl.constexpr,
    OUTPUT_FP16: tl.constexpr = 0,
):
    cur_batch = tl.program_id(0)
    cur_head = tl.program_id(1)

    cur_batch_seq_len = tl.load(B_Seqlen + cur_batch)
    # tripwire: the length stage 1 used (a bad one is 0 there); stage 1 counted it, so nothing is recorded here.
    cur_batch_seq_len = tl.where((cur_batch_seq_len >= 0) & (cur_batch_seq_len <= max_len), cur_batch_seq_len, 0)

    offs_d = tl.arange(0, BLOCK_DV)
    mask_d = offs_d < Lv

    e_sum = 0.0
    e_max = -float("inf")
    acc = tl.zeros([BLOCK_DV], dtype=tl.float32)

    offs_v = cur_batch * stride_mid_ob + cur_head * stride_mid_oh + offs_d
    offs_logic = cur_batch * stride_mid_ob + cur_head * stride_mid_oh + Lv

    for split_kv_id in range(0, NUM_KV_SPLITS):
        kv_len_per_split = tl.cdiv(cur_batch_seq_len, NUM_KV_SPLITS)
        split_kv_start = kv_len_per_split * split_kv_id
        split_kv_end = tl.minimum(split_kv_start + kv_len_per_split, cur_batch_seq_len)

        if split_kv_end > split_kv_start:
            tv = tl.load(
                Mid_O + offs_v + split_kv_id * stride_mid_os, mask=mask_d, other=0.0
            )
            tlogic = tl.load(Mid_O + offs_logic + split_kv_id * stride_mid_os)
            n_e_max = tl.maximum(tlogic, e_max)
            # tripwire: splits whose tokens were all masked have lse -inf: subtract 0, not -inf.
            m_use = tl.where(n_e_max == float("-inf"), 0.0, n_e_max)

            old_scale = tl.exp(e_max - m_use)
            acc *= old_scale
            exp_logic = tl.exp(tlogic - m_use)
            acc += exp_logic * tv

            e_sum = e_sum * old_scale + exp_logic
            e_max = n_e_max

    result = acc / tl.where(e_sum > 0, e_sum, 1.0)  # tripwire: nothing attended: 0, not 0/0
    if OUTPUT_FP16:
        result = result.to(tl.float16)
    tl.store(
        o + cur_batch * stride_obs + cur_head * stride_oh + offs_d,
        result,
        mask=mask_d,
    )
    lse_val = e_max + tl.log(e_sum)
    tl.store(
        lse + cur_batch * stride_lse_bs + cur_head,
        lse_val,
    )


def _decode_softmax_reducev_fwd(
    logits,
    q,
    o,
    lse,
    v_buffer,
    b_seq_len,
    num_kv_splits,
    max_len,
):
    batch, head_num = q.shape[0], q.shape[1]
    Lv = v_buffer.shape[-1]
    BLOCK_DV = triton.next_power_of_2(Lv)

    NUM_KV_SPLITS = num_kv_splits

    extra_kargs = {}
    if is_hip_:
        # https://rocm.docs.amd.com/en/docs-6.2.0/how-to/llm-fine-tuning-optimization/optimizing-triton-kernel.html
        # https://github.com/triton-lang/triton/blob/main/third_party/amd/backend/compiler.py
        extra_kargs = {"waves_per_eu": 4, "matrix_instr_nonkdim": 16, "kpack": 2}

    grid = (batch, head_num)
    _fwd_kernel_stage2[grid](
        logits,
        o,
        lse,
        b_seq_len,
        logits.stride(0),
        logits.stride(1),
        logits.stride(2),
        o.stride(0),
        o.stride(1),
        lse.stride(0),
        max_len,
        NUM_KV_SPLITS=NUM_KV_SPLITS,
        BLOCK_DV=BLOCK_DV,
        Lv=Lv,
        num_warps=4,
        num_stages=2,
        **extra_kargs,
    )


def decode_attention_fwd_normal(
    q,
    k_buffer,
    v_buffer,
    o,
    lse,
    req_to_token,
    b_seq_len,
    attn_logits,
    num_kv_splits,
    sm_scale,
    page_size,
    logit_cap=0.0,
    k_scale=None,
    v_scale=None,
    ctr=None,
    requests=None,
):
    _decode_att_m_fwd(
        q,
        k_buffer,
        v_buffer,
        attn_logits,
        req_to_token,
        b_seq_len,
        num_kv_splits,
        sm_scale,
        page_size,
        logit_cap,
        k_scale,
        v_scale,
        ctr=ctr,
        requests=requests,
    )
    _decode_softmax_reducev_fwd(
        attn_logits, q, o, lse, v_buffer, b_seq_len, num_kv_splits, req_to_token.shape[1] * page_size
    )


def decode_attention_fwd_grouped(
    q,
    k_buffer,
    v_buffer,
    o,
    lse,
    req_to_token,
    b_seq_len,
    attn_logits,
    num_kv_splits,
    sm_scale,
    page_size,
    logit_cap=0.0,
    k_scale=None,
    v_scale=None,
    is_mla=False,
    ctr=None,
    requests=None,
):
    _decode_grouped_att_m_fwd(
        q,
        k_buffer,
        v_buffer,
        attn_logits,
        req_to_token,
        b_seq_len,
        num_kv_splits,
        sm_scale,
        page_size,
        logit_cap,
        k_scale,
        v_scale,
        is_mla=is_mla,
        ctr=ctr,
        requests=requests,
    )
    _decode_softmax_reducev_fwd(
        attn_logits, q, o, lse, v_buffer, b_seq_len, num_kv_splits, req_to_token.shape[1] * page_size
    )


def decode_attention_fwd(
    q,
    k_buffer,
    v_buffer,
    o,
    lse,
    req_to_token,
    b_seq_len,
    attn_logits,
    num_kv_splits,
    sm_scale,
    page_size=1,
    logit_cap=0.0,
    k_scale=None,
    v_scale=None,
    is_mla=False,
    ctr=None,
    requests=None,
):
    """tripwire: ``ctr``: the counter rows of SITES (default: the default monitor's); ``requests``: the request id
    of each sequence (int64 [batch]), kept with the offenders; read on the fault path only."""
    assert num_kv_splits == attn_logits.shape[2]

    if k_scale is None:
        k_scale = torch.tensor(1.0, dtype=torch.float32, device=q.device)
    if v_scale is None:
        v_scale = torch.tensor(1.0, dtype=torch.float32, device=q.device)

    kv_group_num = q.shape[1] // v_buffer.shape[-2]

    if kv_group_num == 1:
        # MHA
        decode_attention_fwd_normal(
            q,
            k_buffer,
            v_buffer,
            o,
            lse,
            req_to_token,
            b_seq_len,
            attn_logits,
            num_kv_splits,
            sm_scale,
            page_size,
            logit_cap,
            k_scale,
            v_scale,
            ctr=ctr,
            requests=requests,
        )
    else:
        # GQA/MQA/MLA
        decode_attention_fwd_grouped(
            q,
            k_buffer,
            v_buffer,
            o,
            lse,
            req_to_token,
            b_seq_len,
            attn_logits,
            num_kv_splits,
            sm_scale,
            page_size,
            logit_cap,
            k_scale,
            v_scale,
            is_mla=is_mla,
            ctr=ctr,
            requests=requests,
        )
