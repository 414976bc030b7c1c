"""`remat estimate` on the command line."""

from __future__ import annotations

import json

import pytest
from typer.testing import CliRunner

from remat.cli import app

runner = CliRunner()
GPT = ["estimate", "--model", "gpt", "--layers", "3", "--hidden", "32", "--heads", "2", "--vocab", "64", "--seq", "16"]


def test_json_output_is_the_estimate() -> None:
    result = runner.invoke(app, GPT + ["--device", "L4-24GB", "--micro-batch", "2", "--json"])
    assert result.exit_code == 0, result.output
    data = json.loads(result.output)
    assert data["model"] == "gpt" and data["num_layers"] == 3 and data["micro_batch"] == 2
    # 3 layers x (qkv 32*96+96, proj 32*32+32, fc 32*128+128, fc2 128*32+32, 2 norms 4*32) + embeddings + final norm + head
    per_layer = 32 * 96 + 96 + 32 * 32 + 32 + 32 * 128 + 128 + 128 * 32 + 32 + 4 * 32
    assert data["param_count"] == 3 * per_layer + 64 * 32 + 16 * 32 + 2 * 32 + 64 * 32
    device = data["devices"][0]
    assert device["device"]["name"] == "L4-24GB"
    assert [row["strategy"] for row in device["strategies"]] == ["none", "full", "selective", "optimal"]
    assert all(row["fits"] for row in device["strategies"])
    assert data["parallelism"]["tensor"] == 1 and data["gpus"] == 1
    none, full = device["strategies"][:2]
    assert none["layer_retained_bytes"] == data["layer_saved_bytes"] and full["layer_retained_bytes"] == data["layer_input_bytes"]
    assert set(none["time"]) == {"compute_s", "comm_s", "bubble_s", "data_parallel_s", "optimizer_s"}


@pytest.mark.slow
def test_parallel_options_and_search() -> None:
    result = runner.invoke(app, GPT + ["--layers", "4", "--tp", "2", "--sp", "--pp", "2", "--grad-accum", "4",
                                       "--distributed-optimizer", "--world-size", "2"], env={"COLUMNS": "200"})
    assert result.exit_code == 0, result.output
    assert "layout: dp2 tp2+sp pp2 = 8 GPU(s)" in result.output and "stage" in result.output
    assert "fp32 gradients" in result.output and "ZeRO-1" in result.output
    found = runner.invoke(app, GPT + ["--search", "--gpus", "4", "--global-batch", "8", "--top", "3", "--json"])
    assert found.exit_code == 0, found.output
    layouts = json.loads(found.output)
    assert 1 <= len(layouts) <= 3 and [c["step_s"] for c in layouts] == sorted(c["step_s"] for c in layouts)
    table = runner.invoke(app, GPT + ["--search", "--gpus", "4", "--global-batch", "8"], env={"COLUMNS": "200"})
    assert table.exit_code == 0 and "tokens/s/GPU" in table.output


def test_table_output_and_errors(tmp_path) -> None:
    result = runner.invoke(app, GPT + ["--device", "H100-80GB", "--optimizer", "sgd-momentum", "--zero", "1",
                                       "--world-size", "2"], env={"COLUMNS": "160"})
    assert result.exit_code == 0, result.output
    assert "H100-80GB" in result.output and "max mb" in result.output and "selective" in result.output
    missing = runner.invoke(app, ["estimate"])
    assert missing.exit_code == 2 and "name a model" in missing.output
    bad = runner.invoke(app, ["estimate", "--model", "gpt", "--kv-heads", "2"])
    assert bad.exit_code == 2 and "apply to --hf models only" in bad.output
    listed = runner.invoke(app, ["estimate", "--list-devices"], env={"COLUMNS": "200"})
    assert listed.exit_code == 0 and "RTX4090-24GB" in listed.output and "989.4" in listed.output
    assert "MI300X-192GB" in listed.output and "GPU link" in listed.output
    both = runner.invoke(app, GPT + ["--distributed-optimizer", "--zero", "3"])
    assert both.exit_code == 2 and "--distributed-optimizer is ZeRO-1" in both.output
    no_gpus = runner.invoke(app, GPT + ["--search"])
    assert no_gpus.exit_code == 2 and "--search needs the number of GPUs" in no_gpus.output


@pytest.mark.slow
def test_head_option() -> None:
    result = runner.invoke(app, GPT + ["--head", "chunked:4", "--json"])
    assert result.exit_code == 0, result.output
    data = json.loads(result.output)
    assert data["head"] == "chunked:4"
    heads = {h["strategy"]: h for h in data["head_bytes"]}
    # 16 tokens of 64-way logits in bf16 (the built-in GPT's loss runs in the model's dtype); the
    # default chunk: 16 tokens / ceil(64 / 32) = 8 rows
    assert list(heads) == ["keep", "recompute", "chunked:8", "chunked:4"] and heads["keep"]["logits_bytes"] == 16 * 64 * 2
    assert heads["chunked:4"]["post_peak_bytes"] < heads["keep"]["post_peak_bytes"]
    table = runner.invoke(app, GPT + ["--head", "chunked"], env={"COLUMNS": "200"})
    assert table.exit_code == 0, table.output
    assert "LM head: chunked:8 (logits 0.00 GiB per GPU)" in table.output
    bad = runner.invoke(app, GPT + ["--head", "chunks:8"])
    assert bad.exit_code == 2 and "unknown head strategy 'chunks:8'" in bad.output


