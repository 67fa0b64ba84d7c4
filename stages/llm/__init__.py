"""The AR-LLM stage: a vLLM v1 async engine that rewrites the user's prompt for the diffusion stage.

Read in this order:
1. `settings`: which model (`resolve_model`: a path or hub id, else an embedded tiny Llama from the
   registry, built locally) and `engine_settings(config, model)`, where the batch-invariance switch
   turns into vLLM engine arguments and the environment of the engine's processes.
2. `engine.LLMEngine`: the lifecycle of one `AsyncLLM` (start, shutdown, health, describe) and
   `generate(prompt_ids, sampling) -> Generation`. Usable without Serve (the audit uses it).
3. `requests.LLMRequests`: `enhance` (prompt -> RevisedPrompt) and `chat` (messages -> Completion),
   admitted with `contracts.admission`. The embedded model's enhancement (a style grammar) lives
   beside that model, in `stages.embedded.llm`.
4. `stage.LLMStage`: the Ray Serve deployment, built from one `LLMStageConfig`.

Requests arrive as plain data (`LLMSamplingParams` or a mapping of its fields); results are typed
(`contracts.results`): token ids, float logprobs, text.
"""

from .engine import DEFAULT_SYSTEM_PROMPT, LLMEngine, LLMRequests
from .settings import INVARIANT_CPU_ENGINE_ARGS, EngineSettings, ModelChoice, engine_settings, resolve_model
from .stage import LLMStage

__all__ = [
    "DEFAULT_SYSTEM_PROMPT",
    "INVARIANT_CPU_ENGINE_ARGS",
    "EngineSettings",
    "LLMEngine",
    "LLMRequests",
    "LLMStage",
    "ModelChoice",
    "engine_settings",
    "resolve_model",
]
