"""The LLM stage without a running engine: embedded model and its enhancement, engine settings, plugin, audit helpers."""

import functools
import json
import os
import platform
import subprocess
import sys
from pathlib import Path

import pytest

from contracts import LLMSamplingParams, cpu
from contracts.config import LLMStageConfig
from contracts.jobs import final
from contracts.results import Completion, Generation
from evidence.llm import batch_orders
from stages.embedded import EMBEDDED_MODELS, MARKER, embedded_models
from stages.embedded import llm as embedded
from stages.kernels import vllm_cpu
from stages.llm import INVARIANT_CPU_ENGINE_ARGS, LLMEngine, ModelChoice, engine_settings, resolve_model
from stages.llm.engine import DEFAULT_SYSTEM_PROMPT, FreeRewrite, LLMRequests, finished
from stages.llm.self_audit import count_differences
from stages.llm.self_check import NEIGHBOURS

REPO_ROOT = Path(__file__).resolve().parents[2]
CHOICE = ModelChoice("/models/tiny", "embedded:tiny-llama", True)


def settings(batch_invariant, device="cpu", torch_threads=None, **engine_args):
    config = LLMStageConfig(batch_invariant=batch_invariant, device=device, torch_threads=torch_threads, engine_args=engine_args)
    return engine_settings(config, CHOICE)


# --- the embedded model -------------------------------------------------------------------


def test_llm_embedded_build_is_deterministic_across_fresh_cache_roots(tmp_path, monkeypatch):
    built = []
    for root in ("first", "second"):
        monkeypatch.setenv("OMNISERVE_CACHE", str(tmp_path / root))
        built.append(embedded.ensure_tiny_llama())
    first, second = built
    assert first != second
    marks = [json.loads((d / MARKER).read_text()) for d in built]
    assert marks[0]["weights_sha256"] == marks[1]["weights_sha256"] == embedded.weights_fingerprint(first)
    config = json.loads((first / "config.json").read_text())
    # vLLM's CPU attention refuses head_dim 16; 64 is what the embedded models use.
    assert config["architectures"] == ["LlamaForCausalLM"] and config["head_dim"] == 64


def test_llm_embedded_build_is_reused_and_an_unmarked_directory_is_never_trusted(tmp_path, monkeypatch):
    monkeypatch.setenv("OMNISERVE_CACHE", str(tmp_path))
    target = embedded.TINY.directory()
    target.mkdir(parents=True)
    (target / "config.json").write_text("half-written")
    built = embedded.ensure_tiny_llama()
    assert built == target and (built / MARKER).is_file()
    stamp = (built / "model.safetensors").stat().st_mtime_ns
    assert embedded.ensure_tiny_llama() == built
    assert (built / "model.safetensors").stat().st_mtime_ns == stamp
    assert not [p for p in target.parent.iterdir() if p.name.startswith(".")], "temporary build left behind"


