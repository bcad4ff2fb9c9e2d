"""The pre-stage's prefix key (connectors/ray/grouping.py): a row's leading text from a prompt,
chat messages or token ids; equal leading texts give equal keys, and build_processor checks the
option. Grouping a real Dataset is tests/integration/test_prefix_grouping.py."""
from __future__ import annotations

import pytest

from batchgen_data.connectors.ray.grouping import (PREFIX_COLUMN, AddPrefixKey, leading_text,
                                                   prefix_hash)
from batchgen_data.connectors.ray.processor import BatchGenProcessorConfig, build_processor

DOC = "Once upon a time " * 40  # 680 characters


def test_leading_text_of_each_row_shape() -> None:
    assert leading_text({"prompt": DOC + "Q1?"}, 100) == DOC[:100]
    msgs = [{"role": "system", "content": "Be brief."},
            {"role": "user", "content": [{"type": "text", "text": DOC},
                                         {"type": "image_url", "image_url": {"url": "x"}}]}]
    assert leading_text({"messages": msgs}, 30) == ("system\nBe brief.\nuser\n" + DOC)[:30]
    assert leading_text({"prompt_token_ids": [5, 6, 7]}, 4) == "5 6 "


def test_rows_sharing_the_leading_text_share_the_key() -> None:
    key = AddPrefixKey(512)
    a, b = key({"prompt": DOC + "Q1?", "id": 1}), key({"prompt": DOC + "Q2?", "id": 2})
    assert a[PREFIX_COLUMN] == b[PREFIX_COLUMN] and a["id"] == 1
    c = key({"prompt": "x" + DOC})
    assert c[PREFIX_COLUMN] != a[PREFIX_COLUMN]
    assert -2**63 <= a[PREFIX_COLUMN] < 2**63 and prefix_hash("") == prefix_hash("")


def test_build_processor_checks_the_option() -> None:
    config = BatchGenProcessorConfig()
    assert build_processor(config, prefix_grouping=True).prefix_grouping
    assert not build_processor(config).prefix_grouping
    with pytest.raises(TypeError, match="prefix_grouping"):
        build_processor(config, prefix_grouping="yes")  # type: ignore[arg-type]
    with pytest.raises(ValueError, match="prefix_chars"):
        build_processor(config, prefix_grouping=True, prefix_chars=0)
