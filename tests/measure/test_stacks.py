"""Stacks: every stack found, blocks numbered in the order they run, nested chains, errors."""

import gc
import warnings
import weakref

import pytest
import torch
from torch import nn

from remat.checkpointing.callsites import uninstall
from remat.measure.stacks import discover


class Layer(nn.Module):
    def __init__(self, width: int = 4) -> None:
        super().__init__()
        self.linear = nn.Linear(width, width)

    def forward(self, x: torch.Tensor, scale: torch.Tensor | None = None) -> torch.Tensor:
        y = torch.tanh(self.linear(x))
        return y if scale is None else y * scale


class TwoTowers(nn.Module):
    """Registers the text tower first, runs the image tower first (as CLIP does)."""

    def __init__(self) -> None:
        super().__init__()
        self.text = nn.ModuleList(Layer() for _ in range(2))
        self.image = nn.ModuleList(Layer() for _ in range(3))
        self.act = nn.ModuleList([nn.ReLU(), nn.ReLU()])  # no parameters: not a stack

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        y = x
        for layer in self.image:
            y = layer(y)
        z = self.act[0](x)
        scale = torch.ones(4)
        for layer in self.text:
            z = layer(z, scale=scale)
        return (y.sum() + z.sum()).reshape(())


def _run(model: nn.Module, blocks=None):
    x = torch.randn(2, 4)
    return discover(model, blocks, lambda: model(x))


def test_blocks_are_numbered_in_run_order_and_cut_into_stacks():
    found = _run(TwoTowers())
    assert [name for name, _ in found.blocks] == ["image.0", "image.1", "image.2", "text.0", "text.1"]
    assert [(s.name, s.start, s.stop, s.class_name) for s in found.stacks] == [
        ("image", 0, 3, "Layer"), ("text", 3, 5, "Layer")]
    # image.1 and image.2 follow the block before; text.1 follows text.0 (same scale tensor)
    assert found.follows_previous == (False, True, True, False, True)


def test_named_patterns_name_several_stacks():
    found = _run(TwoTowers(), ["text.*", "image.*"])
    assert [s.name for s in found.stacks] == ["image", "text"]
    assert [name for name, _ in found.blocks][:1] == ["image.0"]


class Stage(nn.Module):
    """A hierarchical model's stage: a chain of blocks, then a downsampling of its own."""

    def __init__(self) -> None:
        super().__init__()
        self.blocks = nn.ModuleList(Layer() for _ in range(2))
        self.down = nn.Linear(4, 4)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        for block in self.blocks:
            x = block(x)
        return self.down(x)


class Experts(nn.Module):
    """A layer with parallel experts, each called on some rows: not a chain."""

    def __init__(self) -> None:
        super().__init__()
        self.experts = nn.ModuleList(nn.Linear(4, 4) for _ in range(2))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return torch.cat([self.experts[0](x[:1]), self.experts[1](x[1:])])


@pytest.mark.parametrize("cls, expected", [
    # nested chains: one stack per stage, its downsampling a block of the stage's run
    (Stage, [("stages.0.blocks", 0, 3), ("stages.1.blocks", 3, 6)]),
    (Experts, [("stages", 0, 2)]),  # nested lists that are no chain: the outer list
])
def test_nested_stacks_are_used_when_they_run_as_chains(cls, expected):
    model = nn.Module()
    model.stages = nn.ModuleList(cls() for _ in range(2))

    def forward(x: torch.Tensor) -> torch.Tensor:
        for stage in model.stages:
            x = stage(x)
        return x.sum()

    x = torch.randn(2, 4)
    found = discover(model, None, lambda: forward(x))
    assert [(s.name, s.start, s.stop) for s in found.stacks] == expected