def test_a_config_without_a_causal_lm_is_told_what_estimate_prices(tmp_path) -> None:
    """A T5 config.json printed transformers' list of 300-odd configuration classes (T5 is
    estimated now, `tests/estimate/test_encoder_decoder.py`, and so are text and image encoders:
    `test_text_encoders.py`, `test_image_encoders.py`, and speech encoders trained with CTC; a CLIP
    vision tower alone is not)."""
    pytest.importorskip("transformers")
    path = tmp_path / "config.json"
    path.write_text(json.dumps({"model_type": "clip_vision_model", "hidden_size": 64, "num_hidden_layers": 2,
                                "num_attention_heads": 4, "intermediate_size": 128}))
    result = runner.invoke(app, ["estimate", "--config", str(path), "--device", "H100-80GB"], env={"COLUMNS": "400"})
    assert result.exit_code == 2
    text = " ".join(result.output.split())
    assert "CLIPVisionConfig (model_type 'clip_vision_model') has no causal or masked language model in transformers, nor an image " \
        "classifier with its layers in num_hidden_layers" in text
    assert "prices decoder-only language models" in text and "text-to-text encoder-decoders" in text
    assert "GPT2Config" not in text


@pytest.mark.parametrize("cfg, args, said", [
    (dict(model_type="mixtral", hidden_size=32, num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2,
          intermediate_size=64, num_local_experts=4, num_experts_per_tok=2, vocab_size=96), ["--dtype", "fp32"],
     "runs its routed experts (model.layers.0.mlp.experts) with grouped_mm, whose kernel takes bfloat16 only, and the "
     "estimate is asked for float32: estimate it with --dtype bf16"),
    (dict(model_type="xlm", emb_dim=32, n_layers=2, n_heads=4, vocab_size=96), ["--explicit-attention"],
     "XLMWithLMHeadModel's training step cannot be traced on the meta device, where the estimate runs it: "
     "RuntimeError: Tensor.item() cannot be called on meta tensors"),
    (dict(model_type="git", hidden_size=32, num_hidden_layers=2, num_attention_heads=4, intermediate_size=64,
          vocab_size=96), ["--explicit-attention"],
     "copying its traced layers counts 14,984,448 parameters and the model has 85,880,256: its layers differ beyond the "
     "ones traced (a mixture of experts every few layers, as NLLB-MoE's sparse_step), or it has layers beside the ones "
     "its config counts (an image encoder's)"),
    (dict(model_type="rwkv", hidden_size=32, num_hidden_layers=2, attention_hidden_size=32, intermediate_size=64,
          vocab_size=96, context_length=16), [],
     "--seq 32 is more tokens than RWKV's WKV kernel is built for (context_length 16): a training step at that "
     "length fails on a GPU; pass --seq 16 or less"),
    (dict(model_type="blip-2", num_query_tokens=4,
          vision_config=dict(hidden_size=32, intermediate_size=64, num_hidden_layers=2, num_attention_heads=2,
                             image_size=32, patch_size=8),
          qformer_config=dict(hidden_size=32, intermediate_size=64, num_hidden_layers=2, num_attention_heads=2,
                              encoder_hidden_size=32),
          text_config=dict(model_type="opt", hidden_size=32, ffn_dim=64, num_hidden_layers=2, num_attention_heads=2,
                           vocab_size=96, word_embed_proj_dim=32)), [],
     "Blip2Model's training step cannot be traced on the meta device, where the estimate runs it: AttributeError: "
     "'bool' object has no attribute 'unsqueeze'"),
], ids=["moe-fp32", "xlm", "git", "rwkv", "blip-2"])
def test_configs_the_trace_cannot_take_get_one_line_naming_the_way(tmp_path, cfg, args, said) -> None:
    """Each was a traceback of 46 to 62 frames from inside transformers (or transformers' own
    text, naming an argument the CLI has not); GIT's was torch's one line, which named neither the
    model nor the way (its image encoder's layers, found beside the text layers, are not among the
    copies: refused by the count before the trace now); BLIP-2's an AttributeError of its own code
    on the meta device."""
    pytest.importorskip("transformers")
    path = tmp_path / "config.json"
    path.write_text(json.dumps(cfg))
    result = runner.invoke(app, ["estimate", "--config", str(path), "--seq", "32", "--micro-batch", "2", *args],
                           env={"COLUMNS": "400"})
    assert result.exit_code == 2, result.output
    assert said in " ".join(result.output.split())


def test_a_narrow_terminal_gets_every_figure_whole(monkeypatch) -> None:
    """At 80 columns (a terminal's default) the device table cut its cells: a total of 100.00 GiB
    read "100.…", "selective" read "sel…". Where the table does not fit, each strategy is a line
    with its figures named; the wide table stays where it fits."""
    data = json.loads(runner.invoke(app, GPT + ["--device", "L4-24GB", "--json"]).output)
    rows = data["devices"][0]["strategies"]
    from remat.cli._app import console

    monkeypatch.setattr(console, "width", 80)  # the console reads COLUMNS once, when made
    narrow = runner.invoke(app, GPT + ["--device", "L4-24GB"])
    assert narrow.exit_code == 0, narrow.output
    text = " ".join(narrow.output.split())
    assert "…" not in narrow.output and "┃" not in narrow.output
    for row in rows:
        peak, allow, held = (f"{row[key] / 2**30:.2f}" for key in ("peak_bytes", "allowance_bytes", "held_bytes"))
        total = f"{(row['peak_bytes'] + row['allowance_bytes']) / 2**30:.2f}"
        assert f"{row['strategy']}" in text and f"peak {peak}, +allow {allow}, total {total}, held {held};" in text
    assert "none: fits yes; GiB per GPU: peak " in text
    monkeypatch.setattr(console, "width", 200)
    wide = runner.invoke(app, GPT + ["--device", "L4-24GB"])
    assert "┃" in wide.output and "none: fits yes" not in wide.output