def test_llm_embedded_concurrent_first_builds_agree(tmp_path):
    code = "from stages.embedded.llm import ensure_tiny_llama; print(ensure_tiny_llama())"
    env = {**os.environ, "OMNISERVE_CACHE": str(tmp_path)}
    procs = [
        subprocess.Popen([sys.executable, "-c", code], cwd=REPO_ROOT, env=env, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
        for _ in range(2)
    ]
    outputs = [p.communicate(timeout=300) for p in procs]
    assert all(p.returncode == 0 for p in procs), [err[-2000:] for _, err in outputs]
    paths = {out.strip().splitlines()[-1] for out, _ in outputs}
    assert len(paths) == 1 and (Path(paths.pop()) / MARKER).is_file()


def test_llm_embedded_tokenizer_chat_template_and_any_text_round_trip(tmp_path, monkeypatch):
    from transformers import AutoTokenizer

    monkeypatch.setenv("OMNISERVE_CACHE", str(tmp_path))
    tokenizer = AutoTokenizer.from_pretrained(embedded.ensure_tiny_llama())
    text = "a cat, watercolor, soft morning light — ünïcode ✓"
    assert tokenizer.decode(tokenizer(text).input_ids, skip_special_tokens=True) == text
    chat = tokenizer.apply_chat_template([{"role": "user", "content": "hi"}], add_generation_prompt=True, tokenize=False)
    assert chat == "<|begin_of_text|><|user|>hi<|end|><|assistant|>"


def test_llm_style_grammar_accepts_style_phrases_only():
    from xgrammar import Grammar
    from xgrammar.testing import _is_grammar_accept_string

    grammar = Grammar.from_ebnf(embedded.STYLE_GRAMMAR)
    assert _is_grammar_accept_string(grammar, "small, left")
    assert _is_grammar_accept_string(grammar, "large, centered")
    assert not _is_grammar_accept_string(grammar, "small")
    assert not _is_grammar_accept_string(grammar, "large, left, on a blue background")
    assert not _is_grammar_accept_string(grammar, "free text of any kind")


def test_llm_embedded_enhancement_leaves_the_grammar_room_to_finish_and_keeps_the_seed():
    phrases = (f"{s}, {p}" for s in embedded.SIZES for p in embedded.POSITIONS)
    longest = max(phrases, key=lambda phrase: len(phrase.encode()))
    # One byte per token at worst, plus the end of sequence.
    assert embedded.GRAMMAR_MAX_TOKENS > len(longest.encode())
    asked = LLMSamplingParams(seed=5, temperature=0.8, max_tokens=4, min_tokens=2, stop=["."], logprobs=1)
    params, extra = embedded.StyleEnhancement().sampling(asked)
    assert (params.max_tokens, params.min_tokens, params.stop) == (embedded.GRAMMAR_MAX_TOKENS, 0, [])
    assert (params.seed, params.temperature, params.logprobs) == (5, 0.8, 1)
    assert extra["structured_outputs"].grammar == embedded.STYLE_GRAMMAR
    longer = LLMSamplingParams(seed=5, max_tokens=200)
    assert embedded.StyleEnhancement().sampling(longer)[0].max_tokens == 200


def test_llm_embedded_enhancement_puts_the_users_subject_first():
    compose = embedded.StyleEnhancement().compose
    assert compose("  a red fox in the snow. ", "small, left") == "a red fox in the snow, small, left"
    # What the user said stays said: the rewrite fills only the slots the prompt leaves open.
    assert compose("a red circle on a blue background", "small, left") == "a red circle on a blue background, small, left"
    assert compose("a large red circle", "small, top") == "a large red circle, top"
    assert compose("a large red circle, bottom", "small, top") == "a large red circle, bottom"
    # A real model's rewrite replaces the prompt; an empty one keeps it.
    assert FreeRewrite().compose(" a fox ", "a fox at dawn, oil painting") == "a fox at dawn, oil painting"
    assert FreeRewrite().compose(" a fox ", "") == "a fox"


# --- engine settings: where the switch becomes vLLM configuration --------------------------


def test_llm_switch_on_cpu_sets_plugin_environment_and_invariant_engine_args():
    on = settings(True)
    assert on.environment[vllm_cpu.SWITCH_ENV] == "1"
    assert on.environment["VLLM_CPU_ATTN_SPLIT_KV"] == "0"
    for name, (value, _why) in INVARIANT_CPU_ENGINE_ARGS.items():
        assert on.args[name] == value
    assert on.args["worker_extension_cls"].endswith("InvarianceReportExtension")


def test_llm_switch_off_leaves_the_plugin_off_and_vllm_defaults_alone():
    off = settings(False)
    # The one other variable keeps the worker in the engine-core process, switch on or off (stages.llm.settings).
    assert off.environment == {
        vllm_cpu.SWITCH_ENV: "0", "VLLM_ENABLE_V1_MULTIPROCESSING": "0", "VLLM_BATCH_INVARIANT": "0"
    }
    assert "enable_prefix_caching" not in off.args


def test_llm_cpu_never_chunks_prefill_because_vllm_cpu_crashes_on_seeded_chunks():
    assert settings(False).args["enable_chunked_prefill"] is False
    assert settings(True).args["enable_chunked_prefill"] is False


def test_llm_cpu_runs_one_worker_inside_the_engine_core_unless_parallelism_asks_for_more():
    # No worker process busy-waiting beside the engine core on a small CPU box (stages.llm.settings).
    assert settings(True).args["distributed_executor_backend"] == "uni"
    assert settings(False).args["distributed_executor_backend"] == "uni"
    assert "distributed_executor_backend" not in settings(True, tensor_parallel_size=2).args
    assert "distributed_executor_backend" not in settings(True, device="cuda").args
    assert settings(True, distributed_executor_backend="mp").args["distributed_executor_backend"] == "mp"
    # vLLM's CPU platform keeps "uni" only with V1 multiprocessing off (the engine core keeps its own process).
    assert settings(True).environment["VLLM_ENABLE_V1_MULTIPROCESSING"] == "0"
    assert "VLLM_ENABLE_V1_MULTIPROCESSING" not in settings(True, distributed_executor_backend="mp").environment


def test_llm_switch_on_cuda_uses_vllms_own_mode():
    on = settings(True, device="cuda")
    assert on.environment["VLLM_BATCH_INVARIANT"] == "1"
    assert vllm_cpu.SWITCH_ENV not in on.environment
    assert settings(False, device="cuda").environment["VLLM_BATCH_INVARIANT"] == "0"


def test_llm_lora_dir_turns_vllms_lora_path_on_keeping_every_adapter_loaded(tmp_path):
    assert "enable_lora" not in settings(True).args
    for name in ("a", "b", "c", "d", "e"):
        (tmp_path / name).mkdir()
        (tmp_path / name / "adapter_config.json").write_text("{}")
        (tmp_path / name / "adapter_model.safetensors").write_bytes(b"")
    config = LLMStageConfig(batch_invariant=True, lora_dir=str(tmp_path), max_loras=2, max_lora_rank=8)
    args = engine_settings(config, CHOICE).args
    assert (args["enable_lora"], args["max_loras"], args["max_lora_rank"], args["max_cpu_loras"]) == (True, 2, 8, 5)


def test_llm_override_that_breaks_invariance_is_refused():
    name, (value, _why) = next(iter(INVARIANT_CPU_ENGINE_ARGS.items()))
    with pytest.raises(ValueError, match=name):
        settings(True, **{name: not value})
    assert settings(False, **{name: not value}).args[name] == (not value)


def test_llm_kv_cache_is_small_by_default_and_configurable():
    assert settings(False).args["kv_cache_memory_bytes"] == 256 << 20
    assert "gpu_memory_utilization" not in settings(False).args
    config = LLMStageConfig(batch_invariant=False, kv_cache_gib=1.5)
    assert engine_settings(config, CHOICE).args["kv_cache_memory_bytes"] == 3 << 29
    utilization = engine_settings(LLMStageConfig(batch_invariant=False, gpu_memory_utilization=0.5), CHOICE).args
    assert utilization["gpu_memory_utilization"] == 0.5 and "kv_cache_memory_bytes" not in utilization


def test_llm_torch_threads_size_the_workers_openmp_pool_without_core_binding():
    env = settings(True, torch_threads=1).environment
    assert env["OMP_NUM_THREADS"] == "1" and env["VLLM_CPU_OMP_THREADS_BIND"] == "nobind"
    assert "OMP_NUM_THREADS" not in settings(True).environment


def test_llm_engine_settings_come_from_the_config_whole():
    config = LLMStageConfig(batch_invariant=False, dtype="bfloat16", max_model_len=4096, max_num_seqs=3,
                            engine_args={"tensor_parallel_size": 1})
    args = engine_settings(config, CHOICE).args
    assert (args["model"], args["dtype"], args["max_model_len"], args["max_num_seqs"]) == ("/models/tiny", "bfloat16", 4096, 3)
    assert args["max_num_batched_tokens"] == 4096 and args["tensor_parallel_size"] == 1
    with pytest.raises(ValueError, match="resolve the LLM switch"):
        engine_settings(LLMStageConfig(), CHOICE)


def test_llm_model_resolution_embedded_default_and_pass_through(tmp_path, monkeypatch):
    monkeypatch.setenv("OMNISERVE_CACHE", str(tmp_path))
    default = resolve_model(None)  # the trained default: committed, never built into the cache
    assert default.embedded and default.name == "embedded:tiny-rewriter" and Path(default.path).is_dir()
    assert resolve_model("embedded") == resolve_model("embedded:tiny-rewriter") == default
    random_weights = resolve_model("embedded:tiny-llama")  # built from its seed into the cache
    assert random_weights.embedded and Path(random_weights.path).is_relative_to(tmp_path)
    assert resolve_model("org/some-instruct-model") == ModelChoice("org/some-instruct-model", "org/some-instruct-model", False)
    with pytest.raises(ValueError, match="unknown embedded"):
        resolve_model("embedded:nope")


def test_llm_every_embedded_llm_in_the_registry_has_a_recipe():
    ids = embedded_models("llm")
    assert ids[0] == "embedded:tiny-llama" and len(ids) >= 2
    assert all(EMBEDDED_MODELS[i].recipe in embedded.SPECS for i in ids)


# --- the vLLM plugin, inside a fresh process like vLLM's own --------------------------------

_PLUGIN_PROBE = """
import json, os, sys, torch
os.environ["OMNISERVE_VLLM_CPU_INVARIANT"] = sys.argv[1]
from stages.kernels import vllm_cpu
vllm_cpu.register()  # first, as in vLLM's engine core: plugins load before the model's modules import vLLM's ops
from vllm.model_executor.layers import utils
torch.manual_seed(0)
layer = torch.nn.Module()
# The control model's down projection (K = 2816): oneDNN computes one row (a solo decode
# step) differently from two or more, measured on this machine kind.
layer.weight = torch.nn.Parameter(torch.randn(1024, 2816) * 0.02, requires_grad=False)
utils.dispatch_cpu_unquantized_gemm(layer, remove_weight=False)
x = torch.randn(8, 2816)
solo = layer.cpu_linear(x[:1], layer.weight, None)
rows = [layer.cpu_linear(x[:n], layer.weight, None)[:1] for n in range(2, 9)]
print(json.dumps({"equal": all(torch.equal(solo, r) for r in rows), "report": vllm_cpu.process_report()}))
"""


def _probe(switch: str, isa: str | None = None) -> dict:
    """The probe in a fresh interpreter, on this session's kernel path or on `isa` (OMNISERVE_CPU_ISA)."""
    return _probe_on_path(switch, isa or cpu.cpu_isa())


@functools.cache  # one interpreter per switch and path: each imports vLLM (about 10 s on 2 busy cores)
def _probe_on_path(switch: str, isa: str) -> dict:
    env = cpu.path_environment(isa, os.environ)
    done = subprocess.run(
        [sys.executable, "-c", _PLUGIN_PROBE, switch], cwd=REPO_ROOT, capture_output=True, text=True, timeout=300,
        env=env,
    )
    assert done.returncode == 0, done.stderr[-4000:]
    return json.loads(done.stdout.strip().splitlines()[-1])


def test_llm_plugin_reroutes_vllm_cpu_linear_through_the_invariant_kernels():
    on = _probe("1")
    assert on["equal"], "a row's result changed with the number of rows beside it"
    assert on["report"]["gemm_dispatch_patched"] and on["report"]["rerouted_linear_layers"] == 1
    assert on["report"]["kernels"]["installed"] and "aten::mm" in on["report"]["kernels"]["ops"]


def test_llm_plugin_control_stock_vllm_cpu_linear_varies_with_rows_and_is_left_alone():
    off = _probe("0")
    assert not off["report"]["gemm_dispatch_patched"] and not off["report"]["kernels"]["installed"]
    # The control: without the plugin, vLLM's GEMM may give the same row different bits. Whether it does depends
    # on the CPU and the kernel path (oneDNN's kernel choice), so every path this CPU runs is tried; on the first
    # whose control varies, the plugin must make the row's bits equal. Where none varies this proves nothing.
    tried = {}
    for isa in cpu.supported_isas():
        if not _probe("0", isa)["equal"]:
            assert _probe("1", isa)["equal"], f"on the {isa} path the control varies and the plugin did not fix it"
            return
        tried[isa] = "same bits"
    pytest.skip(
        f"measured: stock vLLM CPU linear (K=2816, N=1024, {off['report']['torch_threads']} thread(s)) gave row 0 "
        f"the same bits for 1..8 rows on every path this CPU runs ({tried}), so the control does not vary here"
    )


@pytest.mark.skipif(platform.machine() != "x86_64", reason="vLLM's per-ISA CPU libraries are x86's")
def test_llm_plugin_holds_vllms_own_kernel_library_to_the_kernel_path_switch_on_or_off():
    # vLLM picks its library from the CPU's hardware flags; on an AVX-512 machine held to avx2 it loaded the
    # AVX-512 one and the LLM's golden outputs differed from an AVX2 machine's (0 of 8 matched), measured.
    loaded = {(switch, isa): _probe(switch, isa)["report"]["vllm_library"]
              for isa in cpu.supported_isas() for switch in ("0", "1")}
    assert loaded == {(switch, isa): vllm_cpu.VLLM_LIBRARY[isa] for switch, isa in loaded}


def test_llm_plugin_is_registered_as_a_vllm_general_plugin():
    from importlib.metadata import entry_points

    values = {ep.value for ep in entry_points(group="vllm.general_plugins")}
    assert "stages.kernels.vllm_cpu:register" in values


# --- the engine and its requests, before start -----------------------------------------------


def test_llm_engine_resolves_the_switch_once_and_describes_itself_before_start(clean_switches):
    clean_switches.setenv("OMNI_LLM_BATCH_INVARIANT", "1")
    engine = LLMEngine({"model": "org/some-instruct-model", "torch_threads": 2})
    assert engine.batch_invariant is True and engine.config.batch_invariant is True
    assert engine.settings.args["enforce_eager"] is True
    info = engine.describe()
    assert (info.stage, info.model, info.batch_invariant, info.running, info.kernels) == (
        "llm", "org/some-instruct-model", True, False, []
    )
    assert info.details["model_path"] == "org/some-instruct-model" and not info.details["embedded"]
    assert "model" not in info.details["engine_args"] and info.details["startup_s"] is None
    assert LLMEngine({"model": "org/m", "batch_invariant": False}).batch_invariant is False


@pytest.mark.slow
def test_llm_cpu_engine_switched_on_by_vllms_global_variable_serves_with_our_kernels(clean_switches):
    """VLLM_BATCH_INVARIANT=1, the documented switch for both stages, turns the CPU stage on, and the engine serves:
    vLLM's own mode (CUDA's) stays off in its processes. Before, it was inherited and the engine core's first forward
    failed ("'function' object is not subscriptable"; the engine dead)."""
    import asyncio

    from vllm import SamplingParams

    clean_switches.setenv("VLLM_BATCH_INVARIANT", "1")
    engine = LLMEngine({"torch_threads": 1})
    assert engine.batch_invariant is True and engine.settings.environment["VLLM_BATCH_INVARIANT"] == "0"

    async def served():
        await engine.start()  # checks that every worker installed our kernels
        try:
            return await finished(engine.stream([1, 5, 6, 7], SamplingParams(max_tokens=4, temperature=0.0, seed=1)))
        finally:
            engine.shutdown()

    assert len(asyncio.run(served()).token_ids) == 4


_SOCKETS_PROBE = """
import asyncio, json, os
from pathlib import Path
from stages.llm import LLMEngine

async def main():
    engine = await LLMEngine({"torch_threads": 1, "batch_invariant": False}).start()
    directory = Path(os.environ["VLLM_RPC_BASE_PATH"])
    sockets = sorted(p.name for p in directory.iterdir() if p.is_socket())
    engine.shutdown()
    print(json.dumps({"directory": str(directory), "sockets": sockets}))

asyncio.run(main())
"""


@pytest.mark.slow
def test_llm_engine_sockets_live_in_a_directory_of_its_process_removed_when_it_exits(tmp_path):
    """vLLM names its IPC socket files in VLLM_RPC_BASE_PATH (/tmp by default) and leaves them there: 120 were left in
    /tmp by one run of this suite before. A real engine, started and stopped in a process of its own: its sockets were
    in the process's directory, which is gone once the process exits; a place the user chose is kept."""
    env = {name: value for name, value in os.environ.items() if name != "VLLM_RPC_BASE_PATH"}
    done = subprocess.run([sys.executable, "-c", _SOCKETS_PROBE], cwd=REPO_ROOT, capture_output=True, text=True,
                          timeout=300, env=env)
    assert done.returncode == 0, done.stderr[-4000:]
    seen = json.loads(done.stdout.strip().splitlines()[-1])
    assert Path(seen["directory"]).name.startswith("omniserve-vllm-") and seen["sockets"], seen
    assert not Path(seen["directory"]).exists()
    chosen = tmp_path / "mine"
    chosen.mkdir()
    code = ("import os; from stages.llm.engine import keep_sockets_in_a_directory_of_this_process as keep; keep(); "
            "print(os.environ['VLLM_RPC_BASE_PATH'])")
    said = subprocess.run([sys.executable, "-c", code], cwd=REPO_ROOT, capture_output=True, text=True, timeout=300,
                          env={**env, "VLLM_RPC_BASE_PATH": str(chosen)}, check=True)
    assert said.stdout.strip().splitlines()[-1] == str(chosen) and chosen.is_dir()


def test_llm_requests_on_an_engine_that_is_not_started_are_refused():
    import asyncio

    requests = LLMRequests(LLMEngine(LLMStageConfig(model="org/some-instruct-model", batch_invariant=False)))
    assert requests.system_prompt == DEFAULT_SYSTEM_PROMPT and isinstance(requests.policy, FreeRewrite)
    with pytest.raises(RuntimeError, match="not started"):
        asyncio.run(requests.enhance("a cat", {"seed": 1}))
    with pytest.raises(RuntimeError, match="not started"):
        asyncio.run(final(requests.chat([{"role": "user", "content": "hi"}], {"seed": 1}), Completion))


# --- audit helpers --------------------------------------------------------------------------


def generation(token_ids, top_logprobs) -> Generation:
    return Generation(text="", token_ids=token_ids, logprobs=[], top_logprobs=top_logprobs, finish_reason="stop")


def test_llm_audit_counts_differing_tokens_and_logprobs():
    ref = generation([1, 2], [[(1, -0.5), (3, -1.0)], [(2, -0.25)]])
    same = Generation.model_validate_json(ref.model_dump_json())
    assert count_differences(ref, same) == (0, 0, 5)
    other = generation([1, 4], [[(1, -0.5), (3, -1.0000001)], [(4, -0.25)]])
    assert count_differences(ref, other) == (1, 3, 5)


def test_llm_audit_orders_cover_positions_without_duplicates():
    for size in range(2, 2 + len(NEIGHBOURS)):
        orders = batch_orders(size, ("target-first", "target-last", "target-middle", "shuffled"))
        assert len({tuple(o) for _, o in orders}) == len(orders)
        for _, order in orders:
            assert sorted(order) == [-1, *range(size - 1)]
        positions = {order.index(-1) for _, order in orders}
        assert {0, size - 1} <= positions


def test_vllms_private_batch_invariance_state_is_reset_only_for_a_version_the_adapter_knows(monkeypatch):
    import vllm

    from stages.kernels import vllm_mode

    assert vllm_mode.available() is None and vllm_mode.active() is False
    monkeypatch.setattr(vllm, "__version__", "9.9.9")
    with pytest.raises(vllm_mode.UnknownVLLMError, match="vLLM 9.9.9"):
        vllm_mode.leave()
