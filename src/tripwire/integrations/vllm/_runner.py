"""The step wrappers both of vLLM's model runners (V1 and V2) share: each runner's per-step state, its lifecycle
(the validator built after the KV cache, the reader started after the captures, the stop checked and the verdict
enqueued around each step) and the verdict taken with the step's sampled tokens.

:mod:`tripwire.integrations.vllm._hooks` installs them with each runner's own step hooks
(:mod:`tripwire.integrations.vllm._v1`, and V2's in the hooks module). They run on every engine step, so each does
the least it can on a clean step (no argument tuples, no allocation, no torch call) and says why where it does more.
``plugin`` is the installed :class:`tripwire.integrations.vllm._hooks._Plugin` (its mode, monitor, containment and
``start``), passed in rather than imported: this module sits below the hooks module.
"""

from __future__ import annotations

import functools
import inspect
import logging
import types
import weakref
from typing import Any

from . import _numerics

log = logging.getLogger("tripwire")

# The methods of both runners this module wraps.
LIFECYCLE = ("initialize_kv_cache", "capture_model", "execute_model", "sample_tokens")


class RunnerState:
    """Per model runner: its validator, its verdict ring (None under flag), the step in progress, and the verdicts
    enqueued and not yet taken (each with its step's output, weakly: an output vLLM dropped untaken, as its V2
    warm-up steps do, releases its verdict)."""

    # Read and written by the wrappers on every step: slots, not an instance dict.
    __slots__ = ("in_step", "inputs_done", "late", "logits", "open", "requests", "ring", "rose", "sample_due", "step",
                 "ticket", "validated", "validator")  # fmt: skip

    def __init__(self, validator: Any, ring: Any, logits: Any = None, requests: Any = None, *, late: bool = False):
        self.validator = validator
        self.ring = ring
        # The logits check (tripwire.integrations.vllm._numerics; None: off) and the step's request numbers for it (a
        # function bound to the runner once: nothing is built per step). ``late``: the logits come after
        # execute_model (V2's sample), so the verdict is enqueued there; ``sample_due``: this step's sample is due.
        self.logits = logits
        self.requests = requests
        self.late = late
        self.sample_due = False
        self.in_step = False
        self.inputs_done = False
        self.validated = False
        # The validator's calls may have raised a count this step: on CUDA always (its launches are asynchronous);
        # on the CPU only when an exact path ran (a clean step leaves the arena as the last verdict saw it).
        self.rose = False
        self.ticket: Any = None
        self.step: Any = None
        self.open: list[tuple[Any, Any]] = []  # (ticket, weakref to the output it rides on), oldest first


def lifecycle(plugin: Any, runner_cls: type, make: Any, *, v1: bool) -> list[tuple[type, str, Any]]:
    """The wrappers of a runner class's lifecycle and step (both runners have these methods): the validator built
    by ``make`` after the KV cache, the reader started after the captures, the stop checked and the verdict
    enqueued around each step, and taken with the sampled tokens (``sample_tokens`` wrapped on the runner instance,
    for the one call after a step that enqueued a verdict: a clean CPU step passes three wrappers, ``execute_model``
    and the two phases' hooks, the scheduler's being off the class then; on CUDA every step enqueues a verdict, since
    the validator's launches are asynchronous, so every step wraps ``sample_tokens`` too)."""
    orig = {name: runner_cls.__dict__[name] for name in LIFECYCLE}
    init_sig = inspect.signature(orig["initialize_kv_cache"])

    @functools.wraps(orig["initialize_kv_cache"])
    def initialize_kv_cache(self: Any, *args: Any, **kwargs: Any) -> Any:
        out = orig["initialize_kv_cache"](self, *args, **kwargs)
        if init_sig.bind(self, *args, **kwargs).arguments.get("is_profiling", False):
            return out  # the memory profile's throw-away cache
        plugin.build(self, make)  # before capture_model: the validator preallocates the arena here
        return out

    @functools.wraps(orig["capture_model"])
    def capture_model(self: Any, *args: Any, **kwargs: Any) -> Any:
        out = orig["capture_model"](self, *args, **kwargs)
        if getattr(self, "_tripwire", None) is not None and not kwargs.get("profile_only", False):
            plugin.start()
        return out

    # Bound once: the step path below reads no setting and resolves no method per step. flag never arms a stop
    # from a verdict: no check then.
    execute = orig["execute_model"]
    check = plugin.monitor.check if plugin.mode != "flag" else None

    def enter(self: Any, st: RunnerState, scheduler_output: Any) -> None:
        # Both execute_model wrappers below, before vLLM's step: two calls a step (one here, one in leave) rather than
        # two copies of the step's bookkeeping.
        if not plugin.started:
            plugin.start()  # the first step comes after vLLM's warm-up and captures
        if check is not None:
            check()  # an armed stop fails this step through vLLM's own error path; the step is reader activity
        # One store each on a slotted object (a tuple assignment would build a tuple): no allocation on the step
        # path. The scheduler output is kept for a verdict that fails every request of the step (its ids).
        st.in_step = True
        st.inputs_done = False
        st.validated = False
        st.rose = False
        st.step = scheduler_output
        st.validator.begin()
        if v1:
            plugin.v1_step = (self, st)

    def done(st: RunnerState) -> None:
        st.in_step = False
        if v1:
            plugin.v1_step = None

    def leave(self: Any, st: RunnerState, out: Any) -> Any:
        if st.logits is not None:
            if st.late:
                # V2: the logits are computed in sample_tokens' sample (wrapped in the hooks module), which checks
                # them and enqueues the verdict after them; sample_tokens takes it.
                st.sample_due = True
                if st.ring is not None:
                    self.sample_tokens = types.MethodType(sample_tokens, self)
                return out
            if v1:
                st.rose = _numerics.v1_logits(self, st.logits, st.requests) or st.rose
        if st.rose and st.ring is not None:
            # After the step's kernels, in their stream order: the verdict copy of the sites' rows. A CPU step whose
            # metadata was clean takes none: nothing could rise, and its verdict would be the clean one.
            enqueue(st)
            if out is not None:  # this runner returned its output from execute_model (no sample_tokens call)
                return take_verdict(plugin, st, out)
            # The verdict goes with the sampled tokens: sample_tokens is wrapped on this runner only, for its next
            # call (an instance attribute over the class's method), so a step without a verdict calls vLLM's own.
            self.sample_tokens = types.MethodType(sample_tokens, self)
        return out

    @functools.wraps(execute)
    def execute_model(self: Any, scheduler_output: Any, *args: Any, **kwargs: Any) -> Any:
        st: RunnerState | None = getattr(self, "_tripwire", None)  # set by initialize_kv_cache: None, unguarded
        if st is None or (kwargs and kwargs.get("dummy_run", False)):  # V1 passes no keywords: no dict lookup
            # V2 runs its warm-up and capture batches through execute_model(dummy_run=True): not a step (the reader
            # starts after the captures, and a dummy batch's metadata is vLLM's own placeholder).
            return execute(self, scheduler_output, *args, **kwargs)
        enter(self, st, scheduler_output)
        try:
            out = execute(self, scheduler_output, *args, **kwargs)
        finally:
            done(st)
        return leave(self, st, out)

    def sample_tokens(self: Any, *args: Any, **kwargs: Any) -> Any:
        self.__dict__.pop("sample_tokens", None)  # one call only: the class's method again from the next step on
        st: RunnerState | None = getattr(self, "_tripwire", None)
        out = type(self).sample_tokens(self, *args, **kwargs)  # the runner's own, through its class
        if st is not None and st.ticket is not None:
            return take_verdict(plugin, st, out)
        return out

    functools.update_wrapper(sample_tokens, orig["sample_tokens"])

    return [
        (runner_cls, "initialize_kv_cache", initialize_kv_cache),
        (runner_cls, "capture_model", capture_model),
        (runner_cls, "execute_model", execute_model),
    ]


