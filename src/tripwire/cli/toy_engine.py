"""The demo's toy engine: the decode step built from the reference kernels, on static tensors (capture-safe), and
the metadata faults the demo writes into it between steps (``inject``) and takes back after the step
(``restore``), like a host-side bug would."""

from __future__ import annotations

import math
from dataclasses import dataclass

import torch

# kind -> (where it is written, the site expected to count it)
FAULT_KINDS = {
    "block": ("block_table[r, 0] = a block id far past the KV pool", "kernels.paged_gather.page"),
    "row": ("req_rows[b] = a request row past the block table", "kernels.block_table.row"),
    "count": ("block_counts[r] = the table's width + 1", "kernels.block_table.count"),
    "rope": ("positions[b] = a position past the rope table (FATAL)", "kernels.rope.position"),
    "last": ("free_ids[-1] = a negative block id, on the last step", "kernels.kv_zero.block"),
}

# Toy model sizes: small, so the CPU interpreter runs a step in a fraction of a second.
B, R, W, BS, H, D, VOCAB = 4, 6, 8, 4, 2, 16, 32
MAX_LEN = W * BS  # tokens per request; also the rope table's rows
N_BLOCKS = R * W  # the KV pool; one extra trash block after it takes padding writes


@dataclass
class Fault:
    kind: str
    step: int
    entry: str = ""
    value: int = 0


