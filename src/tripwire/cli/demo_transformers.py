"""``tripwire demo --engine transformers``: the demo's story inside a real engine, transformers' continuous batching.

A small random-initialised Llama (no download) serves a batch of prompts through ``model.generate_batch``: a clean
run without tripwire (the reference), then with :func:`tripwire.integrations.transformers.install`: a clean run
(identical tokens), a read index corrupted at one step (masked, counted once, the other requests' tokens identical),
a write index corrupted at one step (the FATAL site: the stop arms and the engine fails the batch through its own
error path, the process and the device stay healthy), a clean run after ``reset()`` (identical again), and, installed
with ``contain=True``, a read fault in the step of the last token and a write fault, each failing only the request it
hit, in its step. A summary
table closes the run; the exit status is 0 when every expectation held. CPU by default (the validator runs in the
Triton interpreter); on a GPU the engine runs with CUDA graphs.

The engine helpers here (:func:`tiny_llama`, :func:`cb_config`, :class:`FaultInjector`) are shared by the tests and
the GPU scripts: faults are written into the engine's own metadata tensors after it prepared a step, exactly where a
host-side bug would put them.
"""

from __future__ import annotations

import argparse
import logging
import random
import sys
import time
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass, field
from typing import Any

import torch

__all__ = [
    "FAULT_KINDS",
    "VALUE_KINDS",
    "FaultInjector",
    "Injection",
    "cb_config",
    "main",
    "quiet_engine_logs",
    "run",
    "tiny_llama",
]

log = logging.getLogger("tripwire.demo")

# "page": a bad page id in the engine's own block table (the allocator's, on the host), from which the step's read and
# write indices are built: every index of that page is then out of range. "block_table": the decode fast path's device
# block table (flash-attn only).
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


# ---------------------------------------------------------------------------------------------- the demo
@dataclass
class Scenario:
    name: str
    injected: str
    site: str
    count: int
    expected: int
    engine: str
    ok_requests: int
    failed: int
    changed: int
    passed: bool


def _compare(out: dict[str, Any], ref: dict[str, Any]) -> tuple[int, int, int]:
    ok = sum(1 for k in ref if out.get(k) is not None and out[k].error is None)
    failed = sum(1 for k in ref if out.get(k) is None or out[k].error is not None)
    changed = sum(
        1
        for k in ref
        if out.get(k) is not None and out[k].error is None and out[k].generated_tokens != ref[k].generated_tokens
    )
    return ok, failed, changed


def _device_healthy(device: torch.device) -> bool:
    try:
        x = torch.arange(8, device=device) * 2
        if device.type == "cuda":
            torch.cuda.synchronize(device)
        return int(x.sum()) == 56
    except Exception:
        return False


def main(argv: list[str] | None = None) -> int:
    from .text import help_text

    parser = argparse.ArgumentParser(prog="tripwire demo --engine transformers", description=help_text(__doc__))
    parser.add_argument("--engine", choices=["transformers"], default="transformers")
    parser.add_argument("--device", default=None, help="cpu or cuda (default: cuda when available)")
    parser.add_argument("--no-cuda-graphs", action="store_true", help="on a GPU, run the engine without CUDA graphs")
    parser.add_argument("--tokens", type=int, default=24, help="new tokens per request")
    parser.add_argument("--seed", type=int, default=0)
    args = parser.parse_args(argv)
    logging.basicConfig(level=logging.WARNING, format="%(levelname)s %(name)s: %(message)s")
    with quiet_engine_logs():
        return _demo(args)


class _EngineLogFilter(logging.Filter):
    """The demo's filter on transformers' continuous-batching logger: a repeated psutil complaint (logged at every
    manager's start) passes once, and the engine's error for a stop the demo provokes on purpose (a GuardTripped out
    of its generation loop) keeps its one line and drops the traceback. Every other record, and every other
    exception's traceback, passes unchanged."""

    def __init__(self) -> None:
        super().__init__()
        self.seen: set[str] = set()

    def filter(self, record: logging.LogRecord) -> bool:
        msg = record.getMessage()
        if "psutil" in msg:
            if msg in self.seen:
                return False
            self.seen.add(msg)
        exc = record.exc_info[1] if record.exc_info else None
        if exc is not None:
            from ..errors import GuardTripped

            if isinstance(exc, GuardTripped):
                record.exc_info, record.exc_text = None, None
        return True


@contextmanager
def quiet_engine_logs() -> Iterator[_EngineLogFilter]:
    """For the demo's run only: transformers' continuous-batching logger at ERROR (its INFO/WARNING lines per
    request), through :class:`_EngineLogFilter`; both undone on exit."""
    engine_log = logging.getLogger("ContinuousBatchingLogger")
    level, flt = engine_log.level, _EngineLogFilter()
    engine_log.setLevel(logging.ERROR)
    engine_log.addFilter(flt)
    try:
        yield flt
    finally:
        engine_log.removeFilter(flt)
        engine_log.setLevel(level)


