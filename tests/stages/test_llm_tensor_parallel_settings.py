"""The LLM audit's tensor-parallel engines, as settings (no engine started): `--tensor-parallel 2` reaches vLLM."""

from evidence.llm import audit_config
from stages.llm import ModelChoice, engine_settings

CHOICE = ModelChoice("/models/tiny", "embedded:tiny-rewriter", True)


def test_llm_audit_tensor_parallel_gives_worker_processes_with_their_own_threads():
    single = engine_settings(audit_config(None, "on", dtype="float32", torch_threads=1), CHOICE)
    assert "tensor_parallel_size" not in single.args and single.args["distributed_executor_backend"] == "uni"
    parallel = engine_settings(audit_config(None, "on", dtype="float32", torch_threads=1, tensor_parallel=2), CHOICE)
    # Two workers need worker processes (vLLM's "mp" executor, its choice), each with OMP_NUM_THREADS threads and no
    # automatic core binding (which wants a NUMA node per worker).
    assert parallel.args["tensor_parallel_size"] == 2 and "distributed_executor_backend" not in parallel.args
    env = parallel.environment
    assert env["OMP_NUM_THREADS"] == "1" and env["VLLM_CPU_OMP_THREADS_BIND"] == "nobind"
    assert "VLLM_ENABLE_V1_MULTIPROCESSING" not in env
    assert parallel.args["enforce_eager"] is True and parallel.invariance["batch_invariant"] is True
