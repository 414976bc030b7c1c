"""Compiled mode (`remat.profile(..., compiled=...)`, `remat.measure.compiled`): the blocks'
figures as torch.compile runs them, and a plan made from them that compiles whole.

The toy block is ``fc2(tanh(fc1(x)) * sigmoid(fc1(x)))`` on a (8, 16) float32 input, so every
activation is 8 * 16 * 4 = 512 bytes. Eager autograd saves four of them: ``x`` (fc1's weight
gradient), tanh's and sigmoid's outputs (their own backward and the product's) and the product
(fc2's weight gradient): 2048 bytes. Inductor's partitioner saves three: ``x``, fc1's output
(tanh and sigmoid are recomputed from it inside the fused backward) and the product: 1536.
``aot_eager`` partitions by the default rule, which saves what eager autograd saves: 2048.

Inductor compiles C++ on the CPU, tens of seconds per graph here: those tests are marked slow;
the others use ``aot_eager`` (Dynamo and AOT Autograd, the same partition points, no codegen).
"""

from __future__ import annotations

import copy
import dataclasses

import pytest
import torch
from torch import nn

import remat
from remat.checkpointing.cacheable import MATMUL_OPS, op_packet
from remat.measure.compiled import matmul_replay_ms
from remat.measure.types import CompiledBlock, Profile

WIDTH, BATCH = 16, 8
ACTIVATION_BYTES = BATCH * WIDTH * 4


