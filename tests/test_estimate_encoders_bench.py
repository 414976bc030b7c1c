"""The encoders benchmark keeps working: one model of each kind, and a refusal, as its table reports them."""

from __future__ import annotations

import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from benchmarks.estimate_encoders import KINDS, run_one  # noqa: E402


def test_one_of_each_kind_and_a_refusal() -> None:
    """BERT, ViT and wav2vec 2.0 (with SpecAugment) estimated within the bounds the estimate
    tests hold them to; ALBERT refused in words."""
    rows = {}
    for name, model_type in (("text", "bert"), ("image", "vit"), ("speech", "wav2vec2"), ("text", "albert")):
        kind, base, seq, _ = KINDS[name]
        rows[model_type] = run_one(kind, model_type, base, seq)
    assert (rows["bert"]["none"], rows["bert"]["full"], rows["bert"]["params_equal"]) == (0.0, 0.0, True)
    assert (rows["vit"]["none"], rows["vit"]["full"], rows["vit"]["blocks"]) == (0.0, 0.0, 4)
    assert 0.0 <= rows["wav2vec2"]["none"] <= 0.0001 and rows["wav2vec2"]["full"] == 0.0
    assert rows["wav2vec2"]["blocks"] == 7
    assert rows["albert"]["refused"].startswith("config.json: the estimate copies a traced layer to every layer of the "
                                                "model, and no blocks found in AlbertForMaskedLM")
