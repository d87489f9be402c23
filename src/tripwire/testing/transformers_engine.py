"""A real engine to fault: transformers' continuous batching on a small random-initialised Llama (no download), a
persistent engine that keeps its cache across runs, :class:`FaultInjector`, which writes faults into the
engine's own metadata tensors after it prepared a step, exactly where a host-side bug would put them, and
:class:`NanInjector`, which writes NaN into one request's hidden state at a chosen step (a numeric fault). Shared by
``tripwire demo --engine transformers``, the tests and the GPU scripts."""

from __future__ import annotations

import logging
import time
from collections.abc import Iterator
from contextlib import contextmanager
from contextlib import nullcontext as _nullcontext
from dataclasses import dataclass, field
from typing import Any

import torch

log = logging.getLogger("tripwire.demo")

FAULT_KINDS = ("write", "read", "page", "block_table")
# How far out of range an injected entry is: just past the end, far past it, a negative non-padding value.
VALUE_KINDS = ("end", "far", "negative")
PROMPTS = [[1, 2, 3, 4, 5], [6, 7, 8], [9, 10, 11, 12], [13, 14], [15, 16, 17, 18, 19, 20], [21], [22, 23, 24], [25]]


def tiny_llama(device: torch.device | str = "cpu", *, seed: int = 0, layers: int = 2, dtype: torch.dtype | None = None):
    """A random-initialised Llama small enough for the CPU (vocab 128, hidden 64, GQA 4/2 heads)."""
    from transformers import LlamaConfig, LlamaForCausalLM

    torch.manual_seed(seed)
    cfg = LlamaConfig(
        vocab_size=128,
        hidden_size=64,
        intermediate_size=128,
        num_hidden_layers=layers,
        num_attention_heads=4,
        num_key_value_heads=2,
        max_position_embeddings=512,
    )
    model = LlamaForCausalLM(cfg).eval()
    if dtype is not None:
        model = model.to(dtype)
    return model.to(device)


def cb_config(
    *,
    cuda_graphs: bool = False,
    page: int = 16,
    num_blocks: int = 64,
    max_batch_tokens: int = 128,
    max_requests: int = 8,
    **extra: Any,
):
    """A small ContinuousBatchingConfig for the installed transformers (the page size is ``page_size`` from 5.18,
    ``block_size`` before)."""
    from transformers import ContinuousBatchingConfig

    size_key = "page_size" if "page_size" in ContinuousBatchingConfig.__dataclass_fields__ else "block_size"
    sized: dict[str, Any] = {size_key: page}
    return ContinuousBatchingConfig(
        **sized,
        num_blocks=num_blocks,
        max_batch_tokens=max_batch_tokens,
        max_requests_per_batch=max_requests,
        use_cuda_graph=cuda_graphs,
        **extra,
    )


def generation_config(max_new_tokens: int):
    from transformers import GenerationConfig

    return GenerationConfig(max_new_tokens=max_new_tokens, do_sample=False, eos_token_id=-1, pad_token_id=0)


def run(model: Any, prompts: list[list[int]], max_new_tokens: int, cb: Any) -> dict[str, Any]:
    """``generate_batch`` with greedy decoding; returns the engine's outputs by request id."""
    return model.generate_batch(
        prompts, generation_config=generation_config(max_new_tokens), continuous_batching_config=cb
    )


