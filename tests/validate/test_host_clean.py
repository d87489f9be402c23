"""The validator's host clean test, per rule (``Rule.clean``, ``Rule.clean_lengths``, ``Rule.clean_indptr``): the one
test the CPU path runs before its exact path and vLLM's CPU step check runs before calling the validator at all.

Each rule's bounds are tested at the edge: the bound itself passes, one past it flips the answer; padding passes
only as itself (one either side of it flips); an indptr flips when it does not start at 0, decreases once or ends
past its indices. Then random lists against the rules written out entry by entry, and against the validator's own
counts: clean exactly when no entry is bad and the validator counts nothing.
"""

from __future__ import annotations

import pytest
import torch
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from tripwire import Monitor, SiteRegistry
from tripwire.validate import Validator

LO, HI, PAD = 3, 10, -1


@pytest.fixture
def rules():
    m = Monitor(registry=SiteRegistry(capacity=16), capacity=16)
    v = Validator("host", "cpu", monitor=m)
    v.index("plain", lo=LO, hi=HI, safe=LO)
    v.index("padded", lo=LO, hi=HI, padding=PAD)
    v.index("above", lo=LO, hi=HI, padding=HI + 5)  # a padding above the range
    v.index("table", lo=LO, hi=HI, safe=LO, lengths="n")
    v.csr("kv", indptr="ptr", lo=LO, hi=HI, safe=LO)
    return v.rules


def test_range_bounds_flip_one_past_each_end(rules):
    r = rules["plain"]
    assert r.clean([LO, HI - 1, 5]) is True  # both ends of [LO, HI) are in
    assert r.clean([LO - 1, 5]) is False  # one below lo
    assert r.clean([5, HI]) is False  # hi itself
    assert r.clean([]) is True
    assert r.clean([5] * 40 + [HI]) is False  # one bad entry among many, last
    assert r.clean([LO - 1] + [5] * 40) is False  # and first


def test_padding_passes_only_as_itself(rules):
    r = rules["padded"]
    assert r.clean([PAD, 5, PAD, HI - 1, LO]) is True
    assert r.clean([PAD] * 6) is True
    assert r.clean([PAD - 1, 5]) is False  # one below the padding
    assert r.clean([PAD, PAD + 1, 5]) is False  # one above it (still below lo: not padding, not in range)
    assert r.clean([PAD, 5, HI]) is False  # padding does not excuse an entry past hi
    assert rules["plain"].clean([PAD, 5]) is False  # control: a rule without padding counts it
    above = rules["above"]  # padding above the range: the suffix past hi must be padding only
    assert above.clean([5, HI + 5, HI + 5]) is True
    assert above.clean([5, HI + 4, HI + 5]) is False
    assert above.clean([5, HI + 5, HI + 6]) is False
    assert above.clean([LO - 1, HI + 5]) is False


def test_values_are_left_as_given(rules):
    vals = [9, PAD, 4]
    assert rules["padded"].clean(vals) is True
    assert vals == [9, PAD, 4]
    assert rules["plain"].clean((5, 4)) is True  # any iterable of ints


def test_lengths_are_within_zero_and_the_width(rules):
    r = rules["table"]
    assert r.clean_lengths([0, 4, 2], 4) is True  # both ends of [0, width]
    assert r.clean_lengths([0, 5, 2], 4) is False  # one past the width
    assert r.clean_lengths([-1, 2], 4) is False  # one below 0
    assert r.clean_lengths([], 4) is True
    with pytest.raises(ValueError, match="rule 'plain' has no lengths tensor"):
        rules["plain"].clean_lengths([0], 4)
    with pytest.raises(TypeError, match="rule 'table': width must be an int"):
        r.clean_lengths([0], 4.0)


def test_indptr_starts_at_zero_never_decreases_and_ends_within_the_indices(rules):
    r = rules["kv"]
    assert r.clean_indptr([0, 2, 2, 5], 5) is True  # equal neighbours and an end at the indices' length are clean
    assert r.clean_indptr([0], 0) is True
    assert r.clean_indptr([0, 2, 1, 5], 5) is False  # decreases once
    assert r.clean_indptr([0, 2, 3, 6], 5) is False  # ends one past the indices
    assert r.clean_indptr([1, 2, 3, 5], 5) is False  # does not start at 0
    assert r.clean_indptr([-1, 2, 3, 5], 5) is False
    assert r.clean_indptr([], 5) is False  # the validator refuses an empty indptr
    vals = [0, 3, 1]
    assert r.clean_indptr(vals, 5) is False and vals == [0, 3, 1]
    with pytest.raises(ValueError, match="rule 'plain' is an index rule"):
        rules["plain"].clean_indptr([0], 0)


_ints = st.lists(st.integers(-4, 14), max_size=40)


def _reference(slots, counts, indptr, n_kv):
    """The rules written out entry by entry, apart from the code under test: (slots, counts, indptr) clean."""
    prev, ok_ptr = 0, bool(indptr) and indptr[0] == 0
    for x in indptr[1:]:
        ok_ptr = ok_ptr and prev <= x <= n_kv
        prev = x
    return all(x == PAD or LO <= x < HI for x in slots), all(0 <= c <= 4 for c in counts), ok_ptr


@settings(max_examples=150, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(slots=_ints, counts=st.lists(st.integers(-2, 6), min_size=1, max_size=8), indptr=_ints, n_kv=st.integers(0, 12))
def test_clean_exactly_when_no_entry_is_bad(slots, counts, indptr, n_kv):
    """Each host test, and the validator's counts on the same values (flag: nothing is changed), against the rules
    written out entry by entry: clean when, and only when, no entry is bad; the validator counts at a site when, and
    only when, its rule's values are not clean (its CPU path gates its exact path with the same test, so a test that
    let a bad entry through would show here as a count of 0 where the reference finds a bad entry)."""
    m = Monitor(registry=SiteRegistry(capacity=16), capacity=16)
    v = Validator("exact", "cpu", policy="flag", monitor=m)
    v.index("slots", lo=LO, hi=HI, padding=PAD)
    v.index("table", lo=LO, hi=HI, lengths="n")
    v.csr("kv", indptr="ptr", lo=LO, hi=HI)
    indptr = indptr or [0]  # the validator refuses an empty indptr
    v(
        slots=torch.tensor(slots, dtype=torch.int64),
        table=torch.full((len(counts), 4), LO, dtype=torch.int32),
        n=torch.tensor(counts, dtype=torch.int32),
        kv=torch.full((n_kv,), LO, dtype=torch.int64),
        ptr=torch.tensor(indptr, dtype=torch.int64),
    )
    counted = {site: hit.count for (_dev, site), hit in m.snapshot().items()}
    ref_slots, ref_counts, ref_ptr = _reference(slots, counts, indptr, n_kv)
    rules = v.rules
    assert rules["slots"].clean(slots) is ref_slots is ("exact.slots" not in counted)
    assert rules["table"].clean_lengths(counts, 4) is ref_counts is ("exact.n" not in counted)
    assert rules["kv"].clean_indptr(indptr, n_kv) is ref_ptr is ("exact.ptr" not in counted)