class Twice(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.layers = nn.ModuleList(Layer() for _ in range(2))
        self.unused = nn.ModuleList(Layer() for _ in range(2))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        for layer in [*self.layers, self.layers[0]]:  # layers.0 runs twice: shared weights
            x = layer(x)
        return x.sum()


def test_lists_that_do_not_run_once_each_are_left_out_or_refused():
    found = _run(Twice())  # each call of the layer that runs twice a block, beside the one that runs once
    assert [name for name, _ in found.blocks] == ["layers.0@0", "layers.1", "layers.0@1"]
    assert [(s.name, s.start, s.stop) for s in found.stacks] == [("layers", 0, 3)]
    assert found.follows_previous == (False, True, True)
    uninstall(found.sites)
    with pytest.raises(ValueError, match=r"ran another number of times: \{'layers.0': 2, 'unused.0': 0\}"):
        _run(Twice(), ["layers.0", "unused.0"])


class DirectForward(nn.Module):
    """Calls its layers' ``forward`` directly (SqueezeBERT's encoder): no module hook sees them;
    ``skip`` layers it never runs at all."""

    def __init__(self, skip: int = 0) -> None:
        super().__init__()
        self.layers = nn.ModuleList(Layer() for _ in range(2))
        self.skip = skip

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        for layer in self.layers[self.skip:]:
            x = layer.forward(x)
        return x.sum()


@pytest.mark.parametrize("blocks", [None, "layers.*"])
def test_layers_called_through_their_forward_are_blocks_through_call_sites(blocks):
    model = DirectForward()
    found = _run(model, blocks)
    assert [name for name, _ in found.blocks] == ["layers.0@0", "layers.1@0"]
    assert [(s.name, s.start, s.stop) for s in found.stacks] == [("layers", 0, 2)]
    assert found.follows_previous == (False, True)
    # the parent's ``layer.forward(x)`` reaches the site, hooks and all
    seen = []
    handles = [module.register_forward_pre_hook(lambda m, a, i=i: seen.append(i)) for i, (_, module) in
               enumerate(found.blocks)]
    model(torch.randn(2, 4))
    assert seen == [0, 1]
    for handle in handles:
        handle.remove()
    uninstall(found.sites)
    assert all("forward" not in layer.__dict__ for layer in model.layers)  # the watch and the sites are gone


@pytest.mark.parametrize("blocks", [None, "layers.*"])
def test_layers_never_run_are_explained(blocks):
    with pytest.raises(ValueError, match=r"0 calls \(layers\.0\): the forward never ran them, neither as modules nor "
                                         r"through `module\.forward\(\.\.\.\)`: it skips them"):
        _run(DirectForward(skip=1), blocks)


class Wide(nn.Module):
    """A layer made of layers."""

    def __init__(self) -> None:
        super().__init__()
        self.up, self.down = nn.Linear(4, 8), nn.Linear(8, 4)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return x + self.down(torch.tanh(self.up(x)))


class Chain(nn.Module):
    def __init__(self, layer: type[nn.Module] = Wide) -> None:
        super().__init__()
        self.layers = nn.ModuleList(layer() for _ in range(3))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        for layer in self.layers:
            x = layer(x)
        return x.sum()


class _KeepLayers(torch.fx.Tracer):
    def is_leaf_module(self, module: nn.Module, qualified_name: str) -> bool:
        return isinstance(module, Wide) or super().is_leaf_module(module, qualified_name)


def test_a_traced_graph_module_whose_layers_were_inlined_is_explained():
    """``torch.fx.symbolic_trace`` inlines every module that is not one of torch's own layers, so
    the graph calls ``layers.0.up``, never ``layers.0``, which it keeps as a plain ``Module``: the
    error says so and how to trace."""
    hint = (r"Chain is a torch.fx GraphModule: tracing inlined the forward of every layer that is not one of "
            r"torch's own into its graph.*is_leaf_module returns True for their class\)")
    traced = torch.fx.symbolic_trace(Chain())
    with pytest.raises(ValueError, match=r"its stacks \['layers'\] do not run each member exactly once.*" + hint):
        _run(traced)
    with pytest.raises(ValueError, match=r"ran another number of times.*" + hint):
        _run(traced, "layers.*")
    with pytest.raises(ValueError, match=r"no blocks found in Chain: it has no nn.ModuleList.*" + hint):
        _run(torch.fx.symbolic_trace(Chain(Layer)))  # one Linear per layer: not even a stack of plain modules


def test_a_graph_module_traced_with_its_layers_as_leaves_is_planned_and_verified():
    import remat

    torch.manual_seed(0)
    model = Chain()
    traced = torch.fx.GraphModule(model, _KeepLayers().trace(model))
    assert [name for name, _ in _run(traced).blocks] == ["layers.0", "layers.1", "layers.2"]
    batch = torch.randn(2, 4)
    plan = remat.plan(remat.profile(traced, batch, repeats=1), strategy="full")
    check = remat.verify(traced, batch, plan, repeats=1)
    assert check.grads_identical and check.grad_max_abs_diff == 0.0 and check.recompute_counts_match
    assert check.measured_peak_bytes == check.predicted_peak_bytes


def test_discovery_runs_no_backward_and_leaves_the_model_alone():
    model = TwoTowers()
    before = {k: v.clone() for k, v in model.state_dict().items()}
    _run(model)
    assert all(p.grad is None for p in model.parameters())
    assert all(torch.equal(before[k], v) for k, v in model.state_dict().items())


@pytest.mark.parametrize("cls, forwards", [(Stage, 2), (Experts, 1)])
def test_discovery_frees_the_forward_it_ran_without_waiting_for_the_collector(cls, forwards):
    """The traced forwards' activations go when discovery returns: the profile's warm-up step
    runs next, and a graph kept alive until the cyclic collector ran (a recursive closure over
    the trace) held a second forward's worth of memory through it (6-9 s for that step on a
    16-layer GPT, one step's 0.8 s). A second forward sees the layers beside the stacks (the
    stages' downsampling)."""
    model = nn.Module()
    model.stages = nn.ModuleList(cls() for _ in range(2))
    outputs = []
    model.stages[1].register_forward_hook(lambda module, args, output: outputs.append(weakref.ref(output)))

    def forward(x: torch.Tensor) -> torch.Tensor:
        for stage in model.stages:
            x = stage(x)
        return x.sum()

    x = torch.randn(2, 4, requires_grad=True)
    gc.collect()
    gc.disable()
    try:
        found = discover(model, None, lambda: forward(x))
        assert len(outputs) == forwards and all(ref() is None for ref in outputs)
    finally:
        gc.enable()
    assert found.blocks


class ListOfLists(nn.Module):
    """Layers kept in a list of plain lists (as Funnel's encoder keeps one list per pooling
    block), then a stack of its own; ``sizes``: layers per inner list."""

    def __init__(self, sizes: tuple[int, ...]) -> None:
        super().__init__()
        self.blocks = nn.ModuleList(nn.ModuleList(Layer() for _ in range(n)) for n in sizes)
        self.head = nn.ModuleList(Layer() for _ in range(2))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        for group in self.blocks:
            for layer in group:
                x = layer(x)
        for layer in self.head:
            x = layer(x)
        return x.sum()


@pytest.mark.parametrize("sizes", [(1, 1), (2, 2), (1, 3)])
def test_a_list_of_plain_lists_gives_the_layers_of_all_of_them(sizes):
    found = _run(ListOfLists(sizes))
    layers = [f"blocks.{i}.{j}" for i, n in enumerate(sizes) for j in range(n)]
    assert [name for name, _ in found.blocks] == layers + ["head.0", "head.1"]
    assert [(s.name, s.start, s.stop) for s in found.stacks] == [("blocks", 0, len(layers)), ("head", len(layers), len(layers) + 2)]


class Attention(nn.Module):
    def __init__(self, d: int = 4) -> None:
        super().__init__()
        self.norm, self.qkv, self.out = nn.LayerNorm(d), nn.Linear(d, 3 * d), nn.Linear(d, d)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        q, k, v = self.qkv(self.norm(x)).chunk(3, dim=-1)
        return self.out(torch.softmax(q @ k.transpose(-1, -2), dim=-1) @ v)


class Residual(nn.Module):  # no weights of its own
    def forward(self, x: torch.Tensor, residual: torch.Tensor) -> torch.Tensor:
        return x + residual


class PairsOfLayers(nn.Module):
    """vit-pytorch's ViT: ``layers = ModuleList([ModuleList([Attention, FeedForward]) ...])``
    iterated ``for attn, ff in layers``; ``wrapped``: x-transformers' ``[norms, layer, residual]``,
    the norms in a list of their own and a residual without weights."""

    def __init__(self, wrapped: bool, depth: int = 3) -> None:
        super().__init__()
        self.wrapped = wrapped
        pairs = [(Attention(), Layer()) for _ in range(depth)]
        if wrapped:
            self.layers = nn.ModuleList(nn.ModuleList([nn.ModuleList([nn.LayerNorm(4)]), layer, Residual()])
                                        for pair in pairs for layer in pair)
        else:
            self.layers = nn.ModuleList(nn.ModuleList(pair) for pair in pairs)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if self.wrapped:
            for norms, layer, residual in self.layers:
                x = residual(layer(norms[0](x)), x)
        else:
            for attn, ff in self.layers:
                x = attn(x) + x
                x = ff(x) + x
        return x.sum()


@pytest.mark.parametrize("wrapped", [False, True])
def test_lists_of_attention_and_feed_forward_pairs_give_their_layers(wrapped):
    """'no blocks found' before: the inner lists hold several classes (and, wrapped, a list of
    norms and a residual without weights), which are never called themselves."""
    found = _run(PairsOfLayers(wrapped))
    if wrapped:  # each layer, and the norm of its list run beside it
        expected = [name for i in range(6) for name in (f"layers.{i}.0.0", f"layers.{i}.1")]
    else:
        expected = [f"layers.{i}.{j}" for i in range(3) for j in range(2)]
    assert [name for name, _ in found.blocks] == expected


class PartlyRun(nn.Module):
    """One stack runs once each; the other runs its first member twice and its second never."""

    def __init__(self) -> None:
        super().__init__()
        self.layers = nn.ModuleList(Layer() for _ in range(2))
        self.loop = nn.ModuleList(Layer() for _ in range(2))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        for layer in self.layers:
            x = layer(x)
        return self.loop[0](self.loop[0](x)).sum()


class PartlySkipped(PartlyRun):
    """The second stack runs its first member once and its second never."""

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        for layer in self.layers:
            x = layer(x)
        return self.loop[0](x).sum()


def test_a_stack_left_out_beside_others_is_named_in_a_warning():
    with pytest.warns(UserWarning, match=r"left out the stacks loop \(calls per member: \{'loop.0': 1, 'loop.1': 0\}\)"):
        found = _run(PartlySkipped())
    assert [name for name, _ in found.blocks] == ["layers.0", "layers.1"]


def test_a_stack_whose_member_runs_twice_beside_others_has_each_call_planned():
    """A looped model's core between layers that run once: the core's calls are blocks too
    (before, its stack was left out with a warning, half the model planned)."""
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        found = _run(PartlyRun())
    uninstall(found.sites)
    assert [name for name, _ in found.blocks] == ["layers.0", "layers.1", "loop.0@0", "loop.0@1"]
    assert [(s.name, s.start, s.stop) for s in found.stacks] == [("layers", 0, 2), ("loop", 2, 4)]
    assert found.follows_previous == (False, True, False, True)


class Shared(nn.Module):
    """One layer called at every depth (ALBERT's layer group): no list of two."""

    def __init__(self) -> None:
        super().__init__()
        self.groups = nn.ModuleList([Layer()])

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        for _ in range(3):
            x = self.groups[0](x)
        return x.sum()


@pytest.mark.parametrize("blocks", [None, "groups.0"])
def test_each_call_of_a_layer_shared_across_depths_is_a_block(blocks):
    found = _run(Shared(), blocks)
    try:
        assert [name for name, _ in found.blocks] == ["groups.0@0", "groups.0@1", "groups.0@2"]
        assert [(s.name, s.start, s.stop, s.class_name) for s in found.stacks] == [("groups", 0, 3, "Layer")]
        assert found.follows_previous == (False, True, True)  # each call takes the one before's output
        layer = found.sites[0].layer
        assert all(site.__dict__["_site_of"] is layer for _, site in found.blocks)
        assert isinstance(found.blocks[0][1], Layer) and found.blocks[0][1] is not layer
    finally:
        uninstall(found.sites)
    assert "forward" not in layer.__dict__


class SharedAndFrozen(nn.Module):
    """A layer called at two depths with gradients and once more under ``torch.no_grad()``."""

    def __init__(self) -> None:
        super().__init__()
        self.groups = nn.ModuleList([Layer()])

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        with torch.no_grad():
            reference = self.groups[0](x)
        return (self.groups[0](self.groups[0](x)) - reference).sum()


@pytest.mark.parametrize("blocks", [None, "groups.0"])
def test_a_call_without_gradients_is_counted_but_no_block(blocks):
    found = _run(SharedAndFrozen(), blocks)
    uninstall(found.sites)
    assert [name for name, _ in found.blocks] == ["groups.0@1", "groups.0@2"]  # call 0 ran under no_grad
    assert len(found.sites[0].sites) == 3 and found.follows_previous == (False, True)


class Gated(nn.Module):
    def __init__(self, width: int = 4) -> None:
        super().__init__()
        self.gate, self.value = nn.Linear(width, width), nn.Linear(width, width)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return torch.sigmoid(self.gate(x)) * self.value(x)


class Hybrid(nn.Module):
    """Layers of two classes in one list (Jamba's Mamba and attention layers), and a
    Sequential of a Linear and a LayerNorm: a pipeline, not a stack."""

    def __init__(self) -> None:
        super().__init__()
        self.layers = nn.ModuleList([Layer(), Gated(), Layer(), Gated()])
        self.out = nn.Sequential(nn.Linear(4, 4), nn.LayerNorm(4))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        for layer in self.layers:
            x = layer(x)
        return self.out(x).sum()


def test_a_list_of_layers_of_several_classes_is_a_stack():
    found = _run(Hybrid())
    assert [name for name, _ in found.blocks] == ["layers.0", "layers.1", "layers.2", "layers.3"]
    assert [(s.name, s.start, s.stop) for s in found.stacks] == [("layers", 0, 4)]
    assert found.follows_previous == (False, True, True, True)


class Frozen(nn.Module):
    """A frozen tower run under no_grad (CLIPSeg's CLIP), then a trained stack."""

    def __init__(self) -> None:
        super().__init__()
        self.tower = nn.ModuleList(Layer() for _ in range(2))
        self.layers = nn.ModuleList(Layer() for _ in range(2))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        with torch.no_grad():
            for layer in self.tower:
                x = layer(x)
        for layer in self.layers:
            x = layer(x)
        return x.sum()


def test_blocks_run_without_gradients_are_left_out_with_a_warning():
    with pytest.warns(UserWarning, match=r"runs with gradients disabled .*: tower\.0, tower\.1\."):
        found = _run(Frozen())
    assert [name for name, _ in found.blocks] == ["layers.0", "layers.1"]
    with pytest.raises(ValueError, match=r"every block named by blocks='tower\.\*' runs with gradients disabled"):
        with pytest.warns(UserWarning):
            _run(Frozen(), "tower.*")


class Stage(nn.Module):
    def __init__(self, depth: int) -> None:
        super().__init__()
        self.layers = nn.ModuleList(Layer() for _ in range(depth))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        for layer in self.layers:
            x = layer(x)
        return x


class Stages(nn.Module):
    """Stages of 1, 2 and 1 layers (UperNet's ConvNeXt at depths [1, 2, 1]): only the middle
    one holds a stack, so the stages are the blocks."""

    def __init__(self, depths: tuple[int, ...] = (1, 2, 1)) -> None:
        super().__init__()
        self.stages = nn.ModuleList(Stage(d) for d in depths)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        for stage in self.stages:
            x = stage(x)
        return x.sum()


def test_nested_stacks_that_leave_a_member_out_keep_the_outer_stack():
    assert [name for name, _ in _run(Stages((1, 2, 1))).blocks] == ["stages.0", "stages.1", "stages.2"]
    found = _run(Stages((2, 2)))  # every stage holds a stack: its layers are the blocks
    assert [name for name, _ in found.blocks] == ["stages.0.layers.0", "stages.0.layers.1",
                                                  "stages.1.layers.0", "stages.1.layers.1"]


class ReadOnly(nn.Module):
    """A list whose members are never called: the model reads their weights (SAM's point
    embeddings)."""

    def __init__(self) -> None:
        super().__init__()
        self.layers = nn.ModuleList(Layer() for _ in range(2))
        self.tables = nn.ModuleList(nn.Linear(4, 4) for _ in range(2))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        for layer in self.layers:
            x = layer(x)
        return (x + self.tables[0].weight[0] + self.tables[1].weight[1]).sum()


def test_a_list_whose_members_never_run_is_named_as_such():
    with pytest.warns(UserWarning, match=r"tables \(its members are never called: the model reads their weights, "
                                         r"nothing to plan\)") as caught:
        _run(ReadOnly())
    assert "To plan them" not in str(caught[0].message)  # no advice that cannot work


class Lookups(nn.Module):
    """MarkupLM's embeddings: a list of tables per xpath depth, each looked up once and summed,
    before a stack of layers."""

    def __init__(self) -> None:
        super().__init__()
        self.tables = nn.ModuleList(nn.Embedding(8, 4) for _ in range(3))
        self.layers = nn.ModuleList(Layer() for _ in range(2))

    def forward(self, ids: torch.Tensor) -> torch.Tensor:
        x = sum(table(ids[:, i]) for i, table in enumerate(self.tables))
        for layer in self.layers:
            x = layer(x)
        return x.sum()


def test_a_list_of_embedding_tables_is_no_stack():
    """Its tables were blocks (MarkupLM: 100 of 102), each replay a lookup saving nothing."""
    model = Lookups()
    ids = torch.randint(0, 8, (5, 3))
    found = discover(model, None, lambda: model(ids))
    assert [name for name, _ in found.blocks] == ["layers.0", "layers.1"]


class _Res(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.conv = nn.Conv2d(4, 4, 3, padding=1)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return x + torch.relu(self.conv(x))


class _Mid(nn.Module):
    """A U-Net mid block: ResNet unit, attention (a list of one), ResNet unit."""

    def __init__(self) -> None:
        super().__init__()
        self.resnets = nn.ModuleList(_Res() for _ in range(2))
        self.attentions = nn.ModuleList([_Res()])

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.resnets[1](self.attentions[0](self.resnets[0](x)))


class _UpStage(nn.Module):
    """A VAE decoder stage: ResNet units, then an upsampler after an interpolation."""

    def __init__(self) -> None:
        super().__init__()
        self.resnets = nn.ModuleList(_Res() for _ in range(2))
        self.upsamplers = nn.ModuleList([nn.Conv2d(4, 4, 3, padding=1)])

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        for unit in self.resnets:
            x = unit(x)
        return self.upsamplers[0](nn.functional.interpolate(x, scale_factor=2.0))


class _Decoder(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.embed = nn.Conv2d(4, 4, 1)
        self.mid = _Mid()
        self.up_blocks = nn.ModuleList(_UpStage() for _ in range(2))
        self.out = nn.Conv2d(4, 4, 1)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = self.mid(self.embed(x))
        for stage in self.up_blocks:
            x = stage(x)
        return self.out(x).square().mean()


def test_layers_beside_the_stacks_are_blocks_of_their_runs():
    """Descending into the ResNet units of a decoder's stages left each stage's upsampler, and
    the mid block's attention (a list of one, no stack), in the fixed part, never recomputed:
    the upsampler's output at twice the resolution is the decoder's largest. They are blocks
    of the runs they sit in now; the attention takes the unit before's output, so a segment may
    span it, the upsampler (after an interpolation) may not. The layers before and after every
    stack (a stem, an output convolution) stay in the fixed part."""
    model, x = _Decoder(), torch.randn(2, 4, 8, 8)
    found = discover(model, None, lambda: model(x))
    assert [name for name, _ in found.blocks] == [
        "mid.resnets.0", "mid.attentions.0", "mid.resnets.1",
        "up_blocks.0.resnets.0", "up_blocks.0.resnets.1", "up_blocks.0.upsamplers.0",
        "up_blocks.1.resnets.0", "up_blocks.1.resnets.1", "up_blocks.1.upsamplers.0"]
    assert [(s.name, s.start, s.stop) for s in found.stacks] == [
        ("mid.resnets", 0, 3), ("up_blocks.0.resnets", 3, 6), ("up_blocks.1.resnets", 6, 9)]
    assert found.follows_previous == (False, True, True, False, True, False, False, True, False)


class _Transformer2D(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.norm = nn.GroupNorm(2, 4)
        self.proj_in = nn.Linear(4, 4)
        # most of the stage's parameters, as a U-Net's transformer blocks hold (`mostly_nested`)
        self.transformer_blocks = nn.ModuleList(nn.Sequential(nn.Linear(4, 64), nn.GELU(), nn.Linear(64, 4))
                                                for _ in range(2))
        self.proj_out = nn.Linear(4, 4)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        b, c, h, w = x.shape
        y = self.proj_in(self.norm(x).permute(0, 2, 3, 1).reshape(b, h * w, c))
        for block in self.transformer_blocks:
            y = block(y)
        return x + self.proj_out(y).reshape(b, h, w, c).permute(0, 3, 1, 2)


class _DownStage(nn.Module):
    """A U-Net down stage: a ResNet unit and an attention (lists of one), then a downsampler."""

    def __init__(self) -> None:
        super().__init__()
        self.resnets = nn.ModuleList([_Res()])
        self.attentions = nn.ModuleList([_Transformer2D()])
        self.downsamplers = nn.ModuleList([nn.Conv2d(4, 4, 3, stride=2, padding=1)])

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.downsamplers[0](self.attentions[0](self.resnets[0](x)))


def test_a_stage_descended_into_keeps_every_layer_around_its_nested_stack():
    """Each stage holds a stack two levels down (its attention's transformer blocks): remat
    descended to them and planned nothing else of the stage (its ResNet unit, the attention's
    norm and projections, the downsampler). Every one is a block of the stage's run now, in the
    order the forward runs them."""
    model = nn.Module()
    model.stages = nn.ModuleList(_DownStage() for _ in range(2))
    assert 2 * sum(p.numel() for p in model.stages[0].attentions[0].transformer_blocks.parameters()) > sum(
        p.numel() for p in model.stages[0].parameters())

    def forward(x: torch.Tensor) -> torch.Tensor:
        for stage in model.stages:
            x = stage(x)
        return x.square().mean()

    found = discover(model, None, lambda: forward(torch.randn(2, 4, 8, 8)))
    layers = ["resnets.0", "attentions.0.norm", "attentions.0.proj_in", "attentions.0.transformer_blocks.0",
              "attentions.0.transformer_blocks.1", "attentions.0.proj_out", "downsamplers.0"]
    assert [name for name, _ in found.blocks] == [f"stages.{i}.{layer}" for i in range(2) for layer in layers]
    assert [(s.name, s.start, s.stop) for s in found.stacks] == [
        ("stages.0.attentions.0.transformer_blocks", 0, 7), ("stages.1.attentions.0.transformer_blocks", 7, 14)]


class _FocalLayer(nn.Module):
    """FocalNet's layer: projections and an MLP, and a list of two small depthwise convolutions."""

    def __init__(self) -> None:
        super().__init__()
        self.proj_in = nn.Linear(8, 8)
        self.focal_layers = nn.ModuleList(nn.Conv1d(8, 8, 3, padding=1, groups=8) for _ in range(2))
        self.mlp = nn.Sequential(nn.Linear(8, 32), nn.GELU(), nn.Linear(32, 8))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = self.proj_in(x).transpose(1, 2)
        for conv in self.focal_layers:
            h = conv(h)
        x = x + h.transpose(1, 2)
        return x + self.mlp(x)


def test_a_nested_list_of_small_layers_is_not_descended_into():
    """Descending into FocalNet's focal convolutions cut each layer into eight blocks and left
    its residual code between them (least feasible peak 15 % above the layers as blocks): a
    member is split only where its nested stacks hold at least half its parameters."""
    model = nn.Module()
    model.layers = nn.ModuleList(_FocalLayer() for _ in range(3))

    def forward(x: torch.Tensor) -> torch.Tensor:
        for layer in model.layers:
            x = layer(x)
        return x.square().mean()

    found = discover(model, None, lambda: forward(torch.randn(2, 5, 8)))
    assert [name for name, _ in found.blocks] == ["layers.0", "layers.1", "layers.2"]


class _MidWithTransformer(nn.Module):
    """A U-Net mid block whose attention holds a stack of transformer blocks."""

    def __init__(self) -> None:
        super().__init__()
        self.resnets = nn.ModuleList(_Res() for _ in range(2))
        self.attentions = nn.ModuleList([_Transformer2D()])

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.resnets[1](self.attentions[0](self.resnets[0](x)))


def test_a_layer_between_two_members_that_holds_blocks_gives_its_other_layers_too():
    """The attention between the mid block's ResNet units holds its own stack (the transformer
    blocks, chosen as blocks): its norm and projections were left in the fixed part."""
    model = nn.Module()
    model.mid = _MidWithTransformer()
    found = discover(model, None, lambda: model.mid(torch.randn(2, 4, 8, 8)).square().mean())
    assert [name for name, _ in found.blocks] == [
        "mid.resnets.0", "mid.attentions.0.norm", "mid.attentions.0.proj_in", "mid.attentions.0.transformer_blocks.0",
        "mid.attentions.0.transformer_blocks.1", "mid.attentions.0.proj_out", "mid.resnets.1"]


class _Pair(nn.Module):
    """A policy called twice in one step: on chosen and rejected (DPO without concatenation), or
    once under no_grad as its own reference."""

    def __init__(self, reference: bool) -> None:
        super().__init__()
        self.layers = nn.ModuleList([nn.Linear(4, 4) for _ in range(2)])
        self.reference = reference

    def policy(self, x: torch.Tensor) -> torch.Tensor:
        for layer in self.layers:
            x = layer(x)
        return x

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if self.reference:
            with torch.no_grad():
                ref = self.policy(x)
            return (self.policy(x) - ref).pow(2).sum()
        return (self.policy(x) - self.policy(x + 1)).pow(2).sum()


@pytest.mark.parametrize("blocks", [None, "layers.*"])
def test_a_model_called_twice_in_a_step_has_each_call_planned(blocks):
    """A DPO step without concatenation calls the policy on chosen and rejected: each call of each
    layer is a block; the second call of the first layer takes another input, so it starts a run
    of its own."""
    found = _run(_Pair(reference=False), blocks)
    uninstall(found.sites)
    assert [name for name, _ in found.blocks] == ["layers.0@0", "layers.1@0", "layers.0@1", "layers.1@1"]
    assert found.follows_previous == (False, True, False, True)


@pytest.mark.parametrize("blocks", [None, "layers.*"])
def test_a_model_called_again_without_gradients_has_its_calls_with_gradients_planned(blocks):
    """A DPO step that runs the policy as its own reference under no_grad first: the calls of
    the reference pass are counted (the layers hand their calls on by number) but are no blocks."""
    found = _run(_Pair(reference=True), blocks)
    uninstall(found.sites)
    assert [name for name, _ in found.blocks] == ["layers.0@1", "layers.1@1"]
    assert found.follows_previous == (False, True)


class FrozenRepeats(nn.Module):
    """A layer at every depth, all under ``torch.no_grad()``: nothing to recompute."""

    def __init__(self) -> None:
        super().__init__()
        self.groups = nn.ModuleList([Layer()])
        self.head = nn.Linear(4, 4)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        with torch.no_grad():
            for _ in range(3):
                x = self.groups[0](x)
        return self.head(x).sum()


def test_a_layer_that_repeats_only_without_gradients_is_refused_with_the_reason():
    with pytest.raises(ValueError, match=r"its only layers repeat\. Calls per step: \{'groups\.0': 3\}\. Of these, 3 per "
                                         r"module ran with gradients disabled.*Every call ran with gradients disabled "
                                         r"\(under torch.no_grad\(\).*nothing to recompute"):
        _run(FrozenRepeats())


class LoopBesideMid(nn.Module):
    """A stack with a layer run between two of its members (found by a second trace), and a
    looped stack beside it."""

    def __init__(self) -> None:
        super().__init__()
        self.layers = nn.ModuleList(Layer() for _ in range(2))
        self.mid = Gated()
        self.loop = nn.ModuleList(Layer() for _ in range(2))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = self.mid(self.layers[0](x))
        x = self.layers[1](x)
        for _ in range(2):
            for layer in self.loop:
                x = layer(x)
        return x.sum()


def test_a_looped_stack_beside_a_stack_with_a_layer_between_its_members_is_planned():
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        found = _run(LoopBesideMid())
    uninstall(found.sites)
    assert [name for name, _ in found.blocks] == ["layers.0", "mid", "layers.1", "loop.0@0", "loop.1@0", "loop.0@1",
                                                  "loop.1@1"]


class Skips(nn.Module):
    """Runs its two layers, drawing random numbers; the two of ``spare`` never run."""

    def __init__(self) -> None:
        super().__init__()
        self.layers = nn.ModuleList(Layer() for _ in range(2))
        self.spare = nn.ModuleList(Layer() for _ in range(2))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        for layer in self.layers:
            x = layer(x) + torch.rand_like(x)
        return x.sum()


def test_the_forward_that_looks_for_direct_calls_leaves_the_random_draws_as_they_were():
    """Where a member never runs, discovery runs the forward once more to see calls of its
    ``forward``: that forward drew random numbers, so the profiled step after it drew others
    (VITS's random durations set its shapes: its predictions 20-27 % over, from 1.1-1.4 %)."""
    model, x = Skips(), torch.randn(2, 4)
    torch.manual_seed(0)
    model(x)
    once = torch.get_rng_state()
    torch.manual_seed(0)
    with pytest.warns(UserWarning, match="left out the stacks spare"):
        found = discover(model, None, lambda: model(x))
    assert [name for name, _ in found.blocks] == ["layers.0", "layers.1"]
    assert torch.equal(torch.get_rng_state(), once)
