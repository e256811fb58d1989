"""kvasync._sizes: sizes as people write them, read and written back."""

import pytest

from kvasync._sizes import format_bytes, parse_size


@pytest.mark.parametrize(
    ("text", "size"),
    [
        ("12GiB", 12 << 30),
        ("512MiB", 512 << 20),
        ("1.5G", 3 << 29),
        ("2GB", 2_000_000_000),
        ("4096", 4096),
        (" 8 kib ", 8 << 10),
        ("1TB", 10**12),
    ],
)
def test_parse_size_reads_binary_and_decimal_units(text: str, size: int) -> None:
    assert parse_size(text) == size


@pytest.mark.parametrize("text", ["", "GiB", "12 parsecs", "-1GiB", "0", "0.1B", "1e9"])
def test_parse_size_refuses_what_is_not_a_size_of_at_least_one_byte(text: str) -> None:
    with pytest.raises(ValueError, match="size"):
        parse_size(text)


def test_format_bytes_picks_the_largest_binary_unit_below_1024() -> None:
    assert format_bytes(None) == "-"
    assert format_bytes(0) == "0 B"
    assert format_bytes(1023) == "1023 B"
    assert format_bytes(3 << 29) == "1.5 GiB"
    assert format_bytes(512 << 20) == "512.0 MiB"
    assert format_bytes(2048 << 40) == "2048.0 TiB"


def test_the_share_verbs_and_the_core_read_sizes_with_one_function() -> None:
    from kvasync.share import _cli

    assert _cli.parse_size is parse_size
    assert _cli.format_bytes is format_bytes
