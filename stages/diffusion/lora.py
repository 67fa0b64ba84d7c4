"""LoRA adapters applied per row of a denoiser call, without merging (issue 24, item 3: the mechanism); and of a text
encoder call, where the format carries text-encoder layers and the family encodes every sample's prompt in one call.

The base weights stay untouched. Each adapted layer (an `nn.Linear` an adapter names) gets a forward hook that adds,
to each row of its output, that row's adapters' low-rank updates, `scale * B(A x)`, one adapter after another in the
order the row's request lists them. Per list position, consecutive rows with the same adapter and scale form a run
(a sample's rows are adjacent), so one call serves rows with adapter A, adapter B, both, or none: each run's update is
two GEMMs over a view of its own rows, scaled and added in place (Punica / S-LoRA's segmented form, without their
custom kernels). With the batch-invariant kernels a row's GEMM bits do not depend on the other rows, and scaling and
adding are elementwise, so a row's bits are those of its solo call. A row without an adapter is never touched: the
base layer's output, at no extra cost. (An earlier form gathered each adapter's rows and scattered the update back
with `index_add_`: on the step engine's thread that scatter took 1.56 s of a 2.83 s render, measured.)

Adapters are read from the diffusers/PEFT LoRA format (`<component>.<module path>.lora_A.weight` /
`.lora_B.weight`, an optional `.alpha` per module, else alpha = rank); `load_adapter` passes a file through the
pipeline's own `lora_state_dict`, which converts kohya-style and older diffusers keys to that form.

`AdapterLibrary` is one replica's adapters: a directory, read lazily into a least-recently-used cache bounded in
bytes; it resolves a request's `lora` (unknown name: 404; a pinned sha256 that is not the file's: 400) and fills in
each adapter's sha256, which provenance then carries.
"""

from __future__ import annotations

import hashlib
import inspect
import logging
import threading
from collections import OrderedDict
from collections.abc import Iterator, Mapping, Sequence
from contextlib import ExitStack, contextmanager
from dataclasses import dataclass
from pathlib import Path
from typing import Any, cast

import torch
import torch.nn.functional as F

from contracts.errors import InvalidRequestError, ModelNotFoundError, OmniError
from contracts.sampling import LoraChoice

logger = logging.getLogger("ray.serve")


class LoraNotFoundError(ModelNotFoundError):
    """A request names an adapter this replica does not have (404)."""


class LoraLoadError(OmniError):
    """An adapter file that cannot be read or does not fit the model: the operator's problem (500), logged with it."""


class LoraFormatError(ValueError):
    """An adapter's weights do not fit the model: a layer it names is missing or of the wrong kind or shape."""


@dataclass(frozen=True)
class LoraLayer:
    down: torch.Tensor  # A: (rank, in_features)
    up: torch.Tensor  # B: (out_features, rank)
    scale: float  # alpha / rank


@dataclass(frozen=True)
class LoraAdapter:
    name: str
    sha256: str  # of its weights file: what provenance names
    layers: Mapping[str, LoraLayer]  # "<component>.<module path>" -> its update

    @property
    def nbytes(self) -> int:
        """What its weights take, in their dtype (what the library's budget counts)."""
        return sum(t.numel() * t.element_size() for layer in self.layers.values() for t in (layer.down, layer.up))

    @property
    def components(self) -> frozenset[str]:
        """The pipeline components it adapts ("unet", "text_encoder", ...)."""
        return frozenset(key.split(".", 1)[0] for key in self.layers)

    def to(self, dtype: torch.dtype | None = None, device: torch.device | str | None = None) -> LoraAdapter:
        """The adapter with its weights in the denoiser's dtype and on its device: cast once, not at every call."""
        return LoraAdapter(
            self.name,
            self.sha256,
            {p: LoraLayer(u.down.to(device, dtype), u.up.to(device, dtype), u.scale) for p, u in self.layers.items()},
        )


#: One row's adapters, in the order its request lists them: (adapter, the request's scale).
RowAdapters = tuple[tuple[LoraAdapter, float], ...]