class PersistentEngine:
    """One continuous-batching manager kept across runs, so its CUDA graphs are captured once: ``run`` submits the
    prompts, waits for every result and returns them in prompt order.

    A run the engine failed (a stop) ends its generation loop, and the next run builds a new manager: restarting a
    manager after its loop ended does not work in every supported version (5.17 serves it with stale batch sizes)."""

    def __init__(self, model: Any, max_new_tokens: int, cb: Any, *, warmup: bool = True) -> None:
        self.model, self.max_new_tokens, self.cb, self.warmup = model, max_new_tokens, cb, warmup
        self.manager: Any = None
        self.rebuilds = 0

    def _new_manager(self) -> Any:
        manager = self.model.init_continuous_batching(
            generation_config=generation_config(self.max_new_tokens), continuous_batching_config=self.cb
        )
        if self.warmup:
            manager.warmup()
        manager.start()
        return manager

    def run(self, prompts: list[list[int]], *, tag: str = "run", timeout: float = 120.0) -> list[Any]:
        """Serve ``prompts`` as requests ``"<tag>-<i>"`` (so a test can name the request to corrupt)."""
        if self.manager is not None and not self.manager.is_running():
            # The loop ended since the last run (a stop armed after that run's requests had finished).
            self.manager.stop(block=True, timeout=60)
            self.manager = None
            self.rebuilds += 1
        if self.manager is None:
            self.manager = self._new_manager()
        manager = self.manager
        ids = [f"{tag}-{i}" for i in range(len(prompts))]
        for rid, p in zip(ids, prompts, strict=True):
            manager.add_request(p, request_id=rid, max_new_tokens=self.max_new_tokens)
        results: dict[str, Any] = {}
        deadline = time.monotonic() + timeout
        while len(results) < len(ids):
            if time.monotonic() > deadline:
                raise TimeoutError(f"the engine returned {len(results)} of {len(ids)} results in {timeout} s")
            out = manager.get_result(timeout=0.5)
            if out is not None and out.is_finished():
                results[out.request_id] = out
            elif out is None and not manager.is_running():
                break  # the loop ended (a stop) after delivering every request it failed
        out = [results.get(i) for i in ids]
        # A failure other than containment's (a stop, which fails every request in flight) ends the loop: wait for it
        # (its final drain included); the next run gets a new manager. A request failed alone leaves the loop running.
        if any(o is None or (o.error is not None and "tripwire contained" not in o.error) for o in out):
            manager.stop(block=True, timeout=60)
            self.manager = None
            self.rebuilds += 1
        return out

    def close(self) -> None:
        if self.manager is not None:
            self.manager.stop(block=True, timeout=60)
            self.manager = None


# ---------------------------------------------------------------------------------------------- fault injection
@dataclass(frozen=True)
class Injection:
    """Write ``value_kind`` into the ``kind`` metadata of request ``request`` at engine step ``step`` (1-based: the
    steps the scheduler prepared); ``offset`` picks the entry inside the request's span (modulo its length)."""

    kind: str
    step: int
    request: str
    value_kind: str = "far"
    offset: int = 0

    def __post_init__(self) -> None:
        if self.kind not in FAULT_KINDS:
            raise ValueError(f"kind={self.kind!r}: expected one of {FAULT_KINDS}")
        if self.value_kind not in VALUE_KINDS:
            raise ValueError(f"value_kind={self.value_kind!r}: expected one of {VALUE_KINDS}")


@dataclass
class Injected:
    """An injection that happened: the step, the request, the entry's position and the value written (a page
    injection: the block-table column and the page id, and ``entries``, the bad indices built from it per kind)."""

    injection: Injection
    step: int
    position: int
    value: int
    entries: dict[str, int] = field(default_factory=dict)


def _bad_value(value_kind: str, hi: int) -> int:
    return {"end": hi, "far": hi + (1 << 40), "negative": -5}[value_kind]


