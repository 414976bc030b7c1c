"""Which modules are the blocks: found automatically or named by the user.

Automatic: the members of every *stack*, an ``nn.ModuleList`` / ``nn.Sequential`` of two or
more children of one class that hold parameters (a transformer's layers, an encoder's and a
decoder's, a ResNet stage's units), or an ``nn.ModuleList`` of layers of several classes (a
hybrid model's Mamba and attention layers), or a U-Net of nested levels (`nested_levels`: the
layers of every level), that is not nested inside another stack's member. Without a
forward to watch, that is all this module can say; `remat.measure.stacks` runs the forward and
descends into nested stacks that run as chains (the stages of a hierarchical vision model) and
numbers the blocks in the order they run. Named: one or more patterns, each a glob over
qualified module names (``"blocks.*"``, ``"model.layers.*"``) or a class name (``"Block"``,
``"LlamaDecoderLayer"``). Everything outside the blocks is the fixed part.
"""

from __future__ import annotations

import re
from collections.abc import Sequence

from torch import nn
from torch.nn.utils.parametrize import ParametrizationList

Blocks = list[tuple[str, nn.Module]]


def find_blocks(model: nn.Module, blocks: str | Sequence[str] | None = None) -> Blocks:
    """The model's blocks as ``(qualified name, module)`` in module order: the members of every
    outermost stack (``blocks=None``), or the modules the patterns name."""
    if blocks is None:
        return _auto_blocks(model)
    return named_blocks(model, blocks)


def named_blocks(model: nn.Module, blocks: str | Sequence[str]) -> Blocks:
    """The modules ``blocks`` (a pattern or a list of patterns) names, in module order."""
    patterns = [blocks] if isinstance(blocks, str) else list(blocks) if isinstance(blocks, (list, tuple)) else None
    if not patterns or not all(isinstance(p, str) and p for p in patterns):
        raise TypeError(
            f"blocks={blocks!r} is not supported; pass a glob over module names "
            "(e.g. 'blocks.*'), a class name (e.g. 'Block'), a list of them, or None to detect."
        )
    return _named_blocks(model, patterns)


_CONTAINERS = (nn.ModuleList, nn.Sequential, nn.ModuleDict)
"""Module containers: their children may be a stack (`_container`)."""


def _container(module: nn.Module) -> bool:
    """A list or sequential, or a ``ModuleDict`` of a class of its own that runs its members in
    its forward (timm's DenseNet's dense blocks), or a plain ``ModuleDict`` keyed by the layer
    numbers ``"0"``, ``"1"``... in order (torchtitan's and OLMo-core's layers, a dict so that a
    pipeline stage can drop the others and keep their names). Other plain ``ModuleDict``s are
    lookups by key (Switch Transformers' experts, Mask2Former's norm per stage), not chains."""
    if isinstance(module, (nn.ModuleList, nn.Sequential)):
        return True
    if not isinstance(module, nn.ModuleDict):
        return False
    return type(module) is not nn.ModuleDict or _numbered(list(module.keys()))


def _numbered(keys: list[str]) -> bool:
    """Keys that are increasing layer numbers (a pipeline stage's may start past 0)."""
    if not keys or not all(k.isdigit() for k in keys):
        return False
    numbers = [int(k) for k in keys]
    return numbers == list(range(numbers[0], numbers[0] + len(numbers)))


def candidate_lists(model: nn.Module) -> list[tuple[str, int, str]]:
    """``(name, length, child class)`` of every container (`_container`) of same-class children."""
    found = []
    for name, module in model.named_modules():
        if not _container(module) or len(module) == 0 or isinstance(module, ParametrizationList):
            continue  # a parametrized weight's list (weight norm's) is part of one layer, not layers
        classes = {type(child) for child in module.children()}
        if len(classes) == 1:
            found.append((name, len(module), next(iter(classes)).__name__))
    return found


def has_parameters(module: nn.Module) -> bool:
    """Whether ``module`` (or a module inside it) holds a parameter."""
    return next(module.parameters(), None) is not None


