"""A diffusion replica whose workers split each call's image tokens (`parallel: {sp: 2}`, alone and with `cfg: 2`:
stages.diffusion.sequence_plans) gives the bytes one worker gives, for every family sequence parallelism serves: SD3,
FLUX, Qwen-Image and the Wan video. As in test_parallel_group: each request co-batched with unlike neighbours on the
group against the same request rendered alone by a one-worker replica, kernels on; the control, switch off, differs.
"""

import pytest

from contracts.jobs import RenderJob
from contracts.sampling import DiffusionSamplingParams
from stages.diffusion.sequence_parallel import backend_for

from .test_parallel_group import DIT, FLUX, QWEN, WAN, jobs, solo_and_grouped

pytestmark = [pytest.mark.slow, pytest.mark.timeout(600)]

#: The family's jobs (FLUX's and Qwen-Image's with another size: those calls are packed, their padded tokens split), and
#: one whose image tokens do not split in two (48x48: 9 for the images, 27 for the video's 3 latent frames): a call of
#: its own runs whole on each part's first worker (packed with larger FLUX or Qwen-Image images, its padding splits).
UNEVEN = RenderJob(
    prompt="a kite over the sea", params=DiffusionSamplingParams(seed=5, height=48, width=48, num_inference_steps=3)
)


SP_GRIDS = [(model, cfg, 2) for model in (DIT, FLUX, QWEN, WAN) for cfg in (1, 2)]


@pytest.mark.parametrize(("model", "cfg", "sp"), SP_GRIDS)
def test_sequence_parallel_cobatched_gives_one_workers_solo_bytes(serve_instance, model, cfg, sp):
    solo, grouped, group = solo_and_grouped(model, True, cfg, sp, jobs(model) + [UNEVEN])
    assert [r.sha256 for r in grouped] == [r.sha256 for r in solo]
    assert max(r.batch_size for r in grouped) > 1  # they did meet in one call
    workers = group["workers"]
    assert (group["cfg"], group["sp"], group["problem"]) == (cfg, sp, None) and len(workers) == cfg * sp
    assert len({w["pid"] for w in workers}) == cfg * sp, workers  # each its own process
    assert all(w["rows"] > 0 and w["kernels_installed"] for w in workers), workers  # each predicted, with the kernels
    assert group["collectives_sent_bytes"] > 0  # the tokens did travel between workers
    # Each result names the grid that rendered it (the PNG does not: its bytes are the one worker's).
    assert {(r.parallel.cfg, r.parallel.sp) for r in grouped} == {(cfg, sp)} and {r.parallel for r in solo} == {None}


def doubled(job: RenderJob) -> RenderJob:
    """The job at twice its sides: more tokens per call, where a stock GEMM's bits follow its rows more often."""
    sides = {"height": 2 * job.params.height, "width": 2 * job.params.width}
    return RenderJob(prompt=job.prompt, params=job.params.model_copy(update=sides))


#: The control's jobs: at 64x64 for SD3 and FLUX; twice the sides for Qwen-Image and Wan, whose tiny GEMMs at 64x64
#: mostly gave the same bits split or whole (their stock controls there differed in 1 of 2 runs).
CONTROL_JOBS = {
    DIT: jobs(DIT), FLUX: jobs(FLUX), QWEN: [doubled(j) for j in jobs(QWEN)], WAN: [doubled(j) for j in jobs(WAN)]
}


@pytest.mark.parametrize("model", list(CONTROL_JOBS))
def test_control_switch_off_sequence_parallel_bytes_differ(serve_instance, model):
    """Stock kernels under the same splits: a row's bits follow how many token rows share its GEMMs, so the check
    above can fail for each family's split. Which grid shows it follows the CPU's kernels and which calls meet; on a
    2-core Xeon's avx2 path, 2 of 2 runs each: SD3 at both grids, FLUX at one or both, Qwen-Image (128x128) at both,
    Wan (128x128) at 2x2 only. So the grids are tried in turn until one differs."""
    for cfg, sp in ((1, 2), (2, 2)):
        solo, grouped, _ = solo_and_grouped(model, False, cfg, sp, CONTROL_JOBS[model])
        if any(a.sha256 != b.sha256 for a, b in zip(solo, grouped, strict=True)):
            return
    pytest.fail("stock kernels gave the one worker's bytes for every request at every grid: the check could not fail")


def test_the_group_talks_through_gloo_on_cpu_and_nccl_on_cuda():
    """Which library a group's collectives use, by its device (NCCL is chosen, not run: no GPU here)."""
    assert [backend_for(d) for d in ("cpu", "cuda", "cuda:0")] == ["gloo", "nccl", "nccl"]
