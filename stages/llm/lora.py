"""LoRA adapters of the LLM stage, per request, through vLLM's own LoRA support.

vLLM's CPU build serves them (`PunicaWrapperCPU`, plain torch ops; LoRA turns compilation off, which the stage's eager
engine already is). Adapted tokens' updates are per-token batched matrix products, which the project's CPU kernels
cover, so a request's tokens and logprobs do not depend on its neighbours' adapters; one vLLM bug in that path (a
token without an adapter took the last slot's) is masked in every CPU engine process
(`stages.kernels.vllm_cpu.mask_unadapted_lora_tokens`).

An adapters directory holds PEFT adapters, one per sub-directory (`<name>/adapter_config.json` and
`<name>/adapter_model.safetensors`). The engine loads each into vLLM at start-up (`add_lora`), so an adapter vLLM
refuses (a rank past `max_lora_rank`, modules the model lacks) is logged and left out instead of failing a request:
named in a request, vLLM would have failed the whole engine. A request's `lora` names one; unknown: 404.
"""

from __future__ import annotations

import hashlib
import logging
from dataclasses import dataclass
from pathlib import Path

from contracts.errors import ModelNotFoundError
from contracts.sampling import LLMSamplingParams

logger = logging.getLogger("ray.serve")
WEIGHTS, CONFIG = "adapter_model.safetensors", "adapter_config.json"


class LlmLoraNotFoundError(ModelNotFoundError):
    """A request names an adapter this LLM replica does not serve (404)."""


@dataclass(frozen=True)
class LlmAdapter:
    name: str
    id: int  # vLLM's lora_int_id: the adapter's place in the directory's sorted names, from 1
    path: str
    sha256: str  # of its weights file: what the response names

    def request(self):
        from vllm.lora.request import LoRARequest

        return LoRARequest(self.name, self.id, self.path)


def adapter_dirs(directory: str | None) -> list[Path]:
    """The PEFT adapter directories of `directory`, by name; none when it is None or missing."""
    root = Path(directory) if directory else None
    if root is None or not root.is_dir():
        return []
    return sorted(p.parent for p in root.glob(f"*/{WEIGHTS}") if (p.parent / CONFIG).is_file())


def adapters_in(directory: str | None) -> list[LlmAdapter]:
    """The adapters of `directory`, each with its weights' sha256 (read once, when the engine loads them)."""
    return [
        LlmAdapter(path.name, i, str(path), hashlib.sha256((path / WEIGHTS).read_bytes()).hexdigest())
        for i, path in enumerate(adapter_dirs(directory), start=1)
    ]


class ServedAdapters:
    """The adapters an engine serves, by name."""

    def __init__(self, adapters: dict[str, LlmAdapter] | None = None):
        self._by_name = adapters or {}

    def names(self) -> list[str]:
        return sorted(self._by_name)

    def of(self, params: LLMSamplingParams) -> LlmAdapter | None:
        """The adapter a request's params name (`lora`), None for the base model; 404 when not served."""
        return self.get(params.lora) if params.lora else None

    def get(self, name: str) -> LlmAdapter:
        """The adapter `name`; 404 naming it when there is none."""
        found = self._by_name.get(name)
        if found is None:
            raise LlmLoraNotFoundError(
                f"no LoRA adapter named {name!r} for the LLM here; it serves {self.names()}",
                param="lora",
                code="lora_not_found",
            )
        return found


async def load_into(engine, adapters: list[LlmAdapter]) -> ServedAdapters:
    """Each adapter loaded into the running vLLM engine; those it refuses are logged and left out."""
    loaded = {}
    for adapter in adapters:
        try:
            await engine.add_lora(adapter.request())
        except Exception:
            logger.exception("LLM LoRA adapter %r at %s cannot be loaded; it is not served", adapter.name, adapter.path)
            continue
        loaded[adapter.name] = adapter
    return ServedAdapters(loaded)