def stack_lists(model: nn.Module) -> list[str]:
    """Qualified names of every stack (a ModuleList/Sequential of >= 2 same-class children that
    hold parameters: a list of activations or dropouts is not a stack; or a plain ``ModuleList``
    of layers of several classes, each with parameters and modules of its own: a hybrid model's,
    Jamba's Mamba and attention layers, not a convolution beside its norm), in module order. (A ``Sequential`` of several classes is a layer's own
    pipeline, a convolution then its norm, not a stack.)"""
    same = {name for name, count, _ in candidate_lists(model) if count >= 2}
    names = []
    for name, module in model.named_modules():
        children = list(module.children()) if _container(module) else []
        mixed = (type(module) is nn.ModuleList and len({type(c) for c in children}) > 1
                 and all(any(True for _ in c.children()) for c in children))  # layers, not a conv and its norm
        if len(children) >= 2 and (name in same or mixed) and all(
                has_parameters(child) for child in children) and not _lookups(children) or nested_levels(model, name):
            names.append(name)
    return names


def _lookups(children: list[nn.Module]) -> bool:
    """Embedding tables (MarkupLM's 50 xpath tag and 50 subscript embeddings beside its
    encoder): lookups, not layers; as blocks they were 100 of MarkupLM's 102, each replay a table
    lookup saving nothing worth its checkpoint."""
    return all(isinstance(child, (nn.Embedding, nn.EmbeddingBag)) for child in children)


def nested_levels(model: nn.Module, name: str) -> Blocks:
    """The layers of a U-Net written as nested levels (MONAI's ``UNet`` and ``AttentionUnet``,
    pix2pix's ``UnetSkipConnectionBlock``), in module order, which is the order they run, or none
    when ``name`` is no such net: a plain ``Sequential`` (a level) whose members are an encoder
    layer, a module holding the next level, and a decoder layer, nested two levels deep or more.
    The module holding the next level (`_descent`: MONAI's ``SkipConnection``, which concatenates
    the level's input with the next level's output) has no weights of its own; its other children
    with weights (an attention gate, an up-convolution) are layers too, and the deepest level's
    members are (its skip connection round the bottom layer is one); a decoder layer written as a
    plain ``Sequential`` (an up-convolution, then a residual unit) gives its members. The modules
    holding the levels are of one class (a net is alike at every depth: a stage holding a
    Sequential of blocks that hold Sequentials is no U-Net). As stacks, only each encoder layer's
    convolution pairs were found, the decoder and the bottom never recomputed: the least feasible
    peak of MONAI's 2-d UNet on 128x128 images was 0.71 of the peak without recomputation, 0.42
    with the levels' layers (AttentionUnet 0.70 -> 0.40, pix2pix's 0.92 -> 0.77)."""
    module = model.get_submodule(name)
    if type(module) is not nn.Sequential:
        return []
    layers, holders = _unrolled(name, module)
    return layers if len(holders) >= 2 and len(set(holders)) == 1 else []


def _unrolled(name: str, level: nn.Module) -> tuple[Blocks, list[type]]:
    """The layers of ``level`` and of the levels nested in it (`nested_levels`), and the classes
    of the modules holding the levels, outermost first."""
    children = list(level.named_children())
    # the member holding the next level comes after an encoder layer (a residual unit first in
    # its level, its convolutions in a Sequential, is a layer), and a level holds one
    descents = [(i, inner) for i, (_, module) in enumerate(children) if (inner := _descent(module)) is not None
                and any(has_parameters(before) for _, before in children[:i])]
    at, inner = descents[0] if len(descents) == 1 else (None, None)
    layers: Blocks = []
    holders = [] if at is None else [type(children[at][1])]
    for i, (child, module) in enumerate(children):
        qualified = f"{name}.{child}" if name else child
        if i != at:  # a decoder layer written as a plain Sequential (an up-convolution, then a unit): its layers
            layers += members_of(qualified, module) if type(module) is nn.Sequential else [(qualified, module)]
            continue
        for grandchild, sub in module.named_children():
            if grandchild == inner and _level(sub):
                nested, below = _unrolled(f"{qualified}.{grandchild}", sub)
                layers += nested
                holders += below
            elif grandchild == inner or has_parameters(sub):  # the bottom layer; an attention gate, an up-convolution
                layers.append((f"{qualified}.{grandchild}", sub))
    return layers, holders


