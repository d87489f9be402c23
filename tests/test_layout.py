import pytest

from tripwire.layout import GUARD_BIAS, VALUE_MAX, VALUE_MIN, decode, decode_neg, encode, encode_neg


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