def adapter_from_state_dict(
    name: str, sha256: str, state_dict: Mapping[str, torch.Tensor], components: Sequence[str]
) -> LoraAdapter:
    """The updates of `components` ("unet" or "transformer", "text_encoder", ...) from PEFT-format keys, keyed by
    "<component>.<module path>"; other components' keys are left."""
    downs = {
        k.removesuffix(".lora_A.weight"): v
        for k, v in state_dict.items()
        if k.split(".", 1)[0] in components and k.endswith(".lora_A.weight")
    }
    layers = {}
    for key, down in downs.items():
        up = state_dict.get(f"{key}.lora_B.weight")
        if up is None or down.dim() != 2 or up.dim() != 2 or up.shape[1] != down.shape[0]:
            raise LoraFormatError(f"adapter {name!r}: {key} has no matching lora_B of rank {down.shape[0]}")
        alpha = state_dict.get(f"{key}.alpha")
        rank = down.shape[0]
        layers[key] = LoraLayer(down, up, (float(alpha) if alpha is not None else float(rank)) / rank)
    if not layers:
        raise LoraFormatError(f"adapter {name!r} adapts no layer of the {' or '.join(components)}")
    return LoraAdapter(name, sha256, layers)


def load_adapter(
    path: Path,
    name: str,
    pipeline_class: Any,
    components: Sequence[str],
    dtype: torch.dtype | None = None,
    device: Any = None,
) -> LoraAdapter:
    """An adapter file as the pipeline class reads it (`lora_state_dict`: kohya and older diffusers keys converted)."""
    from diffusers.utils import convert_unet_state_dict_to_peft

    # The pipelines' readers differ: SD's and SDXL's return (state_dict, alphas), FLUX's alphas only when asked,
    # SD3's the state dict alone.
    reader = pipeline_class.lora_state_dict
    asked = {"return_alphas": True} if "return_alphas" in inspect.signature(reader).parameters else {}
    read = reader(str(path.parent), weight_name=path.name, **asked)
    state_dict, alphas = (read[0], read[1]) if isinstance(read, tuple) else (read, None)
    state_dict = convert_unet_state_dict_to_peft(dict(state_dict))
    for key, alpha in (alphas or {}).items():  # kohya's per-module alphas, keyed by the module
        state_dict[f"{key.removesuffix('.alpha')}.alpha"] = torch.tensor(alpha)
    sha256 = hashlib.sha256(path.read_bytes()).hexdigest()
    return adapter_from_state_dict(name, sha256, state_dict, components).to(dtype, device)


class RowLora:
    """The per-row updates of one component (the denoiser, a text encoder): hooks on the layers adapters name, and
    which adapters each row of the current call uses (`rows`)."""

    def __init__(self, module: torch.nn.Module, component: str):
        self.module, self.component = module, component
        self._hooked: dict[str, Any] = {}
        self._runs: list[_Run] = []
        self.assignment: Sequence[RowAdapters] = ()  # the current call's, per row (a parallel group splits it)

    def attach(self, adapter: LoraAdapter) -> None:
        """Hook every layer of this component `adapter` names (once per layer, whatever the adapters); refuse one that
        does not fit."""
        prefix = f"{self.component}."
        for key, layer in adapter.layers.items():
            if not key.startswith(prefix):
                continue
            path = key.removeprefix(prefix)
            try:
                module = self.module.get_submodule(path)
            except AttributeError:
                raise LoraFormatError(f"adapter {adapter.name!r} names {key}, which this model lacks") from None
            if not isinstance(module, torch.nn.Linear):
                raise LoraFormatError(f"adapter {adapter.name!r}: {key} is a {type(module).__name__}, not a Linear")
            if layer.down.shape[1] != module.in_features or layer.up.shape[0] != module.out_features:
                raise LoraFormatError(f"adapter {adapter.name!r}: {key}'s shapes do not fit the layer")
            if path not in self._hooked:
                self._hooked[path] = module.register_forward_hook(self._hook(path))

    @contextmanager
    def rows(self, assignment: Sequence[RowAdapters]) -> Iterator[None]:
        """For the calls inside: row i of the denoiser's batch uses `assignment[i]` (empty: no adapter; an adapter at
        scale 0 is none: its row is the base model's, bit for bit)."""
        before = self._runs, self.assignment
        self._runs, self.assignment = _runs(assignment), assignment
        try:
            yield
        finally:
            self._runs, self.assignment = before  # a group's part of a call nests in the whole call's

    def _hook(self, path: str):
        key = f"{self.component}.{path}"

        def add_updates(module: torch.nn.Module, inputs: tuple[torch.Tensor, ...], output: torch.Tensor):
            # Run by run, in order: each row adds its adapters' updates in its own list order.
            for run in self._runs:
                layer = run.adapter.layers.get(key)
                if layer is None:
                    continue
                (x,) = inputs
                if x.shape[0] != run.rows:
                    raise RuntimeError(f"{key}: {x.shape[0]} rows, {run.rows} assigned")
                rows = slice(run.start, run.stop)  # views: no gather, no scatter
                # Weights already in the denoiser's dtype (AdapterLibrary casts them once): `to` is then a no-op.
                update = F.linear(F.linear(x[rows], layer.down.to(x.dtype)), layer.up.to(x.dtype))
                scale = run.scale * layer.scale
                if scale != 1.0:
                    update.mul_(scale)
                # Elementwise, one rounding each (a multiply, then an add, never fused): a row's bits do not depend
                # on which other rows share its run.
                output[rows] += update
            return output if self._runs else None

        return add_updates