def take_verdict(plugin: Any, st: RunnerState, out: Any) -> Any:
    """Take the step's verdict where vLLM waits for the step's sampled tokens: now, for a synchronous output (the
    tokens are on the host: the verdict copy, enqueued before them in stream order, has landed); for an asynchronous
    one (async scheduling), inside its ``get_output``, after vLLM's own wait for the tokens' copy, which the engine
    core calls before the scheduler sees the step. ``None`` (a step that failed before sampling) takes it now."""
    ring, ticket, step = st.ring, st.ticket, st.step
    st.ticket = None
    get = getattr(out, "get_output", None)
    if not callable(get):
        # A verdict of a step that sampled nothing waits on that one copy, bounded (Verdicts.take's wait).
        return plugin.contain.after_step(ring, ticket, step, out, wait=out is None)
    # The output holds its verdict's ticket weakly from the runner's side: an output vLLM drops without asking for
    # it (V2's warm-up steps) releases the ticket at the next enqueue (_release_dropped). The wrapper below holds the
    # output weakly too: no reference cycle keeps a dropped output alive until a garbage collection.
    ref = weakref.ref(out)
    st.open.append((ticket, ref))
    method = type(out).get_output

    def get_output(*args: Any, **kwargs: Any) -> Any:
        o = ref()
        assert o is not None  # called through the output itself
        o.__dict__.pop("get_output", None)
        return plugin.contain.after_step(ring, ticket, step, method(o, *args, **kwargs))

    out.get_output = get_output
    return out


def enqueue(st: RunnerState) -> None:
    """The step's verdict copy, after its kernels in stream order (the outputs of dropped steps released first)."""
    if st.open:
        _release_dropped(st)
    st.ticket = st.ring.enqueue()


def _release_dropped(st: RunnerState) -> None:
    """Forget the taken verdicts of ``st.open``, and take (and drop) those of outputs vLLM dropped without reading
    them: nothing of those steps reached the scheduler or a client, so nothing of theirs can be handed back; their
    counts were reported as always (the reader). Oldest first, so the ring's slots come back in its order. Only the
    thread that runs the steps changes ``st.open`` (an output's ``get_output`` may run on another: it only takes)."""
    keep = []
    for ticket, ref in st.open:
        if ticket.taken:
            continue
        if ref() is not None:
            keep.append((ticket, ref))
            continue
        verdict = st.ring.take(ticket, wait=True)
        if not verdict.clean:
            log.warning(
                "a step whose output vLLM dropped unread had a masked fault (%s); its counts are reported, "
                "no request of it was handed back",
                ", ".join(h.site for h in verdict.hits),
            )
    st.open[:] = keep
