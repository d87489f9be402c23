"""Validators: guard the metadata of kernels you cannot edit, on the device, in one launch per call.

Most indexed kernels an engine runs are not tripwire's (FlashAttention, FlashInfer, CUTLASS, the engine's CUDA
kernels, torch's own ``index_select``/``index_copy_``). One bad entry in the metadata they read is an illegal memory
access (the CUDA context is poisoned: every later CUDA call fails) or a silent write into another tensor. A
:class:`Validator` checks a step's metadata BEFORE those kernels run, counts every bad entry at a site like a guard
does, and with ``policy="mask"`` rewrites each bad entry in place to a safe value, so what follows reads only
in-range memory::

    from tripwire.validate import Validator
    v = Validator("engine", device, policy="mask")          # before capture: registers one site per rule
    v.index("slot_mapping", hi=num_slots, padding=-1, fatal=True)
    v.index("block_table", hi=num_blocks, safe=0, lengths="blocks_per_req")   # only the used columns of each row
    v.csr("kv_indices", indptr="kv_indptr", hi=num_pages, safe=0)
    v(slot_mapping=sm, block_table=bt, blocks_per_req=n, kv_indices=ki, kv_indptr=kp)   # one launch, every rule

Contract:

* A call on CUDA tensors is ONE Triton launch for every rule, with no device sync and no allocation: it is captured
  into a CUDA graph like any kernel, and under ``torch.compile`` it is the custom op ``torch.ops.tripwire.validate``
  (which declares the tensors and the counter arena as mutated, so the compiler keeps and orders it). Its first
  call for a set of rules and dtypes compiles the kernel, and its twin for a register cap
  (tripwire.triton.budget_choice), as any Triton kernel's first launch compiles: make it before a capture. A call
  on CPU tensors is one pass of plain torch ops over every rule (host reads of host tensors, no interpreter).
* Each bad entry counts exactly once per call, at the rule's site (``"<validator>.<rule>"``). First offender:
  row = the entry's first-dimension index (the request row of a table, the token of a slot mapping, the position
  in a CSR indices array), value = the bad value.
* Masking replaces a bad entry by ``safe`` (default: ``padding``); it turns an illegal access into a read or write
  of a known-harmless place, NOT into a correct result: the site's report says so.
* Under ``policy="flag"`` the tensors are left untouched (the downstream kernel still faults: diagnosis only).
* Entries in an engine's unused space are not checked: past a row's ``lengths`` for a 2-D table, past the last row's
  end for a CSR layout.

Backends: CUDA tensors run the Triton kernel (:mod:`tripwire.validate._triton`; triton is imported at the first
validator of that backend, never for a torch one). CPU tensors (CPU engines, such as vLLM's CPU build) run a plain
torch implementation (:mod:`tripwire.validate._torch`) with the same counts, offenders, masking and arena words, and
need neither triton nor its interpreter. Before its exact path the CPU path runs the host clean test, which each
declared :class:`Rule` offers too (``rule.clean(values)``, ``rule.clean_lengths(counts, width)``,
``rule.clean_indptr(indptr, n)``): an engine adapter can read its metadata as plain integers and skip a call that
would count and change nothing.
``Validator(..., backend="triton")`` on CPU tensors runs the kernel instead, under Triton's interpreter: the two
backends compared on the same calls (:data:`BACKENDS`).
"""

from __future__ import annotations

from collections.abc import Callable, Iterable, Mapping
from dataclasses import dataclass
from types import ModuleType
from typing import Any

import torch

from .._default import default_monitor
from .._runtime.arena import normalize_device
from ..monitor import Monitor
from ..sites import Site
from . import _rules as _r
from . import _torch as _validate_torch

__all__ = ["BACKENDS", "POLICIES", "Rule", "Validator"]

