"""decode_token's byte-level style needs the byte map: a ValueError, never a bare assert."""
from __future__ import annotations

import pytest

from radixlang.constrained.tokenizer_info import decode_token, gpt2_unicode_to_bytes


def test_byte_level_without_a_byte_map_is_a_value_error():
    assert decode_token("\u0120hi", "byte_level", gpt2_unicode_to_bytes()) == b" hi"
    with pytest.raises(ValueError, match="byte_map for the byte_level style"):
        decode_token("\u0120hi", "byte_level")
