"""Every user error of profile states the value, what is allowed, and the fix."""

import pytest
import torch
from torch import nn

from remat.measure.profile import profile


class _Pair(nn.Module):
    def __init__(self, output: str = "tensor") -> None:
        super().__init__()
        self.blocks = nn.ModuleList([nn.Linear(4, 4), nn.Linear(4, 4)])
        self.output = output

    def forward(self, x: torch.Tensor):
        y = self.blocks[1](self.blocks[0](x))
        if self.output == "dict with loss":
            return {"y": y, "loss": y.square().sum()}
        return {"y": y} if self.output == "dict" else y


def test_no_detectable_blocks():
    with pytest.raises(ValueError, match=r"no blocks found in Linear.*blocks='<glob over module names>'"):
        profile(nn.Linear(4, 4), torch.randn(2, 4), loss_fn=lambda out, batch: out.sum())


class _Res(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.conv = nn.utils.parametrizations.weight_norm(nn.Conv1d(2, 2, 3, padding=1))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return x + self.conv(torch.relu(x))


class _Codec(nn.Module):
    """Encodec's encoder: one list of convolutions (weight-normed), residual blocks and
    activations, no stack of one class."""

    def __init__(self) -> None:
        super().__init__()
        self.layers = nn.ModuleList([nn.utils.parametrizations.weight_norm(nn.Conv1d(1, 2, 3, padding=1)),
                                     _Res(), nn.ELU(), _Res(), nn.ELU(),
                                     nn.utils.parametrizations.weight_norm(nn.Conv1d(2, 1, 3, padding=1))])

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        for layer in self.layers:
            x = layer(x)
        return x


def test_a_list_of_several_classes_with_a_repeated_layer_is_the_stack_where_there_is_no_other():
    """Encodec's encoder and decoder: no stack of one class; each member of the list is a block
    (a model refused before, "no blocks found")."""
    prof = profile(_Codec(), torch.randn(2, 1, 8), loss_fn=lambda out, batch: out.sum())
    assert [b.name for b in prof.blocks] == [f"layers.{i}" for i in range(6)]
    assert [b.class_name for b in prof.blocks] == ["ParametrizedConv1d", "_Res", "ELU", "_Res", "ELU", "ParametrizedConv1d"]


def test_a_sequential_of_several_classes_with_a_repeated_layer_is_the_stack_where_there_is_no_other():
    """The same layers in a ``Sequential`` (a plain network written as one: ``Linear, ReLU,
    Linear, ...``, VGG's features): each member is a block, as torch's ``checkpoint_sequential``
    takes them (refused before, "no blocks found"; `remat.measure.blocks.leaf_sequences`)."""
    model = _Codec()
    model.layers = nn.Sequential(*model.layers)
    prof = profile(model, torch.randn(2, 1, 8), loss_fn=lambda out, batch: out.sum())
    assert [b.name for b in prof.blocks] == [f"layers.{i}" for i in range(6)]
    assert [b.class_name for b in prof.blocks] == ["ParametrizedConv1d", "_Res", "ELU", "_Res", "ELU", "ParametrizedConv1d"]


def test_no_stack_in_a_sequential_without_a_repeated_layer_names_the_fix():
    """One layer's pipeline (a convolution, its norm, an activation) as the whole model: no
    layer class with parameters repeats in it, and the error says how to name blocks."""
    model = nn.Sequential(nn.Conv1d(1, 2, 3, padding=1), nn.BatchNorm1d(2), nn.ELU())
    with pytest.raises(ValueError) as error:
        profile(model, torch.randn(2, 1, 8), loss_fn=lambda out, batch: out.sum())
    message = str(error.value)
    assert message.startswith("no blocks found in Sequential: it has no nn.ModuleList or nn.Sequential of 2 or more")
    assert message.endswith("Name the blocks with blocks='<glob over module names>' or blocks='<ClassName>' (e.g. 'layers.*').")


def test_pattern_that_matches_nothing():
    with pytest.raises(ValueError, match=r"block pattern 'layers\.\*' matches no module of _Pair.*blocks\.\* \(2 x Linear\)"):
        profile(_Pair(), torch.randn(2, 4), loss_fn=lambda out, batch: out.sum(), blocks="layers.*")


def test_blocks_of_wrong_type():
    with pytest.raises(TypeError, match=r"blocks=3 is not supported"):
        profile(_Pair(), torch.randn(2, 4), blocks=3)


def test_nested_blocks():
    with pytest.raises(ValueError, match=r"block 'blocks\.0' is nested inside block 'blocks'"):
        profile(_Pair(), torch.randn(2, 4), loss_fn=lambda out, batch: out.sum(), blocks=["blocks", "blocks.0"])


def test_loss_not_scalar():
    with pytest.raises(ValueError, match=r"the model output must be a scalar tensor, got shape \(2, 4\)"):
        profile(_Pair(), torch.randn(2, 4))


def test_a_one_element_loss_is_taken_as_a_scalar():
    """OneFormer's loss has shape (1,); ``Tensor.backward()`` takes it, and so does remat."""
    import remat

    model = _Pair()
    batch = torch.randn(2, 4)
    result = profile(model, batch, loss_fn=lambda out, batch: out.sum().reshape(1), repeats=1)
    v = remat.verify(model, batch, remat.plan(result, strategy="full"), lambda out, batch: out.sum().reshape(1), repeats=1)
    assert v.ok and v.grads_identical and v.peak_error_pct == 0.0


def _refused_by_each_stage(model, batch, plan, loss_fn, message: str) -> None:
    """`remat.profile`, `remat.verify` and `remat.apply_` each refuse ``model`` with ``message``."""
    import remat

    with pytest.raises(ValueError, match=r"remat.profile " + message):
        profile(model, batch, loss_fn=loss_fn)
    with pytest.raises(ValueError, match=r"remat.verify " + message):
        remat.verify(model, batch, plan, loss_fn)
    with pytest.raises(ValueError, match=r"remat.apply_ " + message):
        remat.apply_(model, plan)


def test_a_compiled_model_is_refused_with_the_module_it_wraps():
    import remat

    model = _Pair()
    batch = torch.randn(2, 4)
    loss_fn = lambda out, batch: out.sum()  # noqa: E731
    plan = remat.plan(profile(model, batch, loss_fn=loss_fn, repeats=1), strategy="full")
    compiled = torch.compile(model)  # nothing is compiled until it is called; remat refuses before
    message = r"takes the model before torch.compile, got torch.compile's wrapper \(OptimizedModule of _Pair\)\. Pass the module it wraps \(model._orig_mod\)"
    _refused_by_each_stage(compiled, batch, plan, loss_fn, message)
    assert not remat.apply.api.is_applied(model)


@pytest.mark.parametrize("how", ["script", "trace", "one scripted layer"])
def test_a_torchscript_module_is_refused_before_anything_runs(how):
    """A scripted or traced module runs its compiled graph: no hook sees its layers, no checkpoint
    replays them. Before, `remat.profile` failed inside with a TypeError from TorchScript's
    buffer dict."""
    import remat

    model, batch = _Pair(), torch.randn(2, 4)
    loss_fn = lambda out, batch: out.sum()  # noqa: E731
    plan = remat.plan(profile(model, batch, loss_fn=loss_fn, repeats=1), strategy="full")
    if how == "script":
        given, names = torch.jit.script(nn.Sequential(nn.Linear(4, 4), nn.Linear(4, 4))), r"<root>, 0, 1"
    elif how == "trace":
        given, names = torch.jit.trace(model, batch), r"<root>, blocks, blocks\.0, \.\.\."
    else:
        given, names = _Pair(), r"blocks\.1"
        given.blocks[1] = torch.jit.script(given.blocks[1])
    message = (rf"takes an eager nn.Module, but \w+ holds TorchScript modules \({names}\).*Pass the module before "
               r"torch.jit.script / torch.jit.trace")
    _refused_by_each_stage(given, batch, plan, loss_fn, message)


def test_hugging_face_checkpointing_left_on_is_refused_with_the_fix():
    import remat
    from remat.models import build

    built = build("hf:gpt2", num_layers=2, d_model=16, num_heads=2, seq_len=8, batch_size=2, vocab_size=32)
    plan = remat.plan(profile(built.model, built.batch, repeats=1), strategy="full")
    built.model.gradient_checkpointing_enable(gradient_checkpointing_kwargs={"use_reentrant": False})
    message = (r": Hugging Face gradient checkpointing is on in GPT2LMHeadModel \(transformer, transformer\.h\.0, transformer\.h\.1\), so its layers "
               r"already recompute.*Call model.gradient_checkpointing_disable\(\) first")
    with pytest.raises(ValueError, match=r"remat.profile" + message):
        profile(built.model, built.batch)
    with pytest.raises(ValueError, match=r"remat.verify" + message):
        remat.verify(built.model, built.batch, plan)
    with pytest.raises(ValueError, match=r"remat.apply_" + message):
        remat.apply_(built.model, plan)
    assert not remat.apply.api.is_applied(built.model)
    built.model.gradient_checkpointing_disable()
    assert remat.verify(built.model, built.batch, plan, repeats=1).ok


def test_diffusers_checkpointing_left_on_is_refused_with_its_own_fix():
    """diffusers' models turn it on and off with ``enable_gradient_checkpointing`` /
    ``disable_gradient_checkpointing`` and mark each block's parent ``gradient_checkpointing =
    True``, as a U-Net's down blocks here (diffusers is not a dependency: its two names only)."""
    import remat

    class DownBlock(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.gradient_checkpointing = False
            self.resnets = nn.ModuleList(nn.Linear(8, 8) for _ in range(2))

        def forward(self, x: torch.Tensor) -> torch.Tensor:
            for layer in self.resnets:
                x = layer(x)
            return x

    class UNetLike(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.down = DownBlock()

        def forward(self, x: torch.Tensor) -> torch.Tensor:
            return self.down(x).square().mean()

        def disable_gradient_checkpointing(self) -> None:
            self.down.gradient_checkpointing = False

    model = UNetLike()
    model.down.gradient_checkpointing = True
    with pytest.raises(ValueError, match=r"remat.profile: diffusers gradient checkpointing is on in UNetLike \(down\).*"
                                         r"Call model.disable_gradient_checkpointing\(\) first: a remat plan replaces it"):
        profile(model, torch.randn(2, 8))
    model.disable_gradient_checkpointing()
    assert profile(model, torch.randn(2, 8), repeats=1).num_blocks == 2


def test_timm_checkpointing_left_on_is_refused_with_its_own_fix():
    """timm's models checkpoint their blocks themselves after ``set_grad_checkpointing(True)``,
    which sets ``grad_checkpointing`` on the model or on its stages (ConvNeXt's): remat measured 0
    saved bytes per block and planned a one-point frontier, with no word (timm is not a dependency:
    its two names only)."""

    class Stage(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.grad_checkpointing = False
            self.blocks = nn.Sequential(nn.Linear(8, 8), nn.Linear(8, 8))

        def forward(self, x: torch.Tensor) -> torch.Tensor:
            if self.grad_checkpointing:
                return torch.utils.checkpoint.checkpoint_sequential(self.blocks, 2, x, use_reentrant=False)
            return self.blocks(x)

    class TimmLike(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.stages = nn.Sequential(Stage(), Stage())

        def forward(self, x: torch.Tensor) -> torch.Tensor:
            return self.stages(x).square().mean()

        def set_grad_checkpointing(self, enable: bool = True) -> None:
            for stage in self.stages:
                stage.grad_checkpointing = enable

    model = TimmLike()
    model.set_grad_checkpointing(True)
    with pytest.raises(ValueError, match=r"remat.profile: timm's gradient checkpointing is on in TimmLike \(stages\.0, "
                                         r"stages\.1\).*Call model.set_grad_checkpointing\(False\) first"):
        profile(model, torch.randn(2, 8))
    model.set_grad_checkpointing(False)
    assert profile(model, torch.randn(2, 8), repeats=1).num_blocks == 4  # each stage's two layers


@pytest.mark.parametrize("how", ["checkpoint_wrapper", "offload_wrapper", "composable"])
def test_torchs_own_activation_checkpointing_left_on_is_refused_with_the_fix(how):
    """torchtitan wraps each block in ``checkpoint_wrapper``; the composable ``checkpoint`` marks
    a module. Either way its blocks already recompute: the profile saw nothing saved there (0
    bytes under the composable one) and a plan checkpointed them again, with no word."""
    import remat
    from torch.distributed._composable import checkpoint
    from torch.distributed.algorithms._checkpoint.checkpoint_wrapper import checkpoint_wrapper, offload_wrapper

    from remat.models import build

    built = build("gpt", seed=0, optimizer="none", num_layers=2, d_model=16, num_heads=2, seq_len=8, batch_size=2,
                  vocab_size=32)
    plan = remat.plan(profile(built.model, built.batch, built.loss_fn, repeats=1), strategy="full")
    if how == "composable":
        checkpoint(built.model.blocks[1])
    else:
        built.model.blocks[1] = (checkpoint_wrapper if how == "checkpoint_wrapper" else offload_wrapper)(built.model.blocks[1])
    message = r": torch's activation checkpointing is on in GPT \(blocks\.1.*a remat plan replaces it"
    with pytest.raises(ValueError, match=r"remat.profile" + message):
        profile(built.model, built.batch, built.loss_fn)
    with pytest.raises(ValueError, match=r"remat.verify" + message):
        remat.verify(built.model, built.batch, plan, built.loss_fn)
    with pytest.raises(ValueError, match=r"remat.apply_" + message):
        remat.apply_(built.model, plan)
    assert not remat.apply.api.is_applied(built.model)


class _Inner(nn.Module):
    """Checkpoints its own activation when ``inner`` is set: inside the block, which runs as a module."""

    def __init__(self) -> None:
        super().__init__()
        self.linear, self.act, self.inner = nn.Linear(8, 8), nn.Tanh(), False

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        from torch.utils.checkpoint import checkpoint

        y = self.linear(x)
        return checkpoint(self.act, y, use_reentrant=False) if self.inner else self.act(y)


class OwnCheckpoint(nn.Module):
    """Checkpoints its blocks in its own forward (research code's ``if self.ckpt: x = checkpoint(blk, x)``),
    each (``how="each"``), in segments (``"sequential"``), or not (``"inner"``: each block
    checkpoints its activation inside it, which leaves the blocks themselves to plan)."""

    def __init__(self, how: str, reentrant: bool = False) -> None:
        super().__init__()
        self.embed = nn.Linear(8, 8)  # the blocks' input requires grad, as reentrant checkpoints need
        self.blocks = nn.Sequential(*[_Inner() for _ in range(4)])
        self.how, self.reentrant = how, reentrant
        for block in self.blocks:
            block.inner = how == "inner"

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        from torch.utils.checkpoint import checkpoint, checkpoint_sequential

        x = self.embed(x)
        if self.how == "sequential":
            x = checkpoint_sequential(self.blocks, 2, x, use_reentrant=self.reentrant)
        for block in self.blocks if self.how != "sequential" else []:
            x = checkpoint(block, x, use_reentrant=self.reentrant) if self.how == "each" else block(x)
        return x.square().mean()


@pytest.mark.parametrize("how,reentrant", [("each", False), ("each", True), ("sequential", False)])
def test_blocks_the_forward_checkpoints_itself_are_refused_with_where_and_the_fix(how, reentrant):
    """Before, non-reentrant: every plan measured the same (nothing saved in the blocks) and
    checkpointed them twice; reentrant: "every stack runs with gradients disabled", no word of why."""
    model = OwnCheckpoint(how, reentrant)
    inside = r"blocks\.0, blocks\.1" + (r", blocks\.2, blocks\.3" if how == "each" else "")  # not the last segment
    with pytest.raises(ValueError, match=rf"^OwnCheckpoint's forward runs {inside} "
                                         r"inside torch.utils.checkpoint itself \(.*test_errors\.py:[0-9]+\), so they "
                                         r"already recompute.*Turn the model's own checkpointing off"):
        profile(model, torch.randn(2, 8))
    inner = OwnCheckpoint("inner")  # checkpoints inside its blocks: the blocks run as modules, planned
    assert [b.name for b in profile(inner, torch.randn(2, 8), repeats=1).blocks] == [f"blocks.{i}" for i in range(4)]


def test_an_optimizer_whose_step_needs_a_closure_is_refused():
    import remat

    model = _Pair()
    batch = torch.randn(2, 4)
    loss_fn = lambda out, batch: out.sum()  # noqa: E731
    plan = remat.plan(profile(model, batch, loss_fn=loss_fn, repeats=1), strategy="full")
    lbfgs = torch.optim.LBFGS(model.parameters())
    before = [p.detach().clone() for p in model.parameters()]
    message = r"LBFGS.step needs a closure \(it re-evaluates the model\).*Pass optimizer=None"
    with pytest.raises(ValueError, match=r"remat.profile: " + message):
        profile(model, batch, loss_fn=loss_fn, optimizer=lbfgs)
    with pytest.raises(ValueError, match=r"remat.verify: " + message):
        remat.verify(model, batch, plan, loss_fn, lbfgs)
    assert all(torch.equal(a, b) for a, b in zip(before, model.parameters()))
    assert all(p.grad is None for p in model.parameters())


def test_arguments_in_the_wrong_places_are_refused_before_any_step():
    """``remat.verify(model, batch, plan, profile)`` (a profile where the loss function goes) and
    ``remat.profile(model, batch, optimizer)`` (an optimizer there) used to fail inside the step,
    the first with "'Profile' object is not callable"; ``remat.plan(model)`` and
    ``remat.pareto(plan)`` with an AttributeError."""
    import remat

    model = _Pair()
    batch = torch.randn(2, 4)
    loss_fn = lambda out, batch: out.sum()  # noqa: E731
    prof = profile(model, batch, loss_fn=loss_fn, repeats=1)
    plan = remat.plan(prof, strategy="full")
    sgd = torch.optim.SGD(model.parameters(), lr=0.1)
    before = [p.detach().clone() for p in model.parameters()]
    wrong_loss = r"loss_fn must be a function of \(output, batch\).*got a {}\. After the model and the batch come loss_fn"
    with pytest.raises(TypeError, match=r"remat.verify: " + wrong_loss.format("Profile")):
        remat.verify(model, batch, plan, prof)
    with pytest.raises(TypeError, match=r"remat.profile: " + wrong_loss.format("SGD")):
        profile(model, batch, sgd)
    with pytest.raises(TypeError, match=r"remat.verify: optimizer must be a torch.optim.Optimizer \(an object with "
                                        r"step\(\)\), or None for a step without one; got a Profile"):
        remat.verify(model, batch, plan, loss_fn, prof)
    with pytest.raises(TypeError, match=r"remat tuning: " + wrong_loss.format("int")):
        remat.tune(model, batch, prof, "1 GiB", 3)
    needs_profile = r"remat.{} needs the remat Profile of a model.*got {}"
    with pytest.raises(TypeError, match=needs_profile.format("plan", "_Pair")):
        remat.plan(model, budget="1MiB")
    with pytest.raises(TypeError, match=needs_profile.format("pareto", "Plan")):
        remat.pareto(plan)
    with pytest.raises(TypeError, match=needs_profile.format("predict", "Plan")):
        remat.predict(plan, prof)
    assert all(torch.equal(a, b) for a, b in zip(before, model.parameters()))
    assert all(p.grad is None for p in model.parameters())
    assert not remat.apply.api.is_applied(model)


def test_a_call_inside_autocast_is_refused_with_the_wrapper_to_use():
    with torch.autocast("cpu", dtype=torch.bfloat16):
        with pytest.raises(ValueError, match=r"remat.profile was called inside torch.autocast \(cpu\).*Enter autocast "
                                             r"inside the model's forward instead"):
            profile(_Pair(), torch.randn(2, 4), loss_fn=lambda out, batch: out.sum())


@pytest.mark.parametrize("grad", [None, "set"])
def test_the_batchs_input_gradients_are_left_as_they_were(grad):
    """A batch tensor that requires a gradient (``inputs_embeds``, an adversarial input): the
    steps remat runs used to leave their input gradients summed in its ``.grad``."""
    import remat

    torch.manual_seed(0)
    model = _Pair()
    x = torch.randn(2, 4, requires_grad=True)
    x.grad = None if grad is None else torch.full((2, 4), 0.5)
    loss_fn = lambda out, batch: out.square().sum()  # noqa: E731
    result = profile(model, x, loss_fn=loss_fn, repeats=1)
    remat.verify(model, x, remat.plan(result, strategy="full"), loss_fn, repeats=1)
    assert x.grad is None if grad is None else torch.equal(x.grad, torch.full((2, 4), 0.5))


def test_output_not_a_tensor_without_loss_fn():
    with pytest.raises(TypeError, match=r"the model returned dict, not a scalar tensor, and no loss_fn was given "
                                        r"\(nor a .loss or a 'loss' entry\)"):
        profile(_Pair("dict"), torch.randn(2, 4))


def test_a_plain_dict_with_a_loss_entry_gives_the_loss():
    """As a Hugging Face ModelOutput (a dict) gives its ``.loss``."""
    import remat

    model, x = _Pair("dict with loss"), torch.randn(2, 4)
    result = profile(model, x, repeats=1)
    check = remat.verify(model, x, remat.plan(result, strategy="full"), repeats=1)
    assert check.ok and check.grads_identical and check.loss_max_abs_diff == 0.0


def test_batch_on_another_device():
    with pytest.raises(ValueError, match=r"is on meta but the model is on cpu; move the batch"):
        profile(_Pair(), torch.empty(2, 4, device="meta"), loss_fn=lambda out, batch: out.sum())


@pytest.mark.parametrize("kwargs, message", [
    (dict(warmup=-1), r"warmup=-1 must be an integer >= 0"),
    (dict(repeats=0), r"repeats=0 must be an integer >= 1"),
])
def test_bad_counts(kwargs, message):
    with pytest.raises(ValueError, match=message):
        profile(_Pair(), torch.randn(2, 4), loss_fn=lambda out, batch: out.sum(), **kwargs)


def test_failed_profile_leaves_the_model_unchanged():
    torch.manual_seed(0)
    model = _Pair()
    optimizer = torch.optim.SGD(model.parameters(), lr=1.0)
    before = [p.detach().clone() for p in model.parameters()]
    calls = {"n": 0}

    def loss_fn(out, batch):
        calls["n"] += 1
        if calls["n"] > 1:
            raise ValueError("boom")
        return out.sum()

    with pytest.raises(ValueError, match="boom"):
        profile(model, torch.randn(2, 4), loss_fn=loss_fn, optimizer=optimizer)
    assert all(torch.equal(a, b) for a, b in zip(before, model.parameters()))


def test_stacks_run_inside_a_custom_autograd_function_are_named_as_such():
    """Reversible layers (Reformer's) run inside a custom Function's forward, with gradients off;
    the error called them "a frozen part of the model"."""

    class Reversible(torch.autograd.Function):
        @staticmethod
        def forward(ctx, x, layers):
            ctx.layers = layers
            for layer in layers:
                x = layer(x)
            ctx.save_for_backward(x)
            return x

        @staticmethod
        def backward(ctx, grad):
            (y,) = ctx.saved_tensors
            with torch.enable_grad():
                x = y.detach().requires_grad_(True)
                out = x
                for layer in ctx.layers:
                    out = layer(out)
                torch.autograd.backward(out, grad)
            return x.grad, None

    class Model(nn.Module):
        def __init__(self):
            super().__init__()
            self.embed = nn.Linear(4, 4)
            self.layers = nn.ModuleList([nn.Linear(4, 4) for _ in range(3)])

        def forward(self, x):
            return Reversible.apply(self.embed(x), self.layers).sum()

    model = Model()
    with pytest.raises(ValueError, match=r"^no blocks found in Model: every stack runs with gradients disabled \(under "
                                         r"torch.no_grad\(\), a frozen part of the model, or inside a custom "
                                         r"torch.autograd.Function's forward, as reversible layers run"):
        profile(model, torch.randn(2, 4))


@pytest.mark.parametrize("disabled", [torch.no_grad, torch.inference_mode, lambda: torch.set_grad_enabled(False)])
def test_a_step_where_gradients_are_disabled_is_refused_by_name(disabled):
    """Called inside ``torch.no_grad()`` (a notebook cell under it), profile said no block runs with
    gradients, naming frozen parts and custom Functions; verify likewise. Both say where the
    gradients went, and change nothing."""
    import remat
    from remat.plan.planners import plan as make_plan

    model, batch = _Pair(), torch.randn(2, 4)
    loss_fn = lambda out, batch: out.sum()  # noqa: E731
    measured = profile(model, batch, loss_fn=loss_fn, repeats=1)
    full = make_plan(measured, strategy="full")
    before = {k: v.clone() for k, v in model.state_dict().items()}
    for call, where in ((lambda: profile(model, batch, loss_fn=loss_fn), "remat.profile"),
                        (lambda: remat.verify(model, batch, full, loss_fn), "remat.verify")):
        with disabled():
            with pytest.raises(ValueError) as raised:
                call()
        assert str(raised.value) == (
            f"{where} runs a training step, and gradients are disabled where it was called (torch.is_grad_enabled() "
            "is False: inside torch.no_grad(), torch.inference_mode() or torch.set_grad_enabled(False)); call it "
            "outside that block.")
    assert torch.is_grad_enabled() and all(torch.equal(v, model.state_dict()[k]) for k, v in before.items())


def test_parameters_made_under_inference_mode_are_refused_by_name():
    """A model built under ``torch.inference_mode()`` has parameters no step can train; torch raised
    "Inplace update to inference tensor outside InferenceMode is not allowed" from the optimizer's
    step inside the profile."""
    import remat

    with torch.inference_mode():
        model = _Pair()
    said = ("remat.profile: the parameters of _Pair were made under torch.inference_mode() (blocks.0.weight, "
            "blocks.0.bias, blocks.1.weight and 1 more): inference tensors cannot be trained. Build or load the model "
            "outside inference_mode.")
    with pytest.raises(ValueError) as raised:
        profile(model, torch.randn(2, 4), loss_fn=lambda out, batch: out.sum())
    assert str(raised.value) == said
    with pytest.raises(ValueError) as raised:  # auto_ profiles first
        remat.auto_(model, torch.randn(2, 4), lambda out, batch: out.sum(), budget="90%")
    assert str(raised.value) == said