POLICIES = ("mask", "flag")
BACKENDS = ("triton", "torch")
_INDEX_DTYPES = (torch.int32, torch.int64)
_INDEX_DTYPE_SET = frozenset(_INDEX_DTYPES)
_I64_MIN, _I64_MAX = -(1 << 63), (1 << 63) - 1


@dataclass(frozen=True)
class Rule:
    """A declared rule. ``kind`` is ``"index"`` or ``"csr"``; ``aux`` names its lengths (index) or indptr (csr)
    tensor, or is None; ``site``/``aux_site`` are where its bad entries (and bad aux entries) count; ``requests``/
    ``segments`` name its attribution tensors (None: its offenders carry no request)."""

    kind: str
    name: str
    lo: int
    hi: int
    padding: int | None
    safe: int | None
    aux: str | None
    site: Site
    aux_site: Site | None
    requests: str | None = None
    segments: str | None = None

    # The host clean test, per rule: the same test the CPU path runs before its exact path (and vLLM's CPU step
    # check before calling the validator at all), from tripwire.validate._rules, where it is written once.
    def clean(self, values: Iterable[int]) -> bool:
        """True when the validator would count none of ``values`` as entries of this rule: each is in
        ``[lo, hi)`` or is the rule's padding (no values: True). Every value is tested, so for a table or CSR rule
        pass the used entries or all of them (all clean means the used ones are). ``values`` is left as it is."""
        return _r.entries_clean(list(values), self.lo, self.hi, self.padding)

    def clean_lengths(self, counts: Iterable[int], width: int) -> bool:
        """True when every per-row count of this table rule's ``lengths`` is in ``[0, width]`` (``width``: the
        table's columns), so the validator counts and clamps none. ValueError for a rule without lengths."""
        if self.kind != "index" or self.aux is None:
            raise ValueError(f"rule {self.name!r} has no lengths tensor (only a 2-D index rule declared with lengths=)")
        return _r.lengths_clean(list(counts), _int_arg(f"rule {self.name!r}: width", width))

    def clean_indptr(self, indptr: Iterable[int], num_indices: int) -> bool:
        """True when this CSR rule's ``indptr`` starts at 0, never decreases and ends within ``num_indices`` (the
        indices' length), so the validator counts and rewrites none of it (an empty indptr: False, the validator
        refuses it). ValueError for an index rule."""
        if self.kind != "csr":
            raise ValueError(f"rule {self.name!r} is an index rule; only a CSR rule has an indptr")
        return _r.indptr_clean(list(indptr), _int_arg(f"rule {self.name!r}: num_indices", num_indices))


def _int_arg(what: str, v: object) -> int:
    if isinstance(v, bool) or not isinstance(v, int):
        raise TypeError(f"{what} must be an int, got {type(v).__name__} {v!r}")
    if not _I64_MIN <= v <= _I64_MAX:
        raise ValueError(f"{what}={v} does not fit in int64")
    return v


def _opt_int(what: str, v: object) -> int | None:
    return None if v is None else _int_arg(what, v)


_KERNEL: ModuleType | None = None


def _kernel() -> ModuleType:
    """The Triton backend, imported at first use: a CPU-only process (vLLM's CPU build) never imports triton."""
    global _KERNEL
    if _KERNEL is None:
        from . import _launcher  # noqa: F401  (the bound launch's module, imported with the kernel's)
        from . import _triton as _validate_kernel

        _KERNEL = _validate_kernel
    return _KERNEL


def _backend(name: str, device: torch.device, backend: str | None) -> str:
    """The backend a validator on ``device`` runs (``backend``: the one asked for, None for the device's own)."""
    if backend is None:
        return "torch" if device.type == "cpu" else "triton"
    if backend == "torch" and device.type != "cpu":
        raise ValueError(
            f"validator {name!r}: backend='torch' reads its tensors on the host, so it takes CPU tensors only; a "
            f"validator on {device} runs the Triton kernel (backend='triton')"
        )
    if backend == "triton" and device.type == "cpu":
        from ..triton._callee import interpreting, recording

        if not interpreting() and not recording():
            raise RuntimeError(
                f"validator {name!r}: backend='triton' on the CPU runs the kernel under Triton's interpreter, and "
                f"Triton compiles kernels for a GPU in this process: set TRITON_INTERPRET=1 before triton is first "
                f"imported, or build it inside tripwire.resources.capture_launches (its launches recorded, not run)"
            )
    return backend


