import pytest

from remat.plan.budget import format_bytes, parse_budget


@pytest.mark.parametrize(
    ("text", "expected"),
    [
        ("6GiB", 6 * 2**30),
        ("750MB", 750 * 10**6),
        ("512MiB", 512 * 2**20),
        ("1.5GiB", 3 * 2**29),
        ("2KiB", 2048),
        (" 10 B ", 10),
        (123, 123),
    ],
)
def test_parse_bytes(text, expected):
    assert parse_budget(text) == expected


def test_parse_percent_of_baseline():
    assert parse_budget("40%", baseline_peak_bytes=1000) == 400
    assert parse_budget("100%", baseline_peak_bytes=999) == 999
    assert parse_budget("12.5%", baseline_peak_bytes=1000) == 125


@pytest.mark.parametrize(
    ("text", "match"),
    [
        ("6G", "unknown unit 'G'"),
        ("-1GiB", "no sign"),
        ("40", r"budget '40' has no unit: write 40GiB \(or MiB, GB, B...\) for bytes or 40% for a share"),
        ("0.5", "budget '0.5' has no unit: write 0.5GiB"),
        ("1e3", "budget '1e3' has no unit"),
        ("abc", "cannot read budget 'abc'"),
        ("0GiB", "positive byte count"),
        ("0.1B", "positive byte count"),
        ("6 gib", "unknown unit 'gib'"),
    ],
)
def test_reject_bad_text(text, match):
    with pytest.raises(ValueError, match=match):
        parse_budget(text)


def test_reject_bad_percent():
    with pytest.raises(ValueError, match=r"must be in \(0%, 100%\]"):
        parse_budget("0%", baseline_peak_bytes=1000)
    with pytest.raises(ValueError, match=r"must be in \(0%, 100%\]"):
        parse_budget("150%", baseline_peak_bytes=1000)
    with pytest.raises(ValueError, match="no baseline peak is known"):
        parse_budget("40%")


def test_reject_bad_types():
    with pytest.raises(ValueError, match="positive byte count"):
        parse_budget(-5)
    with pytest.raises(TypeError, match="budget 1.5 is not a positive whole number of bytes"):
        parse_budget(1.5)
    with pytest.raises(TypeError, match="got bool"):
        parse_budget(True)


def test_format_bytes():
    assert format_bytes(512) == "512 B"
    assert format_bytes(3 * 2**29) == "1.50 GiB"
    assert format_bytes(2**20) == "1.00 MiB"


def test_a_whole_float_is_bytes_and_a_fraction_names_the_share():
    """``budget=8e9`` (how Python writes large sizes) was a TypeError; a float that is a whole number
    of bytes is that many, and a fraction is refused with the share it may mean."""
    assert parse_budget(8e9) == 8_000_000_000 and parse_budget(1.0) == 1
    with pytest.raises(TypeError) as raised:
        parse_budget(0.4)
    assert str(raised.value) == ("budget 0.4 is not a positive whole number of bytes: give bytes (an int, or a whole "
                                 "float such as 8e9), text like '6GiB' or a share of the baseline peak as text, '40%'.")
    for bad in (1.5, -5.0, 0.0, float("nan"), float("inf")):
        with pytest.raises(TypeError, match=f"budget {bad!r} is not a positive whole number of bytes"):
            parse_budget(bad)
