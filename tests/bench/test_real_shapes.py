"""bench.real_shapes writes GGUF files at a shape's sizes that radixlang and the gguf reader both read."""
from __future__ import annotations

import numpy as np

from bench import real_shapes
from bench.shapes_vs_llama_server import step_bytes


def test_a_shape_is_written_as_f16_with_its_sizes_and_a_padded_vocabulary(tmp_path, monkeypatch):
    from gguf import GGMLQuantizationType, GGUFReader, GGUFValueType
    small = real_shapes.Shape("qwen3", 64, 2, 4, 2, 16, 96, 50000, True, 1e6, 512, qk_norm=True)
    monkeypatch.setitem(real_shapes.SHAPES, "small", small)
    # the embedded SmolLM2's tokenizer fields stand for a small byte-level vocabulary here (reading its 49k
    # tokens would take most of the test); the padding is the same code either way
    t = GGUFValueType
    fields = [("tokenizer.ggml.model", "gpt2", t.STRING, t.STRING),
              ("tokenizer.ggml.tokens", ["a", "b", "ab"], t.ARRAY, t.STRING),
              ("tokenizer.ggml.token_type", [1, 1, 1], t.ARRAY, t.INT32),
              ("tokenizer.ggml.merges", ["a b"], t.ARRAY, t.STRING)]
    monkeypatch.setattr(real_shapes, "_embedded_tokenizer", lambda: fields)
    path = tmp_path / "small.F16.gguf"
    real_shapes.write_f16("small", path)
    reader = GGUFReader(str(path))
    tensors = {t.name: t for t in reader.tensors}
    assert set(tensors) == {name for name, _ in real_shapes._tensors(small)}
    assert "output.weight" not in tensors  # tied
    for name, shape in real_shapes._tensors(small):
        t = tensors[name]
        assert tuple(int(d) for d in reversed(t.shape)) == shape, name  # gguf lists dims innermost first
        assert t.tensor_type == (GGMLQuantizationType.F32 if len(shape) == 1 else GGMLQuantizationType.F16)
    tokens = reader.fields["tokenizer.ggml.tokens"]
    assert len(tokens.data) == small.vocab  # the tokenizer's 3 tokens padded to the shape's vocabulary
    assert tokens.contents()[:4] == ["a", "b", "ab", "<pad3>"]
    assert len(reader.fields["tokenizer.ggml.token_type"].data) == small.vocab
    assert reader.fields["qwen3.attention.head_count_kv"].contents() == 2
    q = tensors["blk.0.attn_q.weight"].data.astype(np.float32)
    assert 0.5 < float(q.std()) * np.sqrt(small.hidden) < 2  # weights scaled by 1/sqrt(fan_in)
    # a tied embedding is read whole as the logits head: every tensor counts toward a decode step's bytes
    assert step_bytes(path) == sum(int(t.n_bytes) for t in reader.tensors)
