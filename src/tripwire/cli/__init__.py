"""The ``tripwire`` command: ``tripwire demo`` (the README's first command), ``tripwire bench``, ``tripwire sites``,
``tripwire doctor``, ``tripwire resources`` (a guarded kernel's registers and occupancy beside its twin's).

Without a GPU, Triton kernels must run in the interpreter, and TRITON_INTERPRET has to be set before triton is
imported: so the CLI decides the device first and sets it before importing anything that imports triton.
"""

from __future__ import annotations

import argparse
import os
import sys
from collections.abc import Iterator
from contextlib import contextmanager

from .text import sites_table


def _want_interpreter(device: str | None) -> bool:
    import torch

    if device is None:
        return not torch.cuda.is_available()
    return not device.startswith("cuda")


def _engine_arg(args: list[str]) -> str | None:
    """The value of ``--engine`` in ``args`` ("" when given without one), or None when absent."""
    for i, a in enumerate(args):
        if a == "--engine":
            return args[i + 1] if i + 1 < len(args) else ""
        if a.startswith("--engine="):
            return a.split("=", 1)[1]
    return None


DESCRIPTION = (
    "tripwire: masked, counted, reported out-of-range accesses in GPU kernels. Commands: demo (a decode loop with "
    "injected metadata faults; --engine transformers or vllm for a real engine), bench (what tripwire costs on this "
    "machine: a self-check of about a minute), "
    "sites (the registered sites), doctor (what works on this machine), resources (a guarded kernel's registers "
    "and occupancy beside its twin's)."
)


def main(argv: list[str] | None = None) -> int:
    try:
        rc = _main(argv)
        sys.stdout.flush()
        return rc
    except BrokenPipeError:
        # The reader of our output went away (`tripwire sites | head`): not an error of ours. Point stdout at
        # /dev/null so the interpreter's final flush does not raise again.
        devnull = os.open(os.devnull, os.O_WRONLY)
        os.dup2(devnull, sys.stdout.fileno())
        return 0


def _main(argv: list[str] | None) -> int:
    from .. import __version__
    from ..errors import SettingError

    parser = argparse.ArgumentParser(prog="tripwire", description=DESCRIPTION)
    parser.add_argument("--version", action="version", version=f"tripwire {__version__}")
    sub = parser.add_subparsers(dest="cmd", required=True)
    demo = sub.add_parser("demo", help="a paged-KV decode loop with injected metadata faults", add_help=False)
    demo.add_argument("args", nargs=argparse.REMAINDER)
    bench = sub.add_parser("bench", help="what tripwire costs on this machine (a self-check)", add_help=False)
    bench.add_argument("args", nargs=argparse.REMAINDER)
    sub.add_parser("sites", help="list the registered sites of the reference kernels and instruments")
    doctor = sub.add_parser("doctor", help="check this machine: what works and what would not", add_help=False)
    doctor.add_argument("args", nargs=argparse.REMAINDER)
    res = sub.add_parser(
        "resources", help="registers, spills and programs per SM of guarded kernels vs twins", add_help=False
    )
    res.add_argument("args", nargs=argparse.REMAINDER)
    argv = list(sys.argv[1:] if argv is None else argv)
    ns, rest = parser.parse_known_args(argv)
    extra = list(getattr(ns, "args", []) or []) + rest
    if ns.cmd in ("demo", "bench", "doctor", "resources"):
        # argparse's REMAINDER drops leading options into `rest` out of order ("bench --only q2 --quick" would
        # become ["q2", "--quick", "--only"]): pass everything after the subcommand through verbatim instead.
        extra = argv[argv.index(ns.cmd) + 1 :]
    try:
        if ns.cmd != "doctor":  # the doctor reports a broken setting as one of its checks
            from ..config import load_settings

            # Before any work: the same refusal the monitor would give later, deep inside a run.
            load_settings()
        return _run(ns.cmd, extra)
    except SettingError as e:
        # A broken setting is the user's input, like a bad option: one line and argparse's status, no traceback.
        print(f"tripwire {ns.cmd}: error: {e}", file=sys.stderr)
        return 2


@contextmanager
def _interpreter(want: bool) -> Iterator[None]:
    """``TRITON_INTERPRET=1`` for the command when it wants the interpreter, and the variable as it was afterwards:
    a command run in-process (a test, a notebook) must not leave later imports interpreted."""
    before = os.environ.get("TRITON_INTERPRET")
    if want:
        os.environ.setdefault("TRITON_INTERPRET", "1")
    try:
        yield
    finally:
        if before is None:
            os.environ.pop("TRITON_INTERPRET", None)
        else:
            os.environ["TRITON_INTERPRET"] = before


def _mode_conflict(cmd: str, want: bool) -> str | None:
    """Why ``cmd`` cannot run in this process, or None: Triton fixes a kernel as interpreted or compiled when its
    module is imported, so once tripwire's kernels are imported in the other mode the command would run them there
    (interpreted kernels on GPU tensors, or compiled ones on CPU tensors)."""
    tt = sys.modules.get("tripwire.triton")
    if tt is None or bool(tt._INTERP) == want:
        return None
    now, need = ("interpreted", "compiled") if want is False else ("compiled", "interpreted")
    return (
        f"tripwire {cmd}: this process already imported tripwire's Triton kernels {now}, and this command needs "
        f"them {need}; run it in a new process (`tripwire {cmd} ...` from a shell)"
    )


def _run(cmd: str, extra: list[str]) -> int:
    want = None
    if cmd == "demo":
        device = None
        for i, a in enumerate(extra):
            if a == "--device" and i + 1 < len(extra):
                device = extra[i + 1]
            elif a.startswith("--device="):
                device = a.split("=", 1)[1]
        want = _want_interpreter(device)
    elif cmd in ("bench", "sites"):
        want = _want_interpreter(None)
    elif cmd == "resources":
        # Compiling for the GPU target needs Triton's compiler, which the interpreter replaces: never interpret.
        want = False
    if want is not None and cmd != "sites":  # sites only imports the kernels to list their sites
        why = _mode_conflict(cmd, want)
        if why is not None:
            print(why, file=sys.stderr)
            return 2
    with _interpreter(bool(want)):
        if cmd == "resources":
            os.environ.pop("TRITON_INTERPRET", None)
        return _command(cmd, extra)


def _command(cmd: str, extra: list[str]) -> int:
    if cmd == "demo":
        engine = _engine_arg(extra)
        if engine == "vllm":
            from .demo_vllm import main as vllm_demo_main

            return vllm_demo_main(extra)
        if engine is not None:
            from .demo_transformers import main as engine_demo_main

            return engine_demo_main(extra)
        from .demo import main as demo_main

        return demo_main(extra)
    if cmd == "bench":
        from .bench.run import main as bench_main

        return int(bench_main(extra) or 0)
    if cmd == "sites":
        import tripwire

        for mod in ("tripwire.kernels", "tripwire.numerics"):
            try:
                __import__(mod)
            except ImportError:
                pass
        print(sites_table(tripwire.sites()))
        return 0
    if cmd == "doctor":
        from .doctor import main as doctor_main

        return doctor_main(extra)
    if cmd == "resources":
        from ..resources import main as resources_main

        return resources_main(extra)
    return 2


if __name__ == "__main__":
    raise SystemExit(main())
