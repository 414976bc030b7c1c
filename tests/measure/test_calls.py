"""When two calls of blocks take the same arguments (`remat.measure.calls`): tensors by identity,
or as a whole alias that carries the gradient the same way (FSDP2 hands every unit's forward its
tensor arguments through an identity autograd function)."""

from __future__ import annotations

import torch

from remat.measure.calls import same_arguments, same_tensor, same_value


class _Identity(torch.autograd.Function):
    """FSDP2's ``RegisterPostBackwardFunction``, reduced: its outputs alias its inputs."""

    @staticmethod
    def forward(ctx, *inputs):
        return inputs

    @staticmethod
    def backward(ctx, *grads):
        return grads


def test_an_alias_an_identity_function_made_is_the_same_argument():
    x = torch.randn(4, 8, requires_grad=True)
    (y,) = _Identity.apply(x)
    assert y is not x and same_tensor(y, x) and same_value((y, 3), (x, 3))
    assert same_arguments((y,), {"mask": None}, (x,), {"mask": None})


def test_other_views_copies_and_detached_aliases_are_not():
    x = torch.randn(4, 8, requires_grad=True)
    assert not same_tensor(x.detach(), x)  # would stop the gradient x carries
    assert not same_tensor(x[1:], x) and not same_tensor(x.t(), x) and not same_tensor(x.view(8, 4), x)
    assert not same_tensor(x.clone(), x) and not same_tensor(x.double(), x)
    p = torch.nn.Parameter(torch.randn(3))
    assert same_tensor(p, p) and not same_tensor(torch.nn.Parameter(p.data), p)  # subclasses: identity only
    s = torch.eye(3).to_sparse()
    assert same_tensor(s, s) and not same_tensor(s.coalesce().clone(), s)
    m = torch.empty(3, device="meta")
    assert not same_tensor(torch.empty(3, device="meta"), m)
