"""The diffusion stage, shaped like `stages.llm`: each file one job.

renderer.py   the loaded pipeline: defaults, what this model can render, whole-batch rendering
batching.py   step-level batching on the engine, or whole requests
stage.py      the Serve deployment: `render(RenderJob)` for generations, edits and streams
self_check.py its canonical requests and the start-up self-check against the golden table
engine/       the step engine: per-sample schedulers, samples join and leave between steps
"""

from .renderer import BatchKey, DiffusionRenderer, Job, encode_png, load_pipeline
from .stage import DiffusionStage

__all__ = ["BatchKey", "DiffusionRenderer", "DiffusionStage", "Job", "encode_png", "load_pipeline"]
