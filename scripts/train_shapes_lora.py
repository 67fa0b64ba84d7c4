"""Train the embedded model's LoRA adapter "twins" (`training.shapes_lora`) and write it where the app finds it.

    .venv/bin/python scripts/train_shapes_lora.py            # train (seeded), evaluate, replace the committed adapter
    .venv/bin/python scripts/train_shapes_lora.py --check    # train aside and compare with the committed adapter

Two CPU threads, seeded (AdapterPlan). The adapter's directory gets `training.json`: the plan, the loss, the time it
took, the library versions, the file's sha256 and what it does, measured: the share of held-out prompts drawn as a
pair (`training.scenes.drawn_twice`) with the adapter at scale 1, and without it.
"""

from __future__ import annotations

import argparse
import hashlib
import json
import shutil
import sys
import tempfile
import time
from importlib.metadata import version
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from stages.embedded.diffusion import ADAPTERS_PATH, LIBRARIES, load_tiny_pipeline
from training.shapes_lora import AdapterPlan, pair_rate, train_adapter

RECORD = "training.json"
WEIGHTS = "pytorch_lora_weights.safetensors"


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--check", action="store_true", help="train aside; compare with the committed adapter")
    parser.add_argument("--steps", type=int, default=AdapterPlan.steps)
    args = parser.parse_args()
    plan = AdapterPlan(steps=args.steps)
    out = ADAPTERS_PATH / plan.name
    started = time.perf_counter()
    with tempfile.TemporaryDirectory() as scratch:
        trained = Path(scratch) / plan.name
        record = train_adapter(
            load_tiny_pipeline("shapes"),
            plan,
            trained / WEIGHTS,
            log=lambda line: print(f"[{time.perf_counter() - started:6.0f}s] {line}"),
        )
        weights = trained / WEIGHTS
        record.update(
            versions={name: version(name) for name in LIBRARIES},
            weights_sha256=hashlib.sha256(weights.read_bytes()).hexdigest(),
            held_out_pair_rate={f"scale {s:g}": pair_rate(weights, s) for s in (1.0, 0.0)},
        )
        (trained / RECORD).write_text(json.dumps(record, indent=2, sort_keys=True) + "\n")
        print(json.dumps(record, indent=2, sort_keys=True))
        if args.check:
            committed = json.loads((out / RECORD).read_text())
            same = committed["weights_sha256"] == record["weights_sha256"]
            print(f"same weights as committed: {same}; committed pair rates {committed['held_out_pair_rate']}")
            sys.exit(0 if same else 1)
        shutil.rmtree(out, ignore_errors=True)
        shutil.copytree(trained, out)
        print(f"wrote {out}")


if __name__ == "__main__":
    main()
