"""Every supported vLLM release, checked from its own source: the hook points and signatures the vLLM plugin relies
on (tests/integrations/vllm_source.py reads the registry's wheels over HTTP range requests into a cache).

0.33 and 0.34 pin torch 2.14, which runs neither on this CPU nor on the GPU here: for them this check is all there
is (docs/vllm.md says so). The other releases also run (the CPU build's 0.27 and 0.32, the GPU's 0.26), and are
checked here too, so one list of hook points covers the whole range. Needs the registry (network): in CI, and
skipped elsewhere when it cannot be reached.
"""

from __future__ import annotations

import ast
import os
import urllib.error

import pytest

from tripwire.integrations import vllm as tw_vllm
from vllm_source import check, check_numerics, source, uses_request_error

RELEASES = ("0.26.0", "0.27.0", "0.28.0", "0.29.0", "0.30.0", "0.31.0", "0.32.0", "0.33.0", "0.34.0")


def _source(version: str) -> dict[str, str]:
    try:
        return source(version)
    except (urllib.error.URLError, OSError) as e:
        if os.environ.get("CI", "").lower() == "true":
            raise
        pytest.skip(f"the registry cannot be reached: {e}")


def test_the_range_is_the_releases_checked():
    """The supported range is exactly the releases checked here: a release added to the range without its check
    (or the other way round) fails."""
    lo, hi = (tuple(int(x) for x in v.split(".")) for v in tw_vllm.SUPPORTED)
    minors = {tuple(int(x) for x in r.split(".")[:2]) for r in RELEASES}
    assert minors == {(lo[0], m) for m in range(lo[1], hi[1])}


@pytest.mark.parametrize("version", RELEASES)
def test_every_hook_point_is_in_the_release(version):
    files = _source(version)
    assert f"\nVersion: {version}\n" in files["metadata"]  # the release's own wheel
    assert check(files) == [], version
    assert check_numerics(files) == [], version
    # V1's runner exists up to 0.33 and is gone from 0.34 (the plugin then hooks V2 alone).
    assert ("v1_runner" in files) == (version != "0.34.0")
    # From 0.33 a contained request's error carries tripwire's message to the API client (vllm.outputs.RequestError
    # with a code and a message).
    assert uses_request_error(files) == (version >= "0.33")
    if uses_request_error(files):
        fields = {
            n.target.id
            for n in ast.walk(ast.parse(files["outputs"]))
            if isinstance(n, ast.AnnAssign) and isinstance(n.target, ast.Name)
        }
        assert {"code", "message"} <= fields


def test_a_missing_hook_point_is_found():
    """Control: the newest release's source with the V2 runner's prepare_attn renamed, the input batch without
    idx_mapping and the scheduler's error set renamed: each is reported."""
    files = dict(_source(RELEASES[-1]))
    files["v2_runner"] = files["v2_runner"].replace("def prepare_attn(", "def prepare_attention(")
    files["v2_batch"] = files["v2_batch"].replace("    idx_mapping: torch.Tensor\n", "    idx_map: torch.Tensor\n")
    files["scheduler"] = files["scheduler"].replace("grammar_compile_error_reqs", "request_errors_by_id")
    problems = check(files)
    assert "V2 runner: no prepare_attn" in problems
    assert "V2 execute_model does not call self.prepare_attn" not in problems  # the call site still says prepare_attn
    assert "V2 InputBatch: no field idx_mapping" in problems
    assert "Scheduler: no grammar_compile_error_reqs" in problems


def test_a_missing_numerics_hook_point_is_found():
    """Control for the numeric checks' hook points: the bitmask moved before V2's logits, V1's kept logits renamed,
    the cache-write op calling the write with a sixth argument, a backend's write renamed: each is reported (0.33
    carries both runners)."""
    files = dict(_source("0.33.0"))
    assert check_numerics(files) == []
    v2 = files["v2_runner"]
    head, tail = v2.split("    def sample(", 1)
    body, rest = tail.split("\n    def ", 1)
    sig, code = body.split("]:\n", 1)  # the bitmask applied first thing, before any logits exist
    body = sig + "]:\n        self.structured_outputs_worker.apply_grammar_bitmask()\n" + code
    files["v2_runner"] = head + "    def sample(" + body + "\n    def " + rest
    files["v1_runner"] = files["v1_runner"].replace("    logits: torch.Tensor\n", "    raw_logits: torch.Tensor\n", 1)
    files["attn_layer"] = files["attn_layer"].replace(
        "            layer_slot_mapping,\n", "            layer_slot_mapping,\n            None,\n", 1
    )
    files["triton_backend"] = files["triton_backend"].replace("def do_kv_cache_update(", "def write_kv_cache(")
    problems = check_numerics(files)
    assert "V2 sample: the grammar bitmask before the logits" in problems
    assert "V1 ExecuteModelState: no logits" in problems
    assert "unified_kv_cache_update: impl.do_kv_cache_update's 5 arguments" in problems
    assert "vllm/v1/attention/backends/triton_attn.py: no do_kv_cache_update" in problems
    assert "vllm/v1/attention/backends/flash_attn.py: do_kv_cache_update's parameters" not in problems
