"""The step engine (stages.diffusion.engine): samples join and leave between steps, and none of it changes a sample's bits.

Real tiny pipelines (UNet and DiT), real kernels, the engine's own thread; no Ray. The engines are the
`engine` fixture of tests/stages/conftest.py. Each invariance check runs
with the kernels on and, as its control, off: the same check must then fail, or it proves nothing.
"""

import threading
import time

import numpy as np
import pytest

from contracts.sampling import DiffusionSamplingParams
from stages.diffusion.engine import Sample
from .conftest import ENGINES_ON, ENGINES_PACKING

pytestmark = pytest.mark.slow
TARGET = ("a red fox in the snow", 42)
WAIT_S = 120


def params(engine, seed, **fields):
    fields.setdefault("num_inference_steps", 4)
    return engine.renderer.resolve(DiffusionSamplingParams(seed=seed, **fields), step_engine=True)


def sample(engine, prompt, seed, **fields) -> Sample:
    return Sample(prompt, params(engine, seed, **fields), on_done=None)


def solo(engine, prompt, seed, **fields) -> np.ndarray:
    return engine.render([sample(engine, prompt, seed, **fields)])[0]


class Collector:
    """Submits samples and collects their images, from the engine's thread."""

    def __init__(self, engine):
        self.engine, self.images, self.finished_order, self.done = engine, {}, [], threading.Condition()

    def submit(self, name, s: Sample) -> Sample:
        def on_done(result, name=name):
            with self.done:
                self.images[name] = result
                self.finished_order.append(name)
                self.done.notify_all()

        s.on_done = on_done
        return self.engine.submit(s)

    def wait(self, names):
        with self.done:
            assert self.done.wait_for(lambda: all(n in self.images for n in names), WAIT_S), f"not finished: {names}"
        for name in names:
            assert not isinstance(self.images[name], BaseException), self.images[name]
        return [self.images[n] for n in names]


def after_forwards(engine, count):
    deadline = time.monotonic() + WAIT_S
    start = engine.forwards
    while engine.forwards < start + count:
        assert time.monotonic() < deadline
        time.sleep(0.002)


def neighbours(engine, count, steps=8):
    """Samples unlike the target: other prompts, seeds, steps, guidance, negative prompts, schedulers."""
    schedulers = sorted(engine.renderer.family.SCHEDULERS)
    variants = [{}, {"guidance_scale": 1.0}, {"negative_prompt": "blurry"}, {"guidance_scale": 9.5},
                {"num_inference_steps": 2}, {"num_inference_steps": 6}, {}]
    made = []
    for i in range(count):
        fields = {"num_inference_steps": steps, **variants[i % len(variants)], "scheduler": schedulers[i % len(schedulers)]}
        made.append(sample(engine, f"neighbour {i}, a lighthouse at dusk", 100 + i, **fields))
    return made


#: Scheduling and bookkeeping: which sample finishes first, who shares a forward, what the engine keeps. One answer on
#: every kernel path, so make test runs them once, on this machine's path; the bits of co-batched and packed samples
#: are the checks above and below, which run on every path.
SCHEDULING = pytest.mark.path_independent


def check(engine, equal: bool) -> None:
    """The invariance verdict: with kernels on it must hold; the control must show it can fail."""
    if engine.invariant:
        assert equal
    else:
        assert not equal, "the control did not vary: this check could not fail"