def _descent(module: nn.Module) -> str | None:
    """The name of the child of ``module`` that is the next level of a nested U-Net (its one
    child that is a level, `_level`) or its bottom layer (its only child) when ``module`` may hold
    one: no container, no weights of its own; else None."""
    if isinstance(module, (*_CONTAINERS, ParametrizationList)) or next(module.parameters(recurse=False), None) is not None:
        return None
    children = list(module.named_children())
    levels = [child for child, sub in children if _level(sub)]
    if len(levels) == 1:
        return levels[0]
    return children[0][0] if len(children) == 1 and has_parameters(children[0][1]) else None


def _level(module: nn.Module) -> bool:
    """A plain ``Sequential`` of two or more members: a level of a nested U-Net, or a layer's pipeline."""
    return type(module) is nn.Sequential and len(module) >= 2


def members(model: nn.Module, list_name: str) -> Blocks:
    """The children of the list ``list_name`` as ``(qualified name, module)``."""
    return members_of(list_name, model.get_submodule(list_name))


def members_of(name: str, module: nn.Module) -> Blocks:
    """The children of ``module``, named ``name``, as ``(qualified name, module)``."""
    prefix = f"{name}." if name else ""
    return [(f"{prefix}{child}", sub) for child, sub in module.named_children()]


_PLAIN = (nn.ModuleList, nn.ModuleDict)
"""Containers with no forward of their own: a list of them runs their members (a decoder level
as ``{"upsample": ..., "blocks": ...}``, MONAI's SegResNetDS)."""


def flattened(model: nn.Module, list_name: str) -> Blocks:
    """The members of the members of ``list_name`` when those are plain lists (an
    ``nn.ModuleList`` of ``nn.ModuleList``: Funnel's encoder, one list of layers per block of
    its pooling; the ``[attention, feed-forward]`` pairs of vit-pytorch's ViT, x-transformers'
    layers and a diffusion U-Net's stages, iterated as ``for attn, ff in self.layers``; plain
    ``nn.ModuleDict`` levels, ``level["upsample"]`` then ``level["blocks"]``), as
    ``(qualified name, module)`` in order: those holding parameters that are no plain list
    themselves (x-transformers' ``[norms, layer, residual]``: the layer; its norms' list and a
    residual without weights are not layers that run as such), if they are two or more; else
    none. A plain list has no forward of its own, so its members are the layers that run (whether
    each runs once, in order, discovery checks). The layers of a U-Net of nested levels too
    (`nested_levels`)."""
    levels = nested_levels(model, list_name)
    if levels:
        return levels
    outer = members(model, list_name)
    if not outer or not all(type(m) in _PLAIN for _, m in outer):
        return []
    inner = [(name, m) for outer_name, _ in outer for name, m in members(model, outer_name)
             if has_parameters(m) and type(m) not in _PLAIN]
    return inner if len(inner) >= 2 else []


def inside(name: str, outer: str) -> bool:
    """Module ``name`` lies strictly inside module ``outer``."""
    return outer == "" and name != "" or name.startswith(outer + ".")


def outermost(names: list[str]) -> list[str]:
    """The stacks not nested inside a member of another one."""
    return [n for n in names if not any(inside(n, other) for other in names if other != n)]


def no_stack_error(model: nn.Module) -> ValueError:
    lists = [name for name, _, _ in candidate_lists(model) if name and has_parameters(model.get_submodule(name))]
    mixed = _mixed_lists(model)
    if lists:
        example = f"'{lists[0]}.*'"
    elif mixed:  # the class that repeats most among a mixed list's members with weights (Encodec's resnet blocks)
        example = f"'{mixed[0][1]}'"
    else:
        example = "'layers.*'"
    seen = (f"; lists of several classes, whose members are not all layers: "
            + ", ".join(f"{name} ({', '.join(classes)})" for name, _, classes in mixed[:4]) if mixed else "")
    return ValueError(
        f"no blocks found in {type(model).__name__}: it has no nn.ModuleList or nn.Sequential of 2 or more "
        f"modules of one class with parameters, nor a ModuleList of composite layers; {_module_summary(model)}"
        f"{seen}. Name the blocks with blocks='<glob over module names>' or blocks='<ClassName>' (e.g. {example})."
    )