class _Block(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.fc1 = nn.Linear(WIDTH, WIDTH)
        self.fc2 = nn.Linear(WIDTH, WIDTH)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        y = self.fc1(x)
        return self.fc2(torch.tanh(y) * torch.sigmoid(y))


class _Net(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.embed = nn.Linear(WIDTH, WIDTH)  # both blocks' inputs need gradients: alike blocks
        self.blocks = nn.ModuleList(_Block() for _ in range(2))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = self.embed(x)
        for block in self.blocks:
            x = block(x)
        return x.square().mean()


def _model() -> tuple[_Net, torch.Tensor]:
    torch.manual_seed(0)
    return _Net(), torch.randn(BATCH, WIDTH)


def _profiles(backend: str) -> tuple[Profile, Profile]:
    model, x = _model()
    eager = remat.profile(model, x, repeats=1)
    torch._dynamo.reset()
    return eager, remat.profile(model, x, repeats=1, compiled=backend)


@pytest.fixture(scope="module")
def aot_eager_profiles() -> tuple[Profile, Profile]:
    return _profiles("aot_eager")


def test_a_compiled_profile_prices_blocks_as_the_compiled_runs_measured_them(aot_eager_profiles):
    eager, compiled = aot_eager_profiles
    assert eager.compiled_backend == "" and eager.compiled_blocks == ()
    assert compiled.compiled_backend == "aot_eager"
    assert compiled.checkpoint_call_ms == 0.0
    figs = compiled.compiled_blocks
    assert len(figs) == 2 and figs[0] is figs[1]  # alike blocks: compiled and measured once
    for before, block, fig in zip(eager.blocks, compiled.blocks, figs, strict=True):
        assert (fig.eager_saved_bytes, fig.saved_bytes) == (4 * ACTIVATION_BYTES, 4 * ACTIVATION_BYTES)
        assert block.saved_bytes == before.saved_bytes
        assert (block.fwd_ms, block.bwd_ms) == (fig.fwd_ms, fig.bwd_ms)
        assert block.recompute_overhead_ms == max(0.0, fig.replay_ms - fig.fwd_ms)
        assert block.selective_overhead_ms == block.selective_cache_overhead_ms == 0.0
        assert 0.0 <= fig.cheap_replay_ms <= fig.replay_ms
        heavy = [op for op in block.ops if op_packet(op.name) in MATMUL_OPS]
        cheap = [op for op in block.ops if op_packet(op.name) not in MATMUL_OPS and not op.is_view]
        assert [op_packet(op.name) for op in heavy] == ["aten.addmm", "aten.addmm"]
        # the matmuls' replay: what the runs measured, at least their share of the forward
        assert sum(op.time_ms for op in heavy) >= fig.replay_ms - fig.cheap_replay_ms - 1e-9
        assert 0.0 < sum(op.time_ms for op in heavy) <= max(fig.replay_ms - fig.cheap_replay_ms, fig.fwd_ms) + 1e-9
        assert sum(op.time_ms for op in cheap) == pytest.approx(fig.cheap_replay_ms, abs=1e-9)
        # everything the eager profile measured about memory stays
        assert (block.bwd_temp_bytes, block.input_bytes, block.ops[0].key) == (
            before.bwd_temp_bytes, before.input_bytes, before.ops[0].key)
    assert Profile.from_json(compiled.to_json()) == compiled


def test_a_replayed_matmul_costs_at_least_its_share_of_the_compiled_forward(aot_eager_profiles):
    eager, _ = aot_eager_profiles
    ops = eager.blocks[0].ops
    heavy = sum(op.time_ms for op in ops if op_packet(op.name) in MATMUL_OPS)
    share = heavy / sum(op.time_ms for op in ops if not op.is_view)
    assert 0.0 < share < 1.0

    def fig(replay_ms: float, cheap_ms: float) -> CompiledBlock:
        return CompiledBlock(fwd_ms=2.0, bwd_ms=3.0, replay_ms=replay_ms, cheap_replay_ms=cheap_ms,
                             saved_bytes=0, eager_saved_bytes=0)

    assert matmul_replay_ms(ops, fig(0.0, 0.0)) == pytest.approx(2.0 * share)  # a noisy 0 is not free
    assert matmul_replay_ms(ops, fig(5.0, 1.0)) == 4.0  # measured above the share: as measured


def test_a_plan_from_a_compiled_profile_compiles_whole_with_the_unplanned_gradients(aot_eager_profiles):
    _, compiled = aot_eager_profiles
    plan = remat.plan(compiled, strategy="full")
    assert [s.strategy for s in plan.segments] == ["recompute", "recompute"]
    want, got = _compiled_grads(None, "aot_eager"), _compiled_grads(plan, "aot_eager")
    for name in want:
        torch.testing.assert_close(got[name], want[name], msg=name)


def _compiled_grads(plan: remat.Plan | None, backend: str) -> dict[str, torch.Tensor]:
    model, x = _model()
    model = copy.deepcopy(model)
    if plan is not None:
        remat.apply_(model, plan)
    torch._dynamo.reset()
    compiled = torch.compile(model, fullgraph=True, backend=backend)  # a graph break raises
    compiled(x).backward()
    return {name: p.grad for name, p in model.named_parameters()}


@pytest.mark.slow
def test_inductor_saves_less_than_eager_and_the_profile_keeps_the_difference():
    """The kept block saves one activation less compiled; a replay is priced as the eager one (a
    Llama layer's compiled replay holds about what its eager replay holds, though its kept
    compiled graph saves 3.1 MB less), so a full plan predicts the eager profile's peak. Here
    inductor's replay saves less too: the compiled step measures that activation per block under
    it, on the safe side."""
    eager, compiled = _profiles("inductor")
    for before, block, fig in zip(eager.blocks, compiled.blocks, compiled.compiled_blocks, strict=True):
        assert (fig.eager_saved_bytes, fig.saved_bytes) == (4 * ACTIVATION_BYTES, 3 * ACTIVATION_BYTES)
        assert block.saved_bytes == before.saved_bytes - ACTIVATION_BYTES
        assert block.replay_saved_extra_bytes == ACTIVATION_BYTES and before.replay_saved_extra_bytes == 0
    none = remat.plan(compiled, strategy="none").prediction.peak_bytes
    assert none < remat.plan(eager, strategy="none").prediction.peak_bytes
    full = remat.plan(compiled, strategy="full")
    assert full.prediction.peak_bytes == remat.plan(eager, strategy="full").prediction.peak_bytes
    model, x = _model()
    torch._dynamo.reset()
    v = remat.verify(model, x, full, repeats=1)
    assert v.compiled_peak_bytes == v.compiled_baseline_peak_bytes == none  # the plan without recomputation: exact
    assert v.compiled_peak_bytes == full.prediction.peak_bytes - 384  # 3 % under: safe
    plan = remat.plan(compiled, strategy="selective:save-matmuls")
    want, got = _compiled_grads(None, "inductor"), _compiled_grads(plan, "inductor")
    for name in want:
        torch.testing.assert_close(got[name], want[name], msg=name)


class _Encoder(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.blocks = nn.ModuleList(_Block() for _ in range(2))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        for block in self.blocks:
            x = block(x)
        return x


class _Patches(nn.Module):
    """A ViT's layout: a patch embedding (a convolution, its stride its kernel) before the
    blocks, which an encoder module runs."""

    def __init__(self) -> None:
        super().__init__()
        self.embed = nn.Conv2d(3, WIDTH, kernel_size=8, stride=8)
        self.encoder = _Encoder()

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.encoder(self.embed(x).flatten(2).transpose(1, 2)).square().mean()


@pytest.mark.slow
def test_the_part_before_the_blocks_is_priced_as_the_compiled_step_holds_it():
    """Inductor on the CPU runs a convolution channels-last: the compiled graph saves
    channels-last copies of the patch embedding's input (2 x 3 x 32 x 32 float32, 24 KiB) and
    weight (12 KiB) for the backward, where eager autograd saves the batch and the parameter
    themselves, and its backward makes more. Both live to the step's last phase, the patch
    embedding's backward, whatever the plan: priced eagerly, the compiled step measured 2.5 times
    the prediction of no recomputation and 2.7 times full recomputation's. The profile measures
    that part compiled around the eager blocks, with the allocator, as verify measures the step:
    every plan's prediction is the compiled step's peak, to the byte."""
    torch.manual_seed(0)
    model, x = _Patches(), torch.randn(2, 3, 32, 32)
    eager = remat.profile(model, x, repeats=1)
    torch._dynamo.reset()
    compiled = remat.profile(model, x, repeats=1, compiled="inductor")
    copies = x.nbytes + model.embed.weight.nbytes
    assert compiled.fixed_pre_saved_bytes == eager.fixed_pre_saved_bytes + copies
    assert compiled.fixed_pre_bwd_temp_bytes > eager.fixed_pre_bwd_temp_bytes
    for strategy in ("none", "full"):
        plan = remat.plan(compiled, strategy=strategy)
        assert plan.prediction.peak_phase == "pre-backward"
        torch._dynamo.reset()
        v = remat.verify(model, x, plan, repeats=1)
        assert v.compiled_error == "" and v.compiled_peak_bytes == plan.prediction.peak_bytes
        assert v.measured_peak_bytes == remat.plan(eager, strategy=strategy).prediction.peak_bytes  # eager: as before


@pytest.mark.parametrize(("compiled", "error", "match"), [
    ("no-such-backend", ValueError, r"compiled='no-such-backend' is not a torch.compile backend; known: .*inductor"),
    (3, TypeError, r"compiled=3 must be a bool or a torch.compile backend name"),
])
def test_a_bad_compiled_argument_is_refused_before_anything_runs(compiled, error, match):
    model, x = _model()
    with pytest.raises(error, match=match):
        remat.profile(model, x, compiled=compiled)
    assert all(p.grad is None for p in model.parameters())


def test_the_meta_device_cannot_be_profiled_compiled():
    with torch.device("meta"):
        model = _Net()
    with pytest.raises(ValueError, match=r"compiled=True needs a model that runs: it is on the meta device"):
        remat.profile(model, torch.empty(BATCH, WIDTH, device="meta"), compiled=True)


def test_a_selective_policy_names_the_same_calls_compiled_as_eager_dropout_included():
    """Traced for the compiler, dropout is one ``native_dropout`` call; eager on the CPU it is
    empty_like, bernoulli_, div_ and mul. The policy counts it as the eager calls, so every key
    a plan can name (cacheable, and no view or alias in the profile: ``_unsafe_view``, traced as
    ``view`` for the compiler, is an alias and never saved) means the same call in both. The
    knapsack saved ``_unsafe_view`` calls beside their matmuls before: compiled, those keys named
    other calls (a per-head value tensor in Llama's attention)."""
    from torch.utils.checkpoint import checkpoint, create_selective_checkpoint_contexts

    from remat.checkpointing.selective import SavedOpsPolicy
    from remat.models import build
    from remat.plan.policies import knapsack_frontier, op_cacheable

    built = build("gpt", seed=0, optimizer="none", num_layers=1, d_model=16, num_heads=2, seq_len=8,
                  batch_size=2, vocab_size=32, dropout=0.1)
    block_profile = remat.profile(built.model, built.batch, built.loss_fn, blocks="blocks.*", repeats=1).blocks[0]
    ops = block_profile.ops
    plannable = {op.key for op in ops if not op.is_view and op_cacheable(op)}
    unsafe_views = [op for op in ops if op.name == "aten._unsafe_view.default"]
    assert unsafe_views and all(op.is_view for op in unsafe_views)  # the attention's reshapes of matmuls
    block, x = built.model.blocks[0], torch.randn(2, 8, 16, requires_grad=True)
    policies: list[SavedOpsPolicy] = []

    def context() -> tuple:
        policies.append(SavedOpsPolicy(frozenset()))
        return create_selective_checkpoint_contexts(policies[-1])

    def step(x: torch.Tensor) -> torch.Tensor:
        return checkpoint(block, x, use_reentrant=False, context_fn=context)

    torch.manual_seed(0)
    step(x).sum().backward()
    torch._dynamo.reset()
    torch.compile(step, fullgraph=True, backend="aot_eager")(x).sum().backward()
    eager = [k for k in policies[0].seen if k in plannable]
    compiled = [k for k in policies[-1].seen if k in plannable]
    assert "aten.mul.Tensor#3" in eager and "aten.native_dropout.default#0" not in policies[0].seen
    assert compiled == eager
    # what the knapsack saves at every size is among them
    assert {key for _, _, keys in knapsack_frontier(block_profile) for key in keys} <= plannable


def test_a_nested_plan_compiles_whole():
    """A recompute segment inside another (the least-peak plans of a ConvNet): the inner region's
    buffer guard was made on its first call, inside the outer checkpoint, a side effect the
    compiler refuses under fullgraph=True. Every region's guard is made with the runtime."""
    from remat.plan.types import Segment

    _, compiled = _profiles("aot_eager")
    full = remat.plan(compiled, strategy="full")
    nested = dataclasses.replace(full, segments=(Segment(start=0, stop=2, strategy="recompute", children=(
        Segment(start=0, stop=1, strategy="recompute"),)),))
    want, got = _compiled_grads(None, "aot_eager"), _compiled_grads(nested, "aot_eager")
    for name in want:
        torch.testing.assert_close(got[name], want[name], msg=name, rtol=0, atol=0)


class _Breaking(_Block):
    def forward(self, x: torch.Tensor) -> torch.Tensor:
        torch._dynamo.graph_break()  # nothing in eager; under fullgraph=True an error
        return super().forward(x)


def test_a_block_that_breaks_the_graph_is_named_in_the_error():
    model, x = _model()
    model.blocks[1] = _Breaking()
    torch._dynamo.reset()
    with pytest.raises(ValueError, match=r"block 'blocks.1' does not run under torch.compile\(fullgraph=True, "
                                         r"backend='aot_eager'\): .*Profile with compiled=False"):
        remat.profile(model, x, blocks="blocks.*", repeats=1, compiled="aot_eager")
    assert all(p.grad is None for p in model.parameters())


SCRATCH = 1 << 22
"""Bytes the ``remat_test_scratch`` backend's compiled forward takes and frees, as a compiled
kernel's buffer: no tensor shows it to the live tracker; the allocator sees it."""
PARAMETER_BYTES = (WIDTH * WIDTH + WIDTH) * 5 * 4
"""The embedding's and the two blocks' four linears' weights and biases, float32."""


@torch._dynamo.register_backend(name="remat_test_scratch")
def _scratch(gm, example_inputs):
    def run(*args):
        buffer = torch.empty(SCRATCH, dtype=torch.uint8)
        del buffer
        return gm.forward(*args)
    return run


@torch._dynamo.register_backend(name="remat_test_refuses")
def _refuses(gm, example_inputs):
    raise RuntimeError("this backend compiles nothing")


def test_a_plan_for_the_compiled_model_is_verified_on_the_compiled_steps(aot_eager_profiles):
    """verify compares the steps eagerly (gradients, op counts, the tracker's peak), then runs both
    compiled with the plan's backend and measures their peaks with the allocator, which sees what
    compiled kernels allocate. Here the compiled forward takes a 4 MiB buffer when only the
    parameters are live (the last step's gradients freed, SGD without state): both compiled
    steps peak at the parameters plus that buffer, to the byte; the eager figures stay the eager
    steps'. The summary says both."""
    from remat.report.summary import _measured

    eager, compiled = aot_eager_profiles
    plan = remat.plan(compiled, strategy="full")
    assert plan.compiled_backend == "aot_eager" and remat.plan(eager, strategy="full").compiled_backend == ""
    assert remat.Plan.from_json(plan.to_json()).compiled_backend == "aot_eager"
    plan = dataclasses.replace(plan, compiled_backend="remat_test_scratch")
    model, x = _model()
    torch._dynamo.reset()
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    v = remat.verify(model, x, plan, optimizer=opt, repeats=1)
    assert v.grads_identical and v.compiled_backend == "remat_test_scratch" and v.compiled_error == ""
    assert v.measured_peak_bytes == v.predicted_peak_bytes < PARAMETER_BYTES + 20_000  # the eager step's
    assert v.compiled_peak_bytes == v.compiled_baseline_peak_bytes == PARAMETER_BYTES + SCRATCH
    assert v.compiled_peak_error_pct == pytest.approx(100 * (PARAMETER_BYTES + SCRATCH - v.predicted_peak_bytes)
                                                      / v.predicted_peak_bytes)
    assert v.compiled_step_ms > 0 and v.compiled_baseline_step_ms > 0
    text = _measured(v, None)
    assert "the figures above are the eager steps'" in text and "Compiled: peak 4.0 MiB" in text
    assert remat.Verification.from_json(v.to_json()).compiled_peak_bytes == v.compiled_peak_bytes


def test_a_model_that_does_not_compile_keeps_the_eager_comparison_and_says_why(aot_eager_profiles):
    plan = dataclasses.replace(remat.plan(aot_eager_profiles[1], strategy="full"), compiled_backend="remat_test_refuses")
    model, x = _model()
    torch._dynamo.reset()
    with pytest.warns(UserWarning, match=r"could not run the steps compiled with backend 'remat_test_refuses': "
                                         r".*this backend compiles nothing"):
        v = remat.verify(model, x, plan, repeats=1)
    assert v.ok and v.measured_peak_bytes == v.predicted_peak_bytes
    assert "this backend compiles nothing" in v.compiled_error and v.compiled_peak_bytes == 0
    from remat.report.summary import _measured
    assert "which did not run compiled" in _measured(v, None)


def test_the_experts_grouped_matmul_is_one_call_eager_or_traced():
    """Hugging Face's MoE layers run their experts through ``aten._grouped_mm`` eagerly and
    through their ``grouped_mm_fallback`` op where it cannot run (traced for the compiler with
    float32 weights): the policy counts the second as the first, so a plan saving the experts'
    outputs saves them compiled too (they were replayed: Qwen2-MoE's two saved keys never met)."""
    from torch.utils.checkpoint import CheckpointPolicy

    pytest.importorskip("transformers.integrations.moe", reason="transformers before 5 has no grouped_mm_fallback op")

    from remat.checkpointing.cacheable import MATMUL_OPS
    from remat.checkpointing.selective import SavedOpsPolicy

    fallback = torch.ops.transformers.grouped_mm_fallback.default
    policy = SavedOpsPolicy(frozenset({"aten._grouped_mm.default#1"}))
    decisions = [policy(None, op) for op in (torch.ops.aten._grouped_mm.default, fallback, fallback)]
    assert decisions == [CheckpointPolicy.PREFER_RECOMPUTE, CheckpointPolicy.MUST_SAVE, CheckpointPolicy.PREFER_RECOMPUTE]
    assert policy.seen == ["aten._grouped_mm.default#0", "aten._grouped_mm.default#1", "aten._grouped_mm.default#2"]
    eager_named = SavedOpsPolicy(frozenset({"transformers.grouped_mm_fallback.default#0"}))
    assert eager_named(None, torch.ops.aten._grouped_mm.default) == CheckpointPolicy.MUST_SAVE
    assert {"aten._grouped_mm", "transformers.grouped_mm_fallback"} <= MATMUL_OPS


class _Active:
    """Python state a forward sets and resets (Hugging Face's attention, where the kernels package
    is installed, does so with a context variable that is a plain attribute under torch.compile)."""

    value: object = None


_ACTIVE = _Active()


class _Writing(_Block):
    def forward(self, x: torch.Tensor) -> torch.Tensor:
        previous, _ACTIVE.value = _ACTIVE.value, self
        try:
            return super().forward(x)
        finally:
            _ACTIVE.value = previous


def test_a_block_that_writes_python_state_is_profiled_and_its_plan_compiles_with_the_flag_named():
    """torch.compile refuses a checkpoint whose forward writes Python state outside it ("HOP:
    Unsafe side effect"); the plain block compiles. The profile refused the block as one that
    does not compile; it measures its replays with dynamo's flag to skip the write in the replay,
    says to set it, leaves it as it was, and the plan compiled with it has the unplanned gradients."""
    model, x = _model()
    model.blocks[1] = _Writing()
    torch._dynamo.reset()
    assert not torch._dynamo.config.skip_fwd_side_effects_in_bwd_under_checkpoint
    with pytest.warns(UserWarning, match=r"block 'blocks.1' writes Python state outside itself.*"
                                         r"skip_fwd_side_effects_in_bwd_under_checkpoint = True\.$"):
        prof = remat.profile(model, x, repeats=1, compiled="aot_eager")
    assert not torch._dynamo.config.skip_fwd_side_effects_in_bwd_under_checkpoint
    plan = remat.plan(prof, strategy="full")
    want = {name: p.grad for name, p in _grads_of(model, x, None).named_parameters()}
    with pytest.raises(Exception, match="Unsafe side effect"):
        _grads_of(model, x, plan)
    with torch._dynamo.config.patch(skip_fwd_side_effects_in_bwd_under_checkpoint=True):
        got = {name: p.grad for name, p in _grads_of(model, x, plan).named_parameters()}
    for name in want:
        torch.testing.assert_close(got[name], want[name], msg=name)
    assert _ACTIVE.value is None
    # verify's compiled steps run as the warning says to: whole, not broken at the checkpoint
    from torch._dynamo.utils import counters

    counters.clear()
    torch._dynamo.reset()
    v = remat.verify(model, x, plan, repeats=1)
    assert v.ok and v.compiled_error == "" and v.compiled_peak_bytes > 0
    assert not counters["graph_break"], dict(counters["graph_break"])
    assert not torch._dynamo.config.skip_fwd_side_effects_in_bwd_under_checkpoint


def _grads_of(model: nn.Module, x: torch.Tensor, plan: remat.Plan | None) -> nn.Module:
    model = copy.deepcopy(model)
    if plan is not None:
        remat.apply_(model, plan)
    torch._dynamo.reset()
    torch.compile(model, fullgraph=True, backend="aot_eager")(x).backward()
    return model


_SYMBOLIC: list[bool] = []


@torch._dynamo.register_backend(name="remat_test_records_shapes")
def _records_shapes(gm, example_inputs):
    values = [node.meta.get("example_value") for node in gm.graph.nodes if node.op == "placeholder"]
    _SYMBOLIC.append(any(isinstance(v, torch.SymInt) or isinstance(v, torch.Tensor)
                         and any(isinstance(d, torch.SymInt) for d in v.shape) for v in values))
    return gm.forward


class _TwoWidths(nn.Module):
    """Two groups of alike blocks, of widths 16 and 32: the probes compile the same code twice."""

    def __init__(self) -> None:
        super().__init__()
        self.first = nn.ModuleList(_Block() for _ in range(2))
        self.up = nn.Linear(WIDTH, 2 * WIDTH)
        self.second = nn.ModuleList(_Wide() for _ in range(2))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        for block in self.first:
            x = block(x)
        x = self.up(x)
        for block in self.second:
            x = block(x)
        return x.square().mean()


class _Wide(_Block):
    def __init__(self) -> None:
        nn.Module.__init__(self)
        self.fc1, self.fc2 = nn.Linear(2 * WIDTH, 2 * WIDTH), nn.Linear(2 * WIDTH, 2 * WIDTH)


def test_the_probes_compile_with_static_shapes():
    """Every group of alike blocks compiles the probes' code again, and a recompile turned dynamo's
    automatic dynamic shapes on: Swin's window partition under symbolic shapes kept inductor in
    sympy for over ten minutes."""
    torch.manual_seed(0)
    model, x = _TwoWidths(), torch.randn(BATCH, WIDTH)
    torch._dynamo.reset()
    _SYMBOLIC.clear()
    remat.profile(model, x, repeats=1, compiled="remat_test_records_shapes")
    assert len(_SYMBOLIC) >= 6 and not any(_SYMBOLIC)
