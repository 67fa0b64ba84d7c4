"""Train the embedded default image model (`omniserve/tiny-shapes-sd`) and write it where the app loads it.

    .venv/bin/python scripts/train_shapes.py            # train (seeded), evaluate, replace the committed model
    .venv/bin/python scripts/train_shapes.py --check    # train aside and compare with the committed model

Training runs on two CPU threads (TrainingPlan.threads: the same bits on any machine with the same library versions,
CPU kind and thread count): 499 s wall on this project's 2-core machine. The model directory gets `training.json`:
the plan, the losses, the time it took, the library versions, the weights' fingerprint and the semantic hit rates
(training.shapes).
"""

from __future__ import annotations

import argparse
import json
import random
import shutil
import sys
import tempfile
import time
from importlib.metadata import version
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from stages.embedded.diffusion import LIBRARIES, TRAINED_PATH, weights_fingerprint
from stages.embedded.shapes import SIZES
from training.scenes import HELD_OUT, Scene
from training.shapes import TrainingPlan, hit_rate, train

RECORD = "training.json"
SEEDS = list(range(10))


def quality(directory: Path) -> dict[str, float]:
    """Hit rates over 8 held-out (shape, colour, background) triples, 10 seeds each: the background alone, and
    background and shape colour together at each size (`training.scenes.drawn_as_said`)."""
    from diffusers import StableDiffusionPipeline

    pipe = StableDiffusionPipeline.from_pretrained(directory, local_files_only=True)
    pipe.set_progress_bar_config(disable=True)
    triples = random.Random(0).sample(sorted(HELD_OUT), 8)
    rates = {size: hit_rate(pipe, [Scene(*t, size=size) for t in triples], SEEDS) for size in SIZES}
    rates["background"] = hit_rate(pipe, [Scene(*t) for t in triples], SEEDS, background_only=True)
    return {name: round(rate, 3) for name, rate in rates.items()}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--check", action="store_true", help="train aside; compare with the committed model")
    parser.add_argument("--out", type=Path, default=TRAINED_PATH)
    args = parser.parse_args()
    started = time.perf_counter()
    with tempfile.TemporaryDirectory() as scratch:
        trained = Path(scratch) / "model"
        record = train(
            TrainingPlan(), trained, log=lambda line: print(f"[{time.perf_counter() - started:6.0f}s] {line}")
        )
        record.update(
            versions={name: version(name) for name in LIBRARIES},
            weights_sha256=weights_fingerprint(trained),
            held_out_hit_rate=quality(trained),
        )
        (trained / RECORD).write_text(json.dumps(record, indent=2, sort_keys=True) + "\n")
        print(json.dumps(record, indent=2, sort_keys=True))
        if args.check:
            committed = json.loads((args.out / RECORD).read_text())
            same = committed["weights_sha256"] == record["weights_sha256"]
            print(f"same weights as committed: {same}; committed hit rates {committed['held_out_hit_rate']}")
            sys.exit(0 if same or _as_good(record, committed) else 1)
        shutil.rmtree(args.out, ignore_errors=True)
        shutil.copytree(trained, args.out)
        print(f"wrote {args.out}")


def _as_good(record: dict, committed: dict) -> bool:
    return all(rate >= committed["held_out_hit_rate"][name] - 0.1 for name, rate in record["held_out_hit_rate"].items())


if __name__ == "__main__":
    main()