@dataclass
class FaultInjector:
    """Corrupts the engine's prepared metadata (see the module docstring). Use as a context manager around
    ``generate_batch``; ``injected`` lists what was written, ``pending`` what never found its request and path.
    A block-table injection happens only on a step the engine runs with a block table (its decode fast path)."""

    injections: list[Injection]
    injected: list[Injected] = field(default_factory=list)
    steps: int = 0

    @property
    def pending(self) -> list[Injection]:
        done = {id(i.injection) for i in self.injected}
        return [j for j in self.injections if id(j) not in done]

    @contextmanager
    def active(self) -> Iterator[FaultInjector]:
        from transformers.generation.continuous_batching.cache import PagedAttentionCache
        from transformers.generation.continuous_batching.continuous_api import ContinuousBatchProcessor

        original = ContinuousBatchProcessor.__dict__["prepare_next_batch"]
        extend = PagedAttentionCache.__dict__["extend_read_and_write_indices"]
        injector = self
        applied: list[tuple[Injection, int, int]] = []  # this step's page injections: (injection, column, bad id)

        def prepare_next_batch(processor: Any, *args: Any, **kwargs: Any) -> Any:
            applied.clear()
            ready = original(processor, *args, **kwargs)
            if ready:
                injector.steps += 1
                injector._pages_built(processor, applied)
                injector._inject(processor)
            return ready

        def extend_read_and_write_indices(cache: Any, request_id: str, *args: Any, **kwargs: Any) -> Any:
            # A page fault: the request's block table holds a bad page id while the engine builds this step's indices
            # from it (after scheduling allocated the step's blocks: the allocator never sees the bad id), and the
            # real page is back before anything else reads the table (so a bad id never reaches the free list).
            due = [
                i
                for i in injector.pending
                if i.kind == "page"
                and i.step <= injector.steps + 1
                and i.request == request_id
                and all(i is not a for a, _, _ in applied)
            ]
            written = [(i, injector._page(cache, i)) for i in due]
            try:
                return extend(cache, request_id, *args, **kwargs)
            finally:
                for i, saved in reversed(written):
                    if saved:
                        table, col, _page = saved[0]
                        applied.append((i, col, table[col]))  # the bad id, read before the real page goes back
                    for table, col, page in reversed(saved):
                        table[col] = page

        ContinuousBatchProcessor.prepare_next_batch = prepare_next_batch  # type: ignore[method-assign,assignment]
        PagedAttentionCache.extend_read_and_write_indices = extend_read_and_write_indices  # type: ignore[method-assign,assignment]
        try:
            yield self
        finally:
            ContinuousBatchProcessor.prepare_next_batch = original  # type: ignore[method-assign]
            PagedAttentionCache.extend_read_and_write_indices = extend  # type: ignore[method-assign]

    @staticmethod
    def _page(cache: Any, inj: Injection) -> list[tuple[list[int], int, int]]:
        """Write a page injection's bad page id into its request's block table, in every attention group's allocator
        (5.18+: ``cache_allocators``; 5.17: ``group_cache_managers``): (table, column, the page it held) per write."""
        from ..integrations.transformers import _cache_groups

        allocators = (
            cache.cache_allocators.values() if hasattr(cache, "cache_allocators") else cache.group_cache_managers
        )
        bad = _bad_value(inj.value_kind, int(_cache_groups(cache)[0].pages or 0))
        out = []
        for alloc in allocators:
            table = alloc.block_table.get(inj.request)
            if table:
                col = inj.offset % len(table)
                out.append((table, col, table[col]))
                table[col] = bad
        return out

    def _pages_built(self, processor: Any, applied: list[tuple[Injection, int, int]]) -> None:
        """Record the page injections applied in this step: the bad indices the engine built from the page."""
        from ..integrations.transformers import _cache_groups

        if not applied:
            return
        io = processor.inputs_and_outputs
        target = io.io_pairs[io.current_pair].host_io if hasattr(io, "io_pairs") else io
        group = _cache_groups(processor.cache)[0]
        batch = [fs.state.request_id for fs in target.requests_in_batch]
        for inj, col, bad in applied:
            b = batch.index(inj.request)
            entries = {}
            for kind, storage in (("write", target.write_index_storage), ("read", target.read_index_storage)):
                spans = [self._span(kind, fs) for fs in target.requests_in_batch]
                start = sum(spans[:b])
                span = storage[0, start : start + spans[b]].cpu()  # a test tool: this sync is deliberate
                entries[kind] = int(((span < 0) | (span >= group.rows)).sum())
            self.injected.append(Injected(inj, self.steps, col, bad, entries))

    def _inject(self, processor: Any) -> None:
        from ..integrations.transformers import _cache_groups

        io = processor.inputs_and_outputs
        target = io.io_pairs[io.current_pair].host_io if hasattr(io, "io_pairs") else io
        group = _cache_groups(processor.cache)[0]
        for inj in self.pending:
            if inj.step > self.steps or inj.kind == "page":
                continue
            batch = [fs.state.request_id for fs in target.requests_in_batch]
            if inj.request not in batch or (inj.kind == "block_table") != bool(target.use_block_table):
                continue  # not in this step, or not this path: try the next step
            if inj.kind == "read" and getattr(target, "max_kv_read", 1) == 0:
                continue  # a step with no past to read (a first prefill) passes no read index: try the next step
            b = batch.index(inj.request)
            if inj.kind == "block_table":
                width = target.block_table.shape[-1]
                pos = b * width + inj.offset % max(1, self._blocks(target.requests_in_batch[b], processor))
                value = _bad_value(inj.value_kind, int(group.pages or 0))
                target.block_table[0].view(-1)[pos] = value
            else:
                spans = [self._span(inj.kind, fs) for fs in target.requests_in_batch]
                start = sum(spans[:b])
                pos = start + inj.offset % spans[b]
                value = _bad_value(inj.value_kind, group.rows)
                storage = target.write_index_storage if inj.kind == "write" else target.read_index_storage
                storage[0, pos] = value
            self.injected.append(Injected(inj, self.steps, pos, value))

    @staticmethod
    def _span(kind: str, fs: Any) -> int:
        # Entries per request in the step's index tensors: its new tokens (writes), its whole context (reads).
        if kind == "write":
            return int(fs.query_length)
        return int(fs.state.position_offset)  # past + new: already advanced by this step's preparation

    @staticmethod
    def _blocks(fs: Any, processor: Any) -> int:
        page = int(processor.cache.cache_allocators["full_attention"].tokens_per_page)
        return -(-int(fs.state.position_offset) // page)


# ---------------------------------------------------------------------------------------------- numeric faults
@dataclass
class NanInjected:
    """A NaN injection that happened: the step, the request, its first token row in the step and its token count,
    and ``row``, its row among the step's sampled logits rows (None: it samples no token this step)."""

    step: int
    request: str
    token: int
    tokens: int
    row: int | None


class NanInjector:
    """Writes NaN into one request's rows of the last decoder layer's output at one engine step (1-based, the steps
    the scheduler prepared), the way a numeric fault in the model would put it there: its logits row that step is
    NaN, nothing else (its K/V were written before, inside that layer's attention).

    Build it on the model BEFORE the engine captures CUDA graphs: its forward hook reads a device mask of token rows
    (all False but at the chosen step), so a captured graph replays the injection too. ``active(request, step)``
    arms one injection around a run; ``injected`` lists what happened; ``remove()`` takes the hook off."""

    def __init__(self, model: Any, *, max_tokens: int = 4096) -> None:
        self.mask = torch.zeros(max_tokens, dtype=torch.bool, device=model.device)
        self._hook = model.model.layers[-1].register_forward_hook(self._write)
        self.injected: list[NanInjected] = []
        self.steps = 0

    def _write(self, module: Any, args: Any, output: Any) -> None:
        hidden = output[0] if isinstance(output, tuple) else output
        hidden.masked_fill_(self.mask[: hidden.shape[1]].view(1, -1, 1), float("nan"))

    def remove(self) -> None:
        self._hook.remove()

    @contextmanager
    def active(self, request: str, step: int) -> Iterator[NanInjector]:
        from transformers.generation.continuous_batching.continuous_api import ContinuousBatchProcessor

        original = ContinuousBatchProcessor.__dict__["prepare_next_batch"]
        injector = self
        self.steps = 0
        self.injected = []

        def prepare_next_batch(processor: Any, *args: Any, **kwargs: Any) -> Any:
            ready = original(processor, *args, **kwargs)
            if ready:
                injector.steps += 1
                injector._arm(processor, request if injector.steps == step else None)
            return ready

        ContinuousBatchProcessor.prepare_next_batch = prepare_next_batch  # type: ignore[method-assign,assignment]
        try:
            yield self
        finally:
            ContinuousBatchProcessor.prepare_next_batch = original  # type: ignore[method-assign]
            self.mask.zero_()

    def _arm(self, processor: Any, request: str | None) -> None:
        io = processor.inputs_and_outputs
        target = io.io_pairs[io.current_pair].host_io if hasattr(io, "io_pairs") else io
        stream = io.compute_stream if self.mask.is_cuda else None
        # On the engine's compute stream: the step's forward (and a replayed graph) reads the mask in stream order.
        with torch.cuda.stream(stream) if stream is not None else _nullcontext():
            self.mask.zero_()
            token = row = 0
            for fs in target.requests_in_batch:
                if request is not None and fs.state.request_id == request:
                    self.mask[token : token + fs.query_length] = True
                    hit_row = row if fs.has_new_token else None
                    self.injected.append(NanInjected(self.steps, request, token, int(fs.query_length), hit_row))
                token += int(fs.query_length)
                row += int(bool(fs.has_new_token))
