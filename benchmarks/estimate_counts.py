"""`remat estimate`'s parameter count of every transformers model type: each type's default
config (`CONFIG_MAPPING[t]()`) read as `remat estimate --config` reads it, its model of a few layers
and the model built whole on the meta device (no memory), the copies' count checked against the
whole model's, then one step of the few layers traced on the meta device (micro-batch 1, 2048
tokens) for the count `remat estimate` prints.

    python -m benchmarks.estimate_counts [--types llama zaya hrm_text] [--json out.json]

Per type: ``ok <parameters>`` (the copies add up to the model), ``refused <the one line>`` or
``crash <exception>`` (a traceback would be a defect: none expected). Prints a line per type,
then the totals and the refusals by the parameter count.
"""

from __future__ import annotations

import argparse
import json
import signal
import tempfile
import warnings
from collections import Counter
from pathlib import Path

TIMEOUT_S = 60


class _Timeout(Exception):
    pass


def _alarm(*_: object) -> None:
    raise _Timeout


def one(model_type: str, folder: Path) -> str:
    """One type's answer (module docstring)."""
    from transformers.models.auto.configuration_auto import CONFIG_MAPPING

    from remat.estimate.sources import ModelSource
    from remat.estimate.trace import trace_source

    path = folder / f"{model_type}.json"
    try:
        CONFIG_MAPPING[model_type]().to_json_file(str(path))
    except Exception as error:  # noqa: BLE001 - transformers' own default config fails
        return f"noconfig {type(error).__name__}"
    signal.signal(signal.SIGALRM, _alarm)
    signal.alarm(TIMEOUT_S)
    try:
        traced = trace_source(ModelSource(hf_config_path=str(path)), seq_len=2048)
        return f"ok {traced.param_count}"
    except _Timeout:
        return "timeout"
    except ValueError as error:
        return "refused " + " ".join(str(error).split())
    except Exception as error:  # noqa: BLE001 - what the sweep is for
        return f"crash {type(error).__name__}: {' '.join(str(error).split())[:300]}"
    finally:
        signal.alarm(0)


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(prog="python -m benchmarks.estimate_counts", description=__doc__.splitlines()[0])
    parser.add_argument("--types", nargs="+")
    parser.add_argument("--json")
    args = parser.parse_args(argv)
    warnings.filterwarnings("ignore")
    from transformers.models.auto.configuration_auto import CONFIG_MAPPING

    types = args.types or sorted(CONFIG_MAPPING.keys())
    out: dict[str, str] = {}
    with tempfile.TemporaryDirectory() as folder:
        for model_type in types:
            out[model_type] = one(model_type, Path(folder))
            print(model_type, out[model_type][:200], flush=True)
    print(dict(Counter(answer.split()[0] for answer in out.values())))
    for model_type, answer in out.items():
        if "copying its traced layers counts" in answer or "several times per step" in answer:
            print(f"- {model_type}: {answer.split(': ', 1)[-1][:160]}")
    if args.json:
        Path(args.json).write_text(json.dumps(out, indent=1))


if __name__ == "__main__":
    main()
