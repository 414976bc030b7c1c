"""Built-in models: build, deterministic seeding, one training step, errors."""

import pytest
import torch
import torch.nn.functional as F

from remat._batch import compute_loss, call_model
from remat.models import MODEL_NAMES, build, model_sizes

HF = [n for n in MODEL_NAMES if n.startswith("hf:")]
SMALL = {
    "gpt": dict(num_layers=2, d_model=16, num_heads=2, seq_len=8, batch_size=2, vocab_size=32),
    "mlp": dict(depth=3, width=8, batch_size=2),
    "convnet": dict(num_blocks=2, channels=4, image_size=8, batch_size=2),
    "unet": dict(depth=2, channels=4, image_size=8, batch_size=2),
    "hf:gpt2": dict(num_layers=2, d_model=16, num_heads=2, seq_len=8, batch_size=2, vocab_size=32),
    "hf:llama": dict(num_layers=2, d_model=16, num_heads=2, seq_len=8, batch_size=2, vocab_size=32),
    "hf:t5": dict(num_layers=2, d_model=16, num_heads=2, seq_len=8, batch_size=2, vocab_size=32),
}


def test_model_names():
    assert MODEL_NAMES[:3] == ("gpt", "mlp", "convnet")
    try:
        import transformers  # noqa: F401
        assert HF == ["hf:gpt2", "hf:llama", "hf:t5"]
    except ImportError:
        assert HF == []


@pytest.mark.parametrize("name", MODEL_NAMES)
def test_one_training_step(name):
    built = build(name, **SMALL[name])
    assert built.name == name and built.model.training
    assert isinstance(built.optimizer, torch.optim.AdamW)
    before = [p.detach().clone() for p in built.model.parameters()]
    loss = compute_loss(call_model(built.model, built.batch), built.batch, built.loss_fn)
    assert loss.dim() == 0 and torch.isfinite(loss)
    loss.backward()
    built.optimizer.step()
    assert any(not torch.equal(a, b) for a, b in zip(before, built.model.parameters()))


@pytest.mark.parametrize("name", MODEL_NAMES)
def test_seed_makes_weights_and_batch_deterministic(name):
    a, b, c = (build(name, seed=s, **SMALL[name]) for s in (1, 1, 2))
    for pa, pb in zip(a.model.parameters(), b.model.parameters()):
        assert torch.equal(pa, pb)
    assert any(not torch.equal(pa, pc) for pa, pc in zip(a.model.parameters(), c.model.parameters()))
    ta = a.batch if not isinstance(a.batch, dict) else tuple(a.batch.values())
    tb = b.batch if not isinstance(b.batch, dict) else tuple(b.batch.values())
    assert all(torch.equal(x, y) for x, y in zip(ta if isinstance(ta, tuple) else (ta,), tb if isinstance(tb, tuple) else (tb,)))


def test_build_does_not_touch_the_global_rng():
    torch.manual_seed(7)
    state = torch.get_rng_state()
    build("gpt", **SMALL["gpt"])
    assert torch.equal(torch.get_rng_state(), state)


def test_gpt_layout_and_attention_kinds_agree():
    explicit = build("gpt", dropout=0.0, **{**SMALL["gpt"]})
    sdpa = build("gpt", dropout=0.0, attention="sdpa", **SMALL["gpt"])
    assert type(explicit.model.blocks).__name__ == "ModuleList" and len(explicit.model.blocks) == 2
    idx, targets = explicit.batch
    assert idx.shape == targets.shape == (2, 8) and torch.equal(idx[:, 1:], targets[:, :-1])
    logits = explicit.model(idx)
    assert logits.shape == (2, 8, 32)
    torch.testing.assert_close(explicit.model(*explicit.batch), sdpa.model(*sdpa.batch))


def test_gpt_attention_is_causal():
    built = build("gpt", dropout=0.0, **SMALL["gpt"])
    idx, _ = built.batch
    changed = idx.clone()
    changed[:, -1] = (changed[:, -1] + 1) % 32
    torch.testing.assert_close(built.model(idx)[:, :-1], built.model(changed)[:, :-1])


def test_convnet_updates_batchnorm_buffers_in_forward():
    built = build("convnet", **SMALL["convnet"])
    mean = built.model.blocks[0].bn1.running_mean.clone()
    built.model(*built.batch)
    assert not torch.equal(mean, built.model.blocks[0].bn1.running_mean)


