"""OpenAI's Videos API over HTTP against the running apps (conftest: the video stage of "/" with invariance on, of
"/off" with it off, both on VIDEO_PATH): the official openai client unchanged, a video rendered among others giving its
solo bytes (frames and MP4 file) with the control, bad requests as 4xx naming the field, deletion.
"""

import hashlib
import json
import os
import signal
import time

import pytest

from stages.diffusion.video_file import decode_mp4, read_mp4_provenance
from tests.orchestration.conftest import MAIN, STEPS, TIMEOUT_S, VIDEO_PATH

PROMPT = "a red ball bouncing on a wooden floor"
pytestmark = pytest.mark.filterwarnings("ignore:The Sora API:DeprecationWarning")  # the client warns of its own service


def _client(base_url: str):
    openai = pytest.importorskip("openai")
    return openai.OpenAI(base_url=f"{base_url}/v1", api_key="unused", timeout=TIMEOUT_S, max_retries=0)


def _finished(http, video_id: str, prefix: str = "") -> dict:
    """Poll a job (of the app at `prefix`) until it has finished."""
    deadline = time.monotonic() + TIMEOUT_S
    while time.monotonic() < deadline:
        video = http.get(f"{prefix}/v1/videos/{video_id}").json()
        if video["status"] in ("completed", "failed"):
            return video
        time.sleep(0.05)
    raise AssertionError(f"video {video_id} did not finish in {TIMEOUT_S} s")


def _create(http, prefix: str = "", **fields) -> dict:
    body = {"prompt": PROMPT, "seed": 7, "enhance_prompt": False, "size": "64x64", **fields}
    answer = http.post(f"{prefix}/v1/videos", json=body)
    assert answer.status_code == 200, answer.text
    return answer.json()


def test_openai_client_creates_polls_and_downloads_a_video(server, http):
    client = _client(server)
    created = client.videos.create(prompt=PROMPT, seconds="1", size="64x64", extra_body={"seed": 11})  # multipart
    assert (created.object, created.status, created.progress, created.seconds) == ("video", "queued", 0, "1")
    assert created.model == "omniserve/tiny-wan-video" and created.num_frames == 9 and created.fps == 8
    seen = []
    while (video := client.videos.retrieve(created.id)).status not in ("completed", "failed"):
        seen.append(video.progress)
        time.sleep(0.05)
    assert video.status == "completed", video.error
    assert seen == sorted(seen) and all(0 <= p < 100 for p in seen) and video.progress == 100
    assert video.completed_at >= created.created_at and video.expires_at > video.completed_at
    assert video.revised_prompt and video.revised_prompt != PROMPT  # the LLM stage rewrote it (enhance_prompt default)
    mp4 = client.videos.download_content(created.id).read()
    assert hashlib.sha256(mp4).hexdigest() == video.sha256
    frames = decode_mp4(mp4)
    assert frames.shape == (9, 64, 64, 3)
    record = json.loads(read_mp4_provenance(mp4))
    assert (record["seed"], record["prompt"], record["params"]["num_frames"]) == (11, PROMPT, 9)
    assert record["revised_prompt"] == video.revised_prompt
    deleted = client.videos.delete(created.id)
    assert (deleted.id, deleted.deleted, deleted.object) == (created.id, True, "video.deleted")


def _solo_then_among_others(http, prefix: str = "") -> tuple[dict, dict, bytes, bytes]:
    """The target alone, then again while three other videos (other prompts, seeds, steps) render."""
    solo = _finished(http, _create(http, prefix)["id"], prefix)
    others = [_create(http, prefix, prompt=f"a blue cube turning, take {i}", seed=100 + i, num_inference_steps=STEPS + 2 * i)
              for i in range(3)]
    again = _finished(http, _create(http, prefix)["id"], prefix)
    for other in others:
        assert _finished(http, other["id"], prefix)["status"] == "completed"
    files = [http.get(f"{prefix}/v1/videos/{v['id']}/content").content for v in (solo, again)]
    return solo, again, files[0], files[1]