@pytest.mark.parametrize("engine", ENGINES_ON, indirect=True)  # bits against diffusers: with the kernels on, as served
def test_a_solo_sample_gives_the_bytes_of_its_own_diffusers_pipeline(engine):
    """The family is its pipeline's `__call__` cut per step: alone, a sample gives what diffusers gives."""
    import torch

    requests = [{}, {"negative_prompt": "blurry", "guidance_scale": 7.0}]
    if "true_cfg_scale" in engine.renderer.pipe.__call__.__code__.co_varnames:
        requests.append({"negative_prompt": "blurry", "true_cfg_scale": 4.0})  # FLUX's second branch
    for fields in requests:
        resolved = params(engine, TARGET[1], **fields)
        (mine,) = engine.render([Sample(TARGET[0], resolved, on_done=None)])
        theirs = engine.renderer.pipe(
            TARGET[0], height=resolved.height, width=resolved.width, num_inference_steps=resolved.num_inference_steps,
            guidance_scale=resolved.guidance_scale, generator=torch.Generator("cpu").manual_seed(TARGET[1]),
            output_type="np", **{k: v for k, v in fields.items() if k != "guidance_scale"},
        ).images[0]
        assert np.array_equal(mine, theirs), fields


@pytest.mark.parametrize("batch", [2, 5, 8])
def test_a_sample_cobatched_with_unlike_neighbours_gives_its_solo_bytes(engine, batch):
    alone = solo(engine, *TARGET)
    images = engine.render([sample(engine, *TARGET), *neighbours(engine, batch - 1, steps=4)])
    equal = np.array_equal(images[0], alone)
    check(engine, equal)


def test_samples_of_one_prompt_encoded_in_one_call_give_their_solo_bytes(engine):
    """Requests for one prompt (other seeds) join one text-encoder call, the whole batch's rows in one tensor: the last
    one's bits once followed where its elements fell in ATen's elementwise loops (Qwen2.5-VL's SiLU, avx512 path,
    the third of three), until the pointwise kernels (blocked.cpp) computed every element by the same code."""
    together = engine.render([sample(engine, TARGET[0], seed, num_inference_steps=2) for seed in (5, 6, 7)])
    alone = [solo(engine, TARGET[0], seed, num_inference_steps=2) for seed in (5, 6, 7)]
    check(engine, all(np.array_equal(a, b) for a, b in zip(together, alone, strict=True)))


def test_a_sample_joining_a_running_batch_midway_gives_its_solo_bytes(engine):
    alone = solo(engine, *TARGET)
    collector = Collector(engine)
    running = [collector.submit(f"long {i}", s) for i, s in enumerate(neighbours(engine, 5, steps=12))]
    after_forwards(engine, 3)
    target = collector.submit("target", sample(engine, *TARGET))
    (image,) = collector.wait(["target"])
    collector.wait([f"long {i}" for i in range(5)])
    assert target.largest_batch > 1 and target.steps_co_batched == 4
    assert all(s.steps_co_batched > 0 for s in running)
    check(engine, np.array_equal(image, alone))


def test_samples_joining_and_leaving_during_its_steps_leave_its_bytes_alone(engine):
    alone = solo(engine, *TARGET, num_inference_steps=10)
    collector = Collector(engine)
    target = collector.submit("target", sample(engine, *TARGET, num_inference_steps=10))
    for wave in range(3):  # short neighbours arrive and finish while the target runs
        for i, s in enumerate(neighbours(engine, 2, steps=2)):
            collector.submit(f"wave {wave}.{i}", s)
        after_forwards(engine, 2)
    (image,) = collector.wait(["target"])
    assert target.largest_batch >= 3
    if not engine.invariant and np.array_equal(image, alone):
        # Measured: on the avx512 path of an Intel Xeon (AMX) the UNet's stock kernels give these batches of at most
        # 3 the solo bits; the co-batching tests above vary there. A machine fact, not a failure.
        pytest.skip("measured: this control did not vary on this CPU and path (batches of at most 3)")
    check(engine, np.array_equal(image, alone))