@dataclass(frozen=True)
class _Run:
    """Consecutive rows of one call that add one adapter's update, at one position of their lists, at one scale."""

    adapter: LoraAdapter
    scale: float
    start: int
    stop: int
    rows: int  # of the whole call


def _runs(assignment: Sequence[RowAdapters]) -> list[_Run]:
    """A call's updates, position by position of the rows' lists, each as runs of consecutive rows (a sample's rows
    are adjacent: one run per sample at least, fewer where neighbours share the adapter); computed once per call, not
    per layer. Scale 0 entries add nothing and are left out."""
    runs: list[_Run] = []
    lists = [tuple((a, scale) for a, scale in row if scale != 0.0) for row in assignment]
    for position in range(max((len(row) for row in lists), default=0)):
        at: list[_Run] = []  # this position's runs
        for i, row in enumerate(lists):
            if position >= len(row):
                continue
            adapter, scale = row[position]
            if at and at[-1].stop == i and at[-1].adapter is adapter and at[-1].scale == scale:
                at[-1] = _Run(adapter, scale, at[-1].start, i + 1, len(assignment))
            else:
                at.append(_Run(adapter, scale, i, i + 1, len(assignment)))
        runs += at
    return runs


#: Where an adapter named `name` lives in the adapters directory, in the order looked for.
ADAPTER_FILES = ("{name}.safetensors", "{name}/pytorch_lora_weights.safetensors")