def test_a_video_rendered_among_others_has_its_solo_frames_and_file_bytes(http):
    solo, again, solo_mp4, again_mp4 = _solo_then_among_others(http)
    assert solo["status"] == again["status"] == "completed"
    assert solo["batch_size"] == 1 and again["steps_co_batched"] > 0, "the second render must have shared its steps"
    assert again["frames_sha256"] == solo["frames_sha256"]  # the frames the encoder was given
    assert again["sha256"] == solo["sha256"] and again_mp4 == solo_mp4  # the file itself
    assert hashlib.sha256(solo_mp4).hexdigest() == solo["sha256"]


def test_the_control_with_invariance_off_differs_among_others(http):
    solo, again, _, _ = _solo_then_among_others(http, "/off")
    assert again["steps_co_batched"] > 0 and again["batch_invariant"] is False
    if again["frames_sha256"] == solo["frames_sha256"]:
        pytest.skip(f"measured: on path {VIDEO_PATH} the tiny Wan's co-batched frames equal its solo ones with stock "
                    "kernels (as the audit found on avx2: 0 of 19 runs differ); the invariance check proves nothing here")
    assert again["sha256"] != solo["sha256"]


@pytest.mark.parametrize(
    ("body", "status", "param"),
    [
        ({"prompt": PROMPT}, 400, "seed"),  # the seed contract under invariance
        ({"prompt": PROMPT, "seed": 1.0}, 400, "seed"),  # integers mean integers
        ({"prompt": PROMPT, "seed": 1, "seconds": "0"}, 400, "seconds"),
        ({"prompt": PROMPT, "seed": 1, "seconds": 9}, 400, "num_frames"),  # 73 frames: over max_frames
        ({"prompt": PROMPT, "seed": 1, "seconds": "1", "num_frames": 17}, 400, "num_frames"),  # they disagree
        ({"prompt": PROMPT, "seed": 1, "num_frames": 10}, 400, "num_frames"),  # not 4k + 1 for the Wan VAE
        ({"prompt": PROMPT, "seed": 1, "size": "72x64"}, 400, "width"),  # not whole latent patches
        ({"prompt": PROMPT, "seed": 1, "size": "64"}, 400, "size"),
        ({"prompt": PROMPT, "seed": 1, "model": "sora-2"}, 404, "model"),
        ({"prompt": PROMPT, "seed": 1, "lora": [{"name": "twins"}]}, 400, "lora"),  # an image extension
        ({"prompt": " ", "seed": 1}, 400, "prompt"),
    ],
)
def test_a_bad_video_request_is_a_4xx_naming_the_field_and_makes_no_job(http, body, status, param):
    answer = http.post("/v1/videos", json=body)
    assert answer.status_code == status, answer.text
    assert answer.json()["error"]["param"] == param


def test_the_form_and_the_routes_refuse_what_they_do_not_serve(http):
    reference = http.post("/v1/videos", data={"prompt": PROMPT, "seed": "1"}, files={"input_reference": ("a.png", b"x")})
    assert reference.status_code == 400 and reference.json()["error"]["param"] == "input_reference"
    assert http.post("/v1/videos", content=b"prompt", headers={"Content-Type": "text/plain"}).status_code == 415
    for path in ("/v1/videos/video_unknown", "/v1/videos/video_unknown/content"):
        missing = http.get(path)
        assert missing.status_code == 404 and missing.json()["error"]["param"] == "video_id"
    assert http.delete("/v1/videos/video_unknown").status_code == 404
    assert http.get("/v1/videos").status_code == 405  # no list: a job's id is its only key
    done = _finished(http, _create(http)["id"])
    thumbnail = http.get(f"/v1/videos/{done['id']}/content", params={"variant": "thumbnail"})
    assert thumbnail.status_code == 400 and thumbnail.json()["error"]["param"] == "variant"