class Validator:
    """A set of rules over one step's metadata, checked (and, under ``mask``, repaired) in one launch per call.

    Args:
        name: prefix of every site this validator registers (``"<name>.<rule>"``).
        device: where the metadata lives. The monitor's arena for it is allocated here, so build validators
            before capturing (declaring rules and calling allocate nothing afterwards).
        policy: ``"mask"`` (count and rewrite bad entries to the rule's safe value) or ``"flag"`` (count only).
        monitor: whose arena and registry hold the sites (default: the default monitor).
        backend: what runs a call: ``"triton"`` (the Triton kernel, one launch) or ``"torch"`` (plain torch ops
            with host reads: CPU only). Default: ``"triton"`` on CUDA, ``"torch"`` on the CPU. ``"triton"`` on
            the CPU runs the kernel under Triton's interpreter (``TRITON_INTERPRET=1``, set before triton is first
            imported), or records its launch (:func:`tripwire.resources.capture_launches`): to compare the two
            backends word for word, or to read the kernel's compiled build for a GPU from CPU tensors. Fixed here,
            read by no call; under ``torch.compile`` the custom op runs the device's default backend.
        fault_calls: the Triton backend's build: ``True``, its out-of-line fault functions call the record's
            atomics (``tripwire.triton.record_hits``' ``CALLS``); ``False``, they inline them. Both count, record
            and mask the same; they differ in the registers the compiler allocates the kernel. ``None`` (default):
            per compiled kernel, the build that fits its twin's register allocation (the register budget compiles
            the second only when the first does not fit). Forcing one is for comparing the two (their registers:
            :func:`tripwire.resources.capture_launches`, ``tripwire resources``) or for keeping off a build that a
            Triton release compiles wrongly; its register cap is still found. ``ValueError`` for the torch backend.
    """

    def __init__(
        self,
        name: str,
        device: torch.device | str | int,
        *,
        policy: str = "mask",
        monitor: Monitor | None = None,
        backend: str | None = None,
        fault_calls: bool | None = None,
    ) -> None:
        if not isinstance(name, str) or not name.strip() or name != name.strip():
            raise ValueError(f"a validator name must be a non-empty string without surrounding spaces, got {name!r}")
        if policy not in POLICIES:
            raise ValueError(f"policy={policy!r} is not a validator policy; expected one of {', '.join(POLICIES)}")
        if backend is not None and backend not in BACKENDS:
            raise ValueError(f"backend={backend!r} is not a validator backend; expected one of {', '.join(BACKENDS)}")
        self.name = name
        self.policy = policy
        self.monitor = monitor if monitor is not None else default_monitor()
        self.device = normalize_device(device)
        self.backend = _backend(name, self.device, backend)
        if fault_calls is not None and (not isinstance(fault_calls, bool) or self.backend != "triton"):
            raise ValueError(
                f"validator {name!r}: fault_calls={fault_calls!r} picks a build of the Triton kernel: True, False or "
                f"None, and only for backend='triton' (this one runs {self.backend!r})"
            )
        self.fault_calls = fault_calls
        # The arena never moves (captured graphs hold its address): resolve it once, here, before any capture.
        self._arena = self.monitor.prealloc(self.device)
        # The fast host check of a tensor's device (Validator._fast): attribute reads, no torch.device built.
        index = self.device.index
        self._on_device: Callable[[torch.Tensor], bool] = (
            (lambda t: t.is_cuda and t.get_device() == index) if self.device.type == "cuda" else (lambda t: t.is_cpu)
        )
        # Static for torch.compile(mode="reduce-overhead"): the op writes it in place, where the reader looks.
        torch._dynamo.mark_static_address(self._arena)
        self._offenders = self.monitor.arena.offenders(self.device)
        if self.backend == "triton":
            _kernel()  # imported (and triton with it) here, before any capture, not at the first call
        self._rules: dict[str, Rule] = {}
        self._aux_owner: dict[str, str] = {}  # lengths/indptr name -> the first rule that uses it (it checks it)
        # Every tensor of a call that is not a rule's: name -> "lengths", "indptr", "requests" or "segments".
        self._aux_kind: dict[str, str] = {}
        self._plan: _Plan | None = None

    # ------------------------------------------------------------------ diagnostics
    @property
    def launch_path(self) -> str:
        """How an eager call runs now: ``"torch"`` (the torch backend's pass of torch ops), ``"jit"`` (the Triton
        kernel through its JITFunction: before the first call, under Triton's interpreter, and while a Triton launch
        hook such as a profiler's is installed, so that the hook sees every launch with its metadata) or
        ``"triton"`` (a compiled kernel's own launcher, bound at the first call of its specialisation: the cheapest
        host path; a call of a specialisation not bound yet still goes through the JITFunction once, which binds
        it). For a kernel engineer reading a profile: a CUDA validator that stays on ``"jit"`` pays the
        JITFunction's host cost at every call. Read when asked; no call reads it."""
        if self.backend == "torch":
            return "torch"
        plan = self._plan
        return "jit" if plan is None or plan.launch is None else plan.launch.path

    @property
    def kernels(self) -> tuple[Any, ...]:
        """The compiled kernels the Triton backend's calls have bound (Triton ``CompiledKernel`` objects), in the
        order their first calls came: one per specialisation Triton compiled the calls to (the tensors' dtypes, and
        per tensor and size what Triton specialises a tuple element on: a size of 1, a multiple of 16, past int32, a
        16-byte aligned address). Read their registers (``n_regs``, ``n_spills``), their code (``asm``) or their
        specialisation (``src``); a count that keeps growing is a workload whose calls keep compiling. Empty for the
        torch backend, under the interpreter, and before a first call; while a launch hook keeps every call on the
        JITFunction nothing new is bound (the kernels bound before stay)."""
        plan = self._plan
        return () if plan is None or plan.launch is None else plan.launch.kernels

    # ------------------------------------------------------------------ declaring
    @property
    def rules(self) -> Mapping[str, Rule]:
        return dict(self._rules)

    @property
    def names(self) -> tuple[str, ...]:
        """Every tensor name a call must pass: the rules', then their lengths/indptr/requests/segments tensors'."""
        return (*self._rules, *self._aux_kind)

    def index(
        self,
        name: str,
        *,
        hi: int,
        lo: int = 0,
        padding: int | None = None,
        safe: int | None = None,
        lengths: str | None = None,
        fatal: bool = False,
        description: str = "",
        site: str | None = None,
        requests: str | None = None,
        segments: str | None = None,
    ) -> Site:
        """Declare an index rule: an entry of tensor ``name`` (1-D, or 2-D) is bad when it is not ``padding`` and
        not in ``[lo, hi)``. For a 2-D table, ``lengths`` names a per-row count passed in the same call: entries past
        a row's count are not checked, and a count outside ``[0, width]`` is itself counted at
        ``"<validator>.<lengths>"`` (clamped into the range under mask). ``site`` overrides the site name (rules of
        several groups of one engine can share one site). Returns the rule's site.

        Attribution: ``requests`` names a tensor of request ids (int, negative = none) that the rule's offenders
        carry: ``requests[row]`` for the row of each bad entry, or, with ``segments`` (an offsets tensor like
        ``cu_seq_lens``: row ``r`` is in segment ``b`` when ``segments[b] <= r < segments[b + 1]``),
        ``requests[b]``. Looked up on the fault path only."""
        return self._declare(
            "index", name, hi, lo, padding, safe, lengths, fatal, description, site, requests, segments
        )

    def csr(
        self,
        name: str,
        *,
        indptr: str,
        hi: int,
        lo: int = 0,
        padding: int | None = None,
        safe: int | None = None,
        fatal: bool = False,
        description: str = "",
        site: str | None = None,
        requests: str | None = None,
    ) -> Site:
        """Declare a CSR rule (FlashInfer's paged layout, paged prefill): 1-D indices ``name`` whose rows are
        ``[indptr[b], indptr[b+1])``. Only used entries are checked (up to the last row's end). A broken indptr (not
        non-decreasing from 0, or past the indices' length) counts at ``"<validator>.<indptr>"``, one count per bad
        indptr entry (row = its position); under mask each bad entry is replaced by the last good one before it, which
        empties the row that ends there and keeps every row in range. Indices count at ``"<validator>.<name>"``.
        ``requests``: the request id of each CSR row (``requests[b]`` for a bad entry of row ``b``)."""
        if not isinstance(indptr, str):
            raise TypeError(f"indptr must name the indptr tensor (a str), got {type(indptr).__name__}")
        return self._declare("csr", name, hi, lo, padding, safe, indptr, fatal, description, site, requests, None)

    def _declare(
        self,
        kind: str,
        name: str,
        hi: object,
        lo: object,
        padding: object,
        safe: object,
        aux: str | None,
        fatal: bool,
        description: str,
        site: str | None,
        requests: str | None,
        segments: str | None,
    ) -> Site:
        what = f"validator {self.name!r}, rule {name!r}"
        if not isinstance(name, str) or not name.isidentifier():
            raise ValueError(
                f"validator {self.name!r}: a rule name must be a Python identifier (it is a keyword of "
                f"the call), got {name!r}"
            )
        if name in self._rules or name in self._aux_kind:
            raise ValueError(f"{what}: the name {name!r} is already declared in this validator")
        hi_i, lo_i = _int_arg(f"{what}: hi", hi), _int_arg(f"{what}: lo", lo)
        if hi_i <= lo_i:
            raise ValueError(f"{what}: hi={hi_i} must be > lo={lo_i} (an empty range would make every entry bad)")
        pad_i, safe_i = _opt_int(f"{what}: padding", padding), _opt_int(f"{what}: safe", safe)
        fill = safe_i if safe_i is not None else pad_i
        if self.policy == "mask":
            if fill is None:
                raise ValueError(
                    f"{what}: policy 'mask' needs a value to rewrite bad entries to: give safe= (an in-range value) "
                    f"or padding="
                )
            if fill != pad_i and not lo_i <= fill < hi_i:
                raise ValueError(
                    f"{what}: safe={fill} is outside [{lo_i}, {hi_i}) and is not the padding value: masking to it "
                    f"would not make the access safe"
                )
        extras = {"lengths" if kind == "index" else "indptr": aux, "requests": requests, "segments": segments}
        if segments is not None and requests is None:
            raise ValueError(f"{what}: segments={segments!r} maps rows to segments of a requests= tensor: give both")
        for role, extra in extras.items():
            if extra is None:
                continue
            if not isinstance(extra, str) or not extra.isidentifier():
                raise ValueError(f"{what}: {role}= must name a tensor of the call (an identifier), got {extra!r}")
            if extra == name or extra in self._rules:
                raise ValueError(f"{what}: {role}={extra!r} is already the name of a rule")
            if self._aux_kind.get(extra, role) != role or sum(e == extra for e in extras.values()) > 1:
                raise ValueError(f"{what}: {extra!r} is already declared as a {self._aux_kind.get(extra, role)} tensor")
        site_name = site if site is not None else f"{self.name}.{name}"
        if not isinstance(site_name, str) or not site_name.strip():
            raise ValueError(f"{what}: site must be a non-empty string, got {site!r}")
        desc = description or (
            self._describe(kind, name, aux)
            if site is None
            else f"validator {self.name!r}: an out-of-range entry of a rule counting at {site_name!r}"
        )
        main_site = self.monitor.registry.register(site_name, description=desc, fatal=fatal)
        aux_site = None
        if aux is not None:
            aux_site = self.monitor.registry.register(
                f"{self.name}.{aux}",
                description=(
                    f"validator {self.name!r}: a per-row count of {aux!r} outside [0, the table's width]"
                    if kind == "index"
                    else f"validator {self.name!r}: CSR indptr {aux!r} not non-decreasing from 0 within its indices"
                ),
            )
        for s in (main_site, aux_site):
            if s is not None and s.id >= self.monitor.settings.capacity:
                raise ValueError(
                    f"{what}: site {s.name!r} holds row {s.id} but the arena has {self.monitor.settings.capacity} "
                    f"rows (raise TRIPWIRE_CAPACITY)"
                )
        self._rules[name] = Rule(kind, name, lo_i, hi_i, pad_i, fill, aux, main_site, aux_site, requests, segments)
        if aux is not None:
            self._aux_owner.setdefault(aux, name)
        for role, extra in extras.items():
            if extra is not None:
                self._aux_kind[extra] = role
        self._plan = None
        return main_site

    def _describe(self, kind: str, name: str, aux: str | None) -> str:
        # No bounds here: a site's description is fixed at its first registration, while a later validator of the
        # same name (a new engine cache, say) may declare other bounds for it.
        if kind == "csr":
            return f"validator {self.name!r}: an out-of-range entry of CSR indices {name!r} (rows from {aux!r})"
        used = f" (the first {aux!r}[row] entries of each row)" if aux is not None else ""
        return f"validator {self.name!r}: an out-of-range entry of {name!r}{used}"

    def sites(self) -> dict[str, Site]:
        """Rule (and lengths/indptr) name -> the site it counts at."""
        out = {n: r.site for n, r in self._rules.items()}
        for aux, owner in self._aux_owner.items():
            aux_site = self._rules[owner].aux_site
            assert aux_site is not None
            out[aux] = aux_site
        return out

    # ------------------------------------------------------------------ calling
    def _build_plan(self) -> _Plan:
        names = self.names
        pos = {n: i for i, n in enumerate(names)}
        ndims: dict[str, tuple[int, ...]] = {n: (1,) for n in names}  # aux tensors and CSR indices are 1-D
        with_lengths: list[tuple[str, str]] = []
        cols: dict[str, list] = {f: [] for f in _r.Rules.__dataclass_fields__}
        for name, r in self._rules.items():
            has_len = r.kind == "index" and r.aux is not None
            if r.kind == "index":
                ndims[name] = (2,) if has_len else (1, 2)
            if has_len:
                assert r.aux is not None
                with_lengths.append((name, r.aux))
            row = (
                ("kind", _r.CSR if r.kind == "csr" else _r.INDEX),
                ("has_pad", r.padding is not None),
                ("has_len", has_len),
                ("own_aux", r.aux is not None and self._aux_owner[r.aux] == name),
                ("lo", r.lo),
                ("hi", r.hi),
                ("pad", r.padding if r.padding is not None else 0),
                ("safe", r.safe if r.safe is not None else 0),
                ("row", r.site.id),
                ("aux_row", r.aux_site.id if r.aux_site is not None else r.site.id),
                ("tensor", pos[name]),
                ("aux", pos[r.aux] if r.aux is not None else pos[name]),
                ("req", 0 if r.requests is None else (1 if r.kind == "index" and r.segments is None else 2)),
                ("requests", pos[r.requests] if r.requests is not None else pos[name]),
                ("segments", pos[r.segments] if r.segments is not None else pos[name]),
            )
            for field_name, value in row:
                cols[field_name].append(value)
        rules = _r.Rules(**{f: tuple(v) for f, v in cols.items()})
        whats = tuple(f"validator {self.name!r}: {n!r}" for n in names)
        # The Triton backend: the launch bound once per plan (the eager host cost); the torch path needs no launcher
        # (and no triton).
        launcher = None
        if self.backend == "triton":
            from ._launcher import Launcher

            launcher = Launcher(self._arena, rules, mask=self.policy == "mask", fault_calls=self.fault_calls)
        self._plan = _Plan(
            names,
            whats,
            tuple(ndims[n] for n in names),
            rules,
            _spec(rules),
            tuple(with_lengths),
            tuple(n for n, kind in self._aux_kind.items() if kind == "indptr"),
            launcher,
        )
        return self._plan

    def _check(self, what: str, t: object, ndims: tuple[int, ...]) -> torch.Tensor:
        if not isinstance(t, torch.Tensor):
            raise TypeError(f"{what} must be a torch.Tensor, got {type(t).__name__}")
        if t.dtype not in _INDEX_DTYPES:
            raise TypeError(f"{what} must be int32 or int64, got {str(t.dtype).replace('torch.', '')}")
        if t.device != self.device:
            raise ValueError(f"{what} is on {t.device} but validator {self.name!r} is on {self.device}")
        if t.dim() not in ndims:
            want = " or ".join(f"{d}-D" for d in ndims)
            raise ValueError(f"{what} must be {want}, got shape {tuple(t.shape)}")
        # The kernel computes flat offsets: a strided view would be checked (and repaired) at the wrong addresses.
        if not t.is_contiguous():
            raise ValueError(f"{what} must be contiguous (got strides {t.stride()} for shape {tuple(t.shape)})")
        return t

    def _fast(self, plan: _Plan, tensors: Mapping[str, torch.Tensor]) -> list[torch.Tensor] | None:
        """The tensors in call order when every host check passes, else None (then :meth:`_checked` finds and names
        what is wrong). The eager host cost of a call is mostly these checks: one pass of cheap attribute reads per
        tensor, no device objects built, no messages."""
        if len(tensors) != len(plan.names):
            return None
        try:
            ordered = [tensors[n] for n in plan.names]
        except KeyError:
            return None
        # Locals, not module globals, and shape[0], not size(0): per-call host time (the loops run every call).
        on, tensor_type, dtypes = self._on_device, torch.Tensor, _INDEX_DTYPE_SET
        for t, nd in zip(ordered, plan.ndims, strict=True):
            # type(), not isinstance: a subclass (a FakeTensor while torch.compile traces) takes the full checks.
            if type(t) is not tensor_type or t.dtype not in dtypes or not on(t) or t.dim() not in nd:
                return None
            if not t.is_contiguous():
                return None
        for table, lengths in plan.with_lengths:
            if tensors[lengths].shape[0] != tensors[table].shape[0]:
                return None
        for n in plan.indptrs:
            if tensors[n].shape[0] == 0:
                return None
        return ordered

    def _checked(self, plan: _Plan, tensors: Mapping[str, torch.Tensor]) -> list[torch.Tensor]:
        """Every host check, raising the first failure's error; the tensors in call order."""
        if len(tensors) != len(plan.names) or any(n not in tensors for n in plan.names):
            missing = [n for n in plan.names if n not in tensors]
            unknown = sorted(set(tensors) - set(plan.names))
            parts = ([f"missing {missing}"] if missing else []) + ([f"unknown {unknown}"] if unknown else [])
            raise TypeError(f"validator {self.name!r}: {'; '.join(parts)} (it takes {list(plan.names)})")
        ordered = [self._check(w, tensors[n], nd) for n, w, nd in zip(plan.names, plan.whats, plan.ndims, strict=True)]
        for table, lengths in plan.with_lengths:
            if tensors[lengths].shape[0] != tensors[table].shape[0]:
                raise ValueError(
                    f"validator {self.name!r}: {lengths!r} has {tensors[lengths].shape[0]} entries but {table!r} has "
                    f"{tensors[table].shape[0]} rows"
                )
        for n in self._aux_kind:
            if self._aux_kind[n] == "indptr" and tensors[n].shape[0] == 0:
                raise ValueError(
                    f"validator {self.name!r}: indptr {n!r} is empty (a CSR indptr has B + 1 >= 1 entries)"
                )
        return ordered

    def __call__(self, **tensors: torch.Tensor) -> None:
        """Check (and under ``mask`` repair, in place) every declared tensor, in one launch.

        Every declared name must be passed, and nothing else. Host checks only (dtype, device, layout, shapes):
        no sync, no allocation, so the call is safe inside a CUDA-graph capture and on an engine's step path.
        """
        plan = self._plan if self._plan is not None else self._build_plan()
        ordered = self._fast(plan, tensors)
        if ordered is None:
            ordered = self._checked(plan, tensors)
        mask = self.policy == "mask"
        if torch.compiler.is_compiling():
            torch.ops.tripwire.validate(ordered, self._arena, list(plan.spec), mask)
        elif plan.launch is None:  # the torch backend
            _validate_torch.launch(self._arena, plan.rules, ordered, mask=mask, offenders=self._offenders)
        else:
            plan.launch(ordered)  # bound once per plan (_launcher.Launcher): the eager host cost


