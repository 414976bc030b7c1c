"""Models written with torch's own layers and features, as people write them: each is profiled,
its least-peak plan and full recomputation verified (gradients bit-identical, the peak as
predicted)."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F
from torch import nn
from torch.nn.utils import parametrizations

import remat

VOCAB = 50


def _lm_loss(out: torch.Tensor, batch) -> torch.Tensor:
    targets = batch if isinstance(batch, torch.Tensor) else batch[-1]
    return F.cross_entropy(out.reshape(-1, VOCAB), targets.reshape(-1))


def _square(out, batch) -> torch.Tensor:
    return out.float().square().mean()


class Encoder(nn.Module):
    """``nn.TransformerEncoder`` (its fast path off: training)."""

    def __init__(self) -> None:
        super().__init__()
        self.embed = nn.Embedding(VOCAB, 32)
        layer = nn.TransformerEncoderLayer(32, 4, 64, dropout=0.1, batch_first=True)
        self.encoder = nn.TransformerEncoder(layer, 3, enable_nested_tensor=False)
        self.head = nn.Linear(32, VOCAB)

    def forward(self, ids: torch.Tensor) -> torch.Tensor:
        return self.head(self.encoder(self.embed(ids)))


class Seq2Seq(nn.Module):
    """``nn.Transformer``: an encoder-decoder, a causal mask on the target."""

    def __init__(self) -> None:
        super().__init__()
        self.embed = nn.Embedding(VOCAB, 32)
        self.transformer = nn.Transformer(32, 4, 2, 2, 64, dropout=0.1, batch_first=True)
        self.head = nn.Linear(32, VOCAB)

    def forward(self, src: torch.Tensor, tgt: torch.Tensor) -> torch.Tensor:
        mask = nn.Transformer.generate_square_subsequent_mask(tgt.shape[1])
        return self.head(self.transformer(self.embed(src), self.embed(tgt), tgt_mask=mask, tgt_is_causal=True))


class LSTMStack(nn.Module):
    """A list of ``nn.LSTM`` layers with residuals."""

    def __init__(self) -> None:
        super().__init__()
        self.embed = nn.Embedding(VOCAB, 32)
        self.rnns = nn.ModuleList(nn.LSTM(32, 32, batch_first=True) for _ in range(3))
        self.head = nn.Linear(32, VOCAB)

    def forward(self, ids: torch.Tensor) -> torch.Tensor:
        h = self.embed(ids)
        for rnn in self.rnns:
            h = h + rnn(h)[0]
        return self.head(h)


class Parametrized(nn.Module):
    """Weight norm, spectral norm and an orthogonal map (``torch.nn.utils.parametrizations``)."""

    def __init__(self) -> None:
        super().__init__()
        self.a = parametrizations.weight_norm(nn.Linear(32, 64))
        self.b = parametrizations.spectral_norm(nn.Linear(64, 32))
        self.c = parametrizations.orthogonal(nn.Linear(32, 32))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return x + self.c(self.b(F.silu(self.a(x))))


class Spectral(nn.Module):
    """A block that mixes tokens in the Fourier domain (complex weights, ``torch.fft``)."""

    def __init__(self) -> None:
        super().__init__()
        self.norm = nn.LayerNorm(32)
        self.filter = nn.Parameter(torch.randn(17, dtype=torch.cfloat) * 0.1)
        self.proj = nn.Linear(32, 32)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return x + self.proj(torch.fft.irfft(torch.fft.rfft(self.norm(x), dim=-1) * self.filter, n=32, dim=-1))


class Bags(nn.Module):
    """``nn.EmbeddingBag`` of offsets, then residual MLP blocks."""

    def __init__(self) -> None:
        super().__init__()
        self.bag = nn.EmbeddingBag(200, 32, mode="sum")
        self.blocks = nn.ModuleList(nn.Sequential(nn.Linear(32, 64), nn.ReLU(), nn.Linear(64, 32)) for _ in range(3))

    def forward(self, idx: torch.Tensor, offsets: torch.Tensor) -> torch.Tensor:
        x = self.bag(idx, offsets)
        for block in self.blocks:
            x = x + block(x)
        return x


class Basic(nn.Module):
    def __init__(self, c: int = 8) -> None:
        super().__init__()
        self.c1, self.b1 = nn.Conv2d(c, c, 3, padding=1, bias=False), nn.BatchNorm2d(c)
        self.c2, self.b2 = nn.Conv2d(c, c, 3, padding=1, bias=False), nn.BatchNorm2d(c)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return F.relu(x + self.b2(self.c2(F.relu(self.b1(self.c1(x)), inplace=True))), inplace=True)


def _cases():
    torch.manual_seed(0)
    ids = torch.randint(0, VOCAB, (2, 12))
    channels_last = nn.Sequential(nn.Conv2d(3, 8, 3, padding=1), *(Basic() for _ in range(3)), nn.AdaptiveAvgPool2d(1),
                                  nn.Flatten(), nn.Linear(8, 4)).to(memory_format=torch.channels_last)
    bf16 = nn.Sequential(*(nn.Sequential(nn.LayerNorm(32), nn.Linear(32, 64), nn.GELU(), nn.Dropout(0.1),
                                         nn.Linear(64, 32)) for _ in range(3))).to(torch.bfloat16)
    return {
        "TransformerEncoder": (Encoder(), ids, _lm_loss),
        "Transformer": (Seq2Seq(), (torch.randint(0, VOCAB, (2, 10)), ids), _lm_loss),
        "LSTM": (LSTMStack(), ids, _lm_loss),
        "parametrizations": (nn.Sequential(*(Parametrized() for _ in range(3))), torch.randn(2, 6, 32), _square),
        "fft": (nn.Sequential(*(Spectral() for _ in range(3))), torch.randn(2, 6, 32), _square),
        "EmbeddingBag": (Bags(), (torch.randint(0, 200, (48,)), torch.arange(0, 48, 6)), _square),
        "channels_last": (channels_last, (torch.randn(2, 3, 8, 8).to(memory_format=torch.channels_last),), _square),
        "bfloat16": (bf16, torch.randn(2, 6, 32, dtype=torch.bfloat16), _square),
    }


@pytest.mark.parametrize("name", list(_cases()))
def test_a_model_of_torch_layers_is_planned_and_verified(name):
    model, batch, loss_fn = _cases()[name]
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-3)
    prof = remat.profile(model, batch, loss_fn, optimizer, repeats=1)
    assert len(prof.blocks) >= 3
    for plan in (remat.pareto(prof)[-1], remat.plan(prof, strategy="full")):
        check = remat.verify(model, batch, plan, loss_fn, torch.optim.AdamW(model.parameters(), lr=1e-3), repeats=1)
        assert check.grads_identical and check.grad_max_abs_diff == 0.0 and check.recompute_counts_match
        assert abs(check.measured_peak_bytes - check.predicted_peak_bytes) <= 0.001 * check.measured_peak_bytes
