import itertools

import pytest

from tripwire.layout import GUARD_BIAS, VALUE_MAX, VALUE_MIN, decode, decode_neg, encode, encode_neg, offender_key


@pytest.mark.parametrize("v", [0, 1, -1, 2**31 - 1, -(2**31), 2**40, VALUE_MAX, VALUE_MIN])
def test_round_trip(v):
    assert decode(encode(v)) == v
    assert decode_neg(encode_neg(v)) == v
    assert 0 < encode(v) < 2**63 and 0 < encode_neg(v) < 2**63


def test_zero_means_nothing_recorded():
    assert decode(0) is None and decode_neg(0) is None
    assert encode(0) == GUARD_BIAS


def test_order_is_kept():
    # atomic_max on the stored words must pick the larger value (and the smaller one for the negated slot).
    assert encode(-5) < encode(3) and encode_neg(-5) > encode_neg(3)


@pytest.mark.parametrize("v", [VALUE_MAX + 1, VALUE_MIN - 1, 2**63])
def test_outside_range_refused(v):
    with pytest.raises(ValueError, match="encodable range"):
        encode(v)
    with pytest.raises(ValueError, match="encodable range"):
        encode_neg(v)


def test_offender_key_tells_the_encodings_special_words_apart():
    """Rows, values and requests at the encoding's special words (0 = request not known, the bias, the saturated
    extremes, small numbers around them): every triple has its own non-zero key. Control: a linear mix of the three
    words (odd multipliers, then an xor-shift) collides on them, e.g. (row 1, value -1, request 0) and (row 1, value
    2**62 - 1 saturated, request not known), which would then share one offender entry."""
    words = sorted({0, 2, 3, encode(-1), encode(0), encode(1), encode(VALUE_MAX), encode(VALUE_MIN), encode(2**61)})
    assert len(words) == 9
    keys = {offender_key(*w) for w in itertools.product(words, repeat=3)}
    assert len(keys) == len(words) ** 3 and 0 not in keys

    def linear(rb: int, vb: int, qb: int) -> int:
        h = (rb * 0x2545F4914F6CDD1D + vb * 0x1F3D5B79A1C3E5F7 + qb * 0x3C6EF372FE94F82B) % 2**64
        return (h ^ (h >> 29)) | 1

    assert linear(encode(1), encode(-1), encode(0)) == linear(encode(1), encode(VALUE_MAX), 0)
    assert offender_key(encode(1), encode(-1), encode(0)) != offender_key(encode(1), encode(VALUE_MAX), 0)
    assert len({linear(*w) for w in itertools.product(words, repeat=3)}) < len(words) ** 3