def test_mlp_depth_up_to_1024():
    assert len(build("mlp", depth=1024, width=2, batch_size=1).model.blocks) == 1024
    with pytest.raises(ValueError, match=r"depth=1025 is out of range; allowed: 1\.\.1024"):
        build("mlp", depth=1025)


@pytest.mark.parametrize("name", HF)
def test_hf_batch_and_loss(name):
    built = build(name, **SMALL[name])
    assert sorted(built.batch) == ["attention_mask", "input_ids", "labels"]
    assert built.loss_fn is None
    assert call_model(built.model, built.batch).loss.dim() == 0


def test_hf_t5_is_an_encoder_decoder_with_layers_in_each_stack():
    """Its loss: cross-entropy of the decoder's logits against the labels as given (the decoder
    reads them shifted right, starting from the pad token); remat finds both stacks' layers."""
    from remat.measure.blocks import find_blocks

    built = build("hf:t5", dropout=0.0, **SMALL["hf:t5"])
    model, batch = built.model, built.batch
    assert [name for name, _ in find_blocks(model)] == [f"{s}.block.{i}" for s in ("encoder", "decoder") for i in (0, 1)]
    output = call_model(model, batch)
    assert output.logits.shape == (2, 8, 32)
    torch.testing.assert_close(output.loss, F.cross_entropy(output.logits.reshape(-1, 32), batch["labels"].reshape(-1)),
                               rtol=0, atol=0)
    shifted = model(input_ids=batch["input_ids"], decoder_input_ids=torch.cat(
        [torch.zeros(2, 1, dtype=torch.long), batch["labels"][:, :-1]], dim=1)).logits
    assert torch.equal(shifted, output.logits)


def test_optimizer_choices():
    assert isinstance(build("mlp", optimizer="sgd", **SMALL["mlp"]).optimizer, torch.optim.SGD)
    assert build("mlp", optimizer="none", **SMALL["mlp"]).optimizer is None
    with pytest.raises(ValueError, match=r"unknown optimizer 'lion'; allowed: adamw, adam, sgd, none"):
        build("mlp", optimizer="lion")


def test_unknown_name_and_size():
    with pytest.raises(ValueError, match=r"unknown model 'resnet'; allowed: gpt, mlp, convnet"):
        build("resnet")
    with pytest.raises(ValueError, match=r"unknown size\(s\) \['depth'\] for model 'gpt'; allowed: num_layers, d_model"):
        build("gpt", depth=3)
    with pytest.raises(ValueError, match=r"attention='flash' is not supported; allowed: explicit, sdpa"):
        build("gpt", attention="flash")
    with pytest.raises(ValueError, match=r"d_model=30 is not divisible by num_heads=4"):
        build("gpt", d_model=30, num_heads=4)


def test_model_sizes_lists_defaults():
    assert model_sizes("mlp") == {"depth": 8, "width": 256, "batch_size": 32}


def test_convnet_stages_halve_the_activations():
    """downsample_every=2: units 2 and 4 halve the image and double the channels, so each stage's
    activations are half the stage before's (shortcut: strided 1x1 conv + BN); the default keeps
    the state_dict keys of a ConvNet without stages."""
    built = build("convnet", num_blocks=5, channels=4, image_size=8, batch_size=2, downsample_every=2)
    shapes, x = [], F.relu(built.model.stem_bn(built.model.stem(built.batch[0])))
    for block in built.model.blocks:
        x = block(x)
        shapes.append(tuple(x.shape))
    assert shapes == [(2, 4, 8, 8), (2, 4, 8, 8), (2, 8, 4, 4), (2, 8, 4, 4), (2, 16, 2, 2)]
    assert [b.shortcut is not None for b in built.model.blocks] == [False, False, True, False, True]
    assert built.model.classifier.in_features == 16
    plain = build("convnet", num_blocks=2, channels=4, image_size=8, batch_size=2)
    assert not any("shortcut" in k for k in plain.model.state_dict())


def test_convnet_refuses_an_image_it_cannot_halve():
    with pytest.raises(ValueError, match=r"image_size=10 must be divisible by 2 \*\* 2 .*downsample_every=2"):
        build("convnet", num_blocks=5, channels=4, image_size=10, downsample_every=2)
    with pytest.raises(ValueError, match="downsample_every=-1 must be >= 0"):
        build("convnet", downsample_every=-1)