def test_a_video_deleted_while_rendering_is_gone_and_the_stage_goes_on(http):
    long = _create(http, num_inference_steps=40)
    assert http.delete(f"/v1/videos/{long['id']}").json() == {"id": long["id"], "object": "video.deleted", "deleted": True}
    assert http.get(f"/v1/videos/{long['id']}").status_code == 404
    unfinished = _create(http, seed=8)
    early = http.get(f"/v1/videos/{unfinished['id']}/content")
    if early.status_code != 200:  # not completed yet: a 400 saying so, naming the video
        assert early.status_code == 400 and early.json()["error"]["code"] == "video_not_ready"
    assert _finished(http, unfinished["id"])["status"] == "completed"


def test_the_served_document_declares_the_video_routes_as_the_server_enforces_them(http):
    document = http.get("/openapi.json").json()
    body = document["paths"]["/v1/videos"]["post"]["requestBody"]["content"]
    assert set(body) == {"application/json", "multipart/form-data"}
    for content in body.values():
        assert "seed" in content["schema"]["required"]  # invariance on: the seed contract
        assert "input_reference" not in content["schema"]["properties"]
    assert {"get", "delete"} <= set(document["paths"]["/v1/videos/{video_id}"])
    assert http.options("/v1/videos/video_unknown").headers["Allow"] == "DELETE, GET"  # every method of the path
    assert "video/mp4" in document["paths"]["/v1/videos/{video_id}/content"]["get"]["responses"]["200"]["content"]


def test_cli_video_shows_progress_and_writes_the_mp4_the_api_serves(server, http, tmp_path, capsys):
    from cli.main import main

    assert main(["video", PROMPT, "--url", server, "--seed", "7", "--size", "64x64", "--no-enhance", "--frames", "9",
                 "--out", str(tmp_path)]) == 0
    out, err = capsys.readouterr()
    path, seed, frames, sha256 = out.strip().split("\t")
    assert (seed, frames) == ("seed=7", "frames=9") and "100% completed" in err
    mp4 = (tmp_path / "video-7.mp4").read_bytes()
    assert path == str(tmp_path / "video-7.mp4") and sha256 == f"sha256={hashlib.sha256(mp4).hexdigest()}"
    same = _finished(http, _create(http)["id"])  # the same request through the API: seed 7, 64x64, 9 frames, as given
    assert http.get(f"/v1/videos/{same['id']}/content").content == mp4
    assert main(["video", PROMPT, "--url", server, "--frames", "10", "--out", str(tmp_path)]) == 1
    assert "HTTP 400" in capsys.readouterr().err


def test_health_reports_the_video_stage_with_its_switch_model_and_replicas(http):
    video = http.get("/health").json()["stages"]["video"]
    assert (video["state"], video["batch_invariant"], video["model"]) == ("running", True, "omniserve/tiny-wan-video")
    assert video["kernels_installed"] is True and video["replicas"]["running"] == 1
    assert video["describe"]["details"]["batching"]["mode"] == "step"
    off = http.get("/off/health").json()["stages"]["video"]
    assert off["batch_invariant"] is False and off["state"] == "running"


# --- a replica killed past half its steps (issue 43) ------------------------------------------------------------------
# Last in the package: they kill the shared apps' video replicas (Serve starts others). "/" takes a checkpoint every
# EVERY steps, "/off" none (the control).
KILLED_STEPS, KILL_AT, EVERY = 48, 50, MAIN["video"]["checkpoint_every"]
#: 25 frames: each step long enough that a poll sees the render between half its steps and its last (with 9, the
#: stock-kernel control's first poll past 50% once read 97%).
KILLED = {"seed": 21, "num_inference_steps": KILLED_STEPS, "num_frames": 25}