class ToyEngine:
    """The decode step's static tensors and the step itself (capture-safe: no sync, no host reads)."""

    def __init__(self, device: torch.device, seed: int) -> None:
        self.device = device
        g = torch.Generator().manual_seed(seed)
        dev = device
        i32 = torch.int32

        def rnd(*shape: int, scale: float = 1.0) -> torch.Tensor:
            return (torch.randn(*shape, generator=g) * scale).to(dev)

        self.embed = rnd(VOCAB, H * D)
        self.wq, self.wk, self.wv = (rnd(H * D, H * D, scale=(H * D) ** -0.5) for _ in range(3))
        self.wo = rnd(H * D, VOCAB, scale=(H * D) ** -0.5)
        inv = 1.0 / (10000.0 ** (torch.arange(0, D // 2, dtype=torch.float32) / (D // 2)))
        ang = torch.arange(MAX_LEN, dtype=torch.float32)[:, None] * inv[None, :]
        self.cos_sin = torch.cat([ang.cos(), ang.sin()], dim=1).to(dev)
        # Request row r owns blocks [r*W, (r+1)*W); the batch serves rows in a shuffled order.
        self.block_table_host = torch.arange(N_BLOCKS, dtype=i32).reshape(R, W)
        self.block_table = self.block_table_host.to(dev, copy=True)  # copy: on the CPU .to() would alias
        self.block_counts = torch.full((R,), W, dtype=i32, device=dev)
        self.req_rows_host = torch.randperm(R, generator=g)[:B].to(i32)
        self.req_rows = self.req_rows_host.to(dev, copy=True)
        self.start_pos = torch.randint(1, MAX_LEN // 2, (B,), generator=g)
        self.start_tokens = torch.randint(0, VOCAB, (B,), generator=g)
        self.kv_init = torch.randn(N_BLOCKS + 1, 2, BS, H, D, generator=g)
        self.positions = torch.zeros(B, dtype=torch.int64, device=dev)
        self.tokens = torch.zeros(B, dtype=torch.int64, device=dev)
        self.kv = torch.zeros(N_BLOCKS + 1, 2, BS, H, D, device=dev)
        # Recurrent state: each request row owns two slots (ping-pong checkpoints).
        self.state_table = torch.arange(2 * R, dtype=i32).reshape(R, 2).to(dev)
        self.state = torch.zeros(2 * R, H * D, device=dev)
        self.parity = torch.zeros(1, dtype=i32, device=dev)
        self.src_cols = torch.zeros(B, dtype=i32, device=dev)
        self.dst_cols = torch.ones(B, dtype=i32, device=dev)
        # Outputs, preallocated (launchers never allocate).
        self.batch_table = torch.zeros(B, W, dtype=i32, device=dev)
        self.slots = torch.zeros(B, dtype=torch.int64, device=dev)
        self.q_rot = torch.zeros(B, H, D, device=dev)
        self.k_rot = torch.zeros(B, H, D, device=dev)
        self.gathered = torch.zeros(B, W, 2, BS, H, D, device=dev)
        # Blocks to zero this step: B*W computed from finished requests, plus one entry the host controls.
        self.free_ids = torch.full((B * W + 1,), N_BLOCKS, dtype=i32, device=dev)
        self.trash = N_BLOCKS
        self.t_idx = torch.arange(W * BS, device=dev)
        self.restart()

    def restart(self) -> None:
        """Fresh requests in the same tensors (in place, so a captured graph stays valid)."""
        self.positions.copy_(self.start_pos)
        self.tokens.copy_(self.start_tokens)
        self.kv.copy_(self.kv_init)
        self.state.zero_()
        self.parity.zero_()
        self.block_table.copy_(self.block_table_host)
        self.req_rows.copy_(self.req_rows_host)
        self.block_counts.fill_(W)
        self.free_ids.fill_(N_BLOCKS)

    def step(self) -> None:
        from ..kernels.block_table import block_table_gather
        from ..kernels.kv_zero import kv_zero
        from ..kernels.paged_gather import paged_gather
        from ..kernels.rope import rope
        from ..kernels.slot_mapping import slot_mapping
        from ..kernels.state_copy import state_copy

        block_table_gather(self.block_table, self.req_rows, self.block_counts, self.batch_table)
        slot_mapping(self.positions, self.req_rows, self.block_table, self.slots, BS, num_kv_blocks=N_BLOCKS)
        x = self.embed[self.tokens]
        q = (x @ self.wq).view(B, H, D)
        k = (x @ self.wk).view(B, H, D)
        v = (x @ self.wv).view(B, H, D)
        rope(self.positions, q, k, self.cos_sin, self.q_rot, self.k_rot)
        # KV write in torch: padding slots (-1, a masked fault upstream) go to the trash block, never to block 0.
        dest = torch.where(self.slots >= 0, self.slots, self.trash * BS)
        blk, off = dest // BS, dest % BS
        self.kv[blk, 0, off] = self.k_rot
        self.kv[blk, 1, off] = v
        paged_gather(self.kv, self.batch_table, self.gathered)
        keys = self.gathered[:, :, 0].reshape(B, W * BS, H, D)
        vals = self.gathered[:, :, 1].reshape(B, W * BS, H, D)
        scores = torch.einsum("bhd,bthd->bht", self.q_rot, keys) / math.sqrt(D)
        visible = self.t_idx[None, :] <= self.positions[:, None]
        scores = scores.masked_fill(~visible[:, None, :], float("-inf"))
        out = torch.einsum("bht,bthd->bhd", scores.softmax(dim=-1), vals)
        self.tokens.copy_((out.reshape(B, H * D) @ self.wo).argmax(dim=-1))
        # Recurrent state: checkpoint each request's state into its other slot, then update it there.
        self.src_cols.copy_(self.parity.expand(B))
        self.dst_cols.copy_((1 - self.parity).expand(B))
        state_copy(self.state, self.state_table, self.req_rows, self.src_cols, self.dst_cols)
        self.parity.copy_(1 - self.parity)
        # Finished requests start over; their blocks are zeroed.
        nxt = self.positions + 1
        finished = nxt >= MAX_LEN
        self.free_ids[: B * W].copy_(torch.where(finished[:, None], self.batch_table, self.trash).reshape(-1))
        kv_zero(self.kv, self.free_ids)
        self.positions.copy_(torch.where(finished, torch.zeros_like(nxt), nxt))


def inject(engine: ToyEngine, f: Fault, rng: torch.Generator) -> None:
    b = int(torch.randint(0, B, (1,), generator=rng))
    r = int(engine.req_rows_host[b])
    if f.kind == "block":
        f.value = N_BLOCKS + 100_000
        engine.block_table[r, 0] = f.value
        f.entry = f"block_table[{r}, 0] (batch entry {b}: paged_gather row {b * W})"
    elif f.kind == "row":
        f.value = R + 1000
        engine.req_rows[b] = f.value
        f.entry = f"req_rows[{b}]"
    elif f.kind == "count":
        f.value = W + 1
        engine.block_counts[r] = f.value
        f.entry = f"block_counts[{r}] (batch entry {b})"
    elif f.kind == "rope":
        f.value = MAX_LEN + 7
        engine.positions[b] = f.value  # not restored: the request then finishes and starts over
        f.entry = f"positions[{b}]"
    elif f.kind == "last":
        f.value = -3
        engine.free_ids[B * W] = f.value
        f.entry = f"free_ids[{B * W}]"


def restore(engine: ToyEngine, f: Fault) -> None:
    if f.kind == "block":
        engine.block_table.copy_(engine.block_table_host)
    elif f.kind == "row":
        engine.req_rows.copy_(engine.req_rows_host)
    elif f.kind == "count":
        engine.block_counts.fill_(W)
    elif f.kind == "last":
        engine.free_ids[B * W] = N_BLOCKS