@dataclass(frozen=True)
class _Plan:
    """A validator's call layout, fixed once its rules are: the tensor names in call order (and the words naming
    each in an error), each one's allowed ranks, the kernel's rules (and the same as the custom op's int spec), the
    (table, lengths) pairs to cross-check and the bound launch."""

    names: tuple[str, ...]
    whats: tuple[str, ...]
    ndims: tuple[tuple[int, ...], ...]
    rules: _r.Rules
    spec: tuple[int, ...]
    with_lengths: tuple[tuple[str, str], ...]
    indptrs: tuple[str, ...]  # the CSR indptr names (each must be non-empty)
    launch: Any  # _launcher.Launcher for the Triton backend, None for the torch path


# ---------------------------------------------------------------------------------------------- the custom op
# The op carries the rules as a flat int list (one field after the other, each as long as the rule count): a custom
# op's schema takes ints, not dataclasses.
_FIELDS = tuple(_r.Rules.__dataclass_fields__)


def _spec(rules: _r.Rules) -> tuple[int, ...]:
    return tuple(int(v) for f in _FIELDS for v in getattr(rules, f))


def _rules_from_spec(spec: list[int] | tuple[int, ...]) -> _r.Rules:
    n, rest = divmod(len(spec), len(_FIELDS))
    if rest:
        raise ValueError(f"tripwire::validate: a spec of {len(spec)} ints is not {len(_FIELDS)} fields per rule")
    flags = ("has_pad", "has_len", "own_aux")  # the rest are ints
    cols: dict[str, tuple] = {
        f: tuple(bool(x) if f in flags else int(x) for x in spec[k * n : (k + 1) * n]) for k, f in enumerate(_FIELDS)
    }
    return _r.Rules(**cols)


@torch.library.custom_op("tripwire::validate", mutates_args=("tensors", "arena"))
def _validate_op(tensors: list[torch.Tensor], arena: torch.Tensor, spec: list[int], mask: bool) -> None:
    if arena.device.type == "cuda":
        _kernel().launch(arena, _rules_from_spec(spec), tensors, mask=mask)
    else:
        _validate_torch.launch(arena, _rules_from_spec(spec), tensors, mask=mask)


@_validate_op.register_fake
def _(tensors, arena, spec, mask):  # type: ignore[no-untyped-def]
    _rules_from_spec(spec)