def test_a_cancelled_sample_leaves_and_the_others_keep_their_bytes(engine):
    alone = solo(engine, *TARGET, num_inference_steps=8)
    collector = Collector(engine)
    doomed = [collector.submit(f"doomed {i}", s) for i, s in enumerate(neighbours(engine, 3, steps=30))]
    target = collector.submit("target", sample(engine, *TARGET, num_inference_steps=8))
    after_forwards(engine, 2)
    for s in doomed:
        engine.cancel(s)
    (image,) = collector.wait(["target"])
    assert all(f"doomed {i}" not in collector.images for i in range(3)), "a cancelled sample was decoded"
    assert all(s.step < 30 for s in doomed) and engine.load()["active"] == 0
    assert target.largest_batch == 4
    check(engine, np.array_equal(image, alone))


def test_partial_images_do_not_change_the_final_bytes(engine):
    plain = solo(engine, *TARGET, num_inference_steps=6)
    partials = []
    with_partials = sample(engine, *TARGET, num_inference_steps=6)
    with_partials.partial_steps, with_partials.on_partial = (2, 4), lambda index, image: partials.append((index, image))
    (final,) = engine.render([with_partials])
    assert np.array_equal(final, plain)  # holds with or without the kernels: a partial is a decode on the side
    assert [index for index, _ in partials] == [0, 1] and all(image.shape == final.shape for _, image in partials)
    assert not np.array_equal(partials[0][1], final)


@SCHEDULING
@pytest.mark.parametrize("engine", ENGINES_ON, indirect=True)  # scheduling, not bits: with the kernels on
def test_a_short_request_sent_while_a_long_batch_runs_finishes_first_and_shares_forwards(engine):
    collector = Collector(engine)
    for i in range(8):
        collector.submit(f"long {i}", sample(engine, f"long {i}", i, num_inference_steps=32))
    after_forwards(engine, 2)
    short = collector.submit("short", sample(engine, "short", 99, num_inference_steps=4))
    collector.wait(["short", *[f"long {i}" for i in range(8)]])
    assert collector.finished_order[0] == "short" and short.largest_batch > 1


@SCHEDULING
@pytest.mark.parametrize("engine", ENGINES_ON, indirect=True)  # the bits' control: the packing test below
def test_a_short_request_of_another_size_sent_while_long_ones_run_finishes_first_with_its_solo_bytes(engine):
    """FLUX packs sizes: the short one shares the long ones' forwards. The others call their denoiser per latent
    shape: the engine picks by fewest remaining steps across shapes, so the short one's forwards run between theirs."""
    expected = solo(engine, "short", 99, num_inference_steps=4)
    collector = Collector(engine)
    longs = [f"long {i}" for i in range(4)]
    for i, name in enumerate(longs):
        collector.submit(name, sample(engine, name, i, num_inference_steps=32, height=128, width=128))
    after_forwards(engine, 2)
    short = collector.submit("short", sample(engine, "short", 99, num_inference_steps=4))
    (image, *_) = collector.wait(["short", *longs])
    assert collector.finished_order[0] == "short"
    assert np.array_equal(image, expected)
    assert short.largest_batch == (5 if engine.renderer.family.packs_sizes else 1)


@pytest.mark.parametrize("engine", ENGINES_PACKING, indirect=True)  # the others call their denoiser per latent shape
def test_samples_of_different_sizes_packed_into_one_call_give_their_solo_bytes(engine):
    """FLUX: token sequences padded to the longest, attention per sample (stages/diffusion/engine/packing.py)."""
    assert engine.renderer.family.packs_sizes
    target = sample(engine, *TARGET)
    expected = solo(engine, *TARGET)
    others = [  # other sizes (wider, taller, smaller, larger), steps, true CFG
        sample(engine, "wide", 1, height=64, width=96, negative_prompt="dark", true_cfg_scale=3.0),
        sample(engine, "tall", 2, height=128, width=64, num_inference_steps=6),
        sample(engine, "small", 3, height=32, width=48),
        sample(engine, "large", 4, height=128, width=128, num_inference_steps=3),
    ]
    wide_alone = solo(engine, "wide", 1, height=64, width=96, negative_prompt="dark", true_cfg_scale=3.0)
    images = engine.render([target, *others])
    assert target.largest_batch == 5 and images[4].shape == (128, 128, 3) and images[3].shape == (32, 48, 3)
    check(engine, np.array_equal(images[0], expected) and np.array_equal(images[1], wide_alone))