def _mixed_lists(model: nn.Module) -> list[tuple[str, str, list[str]]]:
    """``(name, the class to name as blocks, classes)`` of the ModuleLists/Sequentials
    whose members are of several classes, a class with parameters repeating in it (the one of most
    modules: a residual block before the convolutions in it); the longest first."""
    found = []
    for name, module in model.named_modules():
        if not isinstance(module, (nn.ModuleList, nn.Sequential)) or isinstance(module, ParametrizationList):
            continue
        children = list(module.children())
        weighted = [c for c in children if has_parameters(c)]
        names = [type(c).__name__ for c in weighted]
        repeated = [c for c in weighted if names.count(type(c).__name__) >= 2]
        if len({type(c) for c in children}) > 1 and repeated:
            largest = max(repeated, key=lambda c: sum(1 for _ in c.modules()))
            found.append((name, type(largest).__name__, list(dict.fromkeys(type(c).__name__ for c in children))))
    return sorted(found, key=lambda item: -len(model.get_submodule(item[0])))


def mixed_stacks(model: nn.Module) -> list[str]:
    """Where a model has no stack (`stack_lists`): the outermost plain ``ModuleList``s of several
    classes in which a class with parameters repeats, whose every member is then a block: a
    codec's list of convolutions, residual units, activations and an LSTM run in turn (Encodec's
    encoder and decoder), which was refused before, "no blocks found"; and the ``Sequential``s
    in which layers made of layers repeat (`_repeats_layers`)."""
    found = [name for name, _, _ in _mixed_lists(model) if type(model.get_submodule(name)) is nn.ModuleList
             or _repeats_layers(model.get_submodule(name))]
    return sorted(outermost(found), key=list(dict(model.named_modules())).index)


def _repeats_layers(sequential: nn.Module) -> bool:
    """A ``Sequential`` of several classes in which layers made of layers (`_composite`) of one
    class repeat: a network's body, its stem or final convolution beside (timm's RexNet: sixteen
    bottlenecks and a convolution; DPN's dual-path blocks), not one layer's own pipeline."""
    weighted = [type(c) for c in sequential.children() if _composite(c)]
    return any(weighted.count(cls) >= 2 for cls in set(weighted))


def attribute_stacks(model: nn.Module) -> list[str]:
    """Where a model has no stack in a container (`stack_lists`, `mixed_stacks`): the outermost
    modules that are no container whose children, two or more, are all of one class of layers
    made of layers (`_composite`), registered one by one as attributes (timm's RegNet stages: ``b1``, ``b2``, ...
    added with ``add_module``), which was refused before, "no blocks found"; with them the
    modules of the same class holding one such child."""
    found, kinds = [], {}
    for name, module in model.named_modules():
        if isinstance(module, (*_CONTAINERS, ParametrizationList)):
            continue
        children = list(module.children())
        # plain Sequentials as children are lists of layers, not layers (torchvision's VGG: its
        # ``features`` and ``classifier``, whose members `leaf_sequences` takes)
        if (children and len({type(c) for c in children}) == 1 and type(children[0]) not in (nn.Sequential, nn.ModuleList)
                and all(map(_composite, children))):
            kinds[name] = (type(module), type(children[0]))
            if len(children) >= 2:
                found.append(name)
    # a stage of one block is a stage too, where others of its class hold two or more (RegNet's first)
    stages = {kinds[name] for name in found}
    return outermost([name for name, kind in kinds.items() if kind in stages])