def _demo(args: argparse.Namespace) -> int:
    import tripwire
    from tripwire.integrations import transformers as tw

    device = torch.device(args.device or ("cuda" if torch.cuda.is_available() else "cpu"))
    graphs = device.type == "cuda" and not args.no_cuda_graphs
    model = tiny_llama(device, seed=args.seed)
    cb = cb_config(cuda_graphs=graphs)
    prompts = PROMPTS
    print(
        f"tripwire demo --engine transformers: a random-initialised Llama on {device}"
        f"{' with CUDA graphs' if graphs else ''}, {len(prompts)} requests x {args.tokens} new tokens"
    )
    t0 = time.time()
    ref = run(model, prompts, args.tokens, cb)
    print(f"  reference run without tripwire: {len(ref)} requests in {time.time() - t0:.1f} s")

    monitor = tripwire.Monitor(interval=0.005, report_every=1.0)
    handle = tw.install(model, policy="mask", monitor=monitor)
    rows: list[Scenario] = []
    ids = sorted(ref)
    rng = random.Random(args.seed)

    def scenario(
        name: str, inj: Injection | None, site: str, expected: int, *, expect_stop: bool, contained: bool = False
    ) -> None:
        monitor.reset()
        injector = FaultInjector([inj] if inj else [])
        with injector.active():
            out = run(model, prompts, args.tokens, cb)
        snap = monitor.drain()
        count = sum(h.count for (_, s), h in snap.items() if s == site) if site else sum(h.count for h in snap.values())
        ok, failed, changed = _compare(out, ref)
        healthy = _device_healthy(device)
        stopped = failed == len(ref) and all(
            "GuardTripped" in (out[k].error or "") or "MASKED FAULT" in (out[k].error or "") for k in ref
        )
        engine = ("stopped by tripwire" if stopped else "served") + ("" if healthy else ", DEVICE BROKEN")
        if expect_stop:
            passed = healthy and count == expected and stopped
        elif contained:
            # Exactly the victim fails, with containment's error, in the step of the fault (the same-step verdict:
            # the last step's included); every other request is the clean run's.
            assert inj is not None
            victim_ok = failed == 1 and "contained" in (out[inj.request].error or "")
            engine = "served, 1 request failed" if failed == 1 else engine
            passed = healthy and count == expected and victim_ok and changed == 0
        else:
            passed = healthy and count == expected and failed == 0 and changed <= (1 if inj else 0)
        what = f"{inj.kind} of {inj.request} at step {inj.step}" if inj else "-"
        if inj and not injector.injected:
            what, passed = f"{what} (NOT INJECTED)", False
        rows.append(Scenario(name, what, site or "-", count, expected, engine, ok, failed, changed, passed))

    scenario("clean, installed", None, "", 0, expect_stop=False)
    scenario(
        "read fault",
        Injection("read", 3, ids[rng.randrange(len(ids))], "far"),
        tw.SITE_READ_INDEX,
        1,
        expect_stop=False,
    )
    scenario(
        "write fault",
        Injection("write", 2, ids[rng.randrange(len(ids))], "end"),
        tw.SITE_WRITE_INDEX,
        1,
        expect_stop=True,
    )
    scenario("clean after reset", None, "", 0, expect_stop=False)
    handle.uninstall()
    # Containment: a fault fails only the request it hit, in its own step; the batch goes on. A read in the step that
    # produces the last token (the reader alone would be too late for it), and a masked write (its damage is the
    # writer's own token: under containment it fails that request instead of stopping the engine).
    handle = tw.install(model, policy="mask", monitor=monitor, contain=True)
    scenario(
        "contained read",
        Injection("read", args.tokens, ids[rng.randrange(len(ids))], "far", offset=1),
        tw.SITE_READ_INDEX,
        1,
        expect_stop=False,
        contained=True,
    )
    scenario(
        "contained write",
        Injection("write", 5, ids[rng.randrange(len(ids))], "end"),
        tw.SITE_WRITE_INDEX,
        1,
        expect_stop=False,
        contained=True,
    )
    handle.uninstall()
    monitor.stop()

    from .text import format_table

    table = [("scenario", "injected", "site", "count", "engine", "ok", "failed", "changed", "result")]
    for r in rows:
        result = "PASS" if r.passed else f"FAIL (expected count {r.expected})"
        table.append(
            (
                r.name,
                r.injected,
                r.site,
                str(r.count),
                r.engine,
                str(r.ok_requests),
                str(r.failed),
                str(r.changed),
                result,
            )
        )
    lines = format_table(table, right=(3, 5, 6, 7)).splitlines()
    print()
    print(lines[0])
    print("-" * max(map(len, lines)))
    print("\n".join(lines[1:]))
    ok = all(r.passed for r in rows)
    print()
    print(
        "Every fault was masked, counted once at its site, and the engine and device stayed healthy."
        if ok
        else "Some expectation did not hold (see the table)."
    )
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())