def _killed_past_half(http, prefix: str, app: str) -> tuple[dict, list[int], list[int], int]:
    """A job of KILLED_STEPS steps whose video replica (the app's one) is SIGKILLed once its progress is KILL_AT% or
    more, polled to its end: the finished job, its progress polled before the kill (the last when it was killed) and
    after it, and the victim's pid."""
    from tests.reliability.replicas import replica_pids

    (victim,) = replica_pids(app, "VideoStage")
    job = _create(http, prefix, **KILLED)
    before, after = [], []
    deadline = time.monotonic() + TIMEOUT_S
    while (polled := http.get(f"{prefix}/v1/videos/{job['id']}").json())["progress"] < KILL_AT:
        assert polled["status"] in ("queued", "in_progress") and time.monotonic() < deadline, polled
        before.append(polled["progress"])
        time.sleep(0.02)
    assert polled["status"] == "in_progress" and polled["progress"] < 99, polled  # mid-render, not after its last step
    os.kill(victim, signal.SIGKILL)
    before.append(polled["progress"])
    while (polled := http.get(f"{prefix}/v1/videos/{job['id']}").json())["status"] not in ("completed", "failed"):
        assert time.monotonic() < deadline, polled
        after.append(polled["progress"])
        time.sleep(0.02)
    assert polled["status"] == "completed", polled["error"]
    assert victim not in replica_pids(app, "VideoStage")
    return polled, before, after, victim


def _checkpoint_had(progress: int) -> int:
    """The latest checkpoint's step a job polled at `progress`% had surely received: its stream brings step k's
    progress, then its checkpoint, then step k + 1's progress, so a job at step s has every checkpoint before s."""
    step = -(-progress * KILLED_STEPS // 100)  # the fewest steps that show as `progress`
    return (step - 1) // EVERY * EVERY


def test_a_video_whose_replica_is_killed_past_half_its_steps_goes_on_from_its_last_checkpoint_with_the_same_bytes(http):
    from tests.reliability.replicas import runs

    reference = _finished(http, _create(http, **KILLED)["id"])  # uninterrupted
    for run in range(1, runs() + 1):  # each run kills the replica the last one's video finished on
        stats = http.get("/health").json()["ingress"]["video_jobs"]
        started = time.monotonic()
        done, before, after, victim = _killed_past_half(http, "", "main")
        assert (done["sha256"], done["frames_sha256"]) == (reference["sha256"], reference["frames_sha256"]), run
        mp4 = http.get(f"/v1/videos/{done['id']}/content").content
        assert hashlib.sha256(mp4).hexdigest() == reference["sha256"]
        resumed_from, had = done["resumed_from_step"], _checkpoint_had(before[-1])
        # It went on from the last checkpoint its job had when its replica died (none lost on the way), ...
        assert resumed_from is not None and resumed_from % EVERY == 0 and resumed_from >= had >= KILLED_STEPS // 2 - EVERY
        # ... and no client saw its progress fall below that checkpoint's.
        assert after and min(after) >= 100 * resumed_from // KILLED_STEPS, (run, before[-1], resumed_from, after)
        now = http.get("/health").json()["ingress"]["video_jobs"]
        assert now["resumed"] > stats["resumed"] and now["retried"] > stats["retried"], (stats, now)
        print(f"\nrun {run}: video replica {victim} SIGKILLed at {before[-1]}% (polls before: {len(before)}; "
              f"{_checkpoint_had(before[-1])} steps "
              f"checkpointed at least), resumed from step {resumed_from} of {KILLED_STEPS} on {done['replica']}, "
              f"progress after the kill {min(after)}-{max(after)}% over {len(after)} polls, the reference sha256, "
              f"{time.monotonic() - started:.1f} s")


def test_control_without_checkpoints_a_killed_video_starts_again_its_progress_falling_back(http):
    """The same kill on "/off" (checkpoint_every 0): the render starts again at its first step on the new replica, so
    its progress falls below the checkpoint the test above holds it to."""
    done, before, after, _ = _killed_past_half(http, "/off", "off")
    assert done["resumed_from_step"] is None
    assert min(after) < 100 * _checkpoint_had(before[-1]) // KILLED_STEPS, (before[-1], after)
    print(f"\ncontrol: killed at {before[-1]}% after {len(before)} polls, progress after the kill fell to "
          f"{min(after)}% (a resume would have kept {100 * _checkpoint_had(before[-1]) // KILLED_STEPS}%)")
