from remat.report.units import GIB, KIB, MIB, byte_scale, format_bytes, format_flops, format_ms, format_pct, format_ratio


def test_byte_scale_switches_to_gib_at_one_gib():
    assert byte_scale(GIB - 1).unit == "MiB"
    assert byte_scale(MIB - 1).unit == "KiB" and byte_scale(MIB).unit == "MiB"
    assert byte_scale(600 * KIB)(513 * KIB) == 513.0
    assert byte_scale(GIB).unit == "GiB"
    assert byte_scale(3 * MIB)(3 * MIB) == 3.0
    assert byte_scale(6 * GIB)(3 * GIB) == 3.0


def test_format_bytes_uses_binary_units():
    assert format_bytes(4 * GIB) == "4.0 GiB"
    assert format_bytes(79 * MIB) == "79.0 MiB"
    assert format_bytes(1536) == "1.5 KiB"
    assert format_bytes(512) == "512 B"
    assert format_bytes(-2 * MIB) == "-2.0 MiB"


def test_format_ms_pct_ratio():
    assert format_ms(34.0) == "34.0 ms"
    assert format_ms(0.25) == "0.250 ms"
    assert format_ms(12_500) == "12.5 s"
    assert format_pct(100 * (34 / 30 - 1)) == "+13%"
    assert format_pct(2.5316) == "+2.5%"
    assert format_pct(-0.4) == "-0.4%"
    assert format_ratio(36 / 15) == "2.4x"
    assert format_ratio(float("inf")) == "unbounded"


def test_format_flops_uses_decimal_prefixes():
    assert format_flops(6_000_000_000) == "6.0 GFLOP"
    assert format_flops(852_000) == "852.0 kFLOP"
    assert format_flops(1.5e12) == "1.5 TFLOP"
    assert format_flops(12) == "12 FLOP"


def test_a_table_column_reads_in_the_unit_of_its_largest_value():
    from remat._units import in_unit, table_unit

    assert table_unit([]) == ("B", 1) and table_unit([None, 1023]) == ("B", 1)
    assert table_unit([5, 1024]) == ("KiB", 1024) and table_unit([-(2**20)]) == ("MiB", 2**20)
    assert table_unit([2**30 - 1, 3]) == ("MiB", 2**20) and table_unit([2**40]) == ("GiB", 2**30)
    assert in_unit(1536, 1024) == "1.50" and in_unit(1536, 1024, 0) == "2" and in_unit(60, 1) == "60"
    assert in_unit(3 * 2**20 // 2, 2**20, 1) == "1.5"
