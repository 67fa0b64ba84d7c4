"""The step engine: continuous batching of denoising steps, one compute thread per replica.

Between two steps, finished samples leave and waiting ones join; each step calls the denoiser once for up to
`max_batch_size` samples of one latent shape (of any shapes, for a family that packs sizes: FLUX), whatever their
timesteps, step counts, guidance scales, negative prompts and schedulers. A cancelled sample leaves at the next step boundary (its text encoding and
decode are skipped if they have not happened). Nothing is kept per request key: the engine holds the samples
in flight and nothing else.

A replica that stops while samples run (a scale-down, a redeploy) hands them off (`hand_off`): at the next step boundary
each leaves with its state (`checkpoint.Moved`) for its caller to send to another replica, where it goes on from
that step with the same bytes; so does every sample that arrives after.

Which samples share a step: the fewest remaining steps first (short requests are not stuck behind long
ones), aged by the steps a sample has waited through (long ones are never starved), arrival order last.
With the batch-invariant kernels on, none of this changes a sample's bits.
"""

from __future__ import annotations

import functools
import itertools
import logging
import threading
import time
from collections import deque
from typing import Any, cast

import torch

from .families import Family
from .sample import Moved, Sample

logger = logging.getLogger("ray.serve")


def take_joining(waiting: deque[Sample], most: int) -> list[Sample]:
    """Waiting samples that join now (at most `most`: one batch of text encodings), the cancelled ones dropped."""
    joining, now = cast(list[Sample], []), time.monotonic()  # cast: an empty list's items are not inferred
    while waiting and len(joining) < most:
        if not (sample := waiting.popleft()).cancelled:
            sample.joined_at = now
            joining.append(sample)
    return joining


def each_decides(family: Family, batch: list[Sample]) -> list[Sample]:
    """The samples whose rows join this step's denoiser call: with step caching, each decides from its own values
    alone (stages.diffusion.engine.sample), so the decision, like its bits, never follows its neighbours."""
    return [s for s in batch if s.cache is None or s.cache.computes(family.cache_signal(s), s.step, len(s.timesteps))]


class StepEngine:
    #: The samples whose rows join a step's denoiser call (step caching: each decides for itself, `each_decides`).
    computed = staticmethod(each_decides)

    def __init__(self, family: Family, *, max_batch_size: int, torch_threads: int | None = None, pack_sizes=True):
        self.family, self.max_batch_size, self.torch_threads = family, max_batch_size, torch_threads
        self.pack_sizes = pack_sizes and family.packs_sizes  # samples of different sizes in one forward (bool)
        self._waiting: deque[Sample] = deque()
        self._active: list[Sample] = []
        self._wake = threading.Condition()
        self._arrivals = itertools.count()
        self._stopped = False
        self._handing_off = False
        self.forwards = 0
        self.step_started: float | None = None  # time.monotonic() when the current step began; None: idle
        self._thread = threading.Thread(target=self._run, name="diffusion-engine", daemon=True)
        self._thread.start()

    # -- the caller's side (any thread) ------------------------------------------------------------------

    def submit(self, sample: Sample) -> Sample:
        with self._wake:
            sample.arrival = next(self._arrivals)
            self._waiting.append(sample)
            self._wake.notify()
        return sample

    def cancel(self, sample: Sample) -> None:
        """The sample leaves at the next step boundary; nobody is told (its caller is gone)."""
        with self._wake:
            sample.cancelled = True
            self._wake.notify()

    def hand_off(self) -> None:
        """From the next step boundary on, every sample in flight or arriving leaves with its state (`Moved`), not
        rendered further here."""
        with self._wake:
            self._handing_off = True
            self._wake.notify()

    def stop(self, timeout_s: float = 60.0) -> None:
        """The compute thread ends after its current step, and the caller waits for it: a thread still ending while
        the interpreter exits frees the pipeline (it holds the last reference, through its target) during
        finalization, and the process aborts ("terminate called without an active exception"; 6 of 6 processes of
        bench/self_audit.py's start before this wait)."""
        with self._wake:
            self._stopped = True
            self._wake.notify()
        if threading.current_thread() is not self._thread:
            self._thread.join(timeout_s)

    @property
    def alive(self) -> bool:
        return self._thread.is_alive() and not self._stopped

    def load(self) -> dict[str, int]:
        return {"waiting": len(self._waiting), "active": len(self._active), "forwards": self.forwards}

    def render(self, samples: list[Sample], timeout_s: float = 600.0) -> list[Any]:
        """Submit `samples` and wait for their images (warm-up, tests, benchmarks: no event loop needed)."""
        done = threading.Semaphore(0)
        results: dict[int, Any] = {}
        for index, sample in enumerate(samples):
            sample.on_done = functools.partial(_kept, results, done, index)
            self.submit(sample)
        for _ in samples:
            if not done.acquire(timeout=timeout_s):
                raise TimeoutError("the step engine did not finish in time")
        for result in results.values():
            if isinstance(result, BaseException):
                raise result
        return [results[i] for i in range(len(samples))]

    # -- the compute thread ------------------------------------------------------------------------------

    def _run(self) -> None:
        if self.torch_threads:
            torch.set_num_threads(self.torch_threads)  # per thread: OpenMP settings do not follow threads
        while True:
            with self._wake:
                while not self._stopped and not self._waiting and not self._active:
                    self._wake.wait()
                if self._stopped:
                    return
                handing_off = self._handing_off
                if handing_off:  # between two steps: every sample leaves as it is
                    leaving = [s for s in (*self._active, *self._waiting) if not s.cancelled]
                    self._active, self._waiting = [], deque()
                else:
                    joining, self.step_started = take_joining(self._waiting, self.max_batch_size), time.monotonic()
                    self._active = [s for s in self._active if not s.cancelled]
            if handing_off:
                for sample in leaving:
                    _tell(sample, _moved(sample))
                continue
            with torch.inference_mode():
                self._join(joining)
                batch = self._pick()
                if batch:
                    self._forward(batch)
            self.step_started = None

    def _join(self, joining: list[Sample]) -> None:
        if not joining:
            return
        try:
            self.family.condition(joining)  # their adapters, then `encode`
            for sample in joining:
                self.family.prepare(sample)
                sample.restore()  # a sample moved from another replica goes on from the step it had reached
        except Exception as exc:
            self._fail(joining, exc)
            return
        self._active.extend(joining)

    def _pick(self) -> list[Sample]:
        ready = [s for s in self._active if not s.cancelled and not s.finished]
        if not ready:
            return []
        ready.sort(key=lambda s: (s.remaining - s.skipped, s.arrival))
        key = ready[0].latent_key
        batch = [s for s in ready if self.pack_sizes or s.latent_key == key][: self.max_batch_size]
        for sample in ready:
            if sample not in batch:
                sample.skipped += 1
        return batch

    def _forward(self, batch: list[Sample]) -> None:
        try:
            computed = self.computed(self.family, batch)
            fresh = dict(zip(computed, self.family.forward(computed), strict=True)) if computed else {}
            for sample in batch:  # a cached sample steps with the prediction it kept
                self.family.step(
                    sample, fresh[sample] if sample.cache is None else sample.cache.kept(fresh.get(sample))
                )
        except Exception as exc:
            self._fail(batch, exc)
            return
        self.forwards += bool(computed)
        for sample in computed:
            sample.steps_computed += 1
            sample.largest_batch = max(sample.largest_batch, len(computed))
            sample.steps_co_batched += len(computed) > 1
        for sample in batch:
            sample.stepped()
            _checkpoint(sample)
        self._partials([s for s in batch if s.on_partial and s.step in s.partial_steps and not s.cancelled])
        finished = [s for s in batch if s.finished]
        if finished:
            self._active = [s for s in self._active if not s.finished]
            self._finish([s for s in finished if not s.cancelled])

    def _partials(self, samples: list[Sample]) -> None:
        """Decode each sample's current estimate of its final latents (its state is not touched)."""
        if samples:
            estimates = [s.prediction if s.prediction is not None else s.latents for s in samples]
            for sample, image in zip(samples, self._decode(samples, estimates), strict=False):
                _show(sample, image)

    def _finish(self, samples: list[Sample]) -> None:
        if samples:
            _tell_each(samples, self._decode(samples, [s.latents for s in samples]))

    def _decode(self, samples: list[Sample], latents: list[torch.Tensor]) -> list[Any]:
        try:
            return _decoded_by_shape(self.family, samples, latents)
        except Exception as exc:
            self._fail(samples, exc)
            return []

    def _fail(self, samples: list[Sample], exc: Exception) -> None:
        logger.exception("the step engine failed on %d sample(s)", len(samples), exc_info=exc)
        self._active = [s for s in self._active if s not in samples]
        for sample in samples:
            _tell(sample, exc)


