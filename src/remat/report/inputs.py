"""Read the report's JSON inputs, telling profile, plan and verification apart by ``"format"``."""

from __future__ import annotations

import json
from collections.abc import Iterable
from dataclasses import dataclass
from pathlib import Path

from remat._serialize import read_text_file
from remat.measure.types import PROFILE_FORMAT, Profile
from remat.plan.types import PLAN_FORMAT, Plan
from remat.report.blocks import check_plan_matches
from remat.verify_types import VERIFICATION_FORMAT, Verification

DOCUMENT_KINDS = {PROFILE_FORMAT: Profile, PLAN_FORMAT: Plan, VERIFICATION_FORMAT: Verification}


@dataclass(kw_only=True, frozen=True)
class ReportInputs:
    """One profile and what was planned and verified on it."""

    profile: Profile
    """The measured profile."""
    plans: tuple[Plan, ...] = ()
    """Plans made from that profile, in the order given."""
    verifications: tuple[Verification, ...] = ()
    """Verifications of those plans, in the order given."""


def _read(path: str | Path) -> tuple[str, str]:
    """(``"format"`` field, text) of a remat JSON file (a regular file of bounded size)."""
    text = read_text_file(path, "report input")
    try:
        doc = json.loads(text)
    except (RecursionError, json.JSONDecodeError) as exc:
        raise ValueError(f"cannot read {str(path)!r} as JSON ({exc}); pass a file written by remat.") from None
    kind = doc.get("format") if isinstance(doc, dict) else None
    if kind not in DOCUMENT_KINDS:
        raise ValueError(
            f"{str(path)!r} has format={kind!r}; allowed: {sorted(DOCUMENT_KINDS)}. "
            "Pass the JSON files written by `remat profile`, `remat plan` and `remat run`."
        )
    return kind, text


def document_kind(path: str | Path) -> str:
    """The ``"format"`` field of a remat JSON file: ``profile``, ``plan`` or ``verification``."""
    return _read(path)[0]


def load_inputs(paths: Iterable[str | Path]) -> ReportInputs:
    """Load exactly one profile and any number of plans and verifications, checking they match."""
    found: dict[str, list] = {kind: [] for kind in DOCUMENT_KINDS}
    for path in paths:
        kind, text = _read(path)
        found[kind].append(DOCUMENT_KINDS[kind].from_json(text))
    profiles = found[PROFILE_FORMAT]
    if len(profiles) != 1:
        raise ValueError(
            f"a report needs exactly one profile JSON, got {len(profiles)}; "
            "pass one profile.json and the plans and verifications made from it."
        )
    profile = profiles[0]
    for plan in found[PLAN_FORMAT]:
        check_plan_matches(profile, plan)
    return ReportInputs(profile=profile, plans=tuple(found[PLAN_FORMAT]),
                        verifications=tuple(found[VERIFICATION_FORMAT]))
