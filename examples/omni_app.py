"""The whole app on embedded defaults: `serve run examples.omni_app:app` (what `make serve` runs).

Offline on a 2-core CPU box: tiny real-architecture models built locally, fractional CPUs per replica.
`app_builder` takes Serve builder arguments instead, e.g.
`serve run examples.omni_app:app_builder diffusion.num_replicas=2 diffusion.batch_invariant=true`.
"""

from orchestration import AppConfig, app_builder, build_app

#: The ingress keeps 256 MiB of exact images and of exact chat completions: a repeated request whose stages are
#: invariant and verified is answered byte for byte without a stage call (orchestration/result_cache.py). Videos are
#: served too (`/v1/videos`, the tiny Wan: `video: {}` is the video stage's defaults), on a fifth of a CPU: it is idle
#: until a video is asked for.
app = build_app(
    AppConfig.from_args({"ingress.result_cache_mib": 256, "video": {"ray_actor_options": {"num_cpus": 0.2}}})
)

__all__ = ["app", "app_builder"]