def _decoded_by_shape(family: Family, samples: list[Sample], latents: list[torch.Tensor]) -> list[Any]:
    """Each sample's float image (or video), decoded with the others of its frames and shape (a packed batch holds
    several shapes)."""
    images: dict[int, Any] = {}
    for key in dict.fromkeys(s.latent_key for s in samples):
        same = [i for i, s in enumerate(samples) if s.latent_key == key]
        images.update(zip(same, family.decode(torch.cat([latents[i] for i in same]), key[1:]), strict=True))
    return [images[i] for i in range(len(samples))]


def _kept(results: dict[int, Any], done: threading.Semaphore, index: int, result: Any) -> None:
    """`StepEngine.render`'s callback for its sample `index`: keep the result, then wake the caller."""
    results[index] = result
    done.release()


def _checkpoint(sample: Sample) -> None:
    """Hand the sample's state to its caller every `checkpoint_every` steps but the last; a failure costs the
    checkpoint, never the engine or the render."""
    every = sample.checkpoint_every
    if sample.on_checkpoint is None or not every or sample.step % every or sample.finished or sample.cancelled:
        return
    try:
        sample.on_checkpoint(sample.step, sample.export_state())
    except Exception:
        logger.exception("a step-boundary checkpoint failed")


def _moved(sample: Sample) -> Moved:
    """The sample handed off with its state; where that cannot be exported, without it (started anew elsewhere: the
    same bytes, the steps done again)."""
    try:
        return Moved.of(sample)
    except Exception:
        logger.exception("a handed-off sample's state could not be exported")
        return Moved(sample.step, None)


def _show(sample: Sample, image: Any) -> None:
    assert sample.on_partial is not None  # only samples with one are decoded for previews
    sample.on_partial(sample.partial_steps.index(sample.step), image)


def _tell_each(samples: list[Sample], images: list[Any]) -> None:
    """Each sample its image; none when the decode failed (`_fail` has told each one why)."""
    for sample, image in zip(samples, images, strict=False):
        _tell(sample, image)


def _tell(sample: Sample, result: Any) -> None:
    try:
        assert sample.on_done is not None  # set before the sample was submitted
        sample.on_done(result)
    except Exception:  # a caller's callback must never stop the engine
        logger.exception("a step-engine callback failed")