@SCHEDULING
@pytest.mark.parametrize("engine", ENGINES_ON, indirect=True)  # bookkeeping, not bits: with the kernels on
def test_the_engine_keeps_nothing_per_request_key(engine):
    samples = [sample(engine, "keys", i, num_inference_steps=engine.renderer.capabilities.min_steps, guidance_scale=1.5 + i / 1000) for i in range(64)]
    engine.render(samples)
    assert engine.load()["waiting"] == 0 and engine.load()["active"] == 0
    assert not [name for name, value in vars(engine).items() if isinstance(value, dict) and value]


def test_preview_steps_are_evenly_spaced_and_never_the_last_step():
    from stages.diffusion.engine.sample import preview_steps

    assert preview_steps(8, 3) == (2, 4, 6) and preview_steps(4, 2) == (1, 3) and preview_steps(4, 0) == ()
    assert preview_steps(2, 3) == (1,) and preview_steps(1, 2) == ()  # too few steps: fewer previews


#: A process that starts a step engine, stops it mid-render and exits; argv[1] "no-wait": the stop does not wait for the
#: thread (the control: the engine as it was before `stop` waited). The stop comes after the first of a render's 50
#: steps (256x256), so the thread is still computing when the stop returns: without a render in flight the control
#: exited 0 in 6 of 6 runs on a 2-core Xeon (its thread had ended before the interpreter did), with one it aborted
#: in 3 of 3, and the waiting stop exited 0 in 3 of 3.
STOP_THEN_EXIT = """
import sys, threading
from contracts.config import DiffusionStageConfig
from contracts.sampling import DiffusionSamplingParams
from stages.diffusion import DiffusionRenderer
from stages.diffusion.engine import Sample, StepEngine

def start_and_stop():
    renderer = DiffusionRenderer(DiffusionStageConfig(batch_invariant=False, torch_threads=1))
    engine = StepEngine(renderer.family, max_batch_size=1, torch_threads=1)
    if sys.argv[1] == "no-wait":
        engine._thread.join = lambda timeout=None: None
    stepped = threading.Event()
    params = DiffusionSamplingParams(seed=1, height=256, width=256, num_inference_steps=50)
    engine.submit(Sample("a red circle", renderer.resolve(params, step_engine=True), on_done=None,
                         on_step=lambda steps: stepped.set()))
    assert stepped.wait(120), "the render did not start"
    engine.stop()

start_and_stop()  # its last references go here, while the engine's thread may still be ending
print("stopped")
"""


@SCHEDULING
def test_a_process_that_stops_its_engine_exits_cleanly_and_the_control_aborts():
    """`StepEngine.stop` waits for the compute thread, here stopped in the middle of a render: a thread still ending at
    interpreter exit frees the pipeline during finalization and the process aborts (SIGABRT, "terminate called without
    an active exception"). Each run is a process of its own; the control (the stop not waiting) shows the check can
    fail."""
    import signal
    import subprocess
    import sys
    from pathlib import Path

    def exit_code(mode: str) -> int:
        return subprocess.run([sys.executable, "-c", STOP_THEN_EXIT, mode], cwd=Path(__file__).resolve().parents[2],
                              capture_output=True, text=True, timeout=300).returncode

    assert [exit_code("wait") for _ in range(2)] == [0, 0]
    # The control aborts when its thread outlives the interpreter's last reference: run until it does, at most 6 times.
    control = []
    while len(control) < 6 and not any(control):
        control.append(exit_code("no-wait"))
    if not any(control):
        pytest.skip(f"the control (stop not waiting) exited 0 in {len(control)} of {len(control)} runs here: the "
                    "check cannot be shown to fail on this machine")
    assert control[-1] == -signal.SIGABRT, control