class AdapterLibrary:
    """One replica's adapters: the files of `directory`, loaded on first use and kept, least recently used dropped
    first, within `budget_bytes` of weights (the one just loaded always stays)."""

    def __init__(
        self,
        directory: str | None,
        pipeline_class: Any,
        components: Sequence[str],
        budget_bytes: int,
        dtype: torch.dtype | None = None,
        device: Any = None,
    ):
        self.directory = Path(directory) if directory else None
        self.pipeline_class, self.components, self.budget_bytes = pipeline_class, tuple(components), budget_bytes
        self.dtype, self.device = dtype, device  # the denoiser's: weights are cast once, on loading
        self._cache: OrderedDict[str, tuple[tuple[int, int], LoraAdapter]] = OrderedDict()
        self._lock = threading.Lock()  # admission (the replica's loop) and the engine thread both read

    def names(self) -> list[str]:
        if self.directory is None or not self.directory.is_dir():
            return []
        found = {p.stem for p in self.directory.glob("*.safetensors")}
        found |= {p.parent.name for p in self.directory.glob("*/pytorch_lora_weights.safetensors")}
        return sorted(found)

    def path(self, name: str) -> Path:
        for pattern in ADAPTER_FILES if self.directory else ():
            candidate = cast(Path, self.directory) / pattern.format(name=name)
            if candidate.is_file():
                return candidate
        raise LoraNotFoundError(
            f"no LoRA adapter named {name!r} here; GET /v1/loras lists them", param="lora", code="lora_not_found"
        )

    def get(self, name: str) -> LoraAdapter:
        """The adapter `name`, from the cache while its file is unchanged (size and mtime), else read again."""
        path = self.path(name)
        stat = path.stat()
        stamp = (stat.st_size, stat.st_mtime_ns)
        with self._lock:
            kept = self._cache.get(name)
            if kept is not None and kept[0] == stamp:
                self._cache.move_to_end(name)
                return kept[1]
            try:
                adapter = load_adapter(path, name, self.pipeline_class, self.components, self.dtype, self.device)
            except Exception as err:
                logger.exception("LoRA adapter %r at %s cannot be loaded", name, path)
                raise LoraLoadError(f"LoRA adapter {name!r} cannot be loaded; the server's log names the file") from err
            self._cache[name] = (stamp, adapter)
            while len(self._cache) > 1 and sum(a.nbytes for _, a in self._cache.values()) > self.budget_bytes:
                self._cache.popitem(last=False)
            return adapter

    def resolve(self, choices: list[LoraChoice]) -> list[LoraChoice]:
        """`choices` with each adapter's sha256; a given sha256 must be its file's."""
        resolved = []
        for choice in choices:
            adapter = self.get(choice.name)
            if choice.sha256 is not None and choice.sha256 != adapter.sha256:
                raise InvalidRequestError(
                    f"LoRA adapter {choice.name!r} here has other weights (sha256 {adapter.sha256}) than the "
                    f"{choice.sha256} asked for",
                    param="lora",
                )
            resolved.append(choice.model_copy(update={"sha256": adapter.sha256}))
        return resolved

    def cached_bytes(self) -> int:
        with self._lock:
            return sum(a.nbytes for _, a in self._cache.values())


class FamilyAdapters:
    """A step-engine family's LoRA adapters per row: the hooks on its denoiser and, where the family encodes in order,
    on its text encoders; and where a sample's adapters come from (`library`: the renderer sets it)."""

    def __init__(self, pipe, denoiser_name: str, text_encoders: Sequence[str]):
        self.denoiser_name = denoiser_name
        self.denoiser = RowLora(getattr(pipe, denoiser_name), denoiser_name)
        self.text = [RowLora(getattr(pipe, n), n) for n in text_encoders if getattr(pipe, n, None) is not None]
        self.library: AdapterLibrary | None = None

    def attach(self, samples: Sequence[Any]) -> None:
        """Joining samples' adapters, hooked where not yet (on the engine thread: never while a call runs)."""
        for sample in samples:
            if sample.params.lora:
                sample.adapters = self.hooked([(choice.name, choice.scale) for choice in sample.params.lora])

    def hooked(self, named: Sequence[tuple[str, float]]) -> RowAdapters:
        """One row's adapters (name, scale) from the library, each hooked on every component where not yet; a
        parallel group's worker resolves the rows it is sent the same way."""
        if not named:
            return ()
        assert self.library is not None  # admission refuses adapters where there is none
        adapters = tuple((self.library.get(name), scale) for name, scale in named)
        for adapter, _ in adapters:
            for lora in (self.denoiser, *self.text):
                lora.attach(adapter)
        return adapters

    @contextmanager
    def text_rows(self, samples: Sequence[Any]) -> Iterator[None]:
        """Each text encoder's rows with their sample's adapters, inside the block."""
        with ExitStack() as adapted:
            for lora in self.text:
                adapted.enter_context(lora.rows([s.adapters for s in samples]))
            yield

    def check(self, adapter: LoraAdapter) -> None:
        """Refuse (400) an adapter of components this family does not adapt per row: text encoders, where it does not
        encode in order. Applying the rest alone would render another image than the adapter's authors meant."""
        unadapted = adapter.components - {self.denoiser_name, *(lora.component for lora in self.text)}
        if unadapted:
            raise InvalidRequestError(
                f"LoRA adapter {adapter.name!r} adapts {sorted(unadapted)}, which this model's step engine does not "
                "adapt per request (the denoiser's layers only; the text encoders' too for UNet pipelines)",
                param="lora",
                code="unsupported_value",
            )
