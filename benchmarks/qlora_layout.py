"""`remat.models.qlora`'s NF4 layout against bitsandbytes' own (`quantize_4bit` with
``quant_type="nf4"``, ``blocksize=64``, ``compress_statistics=True``, the QLoRA recipe), on random
bf16 weights of several shapes: bytes per weight, the 4-bit codes, the absmax codes, and the
dequantized weights. bitsandbytes is not a dependency (installing it asks for a CUDA torch): put a
copy on the path, for example ``pip install --no-deps --target /tmp/bnb bitsandbytes``.

    PYTHONPATH=src:/tmp/bnb python -m benchmarks.qlora_layout
"""

from __future__ import annotations

import argparse
from typing import Any

import torch

from remat.models.qlora import DYNAMIC_MAP, dequantize_nf4, nf4_bytes, quantize_nf4

SHAPES = ((64, 64), (256, 128), (1000, 64), (4096, 1024), (14336, 4096))


def compare(shape: tuple[int, int], functional: Any) -> dict[str, Any]:
    """One bf16 weight of ``shape`` through both (module docstring)."""
    weight = torch.randn(*shape, generator=torch.Generator().manual_seed(0)).to(torch.bfloat16)
    codes, state = functional.quantize_4bit(weight, blocksize=64, compress_statistics=True, quant_type="nf4")
    # the offset is a 0-d fp32 tensor on the device; the 1 KiB dynamic map is one tensor for every weight
    theirs = (codes.numel() * codes.element_size() + state.absmax.numel() + 4 * state.state2.absmax.numel() + 4
              + 4 * state.code.numel())
    ours = quantize_nf4(weight)
    back = dequantize_nf4(ours["weight_nf4"], ours["absmax"], ours["nested_absmax"], ours["offset"], ours["quant_map"],
                          *shape, torch.bfloat16)
    reference = functional.dequantize_4bit(codes, state)
    return dict(shape=shape, bnb_bytes=theirs, remat_bytes=sum(t.numel() * t.element_size() for t in ours.values()),
                formula=nf4_bytes(weight.numel()), codes_equal=torch.equal(codes.flatten(), ours["weight_nf4"].flatten()),
                absmax_differ=int((state.absmax != ours["absmax"]).sum()), absmax_codes=state.absmax.numel(),
                values_differ=int((back != reference).sum()),
                max_diff=float((back.float() - reference.float()).abs().max()),
                map_equal=torch.equal(DYNAMIC_MAP, functional.create_dynamic_map()))


def main(argv: list[str] | None = None) -> None:
    argparse.ArgumentParser(description=__doc__.splitlines()[0]).parse_args(argv)
    try:
        import bitsandbytes.functional as functional
    except ImportError:
        raise SystemExit("bitsandbytes is not importable; put a copy on PYTHONPATH (module docstring).") from None
    print("| weight | bitsandbytes bytes | remat bytes | `nf4_bytes` | 4-bit codes equal | absmax codes differing | "
          "dequantized values differing (largest difference) |")
    print("|---|---|---|---|---|---|---|")
    for shape in SHAPES:
        r = compare(shape, functional)
        print(f"| {shape[0]} x {shape[1]} | {r['bnb_bytes']:,} | {r['remat_bytes']:,} | {r['formula']:,} | "
              f"{'yes' if r['codes_equal'] else 'no'} | {r['absmax_differ']} of {r['absmax_codes']:,} | "
              f"{r['values_differ']:,} ({r['max_diff']:.3g}) |")
    print(f"\nthe dynamic map equal to bitsandbytes' create_dynamic_map(): {r['map_equal']}")


if __name__ == "__main__":
    main()