def single_stages(model: nn.Module) -> list[str]:
    """Where a model has no stack of any kind above: the lists or sequentials of one layer made of
    layers (`_composite`), two or more of one layer class beside each other in one module (a ResNet
    with one block per stage: timm's resnet10t, ResNeSt-14d; each ``layer1``..``layer4`` holds one
    block), each a stack of one, which was refused before, "no blocks found"."""
    found: list[str] = []
    for name, module in model.named_modules():
        groups: dict[type, list[str]] = {}
        for child, sub in module.named_children():
            members = list(sub.children()) if isinstance(sub, (nn.ModuleList, nn.Sequential)) else []
            if len(members) == 1 and _composite(members[0]):
                groups.setdefault(type(members[0]), []).append(f"{name}.{child}" if name else child)
        found += [stage for stages in groups.values() if len(stages) >= 2 for stage in stages]
    return sorted(outermost(found), key=list(dict(model.named_modules())).index)


def leaf_sequences(model: nn.Module) -> list[str]:
    """Where a model has no stack of any kind above: the outermost ``Sequential``s of several
    classes in which a layer class with parameters repeats (`_mixed_lists`), layers that are no
    layers of layers: a plain network written as one ``Sequential`` (``Linear, ReLU, Linear,
    ReLU, ...``; VGG's features, convolutions between activations and pools), whose every member
    is then a block, as torch's ``checkpoint_sequential`` takes them; such a model was refused
    before, "no blocks found". Members that cannot be replayed alone (an in-place ReLU, which
    overwrites its input) are kept and said so; a segment of several members replays them."""
    found = [name for name, _, _ in _mixed_lists(model) if isinstance(model.get_submodule(name), nn.Sequential)]
    return sorted(outermost(found), key=list(dict(model.named_modules())).index)


def _composite(module: nn.Module) -> bool:
    """A layer made of layers: two or more children with parameters (a residual block, not the
    two convolutions of a residual unit's own pipeline)."""
    return sum(1 for child in module.children() if has_parameters(child)) >= 2


def _auto_blocks(model: nn.Module) -> Blocks:
    stacks = (outermost(stack_lists(model)) or mixed_stacks(model) or attribute_stacks(model) or single_stages(model)
              or leaf_sequences(model))
    if not stacks:
        raise no_stack_error(model)
    return [member for name in stacks for member in flattened(model, name) or members(model, name)]


def _named_blocks(model: nn.Module, patterns: list[str]) -> Blocks:
    chosen: Blocks = []
    for pattern in patterns:
        matches = [
            (name, m) for name, m in model.named_modules()
            if name and (_glob(pattern).fullmatch(name) or type(m).__name__ == pattern)
        ]
        if not matches:
            raise ValueError(
                f"block pattern {pattern!r} matches no module of {type(model).__name__}; "
                f"allowed: a glob over qualified module names or a class name, e.g. "
                f"{_module_summary(model)}. Fix the pattern."
            )
        chosen.extend(m for m in matches if m[0] not in {c[0] for c in chosen})
    _check_disjoint(chosen)
    order = {name: i for i, (name, _) in enumerate(model.named_modules())}
    return sorted(chosen, key=lambda item: order[item[0]])


def _glob(pattern: str) -> re.Pattern[str]:
    """A glob over dotted names: ``*`` and ``?`` stay within one segment, ``**`` crosses dots."""
    parts = re.split(r"(\*\*|\*|\?)", pattern)
    table = {"**": ".*", "*": "[^.]*", "?": "[^.]"}
    return re.compile("".join(table.get(part, re.escape(part)) for part in parts))


def _check_disjoint(chosen: Blocks) -> None:
    names = [name for name, _ in chosen]
    for outer in names:
        for inner in names:
            if inner != outer and inner.startswith(outer + "."):
                raise ValueError(
                    f"block {inner!r} is nested inside block {outer!r}; blocks must not overlap: "
                    "narrow the pattern ('*' stays within one name segment, '**' crosses dots) "
                    "or name a class."
                )


def _module_summary(model: nn.Module, limit: int = 12) -> str:
    lists = candidate_lists(model)
    if lists:
        shown = [f"{name or '<root>'}.* ({n} x {cls})" for name, n, cls in lists[:limit]]
        return "candidate lists: " + ", ".join(shown)
    names = [f"{n} ({type(m).__name__})" for n, m in model.named_modules()
             if n and "parametrizations" not in n.split(".")][:limit]  # a weight norm's own modules
    return "modules: " + (", ".join(names) or "none")
